"""The two flash-attention primitives and their JAX rules, one section per rule:

    fwd_p: bind(q, k, v, *optional, **params) -> (o, lse, row_max, log_sum)
    bwd_p: bind(q, k, v, o, lse, row_max, log_sum, do, g_lse, *optional, bias_grad=...,
                **params) -> (dq, dk, dv[, dbias])

with the operands and static params of ``contract`` (``contract.Operands`` in field order,
``contract.StaticParams``). row_max and log_sum (float32 [B, H, Tq]) are residuals only: the
row's maximum score m and log(l), kept apart so that the backwards' P = exp((S - m) - log(l))
stays exact for rows at a huge offset (docs/design.md#outputs-and-residuals). Abstract eval,
eager impl, batching, the forward-mode error, the default lowering (the xla implementation with
the accelerators' block schedule, ``xla_schedule``) and the ``cpu`` lowering (the fused
implementations through ``implementations``, else the xla implementation with the cpu
schedule), both through ``sharding``'s custom partitioning, so a call partitions under jit with
sharded operands: docs/design.md#the-primitive-layer. Results carry JAX's types: the operands'
varying manual axes inside ``shard_map`` and, on Explicit mesh axes, the batch/head shardings
(docs/parallelism.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import paging
from ..core import contract, dropout
from ..core._jax_private import (ShapedArray, prim_requires_devices_during_lowering,
                                 varying_axes)
from ..core.contract import Operands, coerce_params
from ..xla import attention as xla_attention
from ..xla import schedule as xla_schedule
from . import autotune, dispatch, sharding

fwd_p = Primitive("flash_attention_fwd")
fwd_p.multiple_results = True
bwd_p = Primitive("flash_attention_bwd")
bwd_p.multiple_results = True

_DIRECTION = {fwd_p: "fwd", bwd_p: "bwd"}


def _split(prim, args, params):
    """(main operands, contract.Operands); checks the operand count against the flags."""
    n = len(contract.MAIN_OPERANDS[_DIRECTION[prim]])
    flags = contract.operand_flags(params)
    try:
        return list(args[:n]), Operands.from_list(args[n:], flags)
    except ValueError as e:
        named = dict(zip(Operands._fields, flags))
        raise ValueError(f"{prim.name}: {e} for {named}") from None


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
    if x.alibi_slopes is not None and (x.alibi_slopes.shape != (batch, num_heads)
                                       or x.alibi_slopes.dtype != jnp.float32):
        bad("alibi_slopes", x.alibi_slopes, f"float32 [{batch}, {num_heads}]")
    if x.page_table is not None and (x.page_table.ndim != 2 or x.page_table.shape[0] != batch
                                     or x.page_table.dtype != jnp.int32):
        bad("page_table", x.page_table, f"int32 [{batch}, max_pages]")
    if x.dropout is not None and (x.dropout.shape != (batch, num_heads, dropout.WORDS)
                                  or x.dropout.dtype != jnp.uint32):
        bad("dropout", x.dropout, f"uint32 [{batch}, {num_heads}, {dropout.WORDS}]")


def kv_len(k, x: Operands):
    """The logical key count of a call: k's sequence axis, or max_pages * page_size when k
    holds pages (``paging``)."""
    return k.shape[1] if x.page_table is None else paging.logical_len(k, x.page_table)


def _check_shapes(prim, q, k, v, x, o_shape=None):
    """q [B, Tq, H, Dk], k [B, Tkv, HKV, Dk] (or pages [P, S, HKV, Dk]), v like k with its own
    Dv, and (backward) o/do [B, Tq, H, Dv]."""
    batch, _, num_heads, head_dim = q.shape
    kv_batch = batch if x.page_table is None else k.shape[0]
    if (k.shape[:3] != v.shape[:3] or k.shape[0] != kv_batch or k.shape[3] != head_dim
            or num_heads % k.shape[2]
            or (o_shape is not None and o_shape != q.shape[:3] + v.shape[3:])):
        raise ValueError(f"{prim.name}: incompatible shapes q {q.shape}, k {k.shape}, "
                         f"v {v.shape}" + ("" if o_shape is None else f", o/do {o_shape}"))


def _typed(prim, params, avals, outs):
    """The results ``outs`` (ShapedArrays of shape and dtype) with the types JAX gives arrays
    inside ``shard_map`` and on meshes with Explicit axes: the varying manual axes of the
    operands (all of them: a result depends on every operand) and the shardings of
    ``sharding.result_shardings``."""
    varying = [varying_axes(a) for a in avals]
    union = frozenset().union(*varying)
    template = next((a for a, v in zip(avals, varying) if v == union), None)
    if template is None:
        raise ValueError(f"{prim.name}: operands vary over different manual axes {varying}; "
                         "pass them all varying over the same axes (jax.lax.pcast)")
    shardings = sharding.result_shardings(_DIRECTION[prim], params, avals,
                                          [o.shape for o in outs])
    return tuple(template.update(shape=o.shape, dtype=o.dtype, weak_type=False, sharding=s)
                 for o, s in zip(outs, shardings))


def _fwd_abstract(*args, **params):
    (q, k, v), x = _split(fwd_p, args, params)
    batch, q_len, num_heads, _ = q.shape
    _check_shapes(fwd_p, q, k, v, x)
    _check_operand_avals(fwd_p, x, batch, num_heads, q_len, kv_len(k, x))
    row = ShapedArray((batch, num_heads, q_len), jnp.float32)
    return _typed(fwd_p, params, args, (ShapedArray(q.shape[:3] + v.shape[3:], q.dtype),
                                        row, row, row))


def _bwd_abstract(*args, bias_grad=False, alibi_grad=False, **params):
    (q, k, v, o, lse, row_max, log_sum, do, g_lse), x = _split(bwd_p, args, params)
    batch, q_len, num_heads, _ = q.shape
    if o.shape != do.shape:
        raise ValueError(f"flash_attention_bwd: o {o.shape} and do {do.shape} differ")
    _check_shapes(bwd_p, q, k, v, x, o.shape)
    for name, y in (("lse", lse), ("row_max", row_max), ("log_sum", log_sum),
                    ("g_lse", g_lse)):
        if y.shape != (batch, num_heads, q_len):
            raise ValueError(f"flash_attention_bwd: {name} must be [{batch}, {num_heads}, "
                             f"{q_len}], got {list(y.shape)}")
    if bias_grad and x.bias is None:
        raise ValueError("flash_attention_bwd: bias_grad=True needs a bias operand")
    if alibi_grad and x.alibi_slopes is None:
        raise ValueError("flash_attention_bwd: alibi_grad=True needs an alibi_slopes operand")
    if x.page_table is not None:
        raise ValueError("flash_attention_bwd: a paged call has no backward")
    _check_operand_avals(bwd_p, x, batch, num_heads, q_len, k.shape[1])
    outs = [ShapedArray(q.shape, q.dtype), ShapedArray(k.shape, k.dtype),
            ShapedArray(v.shape, v.dtype)]
    if bias_grad:
        outs.append(ShapedArray(x.bias.shape, jnp.float32))
    if alibi_grad:
        outs.append(ShapedArray(x.alibi_slopes.shape, jnp.float32))
    return _typed(bwd_p, dict(params, bias_grad=bias_grad, alibi_grad=alibi_grad), args, outs)


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
        roles = contract.operand_roles(_DIRECTION[prim], params)
        # Per-example sinks or (shared) pages: the batch axis cannot absorb them.
        unfoldable = ("sinks", "k", "v") if params.get("has_page_table") else ("sinks",)
        if any(r in unfoldable and d is not None for r, d in zip(roles, dims)):
            return _map_batcher(prim, args, dims, params)
        size = axis_data.size
        q, q_dim = args[0], dims[0]
        # The operand's own batch size (needed to unfold even when size or batch is 0).
        batch = q.shape[1] if q_dim == 0 else q.shape[0]
        bias_grad = bool(params.get("bias_grad", False))
        folded, bias_batch = [], 1
        for x, d, role in zip(args, dims, roles):
            if role in unfoldable:  # unbatched here
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
            outs[3] = jnp.sum(outs[3], axis=1, keepdims=True)
        return outs, [0] * len(outs)
    return batcher


batching.fancy_primitive_batchers[fwd_p] = _make_batcher(fwd_p)
batching.fancy_primitive_batchers[bwd_p] = _make_batcher(bwd_p)


# ---------------------------------------------------------------- differentiation

# Names the public function, not the primitive a transform happened to reach.
NO_JVP_MESSAGE = (
    "flash_attention supports only first-order reverse-mode differentiation (jax.grad, jax.vjp, "
    "jax.jacrev); forward-mode (jax.jvp, jax.jacfwd) and higher-order derivatives (grad of "
    "grad, jax.hessian) of it are not implemented. Use jax_flash_metal.reference_attention "
    "(same arguments, plain jax.numpy) for those."
)


def _no_jvp(primals, tangents, **params):
    raise TypeError(NO_JVP_MESSAGE)


ad.primitive_jvps[fwd_p] = _no_jvp
ad.primitive_jvps[bwd_p] = _no_jvp


# ---------------------------------------------------------------- lowering

def _xla_fwd(*args, schedule, **params):
    (q, k, v), x = _split(fwd_p, args, params)
    return list(xla_attention.forward(q, k, v, x, schedule=schedule, **params))


def _xla_bwd(*args, schedule, **params):
    (q, k, v, o, lse, row_max, log_sum, do, g_lse), x = _split(bwd_p, args, params)
    return list(xla_attention.backward(q, k, v, o, lse, row_max, log_sum, do, g_lse, x,
                                       schedule=schedule, **params))


_XLA_IMPL = {fwd_p: _xla_fwd, bwd_p: _xla_bwd}


@functools.lru_cache(maxsize=None)
def _xla_body(prim, schedule):
    return functools.partial(_XLA_IMPL[prim], schedule=schedule)


def _xla_lowering(prim, ctx, args, params, platform):
    """The xla implementation with the block schedule of ``platform``, looked up now
    (``xla_schedule``), partitioned by ``sharding``."""
    body = _xla_body(prim, xla_schedule.for_platform(platform))
    return sharding.lower(prim, _DIRECTION[prim], ctx, args, params, body)


def _platforms(ctx):
    return tuple(getattr(ctx.module_context, "platforms", None) or ("unknown",))


def _make_default_lowering(prim):
    """Every platform without a specific rule (the accelerators): the xla implementation with
    the default (large-block) schedule."""
    def lowering(ctx, *args, **params):
        for platform in _platforms(ctx):
            dispatch.resolve(params["implementation"], platform)  # raises if fused asked
        return _xla_lowering(prim, ctx, args, params, "default")
    return lowering


def _has_zero_size(ctx):
    return any(0 in aval.shape for aval in ctx.avals_in[:3])


def _make_cpu_lowering(prim):
    direction = _DIRECTION[prim]

    def lowering(ctx, *args, **params):
        params = coerce_params(**params)
        q, k, v = ctx.avals_in[:3]
        page_size = k.shape[1] if params["has_page_table"] else None  # k holds pages
        impl = dispatch.resolve(
            params["implementation"], "cpu", call=(direction, q.dtype, q.shape[3], v.shape[3]),
            missing=dispatch.missing_features(params, page_size))
        # Empty problems need no kernel launch; the xla implementation returns zeros / -inf.
        if impl == "xla" or _has_zero_size(ctx):
            return _xla_lowering(prim, ctx, args, params, "cpu")
        params["implementation"] = impl
        params["kernel_variant"] = autotune.choose(direction, impl, ctx.avals_in, params,
                                                   {d: p for p, d in _DIRECTION.items()})
        return sharding.lower(prim, direction, ctx, args, params,
                              dispatch.fused_lowering(direction), fused=True)
    return lowering


mlir.register_lowering(fwd_p, _make_default_lowering(fwd_p))
mlir.register_lowering(bwd_p, _make_default_lowering(bwd_p))
mlir.register_lowering(fwd_p, _make_cpu_lowering(fwd_p), platform="cpu")
mlir.register_lowering(bwd_p, _make_cpu_lowering(bwd_p), platform="cpu")
# Both lowerings emit a custom_partitioning call (sharding), which needs the devices.
prim_requires_devices_during_lowering.update((fwd_p, bwd_p))
