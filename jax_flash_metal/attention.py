"""Public ``flash_attention``: validation, then the two primitives paired by ``jax.custom_vjp``."""

from __future__ import annotations

from functools import partial
from typing import Hashable, Literal, Optional, Tuple, Union, overload

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.typing import ArrayLike

from . import ring_attention, validation
from .primitives import NO_JVP_MESSAGE, bwd_p, fwd_p
from .contract import Implementation, Operands

# local_window_size: None, w, or (left, right) with None for an unbounded side.
Window = Optional[Union[int, Tuple[Optional[int], Optional[int]]]]


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
    dq, dk, dv = grads[:3]
    dbias = grads[3].astype(operands.bias.dtype) if bias_grad else None
    dslopes = grads[-1] if alibi_grad else None
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
    p_sink = jnp.exp((sinks[None, :, None] - row_max) - log_sum)
    return jnp.sum(p_sink * (g_lse - rowsum), axis=(0, 2))


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


# Static checkers see the return type from return_lse: jax.Array, or (out, lse).
@overload
def flash_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    scale: ArrayLike | None = None, is_causal: bool = False,
                    query_seq_lengths: ArrayLike | None = None,
                    key_value_seq_lengths: ArrayLike | None = None,
                    local_window_size: Window = None,
                    implementation: Implementation | None = None,
                    query_segment_ids: ArrayLike | None = None,
                    key_value_segment_ids: ArrayLike | None = None,
                    logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                    causal_alignment: str = "top_left",
                    alibi_slopes: ArrayLike | None = None, page_table: ArrayLike | None = None,
                    sequence_axis_name: Hashable | None = None,
                    sequence_layout: str = "contiguous",
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
                    implementation: Implementation | None = None,
                    query_segment_ids: ArrayLike | None = None,
                    key_value_segment_ids: ArrayLike | None = None,
                    logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                    causal_alignment: str = "top_left",
                    alibi_slopes: ArrayLike | None = None, page_table: ArrayLike | None = None,
                    sequence_axis_name: Hashable | None = None,
                    sequence_layout: str = "contiguous",
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
                    implementation: Implementation | None = None,
                    query_segment_ids: ArrayLike | None = None,
                    key_value_segment_ids: ArrayLike | None = None,
                    logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                    causal_alignment: str = "top_left",
                    alibi_slopes: ArrayLike | None = None, page_table: ArrayLike | None = None,
                    sequence_axis_name: Hashable | None = None,
                    sequence_layout: str = "contiguous",
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
                    implementation: Implementation | None = None,
                    query_segment_ids: ArrayLike | None = None,
                    key_value_segment_ids: ArrayLike | None = None,
                    logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                    causal_alignment: str = "top_left",
                    alibi_slopes: ArrayLike | None = None, page_table: ArrayLike | None = None,
                    sequence_axis_name: Hashable | None = None,
                    sequence_layout: str = "contiguous",
                    dropout_rate: float = 0.0, dropout_rng: ArrayLike | None = None,
                    return_lse: bool = False,
                    return_residual: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]: ...


def flash_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    scale: ArrayLike | None = None, is_causal: bool = False,
                    query_seq_lengths: ArrayLike | None = None,
                    key_value_seq_lengths: ArrayLike | None = None,
                    local_window_size: Window = None,
                    implementation: Implementation | None = None,
                    query_segment_ids: ArrayLike | None = None,
                    key_value_segment_ids: ArrayLike | None = None,
                    logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                    causal_alignment: str = "top_left",
                    alibi_slopes: ArrayLike | None = None, page_table: ArrayLike | None = None,
                    sequence_axis_name: Hashable | None = None,
                    sequence_layout: str = "contiguous",
                    dropout_rate: float = 0.0, dropout_rng: ArrayLike | None = None,
                    return_lse: bool = False,
                    return_residual: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Fused scaled dot-product attention (FlashAttention-2 forward and recompute backward).

    A drop-in for ``jax.nn.dot_product_attention``: every keyword it takes means the same here
    (``implementation`` names this package's implementations); the differences (a row with no
    visible key outputs 0, not the mean of V; non-finite inputs; integer inputs) are listed in
    docs/jax-nn.md.

    Layout as ``jax.nn.dot_product_attention`` (BTNH):
      query: [batch, q_len, num_heads, Dk]; key: [batch, kv_len, num_kv_heads, Dk]; value:
      [batch, kv_len, num_kv_heads, Dv] (Dv may differ from Dk; the output has Dv); or any of
      them without the batch axis (rank 3, batch 1). float32, float16 or
      bfloat16, all one dtype; num_heads % num_kv_heads == 0 (grouped-query attention: query
      head n reads kv head n // (num_heads // num_kv_heads)).
    Every array argument takes what ``jnp.asarray`` takes, as jax.nn does: JAX or NumPy arrays,
    (nested) Python lists, scalars where the shape allows (a scalar bias or mask).
    Args:
      bias: float, rank <= 4, broadcastable to [batch, num_heads, q_len, kv_len] (each axis 1
        or full; missing leading axes are 1); added to the (soft-capped) scores. A -inf entry
        hides that key exactly as a False mask entry (never NaN); +inf or NaN propagates.
        Differentiable (the gradient is summed over the broadcast axes).
      mask: bool, broadcastable like bias; True = the key takes part.
      scale: multiplies q.k; None means 1/sqrt(Dk). Any finite real number known at trace
        time (Python, NumPy or a concrete JAX scalar; 0 and negatives included) is used as
        given; NaN and +-inf raise ValueError.
      is_causal: key j visible to query i only if j <= i + off.
      query_seq_lengths, key_value_seq_lengths: integer [batch], clamped exactly to [0, len]
        in their own dtype, then cast to int32 (concrete ones, e.g. NumPy int64 2**40, are
        clamped in NumPy first; under jit a 64-bit argument reaches this function already
        converted by JAX, which wraps values >= 2**31 unless jax_enable_x64 is on); rows
        i >= q_len_b output 0, keys j >= kv_len_b are never read.
      local_window_size: None, int w (= (w, w)) or (left, right) with ints >= 0 or None
        (unbounded side): visible iff i + off - left <= j <= i + off + right (inclusive).
      implementation: None (best for the platform and this call, or
        $JAX_FLASH_METAL_IMPLEMENTATION), "xla", "metal" or "emulator"; resolved when the
        computation is lowered. The fused kernels implement every feature below, forward and
        backward (dbias: one float32 [batch, num_heads, q_len, kv_len] temporary, summed to the
        bias's shape).
      query_segment_ids, key_value_segment_ids: integer [batch, q_len] / [batch, kv_len]
        ([len] for rank-3 inputs), both or neither; key j visible to query i only when their
        ids are equal (packed sequences), compared exactly in any integer dtypes (64-bit or
        mixed ids are ranked jointly, not cast; TypeError for JAX arrays of two dtypes with no
        32-bit common dtype, and with ``sequence_axis_name`` unless both share one dtype of at
        most 32 bits).
      logits_soft_cap: None or a positive static float c: scores become c * tanh(s / c) before
        the bias (Gemma 2).
      sinks: float [num_heads]: one extra logit per query head in every row's softmax
        denominator, carrying no value (gpt-oss); differentiable.
      causal_alignment: "top_left" (off = 0, jax.nn / PyTorch) or "bottom_right"
        (off = kv_len_b - q_len_b, FlashAttention-2 / KV-cache decoding).
      alibi_slopes: float32 [num_heads] or [batch, num_heads]: ALiBi (Press et al., "Train
        Short, Test Long", 2022): -slope * |i + off - j| is added to each score after the soft
        cap, with the bias, computed from the slopes (no bias tensor). Differentiable.
      page_table: integer [batch, max_pages] (cast to int32): key and value are then a paged
        KV cache [num_pages, page_size, num_kv_heads, Dk or Dv] and logical key j of batch b
        is key[page_table[b, j // page_size], j % page_size] (kv_len = max_pages *
        page_size); key_value_seq_lengths is required. Entries past a row's last used page
        (ceil(kv_len_b / page_size)) are never read and may hold anything; a used entry must
        be in [0, num_pages). Composes with every other argument; forward only.
      sequence_axis_name: None, or the name of a ``shard_map`` mesh axis over which the
        sequence is split (context parallelism): device i of that axis passes its contiguous
        slice [i * T / n, (i + 1) * T / n) of query, key, value and segment ids (lengths count
        global positions, and stay whole), and gets exact attention over the whole sequence by
        ring attention (K/V passed around the axis with ``lax.ppermute``; Liu et al., "Ring
        Attention with Blockwise Transformers", 2023; ``ring_attention.py``). Causal, windows,
        lengths, alignment, segment ids, soft cap, sinks and grouped-query attention use global
        positions; bias, mask, alibi_slopes, page_table and dropout_rate > 0 raise ValueError,
        as does a name not bound there.
      sequence_layout: with ``sequence_axis_name``, "contiguous" (above) or "striped": device
        i holds positions i, i + n, i + 2n, ... (Brandon et al., "Striped Attention", 2023;
        causal work is then even across devices); ``ring_attention.stripe`` / ``unstripe``
        reorder whole arrays into / out of that layout. Without a sequence axis, only
        "contiguous" (ValueError otherwise).
      dropout_rate: a static float in [0, 1): attention dropout on the normalised
        probabilities, O = (P * M / (1 - dropout_rate)) V (inverted dropout; lse is that of the
        undropped scores, gradients those of this formula). M is ``dropout_mask(dropout_rng,
        (batch, num_heads, q_len, kv_len), dropout_rate)``: a pure function of the key, the
        batch index, query head, query and key positions and the rate (Philox-4x32-10 with
        the positions as its counter; ``jax_flash_metal.dropout``), the same for every
        implementation, shape and schedule, recomputed (not stored) by the backward; every
        implementation has it (a forward with dropout never runs the split-KV decode).
      dropout_rng: a JAX PRNG key (``jax.random.key`` with threefry's uint32 [2] key data, or a
        legacy uint32 [2] ``jax.random.PRNGKey``), required when dropout_rate > 0 (accepted
        and unused at 0). A traced operand: new keys under jit do not recompile. Under
        ``jax.vmap`` with a batched key each mapped element uses its own key, as a call per
        element would.
      return_lse: also return the log-sum-exp; gradients flow through it.
      return_residual: jax.nn's name for the log-sum-exp, in jax.nn's layout: also return it as
        [batch, q_len, num_heads] ([q_len, num_heads] for a rank-3 query) in the query's
        dtype, with no gradient (``lax.stop_gradient``, as jax.nn). ValueError with
        return_lse=True (ask for one of the two).
    Returns:
      out [batch, q_len, num_heads, Dv] (no batch axis for a rank-3 query), in the query's
      dtype; with return_lse=True, (out, lse) where lse is float32
      [batch, num_heads, q_len] ([num_heads, q_len] for a rank-3 query), natural log:
      log(exp(sink) + sum_j exp(s_ij)) with sinks. A row with no visible key has out = 0 and
      lse = -inf (the sink with sinks) and contributes nothing to any gradient but dsinks.
      With return_residual=True, (out, residual): that lse, transposed and cast as above.
    Raises:
      TypeError / ValueError (naming the argument) for bad ranks, shapes, dtypes, head counts,
      lengths, windows, alignment, scale, bias, mask, segment ids, soft cap, sinks, ALiBi
      slopes, page table, dropout rate or key, or implementation name; NotImplementedError at
      lowering when an explicitly requested implementation cannot run the call there (a fused
      one names what it lacks: a page size its kernels do not read); ValueError at lowering
      for a dtype, head dim or (Dk, Dv) pair without fused kernels, asked for explicitly;
      TypeError when a paged call is differentiated.
    Differentiable w.r.t. query, key, value, bias, sinks and alibi_slopes in reverse mode,
    first order only (jax.custom_vjp), except with page_table (TypeError when differentiated);
    softmax math is float32. Method: Dao, "FlashAttention-2" (2023), recompute
    backward from (q, k, v, o, lse, dO) with D = rowsum(dO * O) - g_lse.
    """
    return_lse = validation.check_bool(return_lse, "return_lse")
    return_residual = validation.check_bool(return_residual, "return_residual")
    if return_lse and return_residual:
        raise ValueError("return_lse and return_residual both ask for the log-sum-exp (ours: "
                         "float32 [batch, num_heads, q_len], differentiable; jax.nn's: "
                         "[batch, q_len, num_heads] in the query's dtype, no gradient): pass "
                         "only one of them")
    return_lse = return_lse or return_residual
    if sequence_axis_name is None and sequence_layout != "contiguous":
        raise ValueError(f"sequence_layout={sequence_layout!r} needs sequence_axis_name (the "
                         "layout of a sequence split over devices)")
    if sequence_axis_name is not None:
        for name, given in (("alibi_slopes", alibi_slopes), ("page_table", page_table)):
            if given is not None:
                raise ValueError(f"{name} is not supported with sequence_axis_name")
        if validation.check_dropout(dropout_rate, dropout_rng, 1, 1)[0] > 0:
            raise ValueError("dropout_rate > 0 is not supported with sequence_axis_name (ring "
                             "attention)")
        result = ring_attention.ring_flash_attention(
            query, key, value, bias, mask, axis_name=sequence_axis_name,
            sequence_layout=sequence_layout, primitives=(fwd_p, bwd_p),
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            return_lse=return_lse, scale=scale, is_causal=is_causal,
            local_window_size=local_window_size, causal_alignment=causal_alignment,
            implementation=implementation, query_segment_ids=query_segment_ids,
            key_value_segment_ids=key_value_segment_ids, logits_soft_cap=logits_soft_cap,
            sinks=sinks)
    else:
        result = attend(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            local_window_size=local_window_size, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, causal_alignment=causal_alignment,
            implementation=implementation, query_segment_ids=query_segment_ids,
            key_value_segment_ids=key_value_segment_ids, logits_soft_cap=logits_soft_cap,
            sinks=sinks, alibi_slopes=alibi_slopes, page_table=page_table,
            dropout_rate=dropout_rate, dropout_rng=dropout_rng, return_lse=return_lse)
    return _as_residual(result) if return_residual else result


def _as_residual(result):
    """(out, lse) as jax.nn's (out, residual): lse [..., num_heads, q_len] float32 becomes
    [..., q_len, num_heads] in out's dtype, with no gradient (as jax.nn's)."""
    out, lse = result
    return out, jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(out.dtype))


def attend(query, key, value, bias=None, mask=None, *, return_lse=False, **kwargs):
    """``flash_attention`` on one device (no ``sequence_axis_name``), with the keywords of
    ``validation.check_inputs``; the Flax integration also passes ``dropout_broadcast`` (one
    keep mask for every batch entry and head)."""
    q, k, v, operands, params = validation.check_inputs(query, key, value, bias, mask, **kwargs)
    try:
        out, lse = _attention(params, q, k, v, operands)
    except TypeError as e:
        # JAX's own message ("can't apply forward-mode autodiff (jvp) to a custom_vjp function")
        # does not say which function or what to do instead.
        if "forward-mode" in str(e) and "custom_vjp" in str(e):
            raise TypeError(NO_JVP_MESSAGE) from e
        raise
    return validation.restore_rank(query, out, lse, return_lse)
