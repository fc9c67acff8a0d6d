"""Float64 NumPy oracle for attention, written from docs/design.md#api-semantics alone.

It shares no code with the package: visibility is spelled out per batch, the softmax is taken
directly, and the backward uses the softmax Jacobian (dS = P * (dP - rowsum(P * dP) + g_lse)),
not the FlashAttention-2 identity rowsum(P * dP) = rowsum(dO * O) the kernels rely on.

Scores are formed as the API defines them, in float32: scale * q.k, the soft cap, then + bias,
each step rounded to float32 (computed in float64 and rounded once, so each is the correctly
rounded float32 value); the softmax and every gradient are then taken in float64 from exactly
these scores. So rows at a huge offset (an additive -1e9 mask, where a float32 score keeps only
a few bits of q.k) are judged by what float32 scores say, not by the exact real scores.

Sums run over visible keys (or queries) only: a non-finite value at a visible position makes the
affected output NaN, one at an invisible position has no effect.

Attention dropout takes its keep mask M as given (``dropout_mask``, bool [B, H, Tq, Tkv]; the
package's ``dropout_mask`` is checked on its own against Philox's known answers): with
Z = M / (1 - rate), O = (P Z) V, dV = (P Z)^T dO and dP = (dO V^T) Z, then the same softmax
Jacobian.
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
        kl = (kv_len if key_value_seq_lengths is None
              else int(np.clip(key_value_seq_lengths[b], 0, kv_len)))
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


FEATURES = ("bias", "mask", "query_segment_ids", "key_value_segment_ids", "logits_soft_cap",
            "sinks")


def full_visibility(batch, num_heads, q_len, kv_len, *, bias=None, mask=None,
                    query_segment_ids=None, key_value_segment_ids=None, **band):
    """bool [batch, num_heads, q_len, kv_len]: the band of ``visibility`` and the mask (True =
    keep), equal segment ids, and a bias entry other than -inf."""
    vis = np.broadcast_to(visibility(batch, q_len, kv_len, **band)[:, None],
                          (batch, num_heads, q_len, kv_len))
    if mask is not None:
        vis = vis & np.broadcast_to(np.asarray(mask, bool).reshape(
            (1,) * (4 - np.ndim(mask)) + np.shape(mask)), vis.shape)
    if query_segment_ids is not None:
        qs, ks = np.asarray(query_segment_ids), np.asarray(key_value_segment_ids)
        vis = vis & (qs[:, None, :, None] == ks[:, None, None, :])
    if bias is not None:
        vis = vis & ~np.isneginf(_bias4(bias))
    return vis


def _float32(x):
    """x rounded to float32 (Inf past the float32 range), as float64."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def _bias4(bias):
    bias = np.asarray(bias, np.float64)
    return bias.reshape((1,) * (4 - bias.ndim) + bias.shape)


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


def _probabilities(q, k, scale, mask, bias=None, logits_soft_cap=None, sinks=None):
    """Softmax probabilities P [B, H, Tq, Tkv] (0 where invisible and on empty rows), LSE
    [B, H, Tq], the scale, d(capped score)/d(raw score) [B, H, Tq, Tkv] and the sink
    probabilities exp(sink - LSE) [B, H, Tq] (None without sinks). The scores are the float32
    ones of the module docstring."""
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    qh, kh = _heads(q, q.shape[2]), _heads(k, q.shape[2])
    with np.errstate(invalid="ignore", over="ignore"):
        # A query or key with a non-finite entry scores NaN against every key or query (an
        # Inf could otherwise give an infinite score that a soft cap makes finite).
        finite_q, finite_k = np.isfinite(qh), np.isfinite(kh)
        s = scale * np.einsum("bhqd,bhkd->bhqk", np.where(finite_q, qh, 0.0),
                              np.where(finite_k, kh, 0.0))
        bad_q = (~finite_q).any(axis=-1)[:, :, :, None]
        bad_k = (~finite_k).any(axis=-1)[:, :, None, :]
        s = _float32(np.where(bad_q | bad_k, np.nan, s))
        cap_slope = np.ones_like(s)
        if logits_soft_cap is not None:
            c = float(logits_soft_cap)
            t = np.tanh(s / c)
            s, cap_slope = _float32(c * t), 1.0 - t * t
        if bias is not None:
            s = _float32(s + np.where(mask, _float32(_bias4(bias)), 0.0))
        s = np.where(mask, s, -np.inf)
        row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)
        sink = None
        if sinks is not None:
            sink = np.asarray(sinks, np.float64)[None, :, None, None]
            row_max = np.maximum(row_max, sink)
        row_max = np.where(np.isneginf(row_max), 0.0, row_max)
        p = np.where(mask, np.exp(s - row_max), 0.0)
        denom = p.sum(axis=-1, keepdims=True)
        if sink is not None:
            denom = denom + np.exp(sink - row_max)
        with np.errstate(divide="ignore"):
            lse = (row_max + np.log(denom))[..., 0]
        # Empty rows have denom 0 and P 0; a NaN denom (NaN in a visible input) stays NaN.
        p = np.where(denom == 0, 0.0, p / np.where(denom == 0, 1.0, denom))
        # exp(sink - row_max) / denom, not exp(sink - LSE): LSE rounds to row_max at an offset
        # like -1e30 even in float64.
        p_sink = None if sink is None else np.where(
            denom[..., 0] == 0, 0.0, np.exp(sink - row_max)[..., 0] / np.where(denom == 0, 1.0,
                                                                                denom)[..., 0])
    return p, lse, scale, cap_slope, p_sink


def _full_mask(q, k, features, band):
    b, tq, h, _ = q.shape
    keys = ("bias", "mask", "query_segment_ids", "key_value_segment_ids")
    return full_visibility(b, h, tq, k.shape[1], **{n: features.get(n) for n in keys}, **band)


def _dropout_weights(dropout_mask, dropout_rate):
    """Z = M / (1 - rate) as float64 [B, H, Tq, Tkv], or 1 without dropout."""
    if dropout_mask is None:
        return 1.0
    return np.asarray(dropout_mask, bool) / (1.0 - float(dropout_rate))


def attention(q, k, v, *, scale=None, is_causal=False, local_window_size=None,
              query_seq_lengths=None, key_value_seq_lengths=None, causal_alignment="top_left",
              dropout_mask=None, dropout_rate=0.0, **features):
    """Returns (o [B, Tq, H, D], lse [B, H, Tq]) in float64. Empty rows: o = 0, lse = -inf
    (= the sink with sinks). ``features``: the FEATURES keywords of flash_attention (bias and
    mask broadcastable to [B, H, Tq, Tkv], segment ids [B, T], soft cap, sinks [H]).
    ``dropout_mask`` (bool [B, H, Tq, Tkv]) and ``dropout_rate``: attention dropout."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    h = q.shape[2]
    mask = _full_mask(q, k, features, dict(
        is_causal=is_causal, local_window_size=local_window_size,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        causal_alignment=causal_alignment))
    p, lse, _, _, _ = _probabilities(q, k, scale, mask, features.get("bias"),
                                     features.get("logits_soft_cap"), features.get("sinks"))
    o = _masked_contract(p * _dropout_weights(dropout_mask, dropout_rate), mask, _heads(v, h))
    return o.transpose(0, 2, 1, 3), lse


def gradients(q, k, v, do, g_lse=None, *, scale=None, is_causal=False, local_window_size=None,
              query_seq_lengths=None, key_value_seq_lengths=None, causal_alignment="top_left",
              dropout_mask=None, dropout_rate=0.0, **features):
    """Reverse-mode gradients in float64 of <o, do> + <lse, g_lse> as a dict: dq, dk, dv, and
    dbias (summed to the bias's own shape) / dsinks [H] when a bias / sinks are given.

    do [B, Tq, H, Dv]; g_lse [B, H, Tq] or None (zero). dq has q's shape, dk/dv have k's / v's shape
    (summed over each kv head's query-head group). With sinks, dsinks_n = sum over rows of
    P_sink * (g - sum_j P_ij dP_ij): an empty row's LSE is the sink, so its g reaches dsinks.
    """
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    b, tq, h, d = q.shape
    tkv, hkv = k.shape[1], k.shape[2]
    mask = _full_mask(q, k, features, dict(
        is_causal=is_causal, local_window_size=local_window_size,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        causal_alignment=causal_alignment))
    p, _, scale, cap_slope, p_sink = _probabilities(
        q, k, scale, mask, features.get("bias"), features.get("logits_soft_cap"),
        features.get("sinks"))
    g = np.zeros((b, h, tq)) if g_lse is None else np.asarray(g_lse, dtype=np.float64)
    doh, qh, kh, vh = do.transpose(0, 2, 1, 3), _heads(q, h), _heads(k, h), _heads(v, h)
    row_visible = mask.any(axis=-1)  # [B, H, Tq]
    doh = np.where(row_visible[..., None], doh, 0.0)  # cotangents of empty rows reach nothing
    g_rows = np.where(row_visible, g, 0.0)
    out = {}
    z = _dropout_weights(dropout_mask, dropout_rate)
    with np.errstate(invalid="ignore"):
        dp = _dp(doh, vh, mask) * z
        p_dp = (p * dp).sum(axis=-1, keepdims=True)
        ds = np.where(mask, p * (dp - p_dp + g_rows[..., None]), 0.0)
        if "bias" in features and features["bias"] is not None:
            shape = _bias4(features["bias"]).shape
            axes = tuple(i for i, n in enumerate(shape) if n == 1)
            out["dbias"] = ds.sum(axis=axes, keepdims=True).reshape(
                np.shape(features["bias"]))
        if p_sink is not None:
            out["dsinks"] = (p_sink * (g - p_dp[..., 0])).sum(axis=(0, 2))
        ds_raw = np.where(mask, ds * cap_slope, 0.0)
        dq = scale * _masked_contract(ds_raw, mask, kh)
        mask_t = mask.swapaxes(-1, -2)
        dk = scale * _masked_contract(ds_raw.swapaxes(-1, -2), mask_t, qh)
        dv = _masked_contract((p * z).swapaxes(-1, -2), mask_t, doh)
    group = h // hkv
    dk = dk.reshape(b, hkv, group, tkv, d).sum(axis=2)
    dv = dv.reshape(b, hkv, group, tkv, v.shape[3]).sum(axis=2)
    out.update(dq=dq.transpose(0, 2, 1, 3), dk=dk.transpose(0, 2, 1, 3),
               dv=dv.transpose(0, 2, 1, 3))
    return out


def attention_grads(q, k, v, do, g_lse=None, **kwargs):
    """(dq, dk, dv) of ``gradients``."""
    grads = gradients(q, k, v, do, g_lse, **kwargs)
    return grads["dq"], grads["dk"], grads["dv"]


def _dp(doh, vh, mask):
    """dP = dO V^T at visible (i, j) [B, H, Tq, Tkv]; non-finite V at a visible key poisons it."""
    finite_v = np.isfinite(vh)
    dp = np.einsum("bhqd,bhkd->bhqk", doh, np.where(finite_v, vh, 0.0))
    bad_v = (~finite_v).any(axis=-1)[:, :, None, :]
    return np.where(mask, np.where(bad_v, np.nan, dp), 0.0)
