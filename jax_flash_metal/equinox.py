"""``MultiheadAttention``: ``equinox.nn.MultiheadAttention`` with the attention computed by
``flash_attention``.

Change ``eqx.nn.MultiheadAttention(...)`` to ``jax_flash_metal.equinox.MultiheadAttention(...)``:
the constructor, the call and the parameter pytree are Equinox's (it is a subclass that replaces
only ``__call__``), so weights trained or saved with one load into the other. Needs the
``[equinox]`` extra; importing ``jax_flash_metal`` itself does not import Equinox.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._extras import needs
from .attention import flash_attention
from .core.contract import Implementation

with needs("equinox", "jax_flash_metal.equinox", ("equinox",)):
    import equinox as eqx


class MultiheadAttention(eqx.nn.MultiheadAttention):
    """``equinox.nn.MultiheadAttention`` (same constructor, fields and call; see its documentation)
    whose attention is ``flash_attention`` instead of a dense softmax.

    Differences: attention dropout (``dropout_p > 0`` and not in inference mode) draws its mask
    from ``key`` with ``jax_flash_metal.dropout_mask`` (M[0, n, i, j] of this one-sequence
    call), not from ``eqx.nn.Dropout``'s draw; a query row whose every key is masked outputs 0
    (Equinox: the mean of the values).
    """

    def __call__(self, query: jax.Array, key_: jax.Array, value: jax.Array,
                 mask: jax.Array | None = None, *, key: Any = None,
                 inference: bool | None = None, deterministic: bool | None = None,
                 process_heads: Callable[..., Any] | None = None,
                 implementation: Implementation | None = None) -> jax.Array:
        """Multi-head attention of one (unbatched) sequence; ``jax.vmap`` it over a batch.

        Args:
          query [q_len, query_size]; key_ [kv_len, key_size]; value [kv_len, value_size].
          mask: bool [q_len, kv_len] or [num_heads, q_len, kv_len], True = attend.
          key: the PRNG key of attention dropout, required when it is active; flash_attention's
            ``dropout_rng`` (vmap with a batch of keys: each sequence its own mask).
          inference, deterministic (deprecated alias): as Equinox; with dropout_p > 0 one of
            them (or the module's ``inference``) must be True.
          process_heads: as Equinox: maps the (query, key, value) heads [len, num_heads, size]
            to new heads of the same shapes (e.g. rotary embeddings).
          implementation: flash_attention's (an addition to Equinox's call; None = the default).
        Returns:
          [q_len, output_size]. Scores are scaled by 1/sqrt(qk_size); the attention runs in the
          projections' dtype (float32, float16 or bfloat16) with a float32 softmax.
        Raises:
          ValueError for a missing key when dropout is active, mismatched key/value lengths, a
          mask of the wrong shape, or heads that process_heads reshaped.
        """
        if deterministic is not None:
            inference = deterministic
            warnings.warn("MultiheadAttention()(deterministic=...) is deprecated in favour of "
                          "MultiheadAttention()(inference=...)", stacklevel=2)
        inactive = self.dropout.inference if inference is None else inference
        dropout: dict[str, Any] = {}
        if self.dropout.p > 0 and not inactive:
            if key is None:
                raise ValueError(
                    f"jax_flash_metal.equinox.MultiheadAttention: attention dropout (dropout_p="
                    f"{self.dropout.p}) is active, so a PRNG key is required (key=...), or call "
                    "with inference=True")
            dropout = dict(dropout_rate=self.dropout.p, dropout_rng=key)
        q_len, kv_len = query.shape[0], key_.shape[0]
        if value.shape[0] != kv_len:
            raise ValueError("key and value must both be sequences of equal length.")
        heads = [self._project(proj, x) for proj, x in
                 ((self.query_proj, query), (self.key_proj, key_), (self.value_proj, value))]
        if process_heads is not None:
            shapes = [h.shape for h in heads]
            heads = list(process_heads(*heads))
            if [h.shape for h in heads] != shapes:
                raise ValueError("process_heads must not change the shape of the heads.")
        if mask is not None and mask.shape not in ((q_len, kv_len),
                                                   (self.num_heads, q_len, kv_len)):
            raise ValueError(f"mask must have shape (query_seq_length, kv_seq_length)=({q_len}, "
                             f"{kv_len}) or (num_heads, query_seq_length, kv_seq_length); got "
                             f"{mask.shape}.")
        # flash_attention takes one head_dim for query, key and value: zero-padding q and k adds
        # nothing to q.k, and zero-padded value columns are sliced off.
        dim = max(self.qk_size, self.vo_size)
        q, k, v = (jnp.pad(h, ((0, 0), (0, 0), (0, dim - h.shape[-1]))) for h in heads)
        out = flash_attention(q, k, v, mask=mask, scale=1.0 / math.sqrt(self.qk_size),
                              implementation=implementation, **dropout)
        attn = out[:, :, :self.vo_size].reshape(q_len, -1)
        return jax.vmap(self.output_proj)(attn)
