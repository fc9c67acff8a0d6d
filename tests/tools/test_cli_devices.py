"""The programs that run the emulator (selfcheck, tune, profile) compute on the CPU device where
an accelerator is the default device (``tools/cli.emulator_on_the_host``): the emulator is an
FFI call on the host and lowers only for "cpu"."""

import argparse

import jax
import pytest

from jax_flash_metal import implementations
from jax_flash_metal.tools import cli


@pytest.fixture
def restored_default_device():
    saved = jax.config.jax_default_device
    yield
    jax.config.update("jax_default_device", saved)


@pytest.mark.skipif("emulator" not in implementations.available(),
                    reason="the emulator needs the compiled extension")
@pytest.mark.parametrize("backend,name,moved", [("gpu", "emulator", True),
                                                ("gpu", "xla", False),
                                                ("cpu", "emulator", False)])
def test_the_emulator_computes_on_the_host(restored_default_device, monkeypatch, backend, name,
                                           moved):
    jax.config.update("jax_default_device", None)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    cli.check_implementation(argparse.ArgumentParser(), argparse.Namespace(implementation=name))
    assert jax.config.jax_default_device == (jax.devices("cpu")[0] if moved else None)
