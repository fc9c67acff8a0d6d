"""The shader libraries the Metal device compiles, and their offline compile with Apple's tools.

The Metal device compiles the embedded ``shaders/*.metal`` sources (quoted includes inlined,
``_ext.shader_sources()``) at run time, one library per (source file, element type, head dim)
family, selected by preprocessor macros (``_ext.shader_library``: the host's own rule). This
module lists those libraries exactly as the host builds them and compiles each with Apple's
offline compiler, which needs no GPU (macOS CI runs it on a virtual machine whose GPU cannot run
the kernels)::

    python -m jax_flash_metal.fused.shader_libraries OUT [--metal CMD] [--metallib CMD]
        [--specialise FAMILY ...] [--jobs N]

writes ``OUT/<library>.metal`` (the embedded source, byte for byte) and runs, for each,
``CMD -std=metal3.0 -fno-fast-math -Werror -DNAME=VALUE... -c SRC -o AIR`` then
``METALLIB AIR -o LIB``: the host's language version, its IEEE math (``fastMathEnabled = NO``,
``mathMode = safe`` on macOS 15) and its macros (``MTLCompileOptions.preprocessorMacros``).
The kernels' function constants (shaders/function_constants.h) stay unresolved there, as in the
library the host compiles. Each library is then compiled once more per function-constant set
the host may pick for its kernels (``Library.constant_sets``), with ``-DJFM_SPECIALISED=SET``,
which makes the constants those literals: the code a pipeline specialised with that set keeps.
``--specialise`` limits these compiles to the named families ("half_128"; "all": every family;
default "all"), run N at a time (``--jobs``, default 1). CMD defaults to
``xcrun -sdk macosx metal``, METALLIB to ``xcrun -sdk macosx metallib``. Exit status 1 when any compile fails; the failures are printed
with the compiler's messages.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import os
import re
import shlex
import subprocess
import sys

import jax_flash_metal._ext as _ext


@dataclasses.dataclass(frozen=True)
class Library:
    """One library the Metal device compiles.

    file: the embedded source's name ("flash_attention_fwd.metal"); family: "half_64" (element
    type, head dim), or "" for a whole source (the self-check's probe); macros: the preprocessor
    macros {name: value} the host passes; kernels: the kernel names it must define, sorted.
    """

    file: str
    family: str
    macros: dict[str, str]
    kernels: tuple[str, ...]

    @property
    def name(self) -> str:
        """A file-name stem: "flash_attention_fwd.half_64" ("flash_attention_fwd" for a whole
        source)."""
        stem = self.file.removesuffix(".metal")
        return f"{stem}.{self.family}" if self.family else stem

    def compile_flags(self) -> list[str]:
        """The Metal compiler's flags for the host's compile options of this library."""
        return ["-std=metal3.0", "-fno-fast-math", "-Werror",
                *(f"-D{name}={value}" for name, value in self.macros.items())]

    @property
    def constant_sets(self) -> tuple[int, ...]:
        """The function-constant sets the host may pick for this library's kernels, sorted: the
        subsets of each kernel's stage list (``_ext.stage_function_constants``); () for a
        library without attention kernels."""
        sets: set[int] = set()
        for kernel in self.kernels:
            stage = _STAGE.match(kernel)
            mask = _ext.stage_function_constants(stage.group(1)) if stage else 0
            bits = [1 << n for n in range(mask.bit_length()) if mask >> n & 1]
            sets.update(sum(c) for r in range(len(bits) + 1)
                        for c in itertools.combinations(bits, r))
        return tuple(sorted(sets)) if any(sets) else ()


_STAGE = re.compile(r"flash_attention_(.+)_(?:f32|f16|bf16)_d")


def libraries() -> list[Library]:
    """Every library the Metal device can compile, sorted by name, each with the kernels it
    holds: the build's kernel names (``_ext.kernel_names("emulator")``, the same shaders
    translated for the emulator) that an embedded source defines, grouped by
    ``_ext.shader_library``."""
    groups: dict[tuple[str, str], tuple[dict[str, str], list[str]]] = {}
    for kernel in _ext.kernel_names("emulator"):
        try:
            info = _ext.shader_library(kernel)
        except ValueError:  # one of the emulator's own test kernels (tests/emulator/shaders)
            continue
        groups.setdefault((info["file"], info["family"]), (info["macros"], []))[1].append(kernel)
    found = [Library(file, family, macros, tuple(sorted(kernels)))
             for (file, family), (macros, kernels) in groups.items()]
    return sorted(found, key=lambda library: library.name)


def write_sources(out: str) -> list[tuple[Library, str]]:
    """Writes each library's source to ``out/<name>.metal``; returns (library, path) pairs."""
    os.makedirs(out, exist_ok=True)
    texts = _ext.shader_sources()
    written = []
    for library in libraries():
        path = os.path.join(out, library.name + ".metal")
        with open(path, "w", encoding="utf-8") as f:
            f.write(texts[library.file])
        written.append((library, path))
    return written


def _compile(name: str, source: str, flags: list[str], metal: list[str],
             metallib: list[str]) -> str:
    """Compiles and links one source; "" or the failure's message."""
    air = os.path.join(os.path.dirname(source), name + ".air")
    for command in ([*metal, *flags, "-c", source, "-o", air],
                    [*metallib, air, "-o", air.removesuffix(".air") + ".metallib"]):
        r = subprocess.run(command, capture_output=True, text=True)
        if r.returncode != 0:
            return f"{name}: {shlex.join(command)}\n{(r.stderr or r.stdout).strip()}"
    return ""


def compile_all(out: str, metal: list[str], metallib: list[str],
                specialise: tuple[str, ...] = ("all",), jobs: int = 1) -> list[str]:
    """Writes and compiles every library into ``out`` (.metal, .air, .metallib), then each
    library of a family in ``specialise`` ("all": every family) once per constant set
    (``<library>.fc<set>.metallib``), ``jobs`` compiles at a time; returns one message per
    failed compile (empty when all compiled)."""
    work: list[tuple[str, str, list[str], int]] = []  # (name, source, flags, kernels)
    for library, source in write_sources(out):
        n = len(library.kernels)
        work.append((library.name, source, library.compile_flags(), n))
        if "all" in specialise or library.family in specialise:
            work += [(f"{library.name}.fc{c}", source,
                      [*library.compile_flags(), f"-DJFM_SPECIALISED={c}"], n)
                     for c in library.constant_sets]
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        results = list(pool.map(lambda w: _compile(w[0], w[1], w[2], metal, metallib), work))
    for (name, _, _, n), failure in zip(work, results):
        if not failure:  # tools.cli.count is a layer above fused/
            print(f"ok: {name} ({n} kernel{'' if n == 1 else 's'})")
    return [failure for failure in results if failure]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_flash_metal.fused.shader_libraries",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder for the sources, .air and .metallib files")
    p.add_argument("--metal", default="xcrun -sdk macosx metal",
                   help="the Metal compiler command (default: %(default)s)")
    p.add_argument("--metallib", default="xcrun -sdk macosx metallib",
                   help="the Metal library linker command (default: %(default)s)")
    p.add_argument("--specialise", nargs="+", default=["all"], metavar="FAMILY",
                   help="families compiled per function-constant set ('half_128', ...; "
                        "default: all)")
    p.add_argument("--jobs", type=int, default=1, help="compiles run at a time (default: 1)")
    args = p.parse_args(argv)
    failures = compile_all(args.out, shlex.split(args.metal), shlex.split(args.metallib),
                           tuple(args.specialise), args.jobs)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
