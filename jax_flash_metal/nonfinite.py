"""Exact NaN placement for the xla implementation (DESIGN.md section 3).

The blockwise code zeroes non-finite entries of every operand that a probability or dS weighs,
because a weight of exactly 0 (an invisible pair) times NaN would be NaN. An output entry must be
NaN exactly when a visible pair read a non-finite entry there. Visibility is one interval of keys
per query row (and of rows per key: ``visibility.Band``), so those counts are differences of
prefix sums over the sequence axis: O(length * head_dim) work and memory, no score matrix.
"""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32
_PREFIX_BLOCK = 128


def _exclusive_prefix_sums(x):
    """c [B, H, T + 1, D] with c[:, :, t] = sum of x[:, :, :t] for x float [B, H, T, D].

    Two levels of triangular matmuls (within blocks of _PREFIX_BLOCK, then across blocks):
    exact for the 0/1 counts used here, and quicker for XLA:CPU to compile than a cumsum.
    """
    b, h, length, d = x.shape
    size = min(_PREFIX_BLOCK, length)
    nb = -(-length // size)
    xb = jnp.pad(x, ((0, 0), (0, 0), (0, nb * size - length), (0, 0))).reshape(b, h, nb, size, d)
    inclusive = (jnp.arange(size)[:, None] >= jnp.arange(size)[None, :]).astype(F32)
    within = jnp.einsum("st,bhntd->bhnsd", inclusive, xb)
    before = (jnp.arange(nb)[:, None] > jnp.arange(nb)[None, :]).astype(F32)
    offsets = jnp.einsum("mn,bhnd->bhmd", before, within[:, :, :, -1])
    c = (within + offsets[:, :, :, None]).reshape(b, h, nb * size, d)[:, :, :length]
    return jnp.concatenate([jnp.zeros((b, h, 1, d), F32), c], axis=2)


def indicator(x, group_axis=None):
    """1.0 where x is NaN/Inf, else 0.0 (summed over ``group_axis`` when given)."""
    bad = (~jnp.isfinite(x)).astype(F32)
    return bad if group_axis is None else jnp.sum(bad, axis=group_axis)


def interval_counts(bad, lo, hi):
    """[B, H, R, D]: sum of bad[:, :, lo_r:hi_r, :] (``indicator`` values [B, H, T, D]) for
    intervals lo, hi int32 [B, R] (clipped to [0, T])."""
    c = _exclusive_prefix_sums(bad)
    length = bad.shape[2]

    def at(idx):
        idx = jnp.clip(idx, 0, length)[:, None, :, None]
        return jnp.take_along_axis(c, idx, axis=2)

    return at(hi) - at(lo)


def poison(out, counts):
    """NaN wherever counts > 0 (counts broadcast against out)."""
    return jnp.where(counts > 0, jnp.nan, out)
