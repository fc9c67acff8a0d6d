"""jax_flash_metal: fused (flash) attention for JAX with Metal kernels for Apple-silicon GPUs.

``flash_attention`` is the fused primitive pair (forward + FlashAttention-2 backward);
``reference_attention`` is the plain ``jax.numpy`` version with identical semantics;
``dropout_mask`` is the keep mask of their attention dropout.
``implementations.available()`` lists the implementations that can run here; ``devices()`` names
the device behind each, and ``metal_available()`` says whether the Apple GPU path can run.
"""

from . import implementations
from .implementations import devices, metal_available
from .attention import flash_attention
from .dropout import dropout_mask
from .reference import reference_attention

__version__ = "0.1.0"

__all__ = ["flash_attention", "reference_attention", "dropout_mask", "implementations",
           "devices", "metal_available", "__version__"]
