"""Kernel variants: the tile/register strategy the fused kernels run, and whether the autotuner
picks it (docs/kernels.md#kernel-variants, docs/tuning.md).

The forward's tiles (the forward and decode pass 1) and the backward's come in several variants
(``shaders/tile_shapes.h``); the extension lists a family's distinct ones
(``_ext.kernel_variants(stage, dtype, head_dim)``) and the FFI takes the chosen one as the
``kernel_variant`` attribute (the primitive's static ``kernel_variant``). A call is traced with
the variant forced by ``configure(variant=...)`` (``jax_flash_metal.tune.configure``), else by
``$JFM_KERNEL_VARIANT``, else ``AUTO``: the lowering then asks the autotuner where tuning is on
(``autotune_enabled``) and takes variant 0 where it is off. The xla implementation has no kernel
variants and ignores the parameter.
"""

from __future__ import annotations

import numbers
import os

ENV = "JFM_KERNEL_VARIANT"
AUTOTUNE_ENV = "JFM_AUTOTUNE"
AUTO = -1  # the static kernel_variant of a call whose variant the lowering chooses
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# configure()'s settings; None: not set (the environment decides).
_settings: dict[str, object] = {"variant": None, "autotune": None}


def configure(*, variant: int | None = None, autotune: bool | None = None) -> None:
    """Set the process's choice (both settings; an omitted one is None): ``variant`` forces that
    kernel variant for every call traced afterwards (None: ``$JFM_KERNEL_VARIANT`` or the
    autotuner decide; one past the kernels' variants is refused when a call is lowered, ValueError
    naming ``variant``); ``autotune`` turns the
    autotuner on (True, also on the emulated device), off (False) or back to
    ``$JFM_AUTOTUNE`` / the default (None). Both take effect for calls traced afterwards (a
    function already compiled by jit keeps its variant). TypeError / ValueError naming the
    argument for anything else."""
    if variant is not None:
        if isinstance(variant, bool) or not isinstance(variant, numbers.Integral):
            raise TypeError(f"variant must be an int or None, got {variant!r}")
        if variant < 0:
            raise ValueError(f"variant must be a non-negative kernel variant, got {variant}")
        variant = int(variant)
    if autotune is not None and not isinstance(autotune, bool):
        raise TypeError(f"autotune must be True, False or None, got {autotune!r}")
    _settings.update(variant=variant, autotune=autotune)


def settings() -> dict:
    """``configure``'s current arguments (to restore them)."""
    return dict(_settings)


def from_env() -> int:
    """The variant a call is traced with: ``configure(variant=...)``, else
    ``$JFM_KERNEL_VARIANT``, else ``AUTO`` (unset or empty). Raises ValueError naming the
    variable for anything but a non-negative integer; the lowering refuses one past the kernels'
    variants (``_ext.tile_variants``)."""
    if _settings["variant"] is not None:
        return int(_settings["variant"])  # type: ignore[call-overload]
    value = os.environ.get(ENV, "").strip()
    if not value:
        return AUTO
    if not value.isdigit():
        raise ValueError(f"{ENV} must be a non-negative integer (a kernel variant), "
                         f"got {value!r}")
    return int(value)


def autotune_enabled(implementation: str) -> bool:
    """Whether an ``AUTO`` call of the fused ``implementation`` is tuned: ``configure(autotune=
    ...)``, else ``$JFM_AUTOTUNE`` (1/true/yes/on or 0/false/no/off), else on for "metal" only
    (the emulated device's timings mean nothing). ValueError naming the variable otherwise."""
    if _settings["autotune"] is not None:
        return bool(_settings["autotune"])
    word = os.environ.get(AUTOTUNE_ENV, "").strip().lower()
    if word in _ON or word in _OFF:
        return word in _ON
    if word:
        raise ValueError(f"${AUTOTUNE_ENV}={word!r}: expected one of {', '.join(_ON)} (on) or "
                         f"{', '.join(_OFF)} (off)")
    return implementation == "metal"
