"""jax_flash_metal: fused (flash) attention for JAX with Metal kernels for Apple-silicon GPUs.

``flash_attention`` is the fused primitive pair (forward + FlashAttention-2 backward);
``reference_attention`` is the plain ``jax.numpy`` version with identical semantics.
``implementations.available()`` lists the implementations that can run here; ``devices()`` names
the device behind each, and ``metal_available()`` says whether the Apple GPU path can run.
"""

from . import implementations
from .implementations import devices, metal_available
from .attention import flash_attention
from .reference import reference_attention
from . import sharding  # noqa: F401  (registers the fused lowering's partitioning needs)

__version__ = "0.1.0"

__all__ = ["flash_attention", "reference_attention", "implementations", "devices",
           "metal_available", "__version__"]
