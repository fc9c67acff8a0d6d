"""Two processes (jax.distributed on a localhost coordinator, gloo CPU collectives, 2 host
devices each) run the training example's data- and sequence-parallel step (--mesh data=2,sp=2:
batch over "data", ring attention over "sp") and get the single-process, single-device losses."""

import dataclasses
import importlib.util
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from host_devices import environment
from jax_flash_metal import implementations

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("optax", "tqdm")),
    reason="the training example needs the [examples] extra")

STEPS, MAX_BYTES = 2, 1 << 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(implementation, cwd, timeout=300):
    """The outputs of the two processes (each must exit 0 within ``timeout`` seconds)."""
    command = [sys.executable, "-m", "jax_flash_metal.examples.train_lm", "--tiny",
               "--steps", str(STEPS), "--max-bytes", str(MAX_BYTES), "--no-progress",
               "--implementation", implementation, "--mesh", "data=2,sp=2",
               "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    procs = [subprocess.Popen(command + ["--process-id", str(i)], env=environment(2), cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    return outs


@pytest.mark.host  # the one-device run below may be the emulator
def test_two_processes_match_one_device(tmp_path):
    from jax_flash_metal.examples import train_lm

    # The emulator where it exists: its kernels compile in no time (the xla ring: ring_checks).
    implementation = "emulator" if "emulator" in implementations.available() else "xla"
    outs = run_processes(implementation, tmp_path)
    losses = [[float(x) for x in re.search(r"^losses: (.*)$", out, re.M).group(1).split()]
              for out in outs]
    cfg = dataclasses.replace(train_lm.TINY, steps=STEPS)
    data, _ = train_lm.load_text(None, MAX_BYTES)
    _, want = train_lm.train(cfg, train_lm.split(data, cfg.seq_len)[0], implementation,
                             progress=False)
    for got in losses:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
