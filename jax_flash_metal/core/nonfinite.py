"""Exact NaN placement for the xla implementation
(docs/design.md#empty-rows-and-non-finite-inputs).

Where some pair of real positions is hidden, the blockwise code zeroes non-finite entries of
every operand that a probability or dS weighs, because a weight of exactly 0 (an invisible pair)
times NaN would be NaN. An output entry must be NaN exactly when a visible pair read a
non-finite entry there: the xla implementation counts those pairs with matmuls of the
visibility and ``indicator`` arrays (its counting pass, ``xla_tiles``), and ``poison`` puts NaN
where a count is positive.
"""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32


def indicator(x):
    """1.0 where x is NaN/Inf, else 0.0."""
    return (~jnp.isfinite(x)).astype(F32)


def poison(out, counts):
    """NaN wherever counts > 0 (counts broadcast against out)."""
    return jnp.where(counts > 0, jnp.nan, out)
