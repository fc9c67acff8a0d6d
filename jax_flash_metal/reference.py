"""``reference_attention``: the plain dense ``jax.numpy`` definition of the API semantics
(docs/design.md#api-semantics).

``forward`` materialises the [batch, kv_heads, group, q_len, kv_len] score tensor and applies the
visibility rules (``visibility.Band``) with ``where`` (never by adding large negatives), so rows
with no visible key give exactly 0 output and ``-inf`` LSE. Its gradients come from ordinary JAX
autodiff, to any order and in forward mode too. The primitives do not lower to it: their
memory-linear lowering is ``xla_attention``.

All math is float32 (matmuls at HIGHEST precision); outputs are cast back to the input dtype; LSE is
float32 ``[batch, num_heads, q_len]`` in natural log. Query head n uses kv head
``n // (num_heads // num_kv_heads)``. A non-finite input reaches exactly the outputs whose sums
include it at a visible (query, key) pair; in padded tails or invisible pairs it has no effect.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import paging
from .core import contract, dropout, features, nonfinite, validation
from .core import visibility as visibility_rules
from .core.options import Options

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


def _split_heads(x, num_kv_heads):
    """[B, T, H, D] -> [B, T, HKV, G, D] so head n = hkv * G + g."""
    b, t, h, d = x.shape
    return x.reshape(b, t, num_kv_heads, h // num_kv_heads, d)


def _contract(spec, weights, values):
    """einsum in float32 with non-finite values zeroed: a weight of exactly 0 (an invisible pair)
    times NaN would otherwise be NaN; ``nonfinite.poison`` puts NaN back where a visible pair met
    one."""
    values = jnp.where(jnp.isfinite(values), values, 0.0)
    return jnp.einsum(spec, weights, values, precision=_HI, preferred_element_type=_F32)


def _scores(q, k, scale):
    """Scaled scores [B, HKV, G, Tq, Tkv] in float32. A key with a non-finite entry gives NaN
    scores (not a -inf that would quietly weigh it 0); masking later drops them wherever the key
    is invisible."""
    finite = jnp.isfinite(k)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, jnp.where(finite, k, 0.0), precision=_HI,
                   preferred_element_type=_F32) * jnp.float32(scale)
    bad_key = jnp.moveaxis(~jnp.all(finite, axis=-1), 1, -1)[:, :, None, None, :]
    return jnp.where(bad_key, jnp.nan, s)


def forward(q, k, v, operands=contract.Operands(), *, scale, is_causal=False, window_left=-1,
            window_right=-1, bottom_right=False, logits_soft_cap=None, dropout_rate=0.0,
            dropout_key_groups=True, **unused_static):
    """Reference forward. q [B,Tq,H,D], k/v [B,Tkv,HKV,D], ``operands``: contract.Operands.

    Returns (o [B,Tq,H,D] in q.dtype, lse [B,H,Tq] float32). Also differentiable by plain JAX
    autodiff (the row max is a stop_gradient constant and every masked value is selected away
    before any exp/log), which ``reference_attention`` relies on.
    """
    del unused_static  # has_* flags and implementation: implied by the operands / irrelevant here
    x = operands
    if x.page_table is not None:
        k, v = (paging.gather(y, x.page_table, x.kv_lengths) for y in (k, v))
    batch, q_len, num_heads, _ = q.shape
    _, kv_len, num_kv_heads, _ = k.shape
    band = visibility_rules.Band(batch, q_len, kv_len, x.q_lengths, x.kv_lengths,
                                 is_causal=is_causal, window_left=window_left,
                                 window_right=window_right, bottom_right=bottom_right)
    rows, keys = jnp.arange(q_len, dtype=jnp.int32), jnp.arange(kv_len, dtype=jnp.int32)
    band_mask = band.mask(rows, keys)
    bias = None if x.bias is None else features.heads_layout(x.bias.astype(_F32), num_kv_heads)
    mask = None if x.mask is None else features.heads_layout(x.mask, num_kv_heads)
    m5 = features.combine(band_mask[:, None, None], features.visible(
        mask, bias, x.q_segment_ids, x.kv_segment_ids))
    qf = _split_heads(q.astype(_F32), num_kv_heads)
    s, _ = features.soft_cap(_scores(qf, k.astype(_F32), scale), logits_soft_cap)
    if bias is not None:
        s = s + jnp.where(m5, bias, 0.0)
    if x.alibi_slopes is not None:
        s = s + (x.alibi_slopes.reshape(batch, num_kv_heads, -1, 1, 1)
                 * band.alibi_distance(rows, keys)[:, None, None])
    m5 = jnp.broadcast_to(m5, s.shape)
    has_key = jnp.any(m5, axis=-1)  # [B, HKV, G, Tq]
    row_max = jnp.max(jnp.where(m5, s, -jnp.inf), axis=-1, initial=-jnp.inf)
    row_max = jnp.where(has_key, row_max, -jnp.inf)
    sink = None
    if x.sinks is not None:
        sink = x.sinks.astype(_F32).reshape(1, num_kv_heads, -1, 1)
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isneginf(row_max), 0.0, row_max))
    p = jnp.where(m5, jnp.exp(jnp.where(m5, s, 0.0) - row_max[..., None]), 0.0)
    denom = jnp.sum(p, axis=-1)
    if sink is not None:
        denom = denom + jnp.exp(sink - row_max)
    nonempty = denom != 0.0  # a NaN denom (NaN in a visible input) stays NaN
    denom_safe = jnp.where(nonempty, denom, 1.0)
    if x.dropout is not None:  # O = (P Z) V with Z = M / (1 - rate): dropout.dropout_mask's M
        seeds = x.dropout.reshape(batch, num_kv_heads, -1, dropout.WORDS)
        p = p * dropout.weights(seeds, jnp.arange(q_len, dtype=jnp.int32), 0, kv_len,
                                dropout_rate, groups=dropout_key_groups)
    o = _contract("bhgqk,bkhd->bqhgd", p, v.astype(_F32))
    o = nonfinite.poison(o, jnp.einsum("bhgqk,bkhd->bqhgd", m5.astype(_F32),
                                       nonfinite.indicator(v)))
    o = o / jnp.moveaxis(denom_safe, -1, 1)[..., None]
    o = jnp.where(jnp.moveaxis(nonempty, -1, 1)[..., None], o, 0.0)
    lse = jnp.where(nonempty, row_max + jnp.log(denom_safe), -jnp.inf)
    o = o.reshape(q.shape[:3] + v.shape[3:]).astype(q.dtype)
    lse = lse.reshape(batch, num_heads, q_len)
    return o, lse


def reference_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                        query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None, query_segment_ids=None,
                        key_value_segment_ids=None, logits_soft_cap=None, sinks=None,
                        causal_alignment="top_left", alibi_slopes=None, page_table=None,
                        dropout_rate=0.0, dropout_rng=None,
                        return_lse=False):
    """Plain-``jnp`` scaled dot-product attention with exactly ``flash_attention``'s semantics.

    It materialises the full score tensor (memory O(batch * heads * q_len * kv_len)) and computes
    in float32, so it is the documented reference to compare ``flash_attention`` against.
    Differentiable with ordinary JAX autodiff (forward and reverse mode, any order), including
    w.r.t. ``bias``, ``sinks`` and ``alibi_slopes`` (and, unlike ``flash_attention``, through
    a paged cache, which it gathers).

    Args/shapes/dtypes/errors: as ``jax_flash_metal.flash_attention`` (query [B, Tq, H, D] or
    [Tq, H, D], key/value [B, Tkv, HKV, D] or [Tkv, HKV, D], float32/float16/bfloat16; bias and
    mask broadcastable to [B, H, Tq, Tkv]; lengths integer [B]; segment ids integer [B, T];
    sinks [H]; ALiBi slopes [H] or [B, H]; a page table [B, max_pages] with key/value pages;
    value head dim Dv may differ from Dk; dropout_rate and dropout_rng: the same keep mask,
    ``dropout_mask``).
    Returns: out [B, Tq, H, Dv] in the query's dtype, and with ``return_lse=True`` also the
    log-sum-exp [B, H, Tq] ([H, Tq] for rank-3 query) float32 (``-inf`` for rows that see no
    key, or the sink with sinks).
    Raises: TypeError / ValueError naming the bad argument.
    """
    q, k, v, operands, params = validation.check_inputs(query, key, value, bias, mask,
                                                        Options.of(locals()))
    o, lse = forward(q, k, v, operands, **params._asdict())
    return validation.restore_rank(query, o, lse, return_lse)
