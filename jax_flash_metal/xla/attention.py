"""The "xla" implementation, the primitives' default lowering: FlashAttention-2 in jax.numpy / lax.

    forward(q, k, v, operands=Operands(), *, scale, is_causal, window_left, window_right,
            bottom_right, logits_soft_cap, dropout_rate, dropout_key_groups, **unused_static)
            -> (o, lse, row_max, log_sum)
    backward(q, k, v, o, lse, row_max, log_sum, do, g_lse, operands=Operands(), *, (the same),
             bias_grad, **unused_static) -> (dq, dk, dv[, dbias])

Shapes and dtypes as the primitives': q/o/dO [B, Tq, H, D], k/v [B, Tkv, HKV, D] in one float
dtype, lse/g_lse and the residuals row_max/log_sum (the row max m and log l, kept apart:
``xla_tiles.probabilities``) float32 [B, H, Tq] (natural log), ``operands`` the optional ones of
``contract.Operands``. All math is float32 (half-precision inputs multiply as half-precision
operands with float32 accumulation where the schedule's ``half_operands`` says so); outputs are
cast to the input dtype. Method: Dao,
"FlashAttention-2" (2023). Problems with both lengths at most the schedule's ``dense_max_len``
run as one dense tile; larger ones as loops over ``block_q`` x ``block_k`` tiles (block sizes per
lowering platform: ``xla_schedule``; tile math in ``xla_tiles``), with memory linear in length;
NaN placement is exact (``nonfinite``). A short-query forward (decoding) on the accelerators runs
``decode`` instead, which reads the KV cache span by span. The size rule, the loops and the
NaN placement: docs/design.md#the-xla-implementation-and-the-reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import paging
from ..core import nonfinite
from ..core.contract import Operands
from . import blocks, decode, schedule as xla_schedule
from .blocks import block, counted, dropout_of_pass, of_pass, weighted
from . import tiles

F32 = tiles.F32
CPU = xla_schedule.SCHEDULES["cpu"]

# ------------------------------------------------------------------------- forward

def forward(q, k, v, operands=Operands(), *, scale, schedule=CPU, is_causal=False,
            window_left=-1, window_right=-1, bottom_right=False, logits_soft_cap=None,
            dropout_rate=0.0, dropout_key_groups=True, **unused_static):
    """(o [B, Tq, H, D] in q.dtype, lse, row_max, log_sum float32 [B, H, Tq]); see the module
    docstring. ``operands``: contract.Operands (lengths, segment ids, bias, mask, sinks,
    dropout or None); ``schedule``: ``xla_schedule.Schedule`` (default: the cpu one)."""
    del unused_static  # has_* flags and implementation: implied by the operands / irrelevant here
    kv_len = k.shape[1] if operands.page_table is None else paging.logical_len(
        k, operands.page_table)
    if decode.covers(q, k, operands, schedule, dropout_rate, kv_len):  # split-KV decode
        return decode.forward(q, k, v, operands, scale=scale, is_causal=is_causal,
                                  window_left=window_left, window_right=window_right,
                                  bottom_right=bottom_right, logits_soft_cap=logits_soft_cap)
    if operands.page_table is not None:  # a paged cache: read as the contiguous one
        k, v = (paging.gather(x, operands.page_table, operands.kv_lengths) for x in (k, v))
        operands = operands._replace(page_table=None)
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    o_shape = q.shape[:3] + v.shape[3:]
    if 0 in (batch, q_len, kv_len):  # every row is empty: m = lse (the sink or -inf), l = 1
        lse = blocks.empty_lse(operands.sinks, batch, num_heads, q_len)
        return jnp.zeros(o_shape, q.dtype), lse, lse, jnp.zeros_like(lse)
    prec = blocks.precision(q.dtype, scale, schedule)
    grid, t = blocks.setup(q, k, operands, schedule, is_causal, window_left, window_right,
                           bottom_right, (dropout_rate, dropout_key_groups), backward=False,
                           half=prec.dtype != F32)
    kv_valid = blocks.valid(operands.kv_lengths, kv_len)
    qb = blocks.query_blocks(q, kv_heads, t, blocks.valid(operands.q_lengths, q_len), prec.dtype,
                             prec.q_scale)
    kb, vb = (blocks.key_blocks(x, t, kv_valid, prec.dtype) for x in (k, v))
    sinks = None if operands.sinks is None else operands.sinks.reshape(1, kv_heads, -1, 1)
    # NaN placement needs a counting pass (or the dense tile's counts) only where pairs are
    # hidden and some value is non-finite.
    counting = ~blocks.all_finite(v) if grid.hides_pairs else None

    if t.dense:
        visible, bias, z = grid.visible(0, 0)
        o, *stats = tiles.forward_whole_rows(qb[0], kb[0],
                                             weighted(0, vb, grid.hides_pairs)[0],
                                             visible, bias, logits_soft_cap, sinks,
                                             prec.score_scale, z,
                                             schedule.one_pass_statistics and prec.dtype != F32)
        o, stats = o[None], [x[None] for x in stats]
        if counting is not None:
            (o,) = blocks.poison_if(counting, [o],
                                    lambda: [_tile_counts_forward(grid, vb, num_heads)])
    else:
        def step(state, p, c, q, tile):  # q: the rows of qb
            visible, bias, z = tile
            return tiles.forward_step(state, q, of_pass(p, block(kb, c)),
                                      weighted(p, block(vb, c), grid.hides_pairs), visible,
                                      of_pass(p, bias), logits_soft_cap, prec.score_scale,
                                      dropout_of_pass(p, z))

        def finish(state, p):  # the counting pass has no sinks
            return tiles.forward_finish(state, of_pass(p, sinks, -jnp.inf))

        o, *stats = grid.over_query_blocks(lambda q: tiles.running_init(q, v.shape[3]),
                                           step, finish,
                                           lambda p, r: of_pass(p, block(qb, r)),
                                           counting)
        o, stats = counted(o), [x[0] for x in stats]
    o = blocks.from_query_blocks(o, q_len, q.dtype)
    return (o, *(blocks.from_row_blocks(x, q_len) for x in stats))


def _visible_f32(tile, shape):
    visible = tile[0]
    return jnp.ones(shape, F32) if visible is None else jnp.broadcast_to(visible, shape).astype(F32)


def _tile_counts_forward(grid, vb, num_heads):
    """Per output entry of the dense tile, how many visible keys have a non-finite value
    there (one matmul): [1, B, HKV, G, Br, D]."""
    bad_v = nonfinite.indicator(vb)  # [1, B, HKV, Bc, D]
    t = grid.t
    b, hkv, _, d = bad_v.shape[1:]

    def init(q):
        return jnp.zeros(q.shape[:-1] + (d,), F32)

    def step(acc, p, c, q, tile):
        shape = q.shape[:-1] + (t.bc,)
        return acc + jnp.einsum("bhgqk,bhkd->bhgqd", _visible_f32(tile, shape), block(bad_v, c))

    # Only the shape of the query block matters here.
    rows = jnp.zeros((b, hkv, num_heads // hkv, t.br, 1), F32)
    return grid.over_query_blocks(init, step, lambda acc, p: acc, lambda p, r: rows)[0]


# ------------------------------------------------------------------------- backward

def backward(q, k, v, o, lse, row_max, log_sum, do, g_lse, operands=Operands(), *, scale,
             schedule=CPU, is_causal=False, window_left=-1, window_right=-1, bottom_right=False,
             logits_soft_cap=None, dropout_rate=0.0, dropout_key_groups=True, bias_grad=False,
             alibi_grad=False, **unused_static):
    """(dq, dk, dv[, dbias][, dslopes]) in the input dtypes (dbias float32 in the bias
    operand's shape, with ``bias_grad``; dslopes float32 [B, H] = sum over (i, j) of
    dS_ij * -|i + off - j|, with ``alibi_grad``), from the forward's o, lse and residuals and
    the cotangents dO and g_lse:
    delta = rowsum(dO * O) - g_lse (0 for rows past q_len), then the FlashAttention-2
    recompute backward. Rows with no visible key and padding contribute nothing. Sinks are not
    read: lse already includes them."""
    del unused_static
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if 0 in (batch, q_len, kv_len):
        zeros = [jnp.zeros(x.shape, x.dtype) for x in (q, k, v)]
        return zeros + [jnp.zeros(x.shape, F32) for x, wanted in (
            (operands.bias, bias_grad), (operands.alibi_slopes, alibi_grad)) if wanted]
    prec = blocks.precision(q.dtype, scale, schedule)
    grid, t = blocks.setup(q, k, operands, schedule, is_causal, window_left, window_right,
                           bottom_right, (dropout_rate, dropout_key_groups), backward=True,
                           half=prec.dtype != F32)
    q_valid = blocks.valid(operands.q_lengths, q_len)
    kv_valid = blocks.valid(operands.kv_lengths, kv_len)
    # D from the O given, not as rowsum(P dP) (equal only when O = P V over these keys): ring
    # attention passes the O, m and log l of the whole sequence with a part of its keys.
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(F32), o.astype(F32),
                       precision=jax.lax.Precision.HIGHEST) - g_lse.astype(F32)
    if q_valid is not None:
        delta = jnp.where(q_valid[:, None, :], delta, 0.0)
    qb = blocks.query_blocks(q, kv_heads, t, q_valid, prec.dtype, prec.q_scale)
    dob = blocks.query_blocks(do, kv_heads, t, q_valid, prec.dtype)
    kb, vb = (blocks.key_blocks(x, t, kv_valid, prec.dtype) for x in (k, v))
    # A visible pair read a non-finite q or k entry exactly when some row's lse is NaN (the
    # score is NaN: tiles.nan_entries), and a non-finite dO entry of a row makes its delta
    # non-finite (dO * O has no finite value for it): [B, H, Tq] arrays are checked instead of
    # reading q, k and dO again.
    # Other causes (a NaN O, bias or g_lse) only run the counting pass. Where no pair is
    # hidden, the matmuls place NaN themselves (``blocks.weighted``).
    nonfinite_read = None
    if grid.hides_pairs:
        nonfinite_read = jnp.isnan(jnp.sum(lse)) | ~blocks.all_finite(delta)
    dbias_init = jnp.zeros(grid.features.bias.shape, F32) if bias_grad else None
    counting = None if t.dense else nonfinite_read
    hides = grid.hides_pairs
    max_b, log_sum_b, delta_b = (blocks.row_blocks(x, kv_heads, t)
                                 for x in (row_max, log_sum, delta))

    def tile(p, r, c, xs, visible_bias):
        visible, bias, z = visible_bias
        q_r, do_r = block(qb, r), block(dob, r)
        dq, dk, dv, ds = tiles.backward_tile(tiles.BackwardOperands(
            of_pass(p, q_r), weighted(p, q_r, hides), *xs, of_pass(p, do_r),
            weighted(p, do_r, hides), of_pass(p, block(max_b, r)),
            of_pass(p, block(log_sum_b, r)), of_pass(p, block(delta_b, r), -1.0)), visible,
            of_pass(p, bias), logits_soft_cap, prec.score_scale, dropout_of_pass(p, z),
            schedule.pinned_transposes)
        rows = dq
        if alibi_grad:  # per row: sum_j dS * -|i + off - j| (0 in the counting pass)
            rows = (dq, of_pass(p, jnp.sum(ds * grid.alibi_distance(r, c), axis=-1), 0.0))
        return rows, (dk, dv), of_pass(p, ds)

    def key_xs(p, c):
        k_c = block(kb, c)
        return of_pass(p, k_c), weighted(p, k_c, hides), of_pass(p, block(vb, c))

    slots = blocks.pass_count(counting)[1]
    row_init = jnp.zeros((slots,) + qb.shape, F32)
    if alibi_grad:
        row_init = (row_init, jnp.zeros((slots,) + qb.shape[:-1], F32))
    rows, (dk, dv), dbias = grid.over_key_blocks(row_init, tile, key_xs, dbias_init, counting)
    dq, dslopes = rows if alibi_grad else (rows, None)
    if t.dense and nonfinite_read is not None:
        dq, dk, dv = blocks.poison_if(nonfinite_read, [dq[0], dk[0], dv[0]],
                                      lambda: _tile_counts_backward(grid, qb, kb, dob))
    else:
        dq, dk, dv = counted(dq), counted(dk), counted(dv)
    dq = dq * jnp.float32(scale)
    if prec.score_scale is not None:  # the operands' q lacked the scale
        dk = dk * jnp.float32(scale)
    grads = [blocks.from_query_blocks(dq, q_len, q.dtype),
             blocks.from_key_blocks(dk, kv_len, k.dtype),
             blocks.from_key_blocks(dv, kv_len, v.dtype)]
    if bias_grad:
        grads.append(_unpad_bias(dbias, operands.bias.shape))
    if alibi_grad:  # pass 0's [nq, B, HKV, G, Br] summed over the rows
        grads.append(jnp.sum(dslopes[0], axis=(0, 4)).reshape(batch, num_heads))
    return grads


def _unpad_bias(x, shape):
    """The padded [b, HKV|1, G|1, tq|1, tkv|1] layout back to the bias operand's shape."""
    b, h, tq, tkv = shape
    return x[:, :, :, :tq, :tkv].reshape(b, h, tq, tkv)


def _tile_counts_backward(grid, qb, kb, dob):
    """For the dense tile, per gradient entry, how many visible pairs read a non-finite input
    there: dQ from K ([1, B, HKV, G, Br, D]), dK from q and dV from dO ([1, B, HKV, Bc, D])."""
    bad_q, bad_do, bad_k = (nonfinite.indicator(x) for x in (qb, dob, kb))

    def tile(p, r, c, bad_k_c, visible_bias):
        q_r, do_r = block(bad_q, r), block(bad_do, r)
        vis = _visible_f32(visible_bias, q_r.shape[:-1] + (bad_k_c.shape[-2],))
        return (jnp.einsum("bhgqk,bhkd->bhgqd", vis, bad_k_c),
                (jnp.einsum("bhgqk,bhgqd->bhkd", vis, q_r),
                 jnp.einsum("bhgqk,bhgqd->bhkd", vis, do_r)), None)

    dq, (dk, dv), _ = grid.over_key_blocks(jnp.zeros((1,) + qb.shape, F32), tile,
                                           lambda p, c: block(bad_k, c))
    return dq[0], dk[0], dv[0]
