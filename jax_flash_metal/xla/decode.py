"""The xla implementation's short-query forward (decoding with a KV cache): the cache read in
place by two matmuls, and a split-KV loop over spans where an output is not finite.

A forward with at most ``MAX_QUERY_ROWS`` query rows over more keys than the schedule's dense tile,
on a schedule with ``split_kv_decode`` (the accelerators'; ``covers``), runs here instead of the
block loops of ``attention``, whose block layout copies the whole cache first. The whole cache
is read in place by two matmuls per batch row over all heads (``_block_scores``: the keys
[Tkv, HKV D] times the queries laid out block-diagonally; ``_weighted_sum``: the probabilities
[HKV G Tq, Tkv] times the values [Tkv, HKV Dv], keeping the diagonal blocks), with the float32
scores [B, Tkv, HKV, G, Tq] and their (m, l) in between (for groups of batch rows one after
another where all the scores would pass ``SCORE_BYTES``): a matmul, or a reduction, with the head
as a batch axis made XLA copy the cache into [B, HKV, Tkv, D] (or [B, HKV, D, Tkv]) first, and
a slice of the cache along its keys is a copy too when it feeds a matmul. The matmuls do HKV
times the useful multiplies (small next to reading the cache) and weigh every key of every KV
head, so a non-finite entry could reach an output it must not: where any output is not finite,
and only then (a ``lax.cond``), the exact path runs instead: a ``lax.fori_loop`` over spans of
``SPAN`` keys or more (at most ``MAX_SPANS``), each a multiply-and-sum over the head dim (exact per
head), (m, l), and the weighted sum with the span's non-finite values zeroed and NaN placed where a
row sees one (a second matmul counts them), merged into the loop's state (FlashAttention's
rescaling; Dao et al., "Flash-Decoding for long-context inference", 2023). Its copies are of one
span at a time. With a page table the fast path gathers the cache's pages (page 0 past a row's
length) and each exact span only its own; spans that no row can see are skipped when the band is
static.

Semantics are those of ``attention.forward`` (and its outputs (o, lse, row_max, log_sum)):
lengths, causal and local windows in either alignment, grouped-query attention, soft cap, ALiBi,
sinks, exact NaN placement (a non-finite query or key entry makes its visible scores NaN; a value
entry reaches only outputs of the rows that see its key) and empty rows (o = 0, lse = -inf or the
sink). Bias, mask, segment ids and dropout keep the block loops. All math is float32; the
matmuls take half-precision q, K and V as they are, and P rounded to V's dtype, accumulating in
float32 (``tiles.dot``, as the block loops).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..core import features, visibility
from . import tiles

F32 = tiles.F32
MAX_QUERY_ROWS = 16  # query rows per batch row that count as decoding
SPAN = 8192  # keys per span at least: bounds the float32 scores a span keeps
MAX_SPANS = 32  # longer caches take longer spans (the spans are unrolled)
SCORE_BYTES = 128 * 2**20  # the fast path's float32 scores kept at once, at most (but one row's)


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
    rows = np.arange(q_len, dtype=np.int32)
    spans = range(-(-kv_len // span))
    if visibility.array_module(band.q_lengths, band.kv_lengths) is np:  # a static band
        lo, hi = band.key_intervals(rows)
        seen = hi > lo
        spans = range(int(np.min(np.where(seen, lo, kv_len))) // span,
                      -(-int(np.max(np.where(seen, hi, 0))) // span))

    # [B, 1, HKV, G, Tq, D]: query head hkv * G + g, after the key axis.
    qx = _nan_f32(q).reshape(batch, q_len, kv_heads, groups, -1).transpose(0, 2, 3, 1, 4)
    qx = qx[:, None]
    alibi = (None if operands.alibi_slopes is None
             else operands.alibi_slopes.reshape(batch, 1, kv_heads, groups, 1))

    def key_major(x):
        """[B, Tq, span] -> [B, span, 1, 1, Tq], the scores' axes."""
        return x.transpose(0, 2, 1)[:, :, None, None, :]

    def scores(s, keys, lo=0, hi=batch):
        """The scores [hi - lo, n, HKV, G, Tq] of batch rows [lo, hi) and keys ``keys``
        (int [n]) with their features; s: their products q . k."""
        s = features.soft_cap(s * jnp.float32(scale), logits_soft_cap)[0]
        if alibi is not None:
            distance = key_major(band.alibi_distance(jnp.asarray(rows), keys))[lo:hi]
            s = s + alibi[lo:hi] * distance
        return s

    def span_partials(c, state):
        """``state`` (m, l, acc: [B, HKV, G, Tq] and [B, HKV, G, Tq, Dv]) with span c (traced)
        merged in: the scores a multiply-and-sum over the head dim (exact per head), the
        weighted sum ``_weighted_sum`` of the span's values with the non-finite ones zeroed,
        and NaN where a row sees a key whose value entry is not finite (a matmul of the
        visibility and those entries counts them)."""
        nominal = c * span
        start = jnp.minimum(nominal, kv_len - span)  # the last span ends at the cache's end
        keys = start + jnp.arange(span, dtype=jnp.int32)
        seen = band.mask(jnp.asarray(rows), keys) & (keys >= nominal)[None, None, :]
        visible = key_major(seen)
        kx = _nan_f32(_read(k, start, span, table, band.kv_lengths))[:, :, :, None, None]
        vx = _read(v, start, span, table, band.kv_lengths)
        s = jnp.where(visible, scores(jnp.sum(qx * kx, axis=-1), keys), -jnp.inf)
        m, l = tiles.row_statistics(s, axis=1)
        finite = jnp.isfinite(vx)
        acc = _weighted_sum(jnp.exp(s - m[:, None]),
                            jnp.where(finite, vx, jnp.zeros((), vx.dtype)))
        shape = visible.shape[:2] + (kv_heads, groups, q_len)
        counts = _weighted_sum(jnp.broadcast_to(visible, shape).astype(F32),
                               (~finite).astype(vx.dtype))
        acc = jnp.where(counts > 0, jnp.nan, acc)
        part = tiles.Running(m, l, acc)
        return _merge(*(jnp.stack(x, axis=0) for x in zip(state, part)), axis=0)

    def exact():
        """The spans one by one in a loop (each one's copies are of that span only)."""
        rows_shape = (batch, kv_heads, groups, q_len)
        empty = tiles.Running(jnp.full(rows_shape, tiles.LOWEST, F32),
                              jnp.zeros(rows_shape, F32),
                              jnp.zeros(rows_shape + (value_dim,), F32))
        return jax.lax.fori_loop(spans.start, spans.stop, span_partials, empty)

    # The whole cache in two matmuls that read K and V in place (``_matmuls``). They weigh
    # every key of every KV head, so a non-finite entry could reach an output it must not:
    # where any output is not finite, and only then, the exact reductions run instead.
    keys = np.arange(kv_len, dtype=np.int32)
    kx, vx = (_read(x, 0, kv_len, table, band.kv_lengths) for x in (k, v))
    visible = key_major(band.mask(jnp.asarray(rows), keys))  # [B, Tkv, 1, 1, Tq]

    def rows_of(lo, hi):
        """The fast path's (m, l, acc) of batch rows [lo, hi)."""
        s = scores(_block_scores(q[lo:hi], kx[lo:hi]), keys, lo, hi)
        s = jnp.where(visible[lo:hi], s, -jnp.inf)
        m, l = tiles.row_statistics(s, axis=1)
        return tiles.Running(m, l, _weighted_sum(jnp.exp(s - m[:, None]), vx[lo:hi]))

    # Batch rows in groups whose float32 scores fit SCORE_BYTES: the groups run one after
    # another, so the scores of one group at a time are kept.
    step = max(1, SCORE_BYTES // (kv_len * num_heads * q_len * 4))
    parts = [rows_of(lo, min(lo + step, batch)) for lo in range(0, batch, step)]
    fast = tiles.Running(*(jnp.concatenate(x, axis=0) for x in zip(*parts)))
    state = jax.lax.cond(jnp.all(jnp.isfinite(fast.acc)), lambda: fast, exact)
    sinks = (None if operands.sinks is None
             else operands.sinks.astype(F32).reshape(1, kv_heads, groups, 1))
    o, lse, row_max, log_sum = tiles.forward_finish(state, sinks)
    o = o.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, value_dim).astype(q.dtype)
    return (o, *(x.reshape(batch, num_heads, q_len) for x in (lse, row_max, log_sum)))


def _read(x, start, span, table, kv_lengths):
    """Keys [start, start + span) (start an int or a traced int32) of the cache x as
    [B, span, HKV, D]: a slice of x [B, Tkv, HKV, D], or with ``table`` a gather of the span's
    pages from x [P, S, HKV, D] (page 0 for the pages past a row's length, never weighed)."""
    if table is None:
        return jax.lax.dynamic_slice_in_dim(x, start, span, axis=1)
    page = x.shape[1]
    pages = jax.lax.dynamic_slice_in_dim(table, start // page, span // page, axis=1)
    first_key = start + np.arange(span // page, dtype=np.int32) * page
    used = first_key[None, :] < kv_lengths[:, None]
    index = jnp.clip(jnp.where(used, pages, 0), 0, x.shape[0] - 1)
    return x[index].reshape((table.shape[0], span) + x.shape[2:])


def _block_scores(q, k):
    """q . k float32 [B, Tkv, HKV, G, Tq] for q [B, Tq, H, D] and k [B, Tkv, HKV, D], as one
    matmul per batch row over all heads: [Tkv, HKV D] x [HKV D, HKV G Tq] with the queries laid
    out block-diagonally (head hkv's queries in rows hkv D .. hkv D + D, zeros elsewhere), so k
    is read in its own layout. HKV - 1 of every HKV products are with zeros: k entries that are
    not finite make the scores of other heads NaN too (``forward`` then reruns exactly)."""
    batch, q_len, num_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = num_heads // kv_heads
    qx = q.reshape(batch, q_len, kv_heads, groups, head_dim).transpose(0, 4, 2, 3, 1)
    same = (np.arange(kv_heads)[:, None] == np.arange(kv_heads)[None, :])
    blocks = jnp.where(same[None, :, None, :, None, None], qx[:, None], jnp.zeros((), q.dtype))
    blocks = blocks.reshape(batch, kv_heads * head_dim, -1)  # [B, HKV D, HKV G Tq]
    s = tiles.dot("bkn,bnm->bkm", k.reshape(batch, k.shape[1], -1), blocks)
    return s.reshape(batch, k.shape[1], kv_heads, groups, q_len)


def _weighted_sum(p, v):
    """acc [B, HKV, G, Tq, Dv] = sum_j p_j v_j for p float32 [B, span, HKV, G, Tq] (0 where
    unseen) and v [B, span, HKV, Dv], as one matmul per batch row over all heads:
    [HKV G Tq, span] x [span, HKV Dv], reading v in its own layout (a matmul with the head as
    a batch axis needs it as [B, HKV, span, Dv], a copy), then the HKV diagonal blocks. The
    other blocks are HKV - 1 times the useful work: about 65 GFLOP at 131072 keys, batch 8, 32
    heads, small next to reading the cache. P is rounded to v's dtype where v is half
    precision (``tiles.dot``), as the block loops do."""
    batch, span, kv_heads, groups, q_len = p.shape
    value_dim = v.shape[3]
    full = tiles.dot("bkm,bkn->bmn", p.reshape(batch, span, -1), v.reshape(batch, span, -1))
    full = full.reshape(batch, kv_heads, groups, q_len, kv_heads, value_dim)
    heads = np.arange(kv_heads)
    return jnp.moveaxis(full[:, heads, :, :, heads], 0, 1)  # [B, HKV, G, Tq, Dv]


def _merge(m, l, acc, axis):
    """Partial (m, l, acc) along ``axis`` as one: the largest m, the others rescaled to it."""
    top = jnp.max(m, axis=axis, keepdims=True)
    weight = jnp.exp(m - top)
    return tiles.Running(jnp.squeeze(top, axis), jnp.sum(weight * l, axis=axis),
                         jnp.sum(weight[..., None] * acc, axis=axis))
