"""The fused side, imported lazily: ``ffi_lowering`` and the fused implementations it provides,
or why they are absent (no compiled extension, e.g. a source checkout)."""

from __future__ import annotations

import functools
import os
import warnings

from ..core.contract import Implementation

FUSED: tuple[Implementation, ...] = ("emulator", "metal")

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ffi_lowering():
    """The ffi_lowering module, or (None, reason) when the fused side cannot be imported."""
    try:
        from . import ffi_lowering as module
    except ImportError as e:
        reason = f"the FFI lowering could not be imported ({e})"
        if _is_unbuilt_source_tree():
            reason += (f"; jax_flash_metal was imported from its source folder {_PACKAGE_DIR}, "
                       "which has no compiled extension: run from another directory so the "
                       "installed package is used")
            _warn_once(reason)
        return None, reason
    return module, None


def _is_unbuilt_source_tree() -> bool:
    """True when this package is the checkout's folder (e.g. `python -m` run from the repository
    root puts it ahead of the installed copy) and no extension was built into it."""
    has_ext = any(name.startswith("_ext.") for name in os.listdir(_PACKAGE_DIR))
    return not has_ext and os.path.exists(os.path.join(_PACKAGE_DIR, "..", "pyproject.toml"))


def warn_if_metal_build_lacks_its_gpu() -> None:
    """On a macOS build whose Metal device cannot run, says why (once) instead of falling back
    to "xla" silently."""
    module = ffi_lowering()[0]
    why = module.metal_build_unavailable_reason() if module is not None else None
    if why:
        _warn_once(f"jax_flash_metal: the Metal device is unavailable ({why}); flash_attention "
                   "runs the 'xla' implementation (implementations.devices() lists the devices)")


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def available():
    """(the fused implementations that can run here, None) or ([], why none can)."""
    module, reason = ffi_lowering()
    if module is None:
        return [], reason
    return [n for n in module.available_implementations() if n in FUSED], None


def unavailable_reasons() -> dict[str, str]:
    """{implementation: why it cannot run here} for each fused implementation that cannot."""
    module, reason = ffi_lowering()
    if module is None:
        return {name: reason for name in FUSED}
    return module.unavailable_reasons()
