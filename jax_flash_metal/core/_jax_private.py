"""The one place where jax_flash_metal touches JAX internals.

Everything the package needs is public in every supported JAX (0.5.0 through the newest release)
except the abstract value class, which newer releases may move out of ``jax.core``, and the set of
primitives whose lowering needs the device assignment (a ``custom_partitioning`` call inside a
primitive's lowering does: lowering/sharding.py, registered in lowering/primitives.py); both are
kept here so the rest of the package only imports public modules.
"""

try:  # Public in jax 0.5.0 .. 0.12.
    from jax.core import ShapedArray
except ImportError:  # pragma: no cover - future JAX without the public alias
    from jax._src.core import ShapedArray

# Private in jax 0.5.0 .. 0.12 (JAX's own cuDNN attention registers its primitives the same way).
from jax._src.dispatch import prim_requires_devices_during_lowering

__all__ = ["ShapedArray", "prim_requires_devices_during_lowering"]
