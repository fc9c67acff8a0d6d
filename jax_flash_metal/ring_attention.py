"""Context parallelism: ``flash_attention(..., sequence_axis_name=name)`` inside ``shard_map``.

Device i of the named axis (n devices) holds the contiguous slice of positions
[i * T / n, (i + 1) * T / n) of the query and of the key/value sequences (other layouts below).
Each device folds every key slice j into its rows' online-softmax state: block j gives (O_j,
LSE_j, m_j, log l_j) from one forward primitive call on the local slices, and the states merge
exactly: m = max_j m_j, l = sum_j l_j exp(m_j - m), O = sum_j (l_j exp(m_j - m) / l) O_j, LSE =
m + log l. Two strategies bring the key slices (``sequence_strategy``): "ring" (Liu et al.,
"Ring Attention with Blockwise Transformers", 2023): the K/V slices travel around the axis with
``lax.ppermute``, one step per device; "all_gather" (the default, docs/parallelism.md says why):
K/V (and key segment ids) are gathered over the axis once and every slice is read in place.

Visibility uses global positions (``visibility.Band`` over the whole sequences): per (query
slice, key slice) pair the schedule is "hidden" (skipped: no kernel runs; causal attention skips
the pairs above the diagonal, about half), "full" (no positional rule applies inside) or
"partial" (the causal diagonal pair, a plain causal call; any other pair cut by a window, the
lengths or bottom-right alignment gets the band as a mask). Segment ids travel with K/V; sinks
join once, after the ring, as one more logit per row.

The backward (a ``jax.custom_vjp`` around the ring) rotates K/V the same way, and dK/dV with
them, so each slice's gradient is back on its own device after n steps (all_gather: dK/dV of
the whole sequence, reduce-scattered back with ``lax.psum_scatter``). Each visible pair runs
one backward primitive call with the whole call's residuals (the merged O, LSE, m and log l):
its P = exp((S - m) - log l) is the whole softmax restricted to the pair's keys and its D =
rowsum(dO * O) - g_lse the whole call's, so the FlashAttention-2 backward of the pair gives
exactly the pair's share of dQ, dK and dV, and no block's forward is computed again. Memory
per device (ring): the local slices, the traveling K/V slice and dK/dV (two of each in flight
while they move) and the O/LSE state; nothing of size T x T or of the whole sequence
(all_gather: K/V and dK/dV of the whole sequence).

``sequence_layout="striped"`` (Brandon et al., "Striped Attention", 2023): device i holds
positions i, i + n, i + 2n, ... instead (``stripe`` / ``unstripe`` reorder whole arrays), so no
pair is hidden under causal attention but each is about half visible and every device does the
same work: a pair j <= i is a top-left causal call, j > i a bottom-right one whose last key is
padding. ``sequence_layout="zigzag"`` (MaxText's "dual chunk swap"): 2n chunks, device i
holds chunks i and 2n - 1 - i (``zigzag`` / ``unzigzag``), so causal work is even and each
device's positions are two contiguous ranges (its pairs are whole, hidden or a diagonal).
``causal_work`` / ``causal_balance`` measure the balance of a layout.

ALiBi uses global distances: each pair gets -slope * |i + off - j| over its global positions as
a bias (the primitives' own ALiBi would use the pieces' local positions), and dslopes sums the
pairs' -distance-weighted bias gradients. Not supported with a sequence axis (ValueError): bias
and mask (arrays over the whole score matrix; express them with lengths, windows or segment
ids); page_table.

Dropout applies the whole call's keep mask (docs/design.md#dropout): each pair's call gets the
dropout operand with the global positions of its query and key pieces
(``_Pair.dropout_operand``; a piece's positions are first + stride * arange in every layout),
so a split call drops exactly the entries the unsplit call drops.
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .core import dropout, validation, visibility
from .core._jax_private import vary_like, vary_together
from .core.contract import UNBOUNDED, Operands, StaticParams
from .core.options import Options
from .lowering import sharding
from .lowering.primitives import bwd_p, fwd_p

F32 = jnp.float32


# Positions per piece: each device's slices are cut into pieces of at most this many positions
# (where the slice length halves evenly), and each primitive call takes one query piece and one
# key piece. A call's temporaries (the xla implementation's block layouts of its operands) grow
# with its lengths, so pieces keep them a small part of the per-device memory.
PIECE_LEN = 512


def piece_length(chunk):
    """The piece length of a slice of ``chunk`` positions: halved while above PIECE_LEN and
    even."""
    while chunk > PIECE_LEN and chunk % 2 == 0:
        chunk //= 2
    return chunk


class _Ring(NamedTuple):
    """The static configuration of one ring call."""

    axis_name: object
    size: int  # devices on the axis
    q_chunk: int  # positions per device
    kv_chunk: int
    params: StaticParams  # of the whole call (validation.check_inputs)
    layout: str = "contiguous"  # sequence_layout
    strategy: str = "ring"  # sequence_strategy

    @property
    def striped(self):
        return self.layout == "striped"

    @property
    def q_piece(self):
        return piece_length(self.q_chunk // (2 if self.layout == "zigzag" else 1))

    @property
    def kv_piece(self):
        return piece_length(self.kv_chunk // (2 if self.layout == "zigzag" else 1))

    @property
    def dropout_key_groups(self):
        """Whether every key piece starts at a multiple of 4 at unit stride in the keep mask's
        positions (the primitives' ``dropout_key_groups``; ``positions``)."""
        base = self.kv_chunk // (2 if self.layout == "zigzag" else 1)
        return not self.striped and base % 4 == 0 and self.kv_piece % 4 == 0

    @property
    def positional(self):
        """Whether any positional rule (causal, a window) applies."""
        p = self.params
        return p.is_causal or p.window_left >= 0 or p.window_right >= 0

    def positions(self, index, chunk, piece, length):
        """(first, stride): piece ``piece`` (``length`` positions) of slice ``index`` (``chunk``
        positions) holds the positions first + stride * arange(length)."""
        start = piece * length
        if self.layout == "striped":
            return index + self.size * start, self.size
        if self.layout == "zigzag":  # chunks index and 2n - 1 - index of 2n, chunk/2 each
            half = chunk // 2
            return jnp.where(start < half, index * half + start,
                             (2 * self.size - 1 - index) * half + start - half), 1
        return index * chunk + start, 1

    def rows(self, i, r):
        first, stride = self.positions(i, self.q_chunk, r, self.q_piece)
        return first + stride * jnp.arange(self.q_piece, dtype=jnp.int32)

    def keys(self, j, p):
        first, stride = self.positions(j, self.kv_chunk, p, self.kv_piece)
        return first + stride * jnp.arange(self.kv_piece, dtype=jnp.int32)

    def band(self, batch, q_lengths, kv_lengths):
        p = self.params
        return visibility.Band(batch, self.size * self.q_chunk, self.size * self.kv_chunk,
                               q_lengths, kv_lengths, is_causal=p.is_causal,
                               window_left=p.window_left, window_right=p.window_right,
                               bottom_right=p.bottom_right)

    def only_causal(self, has_lengths):
        """Whether causal attention is the only rule (no window, no lengths, equal slices):
        every "partial" pair is then a diagonal one in the contiguous and zigzag layouts (the
        same positions on both sides: a top-left causal call), or in the striped layout one of
        two causal shapes (``_Pair.run``)."""
        p = self.params
        return (p.is_causal and p.window_left < 0 and p.window_right < 0
                and not has_lengths and self.q_chunk == self.kv_chunk)


HIDDEN, FULL, PARTIAL = 0, 1, 2


def block_kind(ring: _Ring, band, i, r, j, p):
    """HIDDEN, FULL or PARTIAL (int32) for query piece r of slice i against key piece p of
    slice j: whether no row, every row or some rows of the query piece see keys of the key
    piece (whole or in part). Row a sees the keys [lo, hi) (``Band.key_intervals``): of the
    piece's keys first + stride * b, those with ceil((lo - first) / stride) <= b <
    ceil((hi - first) / stride)."""
    lo, hi = band.key_intervals(ring.rows(i, r))
    first, stride = ring.positions(j, ring.kv_chunk, p, ring.kv_piece)
    b_lo, b_hi = -((first - lo) // stride), -((first - hi) // stride)
    sees = jnp.minimum(b_hi, ring.kv_piece) > jnp.maximum(b_lo, 0)
    whole = (b_lo <= 0) & (b_hi >= ring.kv_piece)
    return jnp.where(~jnp.any(sees), HIDDEN, jnp.where(jnp.all(whole), FULL, PARTIAL))


def block_schedule(num_devices, q_len, kv_len=None, *, is_causal=False, local_window_size=None,
                   causal_alignment="top_left", sequence_layout="contiguous"):
    """The ring's schedule for whole sequences of ``q_len`` / ``kv_len`` (default q_len)
    positions over ``num_devices`` devices, no lengths, at the granularity of its primitive
    calls: each device's slice is cut into pieces (``piece_length``), and entry [a, b] of the
    int result is HIDDEN (0, skipped), FULL (1) or PARTIAL (2) for query piece a against key
    piece b, counted over the whole sequences (piece a is piece a % m of device a // m's slice,
    m pieces per slice; slices as ``sequence_layout`` lays them out). ``np.count_nonzero`` of
    it is the number of block steps (primitive calls) each direction runs.

    Raises:
      ValueError: ``q_len`` or ``kv_len`` is not a multiple of ``num_devices`` (each device
        holds an equal slice).
    """
    kv_len = q_len if kv_len is None else kv_len
    layout = _check_layout(sequence_layout)
    parts = num_devices * (2 if layout == "zigzag" else 1)
    for name, length in (("q_len", q_len), ("kv_len", kv_len)):
        if length % parts:
            raise ValueError(f"{name}={length} is not a multiple of {parts} (num_devices="
                             f"{num_devices}, {layout}): each device holds an equal slice of the "
                             "sequence")
    left, right = validation.check_window(local_window_size)
    params = StaticParams(1.0, is_causal, left, right, causal_alignment == "bottom_right",
                          False, False, None)
    ring = _Ring(None, num_devices, q_len // num_devices, kv_len // num_devices, params, layout)
    m_q, m_kv = ring.q_chunk // ring.q_piece, ring.kv_chunk // ring.kv_piece
    with jax.ensure_compile_time_eval():
        band = ring.band(1, None, None)
        index = jnp.asarray(np.indices((num_devices, m_q, num_devices, m_kv)).reshape(4, -1))
        kinds = jax.vmap(lambda *irjp: block_kind(ring, band, *irjp))(*index)
    return np.asarray(kinds).reshape(num_devices * m_q, num_devices * m_kv)


def _axis_size(axis_name):
    if isinstance(axis_name, (tuple, list)) or not isinstance(axis_name, Hashable):
        raise TypeError(f"sequence_axis_name must be one mesh axis name (a str), got "
                        f"{axis_name!r}")
    try:
        size = jax.lax.psum(1, axis_name)
    except NameError:
        raise ValueError(
            f"sequence_axis_name={axis_name!r} is not a bound axis name here: call "
            "flash_attention with sequence_axis_name inside jax.shard_map over a mesh with that "
            "axis (each device passes its slice of the sequence)") from None
    return int(size)


def shard_map(f, mesh, in_specs, out_specs):
    """``jax.shard_map`` (JAX 0.7 and newer, with its default check of varying manual axes)
    or ``jax.experimental.shard_map.shard_map`` (older, whose replication check does not see
    through a ``custom_vjp``: off), fully manual over ``mesh``."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as legacy
    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


# ------------------------------------------------------------------------- one block

def _piece(x, index, length, axis=1):
    """Piece ``index`` (``length`` positions) of the sequence ``axis`` of x (None stays None)."""
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, index * length, length, axis)


def _with_piece(x, part, index, length, axis=1):
    """x with piece ``index`` of its sequence ``axis`` replaced by ``part``."""
    return jax.lax.dynamic_update_slice_in_dim(x, part.astype(x.dtype), index * length, axis)


class _Pair(NamedTuple):
    """One block step on one device: query piece r of its slice i against key piece p of the
    key slice j it holds, at piece ``slot`` of the key arrays it holds (the ring's one
    traveling slice: p; all_gather's whole sequence, in slices: j * pieces per slice + p)."""

    ring: _Ring
    band: visibility.Band
    lengths: bool  # whether lengths were given
    i: jax.Array
    r: jax.Array
    j: jax.Array
    p: jax.Array
    slot: jax.Array

    def kind(self):
        return block_kind(self.ring, self.band, self.i, self.r, self.j, self.p)

    def alibi_distance(self):
        """float32 [B, q piece, key piece]: |i + off_b - j| over the pair's global positions
        (ALiBi's distance, off_b the causal-alignment offset)."""
        rows, keys = self.ring.rows(self.i, self.r), self.ring.keys(self.j, self.p)
        diag = rows[None, :, None] + self.band.offset[:, None, None]
        return jnp.abs(diag - keys[None, None, :]).astype(F32)

    def dropout_operand(self, seeds):
        """The dropout operand (or None) of the pair's call: its rows and keys at their global
        positions, so the call applies the whole call's keep mask restricted to the pair."""
        if seeds is None:
            return None
        q_first, q_stride = self.ring.positions(self.i, self.ring.q_chunk, self.r,
                                                self.ring.q_piece)
        k_first, k_stride = self.ring.positions(self.j, self.ring.kv_chunk, self.p,
                                                self.ring.kv_piece)
        return dropout.at_positions(seeds, q_first, q_stride, k_first, k_stride)

    def run(self, kind, block, q_seg, kv_seg, slopes, seeds):
        """``block(params, operands)`` for a FULL or PARTIAL pair, with the static params and
        optional operands (``contract``) of the primitive call on the two pieces that gives
        this pair's part of the whole call: the call's scale, soft cap, segment ids (of the
        pieces) and implementation, ALiBi slopes [B, H] (or None) as the bias of the pair's
        global distances, the dropout operand ``seeds`` (or None) at the pair's global positions;
        no positional rule (FULL), the causal diagonal (PARTIAL under causal
        attention only) or the band as a mask (any other PARTIAL pair)."""
        ring = self.ring
        params = ring.params._replace(
            is_causal=False, window_left=UNBOUNDED, window_right=UNBOUNDED, bottom_right=False,
            has_q_lengths=False, has_kv_lengths=False, has_bias=slopes is not None,
            has_mask=False, has_sinks=False, has_alibi=False,
            dropout_key_groups=ring.dropout_key_groups)
        bias = None if slopes is None else -slopes[:, :, None, None] * self.alibi_distance()[
            :, None]
        operands = Operands(q_segment_ids=q_seg, kv_segment_ids=kv_seg, bias=bias,
                            dropout=self.dropout_operand(seeds))
        if kind == FULL:
            return block(params, operands)
        if not ring.only_causal(self.lengths):
            mask = self.band.mask(ring.rows(self.i, self.r), ring.keys(self.j, self.p))[:, None]
            return block(params._replace(has_mask=True), operands._replace(mask=mask))
        causal = params._replace(is_causal=True)
        if not ring.striped:
            return block(causal, operands)
        # Striped: query a * n + i sees key b * n + j iff b <= a (j <= i), else iff b <= a - 1:
        # bottom-right causal with the piece's last key (never visible then) as padding.
        below = jnp.full(self.band.kv_lengths.shape, ring.kv_piece - 1, jnp.int32)
        return jax.lax.cond(self.j <= self.i, lambda: block(causal, operands), lambda: block(
            causal._replace(bottom_right=True, has_kv_lengths=True),
            operands._replace(kv_lengths=below)))


class _State(NamedTuple):
    """The online-softmax state of query rows (the primitives' forward outputs): O float32
    [B, T, H, Dv], and LSE, the row max m and log l float32 [B, H, T], over the keys folded in
    so far."""

    o: jax.Array
    lse: jax.Array
    row_max: jax.Array
    log_sum: jax.Array

    def piece(self, r, length):
        return _State(_piece(self.o, r, length), *(_piece(x, r, length, 2) for x in self[1:]))

    def with_piece(self, part, r, length):
        return _State(_with_piece(self.o, part.o, r, length),
                      *(_with_piece(x, y, r, length, 2) for x, y in zip(self[1:], part[1:])))


def _initial_state(q, v):
    batch, q_chunk, heads, _ = q.shape
    row = (batch, heads, q_chunk)
    state = _State(jnp.zeros((batch, q_chunk, heads, v.shape[3]), F32),
                   jnp.full(row, -jnp.inf, F32),
                   jnp.full(row, jnp.finfo(F32).min, F32), jnp.zeros(row, F32))
    return _State(*(vary_like(x, q) for x in state))


def _merge(a: _State, b: _State):
    """The state of the keys of both ``a`` and ``b`` (exact): m = max(m_a, m_b), l = l_a
    exp(m_a - m) + l_b exp(m_b - m), O = (l_a exp(m_a - m) O_a + l_b exp(m_b - m) O_b) / l.
    A part whose row saw no key (LSE = -inf) adds nothing; a row that saw none in either keeps
    the larger m (each implementation's own empty-row value, which its backward expects)."""
    empty_a, empty_b = jnp.isneginf(a.lse), jnp.isneginf(b.lse)
    larger = jnp.maximum(a.row_max, b.row_max)
    m = jnp.where(empty_a == empty_b, larger, jnp.where(empty_a, b.row_max, a.row_max))
    share_a = jnp.where(empty_a, 0.0, jnp.exp((a.row_max - m) + a.log_sum))
    share_b = jnp.where(empty_b, 0.0, jnp.exp((b.row_max - m) + b.log_sum))
    total = share_a + share_b
    empty = total == 0.0
    log_sum = jnp.where(empty, 0.0, jnp.log(total))
    total = jnp.where(empty, 1.0, total)

    def weight(share):  # [B, H, T] -> [B, T, H, 1]
        return jnp.swapaxes(share / total, 1, 2)[..., None]

    o = weight(share_a) * a.o + weight(share_b) * b.o.astype(F32)
    return _State(o, jnp.where(empty, -jnp.inf, m + log_sum), m, log_sum)


# ------------------------------------------------------------------------- the ring

def _rotate(ring, xs):
    """xs sent one device along the axis (device d's to d + 1)."""
    return jax.lax.ppermute(xs, ring.axis_name,
                            [(d, (d + 1) % ring.size) for d in range(ring.size)])


def _pass_piece(ring, xs, p):
    """The traveling arrays ``xs`` (key slices, sequence axis 1) with key piece p sent one
    device along the axis and replaced in place by the one received, so only one piece is
    ever in flight beside the slices."""
    length = ring.kv_piece
    received = _rotate(ring, jax.tree_util.tree_map(lambda x: _piece(x, p, length), xs))
    return jax.tree_util.tree_map(lambda x, y: _with_piece(x, y, p, length), xs, received)


def _switch(pair, branch, *operands):
    """branch(kind, *operands) for the pair's kind; HIDDEN runs no kernel. Without any
    positional rule every pair is FULL: no switch then."""
    if not (pair.ring.positional or pair.lengths):
        return branch(FULL, *operands)
    return jax.lax.switch(pair.kind(), [partial(branch, kind) for kind in (HIDDEN, FULL,
                                                                            PARTIAL)],
                          *operands)


def _ring_loop(ring, q, q_lengths, kv_lengths, accumulators, traveling, block_step):
    """(accumulators, traveling) after every block step of this device: for each step s (key
    slice j = (i - s) mod n), each key piece p of it and each query piece r,
    ``block_step(pair, accumulators, traveling)`` gives the new pair of them. The ring's
    ``traveling`` hold slice j: each key piece is passed on once every query piece has used it
    (``_pass_piece``), so after n steps every traveling slice is back on its own device;
    all_gather's hold every slice (``_gathered``) and stay."""
    band = ring.band(q.shape[0], q_lengths, kv_lengths)
    lengths = q_lengths is not None or kv_lengths is not None
    i = jax.lax.axis_index(ring.axis_name)
    pieces = ring.kv_chunk // ring.kv_piece
    gathered = ring.strategy == "all_gather"

    def key_piece(s, p, carry):
        j = (i - s) % ring.size
        slot = j * pieces + p if gathered else p

        def query_piece(r, carry):
            return block_step(_Pair(ring, band, lengths, i, r, j, p, slot), *carry)

        accumulators, traveling = jax.lax.fori_loop(0, ring.q_chunk // ring.q_piece,
                                                    query_piece, carry)
        if gathered:
            return accumulators, traveling
        # The barrier keeps the pass after the query pieces: XLA would otherwise see the
        # traveling slices leave the loop unchanged and pass the piece before it, keeping a
        # second copy of each traveling slice for the loop.
        accumulators, traveling = jax.lax.optimization_barrier((accumulators, traveling))
        return accumulators, _pass_piece(ring, traveling, p)

    def step(s, carry):
        return jax.lax.fori_loop(0, pieces, partial(key_piece, s), carry)

    return jax.lax.fori_loop(0, ring.size, step, (accumulators, traveling))


def _gathered(ring, xs):
    """all_gather's key-side arrays: each of ``xs`` (sequence axis 1; None stays None) with
    every device's slice, in device order (slice j at [j * chunk, (j + 1) * chunk)); the
    ring's as they are."""
    if ring.strategy != "all_gather":
        return xs
    return tuple(None if x is None else jax.lax.all_gather(x, ring.axis_name, axis=1, tiled=True)
                 for x in xs)


def _forward(ring, q, k, v, q_seg, kv_seg, q_lengths, kv_lengths, slopes, seeds):
    """The _State of this device's query slice over the whole key sequence: one forward
    primitive call per visible pair of pieces, merged."""
    q_piece, kv_piece = ring.q_piece, ring.kv_piece

    def block_step(pair, state, kv):
        def branch(kind, state, kv):
            if kind == HIDDEN:
                return state
            k, v, kv_seg = (_piece(x, pair.slot, kv_piece) for x in kv)
            q_r = _piece(q, pair.r, q_piece)
            part = pair.run(kind, lambda params, operands: _State(*fwd_p.bind(
                q_r, k, v, *operands.present(), **params._asdict())),
                _piece(q_seg, pair.r, q_piece), kv_seg, slopes, seeds)
            return state.with_piece(_merge(state.piece(pair.r, q_piece), part), pair.r, q_piece)

        return _switch(pair, branch, state, kv), kv

    return _ring_loop(ring, q, q_lengths, kv_lengths, _initial_state(q, v),
                      _gathered(ring, (k, v, kv_seg)), block_step)[0]


# The roles (sharding._Layout) of _ring_attention's arguments, of a _State and of (dO, g_lse).
_ARG_ROLES = ("q", "kv", "kv_v", "q_segment_ids", "kv_segment_ids", "q_lengths", "kv_lengths",
              "alibi_slopes", "dropout")
_STATE_ROLES = ("q_v", "row", "row", "row")


def _forward_state(ring, *args):
    """The whole call's _State (O in the query's dtype), computed per shard of the batch or
    head axes that a shard_map over the sequence axis alone leaves Explicit (the ring's own
    arrays carry no sharding)."""
    def per_shard(*args):
        state = _forward(ring, *args)
        return tuple(state._replace(o=state.o.astype(args[0].dtype)))

    return _State(*sharding.on_explicit_shards(per_shard, args, _ARG_ROLES, _STATE_ROLES))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring, *args):
    state = _forward_state(ring, *args)
    return state.o, state.lse


def _ring_fwd(ring, *args):
    state = _forward_state(ring, *args)
    # The residuals are the whole call's: O, LSE, m and log l over every key slice.
    return (state.o, state.lse), (args, state)


def _add_piece(acc, part, index, length):
    """acc (float32) with ``part`` added to its piece ``index``."""
    return _with_piece(acc, _piece(acc, index, length) + part.astype(F32), index, length)


def _ring_bwd(ring, residuals, cotangents):
    """The cotangents of _ring_attention's arguments (``_backward``, per shard of any Explicit
    batch or head axes, as ``_forward_state``)."""
    args, state = residuals
    do, g_lse = cotangents[0].astype(args[0].dtype), cotangents[1].astype(F32)
    slopes = args[7]
    out_roles = ("q", "kv", "kv_v") + (() if slopes is None else ("alibi_slopes",))
    grads = sharding.on_explicit_shards(partial(_backward, ring), (*args, *state, do, g_lse),
                                        _ARG_ROLES + _STATE_ROLES + ("q_v", "row"), out_roles)
    return (*grads[:3], None, None, None, None, None if slopes is None else grads[3], None)


def _backward(ring, q, k, v, q_seg, kv_seg, q_lengths, kv_lengths, slopes, seeds, o, lse,
              row_max, log_sum, do, g_lse):
    """dQ, dK, dV (and dslopes with ALiBi): each visible pair's backward primitive call with the whole call's residuals
    (its P = exp((S - m) - log l) is the whole call's softmax restricted to the pair's keys, and
    D = rowsum(dO * O) - g_lse the whole call's), so no block's forward is computed again; the
    dQ parts add up here, the dK/dV parts travel with their K/V slice and are home after n
    steps; all_gather's dK/dV parts add up in whole-sequence buffers, reduce-scattered back
    (each device gets the sum for its own slice). With ALiBi, each pair's bias gradient gives
    its share of dslopes (the bias is -slope * distance)."""
    q_piece, kv_piece = ring.q_piece, ring.kv_piece
    rows = (q, o, do)  # [B, T, H, D]: pieces along axis 1
    stats = (lse, row_max, log_sum, g_lse)  # [B, H, T]: along axis 2

    def block_step(pair, accumulators, traveling):
        def branch(kind, accumulators, traveling):  # the gradients so far, with this pair's
            if kind == HIDDEN:
                return accumulators, traveling
            dq, dslopes = accumulators
            k, v, kv_seg, dk, dv = traveling
            q_r, o_r, do_r = (_piece(x, pair.r, q_piece) for x in rows)
            lse_r, max_r, log_sum_r, g_r = (_piece(x, pair.r, q_piece, 2) for x in stats)
            k_p, v_p = _piece(k, pair.slot, kv_piece), _piece(v, pair.slot, kv_piece)
            grads = pair.run(kind, lambda params, operands: bwd_p.bind(
                q_r, k_p, v_p, o_r, lse_r, max_r, log_sum_r, do_r, g_r, *operands.present(),
                bias_grad=params.has_bias, **params._asdict()),
                _piece(q_seg, pair.r, q_piece), _piece(kv_seg, pair.slot, kv_piece), slopes,
                seeds)
            dq_r, dk_p, dv_p = grads[:3]
            if slopes is not None:  # d(-slope * distance) / d slope = -distance
                dslopes = dslopes - jnp.einsum("bhqk,bqk->bh", grads[3],
                                               pair.alibi_distance(),
                                               precision=jax.lax.Precision.HIGHEST)
            return (_add_piece(dq, dq_r, pair.r, q_piece), dslopes), (
                k, v, kv_seg, _add_piece(dk, dk_p, pair.slot, kv_piece),
                _add_piece(dv, dv_p, pair.slot, kv_piece))

        return _switch(pair, branch, accumulators, traveling)

    zeros = lambda x: vary_like(jnp.zeros(x.shape, F32), q)  # noqa: E731
    k_all, v_all, kv_seg_all = _gathered(ring, (k, v, kv_seg))
    (dq, dslopes), (*_, dk, dv) = _ring_loop(
        ring, q, q_lengths, kv_lengths, (zeros(q), None if slopes is None else zeros(slopes)),
        (k_all, v_all, kv_seg_all, zeros(k_all), zeros(v_all)), block_step)
    if ring.strategy == "all_gather":
        dk, dv = (jax.lax.psum_scatter(x, ring.axis_name, scatter_dimension=1, tiled=True)
                  for x in (dk, dv))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)) + (
        () if slopes is None else (dslopes,))


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def _with_sinks(o, lse, sinks):
    """O and LSE with the sinks (one more logit per head and row, value 0) joined."""
    new = jnp.logaddexp(lse, sinks[None, :, None])
    w = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - jnp.where(jnp.isneginf(new), 0.0, new)))
    return (jnp.swapaxes(w, 1, 2)[..., None] * o.astype(F32)).astype(o.dtype), new


LAYOUTS = ("contiguous", "striped", "zigzag")
STRATEGIES = ("all_gather", "ring")
DEFAULT_STRATEGY = "all_gather"  # docs/parallelism.md says why


def _check_choice(value, name, choices):
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _check_layout(sequence_layout):
    return _check_choice(sequence_layout, "sequence_layout", LAYOUTS)


def stripe(x, num_devices, axis=1):
    """``x`` with its sequence ``axis`` (length T, a multiple of ``num_devices`` n) reordered
    for ``sequence_layout="striped"``: split into n contiguous slices afterwards, device i holds
    positions i, i + n, i + 2n, ... (Brandon et al., "Striped Attention", 2023: every device
    then does about the same causal work). Position p moves to (p % n) * (T / n) + p // n.
    Apply it to query, key, value and segment ids (axis 1) before splitting them over the
    axis; ``unstripe`` restores the order of the output (axis 1) and LSE (axis 2)."""
    x = jnp.moveaxis(jnp.asarray(x), axis, 0)
    t = x.shape[0]
    x = x.reshape(t // num_devices, num_devices, *x.shape[1:]).swapaxes(0, 1)
    return jnp.moveaxis(x.reshape(t, *x.shape[2:]), 0, axis)


def unstripe(x, num_devices, axis=1):
    """The inverse of ``stripe``."""
    x = jnp.moveaxis(jnp.asarray(x), axis, 0)
    t = x.shape[0]
    x = x.reshape(num_devices, t // num_devices, *x.shape[1:]).swapaxes(0, 1)
    return jnp.moveaxis(x.reshape(t, *x.shape[2:]), 0, axis)


def _zigzag_order(num_devices):
    """The chunks (of 2n) in zigzag order: 0, 2n - 1, 1, 2n - 2, ..., n - 1, n."""
    return np.stack([np.arange(num_devices), 2 * num_devices - 1 - np.arange(num_devices)],
                    axis=1).reshape(-1)


def _chunks_in_order(x, order, axis):
    x = jnp.moveaxis(jnp.asarray(x), axis, 0)
    t = x.shape[0]
    x = x.reshape(len(order), t // len(order), *x.shape[1:])[order]
    return jnp.moveaxis(x.reshape(t, *x.shape[2:]), 0, axis)


def zigzag(x, num_devices, axis=1):
    """``x`` with its sequence ``axis`` (length T, a multiple of 2 * ``num_devices`` n)
    reordered for ``sequence_layout="zigzag"``: cut into 2n chunks of T / 2n, device i of the
    n contiguous slices afterwards holds chunks i and 2n - 1 - i (the "dual chunk swap" of
    MaxText's context parallelism: every device then does the same causal work, in two
    contiguous ranges). Apply it to query, key, value and segment ids (axis 1) before splitting
    them over the axis; ``unzigzag`` restores the order of the output (axis 1) and LSE
    (axis 2)."""
    return _chunks_in_order(x, _zigzag_order(num_devices), axis)


def unzigzag(x, num_devices, axis=1):
    """The inverse of ``zigzag``."""
    return _chunks_in_order(x, np.argsort(_zigzag_order(num_devices)), axis)


def positions(num_devices, seq_len, sequence_layout="contiguous"):
    """int [num_devices, seq_len / num_devices]: the global positions each device's slice
    holds in ``sequence_layout``."""
    layout = _check_layout(sequence_layout)
    order = np.arange(seq_len)
    x = {"contiguous": order, "striped": np.asarray(stripe(order, num_devices, axis=0)),
         "zigzag": np.asarray(zigzag(order, num_devices, axis=0))}[layout]
    return x.reshape(num_devices, -1)


def causal_work(num_devices, seq_len, sequence_layout="contiguous"):
    """int [num_devices]: the (query, key) pairs each device's queries see under top-left
    causal attention over ``seq_len`` positions (query p sees keys 0..p: p + 1 pairs), split
    over ``num_devices`` in ``sequence_layout``; the non-causal work per device is
    seq_len ** 2 / num_devices. ``causal_balance`` is its max / min."""
    return (positions(num_devices, seq_len, sequence_layout).astype(np.int64) + 1).sum(axis=1)


def causal_balance(num_devices, seq_len, sequence_layout="contiguous"):
    """max / min over devices of ``causal_work``: 1.0 is perfectly even causal work (the
    slowest device sets the step time)."""
    work = causal_work(num_devices, seq_len, sequence_layout)
    return float(work.max() / work.min())


def ring_flash_attention(query, key, value, bias, mask, options: Options):
    """``flash_attention`` with ``options.sequence_axis_name`` set (docs/api.md documents the
    arguments). Lengths count global positions."""
    layout = _check_layout(options.sequence_layout)
    strategy = _check_choice(DEFAULT_STRATEGY if options.sequence_strategy is None else
                             options.sequence_strategy, "sequence_strategy", STRATEGIES)
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None:
            raise ValueError(
                f"{name} is not supported with sequence_axis_name (it spans the whole score "
                "matrix); express it with lengths, local_window_size or segment ids")
    if options.page_table is not None:
        raise ValueError("page_table is not supported with sequence_axis_name")
    ids = [options.query_segment_ids, options.key_value_segment_ids]
    dtypes = [getattr(x, "dtype", None) or jnp.asarray(x).dtype for x in ids if x is not None]
    if len(dtypes) == 2 and not validation.segment_ids_cast_exactly(*dtypes):
        # Ranking ids per device would number the slices that travel around the ring apart.
        raise TypeError("segment ids with sequence_axis_name need one integer dtype of at most "
                        f"32 bits for both, got {dtypes}")
    axis_name = options.sequence_axis_name
    size = _axis_size(axis_name)
    q, k, v, operands, params = validation.check_inputs(
        query, key, value, None, None,
        options._replace(query_seq_lengths=None, key_value_seq_lengths=None,
                         sequence_axis_name=None, sequence_layout="contiguous",
                         sequence_strategy=None))
    batch = q.shape[0]
    q_lengths = validation.check_lengths(options.query_seq_lengths, "query_seq_lengths", batch,
                                         size * q.shape[1])
    kv_lengths = validation.check_lengths(options.key_value_seq_lengths,
                                          "key_value_seq_lengths", batch, size * k.shape[1])
    if layout == "zigzag" and (q.shape[1] % 2 or k.shape[1] % 2):
        raise ValueError(f"sequence_layout='zigzag' needs even slices (two chunks per device), "
                         f"got query {q.shape[1]} and key {k.shape[1]} positions per device")
    ring = _Ring(axis_name, size, q.shape[1], k.shape[1], params._replace(has_alibi=False),
                 layout, strategy)

    out, lse = _ring_attention(ring, *vary_together((q, k, v, operands.q_segment_ids,
                                                     operands.kv_segment_ids, q_lengths,
                                                     kv_lengths, operands.alibi_slopes,
                                                     operands.dropout)))
    if operands.sinks is not None:
        out, lse = _with_sinks(out, lse, operands.sinks)
    return validation.restore_rank(query, out, lse, options.return_lse)
