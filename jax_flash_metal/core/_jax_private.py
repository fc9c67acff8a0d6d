"""The one place where jax_flash_metal touches JAX internals.

Everything the package needs is public in every supported JAX (0.5.0 through the newest release)
except the abstract value class, which newer releases may move out of ``jax.core``, the set of
primitives whose lowering needs the device assignment (a ``custom_partitioning`` call inside a
primitive's lowering does: lowering/sharding.py, registered in lowering/primitives.py) and the
loaded cuDNN's version (``cudnn/``); all are kept here so the rest of the package only imports
public modules. The varying manual axes of ``shard_map``'s type check changed their spelling
across releases (``aval.vma`` and ``jax.lax.pvary``, then ``aval.mat.varying`` and
``jax.lax.pcast``; none on 0.5.0): read and set here too.
"""

import jax

try:  # Public in jax 0.5.0 .. 0.12.
    from jax.core import ShapedArray
except ImportError:  # pragma: no cover - future JAX without the public alias
    from jax._src.core import ShapedArray

# Private in jax 0.5.0 .. 0.12 (JAX's own cuDNN attention registers its primitives the same way).
from jax._src.dispatch import prim_requires_devices_during_lowering


def varying_axes(aval):
    """The varying manual axes of an abstract value inside ``shard_map`` (``aval.vma`` in the
    JAX releases that introduced them, ``aval.mat.varying`` in the newest; none before)."""
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _varying(x):
    return varying_axes(jax.typeof(x)) if hasattr(jax, "typeof") else frozenset()


def _vary(x, axes):
    axes = tuple(sorted(axes - _varying(x), key=str))
    if not axes:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


def vary_like(x, like):
    """``x`` made varying over the manual axes ``like`` varies over and it does not (an array
    built from constants joins per-device data, e.g. a loop's initial carry); x itself on JAX
    without varying manual axes."""
    return _vary(x, _varying(like))


def vary_together(tree):
    """Every array of ``tree`` made varying over the manual axes any of them varies over, so
    a ``custom_vjp`` function's cotangents (of its results, which depend on all of them) have
    its arguments' types; JAX's transpose of the cast sums the cotangents of the arrays that
    did not vary."""
    axes = frozenset().union(*map(_varying, jax.tree_util.tree_leaves(tree)))
    return jax.tree_util.tree_map(lambda x: _vary(x, axes), tree)



def cudnn_version() -> int | None:
    """The loaded cuDNN's version number (e.g. 91900 for 9.19.0), or None without a CUDA jaxlib
    plugin (private in jax 0.5.0 .. 0.12: ``jax._src.lib.cuda_versions``, which jax.nn's cuDNN
    attention reads to the same end)."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:  # pragma: no cover - a future JAX that moved it
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except Exception:  # noqa: BLE001 - the plugin is there but cuDNN did not load
        return None



__all__ = ["ShapedArray", "cudnn_version", "prim_requires_devices_during_lowering",
           "vary_like", "vary_together", "varying_axes"]
