"""Which keys each query row may see (DESIGN.md section 3), for whole score matrices and tiles.

Key j is visible to query row i of batch b when i < q_len_b, j < kv_len_b, and (with the diagonal
``diag = i + off_b``, ``off_b = kv_len_b - q_len_b`` for bottom-right alignment, else 0) the causal
and local-window bounds hold: ``diag - left <= j <= diag + right``. ``Band`` holds these rules with
the per-batch lengths (traced int32) and answers two questions: the boolean mask of any block of
(rows, keys), and the span of keys (or rows) that a block of rows (or keys) can possibly touch, so
blockwise code visits only the blocks that intersect the band.
"""

from __future__ import annotations

import jax.numpy as jnp


def lengths_or_full(lengths, batch, full):
    """int32 [batch]: the given lengths, or ``full`` for every batch entry when None."""
    if lengths is None:
        return jnp.full((batch,), full, jnp.int32)
    return lengths.astype(jnp.int32)


class Band:
    """The visibility rule of one call.

    Args:
      q_len, kv_len: static sequence lengths.
      q_lengths, kv_lengths: int32 [batch] valid lengths (already clamped) or None (= full).
      batch: static batch size.
      is_causal, window_left, window_right (-1 = unbounded), bottom_right: as the primitives'
        static params.
    """

    def __init__(self, batch, q_len, kv_len, q_lengths, kv_lengths, *, is_causal, window_left,
                 window_right, bottom_right):
        self.q_lengths = lengths_or_full(q_lengths, batch, q_len)
        self.kv_lengths = lengths_or_full(kv_lengths, batch, kv_len)
        self.offset = (self.kv_lengths - self.q_lengths if bottom_right
                       else jnp.zeros((batch,), jnp.int32))
        # A bound wider than both lengths reaches as far as no bound; clamping keeps the span
        # arithmetic below far from int32 overflow.
        reach = q_len + kv_len
        self.left = min(window_left, reach) if window_left >= 0 else None
        right = min(window_right, reach) if window_right >= 0 else None
        self.right = 0 if is_causal else right  # causal: j <= diag (window right >= 0 is looser)

    def mask(self, rows, keys):
        """bool [batch, len(rows), len(keys)] for int32 query indices ``rows`` and key indices
        ``keys`` (absolute positions; positions past the lengths are simply invisible)."""
        i = rows[None, :, None]
        j = keys[None, None, :]
        visible = (i < self.q_lengths[:, None, None]) & (j < self.kv_lengths[:, None, None])
        diag = i + self.offset[:, None, None]
        # Offsets from the diagonal, not diag +/- bound, so nothing can overflow int32.
        if self.right is not None:
            visible &= j - diag <= self.right
        if self.left is not None:
            visible &= diag - j <= self.left
        return visible

    def key_span(self, row_lo, row_hi):
        """Half-open key range [lo, hi) (int32 scalars, hi >= lo) outside which no row in
        [row_lo, row_hi) of any batch entry sees a key; empty when those rows see nothing."""
        row_hi = jnp.minimum(row_hi, jnp.max(self.q_lengths, initial=0))
        lo = jnp.int32(0)
        hi = jnp.max(self.kv_lengths, initial=0)
        if self.left is not None:
            lo = jnp.maximum(lo, row_lo + jnp.min(self.offset, initial=0) - self.left)
        if self.right is not None:
            hi = jnp.minimum(hi, row_hi + jnp.max(self.offset, initial=0) + self.right)
        hi = jnp.where(row_lo < row_hi, hi, lo)
        return lo, jnp.maximum(hi, lo)

    def row_span(self, key_lo, key_hi):
        """Half-open row range [lo, hi) outside which no row sees a key in [key_lo, key_hi)."""
        key_hi = jnp.minimum(key_hi, jnp.max(self.kv_lengths, initial=0))
        lo = jnp.int32(0)
        hi = jnp.max(self.q_lengths, initial=0)
        if self.right is not None:
            lo = jnp.maximum(lo, key_lo - jnp.max(self.offset, initial=0) - self.right)
        if self.left is not None:
            hi = jnp.minimum(hi, key_hi - jnp.min(self.offset, initial=0) + self.left)
        hi = jnp.where(key_lo < key_hi, hi, lo)
        return lo, jnp.maximum(hi, lo)
