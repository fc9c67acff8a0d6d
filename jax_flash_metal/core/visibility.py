"""Which keys each query row may see (docs/design.md#visibility), for whole score matrices and
tiles.

Key j is visible to query row i of batch b when i < q_len_b, j < kv_len_b, and (with the diagonal
``diag = i + off_b``, ``off_b = kv_len_b - q_len_b`` for bottom-right alignment, else 0) the causal
and local-window bounds hold: ``diag - left <= j <= diag + right``. ``Band`` holds these rules with
the per-batch lengths (traced int32) and answers two questions: the boolean mask of any block of
(rows, keys), and the interval of keys each row sees (or of rows that see each key): visibility
is always one contiguous interval per row, which lets blockwise code visit only the blocks that
intersect the band. Without lengths the band's arrays are NumPy arrays, and so are the intervals
of NumPy positions: a static band is then computed while tracing, as NumPy, and enters the
compiled program as constants (eager JAX ops would dispatch, and after a cache clear compile,
each of them).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def array_module(*arrays):
    """numpy when every array is a NumPy array, else jax.numpy."""
    return np if all(isinstance(x, np.ndarray) for x in arrays) else jnp


def lengths_or_full(lengths, batch, full):
    """int32 [batch]: the given lengths, or ``full`` for every batch entry (NumPy) when None."""
    if lengths is None:
        return np.full((batch,), full, np.int32)
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
        xp = array_module(self.q_lengths, self.kv_lengths)
        self.offset = (self.kv_lengths - self.q_lengths if bottom_right
                       else xp.zeros((batch,), np.int32))
        # A bound wider than both lengths reaches as far as no bound; clamping keeps the span
        # arithmetic below far from int32 overflow.
        reach = q_len + kv_len
        self.left = min(window_left, reach) if window_left >= 0 else None
        right = min(window_right, reach) if window_right >= 0 else None
        self.right = 0 if is_causal else right  # causal: j <= diag (window right >= 0 is looser)

    def mask(self, rows, keys, *, check_rows=True, check_keys=True):
        """bool [batch, len(rows), len(keys)] for int32 query indices ``rows`` and key indices
        ``keys`` (absolute positions; positions past the lengths are simply invisible).

        ``check_rows=False`` / ``check_keys=False`` promise that every given row / key is within
        the lengths (no lengths were given and nothing is padded), which skips those compares;
        the result is then None when every pair is visible.
        """
        i = rows[None, :, None]
        j = keys[None, None, :]
        conditions = []
        if check_rows:
            conditions.append(i < self.q_lengths[:, None, None])
        if check_keys:
            conditions.append(j < self.kv_lengths[:, None, None])
        diag = i + self.offset[:, None, None]
        # Offsets from the diagonal, not diag +/- bound, so nothing can overflow int32.
        if self.right is not None:
            conditions.append(j - diag <= self.right)
        if self.left is not None:
            conditions.append(diag - j <= self.left)
        if not conditions:
            return None
        visible = conditions[0]
        for c in conditions[1:]:
            visible = visible & c
        return jnp.broadcast_to(visible, (self.offset.shape[0], rows.shape[0], keys.shape[0]))

    def alibi_distance(self, rows, keys):
        """float32 [batch, len(rows), len(keys)]: -|i + off_b - j|, the distance ALiBi scales
        by each head's slope (docs/design.md#alibi)."""
        diag = rows[None, :, None] + self.offset[:, None, None]
        return -jnp.abs(diag - keys[None, None, :]).astype(jnp.float32)

    def key_intervals(self, rows):
        """(lo, hi) int32 [batch, len(rows)]: query row i sees exactly the keys lo <= j < hi
        (lo == hi for a row that sees none). Visibility is always such an interval."""
        xp = array_module(rows, self.offset, self.q_lengths, self.kv_lengths)
        i = rows[None, :]
        diag = i + self.offset[:, None]
        lo = xp.zeros_like(diag)
        hi = xp.broadcast_to(self.kv_lengths[:, None], diag.shape)
        if self.left is not None:
            lo = xp.maximum(lo, diag - self.left)
        if self.right is not None:
            hi = xp.minimum(hi, diag + self.right + 1)
        hi = xp.where(i < self.q_lengths[:, None], xp.maximum(hi, lo), lo)
        return lo, hi

    def row_intervals(self, keys):
        """(lo, hi) int32 [batch, len(keys)]: key j is seen by exactly the rows lo <= i < hi."""
        xp = array_module(keys, self.offset, self.q_lengths, self.kv_lengths)
        j = keys[None, :]
        lo = xp.zeros((self.offset.shape[0], keys.shape[0]), np.int32)
        hi = xp.broadcast_to(self.q_lengths[:, None], lo.shape)
        if self.right is not None:  # j <= i + off + right
            lo = xp.maximum(lo, j - self.offset[:, None] - self.right)
        if self.left is not None:  # i + off - left <= j
            hi = xp.minimum(hi, j - self.offset[:, None] + self.left + 1)
        hi = xp.where(j < self.kv_lengths[:, None], xp.maximum(hi, lo), lo)
        return lo, hi


def whole_matrix(batch, q_len, kv_len, q_lengths, kv_lengths, *, is_causal, window_left,
                 window_right, bottom_right):
    """Boolean mask [batch, q_len, kv_len]: may query row i see key j under the band rules
    (lengths, causal, window; docs/design.md#visibility)? Also returns the per-batch valid-row
    mask [batch, q_len] (i < q_len_b)."""
    band = Band(batch, q_len, kv_len, q_lengths, kv_lengths,
                is_causal=is_causal, window_left=window_left, window_right=window_right,
                bottom_right=bottom_right)
    rows = jnp.arange(q_len, dtype=jnp.int32)
    mask = band.mask(rows, jnp.arange(kv_len, dtype=jnp.int32))
    return mask, rows[None, :] < band.q_lengths[:, None]
