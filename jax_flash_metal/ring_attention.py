"""Context parallelism: ``flash_attention(..., sequence_axis_name=name)`` inside ``shard_map``.

Device i of the named axis (n devices) holds the contiguous slice of positions
[i * T / n, (i + 1) * T / n) of the query and of the key/value sequences. Ring attention (Liu
et al., "Ring Attention with Blockwise Transformers", 2023): the K/V slices travel around the axis
with ``lax.ppermute`` while each device folds each one into its rows' online-softmax state: block
j gives (O_j, LSE_j) from a ``flash_attention(..., return_lse=True)`` call on the local slices,
and the states merge exactly, LSE = log(sum_j exp(LSE_j)), O = sum_j exp(LSE_j - LSE) O_j.

Visibility uses global positions (``visibility.Band`` over the whole sequences): per (query
slice, key slice) pair the schedule is "hidden" (skipped: no kernel runs; causal attention skips
the pairs above the diagonal, about half), "full" (no positional rule applies inside) or
"partial" (the causal diagonal pair, a plain causal call; any other pair cut by a window, the
lengths or bottom-right alignment gets the band as a mask). Segment ids travel with K/V; sinks
join once, after the ring, as one more logit per row.

The backward (a ``jax.custom_vjp`` around the ring) rotates K/V the same way, and dK/dV with
them, so each slice's gradient is back on its own device after n steps. Each block's gradient is
the VJP of the same block call at the cotangents the merge gives it: with w_j = exp(LSE_j -
LSE), dO_j = w_j dO and g_j = w_j (rowsum(dO * (O_j - O)) + g_lse), which makes the block's own
FlashAttention-2 backward use the global P and D (the VJP recomputes the block's forward).
Memory per device: the local slices, one traveling K/V slice (two in flight) and the O/LSE
state; nothing of size T x T or of the whole sequence.

``sequence_layout="striped"`` (Brandon et al., "Striped Attention", 2023): device i holds
positions i, i + n, i + 2n, ... instead (``stripe`` / ``unstripe`` reorder whole arrays), so no
pair is hidden under causal attention but each is about half visible and every device does the
same work: a pair j <= i is a top-left causal call, j > i a bottom-right one whose last key is
padding.

Not supported with a sequence axis (ValueError): bias and mask (arrays over the whole score
matrix; express them with lengths, windows or segment ids).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import validation, visibility

F32 = jnp.float32


class _Ring(NamedTuple):
    """The static configuration of one ring call."""

    axis_name: object
    size: int  # devices on the axis
    q_chunk: int  # positions per device
    kv_chunk: int
    scale: float
    is_causal: bool
    window_left: int
    window_right: int
    bottom_right: bool
    logits_soft_cap: float | None
    implementation: str | None
    block_attention: Callable | None  # flash_attention (attention.py passes it: no import up)
    striped: bool = False  # sequence_layout="striped"

    def positions(self, index, chunk):
        """(first, stride): slice ``index``'s positions are first + stride * arange(chunk)."""
        return (index, self.size) if self.striped else (index * chunk, 1)

    def rows(self, i):
        first, stride = self.positions(i, self.q_chunk)
        return first + stride * jnp.arange(self.q_chunk, dtype=jnp.int32)

    def keys(self, j):
        first, stride = self.positions(j, self.kv_chunk)
        return first + stride * jnp.arange(self.kv_chunk, dtype=jnp.int32)

    def band(self, batch, q_lengths, kv_lengths):
        return visibility.Band(batch, self.size * self.q_chunk, self.size * self.kv_chunk,
                               q_lengths, kv_lengths, is_causal=self.is_causal,
                               window_left=self.window_left, window_right=self.window_right,
                               bottom_right=self.bottom_right)

    def only_causal(self, has_lengths):
        """Whether causal attention is the only rule (no window, no lengths, equal slices):
        every "partial" pair is then the contiguous layout's diagonal one (a top-left causal
        call), or in the striped layout one of two causal shapes (``_Pair.attend``)."""
        return (self.is_causal and self.window_left < 0 and self.window_right < 0
                and not has_lengths and self.q_chunk == self.kv_chunk)


HIDDEN, FULL, PARTIAL = 0, 1, 2


def block_kind(ring: _Ring, band, i, j):
    """HIDDEN, FULL or PARTIAL (int32) for query slice i against key slice j: whether no row,
    every row or some rows of slice i see keys of slice j (whole or in part). Row r sees the
    keys [lo, hi) (``Band.key_intervals``): of slice j's keys first + stride * b, those with
    ceil((lo - first) / stride) <= b < ceil((hi - first) / stride)."""
    lo, hi = band.key_intervals(ring.rows(i))
    first, stride = ring.positions(j, ring.kv_chunk)
    b_lo, b_hi = -((first - lo) // stride), -((first - hi) // stride)
    sees = jnp.minimum(b_hi, ring.kv_chunk) > jnp.maximum(b_lo, 0)
    whole = (b_lo <= 0) & (b_hi >= ring.kv_chunk)
    return jnp.where(~jnp.any(sees), HIDDEN, jnp.where(jnp.all(whole), FULL, PARTIAL))


def block_schedule(num_devices, q_len, kv_len=None, *, is_causal=False, local_window_size=None,
                   causal_alignment="top_left", sequence_layout="contiguous"):
    """The ring's schedule for whole sequences of ``q_len`` / ``kv_len`` (default q_len)
    positions over ``num_devices`` devices, no lengths: int [num_devices, num_devices], entry
    [i, j] HIDDEN (0, skipped), FULL (1) or PARTIAL (2) for device i's query slice against key
    slice j (slices as ``sequence_layout`` lays them out). ``np.count_nonzero`` of it is the
    number of block steps that run a kernel."""
    kv_len = q_len if kv_len is None else kv_len
    left, right = validation.check_window(local_window_size)
    ring = _Ring(None, num_devices, q_len // num_devices, kv_len // num_devices, 1.0,
                 is_causal, left, right, causal_alignment == "bottom_right", None, None,
                 None, _check_layout(sequence_layout))
    with jax.ensure_compile_time_eval():
        band = ring.band(1, None, None)
        return np.array([[int(block_kind(ring, band, i, j)) for j in range(num_devices)]
                         for i in range(num_devices)])


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
    """``jax.shard_map`` (JAX 0.7 and newer) or ``jax.experimental.shard_map.shard_map``
    (older), fully manual over ``mesh``, with the replication check off (JAX's check does not
    see through the ring's ``custom_vjp``)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy
    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


# ------------------------------------------------------------------------- one block

class _Pair(NamedTuple):
    """One step of the ring on one device: its query slice against the key slice it holds."""

    ring: _Ring
    band: visibility.Band
    lengths: bool  # whether lengths were given
    i: jax.Array  # this device's (query slice's) index on the axis
    j: jax.Array  # the key slice's index

    def kind(self):
        return block_kind(self.ring, self.band, self.i, self.j)

    def attend(self, kind, q, k, v, q_seg, kv_seg):
        """(O_j float32, LSE_j) of a FULL or PARTIAL pair: one flash_attention call."""
        ring = self.ring

        def call(**kw):
            o, lse = ring.block_attention(q, k, v, scale=ring.scale, query_segment_ids=q_seg,
                                     key_value_segment_ids=kv_seg,
                                     logits_soft_cap=ring.logits_soft_cap,
                                     implementation=ring.implementation, return_lse=True, **kw)
            return o.astype(F32), lse

        if kind == FULL:
            return call()
        if not ring.only_causal(self.lengths):
            return call(mask=self.band.mask(ring.rows(self.i), ring.keys(self.j))[:, None])
        if not ring.striped:
            return call(is_causal=True)
        # Striped: query a * n + i sees key b * n + j iff b <= a (j <= i), else iff b <= a - 1:
        # bottom-right causal with the slice's last key (never visible then) as padding.
        below = jnp.full((q.shape[0],), ring.kv_chunk - 1, jnp.int32)
        return jax.lax.cond(self.j <= self.i, lambda: call(is_causal=True), lambda: call(
            is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=below))


def _weights(lse_j, lse):
    """exp(LSE_j - LSE) as [B, T, H, 1] (to scale O), 0 where LSE_j = -inf (nothing seen)."""
    w = jnp.where(jnp.isneginf(lse_j), 0.0,
                  jnp.exp(lse_j - jnp.where(jnp.isneginf(lse), 0.0, lse)))
    return jnp.swapaxes(w, 1, 2)[..., None]


def _merge(o, lse, o_j, lse_j):
    new = jnp.logaddexp(lse, lse_j)
    return _weights(lse, new) * o + _weights(lse_j, new) * o_j, new


# ------------------------------------------------------------------------- the ring

def _pairs(ring, q, q_lengths, kv_lengths):
    """pair(s): the _Pair of ring step s on this device (key slice (i - s) mod n)."""
    band = ring.band(q.shape[0], q_lengths, kv_lengths)
    lengths = q_lengths is not None or kv_lengths is not None
    i = jax.lax.axis_index(ring.axis_name)
    return lambda s: _Pair(ring, band, lengths, i, (i - s) % ring.size)


def _rotate(ring, xs):
    """xs sent one device along the axis (device d's to d + 1)."""
    return jax.lax.ppermute(xs, ring.axis_name,
                            [(d, (d + 1) % ring.size) for d in range(ring.size)])


def _switch(pair, branch, *operands):
    """branch(kind, *operands) for the pair's kind; HIDDEN runs no kernel. Without any
    positional rule every pair is FULL: no switch then."""
    ring = pair.ring
    if not (ring.is_causal or ring.window_left >= 0 or ring.window_right >= 0 or pair.lengths):
        return branch(FULL, *operands)
    return jax.lax.switch(pair.kind(), [partial(branch, kind) for kind in (HIDDEN, FULL,
                                                                            PARTIAL)],
                          *operands)


def _forward(ring, q, k, v, q_seg, kv_seg, q_lengths, kv_lengths):
    """(O float32 [B, Tq/n, H, D], LSE [B, H, Tq/n]) of this device's query slice."""
    pair_at = _pairs(ring, q, q_lengths, kv_lengths)

    def step(s, carry):
        o, lse, kv = carry
        pair = pair_at(s)
        traveling = _rotate(ring, kv)  # sent first, so the transfer overlaps this block

        def branch(kind, o, lse, kv):
            if kind == HIDDEN:
                return o, lse
            return _merge(o, lse, *pair.attend(kind, q, kv[0], kv[1], q_seg, kv[2]))

        return (*_switch(pair, branch, o, lse, kv), traveling)

    batch, q_chunk, heads, _ = q.shape
    init = (jnp.zeros(q.shape, F32), jnp.full((batch, heads, q_chunk), -jnp.inf, F32),
            (k, v, kv_seg))
    o, lse, _ = jax.lax.fori_loop(0, ring.size, step, init)
    return o, lse


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring, q, k, v, q_seg, kv_seg, q_lengths, kv_lengths):
    o, lse = _forward(ring, q, k, v, q_seg, kv_seg, q_lengths, kv_lengths)
    return o.astype(q.dtype), lse


def _ring_fwd(ring, q, k, v, q_seg, kv_seg, q_lengths, kv_lengths):
    o, lse = _forward(ring, q, k, v, q_seg, kv_seg, q_lengths, kv_lengths)
    return (o.astype(q.dtype), lse), (q, k, v, q_seg, kv_seg, q_lengths, kv_lengths, o, lse)


def _ring_bwd(ring, residuals, cotangents):
    q, k, v, q_seg, kv_seg, q_lengths, kv_lengths, o, lse = residuals
    do, g = cotangents[0].astype(F32), cotangents[1].astype(F32)
    pair_at = _pairs(ring, q, q_lengths, kv_lengths)
    zeros = lambda x: jnp.zeros(x.shape, F32)  # noqa: E731

    def step(s, carry):
        dq, kv, dkv = carry
        pair = pair_at(s)
        traveling = _rotate(ring, kv)

        def branch(kind, grads, kv):  # the gradients so far, with this pair's added
            if kind == HIDDEN:
                return grads
            k_j, v_j, kv_seg_j = kv
            (o_j, lse_j), vjp = jax.vjp(
                lambda q, k, v: pair.attend(kind, q, k, v, q_seg, kv_seg_j), q, k_j, v_j)
            w = _weights(lse_j, lse)  # the block's share of each row
            g_j = jnp.swapaxes(w[..., 0], 1, 2) * (
                jnp.einsum("bqhd,bqhd->bhq", do, o_j - o, precision=jax.lax.Precision.HIGHEST)
                + g)
            return tuple(acc + x.astype(F32) for acc, x in zip(grads, vjp((w * do, g_j))))

        dq, dk, dv = _switch(pair, branch, (dq, *dkv), kv)
        return dq, traveling, _rotate(ring, (dk, dv))  # dK, dV home after n steps

    dq, _, (dk, dv) = jax.lax.fori_loop(0, ring.size, step,
                                        (zeros(q), (k, v, kv_seg), (zeros(k), zeros(v))))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None)


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def _with_sinks(o, lse, sinks):
    """O and LSE with the sinks (one more logit per head and row, value 0) joined."""
    new = jnp.logaddexp(lse, sinks[None, :, None])
    return (_weights(lse, new) * o.astype(F32)).astype(o.dtype), new


LAYOUTS = ("contiguous", "striped")


def _check_layout(sequence_layout):
    if not isinstance(sequence_layout, str) or sequence_layout not in LAYOUTS:
        raise ValueError(f"sequence_layout must be one of {LAYOUTS}, got {sequence_layout!r}")
    return sequence_layout == "striped"


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


def ring_flash_attention(query, key, value, bias, mask, *, axis_name, query_seq_lengths,
                         key_value_seq_lengths, return_lse, block_attention,
                         sequence_layout="contiguous", **kwargs):
    """``flash_attention`` with ``sequence_axis_name=axis_name`` (attention.py documents the
    arguments; ``kwargs`` are its other keywords). Lengths count global positions.
    ``block_attention`` is ``flash_attention`` itself, which runs each pair of slices."""
    striped = _check_layout(sequence_layout)
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None:
            raise ValueError(
                f"{name} is not supported with sequence_axis_name (it spans the whole score "
                "matrix); express it with lengths, local_window_size or segment ids")
    ids = [kwargs.get(n) for n in ("query_segment_ids", "key_value_segment_ids")]
    dtypes = [getattr(x, "dtype", None) or jnp.asarray(x).dtype for x in ids if x is not None]
    if len(dtypes) == 2 and not validation.segment_ids_cast_exactly(*dtypes):
        # Ranking ids per device would number the slices that travel around the ring apart.
        raise TypeError("segment ids with sequence_axis_name need one integer dtype of at most "
                        f"32 bits for both, got {dtypes}")
    size = _axis_size(axis_name)
    q, k, v, operands, params = validation.check_inputs(query, key, value, **kwargs,
                                                        query_seq_lengths=None,
                                                        key_value_seq_lengths=None)
    batch = q.shape[0]
    q_lengths = validation.check_lengths(query_seq_lengths, "query_seq_lengths", batch,
                                         size * q.shape[1])
    kv_lengths = validation.check_lengths(key_value_seq_lengths, "key_value_seq_lengths", batch,
                                          size * k.shape[1])
    ring = _Ring(axis_name, size, q.shape[1], k.shape[1], params.scale, params.is_causal,
                 params.window_left, params.window_right, params.bottom_right,
                 params.logits_soft_cap, params.implementation, block_attention, striped)
    out, lse = _ring_attention(ring, q, k, v, operands.q_segment_ids, operands.kv_segment_ids,
                               q_lengths, kv_lengths)
    if operands.sinks is not None:
        out, lse = _with_sinks(out, lse, operands.sinks)
    return validation.restore_rank(query, out, lse, return_lse)
