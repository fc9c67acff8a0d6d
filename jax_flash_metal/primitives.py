"""The two flash-attention primitives and their JAX rules.

fwd_p: bind(q, k, v, *optional, **params) -> (o, lse, row_max, log_sum)
bwd_p: bind(q, k, v, o, lse, row_max, log_sum, do, g_lse, *optional, bias_grad=..., **params)
       -> (dq, dk, dv[, dbias])

lse is the user's natural-log statistic (-inf for a row with no visible key). row_max and
log_sum (float32 [batch, num_heads, q_len] each) are residuals only: the row's maximum score m
(sinks included) and log(l), l the softmax sum relative to m, natural log, so lse = m + log(l).
Both backwards recompute P = exp((S - m) - log(l)) from them: S - m is exact for nearby float32
scores, whereas S - lse loses log(l) when |m| is huge (lse rounds to m, e.g. a row hidden by an
additive -1e9 mask). Their values for an empty row are implementation-defined (the kernels store
a large finite m, the xla implementation the lowest float; both log(l) = 0).

``optional`` are the present fields of ``validation.Operands`` in its order: q_lengths,
kv_lengths (int32 [B]), q_segment_ids, kv_segment_ids (int32 [B, T]), bias (float, rank 4, each
axis 1 or full over [B, H, Tq, Tkv]), mask (bool, same), sinks (float32 [H]); each is present
exactly when its ``has_*`` flag is True. Both primitives take the same optional operands, so a
call's forward and backward lower to the same implementation; the backward reads no sinks (its
LSE already includes them; dsinks comes from O, LSE, dO and g_lse in attention.py). With
``bias_grad`` the backward also returns dbias float32 in the bias operand's (broadcast) shape.

Static params (exact types, ``coerce_params``): scale: float, is_causal: bool, window_left: int,
window_right: int (-1 = unbounded), bottom_right: bool, has_q_lengths, has_kv_lengths,
has_segment_ids, has_bias, has_mask, has_sinks: bool, logits_soft_cap: float | None,
implementation: str | None, and for bwd_p bias_grad: bool.

Rules per primitive: abstract eval, eager impl (a cached ``jax.jit`` of the bind, so eager calls use
the same lowering as compiled ones), a batching rule that folds vmapped axes into the batch
dimension, a default lowering (``mlir.lower_fun`` of the xla implementation, ``xla_attention``,
every platform) and a ``cpu`` lowering that resolves ``implementation`` and, for
"metal"/"emulator", hands over to ``ffi_lowering``. The organisation follows JAX's own cuDNN
attention primitives.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import implementations, xla_attention
from .validation import Operands
from ._jax_private import ShapedArray

fwd_p = Primitive("flash_attention_fwd")
fwd_p.multiple_results = True
bwd_p = Primitive("flash_attention_bwd")
bwd_p.multiple_results = True

_NUM_MAIN = {fwd_p: 3, bwd_p: 9}  # operands before the optional ones


def _split(prim, args, params):
    """(main operands, validation.Operands); checks the operand count against the flags."""
    n = _NUM_MAIN[prim]
    flags = Operands.flags(*(bool(params.get(f, False)) for f in _FLAG_NAMES))
    try:
        return list(args[:n]), Operands.from_list(args[n:], flags)
    except ValueError as e:
        raise ValueError(f"{prim.name}: {e} for {dict(zip(_FLAG_NAMES, flags))}") from None


_FLAG_NAMES = ("has_q_lengths", "has_kv_lengths", "has_segment_ids", "has_bias", "has_mask",
               "has_sinks")


def coerce_params(*, scale, is_causal, window_left, window_right, bottom_right, has_q_lengths,
                  has_kv_lengths, implementation, has_segment_ids=False, has_bias=False,
                  has_mask=False, has_sinks=False, logits_soft_cap=None, bias_grad=None):
    """The static params with their exact Python types (FFI attributes are typed).
    ``bias_grad`` (backward only) is included when given."""
    params = dict(scale=float(scale), is_causal=bool(is_causal), window_left=int(window_left),
                  window_right=int(window_right), bottom_right=bool(bottom_right),
                  has_q_lengths=bool(has_q_lengths), has_kv_lengths=bool(has_kv_lengths),
                  implementation=None if implementation is None else str(implementation),
                  has_segment_ids=bool(has_segment_ids), has_bias=bool(has_bias),
                  has_mask=bool(has_mask), has_sinks=bool(has_sinks),
                  logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap))
    if bias_grad is not None:
        params["bias_grad"] = bool(bias_grad)
    return params


# ---------------------------------------------------------------- abstract evaluation

def _check_operand_avals(prim, x: Operands, batch, num_heads, q_len, kv_len):
    def bad(name, arr, want):
        raise ValueError(f"{prim.name}: {name} must be {want}, got {arr.dtype}{list(arr.shape)}")

    for name, arr, shape in (("q_lengths", x.q_lengths, (batch,)),
                             ("kv_lengths", x.kv_lengths, (batch,)),
                             ("q_segment_ids", x.q_segment_ids, (batch, q_len)),
                             ("kv_segment_ids", x.kv_segment_ids, (batch, kv_len))):
        if arr is not None and (arr.shape != shape or arr.dtype != jnp.int32):
            bad(name, arr, f"int32 {list(shape)}")
    full = (batch, num_heads, q_len, kv_len)
    for name, arr in (("bias", x.bias), ("mask", x.mask)):
        if arr is not None and (arr.ndim != 4 or any(n not in (1, f) for n, f in
                                                      zip(arr.shape, full))):
            bad(name, arr, f"rank 4 with each axis 1 or the size of {list(full)}")
    if x.mask is not None and x.mask.dtype != jnp.bool_:
        bad("mask", x.mask, "bool")
    if x.sinks is not None and (x.sinks.shape != (num_heads,) or x.sinks.dtype != jnp.float32):
        bad("sinks", x.sinks, f"float32 [{num_heads}]")


def _fwd_abstract(*args, **params):
    (q, k, v), x = _split(fwd_p, args, params)
    batch, q_len, num_heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim or (
            num_heads % k.shape[2]):
        raise ValueError(f"flash_attention_fwd: incompatible shapes q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    _check_operand_avals(fwd_p, x, batch, num_heads, q_len, k.shape[1])
    row = ShapedArray((batch, num_heads, q_len), jnp.float32)
    return ShapedArray(q.shape, q.dtype), row, row, row


def _bwd_abstract(*args, bias_grad=False, **params):
    (q, k, v, o, lse, row_max, log_sum, do, g_lse), x = _split(bwd_p, args, params)
    batch, q_len, num_heads, _ = q.shape
    if o.shape != q.shape or do.shape != q.shape or k.shape != v.shape:
        raise ValueError(f"flash_attention_bwd: incompatible shapes q {q.shape}, o {o.shape}, "
                         f"do {do.shape}, k {k.shape}, v {v.shape}")
    for name, y in (("lse", lse), ("row_max", row_max), ("log_sum", log_sum),
                    ("g_lse", g_lse)):
        if y.shape != (batch, num_heads, q_len):
            raise ValueError(f"flash_attention_bwd: {name} must be [{batch}, {num_heads}, "
                             f"{q_len}], got {list(y.shape)}")
    if bias_grad and x.bias is None:
        raise ValueError("flash_attention_bwd: bias_grad=True needs a bias operand")
    _check_operand_avals(bwd_p, x, batch, num_heads, q_len, k.shape[1])
    outs = [ShapedArray(q.shape, q.dtype), ShapedArray(k.shape, k.dtype),
            ShapedArray(v.shape, v.dtype)]
    if bias_grad:
        outs.append(ShapedArray(x.bias.shape, jnp.float32))
    return tuple(outs)


fwd_p.def_abstract_eval(_fwd_abstract)
bwd_p.def_abstract_eval(_bwd_abstract)


# ---------------------------------------------------------------- eager implementation

@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, params_items):
    params = dict(params_items)
    return jax.jit(lambda *args: prim.bind(*args, **params))


def _make_impl(prim):
    def impl(*args, **params):
        return _jitted_bind(prim, tuple(sorted(params.items())))(*args)
    return impl


fwd_p.def_impl(_make_impl(fwd_p))
bwd_p.def_impl(_make_impl(bwd_p))


# ---------------------------------------------------------------- batching

def _fold(x, dim, size):
    """Move the vmapped axis to the front (broadcasting unbatched operands) and merge it with
    the operand's own leading batch axis."""
    x = jnp.broadcast_to(x, (size,) + x.shape) if dim is None else jnp.moveaxis(x, dim, 0)
    return x.reshape((size * x.shape[1],) + x.shape[2:])


def _fold_broadcast(x, dim, size, batch, keep_unbatched):
    """_fold for a bias or mask, whose batch axis may be 1 (broadcast): that axis is first
    expanded to ``batch`` so the merged axis lines up with q's. An unbatched one with batch
    axis 1 stays as it is when ``keep_unbatched`` (it broadcasts over the merged axis too)."""
    if dim is None and keep_unbatched and x.shape[0] == 1:
        return x
    x = jnp.broadcast_to(x, (size,) + x.shape) if dim is None else jnp.moveaxis(x, dim, 0)
    x = jnp.broadcast_to(x, (size, batch) + x.shape[2:])
    return x.reshape((size * batch,) + x.shape[2:])


def operand_roles(prim, params):
    """The role of each operand: "main" or the Operands field name."""
    flags = Operands.flags(*(bool(params.get(f, False)) for f in _FLAG_NAMES))
    return ["main"] * _NUM_MAIN[prim] + [n for n, f in zip(Operands._fields, flags) if f]


def _map_batcher(prim, args, dims, params):
    """vmap as a sequential lax.map over the vmapped axis (for per-example sinks, which the
    batch axis cannot absorb)."""
    batched = [i for i, d in enumerate(dims) if d is not None]

    def one(xs):
        full = list(args)
        for i, x in zip(batched, xs):
            full[i] = x
        return prim.bind(*full, **params)

    outs = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in batched])
    return outs, [0] * len(outs)


def _make_batcher(prim):
    """The rule for ``batching.fancy_primitive_batchers``: JAX 0.5.0 through the newest call it as
    ``rule(axis_data, args, dims, **params)`` (``axis_data.size`` is the vmapped size) and, unlike
    the legacy ``primitive_batchers``, also when no operand is batched."""
    def batcher(axis_data, args, dims, **params):
        if all(d is None for d in dims):  # nothing vmapped: bind as is, outputs unbatched
            outs = prim.bind(*args, **params)
            return outs, [None] * len(outs)
        roles = operand_roles(prim, params)
        if any(r == "sinks" and d is not None for r, d in zip(roles, dims)):
            return _map_batcher(prim, args, dims, params)
        size = axis_data.size
        q, q_dim = args[0], dims[0]
        # The operand's own batch size (needed to unfold even when size or batch is 0).
        batch = q.shape[1] if q_dim == 0 else q.shape[0]
        bias_grad = bool(params.get("bias_grad", False))
        folded, bias_batch = [], 1
        for x, d, role in zip(args, dims, roles):
            if role == "sinks":
                folded.append(x)
            elif role in ("bias", "mask"):
                if role == "bias":
                    bias_batch = x.shape[0 if d is None or d > 0 else 1]
                folded.append(_fold_broadcast(x, d, size, batch,
                                              keep_unbatched=not (role == "bias" and bias_grad)))
            else:
                folded.append(_fold(x, d, size))
        outs = prim.bind(*folded, **params)
        outs = [o.reshape((size, batch) + o.shape[1:]) for o in outs]
        if bias_grad and bias_batch == 1:  # dbias of a batch-broadcast bias: sum that axis
            outs[-1] = jnp.sum(outs[-1], axis=1, keepdims=True)
        return outs, [0] * len(outs)
    return batcher


batching.fancy_primitive_batchers[fwd_p] = _make_batcher(fwd_p)
batching.fancy_primitive_batchers[bwd_p] = _make_batcher(bwd_p)


# ---------------------------------------------------------------- differentiation

NO_JVP_MESSAGE = (
    "flash_attention supports only first-order reverse-mode differentiation (jax.grad, jax.vjp, "
    "jax.jacrev). Forward-mode (jax.jvp, jax.jacfwd) and higher-order derivatives "
    "(grad of grad, jax.hessian) are not implemented by '{}'; use "
    "jax_flash_metal.reference_attention, which is plain jax.numpy, for those."
)


def _make_no_jvp(prim):
    def jvp(primals, tangents, **params):
        raise TypeError(NO_JVP_MESSAGE.format(prim.name))
    return jvp


ad.primitive_jvps[fwd_p] = _make_no_jvp(fwd_p)
ad.primitive_jvps[bwd_p] = _make_no_jvp(bwd_p)


# ---------------------------------------------------------------- lowering

def _xla_fwd(*args, **params):
    (q, k, v), x = _split(fwd_p, args, params)
    return list(xla_attention.forward(q, k, v, x, **params))


def _xla_bwd(*args, **params):
    (q, k, v, o, lse, row_max, log_sum, do, g_lse), x = _split(bwd_p, args, params)
    return list(xla_attention.backward(q, k, v, o, lse, row_max, log_sum, do, g_lse, x,
                                       **params))


_XLA_LOWERING = {
    fwd_p: mlir.lower_fun(_xla_fwd, multiple_results=True),
    bwd_p: mlir.lower_fun(_xla_bwd, multiple_results=True),
}


def _platforms(ctx):
    return tuple(getattr(ctx.module_context, "platforms", None) or ("unknown",))


def _make_default_lowering(prim):
    """Every platform without a specific rule: the xla implementation."""
    def lowering(ctx, *args, **params):
        for platform in _platforms(ctx):
            implementations.resolve(params["implementation"], platform)  # raises if fused asked
        return _XLA_LOWERING[prim](ctx, *args, **params)
    return lowering


def _has_zero_size(ctx):
    return any(0 in aval.shape for aval in ctx.avals_in[:3])


_DIRECTION = {fwd_p: "fwd", bwd_p: "bwd"}


def feature_names(params):
    """Names of the optional features a call uses (as ``ffi_lowering.unsupported_reason`` and
    its error messages name them)."""
    names = [name for flag, name in (("has_bias", "bias"), ("has_mask", "mask"),
                                     ("has_segment_ids", "segment ids"), ("has_sinks", "sinks"))
             if params.get(flag)]
    if params.get("logits_soft_cap") is not None:
        names.append("logits_soft_cap")
    return tuple(names)


def _make_cpu_lowering(prim, ffi_name):
    def lowering(ctx, *args, **params):
        params = coerce_params(**params)
        q = ctx.avals_in[0]
        impl = implementations.resolve(params["implementation"], "cpu",
                                       call=(_DIRECTION[prim], q.dtype, q.shape[3],
                                             feature_names(params)))
        # Empty problems need no kernel launch; the xla implementation returns zeros / -inf.
        if impl == "xla" or _has_zero_size(ctx):
            return _XLA_LOWERING[prim](ctx, *args, **params)
        from . import ffi_lowering
        params["implementation"] = impl
        return getattr(ffi_lowering, ffi_name)(ctx, *args, **params)
    return lowering


mlir.register_lowering(fwd_p, _make_default_lowering(fwd_p))
mlir.register_lowering(bwd_p, _make_default_lowering(bwd_p))
mlir.register_lowering(fwd_p, _make_cpu_lowering(fwd_p, "lower_fwd"), platform="cpu")
mlir.register_lowering(bwd_p, _make_cpu_lowering(bwd_p, "lower_bwd"), platform="cpu")
