"""Kernel variants: the tile/register strategy the fused kernels run
(docs/kernels.md#kernel-variants).

The forward's tiles (the forward and decode pass 1) and the backward's come in several variants
(``shaders/tile_shapes.h``); the extension lists a family's distinct ones
(``_ext.kernel_variants(stage, dtype, head_dim)``) and the FFI takes the chosen one as the
``kernel_variant`` attribute (the primitive's static ``kernel_variant``). Variant 0 is the
default; ``$JFM_KERNEL_VARIANT`` forces another for every call traced while it is set (tests,
timing a variant by hand). The xla implementation has no kernel variants and ignores it.
"""

from __future__ import annotations

import os

ENV = "JFM_KERNEL_VARIANT"


def from_env() -> int:
    """The variant ``$JFM_KERNEL_VARIANT`` forces, read when a call is traced: 0 when unset or
    empty. Raises ValueError naming the variable for anything but a non-negative integer; the
    lowering refuses one past the kernels' variants (``_ext.tile_variants``)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"{ENV} must be a non-negative integer (a kernel variant), "
                         f"got {value!r}")
    return int(value)
