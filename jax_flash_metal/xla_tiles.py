"""The per-tile math of the xla implementation: one (query block, key block) step of
FlashAttention-2 (Dao, "FlashAttention-2", 2023: Algorithm 1 forward, Algorithm 2 backward).

Layout inside a tile (float32): q, dO, O ``[B, HKV, G, Br, D]`` (query head ``hkv * G + g``, so
grouped-query attention never repeats K/V), k, v ``[B, HKV, Bc, D]``, row statistics
``[B, HKV, G, Br]``, ``visible`` bool ``[B, Br, Bc]`` (the same for every head). q arrives
multiplied by the softmax scale.

Every function takes ``exact_nonfinite``. False is the fast path, valid when every value operand
is finite: plain matmuls, because a probability of exactly 0 at an invisible pair times a finite
value is 0. True keeps DESIGN.md's NaN placement when some input is non-finite: non-finite
values are zeroed before each contraction (so a weight of 0 cannot turn them into NaN) and counted
at the visible pairs that read them (``hits``); the outputs are set to NaN where a count is
positive. Scores and weights are always selected with ``visible`` before they reach a sum, so a
NaN weight only ever reaches the outputs of visible pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST
F32 = jnp.float32


def _dot(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HI, preferred_element_type=F32)


def _finite_values(x, exact_nonfinite):
    return jnp.where(jnp.isfinite(x), x, 0.0) if exact_nonfinite else x


def _nonfinite(x, group_axis=None):
    """1.0 where x is NaN/Inf (summed over the query-head group axis when given)."""
    bad = (~jnp.isfinite(x)).astype(F32)
    return bad if group_axis is None else jnp.sum(bad, axis=group_axis)


def _hits(spec, visible, bad):
    """How many visible pairs read a non-finite entry (``bad`` from _nonfinite), per output."""
    return _dot(spec, visible.astype(F32), bad)


def poison(out, hits, per_group=False):
    """NaN wherever a visible pair read a non-finite value (hits > 0). ``per_group``: out has
    the query-head group axis before its last two (rows, head_dim) and hits does not."""
    if hits is None:
        return out
    return jnp.where((hits[..., None, :, :] if per_group else hits) > 0, jnp.nan, out)


def scores(q, k, visible, exact_nonfinite):
    """Scaled scores [B, HKV, G, Br, Bc], ``-inf`` at invisible pairs. A key with a non-finite
    entry scores NaN (not a -inf that would quietly weigh it 0)."""
    s = _dot("bhgqd,bhkd->bhgqk", q, _finite_values(k, exact_nonfinite))
    if exact_nonfinite:
        bad_key = ~jnp.all(jnp.isfinite(k), axis=-1)[:, :, None, None, :]
        s = jnp.where(bad_key, jnp.nan, s)
    return jnp.where(visible[:, None, None], s, -jnp.inf)


class Running(NamedTuple):
    """Online-softmax state of a block of query rows: running max m, running sum l,
    unnormalised output acc, and (exact_nonfinite only) the non-finite hit count of acc."""

    m: jax.Array
    l: jax.Array
    acc: jax.Array
    hits: jax.Array | None


def running_init(q, kv_heads_shape, exact_nonfinite):
    """The state before any key: m = -inf, l = 0, acc = 0."""
    rows = q.shape[:-1]
    hits = jnp.zeros(kv_heads_shape, F32) if exact_nonfinite else None
    return Running(jnp.full(rows, -jnp.inf, F32), jnp.zeros(rows, F32), jnp.zeros(q.shape, F32),
                   hits)


def forward_step(state, q, k, v, visible, exact_nonfinite):
    """Fold one key block into the running state (rescaling by exp(m_old - m_new))."""
    s = scores(q, k, visible, exact_nonfinite)
    m = jnp.maximum(state.m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # no key seen yet: exp(-inf - 0) = 0, never NaN
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(state.m - m_safe)
    l = alpha * state.l + jnp.sum(p, axis=-1)
    acc = alpha[..., None] * state.acc + _dot("bhgqk,bhkd->bhgqd", p,
                                              _finite_values(v, exact_nonfinite))
    hits = state.hits
    if exact_nonfinite:
        hits = hits + _hits("bqk,bhkd->bhqd", visible, _nonfinite(v))
    return Running(m, l, acc, hits)


def forward_finish(state):
    """(o, lse) of the finished rows: o = acc / l and lse = m + log l, or exactly 0 and -inf for
    a row that saw no key (l == 0). A NaN l (a NaN score) keeps o and lse NaN."""
    empty = state.l == 0.0
    o = jnp.where(empty[..., None], 0.0, state.acc / state.l[..., None])
    o = poison(o, state.hits, per_group=True)
    return o, jnp.where(empty, -jnp.inf, state.m + jnp.log(state.l))


class Grads(NamedTuple):
    """One tile's contributions: dq (unscaled) to the query block, dk/dv to the key block, and
    with exact_nonfinite their hit counts (dq_hits [B, HKV, Br, D] shared by the group)."""

    dq: jax.Array
    dk: jax.Array
    dv: jax.Array
    dq_hits: jax.Array | None
    dk_hits: jax.Array | None
    dv_hits: jax.Array | None


def backward_tile(q, k, v, do, lse, delta, visible, exact_nonfinite):
    """FlashAttention-2 backward of one tile from the forward's lse (float32 rows, ``-inf`` for
    empty rows) and delta = rowsum(dO * O) - g_lse: P = exp(S - lse), dV = P^T dO,
    dP = dO V^T, dS = P (dP - delta), dQ = dS K, dK = dS^T (scale q)."""
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)  # an empty row has only -inf scores
    p = jnp.exp(scores(q, k, visible, exact_nonfinite) - lse_safe[..., None])
    # dP uses raw V and dO: a non-finite entry there reaches dS only at visible pairs.
    dp = _dot("bhgqd,bhkd->bhgqk", do, v)
    ds = p * (dp - delta[..., None])
    if exact_nonfinite:  # a NaN lse or dP at an invisible pair must not leak into dS or dV
        vis = visible[:, None, None]
        p = jnp.where(vis, p, 0.0)
        ds = jnp.where(vis, ds, 0.0)
    dv = _dot("bhgqk,bhgqd->bhkd", p, _finite_values(do, exact_nonfinite))
    dq = _dot("bhgqk,bhkd->bhgqd", ds, _finite_values(k, exact_nonfinite))
    dk = _dot("bhgqk,bhgqd->bhkd", ds, _finite_values(q, exact_nonfinite))
    if not exact_nonfinite:
        return Grads(dq, dk, dv, None, None, None)
    return Grads(dq, dk, dv, _hits("bqk,bhkd->bhqd", visible, _nonfinite(k)),
                 _hits("bqk,bhqd->bhkd", visible, _nonfinite(q, group_axis=2)),
                 _hits("bqk,bhqd->bhkd", visible, _nonfinite(do, group_axis=2)))
