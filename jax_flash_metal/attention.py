"""Public ``flash_attention``: validation, then the two primitives paired by ``jax.custom_vjp``."""

from __future__ import annotations

from functools import partial
from typing import Hashable, Literal, overload

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.typing import ArrayLike

from . import ring_attention
from .core import validation
from .core._jax_private import vary_together
from .core.contract import ImplementationChoice, Operands
from .core.options import Options, Window
from .cudnn import attention as cudnn
from .lowering import dispatch, sharding
from .lowering.primitives import NO_JVP_MESSAGE, bwd_p, fwd_p


class _Static:
    """A static value carried in custom_vjp residuals (a pytree with no leaves)."""

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda v, _: _Static(v))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(params, q, k, v, operands):
    o, lse, _, _ = fwd_p.bind(q, k, v, *operands.present(), **params._asdict())
    return o, lse


def _unwrap(x):
    """(value, perturbed) of a symbolic-zeros custom_vjp primal (or None)."""
    return (None, False) if x is None else (x.value, x.perturbed)


def _attention_fwd(params, q, k, v, operands):
    q, k, v = (x.value for x in (q, k, v))
    unwrapped = [_unwrap(x) for x in operands]
    operands = Operands(*(x for x, _ in unwrapped))
    if operands.page_table is not None:
        raise TypeError(PAGED_NO_GRAD_MESSAGE)
    bias_grad, alibi_grad = (unwrapped[Operands._fields.index(n)][1]
                             for n in ("bias", "alibi_slopes"))
    o, lse, row_max, log_sum = fwd_p.bind(q, k, v, *operands.present(), **params._asdict())
    return (o, lse), (q, k, v, o, lse, row_max, log_sum, operands,
                      _Static((bias_grad, alibi_grad)))


PAGED_NO_GRAD_MESSAGE = (
    "flash_attention with page_table (a paged KV cache) is forward only: reverse-mode "
    "differentiation through it is not implemented. To differentiate, pass the cache as "
    "contiguous key/value (jax_flash_metal.paging.gather) without page_table.")


def _dense(ct, like, dtype):
    """A cotangent as an array (symbolic zeros become zeros)."""
    if isinstance(ct, SymbolicZero):
        return jnp.zeros(like.shape, dtype)
    return ct.astype(dtype)


def _attention_bwd(params, residuals, cotangents):
    q, k, v, o, lse, row_max, log_sum, operands, wanted = residuals
    bias_grad, alibi_grad = wanted.value
    do, g_lse = _dense(cotangents[0], o, q.dtype), _dense(cotangents[1], lse, jnp.float32)
    grads = bwd_p.bind(q, k, v, o, lse, row_max, log_sum, do, g_lse, *operands.present(),
                       bias_grad=bias_grad, alibi_grad=alibi_grad, **params._asdict())
    dq, dk, dv = (sharding.like_primal(g, x) for g, x in zip(grads[:3], (q, k, v)))
    dbias = (sharding.like_primal(grads[3].astype(operands.bias.dtype), operands.bias)
             if bias_grad else None)
    dslopes = sharding.like_primal(grads[-1], operands.alibi_slopes) if alibi_grad else None
    dsinks = None if operands.sinks is None else _sinks_grad(operands.sinks, o, row_max,
                                                             log_sum, do, g_lse)
    return dq, dk, dv, operands._replace(q_lengths=None, kv_lengths=None, q_segment_ids=None,
                                         kv_segment_ids=None, bias=dbias, mask=None,
                                         sinks=dsinks, alibi_slopes=dslopes, dropout=None)


def _sinks_grad(sinks, o, row_max, log_sum, do, g_lse):
    """dsinks_n = sum over (batch, row) of P_sink (g_lse - rowsum(dO * O)), P_sink =
    exp((sink_n - m) - log(l)) from the forward's residuals (exact at any offset, as the
    backward's P): the sink is a logit whose value is 0, so it enters only through the
    denominator. Computed from the forward's outputs (no kernel needed), in a fixed order."""
    rowsum = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    # A probability is at most 1; the clamp is exact and keeps exp finite when the kernels'
    # row max saturated below a huge sink (sink - m then overflows).
    p_sink = jnp.minimum(jnp.exp((sinks[None, :, None] - row_max) - log_sum), 1.0)
    return jnp.sum(p_sink * (g_lse - rowsum), axis=(0, 2))


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


# Static checkers see the return type from return_lse and return_residual: jax.Array, or
# (out, lse) / (out, residual).
@overload
def flash_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    scale: ArrayLike | None = None, is_causal: bool = False,
                    query_seq_lengths: ArrayLike | None = None,
                    key_value_seq_lengths: ArrayLike | None = None,
                    local_window_size: Window = None,
                    implementation: ImplementationChoice | None = None,
                    query_segment_ids: ArrayLike | None = None,
                    key_value_segment_ids: ArrayLike | None = None,
                    logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                    causal_alignment: str = "top_left",
                    alibi_slopes: ArrayLike | None = None, page_table: ArrayLike | None = None,
                    sequence_axis_name: Hashable | None = None,
                    sequence_layout: str = "contiguous",
                    sequence_strategy: str | None = None,
                    dropout_rate: float = 0.0, dropout_rng: ArrayLike | None = None,
                    return_lse: Literal[False] = False,
                    return_residual: Literal[False] = False) -> jax.Array: ...


@overload
def flash_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    scale: ArrayLike | None = None, is_causal: bool = False,
                    query_seq_lengths: ArrayLike | None = None,
                    key_value_seq_lengths: ArrayLike | None = None,
                    local_window_size: Window = None,
                    implementation: ImplementationChoice | None = None,
                    query_segment_ids: ArrayLike | None = None,
                    key_value_segment_ids: ArrayLike | None = None,
                    logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                    causal_alignment: str = "top_left",
                    alibi_slopes: ArrayLike | None = None, page_table: ArrayLike | None = None,
                    sequence_axis_name: Hashable | None = None,
                    sequence_layout: str = "contiguous",
                    sequence_strategy: str | None = None,
                    dropout_rate: float = 0.0, dropout_rng: ArrayLike | None = None,
                    return_lse: Literal[True],
                    return_residual: Literal[False] = False) -> tuple[jax.Array, jax.Array]: ...


@overload
def flash_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    scale: ArrayLike | None = None, is_causal: bool = False,
                    query_seq_lengths: ArrayLike | None = None,
                    key_value_seq_lengths: ArrayLike | None = None,
                    local_window_size: Window = None,
                    implementation: ImplementationChoice | None = None,
                    query_segment_ids: ArrayLike | None = None,
                    key_value_segment_ids: ArrayLike | None = None,
                    logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                    causal_alignment: str = "top_left",
                    alibi_slopes: ArrayLike | None = None, page_table: ArrayLike | None = None,
                    sequence_axis_name: Hashable | None = None,
                    sequence_layout: str = "contiguous",
                    sequence_strategy: str | None = None,
                    dropout_rate: float = 0.0, dropout_rng: ArrayLike | None = None,
                    return_lse: Literal[False] = False,
                    return_residual: Literal[True]) -> tuple[jax.Array, jax.Array]: ...


@overload
def flash_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    scale: ArrayLike | None = None, is_causal: bool = False,
                    query_seq_lengths: ArrayLike | None = None,
                    key_value_seq_lengths: ArrayLike | None = None,
                    local_window_size: Window = None,
                    implementation: ImplementationChoice | None = None,
                    query_segment_ids: ArrayLike | None = None,
                    key_value_segment_ids: ArrayLike | None = None,
                    logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                    causal_alignment: str = "top_left",
                    alibi_slopes: ArrayLike | None = None, page_table: ArrayLike | None = None,
                    sequence_axis_name: Hashable | None = None,
                    sequence_layout: str = "contiguous",
                    sequence_strategy: str | None = None,
                    dropout_rate: float = 0.0, dropout_rng: ArrayLike | None = None,
                    return_lse: bool = False,
                    return_residual: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]: ...


def flash_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    scale: ArrayLike | None = None, is_causal: bool = False,
                    query_seq_lengths: ArrayLike | None = None,
                    key_value_seq_lengths: ArrayLike | None = None,
                    local_window_size: Window = None,
                    implementation: ImplementationChoice | None = None,
                    query_segment_ids: ArrayLike | None = None,
                    key_value_segment_ids: ArrayLike | None = None,
                    logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                    causal_alignment: str = "top_left",
                    alibi_slopes: ArrayLike | None = None, page_table: ArrayLike | None = None,
                    sequence_axis_name: Hashable | None = None,
                    sequence_layout: str = "contiguous",
                    sequence_strategy: str | None = None,
                    dropout_rate: float = 0.0, dropout_rng: ArrayLike | None = None,
                    return_lse: bool = False,
                    return_residual: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Fused scaled dot-product attention (FlashAttention-2 forward and recompute backward).

    A drop-in for ``jax.nn.dot_product_attention``: every keyword it takes means the same here
    (``implementation`` names this package's implementations); the differences (a row with no
    visible key outputs 0, not the mean of V; non-finite inputs; integer inputs) are listed in
    docs/jax-nn.md. Every keyword, its default and its rules: docs/api.md (the keywords are the
    fields of ``core.options.Options``).

    Shapes (BTNH, as jax.nn; every leading batch axis may be dropped, rank 3 = batch 1):
      query [batch, q_len, num_heads, Dk]; key [batch, kv_len, num_kv_heads, Dk]; value
      [batch, kv_len, num_kv_heads, Dv]; num_heads % num_kv_heads == 0 (grouped-query
      attention); with ``page_table``, key and value are pages [num_pages, page_size,
      num_kv_heads, D]. bias (float) and mask (bool, True = attend) broadcast to
      [batch, num_heads, q_len, kv_len].
    Dtypes: query, key and value share float32, float16 or bfloat16; softmax math and
      accumulation are float32. Array arguments take what ``jnp.asarray`` takes.
    Returns:
      out [batch, q_len, num_heads, Dv] in the query's dtype; with ``return_lse=True`` also
      lse, float32 [batch, num_heads, q_len], natural log (-inf for a row with no visible key,
      the sink with ``sinks``); with ``return_residual=True`` (jax.nn's name) also that lse in
      jax.nn's layout [batch, q_len, num_heads] and the query's dtype, with no gradient.
    Raises:
      TypeError / ValueError at trace time, naming the argument, for bad shapes, dtypes and
      values (ValueError for return_lse and return_residual together); ValueError at trace time
      when every name of ``implementation`` is "cudnn" and cuDNN cannot run the call, saying why
      (``cudnn.unsupported_reason``); NotImplementedError at lowering when the last requested
      implementation cannot run the call there, saying why; ValueError at lowering for a dtype or
      head dims without fused kernels, asked for explicitly; TypeError when a paged call, or any
      call in forward mode or to second order, is differentiated.
    Differentiable in reverse mode, first order (``jax.custom_vjp``), w.r.t. query, key, value,
    bias, sinks and alibi_slopes. ``implementation`` is a name or names to try in order;
    ``None`` is the platform's chain (("cudnn", "xla") on an NVIDIA GPU, ("metal", "xla") on a
    Mac with the extension, else "xla"; $JAX_FLASH_METAL_IMPLEMENTATION overrides it): "cudnn"
    is decided when this function is traced, the others when the computation is lowered
    (docs/gpu.md). ``sequence_axis_name`` runs context parallelism over a ``shard_map`` axis
    (K/V all-gathered, or passed around a ring: ``sequence_strategy``). Operands sharded over
    batch or heads (Auto or Explicit mesh axes, ``jax.set_mesh``) give outputs and gradients
    with their shardings; docs/parallelism.md.

    Method: Dao, "FlashAttention-2" (2023): online softmax over key blocks; the backward
    recomputes P from (q, k, lse) with D = rowsum(dO * O) - g_lse. Ring attention: Liu et al.
    (2023); striped layout: Brandon et al. (2023); zigzag layout: MaxText's "dual chunk swap";
    dropout: Philox-4x32-10 (Salmon et al., 2011) over the positions.
    """
    options = Options.of(locals())
    residual = _residual_wanted(options)
    if residual:
        options = options._replace(return_lse=True)
    if options.sequence_axis_name is not None:
        result = ring_attention.ring_flash_attention(query, key, value, bias, mask, options)
    else:
        result = attend(query, key, value, bias, mask, options)
    return _as_residual(result) if residual else result


def _residual_wanted(options: Options) -> bool:
    """``return_residual``, checked: jax.nn's spelling of ``return_lse``, never with it."""
    if not validation.check_bool(options.return_residual, "return_residual"):
        return False
    if validation.check_bool(options.return_lse, "return_lse"):
        raise ValueError("return_lse and return_residual both ask for the log-sum-exp (ours: "
                         "float32 [batch, num_heads, q_len], differentiable; jax.nn's: "
                         "[batch, q_len, num_heads] in the query's dtype, no gradient): pass "
                         "only one of them")
    return True


def _as_residual(result):
    """(out, lse) as jax.nn's (out, residual): lse [..., num_heads, q_len] float32 becomes
    [..., q_len, num_heads] in out's dtype, with no gradient (as jax.nn's)."""
    out, lse = result
    return out, jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(out.dtype))


def attend(query, key, value, bias, mask, options: Options, dropout_broadcast=False):
    """``flash_attention`` on one device (``options.sequence_axis_name`` None);
    ``dropout_broadcast``: one keep mask for every batch entry and head (the Flax
    integration's ``broadcast_dropout``)."""
    q, k, v, operands, params = validation.check_inputs(query, key, value, bias, mask, options,
                                                        dropout_broadcast)
    use_cudnn, rest = dispatch.trace_choice(
        params.implementation, lambda: _cudnn_reason(q, k, v, params, options.return_lse))
    if use_cudnn:
        # cuDNN's backward takes even lengths only (jax's check_is_flash_attention): for odd
        # ones the gradients come from the xla implementation.
        attend_cudnn = _cudnn_xla_grad if (q.shape[1] | k.shape[1]) % 2 else cudnn.attend
        out = attend_cudnn(q, k, v, operands, params)
        return validation.restore_rank(query, out, None, False)
    params = params._replace(implementation=rest)
    q, k, v, operands = vary_together((q, k, v, operands))
    try:
        out, lse = _attention(params, q, k, v, operands)
    except TypeError as e:
        # JAX's own message ("can't apply forward-mode autodiff (jvp) to a custom_vjp function")
        # does not say which function or what to do instead.
        if "forward-mode" in str(e) and "custom_vjp" in str(e):
            raise TypeError(NO_JVP_MESSAGE) from e
        raise
    return validation.restore_rank(query, out, lse, options.return_lse)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cudnn_xla_grad(q, k, v, operands, params):
    """``cudnn.attend`` with the xla implementation's gradients (recomputing its forward)."""
    return cudnn.attend(q, k, v, operands, params)


def _cudnn_xla_grad_fwd(q, k, v, operands, params):
    return cudnn.attend(q, k, v, operands, params), (q, k, v, operands)


def _cudnn_xla_grad_bwd(params, residuals, do):
    q, k, v, operands = residuals
    xla = params._replace(implementation=("xla",))
    _, vjp = jax.vjp(lambda q, k, v: _attention(xla, q, k, v, operands)[0], q, k, v)
    return (*vjp(do), Operands())


_cudnn_xla_grad.defvjp(_cudnn_xla_grad_fwd, _cudnn_xla_grad_bwd)


def _cudnn_reason(q, k, v, params, return_lse):
    """Why cuDNN cannot run this call on the default device (``cudnn``), or None."""
    reason, capability, version = cudnn.device_facts()
    return reason or cudnn.unsupported_reason(q, k, v, params, return_lse=return_lse,
                                              capability=capability, version=version)
