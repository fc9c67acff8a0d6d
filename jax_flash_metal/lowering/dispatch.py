"""Which implementation runs a call. ``implementation`` is one name or names to try in order;
the first that can run the call runs it. ``trace_choice`` decides "cudnn" when flash_attention
is traced (jax.nn's cuDNN call then replaces the primitives); ``resolve`` decides among the
others when a primitive is lowered (the argument, then $JAX_FLASH_METAL_IMPLEMENTATION, then the
platform's best that covers the call), for the platform it lowers for. Both choices are logged
at DEBUG level on the "jax_flash_metal" logger. ``fused_lowering`` is the lowering rule of a
fused call (the FFI side, imported lazily). The rules: docs/design.md#implementation-choice and
docs/gpu.md.
"""

from __future__ import annotations

import functools
import logging
import os

from .. import implementations
from ..core import validation
from ..fused import loader

ENV_IMPLEMENTATION = "JAX_FLASH_METAL_IMPLEMENTATION"
CUDNN = "cudnn"
_LOG = logging.getLogger("jax_flash_metal")
# Fused implementations ``implementation=None`` considers, best first. The emulator is a testing
# tool, never picked by default (tests put it here to exercise the fallback on Linux).
_PREFERENCE = ("metal",)


def env_implementation():
    """The implementation names of $JAX_FLASH_METAL_IMPLEMENTATION (``check_implementation``:
    one name or several separated by commas), or None when unset/empty."""
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


def _shown(names) -> str:
    """A chain as the caller wrote it: 'metal' for one name, ('cudnn', 'xla') for several."""
    return repr(names[0]) if len(names) == 1 else repr(tuple(names))


def trace_choice(implementation, cudnn_reason):
    """Whether cuDNN runs a call, decided when flash_attention is traced: (True, None), or
    (False, the names left for ``resolve`` at lowering; None for the platform's default or
    the environment's names).

    ``implementation``: the validated names or None (then $JAX_FLASH_METAL_IMPLEMENTATION, and
    without it the platform's chain: on an NVIDIA GPU ("cudnn", "xla"), elsewhere left to
    ``resolve``). ``cudnn_reason()``: why cuDNN cannot run this call here, or None
    (``cudnn.unsupported_reason`` with the device's facts); called at most once.

    Raises:
      ValueError: every name is "cudnn" and cuDNN cannot run the call (the reason is named).
    """
    names, source = implementation, "implementation"
    if names is None:
        names, source = env_implementation(), f"${ENV_IMPLEMENTATION}"
    if names is None:
        reason = cudnn_reason()
        _LOG.debug("flash_attention: default chain: %s", "cudnn" if reason is None
                   else f"not cudnn ({reason}); the lowering platform's chain")
        return (True, None) if reason is None else (False, None)
    for i, name in enumerate(names):
        if name != CUDNN:
            _LOG.debug("flash_attention: %s=%s: lowering chooses among %s", source,
                       _shown(names), names[i:])
            # The lowering reads the environment again, naming it in its errors.
            return False, names[i:] if implementation is not None else None
        reason = cudnn_reason()
        if reason is None:
            _LOG.debug("flash_attention: %s=%s: cudnn", source, _shown(names))
            return True, None
        _LOG.debug("flash_attention: %s=%s: not cudnn (%s)", source, _shown(names), reason)
    raise ValueError(f"flash_attention {source}={_shown(names)}: 'cudnn' cannot run this call: "
                     f"{reason}")


def resolve(implementation, platform: str, call=None, missing=None) -> str:
    """The implementation to lower with for ``platform`` (a JAX platform name such as "cpu").

    ``implementation``: None, a name or a sequence of names (the first that can run the call
    is taken; "cudnn" was decided at trace time and is skipped here). ``call``:
    ``(direction, dtype, head_dim, value_head_dim)`` of the primitive being lowered
    (direction "fwd" or "bwd"); with ``implementation=None`` and no environment override, a
    call the fused kernels do not cover goes to "xla", and so does a fused name followed by
    others. Without it only availability is considered. ``missing``: the call's features the
    fused kernels lack (``missing_features``): such a call goes to "xla" under
    ``implementation=None``.

    Raises:
      ValueError: unknown name (argument or environment variable), or a chain of "cudnn" only
        reaching the lowering (a call that binds the primitives directly: ring attention).
      NotImplementedError: the last fused implementation of the chain cannot run there, or
        lacks ``missing`` features.
    """
    names = validation.check_implementation(implementation)
    source = "implementation"
    if names is None:
        names = env_implementation()
        source = f"${ENV_IMPLEMENTATION}"
        if names is None:
            chosen = "xla" if missing else _best_available(platform, call)
            _LOG.debug("flash_attention: %s lowers with %r", platform, chosen)
            return chosen
    left = [n for n in names if n != CUDNN]
    if not left:
        raise ValueError(f"flash_attention {source}={_shown(names)}: 'cudnn' runs only through "
                         "flash_attention itself (jax.nn's cuDNN call), not in this call's "
                         "primitives (sequence_axis_name: ring attention); add 'xla'")
    for i, name in enumerate(left):
        last = i == len(left) - 1
        reason = None if name == "xla" else _fused_reason(name, platform, call, missing,
                                                          source, names, last)
        if reason is None or last:
            if reason is not None:
                raise NotImplementedError(reason)
            _LOG.debug("flash_attention: %s=%s: %s lowers with %r", source, _shown(names),
                       platform, name)
            return name
    raise AssertionError("unreachable: the loop returns or raises at its last name")


def _fused_reason(name, platform, call, missing, source, names, last):
    """Why the fused implementation ``name`` cannot lower ``call`` for ``platform`` (the
    NotImplementedError text), or None. A head dim or dtype without kernels is a reason only
    when another name follows (``last`` False); for the last name ``lower_fwd`` raises
    ValueError for it."""
    shown = f"flash_attention {source}={_shown(names)}"
    if platform != "cpu":
        return (f"{shown} runs only when lowering for the 'cpu' platform (an XLA FFI call on "
                f"the host), but this computation lowers for {platform!r}; "
                f"{_fallback_advice(source)} there")
    if name not in loader.available()[0]:
        why = loader.unavailable_reasons().get(name, "the native extension does not provide it")
        return (f"{shown} is not available here: {why}. "
                f"Available: {implementations.available(platform)}")
    if missing:
        return (f"{shown} does not implement {missing} yet; {_fallback_advice(source)} (such "
                "a call then runs on 'xla')")
    if (call is not None and not last
            and loader.ffi_lowering()[0].unsupported_reason(name, *call) is not None):
        return f"{shown}: {name!r} has no kernels for this call"
    return None


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
