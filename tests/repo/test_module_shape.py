"""The shape of the code: module and function sizes, no relay modules, and every public import
path and command-line program of the package.

- No module of ``jax_flash_metal/`` is over LINES_PER_MODULE lines except those of LONG_MODULES
  (each with the reason); no function of the native code (``ffi/`` and ``emulator/``) is over
  LINES_PER_FUNCTION lines except those of LONG_FUNCTIONS.
- No relay: no module imports a name of the package only to hand it on to the package again
  (every use of the name an argument of a call of a package function), outside
  ``__init__.py``, whose re-exports are the public API.
- The public import paths and ``python -m`` programs of docs/api.md keep working.
"""

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "jax_flash_metal")

LINES_PER_MODULE = 400
LONG_MODULES = {
    "xla/blocks.py": "one job: the block grid (layouts, features per block, the two loops)",
    "ring_attention.py": "one job: the ring's block schedule, forward and backward",
    "examples/train_lm.py": "one runnable example, read top to bottom",
    "selfcheck.py": "one job: the self-check's steps in order, each a short function",
}
LINES_PER_FUNCTION = 80
NATIVE_FOLDERS = ("ffi", "emulator")
LONG_FUNCTIONS: dict[tuple[str, str], str] = {}

PUBLIC_MODULES = ["jax_flash_metal", "jax_flash_metal.attention", "jax_flash_metal.reference",
                  "jax_flash_metal.ring_attention", "jax_flash_metal.dropout",
                  "jax_flash_metal.paging", "jax_flash_metal.implementations",
                  "jax_flash_metal.flax", "jax_flash_metal.equinox", "jax_flash_metal.tune"]
PUBLIC_NAMES = {"jax_flash_metal": ["flash_attention", "reference_attention", "dropout_mask",
                                    "devices", "metal_available", "implementations",
                                    "__version__"],
                "jax_flash_metal.implementations": ["available", "devices", "metal_available",
                                                    "unavailable_reasons"],
                "jax_flash_metal.ring_attention": ["stripe", "unstripe", "shard_map"],
                "jax_flash_metal.paging": ["gather", "logical_len"],
                "jax_flash_metal.flax": ["attention_fn"],
                "jax_flash_metal.equinox": ["MultiheadAttention"],
                "jax_flash_metal.tune": ["configure", "tune", "tune_function"]}
PROGRAMS = ["jax_flash_metal.benchmark", "jax_flash_metal.profile", "jax_flash_metal.selfcheck",
            "jax_flash_metal.tune",
            "jax_flash_metal.fused.shader_libraries", "jax_flash_metal.examples.train_lm",
            "jax_flash_metal.examples.train_flax"]


def package_files():
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, PACKAGE).replace(os.sep, "/"), path


def test_module_sizes():
    sizes = {}
    for name, path in package_files():
        with open(path, encoding="utf-8") as f:
            sizes[name] = sum(1 for _ in f)
    long = sorted(n for n, size in sizes.items() if size > LINES_PER_MODULE)
    assert long == sorted(n for n in LONG_MODULES if sizes.get(n, 0) > LINES_PER_MODULE), (
        {n: sizes[n] for n in long})


def ffi_functions(path):
    """(name, lines) of every function defined at the top level of a C++ file (a line at column
    0 that opens a parameter list and, at the end of the signature, a body)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    found, i = [], 0
    while i < len(lines):
        match = re.match(r"^[A-Za-z_][\w:<>,\s\*&]*?\b(\w+)\(", lines[i])
        if match and not lines[i].rstrip().endswith(";"):
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith(("{", ";")):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{"):
                end = next(k for k in range(j + 1, len(lines)) if lines[k].startswith("}"))
                found.append((match.group(1), end - i + 1))
                i = end
        i += 1
    return found


def test_ffi_function_sizes():
    long = {}
    for folder in NATIVE_FOLDERS:
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith((".cc", ".mm", ".h")):
                for function, size in ffi_functions(os.path.join(ROOT, folder, name)):
                    if size > LINES_PER_FUNCTION:
                        long[(f"{folder}/{name}", function)] = size
    assert sorted(long) == sorted(LONG_FUNCTIONS), long


def _root(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _relayed_names(path):
    """Names imported from the package whose every use is as an argument of a call of a name
    imported from the package."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                "jax_flash_metal")):
            imported |= {a.asname or a.name for a in node.names}
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in imported:
            parent = parents[node]
            if isinstance(parent, ast.Tuple):  # (fwd_p, bwd_p) handed on together
                parent = parents[parent]
            if isinstance(parent, ast.keyword):
                parent = parents[parent]
            passed = (isinstance(parent, ast.Call) and node is not parent.func
                      and _root(parent.func) in imported)
            uses.setdefault(node.id, []).append(passed)
    return sorted(n for n, passed in uses.items() if all(passed))


def test_no_relay():
    relays = {name: _relayed_names(path) for name, path in package_files()
              if not name.endswith("__init__.py")}
    assert {n: r for n, r in relays.items() if r} == {}


def test_public_import_paths_and_programs():
    """Each public module and name imports, and each program answers --help, in one fresh
    process (the installed package, as a user has it)."""
    code = f"""
import importlib, runpy, sys
for name in {PUBLIC_MODULES!r}:
    importlib.import_module(name)
for module, names in {PUBLIC_NAMES!r}.items():
    for name in names:
        getattr(importlib.import_module(module), name)
for program in {PROGRAMS!r}:
    sys.argv = [program, "--help"]
    try:
        runpy.run_module(program, run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), (program, e.code)
    else:
        raise AssertionError(program + " --help did not exit")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
