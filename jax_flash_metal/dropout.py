"""The public face of attention dropout: ``dropout_mask``, the keep mask every
``flash_attention`` call with ``dropout_rate > 0`` applies. The construction (Philox-4x32-10
over the positions) is ``core/dropout.py``'s; docs/design.md#dropout describes it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .core.dropout import keep, operand


def dropout_mask(dropout_rng, shape, rate):
    """The keep mask every ``flash_attention(..., dropout_rate=rate, dropout_rng=dropout_rng)``
    applies: bool [batch, num_heads, q_len, kv_len] (True = kept, weighted 1 / (1 - rate)).

    Args:
      dropout_rng: a JAX PRNG key (``jax.random.key`` with the default threefry
        implementation, or a legacy uint32 [2] ``jax.random.PRNGKey``); traced keys work.
      shape: (batch, num_heads, q_len, kv_len), non-negative ints; num_heads counts query
        heads.
      rate: a static float in [0, 1); rate 0 keeps everything.
    Returns:
      bool [batch, num_heads, q_len, kv_len]; entry [b, n, i, j] is the construction of
      docs/design.md#dropout (Philox-4x32-10 with the counter (j // 4, i, n, b), word
      j % 4 >= floor(rate * 2**32)), so any slice of it is the mask of that sub-shape.
    Raises:
      TypeError / ValueError naming ``dropout_rng``, ``shape`` or ``dropout_rate``.
    """
    if (not isinstance(shape, (tuple, list)) or len(shape) != 4
            or not all(isinstance(s, (int, np.integer)) and s >= 0 for s in shape)):
        raise ValueError(f"shape must be (batch, num_heads, q_len, kv_len) of ints >= 0, got "
                         f"{shape!r}")
    batch, heads, q_len, kv_len = (int(s) for s in shape)
    rate, seeds = operand(rate, dropout_rng, batch, heads)
    if seeds is None:
        return jnp.ones((batch, heads, q_len, kv_len), bool)
    return keep(seeds, jnp.arange(q_len, dtype=jnp.int32), 0, kv_len, rate, groups=True)
