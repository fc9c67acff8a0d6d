"""The optional score features of docs/design.md#scores, per block of the score matrix: soft cap,
bias, mask and segment ids. Shared by ``reference_attention`` (one block = the whole matrix) and
the xla implementation (one block = one tile).

Layout of a block: ``[B, HKV, G, rows, keys]`` (query head ``hkv * G + g``). A bias or mask
arrives rank 4 ``[b, h, tq, tkv]`` with every axis 1 (broadcast) or full (``validation``);
``heads_layout`` splits its head axis the same way, keeping size-1 axes size 1, so a broadcast
bias is never expanded.
"""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32


def heads_layout(x, kv_heads):
    """[b, h, tq, tkv] (h = 1 or H) -> [b, HKV or 1, G or 1, tq, tkv]."""
    b, h, tq, tkv = x.shape
    if h == 1:
        return x[:, :, None]
    return x.reshape(b, kv_heads, h // kv_heads, tq, tkv)


def soft_cap(s, cap):
    """(c * tanh(s / c), d/ds of it = 1 - tanh^2) for cap c, or (s, None) without a cap."""
    if cap is None:
        return s, None
    t = jnp.tanh(s / jnp.float32(cap))
    return jnp.float32(cap) * t, 1.0 - t * t


def visible(mask=None, bias=None, q_segments=None, kv_segments=None):
    """bool, broadcastable to the block ``[B, HKV, G, rows, keys]``, or None when no feature
    hides anything: mask True, equal segment ids (int32 [B, rows] / [B, keys]) and a bias other
    than -inf (an additive -inf hides a key exactly as a False mask entry)."""
    conditions = []
    if mask is not None:
        conditions.append(mask)
    if q_segments is not None:
        conditions.append((q_segments[:, :, None] == kv_segments[:, None, :])[:, None, None])
    if bias is not None:
        conditions.append(bias != -jnp.inf)
    if not conditions:
        return None
    result = conditions[0]
    for c in conditions[1:]:
        result = result & c
    return result


def combine(a, b):
    """a & b where either may be None (= all visible)."""
    if a is None:
        return b
    return a if b is None else a & b
