"""The xla implementation's short-query forward (decoding with a KV cache): split-KV attention
over the cache span by span.

A forward with at most ``MAX_QUERY_ROWS`` query rows over more keys than the schedule's dense tile,
on a schedule with ``split_kv_decode`` (the accelerators'; ``covers``), runs here instead of the
block loops of ``attention``, whose block layout copies the whole cache first. The keys are
visited span by span (``SPAN`` keys or more, at most ``MAX_SPANS`` spans, unrolled); each span is
split into chunks of ``CHUNK`` keys, and each chunk gives partial statistics (m, l) and a partial
output acc = sum_j exp(s_j - m) v_j, all merged at the end (FlashAttention's rescaling; Dao et al.,
"Flash-Decoding for long-context inference", 2023). The scores are a multiply-and-sum over the head
dim and the output a weighted sum over keys, not matmuls (whose batch axes would need the cache as
[B, HKV, Tkv, D]), and the spans are static slices of the operands, not a loop's state (a
``lax.fori_loop`` let XLA pick the state's layout, and it transposed the whole cache before the
loop). XLA:GPU still assigns its reductions operand layouts of its own and copies part of the cache
into them (docs/gpu.md has the temporaries this costs); reading it strictly in
place needs more control over layouts than jax.numpy gives. With a page table each span gathers only
its own pages (page 0 for those past a row's length, which are never weighed); spans that no row can
see are skipped when the band is static.

Semantics are those of ``attention.forward`` (and its outputs (o, lse, row_max, log_sum)):
lengths, causal and local windows in either alignment, grouped-query attention, soft cap, ALiBi,
sinks, exact NaN placement (a non-finite query or key entry makes its visible scores NaN; a value
entry reaches only outputs of the rows that see its key) and empty rows (o = 0, lse = -inf or the
sink). Bias, mask, segment ids and dropout keep the block loops. All math is float32.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..core import features, visibility
from . import tiles

F32 = tiles.F32
MAX_QUERY_ROWS = 16  # query rows per batch row that count as decoding
SPAN = 8192  # keys per span at least: bounds the float32 scores a span keeps
MAX_SPANS = 32  # longer caches take longer spans (the spans are unrolled)
CHUNK = 256  # keys per partial (m, l, acc)


def covers(q, k, operands, schedule, dropout_rate, kv_len) -> bool:
    """Whether ``forward`` runs this call (see the module docstring)."""
    return (schedule.split_kv_decode and 0 < q.shape[1] <= MAX_QUERY_ROWS
            and kv_len > schedule.dense_max_len
            and q.shape[0] > 0 and dropout_rate == 0.0
            and all(x is None for x in (operands.bias, operands.mask, operands.q_segment_ids,
                                        operands.dropout)))


def _nan_f32(x):
    """float32 x with every non-finite entry NaN (as the block loops' operands)."""
    return tiles.nan_entries(x.astype(F32))


def forward(q, k, v, operands, *, scale, is_causal=False, window_left=-1, window_right=-1,
            bottom_right=False, logits_soft_cap=None, **unused_static):
    """(o [B, Tq, H, Dv] in q.dtype, lse, row_max, log_sum float32 [B, H, Tq]) as
    ``attention.forward``; k, v are [B, Tkv, HKV, D], or pages [P, S, HKV, D] with
    ``operands.page_table``."""
    del unused_static
    batch, q_len, num_heads, _ = q.shape
    kv_heads, value_dim = k.shape[2], v.shape[3]
    groups = num_heads // kv_heads
    table = operands.page_table
    page = 1 if table is None else k.shape[1]  # keys per page (1: no pages)
    kv_len = k.shape[1] if table is None else table.shape[1] * page
    band = visibility.Band(batch, q_len, kv_len, operands.q_lengths, operands.kv_lengths,
                           is_causal=is_causal, window_left=window_left,
                           window_right=window_right, bottom_right=bottom_right)
    # A span is a whole number of pages, and no longer than the cache.
    span = max(SPAN, -(-kv_len // MAX_SPANS))
    span = min(max(span // page, 1) * page, kv_len)
    chunk = np.gcd(span, CHUNK)
    rows = np.arange(q_len, dtype=np.int32)
    spans = range(-(-kv_len // span))
    if visibility.array_module(band.q_lengths, band.kv_lengths) is np:  # a static band
        lo, hi = band.key_intervals(rows)
        seen = hi > lo
        spans = range(int(np.min(np.where(seen, lo, kv_len))) // span,
                      -(-int(np.max(np.where(seen, hi, 0))) // span))

    # [B, 1, HKV, G, Tq, D]: query head hkv * G + g, the chunk axis before it.
    qx = _nan_f32(q).reshape(batch, q_len, kv_heads, groups, -1).transpose(0, 2, 3, 1, 4)
    qx = qx[:, None]
    alibi = (None if operands.alibi_slopes is None
             else operands.alibi_slopes.reshape(batch, 1, 1, kv_heads, groups, 1))

    def span_partials(c):
        """(m, l, acc) of span c: [B, HKV, G, Tq] and [B, HKV, G, Tq, Dv]."""
        nominal = c * span
        start = min(nominal, kv_len - span)  # the last span ends at the cache's end
        keys = start + np.arange(span, dtype=np.int32)
        visible = band.mask(jnp.asarray(rows), keys) & (keys >= nominal)[None, None, :]
        # [B, n, CHUNK, 1, 1, Tq]: keys split into chunks, before the head axes.
        visible = visible.reshape(batch, q_len, -1, chunk).transpose(0, 2, 3, 1)[:, :, :, None,
                                                                                  None]
        kx, vx = (_nan_f32(_read(x, start, span, table, band.kv_lengths)).reshape(
            batch, -1, chunk, kv_heads, 1, 1, x.shape[3]) for x in (k, v))
        s = jnp.sum(qx[:, :, None] * kx, axis=-1) * jnp.float32(scale)  # [B, n, C, HKV, G, Tq]
        s = features.soft_cap(s, logits_soft_cap)[0]
        if alibi is not None:
            distance = band.alibi_distance(jnp.asarray(rows), keys)  # [B, Tq, span]
            distance = distance.reshape(batch, q_len, -1, chunk).transpose(0, 2, 3, 1)
            s = s + alibi * distance[:, :, :, None, None]
        s = jnp.where(visible, s, -jnp.inf)
        m = jnp.maximum(jnp.max(s, axis=2), tiles.LOWEST)  # per chunk
        p = jnp.exp(s - m[:, :, None])
        l = jnp.sum(p, axis=2)
        acc = jnp.sum(jnp.where(visible[..., None], p[..., None] * vx, 0.0), axis=2)
        return _merge(m, l, acc, axis=1)

    rows_shape = (batch, kv_heads, groups, q_len)
    partials = [span_partials(c) for c in spans] or [tiles.Running(
        jnp.full(rows_shape, tiles.LOWEST, F32), jnp.zeros(rows_shape, F32),
        jnp.zeros(rows_shape + (value_dim,), F32))]
    state = _merge(*(jnp.stack(x, axis=0) for x in zip(*partials)), axis=0)
    sinks = (None if operands.sinks is None
             else operands.sinks.astype(F32).reshape(1, kv_heads, groups, 1))
    o, lse, row_max, log_sum = tiles.forward_finish(state, sinks)
    o = o.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, value_dim).astype(q.dtype)
    return (o, *(x.reshape(batch, num_heads, q_len) for x in (lse, row_max, log_sum)))


def _read(x, start, span, table, kv_lengths):
    """Keys [start, start + span) (static) of the cache x as [B, span, HKV, D]: a slice of x
    [B, Tkv, HKV, D], or with ``table`` a gather of the span's pages from x [P, S, HKV, D]
    (page 0 for the pages past a row's length, which are never weighed)."""
    if table is None:
        return x[:, start:start + span]
    page = x.shape[1]
    pages = table[:, start // page:(start + span) // page]
    first_key = start + np.arange(span // page, dtype=np.int32) * page
    used = first_key[None, :] < kv_lengths[:, None]
    index = jnp.clip(jnp.where(used, pages, 0), 0, x.shape[0] - 1)
    return x[index].reshape((table.shape[0], span) + x.shape[2:])


def _merge(m, l, acc, axis):
    """Partial (m, l, acc) along ``axis`` as one: the largest m, the others rescaled to it."""
    top = jnp.max(m, axis=axis, keepdims=True)
    weight = jnp.exp(m - top)
    return tiles.Running(jnp.squeeze(top, axis), jnp.sum(weight * l, axis=axis),
                         jnp.sum(weight[..., None] * acc, axis=axis))
