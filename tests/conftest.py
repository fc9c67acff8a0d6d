"""Shared fixtures: every API test runs once per implementation available here.

"xla" runs everywhere; "emulator"/"metal" join automatically when jax_flash_metal reports them.
Tests marked ``large`` (big shapes, long matrices) run only on "xla" unless
JFM_TEST_LARGE_ON_ALL=1, because the emulator is slow; ``slow`` tests are left out of the short
jax 0.5.0 CI run.
"""

import os

# The suite compiles hundreds of small XLA programs and LLVM's optimisation passes dominate that
# time; they do not change float semantics (XLA:CPU does not use fast-math), so turn them down.
# Must happen before JAX creates its CPU backend.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS"),
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"]))

import jax_flash_metal  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "large: big case; run on the fused implementations only "
                                       "when JFM_TEST_LARGE_ON_ALL=1")
    config.addinivalue_line("markers", "slow: left out of the short CI run (-m 'not slow')")


def pytest_generate_tests(metafunc):
    if "implementation" not in metafunc.fixturenames:
        return
    names = jax_flash_metal.implementations.available()
    if metafunc.definition.get_closest_marker("large") and os.environ.get(
            "JFM_TEST_LARGE_ON_ALL") != "1":
        names = ["xla"]
    metafunc.parametrize("implementation", names)
