"""The one place where jax_flash_metal touches JAX internals.

Everything the package needs is public in every supported JAX (0.5.0 through the newest release)
except the abstract value class, which newer releases may move out of ``jax.core``; the fallback to
its private home is kept here so the rest of the package only imports public modules.
"""

try:  # Public in jax 0.5.0 .. 0.12.
    from jax.core import ShapedArray
except ImportError:  # pragma: no cover - future JAX without the public alias
    from jax._src.core import ShapedArray

__all__ = ["ShapedArray"]
