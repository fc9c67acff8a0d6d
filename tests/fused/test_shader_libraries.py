"""The offline compile of every shader library (jax_flash_metal.fused.shader_libraries), which macOS
CI runs with Apple's compiler. Here a stand-in compiler receives exactly the command lines Apple's
would: it preprocesses each written source with clang and its -D macros (the emulator's empty
<metal_*> headers) and records the kernels the library instantiates, which must be exactly the
kernels the host expects in it; one family per source also goes through the emulator's translator
and strict pass with those macros."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from api_helpers import FAMILIES, HEAD_DIMS

ext = pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal.fused import shader_libraries  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STDINC = os.path.join(ROOT, "emulator", "shim", "stdinc")
TRANSLATOR = os.path.join(ROOT, "emulator", "translate.py")
CLANG = shutil.which("clang")
needs_clang = pytest.mark.skipif(CLANG is None, reason="needs clang (apt-get install clang)")

# Stands in for `xcrun -sdk macosx metal`: checks the flags the host's compile options map to,
# preprocesses with the -D macros and writes the kernel names the source defines to -o.
FAKE_METAL = textwrap.dedent("""
    import re, subprocess, sys
    args = sys.argv[1:]
    assert args[:3] == ["-std=metal3.0", "-fno-fast-math", "-Werror"], args
    source, out = args[args.index("-c") + 1], args[args.index("-o") + 1]
    defines = [a for a in args if a.startswith("-D")]
    text = subprocess.run([{clang!r}, "-E", "-x", "c++", "-std=c++14", "-undef", "-nostdinc",
                           "-D__METAL_VERSION__=300", "-isystem", {stdinc!r}, *defines, source],
                          capture_output=True, text=True, check=True).stdout
    # template kernels by their host names; a source without any (the probe) by its kernels
    names = (set(re.findall(r'host_name\\("([A-Za-z0-9_]+)"\\)', text))
             or set(re.findall(r'kernel\\s+void\\s+([A-Za-z0-9_]+)\\s*\\(', text)))
    open(out, "w").write("\\n".join(sorted(names)))
""")
FAKE_METALLIB = "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[3])"


def test_libraries_cover_every_kernel_the_host_runs():
    libraries = shader_libraries.libraries()
    kernels = [k for library in libraries for k in library.kernels]
    assert len(kernels) == len(set(kernels))
    product = {n for n in ext.kernel_names("emulator") if n.startswith("flash_attention_")}
    assert set(kernels) == product | {"jfm_simdgroup_layout_probe"}
    families = {library.family for library in libraries if library.family}
    assert families == {f"{t}_{dk}" if dk == dv else f"{t}_{dk}_v{dv}"
                        for t in ("float", "half", "ushort") for dk, dv in FAMILIES}
    for library in libraries:
        if library.family:
            assert library.macros == {"JFM_ONE_FAMILY": "1",
                                      f"JFM_FAMILY_{library.family}": "JFM_SELECTED"}
        else:
            assert library.macros == {}


def test_one_family_list():
    """shaders/kernel_families.h is the one list of (dtype, key head dim, value head dim)
    families: the host reads it (kernel_families), the kernel list holds every family's kernels
    and nothing else, and the head-dim lists of docs/platforms.md and shaders/README.md say the
    same."""
    assert ext.kernel_families() == [(s, dk, dv) for s in ("f32", "f16", "bf16")
                                     for dk, dv in FAMILIES]
    fwd = {n for n in ext.kernel_names("emulator") if n.startswith("flash_attention_fwd_")}
    assert fwd == {ext.kernel_name(stage, s, dk, dv) for s, dk, dv in ext.kernel_families()
                   for stage in ("fwd", "fwd_var1")}  # every tile variant
    assert ext.kernel_name("fwd", "f16", 128, 64) == "flash_attention_fwd_f16_d128_v64"
    listed = ", ".join(str(d) for d in HEAD_DIMS)
    for readme, line in (("docs/platforms.md", "head dims "), ("shaders/README.md", "- Head dims ")):
        with open(os.path.join(ROOT, readme), encoding="utf-8") as f:
            assert line + listed in f.read(), readme


@needs_clang
def test_offline_compile_command_builds_exactly_each_librarys_kernels(tmp_path):
    metal = tmp_path / "fake_metal.py"
    metal.write_text(FAKE_METAL.format(clang=CLANG, stdinc=STDINC))
    metallib = tmp_path / "fake_metallib.py"
    metallib.write_text(FAKE_METALLIB)
    out = tmp_path / "out"
    rc = shader_libraries.main([str(out), "--metal", f"{sys.executable} {metal}",
                                "--metallib", f"{sys.executable} {metallib}",
                                "--specialise", "half_16", "--jobs", "2"])
    assert rc == 0
    sources = ext.shader_sources()
    for library in shader_libraries.libraries():
        assert (out / f"{library.name}.metal").read_text() == sources[library.file]
        built = (out / f"{library.name}.metallib").read_text().split()
        assert tuple(built) == library.kernels, library.name
        # One compile per function-constant set the host may pick, for the family asked for.
        specialised = sorted(out.glob(f"{library.name}.fc*.metallib"))
        want = library.constant_sets if library.family == "half_16" else ()
        assert len(specialised) == len(want), library.name
        for constants in want:
            built = (out / f"{library.name}.fc{constants}.metallib").read_text().split()
            assert tuple(built) == library.kernels, (library.name, constants)


def test_constant_sets_are_the_subsets_of_the_stages_lists():
    """Per library, the function-constant sets the host may pick (the offline compile's list):
    all 64 for the forward, 16 for the backward, the decode's pass-1 and pass-2 lists."""
    by_file = {}
    for library in shader_libraries.libraries():
        by_file.setdefault(library.file, set()).add(library.constant_sets)
    assert by_file["flash_attention_fwd.metal"] == {tuple(range(64))}
    (bwd,) = by_file["flash_attention_bwd.metal"]
    assert len(bwd) == 16 and max(bwd) == ext.stage_function_constants("bwd_dq")
    (decode,) = by_file["flash_attention_decode.metal"]
    assert len(decode) == 17  # pass 1's 16 subsets and pass 2's sinks alone
    assert by_file["simdgroup_layout_probe.metal"] == {()}


def test_offline_compile_reports_a_failing_compiler(tmp_path, capsys):
    fail = tmp_path / "fail.py"
    fail.write_text("import sys; print('error: nope', file=sys.stderr); sys.exit(1)")
    rc = shader_libraries.main([str(tmp_path / "out"), "--metal", f"{sys.executable} {fail}"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "FAILED: flash_attention_bwd.float_112" in err and "error: nope" in err


@needs_clang
def test_one_family_per_source_passes_the_strict_pass_with_its_macros(tmp_path):
    picked = {}
    for library in shader_libraries.libraries():  # one family per source, varied dtypes
        if library.file not in picked and (not library.family or library.family.endswith("_64")
                                           or library.family == "ushort_16"):
            picked[library.file] = library
    texts = ext.shader_sources()
    for library in picked.values():
        (tmp_path / f"{library.name}.metal").write_text(texts[library.file])
        wrapper = tmp_path / f"check_{library.name.replace('.', '_')}.metal"
        wrapper.write_text("".join(f"#define {n} {v}\n" for n, v in library.macros.items())
                           + f'#include "{library.name}.metal"\n')
        r = subprocess.run([sys.executable, TRANSLATOR, "check", "--input", str(wrapper),
                            "--cxx", CLANG, "--clang", CLANG], capture_output=True, text=True)
        assert r.returncode == 0, (library.name, r.stderr)
