"""Attention dropout's keep mask, one construction for every implementation
(docs/design.md#dropout).

``M[b, n, i, j]`` (True = keep) is a pure function of the key's two 32-bit words, the batch
index b, the query head n, the query position i, the key position j and the rate: word
``j % 4`` of Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011) with the counter ``(j // 4, i, n, b)`` and the key's two words as its key, kept iff that
word is >= ``threshold(rate)``. So a sub-shape's mask is the slice of a larger one, and no
padding, block schedule or kernel changes it.

The primitives carry the key as the ``dropout`` operand, uint32 [B, H, WORDS]: per (batch row,
query head) the key's words, the (b, n) its counter uses and the global positions of the call's
rows and keys (``operand``, ``at_positions``): local query row r is position
``q_first + q_stride * r`` and local key c is ``k_first + k_stride * c``, so rows that vmap folds
into the batch axis, shards of batch and heads, and a sequence split into pieces (each device's
slice of a sequence axis) keep their own key and indices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import arguments, mulhi

_U32 = jnp.uint32
# Philox-4x32's multipliers and key increments (Weyl constants), as in Random123.
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
# The dropout operand's words per (batch row, query head), in order.
FIELDS = ("key0", "key1", "b", "n", "q_first", "q_stride", "k_first", "k_stride")
WORDS = len(FIELDS)


def philox4x32(counter, key):
    """Philox-4x32-10: four uint32 arrays (the counter words, broadcastable) and two (the key
    words) -> the four uint32 output words, broadcast together."""
    c0, c1, c2, c3 = (jnp.asarray(c, _U32) for c in counter)
    k0, k1 = (jnp.asarray(k, _U32) for k in key)
    for r in range(ROUNDS):
        if r:
            k0, k1 = k0 + _U32(_W0), k1 + _U32(_W1)
        hi0, lo0 = mulhi.high_and_low(_M0, c0)
        hi1, lo1 = mulhi.high_and_low(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return jnp.broadcast_arrays(c0, c1, c2, c3)


def threshold(rate: float) -> int:
    """floor(rate * 2**32), exact (a float64 times a power of two): a word below it drops its
    entry, so the keep probability is 1 - threshold / 2**32, within 2**-32 of 1 - rate."""
    return math.floor(rate * 2.0 ** 32)


def keep_scale(rate: float) -> float:
    """The weight of a kept entry, 1 / (1 - rate), rounded once to float32."""
    return float(np.float32(1.0 / (1.0 - rate)))


def keep(seeds, rows, key_start, num_keys: int, rate: float, *, groups: bool,
         aligned: bool = False):
    """bool [..., R, num_keys]: the keep mask of the local query rows ``rows`` (int [R]) and
    local keys ``key_start + arange(num_keys)`` for the ``dropout`` operand's entries ``seeds``
    uint32 [..., WORDS], at the global positions the entries map them to. ``key_start``: an
    int, or a traced int32 (``aligned``: known to be a multiple of 4, else one more group of 4
    keys is generated and sliced). ``groups`` (static): the entries' keys are at unit stride
    from a multiple of 4 (the primitives' ``dropout_key_groups``), so local groups of 4 keys
    are global ones and take one Philox call each; otherwise every key takes its own call.
    Static, not read from the entries: a branch on them would run per tile, and on a GPU a
    conditional reads its predicate back to the host and stores its result."""
    k0, k1, b, n, q_first, q_stride, k_first, k_stride = (seeds[..., w, None, None]
                                                          for w in range(WORDS))
    rows = q_first + q_stride * jnp.asarray(rows).astype(_U32)[:, None]
    cut = _U32(threshold(rate))
    if groups:
        return _grouped(key_start, num_keys, aligned, cut, rows, k_first, n, b, (k0, k1))
    return _per_key(key_start, num_keys, cut, rows, k_first, k_stride, n, b, (k0, k1))


def _grouped(key_start, num_keys, aligned, cut, rows, k_first, n, b, key):
    static = isinstance(key_start, int)
    offset = key_start % 4 if static else 0
    exact = static or aligned
    groups = -(-(offset + num_keys) // 4) + (0 if exact else 1)
    first = jnp.asarray(key_start, jnp.int32) // 4
    counter0 = k_first // 4 + (first + jnp.arange(groups, dtype=jnp.int32)).astype(_U32)
    words = philox4x32((counter0, rows, n, b), key)
    # One Philox call gives the words of 4 keys: their 4 keep bits are packed into one byte
    # behind a barrier, so the 10-round chain runs once per group of 4 (fused into the unpacking
    # below, XLA evaluated it per key: docs/benchmarks.md#why-the-xla-schedules), and what is
    # stored between the two is a byte per 4 keys (stacking 4 bool arrays made XLA:GPU store the
    # float32 weights).
    bits = sum((w >= cut).astype(jnp.uint8) << jnp.uint8(i) for i, w in enumerate(words))
    bits = jax.lax.optimization_barrier(bits)
    shifts = jnp.arange(4, dtype=jnp.uint8)
    kept = ((bits[..., None] >> shifts) & jnp.uint8(1)).astype(bool)
    kept = kept.reshape(kept.shape[:-2] + (groups * 4,))
    if exact:
        return kept[..., offset:offset + num_keys]
    return jax.lax.dynamic_slice_in_dim(kept, jnp.asarray(key_start, jnp.int32) % 4, num_keys,
                                        axis=-1)


def _per_key(key_start, num_keys, cut, rows, k_first, k_stride, n, b, key):
    local = (jnp.asarray(key_start, jnp.int32) + jnp.arange(num_keys, dtype=jnp.int32))
    keys = k_first + k_stride * local.astype(_U32)
    words = philox4x32((keys // 4, rows, n, b), key)
    word = keys % 4
    return jnp.where(word < 2, jnp.where(word == 0, words[0], words[1]),
                     jnp.where(word == 2, words[2], words[3])) >= cut


def weights(seeds, rows, key_start, num_keys, rate, *, groups, aligned=False):
    """float32 M / (1 - rate) of ``keep``'s block: the factor dropout puts on P."""
    return jnp.where(keep(seeds, rows, key_start, num_keys, rate, groups=groups,
                          aligned=aligned),
                     jnp.float32(keep_scale(rate)), jnp.float32(0.0))


def check_rate(dropout_rate):
    """``dropout_rate`` as a float in [0, 1); TypeError / ValueError naming it otherwise."""
    rate = arguments.static_real(dropout_rate, "dropout_rate")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
    return rate


def _key_words(dropout_rng):
    """The key's data, uint32 [2]: a typed ``jax.random.key`` (threefry) or a legacy uint32 [2]
    key, possibly traced; TypeError / ValueError naming ``dropout_rng`` otherwise."""
    rng = arguments.as_array(dropout_rng, "dropout_rng")
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(f"dropout_rng must be one key (shape ()), got a key array of shape "
                             f"{rng.shape}; vmap over keys instead")
        rng = jax.random.key_data(rng)
    if rng.dtype != jnp.uint32 or rng.shape != (2,):
        raise TypeError(f"dropout_rng must be a jax.random.key with two uint32 words of key "
                        f"data (the default threefry implementation) or a legacy uint32 [2] "
                        f"key, got {rng.dtype}{list(rng.shape)}")
    return rng


def operand(dropout_rate, dropout_rng, batch, num_heads, broadcast=False):
    """(rate float in [0, 1), the primitives' ``dropout`` operand uint32 [batch, num_heads,
    WORDS] or None).

    The operand holds, per (batch row, query head), the key's two words, the b and n of the
    mask's counter and the call's positions from 0 at stride 1 (``at_positions`` moves them);
    ``broadcast`` gives every row b = n = 0 (one mask for all, Flax's ``broadcast_dropout``).
    None when the rate is 0 (a key is then checked and unused)."""
    rate = check_rate(dropout_rate)
    if dropout_rng is None:
        if rate > 0.0:
            raise ValueError(f"dropout_rate={rate} needs dropout_rng, a JAX PRNG key")
        return rate, None
    rng = _key_words(dropout_rng)
    if rate == 0.0:
        return rate, None

    def index(axis):
        if broadcast:
            return jnp.zeros((batch, num_heads), jnp.uint32)
        return jax.lax.broadcasted_iota(jnp.uint32, (batch, num_heads), axis)

    words = [jnp.broadcast_to(rng[w], (batch, num_heads)) for w in range(2)]
    return rate, at_positions(jnp.stack(words + [index(0), index(1)], axis=-1), 0, 1, 0, 1)


def at_positions(seeds, q_first, q_stride, k_first, k_stride):
    """``seeds`` (uint32 [..., 4 or WORDS], the first 4 words of ``FIELDS``) mapping local
    query row r to global position ``q_first + q_stride * r`` and local key c to
    ``k_first + k_stride * c`` (non-negative ints, possibly traced)."""
    shape = seeds.shape[:-1]
    maps = [jnp.broadcast_to(jnp.asarray(x).astype(_U32), shape)
            for x in (q_first, q_stride, k_first, k_stride)]
    return jnp.concatenate([seeds[..., :4], jnp.stack(maps, axis=-1)], axis=-1)
