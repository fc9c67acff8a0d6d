"""Which implementation lowers a primitive: ``resolve`` decides when it is lowered (the argument,
then $JAX_FLASH_METAL_IMPLEMENTATION, then the best that runs here and covers the call);
``fused_lowering`` is the lowering rule of a fused call (the FFI side, imported lazily). The
rules: docs/design.md#implementation-choice.
"""

from __future__ import annotations

import functools
import os

from .. import implementations
from ..core import validation
from ..fused import loader

ENV_IMPLEMENTATION = "JAX_FLASH_METAL_IMPLEMENTATION"
# Fused implementations ``implementation=None`` considers, best first. The emulator is a testing
# tool, never picked by default (tests put it here to exercise the fallback on Linux).
_PREFERENCE = ("metal",)


def env_implementation():
    """The implementation named by $JAX_FLASH_METAL_IMPLEMENTATION, or None when unset/empty."""
    value = os.environ.get(ENV_IMPLEMENTATION, "").strip()
    return validation.check_implementation(value, f"${ENV_IMPLEMENTATION}") if value else None


def _best_available(platform: str, call) -> str:
    """The first of _PREFERENCE that runs here and covers ``call``, else "xla"."""
    if platform != "cpu":
        return "xla"
    names = loader.available()[0]
    loader.warn_if_metal_build_lacks_its_gpu()
    for name in _PREFERENCE:
        if name in names and (call is None or loader.ffi_lowering()[0].unsupported_reason(
                name, *call) is None):
            return name
    return "xla"


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
        implementation = env_implementation()
        source = f"${ENV_IMPLEMENTATION}"
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
    if implementation not in loader.available()[0]:
        why = loader.unavailable_reasons().get(implementation,
                                               "the native extension does not provide it")
        raise NotImplementedError(
            f"flash_attention {source}={implementation!r} is not available here: {why}. "
            f"Available: {implementations.available(platform)}"
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


@functools.cache
def fused_lowering(direction: str):
    """The lowering rule ``(ctx, *args, implementation, **params)`` of a ``direction`` ("fwd" or
    "bwd") primitive for the fused implementation that ``resolve`` chose: the FFI custom call
    (``ffi_lowering.lower_fwd`` / ``lower_bwd``). One object per direction (a cache key of the
    sharding)."""
    def lower(ctx, *args, implementation: str, **params):
        module, reason = loader.ffi_lowering()
        if module is None:  # resolve() returns a fused name only when the module imported
            raise NotImplementedError(
                f"flash_attention implementation={implementation!r}: {reason}")
        rule = module.lower_fwd if direction == "fwd" else module.lower_bwd
        return rule(ctx, *args, implementation=implementation, **params)
    return lower
