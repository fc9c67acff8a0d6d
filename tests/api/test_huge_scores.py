"""Scores at huge offsets: additive masks of any magnitude (0 to finfo(float32).min, and -inf)
over whole rows, half rows and single keys, with and without sinks (also at the offset),
causal, grouped-query attention and segment ids, in float32, float16 and bfloat16, on the xla
implementation (dense and blockwise) and the emulated kernels (tiled forward and split-KV
decode), against the float64 oracle with cotangents on every row and on the LSE.

The softmax and its gradients are those of the float32 scores (scale q.k + bias, rounded to
float32; tests/helpers/oracle.py forms them so): where every key of a row sits at -1e9, jax.nn's
softmax is uniform and its gradients are ordinary, and the residuals the backward recomputes P
from (the row max and log l, kept apart) must give exactly that. q and k are drawn on a coarse
dyadic grid, so q.k is exact in every dtype and summation order and each implementation forms
the very scores the oracle does; v, dO and the LSE cotangent are Gaussian.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import tolerance
from api_helpers import DTYPES, needs_emulator, normal, run
from jax_flash_metal import flash_attention

IMPLEMENTATIONS = ["xla", pytest.param("emulator", marks=needs_emulator)]
OFFSETS = (0.0, -1e4, -1e6, -1e9, -1e30, float(np.finfo(np.float32).min), -np.inf)


def dyadic(rng, shape, dtype):
    """Entries of {-1, -1/2, 0, 1/2, 1}: with head dim 16 (scale 1/4) every score is a multiple
    of 1/16 below 4 in magnitude, exact in every dtype and order of summation."""
    return jnp.asarray(rng.integers(-2, 3, shape).astype(np.float32) / 2, dtype)


def inputs(dtype, batch, q_len, kv_len, heads, kv_heads, seed=0):
    """q, k (dyadic), v, dO (Gaussian) in dtype; g_lse float32 Gaussian on every row."""
    rng = np.random.default_rng(seed)
    q = dyadic(rng, (batch, q_len, heads, 16), dtype)
    k = dyadic(rng, (batch, kv_len, kv_heads, 16), dtype)
    v = normal(rng, (batch, kv_len, kv_heads, 16), dtype)
    do = normal(rng, (batch, q_len, heads, 16), dtype)
    return q, k, v, do, normal(rng, (batch, heads, q_len), jnp.float32)


def offset_bias(offsets, heads, q_len, kv_len):
    """float32 [B, H, Tq, Tkv], B = len(offsets): 0, but in batch entry b row 1 entirely at
    offsets[b], the even keys of row 3 and key 2 of row 5 (with one query row, each head gets
    one of the three patterns instead)."""
    bias = np.zeros((len(offsets), heads, q_len, kv_len), np.float32)
    for b, offset in enumerate(offsets):
        if q_len == 1:
            for h in range(heads):
                bias[b, h, 0, [slice(None), slice(0, None, 2), 2][h % 3]] = offset
        else:
            bias[b, :, 1, :] = offset
            bias[b, :, 3, ::2] = offset
            bias[b, :, 5, 2] = offset
    return jnp.asarray(bias)


# The fused kernels' score limit (JFM_SCORE_LIMIT, FLT_MAX / 4): a row whose every score is
# below -SCORE_LIMIT (a whole row at finfo.min) gets its softmax and gradients right, but its
# LSE is the saturated one (docs/api.md#limitations).
SCORE_LIMIT = np.float32(8.50705917e37)


def check(got, q, k, v, do, g, saturates=False, **kw):
    """Every output of run() against the oracle: O and the gradients with the tolerances of
    tests/helpers/tolerance.py; the LSE row by row (rows differ by up to 38 orders of magnitude, so
    a tolerance relative to the largest would say nothing) within the float32 tolerance of its own
    magnitude, infinities exactly. With ``saturates`` (the fused kernels) the LSE of a row whose
    oracle LSE is below -SCORE_LIMIT is -SCORE_LIMIT exactly instead."""
    kw = {n: (np.asarray(x) if isinstance(x, jax.Array) else x) for n, x in kw.items()}
    want = tolerance.assert_all_match_oracle(got, q, k, v, do, g,
                                             names=tuple(n for n in got if n != "lse"), **kw)
    lse, want_lse = np.asarray(got["lse"], np.float64), want["lse"]
    beyond = np.isfinite(want_lse) & (want_lse < -SCORE_LIMIT) & saturates
    assert (lse[beyond] == -SCORE_LIMIT).all()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    ordinary = np.isfinite(want_lse) & ~beyond
    np.testing.assert_allclose(lse[ordinary], want_lse[ordinary],
                               rtol=tolerance.FLOAT32_RTOL["lse"], atol=1e-6)


TQ, TK, H, HKV = 9, 11, 4, 2
SINKS = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
VARIANTS = {
    "plain": dict(),
    "sinks": dict(sinks=SINKS),
    "causal-gqa-segments": dict(is_causal=True, segments=True),
}


def call_kwargs(offsets, variant, heads=H, q_len=TQ, kv_len=TK):
    """flash_attention keywords: the offsets' bias and the variant's features."""
    kw = dict(variant, bias=offset_bias(offsets, heads, q_len, kv_len))
    if kw.pop("segments", False):
        ids = np.tile([0, 0, 1], max(q_len, kv_len))[None].repeat(len(offsets), 0)
        kw["query_segment_ids"] = jnp.asarray(ids[:, :q_len])
        kw["key_value_segment_ids"] = jnp.asarray(ids[:, :kv_len])
    return kw


# ---- the grid: every offset (one per batch entry), each variant, both implementations -------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_xla_float32(blocks, variant):
    q, k, v, do, g = inputs(jnp.float32, len(OFFSETS), TQ, TK, H, HKV, seed=1)
    kw = call_kwargs(OFFSETS, VARIANTS[variant])
    check(run(q, k, v, do, g, implementation="xla", **kw), q, k, v, do, g, **kw)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_xla_half_precision(blocks, dtype):
    q, k, v, do, g = inputs(DTYPES[dtype], len(OFFSETS), TQ, TK, H, HKV, seed=2)
    kw = call_kwargs(OFFSETS, VARIANTS["sinks"])
    check(run(q, k, v, do, g, implementation="xla", **kw), q, k, v, do, g, **kw)


@needs_emulator
@pytest.mark.parametrize("variant", ["sinks", "causal-gqa-segments"])
def test_emulator_float32(variant):
    q, k, v, do, g = inputs(jnp.float32, len(OFFSETS), TQ, TK, H, HKV, seed=3)
    kw = call_kwargs(OFFSETS, VARIANTS[variant])
    check(run(q, k, v, do, g, implementation="emulator", **kw), q, k, v, do, g, saturates=True,
          **kw)


@needs_emulator
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_emulator_half_precision(dtype):
    q, k, v, do, g = inputs(DTYPES[dtype], len(OFFSETS), TQ, TK, H, HKV, seed=4)
    kw = call_kwargs(OFFSETS, VARIANTS["plain"])
    check(run(q, k, v, do, g, implementation="emulator", **kw), q, k, v, do, g, saturates=True,
          **kw)


@needs_emulator
def test_emulator_decode():
    """q_len 2 against 600 keys: the split-KV decode (several splits, merged in pass 2) writes
    the residuals, the regular backward reads them."""
    from jax_flash_metal import _ext

    offsets = (-1e9, -1e30, -np.inf)
    q, k, v, do, g = inputs(jnp.float32, len(offsets), 2, 600, H, HKV, seed=5)
    assert _ext.decode_splits("f32", len(offsets), 2, 600, H, HKV, 16)[0] > 1
    kw = dict(bias=offset_bias(offsets, H, 1, 600).repeat(2, axis=2), sinks=SINKS)
    check(run(q, k, v, do, g, implementation="emulator", **kw), q, k, v, do, g, saturates=True,
          **kw)


# ---- sinks at the offset: a sink that competes with a row whose every key sits there --------

@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("offset", [-1e9, -1e30, -np.inf], ids=["-1e9", "-1e30", "-inf"])
def test_sinks_at_the_offset(impl, offset):
    """(The kernels saturate a sink beyond +-8.5e37, docs/api.md#limitations: finfo.min is left to
    the grid's rows.)"""
    q, k, v, do, g = inputs(jnp.float32, 1, TQ, TK, H, HKV, seed=8)
    kw = dict(bias=offset_bias([offset], H, TQ, TK),
              sinks=jnp.asarray([0.5, offset, -1.0, offset], jnp.float32))
    check(run(q, k, v, do, g, implementation=impl, **kw), q, k, v, do, g,
          saturates=impl == "emulator", **kw)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_sink_beyond_the_saturation(impl):
    """A sink of 1e38 (beyond the kernels' +-8.5e37) takes its head's whole weight: output 0
    there, and every gradient, dsinks included, that of the float64 oracle (never NaN)."""
    q, k, v, do, g = inputs(jnp.float32, 1, TQ, TK, H, HKV, seed=9)
    sinks = jnp.asarray([1e38, 0.5, -1.0, 2.0], jnp.float32)
    got = run(q, k, v, do, g, implementation=impl, sinks=sinks)
    tolerance.assert_all_match_oracle(got, q, k, v, do, g, sinks=np.asarray(sinks),
                                      names=("o", "dq", "dk", "dv", "dsinks"))


# ---- finite differences where the offset leaves them meaningful -----------------------------

@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("offset", [-1e9, float(np.finfo(np.float32).min), -np.inf],
                         ids=["-1e9", "finfo.min", "-inf"])
def test_check_grads_with_partly_hidden_rows(impl, offset):
    """Half rows and single keys at the offset (their weight is exactly 0 in float32), the other
    keys ordinary: finite differences in q, k, v see the same function. (A row whose every key
    sits at -1e9 has a uniform softmax whatever q and k are within a float32 ulp of 64, so
    finite differences there are 0 while the float32 scores' gradient is not.)"""
    q, k, v, _, _ = inputs(jnp.float32, 1, 6, 7, 2, 1, seed=6)
    bias = offset_bias([offset], 2, 6, 7).at[:, :, 1].set(0.0)  # no whole row at the offset

    def f(q, k, v):
        o, lse = flash_attention(q, k, v, bias, implementation=impl, return_lse=True)
        return o, jnp.where(jnp.isfinite(lse), lse, 0.0)

    check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


# ---- the table of the issue: jax.nn's gradients under a -1e9 row mask ------------------------

def assert_matches_jax_nn_under_a_row_mask(implementation):
    """Batch 1, length 40, 2 heads, head dim 16, one row masked by a bias of -1e9 (jax.nn: a
    uniform softmax there), Gaussian inputs and cotangents: O, dQ, dK, dV within 1e-3 of
    jax.nn.dot_product_attention's (float32)."""
    rng = np.random.default_rng(7)
    q, k, v, do = (normal(rng, (1, 40, 2, 16), jnp.float32) for _ in range(4))
    bias = jnp.zeros((1, 2, 40, 40), jnp.float32).at[:, :, 5, :].set(-1e9)

    def grads(f):
        o, vjp = jax.vjp(f, q, k, v)
        return (o, *vjp(do))

    want = grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias))
    got = grads(lambda q, k, v: flash_attention(q, k, v, bias, implementation=implementation))
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert float(jnp.max(jnp.abs(a - b))) < 1e-3, name


def test_xla_matches_jax_nn_under_a_row_mask(blocks):
    assert_matches_jax_nn_under_a_row_mask("xla")


@needs_emulator
def test_fused_kernels_match_jax_nn_under_a_row_mask():
    assert_matches_jax_nn_under_a_row_mask("emulator")
