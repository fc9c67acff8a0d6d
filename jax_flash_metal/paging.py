"""A paged KV cache (docs/design.md#paged-kv-cache) as the contiguous key/value the xla
implementation and ``reference_attention`` read.

Pages are ``[num_pages, page_size, HKV, D]``; ``page_table`` int32 ``[B, max_pages]`` names the
page of each block of ``page_size`` logical keys, so logical key j of batch b is
``pages[page_table[b, j // page_size], j % page_size]`` and the logical length is
``max_pages * page_size``. Only the first ``ceil(kv_len_b / page_size)`` entries of a row are
used: the others may hold anything (even out-of-range page numbers) and are never followed.
"""

from __future__ import annotations

import jax.numpy as jnp


def logical_len(pages, page_table):
    """Tkv of the logical (contiguous) cache: max_pages * page_size."""
    return page_table.shape[1] * pages.shape[1]


def gather(pages, page_table, kv_lengths):
    """The logical cache [B, max_pages * page_size, HKV, D] of ``pages``.

    Table entries past a row's last used page are replaced by page 0 before the gather, so they
    are never read; the keys they stand for lie past ``kv_lengths`` (int32 [B]), which
    attention never reads either. A used entry outside [0, num_pages) is clamped (the caller
    promises it is in range)."""
    num_pages, page_size = pages.shape[:2]
    batch, max_pages = page_table.shape
    if num_pages == 0:  # nothing to read: every length is 0 (or the cache is all padding)
        return jnp.zeros((batch, max_pages * page_size) + pages.shape[2:], pages.dtype)
    used = jnp.arange(max_pages)[None, :] * page_size < kv_lengths[:, None]
    index = jnp.clip(jnp.where(used, page_table, 0), 0, num_pages - 1)
    return pages[index].reshape((batch, max_pages * page_size) + pages.shape[2:])
