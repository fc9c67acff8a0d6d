"""The translator and strict pass reject what the Metal compiler would (or what the emulator
cannot run), naming file:line. Runs translate.py on tests/emulator/shaders/strict_fail/*.metal,
which are deliberately broken and therefore not part of the build. Uses the clang the build's strict
pass ran with (recorded in jax_flash_metal/_build_info.py); skipped when the build found none."""

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
    pytestmark = [
        pytest.mark.skipif(CLANG is None, reason="the build found no clang, so it ran no strict "
                                                 "shader pass (install clang, then reinstall "
                                                 "jax_flash_metal)"),
        # A build copied from another machine (how the suite runs on a GPU machine).
        pytest.mark.skipif(CLANG is not None and not os.path.exists(CLANG),
                           reason=f"the clang the build ran with ({CLANG}) is not here")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRANSLATOR = os.path.join(ROOT, "emulator", "translate.py")
BROKEN = os.path.join(ROOT, "tests", "emulator", "shaders", "strict_fail")


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


def test_rolled_fragment_loop_is_an_error_naming_the_loop():
    rc, err = check("rolled_fragment_loop.metal")
    assert rc != 0
    assert ("rolled_fragment_loop.metal:13: error: loop over 'f' indexes fragment array 'acc' "
            "with it but has no JFM_PRAGMA_UNROLL") in err, err


@pytest.mark.parametrize("edit,needle", [
    # the pragma added: the fixture passes (the unroll pragma is valid before a for loop)
    (lambda lines: lines.__setitem__(12, "  JFM_PRAGMA_UNROLL" + lines[12]), None),
    # a thread_elements() subscript by the loop variable needs it too
    (lambda lines: lines.__setitem__(12, "  JFM_PRAGMA_UNROLL" + lines[12] + "\n"
                                     "  for (int e = 0; e < 2; ++e) "
                                     "acc[0].thread_elements()[e] = 0.0f;"),
     ":14: error: loop over 'e' indexes a fragment's thread_elements() with it"),
    # the pragma anywhere but right before a loop is a strict-pass (clang) error
    (lambda lines: lines.__setitem__(12, "  JFM_PRAGMA_UNROLL" + lines[12] + "\n"
                                     "  JFM_PRAGMA_UNROLL out[0] = 1.0f;"),
     "expected a for, while, or do-while loop to follow '#pragma clang loop'"),
])
def test_fragment_loop_rule_variants(tmp_path, edit, needle):
    with open(os.path.join(BROKEN, "rolled_fragment_loop.metal")) as f:
        lines = f.read().split("\n")
    assert lines[12].startswith("  for (int f = 0; f < 4; ++f) {")
    edit(lines)
    path = tmp_path / "variant.metal"
    path.write_text("\n".join(lines))
    rc, err = translate_check(str(path))
    if needle is None:
        assert rc == 0, err
    else:
        assert rc != 0 and needle in err, err


def test_good_shaders_pass():
    shaders = [os.path.join(ROOT, "tests", "emulator", "shaders", f)
               for f in sorted(os.listdir(os.path.join(ROOT, "tests", "emulator", "shaders")))
               if f.endswith(".metal")]
    assert shaders
    for path in shaders:
        rc, err = translate_check(path)
        assert rc == 0, err
