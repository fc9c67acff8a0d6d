"""The "xla" implementation, the primitives' default lowering: FlashAttention-2 in jax.numpy / lax.

    forward(q, k, v, q_lengths, kv_lengths, **params) -> (o, lse)
    backward(q, k, v, o, lse, do, g_lse, q_lengths, kv_lengths, **params) -> (dq, dk, dv)

Shapes and dtypes as the primitives (primitives.py): q/o/dO [B, Tq, H, D], k/v [B, Tkv, HKV, D]
in one float dtype, lse/g_lse float32 [B, H, Tq] (natural log), lengths int32 [B] or None. All math
is float32; outputs are cast to the input dtype. Method: Dao, "FlashAttention-2" (2023): the
forward walks key blocks with an online softmax, the backward recomputes each tile's scores from
(q, k, v, lse) and accumulates dQ, dK, dV (tile math in ``xla_tiles``).

Size rule: a problem with ``q_len <= DENSE_MAX_LEN`` and ``kv_len <= DENSE_MAX_LEN`` runs as one
dense tile (no loops: fastest when the scores are small). Anything larger is tiled into blocks of
``BLOCK_Q`` query rows by ``BLOCK_K`` keys: a scan over query blocks with an inner loop over only
the key blocks that intersect the causal/window band and the valid lengths (the forward), and a
scan over key blocks with an inner loop over the query blocks that can see them (the backward,
which adds each tile's dQ into its query block, in a fixed order: deterministic). Temporary memory
is then O(B * H * BLOCK_Q * BLOCK_K) plus the float32 copies of the inputs: linear in length.

Non-finite inputs (DESIGN.md section 3): rows past the lengths are zeroed first (padding is never
read). The tiles get each operand in the form that keeps NaN from reaching invisible pairs
(``xla_tiles``: non-finite key rows all-NaN, weighted values with non-finite entries zeroed), and
one ``lax.cond`` per primitive, taken only when some input is non-finite, puts NaN back in the
outputs that a visible pair would have made NaN (``nonfinite``: prefix sums, O(length * D)).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import nonfinite, visibility
from . import xla_tiles as tiles

F32 = tiles.F32
DENSE_MAX_LEN = 256
BLOCK_Q = 128
BLOCK_K = 128


class _Tiling(NamedTuple):
    """Block sizes (Br query rows, Bc keys) and block counts; dense = a single tile."""

    br: int
    bc: int
    nq: int
    nk: int

    @property
    def dense(self):
        return self.nq == 1 and self.nk == 1


def tiling(q_len, kv_len):
    """The _Tiling the size rule picks for these (static, non-zero) lengths."""
    if q_len <= DENSE_MAX_LEN and kv_len <= DENSE_MAX_LEN:
        return _Tiling(q_len, kv_len, 1, 1)
    br, bc = min(BLOCK_Q, q_len), min(BLOCK_K, kv_len)
    return _Tiling(br, bc, -(-q_len // br), -(-kv_len // bc))


# ------------------------------------------------------------------------- layout

def _valid(lengths, size):
    """bool [B, size]: position < length (None when every position is valid)."""
    return None if lengths is None else jnp.arange(size)[None, :] < lengths[:, None]


def _query_blocks(x, kv_heads, t: _Tiling, valid, scale=1.0):
    """[B, Tq, H, D] -> float32 [nq, B, HKV, G, Br, D], rows past the lengths zeroed."""
    b, length, h, d = x.shape
    x = x.astype(F32)
    if valid is not None:
        x = jnp.where(valid[:, :, None, None], x, 0.0)
    if scale != 1.0:
        x = x * jnp.float32(scale)
    x = jnp.pad(x, ((0, 0), (0, t.nq * t.br - length), (0, 0), (0, 0)))
    return x.reshape(b, t.nq, t.br, kv_heads, h // kv_heads, d).transpose(1, 0, 3, 4, 2, 5)


def _from_query_blocks(x, length, dtype):
    nq, b, hkv, g, br, d = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * br, hkv * g, d)[:, :length].astype(dtype)


def _key_blocks(x, t: _Tiling, valid):
    """[B, Tkv, HKV, D] -> float32 [nk, B, HKV, Bc, D], keys past the lengths zeroed."""
    b, length, hkv, d = x.shape
    x = x.astype(F32)
    if valid is not None:
        x = jnp.where(valid[:, :, None, None], x, 0.0)
    x = jnp.pad(x, ((0, 0), (0, t.nk * t.bc - length), (0, 0), (0, 0)))
    return x.reshape(b, t.nk, t.bc, hkv, d).transpose(1, 0, 3, 2, 4)


def _from_key_blocks(x, length, dtype):
    nk, b, hkv, bc, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, nk * bc, hkv, d)[:, :length].astype(dtype)


def _row_blocks(x, kv_heads, t: _Tiling):
    """float32 [B, H, Tq] -> [nq, B, HKV, G, Br]."""
    b, h, length = x.shape
    x = jnp.pad(x.astype(F32), ((0, 0), (0, 0), (0, t.nq * t.br - length)))
    return x.reshape(b, kv_heads, h // kv_heads, t.nq, t.br).transpose(3, 0, 1, 2, 4)


def _from_row_blocks(x, length):
    nq, b, hkv, g, br = x.shape
    return x.transpose(1, 2, 3, 0, 4).reshape(b, hkv * g, nq * br)[:, :, :length]


def _all_finite(*xs):
    # x * 0 is 0 for finite x and NaN otherwise; a float sum compiles far faster than a
    # boolean all-reduction on XLA:CPU.
    return jnp.isfinite(functools.reduce(jnp.add, [jnp.sum(x * 0.0) for x in xs]))


def _block(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _add_block(x, i, part):
    return jax.lax.dynamic_update_index_in_dim(x, _block(x, i) + part, i, 0)


def _block_ranges(lo, hi, n, size, other):
    """Per block of ``size`` positions (``n`` blocks), the range [first, last) of blocks of
    ``other`` positions that its intervals lo, hi [B, n * size] touch in any batch entry."""
    lo, hi = lo.reshape(-1, n, size), hi.reshape(-1, n, size)
    empty = hi <= lo
    first = jnp.min(jnp.where(empty, jnp.iinfo(jnp.int32).max, lo), axis=(0, 2))
    last = jnp.max(jnp.where(empty, 0, hi), axis=(0, 2))
    none = last <= first
    return (jnp.where(none, 0, first // other),
            jnp.where(none, 0, (last + other - 1) // other))


def _nan_rows(x):
    """A query or key row with any non-finite entry becomes all-NaN, so its scores are NaN
    (adding the row's sum of x * 0: 0 for a finite row, NaN otherwise)."""
    return x + jnp.sum(x * 0.0, axis=-1, keepdims=True)


def _zero_nonfinite(x):
    return jnp.where(jnp.isfinite(x), x, 0.0)


class _Blocks:
    """The block grid of one call: the band, the tiling, and the two loop drivers.

    ``check_rows`` / ``check_keys``: whether tiles must compare positions with the lengths
    (lengths were given, or the last block is padded).
    """

    def __init__(self, band, t: _Tiling, q_len, kv_len, has_q_lengths, has_kv_lengths):
        self.band, self.t = band, t
        self.check_rows = has_q_lengths or t.nq * t.br != q_len
        self.check_keys = has_kv_lengths or t.nk * t.bc != kv_len

    def visible(self, r, c):
        t = self.t
        return self.band.mask(r * t.br + jnp.arange(t.br, dtype=jnp.int32),
                              c * t.bc + jnp.arange(t.bc, dtype=jnp.int32),
                              check_rows=self.check_rows, check_keys=self.check_keys)

    def over_query_blocks(self, init, step, finish, qb):
        """For each query block r (rows of ``qb`` [nq, ...]): state = init(q_r), then
        state = step(state, c, q_r, visible) for every key block c that r can see, then
        finish(state). Returns the stacked results ([nq, ...] leaves)."""
        t = self.t
        if t.dense:
            q = qb[0]
            return jax.tree_util.tree_map(lambda x: x[None],
                                          finish(step(init(q), 0, q, self.visible(0, 0))))
        lo, hi = self.band.key_intervals(jnp.arange(t.nq * t.br, dtype=jnp.int32))
        firsts, lasts = _block_ranges(lo, hi, t.nq, t.br, t.bc)

        def query_block(_, xs):
            r, q, first, last = xs
            state = jax.lax.fori_loop(first, last,
                                      lambda c, s: step(s, c, q, self.visible(r, c)), init(q))
            return None, finish(state)

        return jax.lax.scan(query_block, None,
                            (jnp.arange(t.nq, dtype=jnp.int32), qb, firsts, lasts))[1]

    def over_key_blocks(self, row_init, tile, key_xs):
        """For each key block c (``key_xs``: arrays [nk, ...]) and every query block r that can
        see it, ``tile(r, xs_c, visible)`` -> (row part, key part); row parts are summed into
        ``row_init`` (leaves [nq, ...]) at block r, key parts per key block, in a fixed order
        (deterministic). Returns (row sums, stacked key sums [nk, ...])."""
        t = self.t
        if t.dense:
            rows, keys = tile(0, jax.tree_util.tree_map(lambda x: x[0], key_xs),
                              self.visible(0, 0))
            return (jax.tree_util.tree_map(lambda x: x[None], rows),
                    jax.tree_util.tree_map(lambda x: x[None], keys))
        lo, hi = self.band.row_intervals(jnp.arange(t.nk * t.bc, dtype=jnp.int32))
        firsts, lasts = _block_ranges(lo, hi, t.nk, t.bc, t.br)

        def key_block(row_acc, xs):
            c, first, last, xs = xs
            # The key sums start at zero, shaped like one tile's key part.
            zero_keys = jax.tree_util.tree_map(
                lambda s: jnp.zeros(s.shape, s.dtype),
                jax.eval_shape(lambda: tile(0, xs, self.visible(0, c))[1]))

            def body(r, accs):
                rows, keys = tile(r, xs, self.visible(r, c))
                row_acc = jax.tree_util.tree_map(lambda a, p: _add_block(a, r, p), accs[0], rows)
                return row_acc, jax.tree_util.tree_map(jnp.add, accs[1], keys)

            return jax.lax.fori_loop(first, last, body, (row_acc, zero_keys))

        return jax.lax.scan(key_block, row_init,
                            (jnp.arange(t.nk, dtype=jnp.int32), firsts, lasts, key_xs))


def _setup(q, k, q_lengths, kv_lengths, is_causal, window_left, window_right, bottom_right):
    batch, q_len, _, _ = q.shape
    kv_len = k.shape[1]
    band = visibility.Band(batch, q_len, kv_len, q_lengths, kv_lengths, is_causal=is_causal,
                           window_left=window_left, window_right=window_right,
                           bottom_right=bottom_right)
    t = tiling(q_len, kv_len)
    return _Blocks(band, t, q_len, kv_len, q_lengths is not None, kv_lengths is not None), t


def _heads_major(x):
    """[B, T, N, D] -> [B, N, T, D] (the sequence axis where ``nonfinite`` counts along it)."""
    return jnp.swapaxes(x, 1, 2)


def _poison_if(pred, out, counts_fn):
    """out with NaN where ``counts_fn()`` (computed only when ``pred``) is positive."""
    return jax.lax.cond(pred, lambda o: nonfinite.poison(o, counts_fn()), lambda o: o, out)


def _per_query_head(counts):
    """Counts [B, HKV, T, D] of a kv head -> [B, T, HKV, 1, D] against [B, T, HKV, G, D]."""
    return _heads_major(counts)[:, :, :, None, :]


# ------------------------------------------------------------------------- forward

def forward(q, k, v, q_lengths=None, kv_lengths=None, *, scale, is_causal=False, window_left=-1,
            window_right=-1, bottom_right=False, **unused_static):
    """(o [B, Tq, H, D] in q.dtype, lse float32 [B, H, Tq]); see the module docstring."""
    del unused_static  # has_* flags and implementation: implied by the operands / irrelevant here
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if 0 in (batch, q_len, kv_len):
        return jnp.zeros(q.shape, q.dtype), jnp.full((batch, num_heads, q_len), -jnp.inf, F32)
    blocks, t = _setup(q, k, q_lengths, kv_lengths, is_causal, window_left, window_right,
                       bottom_right)
    kv_valid = _valid(kv_lengths, kv_len)
    qb = _query_blocks(q, kv_heads, t, _valid(q_lengths, q_len), scale)
    kb, vb = _key_blocks(k, t, kv_valid), _key_blocks(v, t, kv_valid)
    k_nan, v_zeroed = _nan_rows(kb), _zero_nonfinite(vb)

    def step(state, c, q, visible):  # q: the rows of _nan_rows(qb)
        return tiles.forward_step(state, q, _block(k_nan, c), _block(v_zeroed, c), visible)

    o, lse = blocks.over_query_blocks(tiles.running_init, step, tiles.forward_finish,
                                      _nan_rows(qb))
    o = _from_query_blocks(o, q_len, F32).reshape(batch, q_len, kv_heads, -1, head_dim)

    def counts():
        lo, hi = blocks.band.key_intervals(jnp.arange(q_len, dtype=jnp.int32))
        return _per_query_head(nonfinite.interval_counts(
            nonfinite.indicator(_heads_major(v)), lo, hi))

    o = _poison_if(~_all_finite(vb), o, counts)
    return o.reshape(q.shape).astype(q.dtype), _from_row_blocks(lse, q_len)


# ------------------------------------------------------------------------- backward

def backward(q, k, v, o, lse, do, g_lse, q_lengths=None, kv_lengths=None, *, scale,
             is_causal=False, window_left=-1, window_right=-1, bottom_right=False,
             **unused_static):
    """(dq, dk, dv) in the input dtypes, from the forward's o and lse and the cotangents dO and
    g_lse: delta = rowsum(dO * O) - g_lse (0 for rows past q_len), then the FlashAttention-2
    recompute backward. Rows with no visible key and padding contribute nothing."""
    del unused_static
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if 0 in (batch, q_len, kv_len):
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape,
                                                                                   v.dtype)
    blocks, t = _setup(q, k, q_lengths, kv_lengths, is_causal, window_left, window_right,
                       bottom_right)
    q_valid, kv_valid = _valid(q_lengths, q_len), _valid(kv_lengths, kv_len)
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(F32), o.astype(F32),
                       precision=jax.lax.Precision.HIGHEST) - g_lse.astype(F32)
    if q_valid is not None:
        delta = jnp.where(q_valid[:, None, :], delta, 0.0)
    qb, dob = _query_blocks(q, kv_heads, t, q_valid, scale), _query_blocks(do, kv_heads, t,
                                                                           q_valid)
    kb, vb = _key_blocks(k, t, kv_valid), _key_blocks(v, t, kv_valid)
    row_xs = (_nan_rows(qb), _zero_nonfinite(qb), dob, _zero_nonfinite(dob),
              _row_blocks(lse, kv_heads, t), _row_blocks(delta, kv_heads, t))

    def tile(r, xs, visible):
        q_r, q_zeroed, do_r, do_zeroed, lse_r, delta_r = (_block(x, r) for x in row_xs)
        dq, dk, dv = tiles.backward_tile(tiles.BackwardOperands(
            q_r, q_zeroed, *xs, do_r, do_zeroed, lse_r, delta_r), visible)
        return dq, (dk, dv)

    dq, (dk, dv) = blocks.over_key_blocks(jnp.zeros(qb.shape, F32), tile,
                                          (_nan_rows(kb), _zero_nonfinite(kb), vb))
    dq = _from_query_blocks(dq * jnp.float32(scale), q_len, F32)
    dk, dv = _from_key_blocks(dk, kv_len, F32), _from_key_blocks(dv, kv_len, F32)

    def poisoned(grads):
        dq, dk, dv = grads
        lo, hi = blocks.band.key_intervals(jnp.arange(q_len, dtype=jnp.int32))
        dq_counts = _per_query_head(nonfinite.interval_counts(
            nonfinite.indicator(_heads_major(k)), lo, hi))
        # dK and dV counts in one pass: q's and dO's indicators side by side on the last axis.
        lo, hi = blocks.band.row_intervals(jnp.arange(kv_len, dtype=jnp.int32))
        group = (batch, q_len, kv_heads, num_heads // kv_heads, head_dim)
        bad = jnp.concatenate([nonfinite.indicator(x.reshape(group), group_axis=3)
                               for x in (q, do)], axis=-1)
        key_counts = _heads_major(nonfinite.interval_counts(_heads_major(bad), lo, hi))
        dq = nonfinite.poison(dq.reshape(group), dq_counts).reshape(q.shape)
        return (dq, nonfinite.poison(dk, key_counts[..., :head_dim]),
                nonfinite.poison(dv, key_counts[..., head_dim:]))

    dq, dk, dv = jax.lax.cond(~_all_finite(qb, kb, dob), poisoned, lambda g: g, (dq, dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
