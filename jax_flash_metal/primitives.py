"""The two flash-attention primitives and their JAX rules.

fwd_p: bind(q, k, v, [q_lengths], [kv_lengths], **params) -> (o, lse)
bwd_p: bind(q, k, v, o, lse, do, g_lse, [q_lengths], [kv_lengths], **params) -> (dq, dk, dv)

Static params (exact types): scale: float, is_causal: bool, window_left: int, window_right: int
(-1 = unbounded), bottom_right: bool, has_q_lengths: bool, has_kv_lengths: bool,
implementation: str | None. A length operand is present only when its has_* flag is True.

Rules per primitive: abstract eval, eager impl (a cached ``jax.jit`` of the bind, so eager calls use
the same lowering as compiled ones), a batching rule that folds vmapped axes into the batch
dimension, a default lowering (``mlir.lower_fun`` of the xla implementation, ``xla_attention``,
every platform) and a
``cpu`` lowering that resolves ``implementation`` and, for "metal"/"emulator", hands over to
``ffi_lowering``. The organisation follows JAX's own cuDNN attention primitives.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import implementations, xla_attention
from ._jax_private import ShapedArray

fwd_p = Primitive("flash_attention_fwd")
fwd_p.multiple_results = True
bwd_p = Primitive("flash_attention_bwd")
bwd_p.multiple_results = True

_NUM_MAIN = {fwd_p: 3, bwd_p: 7}  # operands before the optional lengths


def _split(prim, args, has_q_lengths, has_kv_lengths):
    """(main operands, q_lengths | None, kv_lengths | None); checks the operand count."""
    n = _NUM_MAIN[prim]
    expected = n + int(has_q_lengths) + int(has_kv_lengths)
    if len(args) != expected:
        raise ValueError(
            f"{prim.name} expects {expected} operands for has_q_lengths={has_q_lengths}, "
            f"has_kv_lengths={has_kv_lengths}, got {len(args)}"
        )
    rest = list(args[n:])
    q_lengths = rest.pop(0) if has_q_lengths else None
    kv_lengths = rest.pop(0) if has_kv_lengths else None
    return list(args[:n]), q_lengths, kv_lengths


def coerce_params(*, scale, is_causal, window_left, window_right, bottom_right, has_q_lengths,
                  has_kv_lengths, implementation):
    """The static params with their exact Python types (FFI attributes are typed)."""
    return dict(scale=float(scale), is_causal=bool(is_causal), window_left=int(window_left),
                window_right=int(window_right), bottom_right=bool(bottom_right),
                has_q_lengths=bool(has_q_lengths), has_kv_lengths=bool(has_kv_lengths),
                implementation=None if implementation is None else str(implementation))


# ---------------------------------------------------------------- abstract evaluation

def _check_lengths_aval(name, x, batch):
    if x is not None and (x.shape != (batch,) or x.dtype != jnp.int32):
        raise ValueError(f"{name} must be int32 [{batch}], got {x.dtype}{list(x.shape)}")


def _fwd_abstract(*args, has_q_lengths, has_kv_lengths, **_):
    (q, k, v), ql, kl = _split(fwd_p, args, has_q_lengths, has_kv_lengths)
    batch, q_len, num_heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim or (
            num_heads % k.shape[2]):
        raise ValueError(f"flash_attention_fwd: incompatible shapes q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    _check_lengths_aval("q_lengths", ql, batch)
    _check_lengths_aval("kv_lengths", kl, batch)
    return (ShapedArray(q.shape, q.dtype),
            ShapedArray((batch, num_heads, q_len), jnp.float32))


def _bwd_abstract(*args, has_q_lengths, has_kv_lengths, **_):
    (q, k, v, o, lse, do, g_lse), ql, kl = _split(bwd_p, args, has_q_lengths, has_kv_lengths)
    batch, q_len, num_heads, _ = q.shape
    if o.shape != q.shape or do.shape != q.shape or k.shape != v.shape:
        raise ValueError(f"flash_attention_bwd: incompatible shapes q {q.shape}, o {o.shape}, "
                         f"do {do.shape}, k {k.shape}, v {v.shape}")
    for name, x in (("lse", lse), ("g_lse", g_lse)):
        if x.shape != (batch, num_heads, q_len):
            raise ValueError(f"flash_attention_bwd: {name} must be [{batch}, {num_heads}, "
                             f"{q_len}], got {list(x.shape)}")
    _check_lengths_aval("q_lengths", ql, batch)
    _check_lengths_aval("kv_lengths", kl, batch)
    return (ShapedArray(q.shape, q.dtype), ShapedArray(k.shape, k.dtype),
            ShapedArray(v.shape, v.dtype))


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


def _make_batcher(prim):
    def batcher(args, dims, **params):
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        q, q_dim = args[0], dims[0]
        # The operand's own batch size (needed to unfold even when size or batch is 0).
        batch = q.shape[1] if q_dim == 0 else q.shape[0]
        outs = prim.bind(*(_fold(x, d, size) for x, d in zip(args, dims)), **params)
        outs = [o.reshape((size, batch) + o.shape[1:]) for o in outs]
        return outs, [0] * len(outs)
    return batcher


batching.primitive_batchers[fwd_p] = _make_batcher(fwd_p)
batching.primitive_batchers[bwd_p] = _make_batcher(bwd_p)


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

def _xla_fwd(*args, has_q_lengths, has_kv_lengths, **params):
    (q, k, v), ql, kl = _split(fwd_p, args, has_q_lengths, has_kv_lengths)
    return list(xla_attention.forward(q, k, v, ql, kl, **params))


def _xla_bwd(*args, has_q_lengths, has_kv_lengths, **params):
    main, ql, kl = _split(bwd_p, args, has_q_lengths, has_kv_lengths)
    return list(xla_attention.backward(*main, ql, kl, **params))


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


def _make_cpu_lowering(prim, ffi_name):
    def lowering(ctx, *args, **params):
        params = coerce_params(**params)
        q = ctx.avals_in[0]
        impl = implementations.resolve(params["implementation"], "cpu",
                                       call=(_DIRECTION[prim], q.dtype, q.shape[3]))
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
