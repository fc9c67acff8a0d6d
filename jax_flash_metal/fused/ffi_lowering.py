"""The FFI side of the fused implementations: registers the native extension's FFI targets for
the ``cpu`` platform on import and emits the primitives' custom calls (``lower_fwd``,
``lower_bwd``, reached through ``dispatch.fused_lowering``). Importing it raises ImportError
when the extension is missing or this jaxlib refuses its handlers, which ``implementations``
reports as "no fused implementation available". Two variables are read on import:
$JAX_FLASH_METAL_EMULATOR_SCHEDULE ("forward", "reverse", "random" or "random:SEED") sets the
emulator's thread resume order and the order of dispatches that may run concurrently, and
$JAX_FLASH_METAL_DEBUG turns on Metal's per-encoder execution status
(docs/design.md#the-native-extension).
The operands, results and attributes of the calls: docs/design.md#the-ffi-lowering and
``ffi/attention_ffi.h``.
"""

from __future__ import annotations

import functools
import os
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

import jax_flash_metal._ext as _ext  # a module import: mypy takes the unbuilt extension as Any
from ..core.contract import MAIN_OPERANDS, OPERAND_FLAGS, kernel_suffix, operand_roles
from ..core._jax_private import ShapedArray



def _target(direction: str, implementation: str) -> str:
    return f"jax_flash_metal_attention_{direction}_{implementation}"


_TARGETS = _ext.ffi_targets()
try:
    for _name, _capsule in _TARGETS.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="cpu", api_version=1)
except Exception as e:  # e.g. an extension built against newer XLA FFI headers than this jaxlib
    raise ImportError(f"jaxlib {jax.lib.__version__} refused the extension's FFI handlers: {e}. "
                      "Rebuild jax_flash_metal against this jaxlib.") from e

# The handlers find each optional operand by this list (JFM_OPTIONAL_OPERANDS): an extension
# built from another list would read operands from the wrong slots.
if _ext.optional_operands() != list(OPERAND_FLAGS.items()):
    raise ImportError(f"the extension's optional operands {_ext.optional_operands()} are not "
                      f"contract.Operands's {list(OPERAND_FLAGS.items())}: rebuild jax_flash_metal")

SCHEDULE_ENV = "JAX_FLASH_METAL_EMULATOR_SCHEDULE"


def _schedule_from_env(value: str) -> None:
    name, _, seed = value.strip().partition(":")
    try:
        _ext.set_emulator_schedule(name, int(seed or 0))
    except ValueError as e:
        raise ValueError(f"${SCHEDULE_ENV}={value!r}: expected forward, reverse, random or "
                         f"random:SEED ({e})") from None


if os.environ.get(SCHEDULE_ENV, "").strip():
    _schedule_from_env(os.environ[SCHEDULE_ENV])

DEBUG_ENV = "JAX_FLASH_METAL_DEBUG"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _debug_from_env(value: str) -> None:
    word = value.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(f"${DEBUG_ENV}={value!r}: expected one of {', '.join(_TRUE)} (on) or "
                         f"{', '.join(_FALSE[1:])} (off)")
    _ext.set_metal_debug(word in _TRUE)


_debug_from_env(os.environ.get(DEBUG_ENV, ""))


def _built(implementation: str) -> bool:
    return all(_target(d, implementation) in _TARGETS for d in ("fwd", "bwd"))


def _check_built(implementation: str) -> None:
    if not _built(implementation):
        raise ValueError(f"flash_attention: this build of jax_flash_metal has no "
                         f"{implementation!r} FFI targets (built: {sorted(_TARGETS)})")


def available_implementations() -> list[str]:
    """Fused implementations that can run here: "emulator" always (the extension imported),
    "metal" when this is a macOS build and the machine has a Metal GPU."""
    names = ["emulator"]
    if _built("metal") and _ext.metal_available():
        names.append("metal")
    return names


def unavailable_reasons() -> dict[str, str]:
    """{"metal": why it cannot run here} when it cannot (e.g. a Linux build, or a GPU that is not
    Apple silicon); empty otherwise."""
    if "metal" in available_implementations():
        return {}
    return {"metal": _ext.metal_unavailable_reason() or "this build has no Metal FFI targets"}


def metal_build_unavailable_reason() -> str | None:
    """Why this macOS build's Metal device cannot run here (no GPU found, not Apple silicon, ...),
    or None when it can or this build has no Metal device."""
    if not _built("metal") or "metal" in available_implementations():
        return None
    return _ext.metal_unavailable_reason()


def device_names() -> dict[str, str]:
    """{implementation: device name} for ``available_implementations()`` (the GPU's name for
    "metal")."""
    return {name: _ext.device_name(name) for name in available_implementations()}


@functools.lru_cache(maxsize=None)
def kernel_names(implementation: str) -> frozenset[str]:
    """Kernel names the device behind ``implementation`` ("emulator" or "metal") can run.

    On Metal the first call compiles the embedded shader library. Raises ValueError when that
    device is unavailable.
    """
    return frozenset(_ext.kernel_names(implementation))


def unsupported_reason(implementation: str, direction: str, dtype, head_dim: int,
                       value_head_dim: int) -> str | None:
    """Why the fused kernels of ``implementation`` cannot run a ``direction`` ("fwd" or "bwd")
    call with this dtype, query/key head dim and value head dim, or None when every kernel it
    needs exists (one family of shaders/kernel_families.h per dtype and pair of head dims). The
    optional features need no kernels of their own: every kernel implements all of them.

    The device's kernel list is asked (on Metal without compiling anything), so a build whose
    shaders lack a head dim is reported at trace time rather than when the computation runs.
    """
    dtype = np.dtype(dtype)
    suffix = kernel_suffix(dtype)
    if suffix is None:
        return (f"flash_attention: dtype {dtype} has no {implementation} kernels "
                f"(float32, float16, bfloat16 only)")
    # The kernels (stages) the direction runs, as ffi/dispatch_plan.cc plans them.
    stages = (("fwd", "decode_partial", "decode_combine") if direction == "fwd"
              else tuple(_ext.bwd_stages(_ext.tile_head_dim(head_dim, value_head_dim))))
    names = kernel_names(implementation)
    missing = [name for name in (_ext.kernel_name(s, suffix, head_dim, value_head_dim)
                                 for s in stages) if name not in names]
    if not missing:
        return None
    # The families of this dtype the device has: "_dD" (Dv = Dk) or "_dDK_vDV" name tags.
    prefix = f"flash_attention_{stages[0]}_{suffix}_d"
    tags = [n[len(prefix):].split("_v") for n in names if n.startswith(prefix)]
    dims = sorted(int(t[0]) for t in tags if len(t) == 1 and t[0].isdigit())
    pairs = sorted((int(t[0]), int(t[1])) for t in tags
                   if len(t) == 2 and t[0].isdigit() and t[1].isdigit())
    asked = (f"head_dim {head_dim}" if value_head_dim == head_dim else
             f"key head dim {head_dim} with value head dim {value_head_dim}")
    message = (f"flash_attention: {asked} with dtype {dtype} is not supported by "
               f"the {implementation!r} implementation, whose kernels take head dims {dims} "
               f"(key and value alike) and the (key, value) head-dim pairs {pairs}; the 'xla' "
               f"implementation runs any head dim")
    offered = (head_dim in dims) if value_head_dim == head_dim else (
        (head_dim, value_head_dim) in pairs)
    if offered:
        message += f". This build lacks kernels of that family: {missing}"  # a broken build
    library_error = _ext.library_error(implementation)
    if library_error:
        message += f". Shader library error: {library_error}"
    return message


def check_supported(implementation: str, direction: str, dtype, head_dim: int,
                    value_head_dim: int) -> None:
    """Raise ``unsupported_reason`` as TypeError (a dtype without kernels) or ValueError (head
    dims without kernels), if any."""
    reason = unsupported_reason(implementation, direction, dtype, head_dim, value_head_dim)
    if reason is None:
        return
    raise (ValueError if kernel_suffix(dtype) else TypeError)(reason)


# The FFI attributes as the extension lists them (JFM_FFI_ATTRIBUTES, ffi/attention_ffi.h), each
# with the NumPy type of its exact FFI type (a Python float would become f64).
_NUMPY_TYPES = {"float": np.float32, "double": np.float64, "int32_t": np.int32, "bool": np.bool_}
_ATTRIBUTES = tuple((name, _NUMPY_TYPES[kind]) for name, kind in _ext.ffi_attributes())


def _attributes(*, bias_grad=False, alibi_grad=False, logits_soft_cap=None, **params):
    """The FFI attributes of a call from the primitive's static ``params`` (``StaticParams``
    without ``contract.HOST_ONLY_PARAMS``): the soft cap is 0.0 when absent, ``bias_grad`` and
    ``alibi_grad`` False for the forward."""
    values = dict(params, bias_grad=bias_grad, alibi_grad=alibi_grad,
                  logits_soft_cap=0.0 if logits_soft_cap is None else logits_soft_cap)
    variants = _ext.tile_variants("fwd")
    if not 0 <= values.get("kernel_variant", 0) < variants:
        raise ValueError(f"variant (tune.configure(variant=...) or $JFM_KERNEL_VARIANT) must be "
                         f"in [0, {variants}), "
                         f"got {values['kernel_variant']}")
    return {name: numpy_type(values[name]) for name, numpy_type in _ATTRIBUTES}


def _contract_operands(ctx: mlir.LoweringRuleContext, args, direction, params):
    """(avals, args) of a ``direction`` ("fwd" or "bwd") primitive's call with the bias in a dtype
    the FFI contract takes: the dtype of q, or float32 (a bias of another float dtype is
    converted, exactly)."""
    avals, args = list(ctx.avals_in), list(args)
    roles = operand_roles(direction, params)
    if "bias" not in roles:
        return avals, args
    n = roles.index("bias")
    bias, q = (cast(ShapedArray, avals[i]) for i in (n, 0))
    if bias.dtype not in (q.dtype, np.dtype(np.float32)):
        f32 = ShapedArray(bias.shape, np.float32)
        convert = mlir.lower_fun(lambda b: b.astype(np.float32), multiple_results=False)
        [args[n]] = convert(ctx.replace(avals_in=[bias], avals_out=[f32]), args[n])
        avals[n] = f32
    return avals, args


def lower_fwd(ctx: mlir.LoweringRuleContext, *args, implementation: str, **params):
    """Emit the forward FFI call: args (q, k, v, then the optional operands of
    contract.Operands in the contract's order, ffi/attention_ffi.h) -> (o, lse, row_max,
    log_sum).

    Short queries against a long KV cache take the split-KV decode kernels (the handler decides,
    ``ffi/dispatch_plan.h`` decode_splits; a call with dropout never does); their float32
    workspace is a fourth result of the custom call, sized here by the extension's own rule
    (``_ext.decode_splits`` for this device, 0 elements for the tiled forward) and dropped,
    like the backward's delta.

    ``implementation`` is "metal" or "emulator"; ``params`` are the primitive's other static
    params (``contract.StaticParams``, coerced by ``contract.coerce_params``), sent as the FFI
    attributes. Raises ValueError for head dims the device has no kernels for or when
    ``implementation`` is not in this build, TypeError for a dtype without kernels.
    """
    q, k, v = (cast(ShapedArray, aval) for aval in ctx.avals_in[:3])
    _check_built(implementation)
    check_supported(implementation, "fwd", q.dtype, q.shape[3], v.shape[3])
    batch, q_len, num_heads, head_dim = q.shape
    kv_len = k.shape[1]
    if params.get("has_page_table"):  # k holds pages: the logical length is the table's
        table = cast(ShapedArray, ctx.avals_in[operand_roles("fwd", params).index("page_table")])
        kv_len = table.shape[1] * k.shape[1]
    _, workspace_elements = _ext.decode_splits(
        kernel_suffix(q.dtype), batch, q_len, kv_len, num_heads, k.shape[2],
        head_dim, implementation, v.shape[3], params.get("dropout_rate", 0.0) > 0)
    workspace = ShapedArray((workspace_elements,), np.float32)
    avals, args = _contract_operands(ctx, args, "fwd", params)
    call_ctx = ctx.replace(avals_in=avals, avals_out=(*ctx.avals_out, workspace))
    rule = jax.ffi.ffi_lowering(_target("fwd", implementation))
    return list(rule(call_ctx, *args, **_attributes(**params)))[:4]


def lower_bwd(ctx: mlir.LoweringRuleContext, *args, implementation: str, bias_grad=False,
              alibi_grad=False, **params):
    """Emit the backward FFI call for the primitive's args (q, k, v, o, lse, row_max, log_sum,
    do, g_lse, then the optional operands as for ``lower_fwd``) -> (dq, dk, dv[, dbias]
    [, dslopes]).

    The kernels recompute P from the residuals row_max and log_sum, so the call takes
    (q, k, v, o, row_max, log_sum, do, g_lse, *optional) and the lse operand is dropped. The custom
    call has three more results: dbias float32 [batch, num_heads, q_len, kv_len] with
    ``bias_grad`` (else [0]), summed here over the bias operand's broadcast axes to the
    primitive's dbias; dalibi float32 [batch, num_heads, q_len] with ``alibi_grad`` (else [0]),
    each query row's share of the slopes' gradient, summed here over the rows to dslopes
    [batch, num_heads]; and the float32 [batch, num_heads, q_len] workspace for
    D_i = rowsum(dO_i * O_i) - g_lse_i, dropped here: XLA allocates both like any temporary, so
    they show up in memory_analysis() and need no allocator inside the handler. Errors as for
    ``lower_fwd``.
    """
    q, k, v = (cast(ShapedArray, aval) for aval in ctx.avals_in[:3])
    _check_built(implementation)
    check_supported(implementation, "bwd", q.dtype, q.shape[3], v.shape[3])
    batch, q_len, num_heads, _ = q.shape
    full = (batch, num_heads, q_len, k.shape[1])
    rows = (batch, num_heads, q_len)
    dbias = ShapedArray(full if bias_grad else (0,), np.float32)
    dalibi = ShapedArray(rows if alibi_grad else (0,), np.float32)
    delta = ShapedArray(rows, np.float32)
    avals, args = _contract_operands(ctx, args, "bwd", params)
    keep = [n for n in range(len(args)) if n != _BWD_LSE_OPERAND]
    call_ctx = ctx.replace(avals_in=[avals[n] for n in keep],
                           avals_out=(*ctx.avals_out[:3], dbias, dalibi, delta))
    rule = jax.ffi.ffi_lowering(_target("bwd", implementation))
    results = list(rule(call_ctx, *(args[n] for n in keep),
                        **_attributes(bias_grad=bias_grad, alibi_grad=alibi_grad, **params)))
    # The primitive's [dbias][, dslopes], each a sum of the custom call's result.
    outs, reduced = results[:3], [cast(ShapedArray, aval) for aval in ctx.avals_out[3:]]

    def reduce(result, aval, fun):
        return mlir.lower_fun(fun, multiple_results=False)(
            ctx.replace(avals_in=[aval], avals_out=[reduced.pop(0)]), result)

    if bias_grad:
        # The bias's broadcast axes are the size-1 axes of the primitive's dbias result.
        axes = tuple(n for n, size in enumerate(reduced[0].shape) if size == 1 and full[n] != 1)
        outs += reduce(results[3], dbias, lambda d: jnp.sum(d, axis=axes, keepdims=True))
    if alibi_grad:
        outs += reduce(results[4], dalibi, lambda d: jnp.sum(d, axis=2))
    return outs


_BWD_LSE_OPERAND = MAIN_OPERANDS["bwd"].index("lse")
