"""Shared fixtures: every API test runs once per implementation available here.

"xla" runs everywhere; "emulator"/"metal" join automatically when jax_flash_metal reports them.
Tests marked ``large`` (big shapes, long matrices) run only on "xla" unless
JFM_TEST_LARGE_ON_ALL=1, because the emulator is slow; ``slow`` tests are left out of the short
jax 0.5.0 CI run. ``quick`` marks the tests of QUICK_FILES (not ``slow``): ``pytest -n 2 -m
quick``, about a minute, checks that an install works (README).
"""

import os
import sys

import pytest

# The helpers every test folder shares (oracle, tolerances, inputs) are imported by name.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))

# The suite compiles hundreds of small XLA programs and LLVM's optimisation passes dominate that
# time; they do not change float semantics (XLA:CPU does not use fast-math), so turn them down.
# Must happen before JAX creates its CPU backend.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS"),
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"]))

# Child processes (tests that run Python elsewhere, e.g. cwd="/") import the same package as
# this one: a relative PYTHONPATH (PYTHONPATH=. over a source tree) would name another folder.
if os.environ.get("PYTHONPATH"):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        os.path.abspath(p) for p in os.environ["PYTHONPATH"].split(os.pathsep) if p)

# The autotuner (docs/tuning.md) would time every new call's variants on a Mac and write the
# user's cache; the suite checks variants against the oracle instead (tests/lowering/
# test_autotune.py turns tuning on for itself).
os.environ.setdefault("JFM_AUTOTUNE", "0")

import jax  # noqa: E402

import jax_flash_metal  # noqa: E402
from api_helpers import use_xla_schedule  # noqa: E402
from jax_flash_metal.xla import schedule as xla_schedule  # noqa: E402

# The package and its extension, argument checking, and both implementations (xla, emulator)
# against the oracle on small shapes: forward, backward, decode.
QUICK_FILES = {"test_packaging.py", "test_typing_and_imports.py", "test_errors.py",
               "test_array_likes.py", "test_emulator.py", "test_decode.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "large: big case; run on the fused implementations only "
                                       "when JFM_TEST_LARGE_ON_ALL=1")
    config.addinivalue_line("markers", "slow: left out of the short CI run (-m 'not slow')")
    config.addinivalue_line("markers", "quick: the minute's install check (-m quick; "
                                       "QUICK_FILES in conftest.py)")
    config.addinivalue_line("markers", "emulator: names the emulator (api_helpers.needs_emulator)"
                                       "; skipped without the extension, run on the CPU device")
    config.addinivalue_line("markers", "host: run on the CPU device (lowers for the emulator "
                                       "where it is available)")


def pytest_generate_tests(metafunc):
    if "implementation" in metafunc.fixturenames:
        metafunc.parametrize("implementation", jax_flash_metal.implementations.available())


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the tests of QUICK_FILES ``quick`` (unless ``slow``); skip those marked
    ``emulator`` where it is not available; deselect ``large`` cases (marked on the test or on
    one parameter) for the fused implementations, unless JFM_TEST_LARGE_ON_ALL=1."""
    without_emulator = "emulator" not in jax_flash_metal.implementations.available()
    for item in items:
        if item.path.name in QUICK_FILES and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.quick)
        if without_emulator and item.get_closest_marker("emulator"):
            item.add_marker(pytest.mark.skip(reason="the emulator needs the compiled extension"))
    if os.environ.get("JFM_TEST_LARGE_ON_ALL") == "1":
        return
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        implementation = callspec.params.get("implementation") if callspec else None
        fused = implementation not in (None, "xla")
        (drop if fused and item.get_closest_marker("large") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# The xla implementation's paths: one dense tile (this platform's schedule), the accelerators'
# dense tile (half-precision operands, one-pass row statistics), blocks of 4 rows x 4 keys.
PATHS = {"dense": None,
         "dense-accelerator": xla_schedule.Schedule(dense_max_len=64, block_q=64, block_k=64,
                                                    half_operands=True,
                                                    one_pass_statistics=True),
         "blocks": xla_schedule.Schedule(dense_max_len=4, block_q=4, block_k=4)}


@pytest.fixture(params=list(PATHS))
def blocks(request, monkeypatch):
    """Every path of the xla implementation (PATHS), for the tests that take it."""
    if PATHS[request.param] is None:
        yield request.param
    else:
        use_xla_schedule(monkeypatch, PATHS[request.param])
        yield request.param
        jax.clear_caches()


# The emulator is an FFI call on the host: where the default device is an accelerator (a GPU
# machine), the tests that run it take the CPU device as their default device, and the rest
# run on the accelerator.
HOST_FOLDERS = {"emulator", "fused"}


def _runs_on_the_host(item) -> bool:
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec else ()
    return (item.path.parent.name in HOST_FOLDERS
            or any(item.get_closest_marker(m) is not None for m in ("emulator", "host"))
            or any(isinstance(p, str) and p == "emulator" for p in params))


@pytest.fixture(autouse=True)
def _host_device_for_the_emulator(request):
    # The programs some tests run move the global default device (tools/cli.py's
    # emulator_on_the_host); the tests after them get it back.
    saved = jax.config.jax_default_device
    if jax.default_backend() == "cpu" or not _runs_on_the_host(request.node):
        yield
    else:
        try:
            cpu = jax.devices("cpu")[0]
        except RuntimeError:  # JAX_PLATFORMS names the accelerator only
            pytest.skip("runs the emulator, on the CPU device, which JAX_PLATFORMS leaves out")
        with jax.default_device(cpu):
            yield
    if jax.config.jax_default_device is not saved:
        jax.config.update("jax_default_device", saved)


@pytest.fixture(autouse=True, scope="session")
def _full_precision_references():
    """On an accelerator, float32 matmuls that name no precision (jax.nn's, Flax's and Equinox's,
    the references some tests compare with) run at full precision, not TF32 as an NVIDIA GPU's
    default would; the xla implementation names its own (tests/xla/test_precision.py)."""
    if jax.default_backend() == "cpu":
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield
