"""The installed build is the wheel pyproject.toml asks for: on CPython >= 3.12 a stable-ABI
(abi3) wheel tagged cp312-abi3 whose extension is named *.abi3.so; below 3.12 a wheel for this
interpreter version only. (.ci/run also scans the abi3 extension's symbols with abi3audit.)"""

import importlib.metadata
import importlib.util
import os
import re
import sys
import sysconfig

import pytest

import jax_flash_metal

EXT = importlib.util.find_spec("jax_flash_metal._ext")
try:
    importlib.metadata.distribution("jax_flash_metal")
    INSTALLED = True
except importlib.metadata.PackageNotFoundError:
    INSTALLED = False
needs_install = pytest.mark.skipif(not INSTALLED, reason="jax_flash_metal is imported from a "
                                                         "source tree with no installed "
                                                         "distribution (no wheel metadata)")
pytestmark = pytest.mark.skipif(EXT is None, reason="jax_flash_metal has no compiled extension "
                                                    "here (imported from the source tree)")


def wheel_tags():
    wheel = importlib.metadata.distribution("jax_flash_metal").read_text("WHEEL")
    return [line.split(":", 1)[1].strip() for line in wheel.splitlines()
            if line.startswith("Tag:")]


@needs_install
def test_wheel_tag_and_extension_name_match_the_interpreter():
    tags = wheel_tags()
    assert tags
    version = f"cp3{sys.version_info.minor}"
    if sys.implementation.name == "cpython" and sys.version_info >= (3, 12):
        assert all(t.startswith("cp312-abi3-") for t in tags), tags
        assert EXT.origin.endswith(".abi3" + sysconfig.get_config_var("SHLIB_SUFFIX")), EXT.origin
    else:
        assert all(t.startswith(f"{version}-{version}-") for t in tags), tags
        assert EXT.origin.endswith(sysconfig.get_config_var("EXT_SUFFIX")), EXT.origin


@needs_install
def test_version_is_the_distribution_version():
    assert jax_flash_metal.__version__ == importlib.metadata.version("jax_flash_metal")


def test_test_kernels_are_in_the_extension_only_when_the_build_says_so():
    """Wheels are built with JFM_TEST_KERNELS=OFF (pyproject.toml): no kernel of
    tests/emulator/shaders may then be in the extension; a source install has them."""
    from jax_flash_metal import _build_info
    from jax_flash_metal._ext import emulator

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "emulator", "shaders")
    names = set()
    for name in os.listdir(folder):
        if name.endswith(".metal"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                names |= set(re.findall(r"\bkernel\s+void\s+(\w+)", f.read()))
    assert names
    present = names & set(emulator.kernel_names())
    if _build_info.TEST_KERNELS:
        assert present
    else:
        assert present == set(), sorted(present)
