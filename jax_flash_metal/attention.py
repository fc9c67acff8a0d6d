"""Public ``flash_attention``: validation, then the two primitives paired by ``jax.custom_vjp``."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from . import validation
from .primitives import NO_JVP_MESSAGE, bwd_p, fwd_p


def _bind_fwd(params, q, k, v, q_lengths, kv_lengths):
    lengths = [x for x in (q_lengths, kv_lengths) if x is not None]
    return fwd_p.bind(q, k, v, *lengths, **params._asdict())


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(params, q, k, v, q_lengths, kv_lengths):
    o, lse, _ = _bind_fwd(params, q, k, v, q_lengths, kv_lengths)
    return o, lse


def _attention_fwd(params, q, k, v, q_lengths, kv_lengths):
    o, lse, l2 = _bind_fwd(params, q, k, v, q_lengths, kv_lengths)
    return (o, lse), (q, k, v, o, lse, l2, q_lengths, kv_lengths)


def _attention_bwd(params, residuals, cotangents):
    q, k, v, o, lse, l2, q_lengths, kv_lengths = residuals
    do, g_lse = cotangents
    lengths = [x for x in (q_lengths, kv_lengths) if x is not None]
    dq, dk, dv = bwd_p.bind(q, k, v, o, lse, l2, do.astype(q.dtype), g_lse.astype(jnp.float32),
                            *lengths, **params._asdict())
    return dq, dk, dv, None, None  # lengths are integers: no gradient


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(query, key, value, *, scale=None, is_causal=False, local_window_size=None,
                    query_seq_lengths=None, key_value_seq_lengths=None,
                    causal_alignment="top_left", return_lse=False, implementation=None):
    """Fused scaled dot-product attention (FlashAttention-2 forward and recompute backward).

    Layout as ``jax.nn.dot_product_attention`` (BTNH):
      query: [batch, q_len, num_heads, head_dim]; key, value: [batch, kv_len, num_kv_heads,
      head_dim]; float32, float16 or bfloat16, all one dtype; num_heads % num_kv_heads == 0
      (grouped-query attention: query head n reads kv head n // (num_heads // num_kv_heads)).
    Args:
      scale: float multiplying q.k; None means 1/sqrt(head_dim). Any float (0, negative) is used
        as given. Static (a Python/NumPy number, not an array).
      is_causal: key j visible to query i only if j <= i + off.
      local_window_size: None, int w (= (w, w)) or (left, right) with ints >= 0 or None
        (unbounded side): visible iff i + off - left <= j <= i + off + right (inclusive).
      query_seq_lengths, key_value_seq_lengths: integer [batch] (cast to int32, clamped to
        [0, len]); rows i >= q_len_b output 0, keys j >= kv_len_b are never read.
      causal_alignment: "top_left" (off = 0, jax.nn / PyTorch) or "bottom_right"
        (off = kv_len_b - q_len_b, FlashAttention-2 / KV-cache decoding).
      return_lse: also return the log-sum-exp; gradients flow through it.
      implementation: None (best for the platform, or $JAX_FLASH_METAL_IMPLEMENTATION), "xla",
        "metal" or "emulator"; resolved when the computation is lowered.
    Returns:
      out [batch, q_len, num_heads, head_dim] in the input dtype; with return_lse=True,
      (out, lse) where lse is float32 [batch, num_heads, q_len], natural log. A row with no
      visible key has out = 0 and lse = -inf and contributes nothing to any gradient.
    Raises:
      TypeError / ValueError (naming the argument) for bad ranks, shapes, dtypes, head counts,
      lengths, windows, alignment, scale or implementation name; NotImplementedError at lowering
      when an explicitly requested implementation cannot run there.
    Differentiable w.r.t. query, key and value in reverse mode, first order only (jax.custom_vjp);
    softmax math is float32. Method: Dao, "FlashAttention-2" (2023), recompute backward from
    (q, k, v, o, lse, dO) with D = rowsum(dO * O) - g_lse.
    """
    q, k, v, q_lengths, kv_lengths, params = validation.check_inputs(
        query, key, value, scale=scale, is_causal=is_causal,
        local_window_size=local_window_size, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, causal_alignment=causal_alignment,
        implementation=implementation)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    try:
        out, lse = _attention(params, q, k, v, q_lengths, kv_lengths)
    except TypeError as e:
        # JAX's own message ("can't apply forward-mode autodiff (jvp) to a custom_vjp function")
        # does not say which function or what to do instead.
        if "forward-mode" in str(e) and "custom_vjp" in str(e):
            raise TypeError(NO_JVP_MESSAGE.format("flash_attention")) from e
        raise
    return (out, lse) if return_lse else out
