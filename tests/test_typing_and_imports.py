"""The installed package is typed (py.typed, return_lse overloads) and importing it loads no
framework integration (Flax, Equinox)."""

import importlib
import importlib.resources
import subprocess
import sys
import textwrap

import pytest


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
