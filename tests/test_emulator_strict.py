"""The translator and strict pass reject what the Metal compiler would (or what the emulator
cannot run), naming file:line. Runs translate.py on tests/shaders/strict_fail/*.metal, which are
deliberately broken and therefore not part of the build. Needs clang (installed by .ci/run)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRANSLATOR = os.path.join(ROOT, "ffi", "emulator", "translate.py")
BROKEN = os.path.join(ROOT, "tests", "shaders", "strict_fail")


def check(name):
    clang = shutil.which("clang")
    assert clang, "clang is required for the strict pass (the build needs it too)"
    path = os.path.join(BROKEN, name)
    r = subprocess.run([sys.executable, TRANSLATOR, "check", "--input", path, "--cxx", clang,
                        "--clang", clang], capture_output=True, text=True)
    return r.returncode, r.stderr


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
    clang = shutil.which("clang")
    assert clang
    shaders = [os.path.join(ROOT, "tests", "shaders", f)
               for f in sorted(os.listdir(os.path.join(ROOT, "tests", "shaders")))
               if f.endswith(".metal")]
    assert shaders
    for path in shaders:
        r = subprocess.run([sys.executable, TRANSLATOR, "check", "--input", path, "--cxx", clang,
                            "--clang", clang], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
