"""Every Metal function-constant set the host can pick (shaders/function_constants.h), as calls:
the sets are generated from the host's own per-stage masks (``_ext.stage_function_constants``),
and each set becomes the flash_attention call that uses exactly its features, checked against
the float64 oracle. tests/fused/test_function_constants.py checks the dispatched sets; the
sanitizer runs every set (tests/fused/test_sanitizer_kernels.py).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import oracle
import tolerance
from api_helpers import normal, run
from jax_flash_metal import _ext, flash_attention
from jax_flash_metal.dropout import dropout_mask

NAMES = _ext.function_constant_names()
BIT = {name: 1 << n for n, name in enumerate(NAMES)}
B, H, HKV, D = 2, 4, 2, 16
KV_LEN = 40
KEY = jax.random.key(7)


def subsets(mask):
    """Every constant set within `mask` (the bits of the host's list), smallest first."""
    bits = [1 << n for n in range(32) if mask >> n & 1]
    return sorted(sum(c) for r in range(len(bits) + 1) for c in itertools.combinations(bits, r))


def label(constants):
    return "+".join(n for n in NAMES if constants & BIT[n]) or "plain"


# The prefill sets (the tiled forward and the backward read every constant) and the decode's
# (q_len 1: pass 1 and the combine).
PREFILL = subsets(_ext.stage_function_constants("fwd"))
DECODE = subsets(_ext.stage_function_constants("decode_partial")
                 | _ext.stage_function_constants("decode_combine"))


def call_arguments(constants, q_len, kv_len, rng):
    """flash_attention keyword arguments that use exactly the features of `constants`."""
    kw = {}
    if constants & BIT["causal"]:
        kw.update(is_causal=True, causal_alignment="bottom_right")
    if constants & BIT["lengths"]:
        kw.update(query_seq_lengths=np.array([q_len, max(q_len - 3, 1)], np.int32),
                  key_value_seq_lengths=np.array([kv_len, kv_len - 5], np.int32))
    if constants & BIT["score_features"]:
        kw["bias"] = np.asarray(normal(rng, (1, H, q_len, kv_len), jnp.float32))
    if constants & BIT["sinks"]:
        kw["sinks"] = np.asarray(normal(rng, (H,), jnp.float32))
    if constants & BIT["dropout"]:
        kw.update(dropout_rate=0.5, dropout_rng=KEY)
    return kw


def _oracle_arguments(constants, kw, q_len, kv_len):
    out = {n: x for n, x in kw.items() if n not in ("dropout_rate", "dropout_rng")}
    if constants & BIT["dropout"]:
        out.update(dropout_rate=0.5, dropout_mask=np.asarray(
            dropout_mask(KEY, (B, H, q_len, kv_len), 0.5)))
    return out


def paged_case(constants, q, kv_len, rng, kw):
    """Forward on a paged cache (forward only; pages of 16 keys in shuffled order, key lengths
    always given, as a paged call needs them) against the oracle on the gathered cache."""
    page, pages = 16, -(-kv_len // 16)
    lengths = kw.pop("key_value_seq_lengths", np.array([pages * page] * B, np.int32))
    table = rng.permutation(B * pages).reshape(B, pages).astype(np.int32)
    k = np.asarray(normal(rng, (B * pages, page, HKV, D), jnp.float32))
    v = np.asarray(normal(rng, (B * pages, page, HKV, D), jnp.float32))
    k_flat, v_flat = (x[table].reshape(B, pages * page, HKV, D) for x in (k, v))
    if "bias" in kw:
        kw["bias"] = np.pad(kw["bias"], ((0, 0), (0, 0), (0, 0), (0, pages * page - kv_len)))
    call_kw = dict(kw, key_value_seq_lengths=lengths)  # a paged call always has them
    o, lse = flash_attention(q, k, v, page_table=table, implementation="emulator",
                             return_lse=True, **call_kw)
    want_o, want_lse = oracle.attention(
        q, k_flat, v_flat, **_oracle_arguments(constants, call_kw, q.shape[1], pages * page))
    tolerance.assert_matches_oracle("o", o, want_o)
    tolerance.assert_matches_oracle("lse", lse, want_lse)


def run_constant_set(constants, q_len):
    """The emulator call using exactly the features of `constants` (B, H, HKV, D above; KV_LEN
    keys), float32: O, LSE and, without paging, dQ, dK, dV, dbias, dsinks against the oracle."""
    rng = np.random.default_rng(constants)
    kw = call_arguments(constants, q_len, KV_LEN, rng)
    q = normal(rng, (B, q_len, H, D), jnp.float32)
    if constants & BIT["paged"]:
        paged_case(constants, q, KV_LEN, rng, kw)
        return
    k, v = (normal(rng, (B, KV_LEN, HKV, D), jnp.float32) for _ in range(2))
    do = normal(rng, (B, q_len, H, D), jnp.float32)
    g = jnp.zeros((B, H, q_len), jnp.float32)
    got = run(q, k, v, do, g, implementation="emulator", **kw)
    tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=tuple(got),
                                      **_oracle_arguments(constants, kw, q_len, KV_LEN))
