"""The per-tile math of the xla implementation: one (query block, key block) step of
FlashAttention-2 (Dao, "FlashAttention-2", 2023: Algorithm 1 forward, Algorithm 2 backward).

Layout inside a tile (float32): q, dO ``[B, HKV, G, Br, D]`` (query head ``hkv * G + g``, so
grouped-query attention never repeats K/V), k, v ``[B, HKV, Bc, D]``, row statistics
``[B, HKV, G, Br]``, ``visible`` bool ``[B, Br, Bc]`` (the same for every head) or None when every
pair of the tile is visible. q arrives multiplied by the softmax scale.

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

_HI = jax.lax.Precision.HIGHEST
F32 = jnp.float32


def _dot(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HI, preferred_element_type=F32)


def _masked(visible, x, fill):
    """x [B, HKV, G, Br, Bc] with ``fill`` at invisible pairs."""
    return x if visible is None else jnp.where(visible[:, None, None], x, fill)


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


def forward_step(state, q, k_nan, v_zeroed, visible):
    """Fold one key block into the running state (rescaling by exp(m_old - m_new))."""
    s = _masked(visible, _dot("bhgqd,bhkd->bhgqk", q, k_nan), -jnp.inf)
    m = jnp.maximum(state.m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m[..., None])
    alpha = jnp.exp(state.m - m)
    return Running(m, alpha * state.l + jnp.sum(p, axis=-1),
                   alpha[..., None] * state.acc + _dot("bhgqk,bhkd->bhgqd", p, v_zeroed))


def forward_finish(state):
    """(o, lse) of finished rows: o = acc / l and lse = m + log l, or exactly 0 and -inf for a
    row that saw no key (l == 0). A NaN l (a NaN score) keeps o and lse NaN."""
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


def backward_tile(x: BackwardOperands, visible):
    """(dq unscaled, dk, dv) contributions of one tile: P = exp(S - lse) (lse = -inf for empty
    rows), dV = P^T dO, dP = dO V^T, dS = P (dP - delta), dQ = dS K, dK = dS^T (scale q)."""
    lse = jnp.maximum(x.lse, LOWEST)  # an empty row (-inf) has only invisible pairs
    s = _dot("bhgqd,bhkd->bhgqk", x.q, x.k_nan)
    p = jnp.exp(_masked(visible, s - lse[..., None], -jnp.inf))
    dp = _dot("bhgqd,bhkd->bhgqk", x.do, x.v)
    ds = _masked(visible, p * (dp - x.delta[..., None]), 0.0)
    return (_dot("bhgqk,bhkd->bhgqd", ds, x.k_zeroed), _dot("bhgqk,bhgqd->bhkd", ds, x.q_zeroed),
            _dot("bhgqk,bhgqd->bhkd", p, x.do_zeroed))
