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

Non-finite inputs: rows past the lengths are zeroed first (padding is never read), then one
``lax.cond`` on "every remaining input is finite" picks the plain-matmul path or the path that
places NaN exactly as DESIGN.md section 3 says (``xla_tiles``); only the chosen one runs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import visibility
from . import xla_tiles as tiles

F32 = tiles.F32
DENSE_MAX_LEN = 512
BLOCK_Q = 256
BLOCK_K = 256


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
    return functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(x)) for x in xs])


def _block(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _add_block(x, i, part):
    return jax.lax.dynamic_update_index_in_dim(x, _block(x, i) + part, i, 0)


def _block_range(lo, hi, size):
    """Indices of the blocks of ``size`` that cover positions [lo, hi)."""
    return lo // size, (hi + size - 1) // size


def _band(batch, q_len, kv_len, q_lengths, kv_lengths, is_causal, window_left, window_right,
          bottom_right):
    return visibility.Band(batch, q_len, kv_len, q_lengths, kv_lengths, is_causal=is_causal,
                           window_left=window_left, window_right=window_right,
                           bottom_right=bottom_right)


# ------------------------------------------------------------------------- forward

def _forward_blocks(band, t: _Tiling, qb, kb, vb, exact_nonfinite):
    """(o [nq, B, HKV, G, Br, D], lse [nq, B, HKV, G, Br]) for blocked inputs."""
    rows_in = jnp.arange(t.br, dtype=jnp.int32)
    keys_in = jnp.arange(t.bc, dtype=jnp.int32)
    hits_shape = qb.shape[1:3] + qb.shape[4:]

    def step(state, q, c, rows):
        visible = band.mask(rows, c * t.bc + keys_in)
        return tiles.forward_step(state, q, _block(kb, c), _block(vb, c), visible,
                                  exact_nonfinite)

    if t.dense:
        state = step(tiles.running_init(qb[0], hits_shape, exact_nonfinite), qb[0], 0, rows_in)
        return tuple(x[None] for x in tiles.forward_finish(state))

    def query_block(_, xs):
        r, q = xs
        rows = r * t.br + rows_in
        c_lo, c_hi = _block_range(*band.key_span(r * t.br, (r + 1) * t.br), t.bc)
        state = jax.lax.fori_loop(c_lo, c_hi, lambda c, s: step(s, q, c, rows),
                                  tiles.running_init(q, hits_shape, exact_nonfinite))
        return None, tiles.forward_finish(state)

    return jax.lax.scan(query_block, None, (jnp.arange(t.nq, dtype=jnp.int32), qb))[1]


def forward(q, k, v, q_lengths=None, kv_lengths=None, *, scale, is_causal=False, window_left=-1,
            window_right=-1, bottom_right=False, **unused_static):
    """(o [B, Tq, H, D] in q.dtype, lse float32 [B, H, Tq]); see the module docstring."""
    del unused_static  # has_* flags and implementation: implied by the operands / irrelevant here
    batch, q_len, num_heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if 0 in (batch, q_len, kv_len):
        return jnp.zeros(q.shape, q.dtype), jnp.full((batch, num_heads, q_len), -jnp.inf, F32)
    band = _band(batch, q_len, kv_len, q_lengths, kv_lengths, is_causal, window_left,
                 window_right, bottom_right)
    t = tiling(q_len, kv_len)
    kv_valid = _valid(kv_lengths, kv_len)
    qb = _query_blocks(q, kv_heads, t, _valid(q_lengths, q_len), scale)
    kb, vb = _key_blocks(k, t, kv_valid), _key_blocks(v, t, kv_valid)
    run = lambda exact: functools.partial(_forward_blocks, band, t, exact_nonfinite=exact)  # noqa: E731
    o, lse = jax.lax.cond(_all_finite(qb, kb, vb), run(False), run(True), qb, kb, vb)
    return _from_query_blocks(o, q_len, q.dtype), _from_row_blocks(lse, q_len)


# ------------------------------------------------------------------------- backward

def _backward_blocks(band, t: _Tiling, qb, kb, vb, dob, lseb, deltab, exact_nonfinite):
    """(dq [nq, B, HKV, G, Br, D] unscaled, dk, dv [nk, B, HKV, Bc, D]) for blocked inputs."""
    rows_in = jnp.arange(t.br, dtype=jnp.int32)
    keys_in = jnp.arange(t.bc, dtype=jnp.int32)

    def tile(r, k, v, keys):
        visible = band.mask(r * t.br + rows_in, keys)
        return tiles.backward_tile(_block(qb, r), k, v, _block(dob, r), _block(lseb, r),
                                   _block(deltab, r), visible, exact_nonfinite)

    if t.dense:
        g = tile(0, kb[0], vb[0], keys_in)
        return (tiles.poison(g.dq, g.dq_hits, per_group=True)[None],
                tiles.poison(g.dk, g.dk_hits)[None], tiles.poison(g.dv, g.dv_hits)[None])

    def add_tile(r, acc, k, v, keys):
        g = tile(r, k, v, keys)
        at_row = lambda a, b: None if a is None else _add_block(a, r, b)  # noqa: E731
        plus = lambda a, b: None if a is None else a + b  # noqa: E731
        return tiles.Grads(at_row(acc.dq, g.dq), plus(acc.dk, g.dk), plus(acc.dv, g.dv),
                           at_row(acc.dq_hits, g.dq_hits), plus(acc.dk_hits, g.dk_hits),
                           plus(acc.dv_hits, g.dv_hits))

    def key_block(dq_acc, xs):
        c, k, v = xs
        keys = c * t.bc + keys_in
        r_lo, r_hi = _block_range(*band.row_span(c * t.bc, (c + 1) * t.bc), t.br)
        zeros = jnp.zeros(k.shape, F32)
        init = tiles.Grads(dq_acc[0], zeros, zeros, dq_acc[1],
                           *((zeros, zeros) if exact_nonfinite else (None, None)))
        acc = jax.lax.fori_loop(r_lo, r_hi, lambda r, a: add_tile(r, a, k, v, keys), init)
        dk, dv = tiles.poison(acc.dk, acc.dk_hits), tiles.poison(acc.dv, acc.dv_hits)
        return (acc.dq, acc.dq_hits), (dk, dv)

    dq_hits = jnp.zeros(qb.shape[:3] + qb.shape[4:], F32) if exact_nonfinite else None
    (dq, dq_hits), (dk, dv) = jax.lax.scan(
        key_block, (jnp.zeros(qb.shape, F32), dq_hits), (jnp.arange(t.nk, dtype=jnp.int32), kb,
                                                          vb))
    return tiles.poison(dq, dq_hits, per_group=True), dk, dv


def backward(q, k, v, o, lse, do, g_lse, q_lengths=None, kv_lengths=None, *, scale,
             is_causal=False, window_left=-1, window_right=-1, bottom_right=False,
             **unused_static):
    """(dq, dk, dv) in the input dtypes, from the forward's o and lse and the cotangents dO and
    g_lse: delta = rowsum(dO * O) - g_lse (0 for rows past q_len), then the FlashAttention-2
    recompute backward. Rows with no visible key and padding contribute nothing."""
    del unused_static
    batch, q_len, num_heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if 0 in (batch, q_len, kv_len):
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape,
                                                                                   v.dtype)
    band = _band(batch, q_len, kv_len, q_lengths, kv_lengths, is_causal, window_left,
                 window_right, bottom_right)
    t = tiling(q_len, kv_len)
    q_valid, kv_valid = _valid(q_lengths, q_len), _valid(kv_lengths, kv_len)
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(F32), o.astype(F32),
                       precision=jax.lax.Precision.HIGHEST) - g_lse.astype(F32)
    if q_valid is not None:
        delta = jnp.where(q_valid[:, None, :], delta, 0.0)
    blocks = (_query_blocks(q, kv_heads, t, q_valid, scale), _key_blocks(k, t, kv_valid),
              _key_blocks(v, t, kv_valid), _query_blocks(do, kv_heads, t, q_valid),
              _row_blocks(lse, kv_heads, t), _row_blocks(delta, kv_heads, t))
    finite = _all_finite(*blocks[:4], blocks[5]) & ~jnp.any(jnp.isnan(blocks[4]))
    run = lambda exact: functools.partial(_backward_blocks, band, t, exact_nonfinite=exact)  # noqa: E731
    dq, dk, dv = jax.lax.cond(finite, run(False), run(True), *blocks)
    return (_from_query_blocks(dq * jnp.float32(scale), q_len, q.dtype),
            _from_key_blocks(dk, kv_len, k.dtype), _from_key_blocks(dv, kv_len, v.dtype))
