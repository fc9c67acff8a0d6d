"""The one place where jax_flash_metal touches JAX internals.

Everything the package needs is public in every supported JAX (0.5.0 through the newest release)
except the abstract value class, which newer releases may move out of ``jax.core``, the set of
primitives whose lowering needs the device assignment (a ``custom_partitioning`` call inside a
primitive's lowering does: lowering/sharding.py, registered in lowering/primitives.py) and the
loaded cuDNN's version (``cudnn/``); all are kept here so the rest of the package only imports
public modules.
"""

try:  # Public in jax 0.5.0 .. 0.12.
    from jax.core import ShapedArray
except ImportError:  # pragma: no cover - future JAX without the public alias
    from jax._src.core import ShapedArray

# Private in jax 0.5.0 .. 0.12 (JAX's own cuDNN attention registers its primitives the same way).
from jax._src.dispatch import prim_requires_devices_during_lowering



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


__all__ = ["ShapedArray", "cudnn_version", "prim_requires_devices_during_lowering"]
