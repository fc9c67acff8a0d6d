"""Plain ``jax.numpy`` attention: the "xla" implementation and the documented reference.

``forward`` materialises the [batch, kv_heads, group, q_len, kv_len] score tensor and applies the
visibility rules of DESIGN.md section 3 with ``where`` (never by adding large negatives), so rows
with no visible key give exactly 0 output and ``-inf`` LSE. ``backward`` is the FlashAttention-2
recompute backward (Dao, "FlashAttention-2", 2023, Algorithm 2) from (q, k, v, o, lse, dO, g_lse),
not autodiff of ``forward``: it is the oracle the fused Metal backward kernels are checked against.

All math is float32 (matmuls at HIGHEST precision); outputs are cast back to the input dtype; LSE is
float32 ``[batch, num_heads, q_len]`` in natural log. Query head n uses kv head
``n // (num_heads // num_kv_heads)``. A non-finite input reaches exactly the outputs whose sums
include it at a visible (query, key) pair; in padded tails or invisible pairs it has no effect.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import validation

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


def _lengths(lengths, batch, full):
    if lengths is None:
        return jnp.full((batch,), full, jnp.int32)
    return lengths.astype(jnp.int32)


def visibility(batch, q_len, kv_len, q_lengths, kv_lengths, *, is_causal, window_left,
               window_right, bottom_right):
    """Boolean mask [batch, q_len, kv_len]: may query row i see key j (DESIGN.md section 3)?

    Also returns the per-batch valid-row mask [batch, q_len] (i < q_len_b).
    """
    ql = _lengths(q_lengths, batch, q_len)[:, None, None]
    kl = _lengths(kv_lengths, batch, kv_len)[:, None, None]
    i = jnp.arange(q_len, dtype=jnp.int32)[None, :, None]
    j = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
    diag = i + (kl - ql if bottom_right else 0)  # the key aligned with query row i
    row_ok = i < ql
    mask = row_ok & (j < kl)
    if is_causal:
        mask &= j <= diag
    # Compare offsets from the diagonal, not diag +/- bound: a bound near INT32_MAX must not
    # overflow int32.
    if window_left >= 0:
        mask &= diag - j <= window_left
    if window_right >= 0:
        mask &= j - diag <= window_right
    return mask, row_ok[:, :, 0]


def _split_heads(x, num_kv_heads):
    """[B, T, H, D] -> [B, T, HKV, G, D] so head n = hkv * G + g."""
    b, t, h, d = x.shape
    return x.reshape(b, t, num_kv_heads, h // num_kv_heads, d)


def _nonfinite(x):
    return (~jnp.isfinite(x)).astype(_F32)


def _contract(spec, weights, values):
    """einsum in float32 with non-finite values zeroed: a weight of exactly 0 (an invisible pair)
    times NaN would otherwise be NaN. ``_poison`` puts NaN back where a visible pair met one."""
    values = jnp.where(jnp.isfinite(values), values, 0.0)
    return jnp.einsum(spec, weights, values, precision=_HI, preferred_element_type=_F32)


def _poison(out, hits):
    """NaN wherever ``hits`` (a count of visible non-finite inputs) is positive."""
    return jnp.where(hits > 0, jnp.nan, out)


def _scores(q, k, scale, mask):
    """Scaled scores [B, HKV, G, Tq, Tkv] in float32 and the broadcast mask [B, 1, 1, Tq, Tkv].

    A key with a non-finite entry gives NaN scores (not a -inf that would quietly weigh it 0);
    the mask later drops them wherever the key is invisible.
    """
    finite = jnp.isfinite(k)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, jnp.where(finite, k, 0.0), precision=_HI,
                   preferred_element_type=_F32) * jnp.float32(scale)
    bad_key = jnp.moveaxis(~jnp.all(finite, axis=-1), 1, -1)[:, :, None, None, :]
    return jnp.where(bad_key, jnp.nan, s), mask[:, None, None, :, :]


def forward(q, k, v, q_lengths=None, kv_lengths=None, *, scale, is_causal=False, window_left=-1,
            window_right=-1, bottom_right=False, **unused_static):
    """Reference forward. q [B,Tq,H,D], k/v [B,Tkv,HKV,D], lengths int32 [B] or None.

    Returns (o [B,Tq,H,D] in q.dtype, lse [B,H,Tq] float32). Also differentiable by plain JAX
    autodiff (the row max is a stop_gradient constant and every masked value is selected away
    before any exp/log), which ``reference_attention`` relies on.
    """
    del unused_static  # has_* flags and implementation: implied by the operands / irrelevant here
    batch, q_len, num_heads, _ = q.shape
    _, kv_len, num_kv_heads, _ = k.shape
    mask, _ = visibility(
        batch, q_len, kv_len, q_lengths, kv_lengths, is_causal=is_causal,
        window_left=window_left, window_right=window_right, bottom_right=bottom_right)
    qf = _split_heads(q.astype(_F32), num_kv_heads)
    s, m4 = _scores(qf, k.astype(_F32), scale, mask)
    has_key = jnp.any(m4, axis=-1)  # [B, 1, 1, Tq]
    row_max = jnp.max(jnp.where(m4, s, -jnp.inf), axis=-1, initial=-jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.where(has_key, row_max, 0.0))
    p = jnp.where(m4, jnp.exp(jnp.where(m4, s, 0.0) - row_max[..., None]), 0.0)
    denom = jnp.sum(p, axis=-1)
    denom_safe = jnp.where(has_key, denom, 1.0)
    maskf = mask.astype(_F32)  # [B, Tq, Tkv], the same for every head
    o = _contract("bhgqk,bkhd->bqhgd", p, v.astype(_F32))
    o = _poison(o, jnp.einsum("bqk,bkhd->bqhd", maskf, _nonfinite(v))[:, :, :, None, :])
    o = o / jnp.moveaxis(denom_safe, -1, 1)[..., None]
    o = jnp.where(jnp.moveaxis(has_key, -1, 1)[..., None], o, 0.0)
    lse = jnp.where(has_key, row_max + jnp.log(denom_safe), -jnp.inf)
    o = o.reshape(q.shape).astype(q.dtype)
    lse = lse.reshape(batch, num_heads, q_len)
    return o, lse


def backward(q, k, v, o, lse, do, g_lse, q_lengths=None, kv_lengths=None, *, scale,
             is_causal=False, window_left=-1, window_right=-1, bottom_right=False,
             **unused_static):
    """FlashAttention-2 recompute backward; returns (dq, dk, dv) in the input dtypes.

    D_i = rowsum(dO_i * O_i) - g_lse_i (0 for rows past q_len); P = exp(S - lse) on visible
    entries and exactly 0 elsewhere (so an empty row with lse = -inf gives 0, never NaN);
    dV = P^T dO; dP = dO V^T; dS = P * (dP - D); dQ = scale dS K; dK = scale dS^T Q, with dK/dV
    summed over the query heads of each kv head group.
    """
    del unused_static
    batch, q_len, num_heads, _ = q.shape
    _, kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    mask, row_ok = visibility(
        batch, q_len, kv_len, q_lengths, kv_lengths, is_causal=is_causal,
        window_left=window_left, window_right=window_right, bottom_right=bottom_right)
    qf = _split_heads(q.astype(_F32), num_kv_heads)
    dof = _split_heads(do.astype(_F32), num_kv_heads)
    of = _split_heads(o.astype(_F32), num_kv_heads)
    kf = k.astype(_F32)
    lse5 = lse.astype(_F32).reshape(batch, num_kv_heads, group, q_len)
    g5 = g_lse.astype(_F32).reshape(batch, num_kv_heads, group, q_len)
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", dof, of, precision=_HI) - g5
    delta = jnp.where(row_ok[:, None, None, :], delta, 0.0)

    s, m4 = _scores(qf, kf, scale, mask)
    p = jnp.where(m4, jnp.exp(jnp.where(m4, s - lse5[..., None], 0.0)), 0.0)
    maskf = mask.astype(_F32)  # [B, Tq, Tkv], the same for every head
    dv = _contract("bhgqk,bqhgd->bkhd", p, dof)
    dv = _poison(dv, jnp.einsum("bqk,bqhd->bkhd", maskf, _nonfinite(dof).sum(axis=3)))
    # Invisible (i, j) pairs are selected away, so a NaN there (e.g. in a padded V row) is dropped.
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dof, v.astype(_F32), precision=_HI)
    ds = jnp.where(m4, p * (dp - delta[..., None]), 0.0)
    dq = _contract("bhgqk,bkhd->bqhgd", ds, kf) * jnp.float32(scale)
    dq = _poison(dq, jnp.einsum("bqk,bkhd->bqhd", maskf, _nonfinite(kf))[:, :, :, None, :])
    dk = _contract("bhgqk,bqhgd->bkhd", ds, qf) * jnp.float32(scale)
    dk = _poison(dk, jnp.einsum("bqk,bqhd->bkhd", maskf, _nonfinite(qf).sum(axis=3)))
    return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))


def reference_attention(query, key, value, *, scale=None, is_causal=False, local_window_size=None,
                        query_seq_lengths=None, key_value_seq_lengths=None,
                        causal_alignment="top_left", return_lse=False):
    """Plain-``jnp`` scaled dot-product attention with exactly ``flash_attention``'s semantics.

    It materialises the full score tensor (memory O(batch * heads * q_len * kv_len)) and computes
    in float32, so it is the documented reference to compare ``flash_attention`` against.
    Differentiable with ordinary JAX autodiff (forward and reverse mode, any order).

    Args/shapes/dtypes/errors: as ``jax_flash_metal.flash_attention`` (query [B, Tq, H, D],
    key/value [B, Tkv, HKV, D], float32/float16/bfloat16; lengths integer [B]).
    Returns: out [B, Tq, H, D] in the input dtype, and with ``return_lse=True`` also the
    log-sum-exp [B, H, Tq] float32 (``-inf`` for rows that see no key).
    Raises: TypeError / ValueError naming the bad argument.
    """
    q, k, v, ql, kl, params = validation.check_inputs(
        query, key, value, scale=scale, is_causal=is_causal,
        local_window_size=local_window_size, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, causal_alignment=causal_alignment)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    o, lse = forward(q, k, v, ql, kl, **params._asdict())
    return (o, lse) if return_lse else o
