"""The backward kernels with the optional features (bias and its gradient, mask, segment ids, soft
cap; sinks through dsinks) on the emulator, end to end through flash_attention (the forward runs
the features' forward kernels): dQ, dK, dV, dbias and dsinks against the float64 oracle with
the tolerances of docs/testing.md#tolerances, alone and combined with causal/window/lengths/GQA,
across tile edges and head dims up to the split dK/dV kernels; the segment-id block skip in the
profile, bit-identical gradients under every emulator schedule, vmap with a bias gradient, and no Tq
x Tkv buffer without a bias gradient (check_grads through bias and sinks on the emulator:
tests/api/test_features.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tolerance
from api_helpers import make_inputs, normal

ext = pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal import flash_attention  # noqa: E402
from kernel_harness import needs_counting  # noqa: E402
from jax_flash_metal.tools import profile_model  # noqa: E402

B, TQ, TK, H, HKV, D = 2, 9, 11, 4, 2, 16
# Names of the differentiable feature arguments, whose gradients the VJP also returns.
DIFFERENTIABLE = ("bias", "sinks")


def run(q, k, v, do, g, **kw):
    """o, lse, dq, dk, dv and dbias / dsinks for a given bias / sinks: the emulator's forward and
    the VJP at cotangents (do, g)."""
    diff = {n: jnp.asarray(kw.pop(n)) for n in DIFFERENTIABLE if kw.get(n) is not None}

    def f(q, k, v, diff):
        return flash_attention(q, k, v, diff.get("bias"), sinks=diff.get("sinks"),
                               implementation="emulator", return_lse=True, **kw)

    (o, lse), vjp = jax.vjp(jax.jit(f), q, k, v, diff)
    dq, dk, dv, ddiff = vjp((do, g))
    out = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
    out.update({"d" + n: x for n, x in ddiff.items()})
    return out


def check(q, k, v, do, g, **kw):
    """run() against the oracle on every output; returns (got, oracle values)."""
    got = run(q, k, v, do, g, **dict(kw))
    names = tolerance.OUTPUTS + tuple("d" + n for n in DIFFERENTIABLE if kw.get(n) is not None)
    return got, tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=names, **kw)


def inputs(seed=0, batch=B, q_len=TQ, kv_len=TK, heads=H, kv_heads=HKV, head_dim=D,
           dtype=jnp.float32):
    return make_inputs(seed, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)


BIAS_SHAPES = [(), (TK,), (1, H, 1, TK), (B, 1, TQ, 1), (H, TQ, TK), (B, H, TQ, TK)]


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=str)
def test_bias_gradient_of_every_broadcast_shape(shape):
    """dbias (written by the dQ kernel in the full layout, summed by XLA over the broadcast axes)
    has the bias's shape and matches the oracle, with a window and lengths hiding entries."""
    q, k, v, do, g = inputs(3)
    bias = np.asarray(normal(np.random.default_rng(4), shape, jnp.float32))
    got, _ = check(q, k, v, do, g, bias=bias, local_window_size=(5, 2),
                   query_seq_lengths=np.array([9, 6]), key_value_seq_lengths=np.array([11, 4]))
    assert got["dbias"].shape == shape and got["dbias"].dtype == jnp.float32


@pytest.mark.parametrize("shape", [(TQ, TK), (B, 1, 1, TK), (1, H, TQ, 1), (B, H, TQ, TK)],
                         ids=str)
def test_masks_with_empty_rows(shape):
    """Masked pairs and rows that see nothing add nothing to any gradient (no NaN)."""
    q, k, v, do, g = inputs(1)
    mask = np.random.default_rng(2).random(shape) > 0.4
    if len(shape) >= 2 and shape[-2] == TQ:
        mask[..., 3, :] = False
    got, want = check(q, k, v, do, g, mask=mask, is_causal=True)
    assert np.isneginf(want["lse"]).any() or shape[-2] != TQ
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(np.asarray(got[name])).all(), name


def test_minus_inf_bias_hides_like_a_false_mask():
    """An additive -inf hides the key in the backward exactly as mask=False; its dbias is 0."""
    q, k, v, do, g = inputs(5)
    mask = np.random.default_rng(6).random((B, 1, TQ, TK)) > 0.5
    mask[1, 0, 2] = False  # an empty row
    bias = np.where(mask, 0.0, -np.inf).astype(np.float32)
    by_bias, _ = check(q, k, v, do, g, bias=bias)
    by_mask = run(q, k, v, do, g, mask=mask)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(by_bias[name], by_mask[name], rtol=1e-6, atol=1e-6)
    dbias = np.asarray(by_bias["dbias"])
    assert np.all(dbias[np.broadcast_to(~mask, dbias.shape)] == 0)


@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
def test_non_finite_bias_propagates(bad):
    """A +inf or NaN bias entry on a visible pair poisons its row's gradients and the keys that
    row sees (the oracle's NaN pattern), never silently 0; the other rows stay finite."""
    q, k, v, do, g = inputs(27)
    bias = np.array(normal(np.random.default_rng(28), (TQ, TK), jnp.float32))
    bias[4, 1] = bad
    got, _ = check(q, k, v, do, g, bias=bias, is_causal=True)
    assert not np.isfinite(np.asarray(got["dq"])[:, 4]).any()
    assert np.isfinite(np.delete(np.asarray(got["dq"]), 4, axis=1)).all()


def test_packed_segments_across_tiles():
    """Packed sequences over several 32-key blocks (float16, D 16: 32 x 32 dQ tiles) with causal:
    the id-range skip drops the blocks of other segments, whose dbias entries are exactly 0;
    padding keys of segment 0 that no query matches."""
    q, k, v, do, g = inputs(7, batch=1, q_len=80, kv_len=80, heads=2, kv_heads=1,
                            dtype=jnp.float16)
    ids = np.repeat([1, 2, 3, 4], [17, 30, 21, 12])[None]
    kv_ids = ids.copy()
    kv_ids[0, 75:] = 0
    bias = np.asarray(normal(np.random.default_rng(8), (1, 2, 80, 80), jnp.float32))
    got, want = check(q, k, v, do, g, bias=bias, query_segment_ids=ids,
                      key_value_segment_ids=kv_ids, is_causal=True)
    other = ids[0][:, None] != kv_ids[0][None, :]
    assert np.all(np.asarray(got["dbias"])[:, :, other] == 0)


def test_segments_that_never_meet():
    """No query shares a segment with any key: every gradient, dbias included, is exactly 0."""
    q, k, v, do, g = inputs(8)
    bias = np.asarray(normal(np.random.default_rng(9), (B, H, TQ, TK), jnp.float32))
    got, _ = check(q, k, v, do, g, bias=bias, query_segment_ids=np.ones((B, TQ), np.int32),
                   key_value_segment_ids=np.full((B, TK), 2, np.int32))
    for name in ("dq", "dk", "dv", "dbias"):
        assert np.all(np.asarray(got[name]) == 0), name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_soft_cap_with_large_logits(dtype):
    """Inputs 8 N(0,1): raw scores in the hundreds, capped to +-30; the cap's derivative
    1 - tanh^2 reaches dQ and dK (without it they would be far off)."""
    q, k, v, do, g = inputs(9, dtype=dtype)
    q, k = q * 8, k * 8
    check(q, k, v, do, g, logits_soft_cap=30.0, is_causal=True)


def test_sinks_with_empty_rows():
    """Sinks need no backward kernel work (the residuals include them): dQ, dK, dV and dsinks
    (computed from O and the residuals) with empty rows from a zero kv length and rows past
    q_len."""
    q, k, v, do, g = inputs(10)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    got, _ = check(q, k, v, do, g, sinks=sinks, query_seq_lengths=np.array([9, 5]),
                   key_value_seq_lengths=np.array([0, 11]), is_causal=True,
                   causal_alignment="bottom_right")
    assert np.all(np.asarray(got["dk"])[0] == 0) and np.all(np.asarray(got["dv"])[0] == 0)


def test_minus_inf_sinks_are_no_sinks():
    """A -inf sink is no sink: the gradients match the oracle of none, its dsinks is exactly 0,
    with rows emptied by the mask (the emulator's fast:: math returns garbage for Inf/NaN
    arguments, so a backward relying on fast::exp2(-inf) = 0 fails here)."""
    q, k, v, do, g = inputs(12)
    sinks = np.array([-np.inf, 0.5, -np.inf, 1.0], np.float32)
    mask = np.random.default_rng(13).random((TQ, TK)) > 0.3
    mask[2] = False
    got, _ = check(q, k, v, do, g, sinks=sinks, mask=mask, is_causal=True)
    dsinks = np.asarray(got["dsinks"])
    assert (dsinks[[0, 2]] == 0).all() and np.isfinite(dsinks).all()


COMBINED = [
    dict(is_causal=True),
    dict(local_window_size=(3, 1), causal_alignment="bottom_right"),
    dict(is_causal=True, query_seq_lengths=np.array([7, 9]),
         key_value_seq_lengths=np.array([11, 5]), causal_alignment="bottom_right"),
]


def _all_features(rng, batch, heads, q_len, kv_len):
    return dict(bias=np.asarray(normal(rng, (1, heads, q_len, kv_len), jnp.float32)),
                mask=rng.random((batch, 1, q_len, kv_len)) > 0.2,
                query_segment_ids=np.sort(rng.integers(0, 3, (batch, q_len)), axis=1),
                key_value_segment_ids=np.sort(rng.integers(0, 3, (batch, kv_len)), axis=1),
                logits_soft_cap=4.0, sinks=np.asarray(normal(rng, (heads,), jnp.float32)))


@pytest.mark.parametrize("band", COMBINED, ids=["causal", "window", "lengths"])
def test_everything_combined(band):
    """Mask, bias, segments, soft cap and sinks at once, with GQA and the band rules."""
    q, k, v, do, g = inputs(11)
    check(q, k, v, do, g, **_all_features(np.random.default_rng(12), B, H, TQ, TK), **band)


@pytest.mark.parametrize("dtype,head_dim", [("f16", 64), ("f32", 128), ("bf16", 160),
                                            ("f32", 192)])
def test_head_dims_and_tile_edges(dtype, head_dim):
    """Every feature at once over lengths just past a tile (dQ rows, dK/dV keys) for the one
    dK/dV kernel and the split dK and dV kernels (D >= 160), GQA 2."""
    dtypes = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}
    q, k, v, do, g = inputs(13, batch=1, q_len=33, kv_len=41, heads=2, kv_heads=1,
                            head_dim=head_dim, dtype=dtypes[dtype])
    check(q, k, v, do, g, **_all_features(np.random.default_rng(14), 1, 2, 33, 41),
          is_causal=True, causal_alignment="bottom_right")


def test_bias_in_the_query_dtype():
    """A bfloat16 bias with bfloat16 inputs is read as bfloat16 (JFM_BIAS_OF_Q); its gradient
    is returned in bfloat16."""
    q, k, v, do, g = inputs(15, dtype=jnp.bfloat16)
    bias = normal(np.random.default_rng(16), (1, H, 1, TK), jnp.bfloat16)
    got, _ = check(q, k, v, do, g, bias=bias, is_causal=True)
    assert got["dbias"].dtype == jnp.bfloat16


def test_no_score_sized_buffer_without_a_bias_gradient():
    """Compile only (never run) at length 4096 with a key bias: differentiating w.r.t. q, k, v
    keeps no Tq x Tkv temporary; w.r.t. the bias too, XLA plans the float32 [B, H, Tq, Tkv]
    dbias the dQ kernel writes."""
    length, heads = 4096, 2
    x = jax.ShapeDtypeStruct((1, length, heads, 16), jnp.float32)
    bias = jax.ShapeDtypeStruct((length,), jnp.float32)
    scores_bytes = heads * length * length * 4

    def temp_bytes(argnums):
        def loss(q, k, v, bias):
            return flash_attention(q, k, v, bias, is_causal=True,
                                   implementation="emulator").sum()
        grad = jax.jit(jax.grad(loss, argnums=argnums))
        return grad.lower(x, x, x, bias).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes((0, 1, 2)) < scores_bytes / 100
    assert temp_bytes((0, 1, 2, 3)) >= scores_bytes


def _streamed_bytes(length, segment_len):
    """(K and V bytes bwd_dq reads, Q and dO bytes bwd_dkdv reads) of the emulator's backward at
    this length with packed segments of segment_len keys (0: none); float16, D 64, one head
    (32 x 32 tiles in both kernels)."""
    q, k, v, do, _ = inputs(24, batch=1, q_len=length, kv_len=length, heads=1, kv_heads=1,
                            head_dim=64, dtype=jnp.float16)
    kw = {}
    if segment_len:
        ids = jnp.asarray(np.arange(length)[None] // segment_len, jnp.int32)
        kw = dict(query_segment_ids=ids, key_value_segment_ids=ids)
    _, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, implementation="emulator", **kw),
                     q, k, v)
    records = profile_model._recorded(jax.jit(lambda vjp, ct: vjp(ct)), vjp, do)
    reads = {r["kernel"].split("_f16")[0]: r["buffers"] for r in records}
    dq, dkdv = reads["flash_attention_bwd_dq"], reads["flash_attention_bwd_dkdv"]
    return dq[1]["read"] + dq[2]["read"], dkdv[0]["read"] + dkdv[5]["read"]


@needs_counting
def test_segments_that_never_meet_are_never_staged():
    """Packed segments of 128: each owner block meets the 4 streamed blocks of its own segment,
    the others are skipped before they are staged, so the streamed bytes of both backward
    kernels are a quarter of the unpacked call's at length 512 and grow linearly."""
    dense = _streamed_bytes(512, 0)
    packed, packed_twice = _streamed_bytes(512, 128), _streamed_bytes(1024, 128)
    assert packed == tuple(n // 4 for n in dense), (packed, dense)
    assert packed_twice == tuple(2 * n for n in packed), (packed, packed_twice)


def test_schedules_give_bit_identical_gradients():
    """Every gradient element, dbias included, has one owner and a fixed reduction order:
    the emulator's resume order (after every barrier and simd operation) changes no bit."""
    q, k, v, do, g = inputs(25, batch=1, q_len=40, kv_len=70, heads=2, kv_heads=1)
    kw = _all_features(np.random.default_rng(26), 1, 2, 40, 70)
    before = ext.emulator_schedule()
    results = []
    try:
        for schedule, seed in (("forward", 0), ("reverse", 0), ("random", 5)):
            ext.set_emulator_schedule(schedule, seed)
            jax.clear_caches()
            results.append({n: np.asarray(x) for n, x in run(q, k, v, do, g, **kw).items()})
    finally:
        ext.set_emulator_schedule(*before)
    for other in results[1:]:
        for name, x in other.items():
            assert x.tobytes() == results[0][name].tobytes(), name


def test_vmap_with_a_bias_gradient():
    """vmap over a batch-broadcast bias (expanded under the fold, its dbias summed back over
    the batch): each example gets its own bias gradient."""
    q, k, v, _, _ = inputs(19)
    rng = np.random.default_rng(20)
    bias = jnp.asarray(normal(rng, (3, 1, H, 1, TK), jnp.float32))
    mask = jnp.asarray(rng.random((TQ, TK)) > 0.3)

    def loss(bias):
        out = flash_attention(q, k, v, bias, mask, implementation="emulator")
        return jnp.sum(out * v[:, :TQ, :1])

    dbias = jax.vmap(jax.grad(loss))(bias)
    for i in range(3):
        np.testing.assert_allclose(dbias[i], jax.grad(loss)(bias[i]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fill", [float(jnp.finfo(jnp.float32).min),
                                  float(jnp.finfo(jnp.bfloat16).min), -2.4e38], ids=str)
def test_finfo_min_additive_mask(fill):
    """An additive causal mask of finfo.min (the usual jax.nn / PyTorch idiom) leaves the log2
    domain's float range; its scores saturate (jfm_saturate_score2) instead of overflowing to
    NaN. Every row sees its diagonal: O, LSE and every gradient match the oracle."""
    q, k, v, do, g = inputs(21, q_len=TK)
    keep = np.tril(np.ones((TK, TK), bool))
    check(q, k, v, do, g, bias=jnp.where(keep, 0.0, jnp.float32(fill)))


def test_saturated_rows_and_sinks_stay_finite():
    """A row whose every bias is finfo.min attends uniformly, as in jax.nn (not an empty row:
    only -inf hides); a sink of 3e38 takes all of its head's weight (O = 0), never NaN."""
    q, k, v, _, _ = inputs(22)
    bias = jnp.zeros((B, H, TQ, TK)).at[:, :, 3].set(jnp.finfo(jnp.float32).min)
    o = flash_attention(q, k, v, bias, implementation="emulator")
    np.testing.assert_allclose(o, jax.nn.dot_product_attention(q, k, v, bias), rtol=2e-5,
                               atol=2e-5)
    sinks = jnp.array([3e38, 0.0, 0.0, 0.0], jnp.float32)
    o, lse = flash_attention(q, k, v, sinks=sinks, implementation="emulator", return_lse=True)
    assert np.isfinite(np.asarray(lse)).all() and (np.asarray(o)[:, :, 0] == 0).all()
