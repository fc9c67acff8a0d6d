"""The translator and strict pass reject what the Metal compiler would (or what the emulator
cannot run), naming file:line. Runs translate.py on tests/shaders/strict_fail/*.metal, which are
deliberately broken and therefore not part of the build. Uses the clang the build's strict pass
ran with (recorded in jax_flash_metal/_build_info.py); skipped when the build found none."""

import os
import subprocess
import sys

import pytest

try:
    from jax_flash_metal._build_info import STRICT_PASS_CLANG as CLANG
except ImportError:  # jax_flash_metal imported from the source tree, not from a build
    CLANG = None
    pytestmark = pytest.mark.skip(reason="jax_flash_metal was imported without a build "
                                         "(no jax_flash_metal/_build_info.py)")
else:
    pytestmark = pytest.mark.skipif(
        CLANG is None, reason="the build found no clang, so it ran no strict shader pass "
                              "(install clang, then reinstall jax_flash_metal)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRANSLATOR = os.path.join(ROOT, "ffi", "emulator", "translate.py")
BROKEN = os.path.join(ROOT, "tests", "shaders", "strict_fail")


def translate_check(path):
    r = subprocess.run([sys.executable, TRANSLATOR, "check", "--input", path, "--cxx", CLANG,
                        "--clang", CLANG], capture_output=True, text=True)
    return r.returncode, r.stderr


def check(name):
    return translate_check(os.path.join(BROKEN, name))


@pytest.mark.parametrize("name,line,phrases", [
    # clang 14 says: cannot initialize a variable of type 'threadgroup float *' with an lvalue of
    # type 'device float *'
    ("address_space.metal", 9, ["cannot initialize", "float *"]),
    ("cxx17.metal", 7, ["constexpr if", "C++17"]),
    ("constant_write.metal", 6, ["read-only"]),
    ("double.metal", 6, ["jfm_double_is_not_supported_in_metal"]),
])
def test_strict_pass_rejects(name, line, phrases):
    rc, err = check(name)
    assert rc != 0
    lines = [x for x in err.splitlines() if f"{name}:{line}:" in x and "error:" in x]
    assert lines, err
    for phrase in phrases:
        assert phrase in lines[0], err


def test_unsupported_attribute_is_an_error_naming_the_line():
    rc, err = check("unsupported_attribute.metal")
    assert rc != 0
    assert "unsupported_attribute.metal:7: error: unsupported kernel parameter attribute " \
           "'quadgroup_index_in_threadgroup'" in err


def test_kernel_in_namespace_is_an_error_naming_the_line():
    rc, err = check("namespace_kernel.metal")
    assert rc != 0
    assert "namespace_kernel.metal:6: error: kernels inside namespaces are not supported" in err


def test_threadgroup_variable_outside_a_kernel_is_an_error():
    rc, err = check("helper_threadgroup.metal")
    assert rc != 0
    assert ("helper_threadgroup.metal:6: error: threadgroup variables can only be declared in "
            "kernel functions") in err


def test_good_shaders_pass():
    shaders = [os.path.join(ROOT, "tests", "shaders", f)
               for f in sorted(os.listdir(os.path.join(ROOT, "tests", "shaders")))
               if f.endswith(".metal")]
    assert shaders
    for path in shaders:
        rc, err = translate_check(path)
        assert rc == 0, err
