"""Which implementation runs a flash_attention call: "xla" (FlashAttention-2 in ``jax.numpy``, any
platform), "metal" (the Metal kernels through an XLA FFI call on the ``cpu`` platform) or
"emulator" (the same FFI handler on the MSL-on-CPU emulator, for testing). ``resolve`` decides
when a primitive is lowered; ``lower_fused`` hands a fused call to ``ffi_lowering``, which this
module imports lazily and treats as absent when it cannot be imported. The rules:
docs/design.md#implementation-choice.
"""

from __future__ import annotations

import functools
import os
import warnings

from . import validation
from .contract import Implementation

FUSED: tuple[Implementation, ...] = ("emulator", "metal")
# Fused implementations ``implementation=None`` considers, best first. The emulator is a testing
# tool, never picked by default (tests put it here to exercise the fallback on Linux).
_PREFERENCE = ("metal",)


def _ffi_lowering():
    """The ffi_lowering module, or (None, reason) when the fused side cannot be imported."""
    try:
        from . import ffi_lowering
    except ImportError as e:
        reason = f"the FFI lowering could not be imported ({e})"
        if _is_unbuilt_source_tree():
            reason += (f"; jax_flash_metal was imported from its source folder {_PACKAGE_DIR}, "
                       "which has no compiled extension: run from another directory so the "
                       "installed package is used")
            _warn_once(reason)
        return None, reason
    return ffi_lowering, None


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_unbuilt_source_tree() -> bool:
    """True when this package is the checkout's folder (e.g. `python -m` run from the repository
    root puts it ahead of the installed copy) and no extension was built into it."""
    has_ext = any(name.startswith("_ext.") for name in os.listdir(_PACKAGE_DIR))
    return not has_ext and os.path.exists(os.path.join(_PACKAGE_DIR, "..", "pyproject.toml"))


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _fused_available():
    module, reason = _ffi_lowering()
    if module is None:
        return [], reason
    return [n for n in module.available_implementations() if n in FUSED], None


def available(platform: str = "cpu") -> list[Implementation]:
    """Names of the implementations that can run for ``platform`` here, "xla" first.

    Tests parametrise over ``available()``; "emulator" and "metal" appear only when the native
    extension is importable (and, for "metal", a Metal device exists).
    """
    names: list[Implementation] = ["xla"]
    if platform == "cpu":
        names += [n for n in FUSED if n in _fused_available()[0]]
    return names


def _best_available(platform: str, call) -> str:
    """The first of _PREFERENCE that runs here and covers ``call``, else "xla"."""
    if platform != "cpu":
        return "xla"
    names = _fused_available()[0]
    _warn_if_metal_build_lacks_its_gpu()
    for name in _PREFERENCE:
        if name in names and (call is None or _ffi_lowering()[0].unsupported_reason(name, *call)
                              is None):
            return name
    return "xla"


def _warn_if_metal_build_lacks_its_gpu() -> None:
    """On a macOS build whose Metal device cannot run, says why (once) instead of falling back
    to "xla" silently."""
    module = _ffi_lowering()[0]
    why = module.metal_build_unavailable_reason() if module is not None else None
    if why:
        _warn_once(f"jax_flash_metal: the Metal device is unavailable ({why}); flash_attention "
                   "runs the 'xla' implementation (implementations.devices() lists the devices)")


def fused_page_size(page_size: int) -> bool:
    """Whether the fused kernels read a paged KV cache of ``page_size`` keys per page: powers
    of two >= 16, so that their key blocks (8, 16 or 32 keys) tile pages
    (``jfm_page_size_supported`` in shaders/tile_shapes.h, which the FFI handler checks too)."""
    return page_size >= 16 and page_size & (page_size - 1) == 0


def missing_features(params, page_size: int | None = None) -> str | None:
    """The features of a call (the primitives' static ``params`` and, for a paged call, the page
    size) that the fused kernels do not implement yet, named for an error message, or None.
    (Head dims are the kernel families' matter: ``ffi_lowering.unsupported_reason``.)"""
    if params.get("has_page_table") and not fused_page_size(page_size or 0):
        return (f"page_table with page_size {page_size} (the fused kernels take powers of two "
                f">= 16)")
    return None


def resolve(implementation: str | None, platform: str, call=None, missing=None) -> str:
    """The implementation to lower with for ``platform`` (a JAX platform name such as "cpu").

    ``call``: ``(direction, dtype, head_dim, value_head_dim)`` of the primitive being lowered
    (direction "fwd" or "bwd"); with ``implementation=None`` and no environment override, a
    call the fused kernels do not cover goes to "xla". Without it only availability is considered.
    ``missing``: the call's features the fused kernels lack (``missing_features``): such a call
    goes to "xla" under ``implementation=None``.

    Raises:
      ValueError: unknown name (argument or environment variable).
      NotImplementedError: a fused implementation was asked for explicitly where it cannot run,
        or for a call with ``missing`` features.
    """
    implementation = validation.check_implementation(implementation)
    source = "implementation"
    if implementation is None:
        implementation = validation.env_implementation()
        source = f"${validation.ENV_IMPLEMENTATION}"
        if implementation is None:
            return "xla" if missing else _best_available(platform, call)
    if implementation == "xla":
        return "xla"
    if platform != "cpu":
        raise NotImplementedError(
            f"flash_attention {source}={implementation!r} runs only when lowering for the 'cpu' "
            f"platform (an XLA FFI call on the host), but this computation lowers for "
            f"{platform!r}; {_fallback_advice(source)} there"
        )
    names, _ = _fused_available()
    if implementation not in names:
        why = unavailable_reasons().get(implementation, "the native extension does not provide it")
        raise NotImplementedError(
            f"flash_attention {source}={implementation!r} is not available here: {why}. "
            f"Available: {available(platform)}"
        )
    if missing:
        raise NotImplementedError(
            f"flash_attention {source}={implementation!r} does not implement {missing} yet; "
            f"{_fallback_advice(source)} (such a call then runs on 'xla')")
    return implementation


def _fallback_advice(source: str) -> str:
    """How to leave a fused implementation chosen by ``source`` (the argument, or the
    environment variable that ``implementation=None`` reads)."""
    if source == "implementation":
        return "use implementation=None or 'xla'"
    return f"unset {source} or pass implementation='xla'"


def lower_fused(direction: str, ctx, *args, implementation: str, **params):
    """The FFI custom call of a ``direction`` ("fwd" or "bwd") primitive for the fused
    ``implementation`` that ``resolve`` chose (``ffi_lowering.lower_fwd`` / ``lower_bwd``): the
    primitives reach the FFI side only through this module."""
    module, reason = _ffi_lowering()
    if module is None:  # resolve() returns a fused name only when the module imported
        raise NotImplementedError(f"flash_attention implementation={implementation!r}: {reason}")
    lower = module.lower_fwd if direction == "fwd" else module.lower_bwd
    return lower(ctx, *args, implementation=implementation, **params)


def metal_available() -> bool:
    """True when ``implementation="metal"`` can run here: the native extension was built on
    macOS, and the GPU is Apple silicon (GPU family Apple7 or newer, unified memory, 32-wide
    simdgroups) on macOS 13+ (Metal Shading Language 3.0). ``devices()["metal"]`` says why not."""
    return "metal" in _fused_available()[0]


def unavailable_reasons() -> dict[str, str]:
    """{implementation: why it cannot run here} for each fused implementation that cannot."""
    module, reason = _ffi_lowering()
    if module is None:
        return {name: reason for name in FUSED}
    return module.unavailable_reasons()


def devices() -> dict[str, str]:
    """What this installation can run, for lowering on ``cpu``: {implementation: device} for
    "xla", "emulator" and "metal", in that order. An implementation in ``available("cpu")`` maps
    to its device, e.g. ``{"xla": "FlashAttention-2 in jax.numpy (any platform)",
    "emulator": "MSL-on-CPU emulator", "metal": "Apple M2 Pro"}``; one that cannot run here maps
    to ``"unavailable: "`` and the reason, e.g. ``"unavailable: the GPU 'AMD Radeon Pro 5500M'
    is not in GPU family Apple7 or newer ..."`` on an Intel Mac."""
    result = {"xla": "FlashAttention-2 in jax.numpy (any platform)"}
    module, _ = _ffi_lowering()
    if module is not None:
        result.update(module.device_names())
    reasons = unavailable_reasons()
    for name in FUSED:
        result.setdefault(name, f"unavailable: {reasons.get(name, 'unknown reason')}")
    return result
