"""Float64 NumPy oracle for attention, written from DESIGN.md section 3 alone.

It shares no code with the package: visibility is spelled out per batch, the softmax is taken
directly, and the backward uses the softmax Jacobian (dS = P * (dP - rowsum(P * dP) + g_lse)),
not the FlashAttention-2 identity rowsum(P * dP) = rowsum(dO * O) the kernels rely on.

Sums run over visible keys (or queries) only: a non-finite value at a visible position makes the
affected output NaN, one at an invisible position has no effect.
"""

import numpy as np


def _window_bounds(local_window_size):
    if local_window_size is None:
        return None, None
    if isinstance(local_window_size, (int, np.integer)):
        return int(local_window_size), int(local_window_size)
    left, right = local_window_size
    return left, right


def visibility(batch, q_len, kv_len, *, is_causal=False, local_window_size=None,
               query_seq_lengths=None, key_value_seq_lengths=None, causal_alignment="top_left"):
    """bool [batch, q_len, kv_len]: may query i see key j in batch b."""
    left, right = _window_bounds(local_window_size)
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    mask = np.zeros((batch, q_len, kv_len), dtype=bool)
    for b in range(batch):
        ql = q_len if query_seq_lengths is None else int(np.clip(query_seq_lengths[b], 0, q_len))
        kl = kv_len if key_value_seq_lengths is None else int(np.clip(key_value_seq_lengths[b], 0, kv_len))
        off = kl - ql if causal_alignment == "bottom_right" else 0
        m = (i < ql) & (j < kl)
        if is_causal:
            m &= j <= i + off
        if left is not None:
            m &= j >= i + off - left
        if right is not None:
            m &= j <= i + off + right
        mask[b] = m
    return mask


def _masked_contract(weights, mask, values):
    """sum_k weights[..., r, k] * values[..., k, :] over visible k only.

    weights [B, H, R, K], mask [B, 1, R, K] bool, values [B, H, K, D]; a non-finite value at a
    visible (r, k) makes row r NaN.
    """
    finite = np.isfinite(values)
    out = np.einsum("bhrk,bhkd->bhrd", np.where(mask, weights, 0.0), np.where(finite, values, 0.0))
    poisoned = np.einsum("bhrk,bhkd->bhrd", mask.astype(np.float64), (~finite).astype(np.float64))
    return np.where(poisoned > 0, np.nan, out)


def _heads(x, num_heads):
    """[B, T, Hx, D] -> [B, num_heads, T, D], repeating each kv head over its query-head group."""
    x = np.asarray(x, dtype=np.float64).transpose(0, 2, 1, 3)
    return np.repeat(x, num_heads // x.shape[1], axis=1)


def _probabilities(q, k, scale, mask):
    """Softmax probabilities P [B, H, Tq, Tkv] (0 where invisible and on empty rows) and LSE."""
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    qh, kh = _heads(q, q.shape[2]), _heads(k, q.shape[2])
    with np.errstate(invalid="ignore", over="ignore"):
        finite_k = np.isfinite(kh)
        s = scale * np.einsum("bhqd,bhkd->bhqk", qh, np.where(finite_k, kh, 0.0))
        bad_k = (~finite_k).any(axis=-1)[:, :, None, :]
        s = np.where(bad_k, np.nan, s)
        s = np.where(mask, s, -np.inf)
        row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)
        row_max = np.where(np.isneginf(row_max), 0.0, row_max)
        p = np.where(mask, np.exp(s - row_max), 0.0)
        denom = p.sum(axis=-1, keepdims=True)
        with np.errstate(divide="ignore"):
            lse = (row_max + np.log(denom))[..., 0]
        # Empty rows have denom 0 and P 0; a NaN denom (NaN in a visible input) stays NaN.
        p = np.where(denom == 0, 0.0, p / np.where(denom == 0, 1.0, denom))
    return p, lse, scale


def attention(q, k, v, *, scale=None, is_causal=False, local_window_size=None,
              query_seq_lengths=None, key_value_seq_lengths=None, causal_alignment="top_left"):
    """Returns (o [B, Tq, H, D], lse [B, H, Tq]) in float64. Empty rows: o = 0, lse = -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, tq, h, _ = q.shape
    mask = visibility(b, tq, k.shape[1], is_causal=is_causal, local_window_size=local_window_size,
                      query_seq_lengths=query_seq_lengths,
                      key_value_seq_lengths=key_value_seq_lengths,
                      causal_alignment=causal_alignment)[:, None]
    p, lse, _ = _probabilities(q, k, scale, mask)
    o = _masked_contract(p, mask, _heads(v, h))
    return o.transpose(0, 2, 1, 3), lse


def attention_grads(q, k, v, do, g_lse=None, *, scale=None, is_causal=False,
                    local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None,
                    causal_alignment="top_left"):
    """Reverse-mode gradients (dq, dk, dv) in float64 of <o, do> + <lse, g_lse>.

    do [B, Tq, H, D]; g_lse [B, H, Tq] or None (zero). dq has q's shape, dk/dv have k's shape
    (summed over each kv head's query-head group).
    """
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    b, tq, h, d = q.shape
    tkv, hkv = k.shape[1], k.shape[2]
    mask = visibility(b, tq, tkv, is_causal=is_causal, local_window_size=local_window_size,
                      query_seq_lengths=query_seq_lengths,
                      key_value_seq_lengths=key_value_seq_lengths,
                      causal_alignment=causal_alignment)[:, None]
    p, _, scale = _probabilities(q, k, scale, mask)
    g = np.zeros((b, h, tq)) if g_lse is None else np.asarray(g_lse, dtype=np.float64)
    doh, qh, kh, vh = do.transpose(0, 2, 1, 3), _heads(q, h), _heads(k, h), _heads(v, h)
    row_visible = mask.any(axis=-1)  # [B, 1, Tq]
    doh = np.where(row_visible[..., None], doh, 0.0)  # cotangents of empty rows reach nothing
    g = np.where(row_visible, g, 0.0)
    with np.errstate(invalid="ignore"):
        dp = _dp(doh, vh, mask)
        ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True) + g[..., None])
        ds = np.where(mask, ds, 0.0)
        dq = scale * _masked_contract(ds, mask, kh)
        mask_t = mask.swapaxes(-1, -2)
        dk = scale * _masked_contract(ds.swapaxes(-1, -2), mask_t, qh)
        dv = _masked_contract(p.swapaxes(-1, -2), mask_t, doh)
    group = h // hkv
    dk = dk.reshape(b, hkv, group, tkv, d).sum(axis=2)
    dv = dv.reshape(b, hkv, group, tkv, d).sum(axis=2)
    return dq.transpose(0, 2, 1, 3), dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


def _dp(doh, vh, mask):
    """dP = dO V^T at visible (i, j) [B, H, Tq, Tkv]; non-finite V at a visible key poisons it."""
    finite_v = np.isfinite(vh)
    dp = np.einsum("bhqd,bhkd->bhqk", doh, np.where(finite_v, vh, 0.0))
    bad_v = (~finite_v).any(axis=-1)[:, :, None, :]
    return np.where(mask, np.where(bad_v, np.nan, dp), 0.0)
