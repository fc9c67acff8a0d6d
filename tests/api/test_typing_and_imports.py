"""The installed package is typed (py.typed, return_lse overloads) and importing it loads no
framework integration (Flax, Equinox)."""

import ast
import importlib
import importlib.resources
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_loads_no_framework():
    code = ("import sys, jax_flash_metal; "
            "print(sorted(m for m in ('flax', 'equinox') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd="/")
    assert out.stdout.strip() == "[]"


def test_py_typed_is_installed():
    assert importlib.resources.files("jax_flash_metal").joinpath("py.typed").is_file()


@pytest.mark.slow  # mypy on jax takes tens of seconds
def test_return_type_follows_return_lse(tmp_path, monkeypatch):
    api = pytest.importorskip("mypy.api")
    monkeypatch.chdir(tmp_path)  # the installed package, not the source tree
    (tmp_path / "use.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp
        from jax_flash_metal import flash_attention
        q = jnp.zeros((1, 4, 2, 16))
        reveal_type(flash_attention(q, q, q))
        reveal_type(flash_attention(q, q, q, return_lse=True))
        flash_attention(q, q, q, is_causal="yes")
    """))
    stdout, _, status = api.run(["use.py", "--cache-dir", "cache", "--no-error-summary"])
    lines = stdout.splitlines()
    assert status == 1, stdout  # the one deliberate error
    assert 'use.py:5: note: Revealed type is "jax._src.basearray.Array"' in lines, stdout
    assert ('use.py:6: note: Revealed type is "tuple[jax._src.basearray.Array, '
            'jax._src.basearray.Array]"') in lines, stdout
    assert any(line.startswith("use.py:7: error: No overload variant") for line in lines), stdout


def _keywords(function):
    """[(name, default source or None, annotation source or None)] of a function's parameters
    after the five positional ones (query, key, value, bias, mask), from its source (``ast``)."""
    args = function.args
    assert [a.arg for a in args.args] == ["query", "key", "value", "bias", "mask"]
    defaults = [None] * (len(args.kwonlyargs) - len(args.kw_defaults)) + args.kw_defaults
    return [(a.arg, None if d is None else ast.unparse(d),
             None if a.annotation is None else ast.unparse(a.annotation))
            for a, d in zip(args.kwonlyargs, defaults)]


def _functions(module, name):
    with open(module.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]


def test_the_keywords_are_declared_once():
    """flash_attention's overloads and implementation, reference_attention and the API table of
    docs/api.md name exactly the fields of core.options.Options, in order, with its defaults
    (and, where annotated, its annotations)."""
    from jax_flash_metal import attention, reference
    from jax_flash_metal.core import options

    with open(options.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    declared = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Options")
    fields = [(n.target.id, ast.unparse(n.value), ast.unparse(n.annotation))
              for n in declared.body if isinstance(n, ast.AnnAssign)]
    assert [f[0] for f in fields] == list(options.Options._fields)

    signatures = _functions(attention, "flash_attention")
    # four typing overloads on return_lse and return_residual, and the function
    assert len(signatures) == 5
    for signature in signatures:
        got = _keywords(signature)
        assert [g[0] for g in got] == [f[0] for f in fields]
        # return_lse's and return_residual's defaults and annotations are what each overload
        # is about.
        assert got[:-2] == fields[:-2]
    assert _keywords(signatures[-1])[-2:] == fields[-2:]

    reference_keywords = _keywords(_functions(reference, "reference_attention")[0])
    assert ([(name, default) for name, default, _ in reference_keywords]
            == [(name, default) for name, default, _ in fields
                if name not in options.NOT_IN_REFERENCE])

    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
        table = f.read().split("## Keywords", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, flags=re.M)
    assert rows == [(name, default) for name, default, _ in fields]


@pytest.mark.parametrize("module,missing,extra", [
    ("jax_flash_metal.flax", "flax", "flax"),
    ("jax_flash_metal.equinox", "equinox", "equinox"),
    ("jax_flash_metal.examples.train_lm", "optax", "examples"),
    ("jax_flash_metal.examples.train_flax", "tqdm", "examples"),
])
def test_missing_optional_dependency_names_the_extra(monkeypatch, module, missing, extra):
    for name in [m for m in sys.modules if m.startswith(missing + ".")]:
        monkeypatch.delitem(sys.modules, name)  # an imported submodule would still load
    monkeypatch.setitem(sys.modules, missing, None)  # import of `missing` now fails
    for name in ("jax_flash_metal.flax", "jax_flash_metal.equinox",
                 "jax_flash_metal.examples.train_lm", "jax_flash_metal.examples.train_flax"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match=rf'needs {missing}, .* pip install "\.\[{extra}\]"'):
        importlib.import_module(module)
