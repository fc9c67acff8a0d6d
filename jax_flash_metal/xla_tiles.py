"""The per-tile math of the xla implementation: one (query block, key block) step of
FlashAttention-2 (Dao, "FlashAttention-2", 2023: Algorithm 1 forward, Algorithm 2 backward).

Layout inside a tile (float32): q, dO ``[B, HKV, G, Br, D]`` (query head ``hkv * G + g``, so
grouped-query attention never repeats K/V), k, v ``[B, HKV, Bc, D]``, row statistics
``[B, HKV, G, Br]``, ``visible`` bool broadcastable to ``[B, HKV, G, Br, Bc]`` or None when every
pair of the tile is visible, ``bias`` float32 broadcastable the same way or None. q arrives
multiplied by the softmax scale. Scores are ``cap(q . k) + bias`` (``features.soft_cap``).

Non-finite inputs (DESIGN.md section 3) cost nothing here: the caller passes each operand in the
form that makes plain matmuls place NaN exactly. Scores use q and k with every non-finite row
made all-NaN (a key with an Inf entry scores NaN, not a -inf that would quietly weigh it 0);
dP uses raw v and dO; and scores, P and dS are selected with ``visible`` before any sum, so a NaN
there reaches only the outputs of visible pairs. The operands that are weighted by P or dS (v in
the forward; dO, k, q in the backward) arrive with non-finite entries zeroed, since a weight of
exactly 0 times NaN would be NaN; ``nonfinite`` puts the NaN back where a visible pair read one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import features

_HI = jax.lax.Precision.HIGHEST
F32 = jnp.float32


def _dot(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HI, preferred_element_type=F32)


def _masked(visible, x, fill):
    """x [B, HKV, G, Br, Bc] with ``fill`` at invisible pairs."""
    return x if visible is None else jnp.where(visible, x, fill)


def _scores(q, k_nan, bias, cap):
    """(cap(q . k) + bias, d cap / d raw score or None) for one tile."""
    s, slope = features.soft_cap(_dot("bhgqd,bhkd->bhgqk", q, k_nan), cap)
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


def running_init(q):
    """The state before any key: m = LOWEST, l = 0, acc = 0."""
    rows = q.shape[:-1]
    return Running(jnp.full(rows, LOWEST, F32), jnp.zeros(rows, F32), jnp.zeros(q.shape, F32))


def forward_step(state, q, k_nan, v_zeroed, visible, bias=None, cap=None):
    """Fold one key block into the running state (rescaling by exp(m_old - m_new))."""
    s = _masked(visible, _scores(q, k_nan, bias, cap)[0], -jnp.inf)
    m = jnp.maximum(state.m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m[..., None])
    alpha = jnp.exp(state.m - m)
    return Running(m, alpha * state.l + jnp.sum(p, axis=-1),
                   alpha[..., None] * state.acc + _dot("bhgqk,bhkd->bhgqd", p, v_zeroed))


def forward_finish(state, sinks=None):
    """(o, lse) of finished rows: o = acc / l and lse = m + log l, or exactly 0 and -inf for a
    row that saw no key (l == 0). A NaN l (a NaN score) keeps o and lse NaN. ``sinks``
    (float32 broadcastable to the rows, e.g. [1, HKV, G, 1]) join the denominator as one more
    logit each with no value, so an empty row gets o = 0 and lse = its sink."""
    if sinks is not None:
        m = jnp.maximum(state.m, sinks)
        alpha = jnp.exp(state.m - m)
        state = Running(m, alpha * state.l + jnp.exp(sinks - m), alpha[..., None] * state.acc)
    empty = state.l == 0.0
    o = jnp.where(empty[..., None], 0.0, state.acc / state.l[..., None])
    return o, jnp.where(empty, -jnp.inf, state.m + jnp.log(state.l))


class BackwardOperands(NamedTuple):
    """One tile's backward inputs, each in the form the module docstring gives."""

    q: jax.Array         # non-finite rows all-NaN, times scale (for the scores)
    q_zeroed: jax.Array  # non-finite entries 0 (for dK)
    k_nan: jax.Array     # non-finite key rows all-NaN (for the scores)
    k_zeroed: jax.Array  # (for dQ)
    v: jax.Array         # raw (for dP)
    do: jax.Array        # raw (for dP)
    do_zeroed: jax.Array  # (for dV)
    lse: jax.Array
    delta: jax.Array


def backward_tile(x: BackwardOperands, visible, bias=None, cap=None):
    """(dq unscaled, dk, dv, dS) contributions of one tile: P = exp(S - lse) (lse = -inf for
    empty rows), dV = P^T dO, dP = dO V^T, dS = P (dP - delta) (the bias gradient), then through
    the soft cap's slope dS_raw = dS (1 - tanh^2), dQ = dS_raw K, dK = dS_raw^T (scale q)."""
    lse = jnp.maximum(x.lse, LOWEST)  # an empty row (-inf) has only invisible pairs
    s, slope = _scores(x.q, x.k_nan, bias, cap)
    p = jnp.exp(_masked(visible, s - lse[..., None], -jnp.inf))
    dp = _dot("bhgqd,bhkd->bhgqk", x.do, x.v)
    ds = _masked(visible, p * (dp - x.delta[..., None]), 0.0)
    ds_raw = ds if slope is None else ds * slope
    return (_dot("bhgqk,bhkd->bhgqd", ds_raw, x.k_zeroed),
            _dot("bhgqk,bhgqd->bhkd", ds_raw, x.q_zeroed),
            _dot("bhgqk,bhgqd->bhkd", p, x.do_zeroed), ds)
