"""The programs that run the emulator (selfcheck, tune, profile) compute on the CPU device where
an accelerator is the default device (``tools/cli.emulator_on_the_host``): the emulator is an
FFI call on the host and lowers only for "cpu"."""

import argparse

import jax
import pytest

from jax_flash_metal import implementations
from jax_flash_metal.tools import cli


@pytest.fixture(autouse=True)
def _host_device_for_the_emulator():
    """These tests set the global default device themselves and get it back: no pin
    (tests/conftest.py's fixture of this name), whose context would hide the setting they
    read."""
    saved = jax.config.jax_default_device
    yield
    jax.config.update("jax_default_device", saved)


@pytest.mark.skipif("emulator" not in implementations.available(),
                    reason="the emulator needs the compiled extension")
@pytest.mark.parametrize("backend,name,moved", [("gpu", "emulator", True),
                                                ("gpu", "xla", False),
                                                ("cpu", "emulator", False)])
def test_the_emulator_computes_on_the_host(monkeypatch, backend, name, moved):
    jax.config.update("jax_default_device", None)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    cli.check_implementation(argparse.ArgumentParser(), argparse.Namespace(implementation=name))
    assert jax.config.jax_default_device == (jax.devices("cpu")[0] if moved else None)


def test_abstract_operands_lower_for_the_default_device():
    """The programs lower abstract shapes (``cli.operand_shape``): they must follow the device
    ``emulator_on_the_host`` chose, which an operand without a sharding would not."""
    cpu = jax.devices("cpu")[0]
    jax.config.update("jax_default_device", cpu)
    spec = cli.operand_shape((2, 3), "bfloat16")
    assert (spec.shape, spec.dtype, spec.sharding.device_set) == ((2, 3), jax.numpy.bfloat16,
                                                                   {cpu})
    assert cli.default_device() == cpu
