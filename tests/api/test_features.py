"""bias, mask, segment ids, logits soft cap and sinks (docs/design.md#scores) against the float64
oracle, and against jax.nn.dot_product_attention wherever jax.nn defines the same thing.

Run on the xla implementation (dense and, with shrunken blocks, blockwise); the fused kernels'
features: tests/fused/test_kernels_features_fwd.py (forward) and
tests/fused/test_kernels_features_bwd.py (gradients).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import tolerance
from api_helpers import make_inputs, needs_emulator, normal, run
from jax_flash_metal import flash_attention, reference_attention
from jax_flash_metal.lowering import dispatch

B, TQ, TK, H, HKV, D = 2, 9, 11, 4, 2, 16


def check(q, k, v, do, g, names=None, **kw):
    """run() matches the oracle on every output (docs/testing.md#tolerances)."""
    got = run(q, k, v, do, g, **dict(kw))
    names = names or tuple(got)
    return got, tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=names, **kw)


def inputs(seed=0, batch=B, q_len=TQ, kv_len=TK, heads=H, kv_heads=HKV, dtype=jnp.float32):
    return make_inputs(seed, batch, q_len, kv_len, heads, kv_heads, D, dtype)


MASK_SHAPES = [(TK,), (TQ, TK), (B, 1, 1, TK), (1, H, TQ, 1), (B, H, TQ, TK), (1, 1, 1, 1)]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_mask_broadcast_shapes(blocks, shape):
    """Every broadcast shape, with rows that see nothing (O = 0, LSE = -inf, no NaN)."""
    q, k, v, do, g = inputs(1)
    rng = np.random.default_rng(2)
    mask = rng.random(shape) > 0.4
    if len(shape) >= 2 and shape[-2] == TQ:
        mask[..., 3, :] = False  # a query row that sees nothing
    got, want = check(q, k, v, do, g, mask=mask, is_causal=True)
    empty = np.isneginf(want["lse"])
    assert empty.any() or shape != (TQ, TK)
    assert np.all(np.asarray(got["o"]).transpose(0, 2, 1, 3)[empty] == 0)
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(np.asarray(got[name])).all(), name


BIAS_SHAPES = [(), (TK,), (1, H, 1, TK), (B, 1, TQ, 1), (H, TQ, TK), (B, H, TQ, TK)]


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=str)
def test_bias_broadcast_shapes_and_gradient(blocks, shape):
    """dbias is summed over the broadcast axes and has the bias's own shape."""
    q, k, v, do, g = inputs(3)
    bias = np.asarray(normal(np.random.default_rng(4), shape, jnp.float32))
    got, _ = check(q, k, v, do, g, bias=bias, local_window_size=(5, 2),
                   query_seq_lengths=np.array([9, 6]), key_value_seq_lengths=np.array([11, 4]))
    assert got["dbias"].shape == shape and got["dbias"].dtype == jnp.float32


def test_minus_inf_bias_is_a_false_mask(blocks):
    """An additive -inf hides a key exactly as mask=False (never NaN, an all -inf row is an
    empty row); +inf or NaN in the bias propagates to that row."""
    q, k, v, do, g = inputs(5)
    rng = np.random.default_rng(6)
    mask = rng.random((B, 1, TQ, TK)) > 0.5
    mask[1, 0, 2] = False
    bias = np.where(mask, 0.0, -np.inf).astype(np.float32)
    by_bias = run(q, k, v, do, g, bias=bias)
    by_mask = run(q, k, v, do, g, mask=mask)
    for name in ("o", "lse", "dq", "dk", "dv"):
        np.testing.assert_allclose(np.asarray(by_bias[name]), np.asarray(by_mask[name]),
                                   rtol=1e-6, atol=1e-6)
    assert np.isneginf(np.asarray(by_bias["lse"])[1, :, 2]).all()
    assert np.isfinite(np.asarray(by_bias["dbias"])).all()
    for bad in (np.inf, np.nan):
        poisoned = np.zeros((TQ, TK), np.float32)
        poisoned[4, 1] = bad
        o = flash_attention(q, k, v, poisoned, implementation="xla")
        assert not np.isfinite(np.asarray(o)[:, 4]).any()
        assert np.isfinite(np.delete(np.asarray(o), 4, axis=1)).all()


def test_packed_segments_with_causal(blocks):
    """Packed sequences: visible iff same segment (and causal), padding segment 0 unmatched."""
    q, k, v, do, g = inputs(7, q_len=12, kv_len=12)
    ids = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3], [1, 1, 1, 1, 1, 1, 2, 2, 2, 9, 9, 9]])
    kv_ids = ids.copy()
    kv_ids[1, 9:] = 0  # padding keys no query matches: rows 9..11 of batch 1 are empty
    got, want = check(q, k, v, do, g, query_segment_ids=ids, key_value_segment_ids=kv_ids,
                      is_causal=True)
    assert np.isneginf(want["lse"][1, :, 9:]).all()
    assert np.all(np.asarray(got["o"])[1, 9:] == 0)


def test_segments_that_never_meet(blocks):
    """No query shares a segment with any key: O = 0, LSE = -inf, all gradients 0."""
    q, k, v, do, g = inputs(8)
    got, _ = check(q, k, v, do, g, query_segment_ids=np.ones((B, TQ), np.int32),
                   key_value_segment_ids=np.full((B, TK), 2, np.int32))
    assert np.all(np.asarray(got["o"]) == 0) and np.isneginf(np.asarray(got["lse"])).all()
    for name in ("dq", "dk", "dv"):
        assert np.all(np.asarray(got[name]) == 0), name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_soft_cap_with_large_logits(blocks, dtype):
    """Inputs 8 N(0,1): raw scores reach the hundreds, the cap bounds them to +-30."""
    q, k, v, do, g = inputs(9, dtype=dtype)
    q, k = q * 8, k * 8
    check(q, k, v, do, g, names=tolerance.OUTPUTS, logits_soft_cap=30.0, is_causal=True)
    capped = run(q, k, v, do, g, logits_soft_cap=30.0)
    assert not np.allclose(np.asarray(capped["o"], np.float32),
                           np.asarray(run(q, k, v, do, g)["o"], np.float32), atol=1e-2)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=str)
def test_soft_cap_keeps_non_finite_queries_nan(implementation, blocks, bad):
    """A query with an Inf entry propagates NaN (docs/design.md#empty-rows-and-non-finite-inputs)
    even though the cap would squash its infinite scores to finite ones."""
    q, k, v, do, g = inputs(12)
    q = q.at[1, 3, 2, 0].set(bad)
    got, _ = check(q, k, v, do, g, names=tolerance.OUTPUTS, logits_soft_cap=5.0,
                   implementation=implementation)
    assert np.isnan(np.asarray(got["o"])[1, 3, 2]).all()


def test_sinks_with_empty_rows(blocks):
    """Sinks join every denominator; empty rows (a zero kv length, rows past q_len, a window
    that misses) output 0 with LSE = the sink; dsinks matches the oracle."""
    q, k, v, do, g = inputs(10)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    got, want = check(q, k, v, do, g, sinks=sinks, query_seq_lengths=np.array([9, 5]),
                      key_value_seq_lengths=np.array([0, 11]), is_causal=True,
                      causal_alignment="bottom_right")
    lse = np.asarray(got["lse"])
    np.testing.assert_array_equal(lse[0], np.broadcast_to(sinks[:, None], (H, TQ)))
    np.testing.assert_array_equal(lse[1, :, 5:], np.broadcast_to(sinks[:, None], (H, TQ - 5)))
    assert np.all(np.asarray(got["o"])[0] == 0) and np.all(np.asarray(got["o"])[1, 5:] == 0)


COMBINED = [
    dict(is_causal=True),
    dict(local_window_size=(3, 1), causal_alignment="bottom_right"),
    dict(is_causal=True, query_seq_lengths=np.array([7, 9]),
         key_value_seq_lengths=np.array([11, 5]), causal_alignment="bottom_right"),
]


@pytest.mark.parametrize("band", COMBINED, ids=["causal", "window", "lengths"])
def test_everything_combined(blocks, band):
    """Mask, bias, segments, soft cap and sinks at once, with GQA and the band rules."""
    q, k, v, do, g = inputs(11)
    rng = np.random.default_rng(12)
    features = dict(
        bias=np.asarray(normal(rng, (1, H, TQ, TK), jnp.float32)),
        mask=rng.random((B, 1, TQ, TK)) > 0.2,
        query_segment_ids=np.sort(rng.integers(0, 3, (B, TQ)), axis=1),
        key_value_segment_ids=np.sort(rng.integers(0, 3, (B, TK)), axis=1),
        logits_soft_cap=4.0, sinks=np.asarray(normal(rng, (H,), jnp.float32)))
    check(q, k, v, do, g, **features, **band)


def test_long_sequences_with_real_blocks():
    """The real block sizes (128) with segments, bias and sinks across several blocks."""
    q, k, v, do, g = inputs(13, batch=1, q_len=300, kv_len=270, heads=2, kv_heads=1)
    rng = np.random.default_rng(14)
    check(q, k, v, do, g, bias=np.asarray(normal(rng, (1, 2, 1, 270), jnp.float32)),
          query_segment_ids=np.repeat(np.arange(3), 100)[None],
          key_value_segment_ids=np.repeat(np.arange(3), 90)[None], sinks=np.zeros(2, np.float32),
          is_causal=True, causal_alignment="bottom_right")


def test_equals_jax_nn():
    """Where jax.nn.dot_product_attention defines the same thing (every row sees a key):
    positional bias and mask, rank-3 inputs, a concrete JAX scalar scale, lengths, window."""
    q, k, v, _, _ = inputs(15)
    rng = np.random.default_rng(16)
    bias = jnp.asarray(normal(rng, (1, H, TQ, TK), jnp.float32))
    mask = rng.random((B, 1, TQ, TK)) > 0.3
    mask[..., 0] = True  # key 0 is visible to every causal row
    kw = dict(scale=jnp.float32(0.3), is_causal=True, local_window_size=(6, 0),
              query_seq_lengths=jnp.array([9, 9], jnp.int32),
              key_value_seq_lengths=jnp.array([11, 8], jnp.int32))
    want = jax.nn.dot_product_attention(q, k, v, bias, mask, **kw)
    np.testing.assert_allclose(flash_attention(q, k, v, bias, mask, **kw), want, atol=2e-6)
    np.testing.assert_allclose(reference_attention(q, k, v, bias, mask, **kw), want, atol=2e-6)
    # Rank 3 (no batch axis): output rank 3, LSE [heads, q_len].
    out, lse = flash_attention(q[0], k[0], v[0], bias[0], mask[0], scale=0.3, return_lse=True)
    np.testing.assert_allclose(out, jax.nn.dot_product_attention(
        q[0], k[0], v[0], bias[0], mask[0], scale=0.3), atol=2e-6)
    assert out.shape == q[0].shape and lse.shape == (H, TQ)


@pytest.mark.parametrize("fill", [-1e9, float(jnp.finfo(jnp.float32).min)], ids=str)
def test_large_negative_additive_masks_equal_jax_nn(implementation, blocks, fill):
    """The PyTorch / jax.nn idiom of an additive mask (-1e9 or finfo.min where hidden): O equals
    jax.nn's, including a row hidden everywhere (uniform weights, as jax.nn; only -inf hides), and
    the gradients of the rows that see a key do too."""
    q, k, v, _, _ = inputs(23)
    keep = np.tril(np.ones((TQ, TK), bool), 1)
    keep[4] = False
    bias = jnp.where(jnp.asarray(keep), 0.0, jnp.float32(fill))[None, None]
    out = flash_attention(q, k, v, bias, implementation=implementation)
    np.testing.assert_allclose(out, jax.nn.dot_product_attention(q, k, v, bias), atol=2e-5)

    seen = jnp.asarray(keep.any(axis=1))[None, :, None, None]  # the loss skips row 4

    def loss(attention):
        return lambda q, k, v: jnp.sum(jnp.where(seen, jnp.sin(attention(q, k, v, bias)), 0.0))

    got = jax.grad(loss(functools.partial(flash_attention, implementation=implementation)),
                   (0, 1, 2))(q, k, v)
    want = jax.grad(loss(jax.nn.dot_product_attention), (0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(a, b, atol=5e-5, err_msg=f"d{name}")


def test_check_grads_through_bias_and_sinks(implementation):
    """Finite differences through every differentiable input, with the soft cap and causal
    (float32: eps 1e-2 keeps the rounding error of the differences near 1e-4, so a 5e-3
    tolerance still catches a wrong factor such as a missing cap derivative)."""
    q, k, v, _, _ = inputs(17, batch=1, q_len=5, kv_len=6, heads=2, kv_heads=1)
    bias = jnp.asarray(normal(np.random.default_rng(18), (1, 2, 5, 1), jnp.float32))

    def f(q, k, v, bias, sinks):
        return flash_attention(q, k, v, bias, is_causal=True, sinks=sinks, logits_soft_cap=3.0,
                               implementation=implementation, return_lse=True)

    check_grads(f, (q, k, v, bias, jnp.array([0.3, -0.2])), order=1, modes=["rev"], eps=1e-2,
                atol=5e-3, rtol=5e-3)


def test_vmap_over_bias_mask_and_sinks():
    """A vmapped bias (batch axis 1, expanded under the fold), mask and per-example sinks
    (a sequential map) give each example's own result and bias gradient."""
    q, k, v, _, _ = inputs(19)
    rng = np.random.default_rng(20)
    bias = jnp.asarray(normal(rng, (3, 1, H, 1, TK), jnp.float32))
    sinks = jnp.asarray(normal(rng, (3, H), jnp.float32))
    mask = jnp.asarray(rng.random((TQ, TK)) > 0.3)

    def f(bias, sinks):
        return flash_attention(q, k, v, bias, mask, sinks=sinks, implementation="xla")

    def loss(fn):
        return lambda b, s: jnp.sum(fn(b, s) * v[:, :TQ, :1].repeat(H, 2))

    out = jax.vmap(f)(bias, sinks)
    dbias = jax.vmap(jax.grad(loss(f)))(bias, sinks)
    for i in range(3):
        np.testing.assert_allclose(out[i], f(bias[i], sinks[i]), atol=1e-6)
        np.testing.assert_allclose(dbias[i], jax.grad(loss(f))(bias[i], sinks[i]), atol=1e-5)


def test_memory_linear_with_segment_ids():
    """Compiled forward + backward with segment ids (and a kv-position bias) at length 16384
    keep no [T, T] temporary: 4x the length costs at most about 4x the temporaries."""
    def temp_bytes(length):
        x = jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32)
        ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
        bias = jax.ShapeDtypeStruct((length,), jnp.float32)

        def f(q, k, v, ids, bias):
            return jax.grad(lambda q, k, v, bias: flash_attention(
                q, k, v, bias, query_segment_ids=ids, key_value_segment_ids=ids,
                is_causal=True, implementation="xla").sum(), argnums=(0, 1, 2, 3))(q, k, v, bias)

        return jax.jit(f).lower(x, x, x, ids, bias).compile().memory_analysis().temp_size_in_bytes

    short, long = temp_bytes(4096), temp_bytes(16384)
    assert long <= 5 * short, (short, long)
    assert long < 16384 * 16384 * 4 / 16, long


FEATURE_CALLS = [  # (feature name in the error, arguments after q, k, v)
    ("bias", dict(bias=jnp.zeros((5, 5)))),
    ("mask", dict(mask=jnp.ones((5, 5), bool))),
    ("segment ids", dict(query_segment_ids=jnp.zeros((1, 5), int),
                         key_value_segment_ids=jnp.zeros((1, 5), int))),
    ("logits_soft_cap", dict(logits_soft_cap=5.0)),
    ("sinks", dict(sinks=jnp.zeros(2))),
]


@needs_emulator
@pytest.mark.parametrize("feature,kw", FEATURE_CALLS, ids=[f for f, _ in FEATURE_CALLS])
def test_fused_implementations_take_feature_calls(monkeypatch, feature, kw):
    """implementation=None with a fused implementation preferred: forward and backward of a
    feature call lower to its kernels (both directions implement every feature) and match the
    reference."""
    del feature  # the id
    monkeypatch.delenv("JAX_FLASH_METAL_IMPLEMENTATION", raising=False)
    monkeypatch.setattr(dispatch, "_PREFERENCE", ("emulator",))
    q = jnp.asarray(normal(np.random.default_rng(21), (1, 5, 2, 16), jnp.float32))

    def grad(fn=flash_attention):
        return jax.jit(jax.grad(lambda q: fn(q, q, q, **kw).sum()))

    text = grad().lower(q).as_text()
    assert "jax_flash_metal_attention_fwd" in text and "jax_flash_metal_attention_bwd" in text
    np.testing.assert_allclose(grad()(q), grad(reference_attention)(q), rtol=1e-4, atol=1e-5)
