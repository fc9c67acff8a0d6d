"""Runs a test script in a fresh Python process with several host (CPU) devices.

The device count (``--xla_force_host_platform_device_count``) is fixed when JAX creates its CPU
backend, so multi-device checks run in a subprocess and leave the device count of the test
process (and of pytest-xdist workers) as it is.
"""

import os
import subprocess
import sys

import jax_flash_metal

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(jax_flash_metal.__file__)))


def environment(devices, **extra):
    """os.environ for a child that imports this jax_flash_metal and the tests' helpers, with
    ``devices`` host devices as its only devices (JAX_PLATFORMS=cpu, also where a GPU is the
    default backend; None: leave XLA_FLAGS and the platforms as they are)."""
    env = dict(os.environ, **extra)
    if devices is not None:
        env["XLA_FLAGS"] = " ".join(filter(None, [
            env.get("XLA_FLAGS"), f"--xla_force_host_platform_device_count={devices}"]))
        env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [PACKAGE_PARENT, HERE, env.get("PYTHONPATH")]))
    return env


def run_script(script, *args, devices=8, timeout=300):
    """Run ``script`` (a path under tests/) with ``args``; fail with its output when it exits
    non-zero."""
    proc = subprocess.run([sys.executable, os.path.join(TESTS, script), *map(str, args)],
                          env=environment(devices), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout
