"""The block grid of the xla implementation: tiling, the operand block layouts, the score
features per block, and the two loops over blocks that ``attention``'s forward and backward
drive.

Layouts: queries in ``[nq, B, HKV, G, Br, D]`` blocks (per-row statistics ``[nq, B, HKV, G,
Br]``), keys and values in ``[nk, B, HKV, Bc, D]`` blocks, padded to whole blocks with the
padding zeroed. The size rule, the loops and the NaN placement:
docs/design.md#the-xla-implementation-and-the-reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..core import dropout, features, nonfinite, visibility
from . import schedule as xla_schedule
from . import tiles

F32 = tiles.F32
CPU = xla_schedule.SCHEDULES["cpu"]


class _Tiling(NamedTuple):
    """Block sizes (Br query rows, Bc keys) and block counts; dense = a single tile."""

    br: int
    bc: int
    nq: int
    nk: int

    @property
    def dense(self):
        return self.nq == 1 and self.nk == 1


def tiling(q_len, kv_len, schedule=CPU, *, long_inner=False, backward=False):
    """The _Tiling the size rule of ``schedule`` (``xla_schedule.Schedule``) picks for these
    (static, non-zero) lengths, for the forward or the ``backward``; with ``long_inner`` (half
    operands and a band that hides no whole block: no causal mask, no window) the inner loop's
    blocks take the schedule's ``inner_block``, if any."""
    if q_len <= schedule.dense_max_len and kv_len <= schedule.dense_max_len:
        return _Tiling(q_len, kv_len, 1, 1)
    br, bc = schedule.block_q, schedule.block_k
    if schedule.inner_block is not None and long_inner:
        br, bc = (schedule.inner_block, bc) if backward else (br, schedule.inner_block)
    br, bc = min(br, q_len), min(bc, kv_len)
    return _Tiling(br, bc, -(-q_len // br), -(-kv_len // bc))


# ------------------------------------------------------------------------- layout

def valid(lengths, size, padded=None):
    """bool [B, padded (default size)]: position < length and < size; None when every position
    is valid."""
    padded = size if padded is None else padded
    if lengths is None and size == padded:
        return None
    limit = size if lengths is None else jnp.minimum(lengths, size)[:, None]
    return jnp.arange(padded)[None, :] < limit


def _split_rows(x, n, size):
    """[B, T, ...] -> [B, n, size, ...], padded with zeros (False) at the end of T."""
    pad = [(0, 0), (0, n * size - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad).reshape(x.shape[0], n, size, *x.shape[2:])


def _operand_form(x, valid, dtype, scale=1.0):
    """x in ``dtype`` with the positions past the lengths (``valid`` False) zeroed, times
    ``scale``, other non-finite entries NaN (``tiles.nan_entries``). Applied after the transpose to
    the block layout, so XLA writes that layout in one pass."""
    x = x.astype(dtype)
    if valid is not None:
        x = jnp.where(valid, x, 0.0)
    if scale != 1.0:
        x = x * jnp.float32(scale)
    return tiles.nan_entries(x)


def query_blocks(x, kv_heads, t: _Tiling, valid, dtype, scale=1.0):
    """[B, Tq, H, D] -> [nq, B, HKV, G, Br, D] in ``_operand_form``."""
    b, _, h, d = x.shape
    x = _split_rows(x, t.nq, t.br).reshape(b, t.nq, t.br, kv_heads, h // kv_heads, d)
    if valid is not None:
        valid = _split_rows(valid, t.nq, t.br).transpose(1, 0, 2)[:, :, None, None, :, None]
    return _operand_form(x.transpose(1, 0, 3, 4, 2, 5), valid, dtype, scale)


def from_query_blocks(x, length, dtype):
    nq, b, hkv, g, br, d = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * br, hkv * g, d)[:, :length].astype(dtype)


def key_blocks(x, t: _Tiling, valid, dtype):
    """[B, Tkv, HKV, D] -> [nk, B, HKV, Bc, D] in ``_operand_form``."""
    if valid is not None:
        valid = _split_rows(valid, t.nk, t.bc).transpose(1, 0, 2)[:, :, None, :, None]
    return _operand_form(_split_rows(x, t.nk, t.bc).transpose(1, 0, 3, 2, 4), valid, dtype)


def from_key_blocks(x, length, dtype):
    nk, b, hkv, bc, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, nk * bc, hkv, d)[:, :length].astype(dtype)


def row_blocks(x, kv_heads, t: _Tiling):
    """float32 [B, H, Tq] -> [nq, B, HKV, G, Br]."""
    b, h, length = x.shape
    x = jnp.pad(x.astype(F32), ((0, 0), (0, 0), (0, t.nq * t.br - length)))
    return x.reshape(b, kv_heads, h // kv_heads, t.nq, t.br).transpose(3, 0, 1, 2, 4)


def from_row_blocks(x, length):
    nq, b, hkv, g, br = x.shape
    return x.transpose(1, 2, 3, 0, 4).reshape(b, hkv * g, nq * br)[:, :, :length]


def all_finite(*xs):
    """False when some x has a NaN or Inf entry (and, harmlessly, when a sum overflows: the
    exact branch then runs for nothing). A float sum compiles and runs faster on XLA:CPU than
    a boolean all-reduction; it reads the arrays as the caller passes them (pass the inputs,
    not copies laid out for the tiles, so XLA need not materialise those)."""
    return jnp.isfinite(functools.reduce(jnp.add, [jnp.sum(x, dtype=F32) for x in xs]))


def _index(i):
    """A start index as uint32: JAX adds no negative-index wrap-around to an unsigned one (a
    compare and select per index, in tracing and in each loop iteration's compiled code)."""
    return jnp.asarray(i).astype(jnp.uint32)


def _start(index, ndim):
    return [_index(i) for i in index] + [np.uint32(0)] * (ndim - len(index))


def block(x, *index):
    """x[index] for (traced) integer indices of the leading axes."""
    n = len(index)
    return jax.lax.dynamic_slice(x, _start(index, x.ndim), (1,) * n + x.shape[n:]).reshape(
        x.shape[n:])


def _set_block(x, part, *index):
    """x with x[index] = part."""
    return jax.lax.dynamic_update_slice(x, part.reshape((1,) * len(index) + part.shape),
                                        _start(index, x.ndim))


def _add_block(x, part, *index):
    return _set_block(x, block(x, *index) + part, *index)


def pass_count(counting):
    """(number of passes: 2 when the traced bool ``counting`` holds, else 1; result slots)."""
    return (1, 1) if counting is None else (1 + counting.astype(jnp.int32), 2)


def _block_ranges(lo, hi, n, size, other):
    """Per block of ``size`` positions (``n`` blocks), the range [first, last) of blocks of
    ``other`` positions that its intervals lo, hi [B, n * size] touch in any batch entry
    (NumPy for NumPy intervals: ``visibility``)."""
    xp = visibility.array_module(lo, hi)
    lo, hi = lo.reshape(-1, n, size), hi.reshape(-1, n, size)
    empty = hi <= lo
    first = xp.min(xp.where(empty, np.iinfo(np.int32).max, lo), axis=(0, 2))
    last = xp.max(xp.where(empty, 0, hi), axis=(0, 2))
    none = last <= first
    return (xp.where(none, 0, first // other),
            xp.where(none, 0, (last + other - 1) // other))


def _zero_nonfinite(x):
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _pad_axis(x, axis, size, value):
    """x padded at the end of ``axis`` to ``size`` (unless that axis broadcasts: size 1)."""
    if x.shape[axis] == 1 or x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _slice_axis(x, axis, start, size):
    """The block [start, start + size) of ``axis``, or x itself where that axis broadcasts."""
    if x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, _index(start), size, axis)


class _Features:
    """The optional bias, mask and segment ids of one call, laid out for tiles.

    bias / mask: ``[b, HKV|1, G|1, tq|1, tkv|1]`` (``features.heads_layout``) padded to whole
    blocks (bias 0, mask False) only along axes they do not broadcast: a broadcast bias is
    never expanded, so memory stays that of the user's arrays. Segment ids int32 [B, T] padded
    to whole blocks.
    """

    def __init__(self, operands, kv_heads, t: _Tiling):
        self.t = t
        self.bias = self.mask = self.q_segments = self.kv_segments = None
        for name in ("bias", "mask"):
            x = getattr(operands, name)
            if x is not None:
                x = features.heads_layout(x, kv_heads)
                fill = False if name == "mask" else 0.0
                x = _pad_axis(_pad_axis(x, 3, t.nq * t.br, fill), 4, t.nk * t.bc, fill)
                setattr(self, name, x)
        if operands.q_segment_ids is not None:
            self.q_segments = _pad_axis(operands.q_segment_ids, 1, t.nq * t.br, -1)
            self.kv_segments = _pad_axis(operands.kv_segment_ids, 1, t.nk * t.bc, -1)

    @property
    def present(self):
        return any(x is not None for x in (self.bias, self.mask, self.q_segments))

    def _block(self, x, r, c):
        t = self.t
        return _slice_axis(_slice_axis(x, 3, r * t.br, t.br), 4, c * t.bc, t.bc)

    def tile(self, r, c):
        """(visible bool broadcastable to [B, HKV, G, Br, Bc] or None, bias float32 block or
        None) of tile (r, c)."""
        t = self.t
        bias = None if self.bias is None else self._block(self.bias, r, c).astype(F32)
        mask = None if self.mask is None else self._block(self.mask, r, c)
        qs = ks = None
        if self.q_segments is not None:
            qs = _slice_axis(self.q_segments, 1, r * t.br, t.br)
            ks = _slice_axis(self.kv_segments, 1, c * t.bc, t.bc)
        return features.visible(mask, bias, qs, ks), bias

    def add_block(self, acc, r, c, ds):
        """acc (float32, the padded bias layout) + the tile's dS [B, HKV, G, Br, Bc] summed
        over the axes where the bias broadcasts, at tile (r, c)."""
        axes = tuple(i for i, n in enumerate(acc.shape) if n == 1 and ds.shape[i] != 1)
        part = jnp.sum(ds, axis=axes, keepdims=True)
        t = self.t
        rows = 0 if acc.shape[3] == 1 else r * t.br
        keys = 0 if acc.shape[4] == 1 else c * t.bc
        start = _start((0, 0, 0, rows, keys), acc.ndim)
        return jax.lax.dynamic_update_slice(
            acc, jax.lax.dynamic_slice(acc, start, part.shape) + part, start)

    def meets(self, q_valid, kv_valid):
        """bool [nq, nk]: may query block r and key block c share a segment in some batch
        entry (their id ranges overlap); None without segment ids. ``*valid``: bool [B, T]
        of the padded lengths, or None."""
        if self.q_segments is None:
            return None
        t = self.t

        def ranges(ids, valid, n, size):
            ids = ids.reshape(ids.shape[0], n, size)
            valid = (jnp.ones(ids.shape, bool) if valid is None
                     else jnp.broadcast_to(valid.reshape(-1, n, size), ids.shape))
            big = jnp.iinfo(jnp.int32).max
            return (jnp.min(jnp.where(valid, ids, big), axis=2),
                    jnp.max(jnp.where(valid, ids, -big), axis=2))

        q_lo, q_hi = ranges(self.q_segments, q_valid, t.nq, t.br)
        k_lo, k_hi = ranges(self.kv_segments, kv_valid, t.nk, t.bc)
        overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
        return jnp.any(overlap, axis=0)


def _narrow(firsts, lasts, meets):
    """Shrink each block range [first, last) to the blocks between the first and the last one
    that ``meets`` ([n, m] bool) allows (an empty range when none)."""
    if meets is None:
        return firsts, lasts
    m = meets.shape[1]
    cs = jnp.arange(m, dtype=jnp.int32)[None, :]
    ok = meets & (cs >= firsts[:, None]) & (cs < lasts[:, None])
    any_ok = jnp.any(ok, axis=1)
    first = jnp.argmax(ok, axis=1).astype(jnp.int32)
    last = (m - jnp.argmax(ok[:, ::-1], axis=1)).astype(jnp.int32)
    return jnp.where(any_ok, first, 0), jnp.where(any_ok, last, 0)


class _Blocks:
    """The block grid of one call: the band, the tiling, and the two loop drivers.

    ``check_rows`` / ``check_keys``: whether tiles must compare positions with the lengths
    (lengths were given, or the last block is padded).
    """

    def __init__(self, band, t: _Tiling, q_len, kv_len, operands, kv_heads, dropout_static):
        self.band, self.t = band, t
        # The dropout operand as [B, HKV, G, WORDS], like the tiles' query heads.
        self.dropout = operands.dropout
        self.dropout_rate, self.dropout_key_groups = dropout_static
        if self.dropout is not None:
            b, h, _ = self.dropout.shape
            self.dropout = self.dropout.reshape(b, kv_heads, h // kv_heads, dropout.WORDS)
        self.check_rows = operands.q_lengths is not None or t.nq * t.br != q_len
        self.check_keys = operands.kv_lengths is not None or t.nk * t.bc != kv_len
        self.features = _Features(operands, kv_heads, t)
        # Whether some pair of real positions is hidden (else only the zero padding of the
        # last blocks is): only then can a weight of 0 meet a non-finite entry, so only then
        # do the weighted operands need zeroing and NaN placement its counting pass.
        self.hides_pairs = (band.left is not None or band.right is not None
                            or operands.q_lengths is not None or operands.kv_lengths is not None
                            or self.features.present)
        self.meets = self.features.meets(
            valid(operands.q_lengths, q_len, t.nq * t.br),
            valid(operands.kv_lengths, kv_len, t.nk * t.bc))
        # ALiBi slopes [B, HKV, G, 1, 1], or None.
        self.alibi = (None if operands.alibi_slopes is None else
                      operands.alibi_slopes.reshape(band.offset.shape[0], kv_heads, -1, 1, 1))

    def _positions(self, r, c):
        t = self.t
        return (r * t.br + jnp.arange(t.br, dtype=jnp.int32),
                c * t.bc + jnp.arange(t.bc, dtype=jnp.int32))

    def alibi_distance(self, r, c):
        """-|i + off - j| of tile (r, c), [B, 1, 1, Br, Bc] (``Band.alibi_distance``)."""
        return self.band.alibi_distance(*self._positions(r, c))[:, None, None]

    def visible(self, r, c):
        """(visible bool broadcastable to [B, HKV, G, Br, Bc] or None, bias block or None,
        ``tiles.Dropout`` or None) of tile (r, c); the bias includes the ALiBi term."""
        rows, keys = self._positions(r, c)
        band = self.band.mask(rows, keys, check_rows=self.check_rows,
                              check_keys=self.check_keys)
        extra, bias = self.features.tile(r, c)
        if self.alibi is not None:
            alibi = self.alibi * self.alibi_distance(r, c)
            bias = alibi if bias is None else bias + alibi
        z = None
        if self.dropout is not None:
            z = tiles.Dropout(dropout.keep(self.dropout, rows, c * self.t.bc, self.t.bc,
                                           self.dropout_rate, groups=self.dropout_key_groups,
                                           aligned=self.t.bc % 4 == 0),
                              dropout.keep_scale(self.dropout_rate))
        return features.combine(None if band is None else band[:, None, None], extra), bias, z

    def over_query_blocks(self, init, step, finish, rows, counting=None):
        """For each pass p and query block r (``q_r = rows(p, r)``): state = init(q_r), then
        state = step(state, p, c, q_r, visible) for every key block c that r can see, then
        finish(state, p). One pass (p = 0) unless ``counting`` (a traced bool; not for the
        dense tile) holds, then a second one (p = 1, the counting pass: xla_tiles). Returns the
        results [slots, nq, ...], pass p at [p] (zeros for a pass that did not run); one slot
        without ``counting``, else 2."""
        t = self.t
        if t.dense:
            q = rows(0, 0)
            return jax.tree_util.tree_map(lambda x: x[None, None],
                                          finish(step(init(q), 0, 0, q, self.visible(0, 0)), 0))
        lo, hi = self.band.key_intervals(np.arange(t.nq * t.br, dtype=np.int32))
        firsts, lasts = _narrow(*_block_ranges(lo, hi, t.nq, t.br, t.bc), self.meets)
        passes, slots = pass_count(counting)

        def query_block(i, results):
            p, r = (0, i) if counting is None else (i // t.nq, i % t.nq)
            q = rows(p, r)
            state = jax.lax.fori_loop(block(firsts, r), block(lasts, r),
                                      lambda c, s: step(s, p, c, q, self.visible(r, c)), init(q))
            return jax.tree_util.tree_map(lambda acc, x: _set_block(acc, x, p, r), results,
                                          finish(state, p))

        shapes = jax.eval_shape(lambda: finish(init(rows(0, 0)), 0))
        zeros = jax.tree_util.tree_map(lambda x: jnp.zeros((slots, t.nq) + x.shape, x.dtype),
                                       shapes)
        return jax.lax.fori_loop(0, passes * t.nq, query_block, zeros)

    def over_key_blocks(self, row_init, tile, key_xs, pair_init=None, counting=None):
        """For each pass p (as ``over_query_blocks``), each key block c and every query block r
        that can see it, ``tile(p, r, c, key_xs(p, c), visible)`` -> (row part, key part, pair
        part); row parts are summed into ``row_init`` (leaves [slots, nq, ...]) at [p, r], key
        parts per key block, and pair parts (a bias-shaped gradient, only with ``pair_init``)
        into ``pair_init`` at block (r, c) (``_Features.add_block``), all in a fixed order
        (deterministic). Returns (row sums, key sums [slots, nk, ...], pair sums or None)."""
        t = self.t
        add_pair = self.features.add_block
        if t.dense:
            rows, keys, pair = tile(0, 0, 0, key_xs(0, 0), self.visible(0, 0))
            return (jax.tree_util.tree_map(lambda a, x: a + x[None, None], row_init, rows),
                    jax.tree_util.tree_map(lambda x: x[None, None], keys),
                    None if pair_init is None else add_pair(pair_init, 0, 0, pair))
        lo, hi = self.band.row_intervals(np.arange(t.nk * t.bc, dtype=np.int32))
        firsts, lasts = _narrow(*_block_ranges(lo, hi, t.nk, t.bc, t.br),
                                None if self.meets is None else self.meets.T)
        passes, slots = pass_count(counting)

        def key_block(i, accs):
            (row_acc, pair_acc), key_acc = accs
            p, c = (0, i) if counting is None else (i // t.nk, i % t.nk)
            xs = key_xs(p, c)

            def body(r, accs):
                row_acc, pair_acc, keys_c = accs
                rows, keys, pair = tile(p, r, c, xs, self.visible(r, c))
                row_acc = jax.tree_util.tree_map(lambda a, x: _add_block(a, x, p, r), row_acc,
                                                 rows)
                if pair_acc is not None:
                    pair_acc = add_pair(pair_acc, r, c, pair)
                return row_acc, pair_acc, jax.tree_util.tree_map(jnp.add, keys_c, keys)

            # The key sums start at zero, shaped like one tile's key part.
            zero_keys = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape[2:], x.dtype),
                                               key_acc)
            row_acc, pair_acc, keys_c = jax.lax.fori_loop(
                block(firsts, c), block(lasts, c), body, (row_acc, pair_acc, zero_keys))
            key_acc = jax.tree_util.tree_map(lambda a, x: _set_block(a, x, p, c), key_acc, keys_c)
            return (row_acc, pair_acc), key_acc

        key_shapes = jax.eval_shape(lambda: tile(0, 0, 0, key_xs(0, 0), self.visible(0, 0))[1])
        key_init = jax.tree_util.tree_map(
            lambda x: jnp.zeros((slots, t.nk) + x.shape, x.dtype), key_shapes)
        (rows, pair), keys = jax.lax.fori_loop(0, passes * t.nk, key_block,
                                               ((row_init, pair_init), key_init))
        return rows, keys, pair


def setup(q, k, operands, schedule, is_causal, window_left, window_right, bottom_right,
          dropout_static, backward, half):
    """(the tiles of a call, its tiling); ``dropout_static``: (dropout_rate,
    dropout_key_groups)."""
    batch, q_len, _, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    band = visibility.Band(batch, q_len, kv_len, operands.q_lengths, operands.kv_lengths,
                           is_causal=is_causal, window_left=window_left,
                           window_right=window_right, bottom_right=bottom_right)
    t = tiling(q_len, kv_len, schedule, backward=backward,
               long_inner=half and band.left is None and band.right is None)
    return _Blocks(band, t, q_len, kv_len, operands, kv_heads, dropout_static), t


class _Precision(NamedTuple):
    """How the operands enter the matmuls: their dtype, the scale q is multiplied by as it is
    laid out in blocks, and the one the tiles apply to the float32 scores (None: q has it)."""

    dtype: jnp.dtype
    q_scale: float
    score_scale: float | None


def precision(dtype, scale, schedule):
    """Half-precision inputs stay half (``xla_schedule``'s ``half_operands``) and then keep the
    scale out of q: rounding scale * q to the half format would cost accuracy that the
    products, exact in float32 accumulation, keep; everything else multiplies as float32."""
    if schedule.half_operands and dtype in (jnp.float16, jnp.bfloat16):
        return _Precision(jnp.dtype(dtype), 1.0, scale)
    return _Precision(jnp.dtype(F32), scale, None)


def empty_lse(sinks, batch, num_heads, q_len):
    """The LSE of rows that see no key: -inf, or the row's sink."""
    if sinks is None:
        return jnp.full((batch, num_heads, q_len), -jnp.inf, F32)
    return jnp.broadcast_to(sinks.astype(F32)[None, :, None], (batch, num_heads, q_len))


def poison_if(pred, outs, counts_fn):
    """``outs`` with NaN where the counts ``counts_fn()`` returns for them (computed only when
    ``pred``) are positive. The ``lax.cond`` returns only the counts (zeros when not ``pred``)
    and takes none of ``outs``: no output has to pass through it, and it can run beside the
    main computation."""
    def masks():
        return [jnp.broadcast_to(c > 0, o.shape) for c, o in zip(counts_fn(), outs)]

    masks = jax.lax.cond(pred, masks, lambda: [jnp.zeros(o.shape, bool) for o in outs])
    return [nonfinite.poison(o, c) for o, c in zip(outs, masks)]


def of_pass(p, x, counting_value=0.0):
    """An operand block of pass ``p``: x, or ``counting_value`` in the counting pass (p == 1,
    xla_tiles); x itself where p is a Python int (a loop without a counting pass, or the dense
    tile). Computed per block inside the loops, so no counting-pass copy of an operand is ever
    stored."""
    if x is None or isinstance(p, int):
        return x
    return jnp.where(p == 1, counting_value, x)


def dropout_of_pass(p, z):
    """A tile's ``tiles.Dropout`` (or None) in pass ``p``: in the counting pass every entry is
    kept at weight 1, so the counts see every visible pair."""
    if z is None:
        return None
    return tiles.Dropout(of_pass(p, z.keep, True), of_pass(p, z.scale, 1.0))


def weighted(p, x, hides_pairs):
    """A block of an operand that P or dS weighs (x: its non-finite entries NaN): x with them
    zeroed, or (counting pass) its indicator; where no pair is hidden
    (``_Blocks.hides_pairs`` false), x itself, so the matmuls place NaN and no counting pass is
    needed."""
    if not hides_pairs:
        return x
    return of_pass(p, _zero_nonfinite(x), nonfinite.indicator(x).astype(x.dtype))


def counted(x):
    """Pass 0's result with NaN where the counting pass (slot 1, if any) counted a non-finite
    read."""
    return x[0] if x.shape[0] == 1 else nonfinite.poison(x[0], x[1])
