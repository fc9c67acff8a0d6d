"""The per-tile math of the xla implementation: one (query block, key block) step of
FlashAttention-2 (Dao, "FlashAttention-2", 2023: Algorithm 1 forward, Algorithm 2 backward).

Layout inside a tile: q, dO ``[B, HKV, G, Br, D]`` (query head ``hkv * G + g``, so
grouped-query attention never repeats K/V), k, v ``[B, HKV, Bc, D]``, row statistics
``[B, HKV, G, Br]``, ``visible`` bool broadcastable to ``[B, HKV, G, Br, Bc]`` or None when every
pair of the tile is visible, ``bias`` float32 broadcastable the same way or None. The operands
q, k, v, dO are float32, or all float16/bfloat16 (``xla_schedule``'s ``half_operands``); every
matmul accumulates in float32, and P and dS enter theirs rounded to the operands' dtype. Scores
are ``cap(scale * (q . k)) + bias`` (``features.soft_cap``) in float32; with ``scale`` None, q
arrives multiplied by the softmax scale (float32 operands).
``dropout``: None, or a ``Dropout``: the keep mask M bool ``[B, HKV, G, Br, Bc]`` and the weight
1 / (1 - rate) of a kept entry, so Z = M / (1 - rate) (``dropout.keep``): O = (P Z) V, so
dV = (P Z)^T dO and dP = (dO V^T) Z; the softmax statistics, and D = rowsum(dO O) =
rowsum(P dP), are those of the undropped P.

Non-finite inputs (docs/design.md#empty-rows-and-non-finite-inputs) cost nothing here: the caller
passes each operand in the form that makes plain matmuls place NaN exactly. Every operand arrives
with its non-finite entries NaN, so a query or key with one scores NaN (a key with an Inf entry
scores NaN, not a -inf that would quietly weigh it 0), and so does dP; scores, P and dS are selected
with ``visible`` before any sum, so a NaN there reaches only the outputs of visible pairs. Where
some pair is hidden, the operands that are weighted by P or dS (v in the forward; dO, k, q in the
backward) arrive with non-finite entries zeroed instead, since a weight of exactly 0 times NaN
would be NaN.

The NaN goes back where a visible pair read one through a counting pass of the same tile code
with other operands: q, k, v for dP and dO for dP all 0, the residuals m and log l 0, delta -1
and no bias make every visible score 0, so P and dS are the visibility indicator (1 at visible
pairs, 0 elsewhere), and the weighted operands arrive as ``nonfinite.indicator`` arrays: the outputs
then count, per entry, the visible pairs that read a non-finite input there (the forward's o:
that count over the number of visible keys).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..core import features

_HI = jax.lax.Precision.HIGHEST
F32 = jnp.float32


def nan_entries(x):
    """x with every non-finite entry NaN (x - x is 0 for a finite entry, else NaN). A matmul
    then gives NaN wherever it reads one, where an Inf could have given a finite or infinite
    value: a query or key with one scores NaN against every key or query."""
    return x + (x - x)


def dot(spec, a, b):
    """The float32 product of a and b. Where one is a half-precision operand, the other (a
    float32 P or dS) is rounded to its dtype, so the matmul runs on the half-precision matrix
    units; float32 operands multiply at float32 precision."""
    dtype = b.dtype if a.dtype == F32 else a.dtype
    precision = _HI if dtype == F32 else None
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=precision,
                      preferred_element_type=F32)


def _as_operand(x, like):
    """float32 x rounded to the dtype of the operand ``like`` (a no-op for float32)."""
    return x.astype(like.dtype).astype(F32)


def _masked(visible, x, fill):
    """x [B, HKV, G, Br, Bc] with ``fill`` at invisible pairs."""
    return x if visible is None else jnp.where(visible, x, fill)


def _scores(q, k_nan, bias, cap, scale):
    """(cap(scale * (q . k)) + bias, d cap / d raw score or None) for one tile."""
    s = dot("bhgqd,bhkd->bhgqk", q, k_nan)
    s, slope = features.soft_cap(s if scale is None else s * jnp.float32(scale), cap)
    return (s if bias is None else s + bias), slope


class Running(NamedTuple):
    """Online-softmax state of a block of query rows: running max m, running sum l and the
    unnormalised output acc."""

    m: jax.Array
    l: jax.Array
    acc: jax.Array


# The running max starts at the lowest finite float, not -inf: every visible score is >= it, and
# exp(-inf - LOWEST) = 0 for invisible ones, so no step needs a -inf - -inf guard.
LOWEST = float(jnp.finfo(F32).min)


def running_init(q, value_head_dim):
    """The state before any key: m = LOWEST, l = 0, acc = 0 (rows x ``value_head_dim``)."""
    rows = q.shape[:-1]
    return Running(jnp.full(rows, LOWEST, F32), jnp.zeros(rows, F32),
                   jnp.zeros(rows + (value_head_dim,), F32))


class Dropout(NamedTuple):
    """A tile's dropout: keep mask M and the weight of a kept entry (float, or a traced float32
    scalar), Z = M * scale."""

    keep: jax.Array
    scale: float | jax.Array


def _dropped(p, dropout):
    """P Z, or P without dropout."""
    if dropout is None:
        return p
    return p * jnp.where(dropout.keep, jnp.asarray(dropout.scale, F32), F32(0.0))


def _merge_statistics(a, b):
    """Two partial row statistics (m, l), l = sum exp(s - m) over their scores, as one: the
    larger max, the other sum rescaled to it (one exponential per merge)."""
    (m1, l1), (m2, l2) = a, b
    scale = jnp.exp(-jnp.abs(m1 - m2))
    return jnp.maximum(m1, m2), jnp.where(m1 >= m2, l1 + l2 * scale, l1 * scale + l2)


def row_statistics(s, axis=-1):
    """(m, l) of masked scores s [..., Bc] (-inf at invisible pairs; the keys on ``axis``, the
    last by default): m = max(LOWEST, max s)
    and l = sum exp(s - m), in one pass over s (a variadic reduction of the pairs (s, 1),
    (LOWEST, 0) for an invisible pair, with ``_merge_statistics``), where a max reduction then
    a sum of exponentials would read s twice. A NaN score makes both NaN; a row with no visible
    score gets (LOWEST, 0)."""
    hidden = s == -jnp.inf
    return jax.lax.reduce((jnp.where(hidden, LOWEST, s), jnp.where(hidden, 0.0, 1.0)),
                          (jnp.float32(LOWEST), jnp.float32(0.0)), _merge_statistics,
                          (axis % s.ndim,))


def forward_step(state, q, k_nan, v_zeroed, visible, bias=None, cap=None, scale=None,
                 dropout=None):
    """Fold one key block into the running state (rescaling by exp(m_old - m_new)); the sum l
    takes P, the output P Z."""
    s = _masked(visible, _scores(q, k_nan, bias, cap, scale)[0], -jnp.inf)
    m = jnp.maximum(state.m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m[..., None])
    alpha = jnp.exp(state.m - m)
    return Running(m, alpha * state.l + jnp.sum(p, axis=-1),
                   alpha[..., None] * state.acc + dot("bhgqk,bhkd->bhgqd", _dropped(p, dropout),
                                                       v_zeroed))


def forward_finish(state, sinks=None):
    """(o, lse, m, log l) of finished rows: o = acc / l and lse = m + log l, or exactly 0 and
    -inf for a row that saw no key (l == 0); m and log l are the residuals ``probabilities``
    takes (LOWEST and 0 for such a row). A NaN l (a NaN score) keeps o, lse and log l NaN. ``sinks``
    (float32 broadcastable to the rows, e.g. [1, HKV, G, 1]) join the denominator as one more
    logit each with no value, so an empty row gets o = 0 and lse = its sink."""
    if sinks is not None:
        m = jnp.maximum(state.m, sinks)
        alpha = jnp.exp(state.m - m)
        state = Running(m, alpha * state.l + jnp.exp(sinks - m), alpha[..., None] * state.acc)
    empty = state.l == 0.0
    o = jnp.where(empty[..., None], 0.0, state.acc / state.l[..., None])
    log_l = jnp.where(empty, 0.0, jnp.log(state.l))
    return o, jnp.where(empty, -jnp.inf, state.m + log_l), state.m, log_l


class BackwardOperands(NamedTuple):
    """One tile's backward inputs, each in the form the module docstring gives."""

    q: jax.Array         # non-finite entries NaN, times scale unless it is applied to the
                         # scores (for the scores)
    q_zeroed: jax.Array  # non-finite entries 0 (for dK)
    k_nan: jax.Array     # non-finite entries NaN (for the scores)
    k_zeroed: jax.Array  # (for dQ)
    v: jax.Array         # non-finite entries NaN (for dP)
    do: jax.Array        # (for dP)
    do_zeroed: jax.Array  # (for dV)
    row_max: jax.Array   # the forward's residuals m and log l (``probabilities``)
    log_sum: jax.Array
    delta: jax.Array     # rowsum(dO O) - g_lse


def probabilities(s, m, log_l, visible):
    """P = exp((S - m) - log l), 0 at invisible pairs, from the row max m and the log of the
    row's sum l relative to it: S - m is exact for nearby float32 scores, so this holds at any
    offset (S - lse would lose log l where |m| is huge and lse = m + log l rounds to m). An
    empty row (only invisible pairs) has m = LOWEST and log l = 0. ``forward_whole_rows``
    and ``backward_tile`` both take P from here, so inside one jit XLA finds the backward's P
    equal to the forward's and computes it once."""
    return jnp.exp(_masked(visible, (s - m[..., None]) - log_l[..., None], -jnp.inf))


def forward_whole_rows(q, k_nan, v_zeroed, visible, bias=None, cap=None, sinks=None,
                       scale=None, dropout=None, one_pass_statistics=False):
    """(o, lse, m, log l) of a tile that holds every key of its rows (the dense path), without
    the online softmax: m = max S and l = sum exp(S - m) (plus the sinks as in
    ``forward_finish``) in two passes over the scores, or in one (``row_statistics``) with
    ``one_pass_statistics``; lse = m + log l (-inf for a row that sees no key), then o = P V
    with P = ``probabilities(S, m, log l)``, the same P the backward recomputes."""
    s = _scores(q, k_nan, bias, cap, scale)[0]
    s_masked = _masked(visible, s, -jnp.inf)
    if one_pass_statistics:
        m, l = row_statistics(s_masked)
        if sinks is not None:  # each sink: one more logit, a statistic (sink, 1) to merge
            m, l = _merge_statistics((m, l), (sinks, 1.0))
    else:
        m = jnp.maximum(jnp.max(s_masked, axis=-1), LOWEST)
        if sinks is not None:
            m = jnp.maximum(m, sinks)
        l = jnp.sum(jnp.exp(s_masked - m[..., None]), axis=-1)
        if sinks is not None:
            l = l + jnp.exp(sinks - m)
    log_l = jnp.where(l == 0.0, 0.0, jnp.log(l))
    lse = jnp.where(l == 0.0, -jnp.inf, m + log_l)
    o = dot("bhgqk,bhkd->bhgqd", _dropped(probabilities(s, m, log_l, visible), dropout),
             v_zeroed)
    return o, lse, m, log_l


def _key_major(small, big, pinned_transposes):
    """sum over rows (and heads of a group) of big [B, HKV, G, Br, Bc] x small [B, HKV, G, Br, D]
    -> [B, HKV, Bc, D] (dS^T q, P^T dO). With ``pinned_transposes``, computed as
    (small^T big)^T: a plain matmul that reads the [rows, keys] operand in its layout. The
    optimization barriers keep XLA from folding the two small transposes back into the matmul,
    which XLA:CPU would then run as a slower transposed-operand matmul
    (docs/benchmarks.md#why-the-xla-schedules)."""
    if not pinned_transposes:
        return dot("bhgqd,bhgqk->bhkd", small, big)
    small_t = jax.lax.optimization_barrier(jnp.moveaxis(small, -1, 2))  # [B, HKV, D, G, Br]
    return jnp.swapaxes(jax.lax.optimization_barrier(
        dot("bhdgq,bhgqk->bhdk", small_t, big)), -1, -2)


def _dp_minus_delta(x: BackwardOperands, dropout):
    """dP Z - D with dP = dO V^T, rounded to the operands' dtype. With dropout it is formed as
    E = scale * dP - D, then 0 * E - D where dropped (-D, or NaN where E is, as 0 * dP would
    give): the mask stays out of E, so XLA:GPU fuses E into the dP matmul's epilogue as it does
    dP - D without dropout (with the mask there, it stored dP as a float32 tile and read it
    back: docs/gpu.md#dropout)."""
    dp = dot("bhgqd,bhkd->bhgqk", x.do, x.v)
    delta = x.delta[..., None]
    if dropout is None:
        return _as_operand(dp - delta, x.do)
    e = _as_operand(jnp.asarray(dropout.scale, F32) * dp - delta, x.do)
    return jnp.where(dropout.keep, e, _as_operand(0.0 * e - delta, x.do))


def backward_tile(x: BackwardOperands, visible, bias=None, cap=None, scale=None, dropout=None,
                  pinned_transposes=False):
    """(dq unscaled, dk, dv, dS) contributions of one tile: P = ``probabilities`` from the
    forward's residuals, dV = (P Z)^T dO, dP = (dO V^T) Z (Z = 1 without dropout),
    dS = P (dP - delta) (the bias gradient), then through the soft cap's slope
    dS_raw = dS (1 - tanh^2), dQ = dS_raw K, dK = dS_raw^T q (q as the operands hold it: times
    scale, or unscaled with ``scale`` given, then dk lacks it too). With half-precision
    operands, P (for dV and dS alike) and dP - delta are rounded to the operands' dtype, so XLA
    can write both in half precision straight from their matmuls instead of float32 tiles; dS is
    rounded for its matmuls anyway. The difference is rounded, not dP: dP - delta cancels where
    the softmax is nearly one-hot (case C-07), and a rounded dP would leave its rounding error.
    ``pinned_transposes``: as ``xla_schedule``'s (``_key_major``)."""
    s, slope = _scores(x.q, x.k_nan, bias, cap, scale)
    p = _as_operand(probabilities(s, x.row_max, x.log_sum, visible), x.do)
    ds = _masked(visible, p * _dp_minus_delta(x, dropout), 0.0)
    ds_raw = ds if slope is None else ds * slope
    return (dot("bhgqk,bhkd->bhgqd", ds_raw, x.k_zeroed),
            _key_major(x.q_zeroed, ds_raw, pinned_transposes),
            _key_major(x.do_zeroed, _dropped(p, dropout), pinned_transposes), ds)
