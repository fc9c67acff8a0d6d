"""The forward kernels with the optional features of docs/design.md#scores (soft cap, bias, mask,
segment ids, sinks; shaders/flash_attention_features.h) through the whole chain: flash_attention
-> forward primitive -> FFI lowering -> emulated device -> tiled forward or split-KV decode.
O and LSE against the float64 oracle (tests/helpers/oracle.py, tolerances of
tests/helpers/tolerance.py), the residuals m and log(l) against LSE, the segment-id tile skip in the
kernel profile, and the handler's errors for bad feature operands.

The backward with the features: tests/fused/test_kernels_features_bwd.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tolerance
from api_helpers import normal

ext = pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal import flash_attention  # noqa: E402
import kernel_harness as kh  # noqa: E402
from ffi_targets import fwd_call  # noqa: E402  (the forward target called directly)
from kernel_harness import needs_counting  # noqa: E402
from jax_flash_metal.tools import profile_model  # noqa: E402

def forward(q, k, v, bias=None, mask=None, **kw):
    """(o, lse) of the emulator's forward."""
    return flash_attention(q, k, v, bias, mask, implementation="emulator", return_lse=True, **kw)


def check(q, k, v, bias=None, mask=None, **kw):
    """forward() matches the oracle on O and LSE; returns (o, lse)."""
    o, lse = forward(q, k, v, bias, mask, **kw)
    oracle_kw = {n: (np.asarray(x) if isinstance(x, jax.Array) else x) for n, x in kw.items()}
    do = jnp.zeros(q.shape, q.dtype)  # the half-precision yardstick also runs a backward
    tolerance.assert_all_match_oracle(dict(o=o, lse=lse), q, k, v, do, names=("o", "lse"),
                                      bias=None if bias is None else np.asarray(bias, np.float32),
                                      mask=None if mask is None else np.asarray(mask), **oracle_kw)
    return o, lse


def qkv(seed, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype=jnp.float32, scale=1.0):
    rng = np.random.default_rng(seed)
    return (normal(rng, (batch, q_len, heads, head_dim), dtype, scale),
            normal(rng, (batch, kv_len, kv_heads, head_dim), dtype, scale),
            normal(rng, (batch, kv_len, kv_heads, head_dim), dtype))


def segments(rng, batch, length, count):
    """int32 [batch, length]: sorted packed-sequence ids 0..count-1 (random boundaries)."""
    cuts = np.sort(rng.integers(0, length, (batch, count - 1)), axis=1)
    return jnp.asarray((np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


B, TQ, TK, H, HKV, D = 2, 19, 37, 4, 2, 16


def _features(rng, kind, dtype=jnp.float32, heads=H, q_len=TQ, kv_len=TK, batch=B):
    if kind == "bias":
        return dict(bias=normal(rng, (batch, heads, q_len, kv_len), dtype))
    if kind == "mask":
        return dict(mask=jnp.asarray(rng.random((batch, heads, q_len, kv_len)) < 0.6))
    if kind == "segments":
        return dict(query_segment_ids=segments(rng, batch, q_len, 3),
                    key_value_segment_ids=segments(rng, batch, kv_len, 3))
    if kind == "soft_cap":
        return dict(logits_soft_cap=2.5)
    return dict(sinks=normal(rng, (heads,), jnp.float32, 2.0))


KINDS = ("bias", "mask", "segments", "soft_cap", "sinks")


@pytest.mark.parametrize("kind", KINDS)
def test_each_feature_alone(kind):
    q, k, v = qkv(1, B, TQ, TK, H, HKV, D, scale=2.0)
    check(q, k, v, **_features(np.random.default_rng(2), kind))


@pytest.mark.parametrize("band", [
    dict(is_causal=True),
    dict(local_window_size=(5, 3), causal_alignment="bottom_right"),
    dict(is_causal=True, causal_alignment="bottom_right",
         query_seq_lengths=np.array([19, 7], np.int32),
         key_value_seq_lengths=np.array([30, 37], np.int32)),
], ids=["causal", "window", "lengths"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_features_with_the_band_rules_and_gqa(band, dtype):
    rng = np.random.default_rng(3)
    q, k, v = qkv(4, B, TQ, TK, H, HKV, D, dtype, scale=2.0)
    features = {}
    for kind in KINDS:
        features.update(_features(rng, kind, dtype))
    band = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in band.items()}
    check(q, k, v, **features, **band)


@pytest.mark.parametrize("shape", [(B, 1, 1, TK), (1, H, TQ, TK), (TQ, TK), (B, H, TQ, 1),
                                   (1, 1, TQ, 1)])
def test_masks_of_every_broadcast_shape_with_empty_rows(shape):
    """Rows whose every key is masked output exactly 0 and LSE -inf."""
    rng = np.random.default_rng(5)
    mask = rng.random(shape) < 0.5
    mask.reshape(-1, *shape[-2:])[0, min(3, shape[-2] - 1)] = False  # empty rows somewhere
    q, k, v = qkv(6, B, TQ, TK, H, HKV, D)
    o, lse = check(q, k, v, mask=jnp.asarray(mask))
    empty = ~np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + shape),
                             (B, H, TQ, TK)).any(-1)
    assert empty.any()
    assert np.isneginf(np.asarray(lse)[empty]).all()
    assert (np.asarray(o).transpose(0, 2, 1, 3)[empty] == 0).all()


@pytest.mark.parametrize("shape,bias_dtype,q_dtype", [
    ((1, 1, 1, TK), jnp.float32, jnp.float32),
    ((B, H, TQ, TK), jnp.bfloat16, jnp.bfloat16),  # the dtype of q
    ((1, H, 1, 1), jnp.float32, jnp.float16),  # float32 with half inputs
    ((B, 1, TQ, TK), jnp.float16, jnp.float32),  # converted to float32 by the lowering
])
def test_bias_of_several_broadcast_shapes_and_dtypes(shape, bias_dtype, q_dtype):
    rng = np.random.default_rng(7)
    q, k, v = qkv(8, B, TQ, TK, H, HKV, D, q_dtype)
    check(q, k, v, bias=normal(rng, shape, bias_dtype, 3.0))


def test_bias_minus_inf_hides_and_plus_inf_nan_propagate():
    """-inf hides a key exactly like a False mask entry (a row of -inf is empty: O = 0, LSE =
    -inf, never NaN); +inf or NaN on a visible entry poisons its row only."""
    rng = np.random.default_rng(9)
    bias = np.asarray(rng.standard_normal((B, H, TQ, TK)), np.float32)
    bias[:, :, 2, :] = -np.inf
    bias[:, :, 5, ::3] = -np.inf
    bias[0, 1, 7, 4] = np.inf
    bias[1, 0, 9, 0] = np.nan
    q, k, v = qkv(10, B, TQ, TK, H, HKV, D)
    o, lse = check(q, k, v, bias=jnp.asarray(bias))
    o, lse = np.asarray(o), np.asarray(lse)
    assert (o[:, 2] == 0).all() and np.isneginf(lse[:, :, 2]).all()
    assert np.isnan(o[0, 7, 1]).all() and np.isnan(o[1, 9, 0]).all()
    nan_rows = np.isnan(o).any(axis=-1)
    assert nan_rows.sum() == 2  # exactly the two poisoned (row, head) pairs


def test_packed_segments_with_causal():
    rng = np.random.default_rng(11)
    q, k, v = qkv(12, 2, 70, 70, 2, 1, 32, jnp.float16)
    ids = segments(rng, 2, 70, 4)
    check(q, k, v, query_segment_ids=ids, key_value_segment_ids=ids, is_causal=True)


def test_segments_that_never_meet_are_empty_rows():
    q, k, v = qkv(13, 1, 40, 50, 2, 2, 16)
    o, lse = check(q, k, v, query_segment_ids=jnp.zeros((1, 40), jnp.int32),
                   key_value_segment_ids=jnp.ones((1, 50), jnp.int32))
    assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_soft_cap_with_large_logits_in_bfloat16():
    """Scores up to ~+-500 capped at 5: without the cap the softmax would be one-hot."""
    q, k, v = qkv(14, 1, 33, 70, 2, 1, 64, jnp.bfloat16, scale=6.0)
    check(q, k, v, logits_soft_cap=5.0)
    check(q, k, v, logits_soft_cap=5.0, bias=normal(np.random.default_rng(0), (33, 70),
                                                    jnp.float32))


def test_sinks_with_empty_rows():
    """A row with no visible key: O = 0 and LSE = its head's sink (lengths, masks and rows a
    window leaves empty)."""
    rng = np.random.default_rng(15)
    q, k, v = qkv(16, B, TQ, TK, H, HKV, D)
    sinks = normal(rng, (H,), jnp.float32, 3.0)
    mask = np.ones((TQ, TK), bool)
    mask[4] = False
    o, lse = check(q, k, v, mask=jnp.asarray(mask), sinks=sinks,
                   query_seq_lengths=jnp.asarray([19, 10], jnp.int32),
                   key_value_seq_lengths=jnp.asarray([0, 37], jnp.int32))
    o, lse = np.asarray(o), np.asarray(lse)
    expected = np.broadcast_to(np.asarray(sinks)[:, None], (H, TQ))
    assert (o[0] == 0).all()  # batch 0 has no keys at all
    np.testing.assert_allclose(lse[0], expected, rtol=1e-6)
    assert (o[1, 4] == 0).all() and (o[1, 10:] == 0).all()
    np.testing.assert_allclose(lse[1, :, 4], sinks, rtol=1e-6)


@pytest.mark.parametrize("q_len", [TQ, 2], ids=["tiled", "decode"])
def test_minus_inf_sinks_are_no_sinks(q_len):
    """A -inf sink adds exp(-inf) = 0 to its head's denominator: those heads match the oracle of
    no sink, and rows emptied by the mask or a -inf bias stay empty (O = 0, LSE = -inf).
    fast::exp2(-inf) is not promised to be 0, and the emulator's fast:: functions return garbage
    for it (emulator/README.md), so a kernel relying on it fails here."""
    rng = np.random.default_rng(19)
    q, k, v = qkv(20, B, q_len, TK, H, HKV, D)
    sinks = jnp.asarray([-np.inf, 0.5, -np.inf, 2.0], jnp.float32)
    mask = np.ones((q_len, TK), bool)
    mask[0] = False
    bias = np.asarray(rng.standard_normal((B, H, q_len, TK)), np.float32)
    bias[:, :, -1, :] = -np.inf
    bias[:, :, :, ::4] = -np.inf
    o, lse = check(q, k, v, bias=jnp.asarray(bias), mask=jnp.asarray(mask), sinks=sinks)
    o, lse = np.asarray(o), np.asarray(lse)
    for row in (0, q_len - 1):  # the masked row and the -inf bias row
        assert (o[:, row] == 0).all()
        assert np.isneginf(lse[:, [0, 2], row]).all()
        np.testing.assert_allclose(lse[:, [1, 3], row], np.broadcast_to([0.5, 2.0], (B, 2)),
                                   rtol=1e-6)


@pytest.mark.parametrize("dtype,head_dim,q_len,kv_len", [
    (jnp.float16, 64, 33, 65),    # BQ 32, BK 32: one row and one key past a block
    (jnp.float32, 128, 31, 17),   # BK 16, Q in registers, staged through the K/V tiles
    (jnp.bfloat16, 160, 17, 15),  # BK 16, one buffer, Q reloaded
])
def test_tile_sizes_around_the_block_edges(dtype, head_dim, q_len, kv_len):
    rng = np.random.default_rng(17)
    q, k, v = qkv(18, 1, q_len, kv_len, 2, 1, head_dim, dtype)
    check(q, k, v, bias=normal(rng, (1, 2, q_len, kv_len), jnp.float32),
          mask=jnp.asarray(rng.random((1, 1, q_len, kv_len)) < 0.8),
          query_segment_ids=segments(rng, 1, q_len, 2),
          key_value_segment_ids=segments(rng, 1, kv_len, 2), logits_soft_cap=4.0,
          sinks=normal(rng, (2,), jnp.float32), is_causal=True, causal_alignment="bottom_right")


@pytest.mark.parametrize("q_len,heads,kv_heads,dtype", [(1, 8, 2, jnp.float16),
                                                        (3, 4, 1, jnp.float32),
                                                        (16, 2, 2, jnp.bfloat16)])
def test_decode_shapes(q_len, heads, kv_heads, dtype):
    """Short queries against a KV cache take the split-KV decode with every feature: a padding
    mask as Flax passes it, a bias, packed segments, a cap and sinks (combined across splits)."""
    batch, kv_len, head_dim = 2, 700, 32
    splits, _ = ext.decode_splits({jnp.float16: "f16", jnp.float32: "f32",
                                   jnp.bfloat16: "bf16"}[dtype], batch, q_len, kv_len, heads,
                                  kv_heads, head_dim)
    assert splits > 1
    rng = np.random.default_rng(19)
    q, k, v = qkv(20, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)
    padding = np.arange(kv_len)[None, None, None, :] < np.array([500, 650])[:, None, None, None]
    kv_ids = segments(rng, batch, kv_len, 3)
    check(q, k, v, bias=normal(rng, (batch, heads, 1, kv_len), jnp.float32),
          mask=jnp.asarray(padding), query_segment_ids=kv_ids[:, -q_len:],
          key_value_segment_ids=kv_ids, logits_soft_cap=6.0,
          sinks=normal(rng, (heads,), jnp.float32), is_causal=True,
          causal_alignment="bottom_right")


def test_emulator_schedules_give_identical_results():
    rng = np.random.default_rng(21)
    q, k, v = qkv(22, 1, 40, 70, 2, 1, 16)
    kw = dict(mask=jnp.asarray(rng.random((40, 70)) < 0.7),
              query_segment_ids=segments(rng, 1, 40, 3),
              key_value_segment_ids=segments(rng, 1, 70, 3))
    before = ext.emulator_schedule()
    results = []
    try:
        for schedule in ("forward", "reverse", "random"):
            ext.set_emulator_schedule(schedule, 5)
            jax.clear_caches()
            results.append([np.asarray(x) for x in forward(q, k, v, **kw)])
    finally:
        ext.set_emulator_schedule(*before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


# ---- the backward's residuals, through the FFI target -------------------------------------

@pytest.mark.parametrize("q_len", [1, 20], ids=["decode", "tiled"])
def test_residuals_include_the_sinks(q_len):
    """m + log(l) = LSE on every row, empty ones included (they hold the sink: m = the sink,
    log(l) = 0), so the backward's P is normalised with the sink in the denominator."""
    q, k, v = qkv(23, 1, q_len, 300, 2, 2, 16)
    sinks = jnp.asarray([0.5, 30.0], jnp.float32)  # a sink far above every score, too
    mask = np.ones((1, 1, q_len, 300), bool)
    mask[..., 0, :] = False
    o, lse, (row_max, log_sum) = fwd_call(q, k, v, jnp.asarray(mask), sinks, has_mask=True,
                                          has_sinks=True)
    kh.check_residuals(lse, row_max, log_sum)
    np.testing.assert_array_equal(np.asarray(row_max)[0, :, 0], sinks)
    np.testing.assert_array_equal(np.asarray(log_sum)[0, :, 0], 0.0)
    np.testing.assert_allclose(np.asarray(lse)[0, :, 0], sinks, rtol=1e-6)
    assert (np.asarray(o)[0, 0] == 0).all()


def test_no_keys_with_sinks():
    """kv_len 0 (no dispatch): O = 0, LSE = m = the sink, log(l) = 0."""
    q = jnp.ones((1, 3, 2, 16), jnp.float32)
    k = jnp.ones((1, 0, 1, 16), jnp.float32)
    sinks = jnp.asarray([1.5, -2.0], jnp.float32)
    o, lse, (row_max, log_sum) = fwd_call(q, k, k, sinks, has_sinks=True)
    assert (np.asarray(o) == 0).all()
    np.testing.assert_allclose(lse, np.broadcast_to(np.asarray(sinks)[None, :, None], lse.shape),
                               rtol=1e-6)
    np.testing.assert_array_equal(row_max, lse)
    np.testing.assert_array_equal(log_sum, 0.0)


# ---- handler errors for bad feature operands -------------------------------------------------

_Q = jnp.zeros((1, 4, 2, 16), jnp.float32)
_K = jnp.zeros((1, 5, 1, 16), jnp.float32)
_IDS = (jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 5), jnp.int32))


@pytest.mark.parametrize("operands,attrs,message", [
    ((), dict(has_mask=True), r"expected 1 optional operand\(s\) after the arrays \(mask,"),
    (_IDS, dict(), r"expected 0 optional operand\(s\) after the arrays \(none,"),
    ((_IDS[1], _IDS[1]), dict(has_segment_ids=True), r"q_segment_ids must be int32 \[1, 4\]"),
    ((_IDS[0], _IDS[0].astype(jnp.float32)), dict(has_segment_ids=True),
     r"kv_segment_ids must be int32 \[1, 5\], got float32"),
    ((jnp.zeros((1, 2, 4, 5), jnp.float16),), dict(has_bias=True),
     r"bias must have the dtype of query \(float32\) or float32, got float16"),
    ((jnp.zeros((2, 4, 5), jnp.float32),), dict(has_bias=True),
     r"bias must have rank 4 with each axis 1 or the size of \[1, 2, 4, 5\], got shape "
     r"\[2, 4, 5\]"),
    ((jnp.zeros((1, 2, 3, 5), jnp.float32),), dict(has_bias=True), r"bias must have rank 4"),
    ((jnp.zeros((1, 1, 4, 5), jnp.float32),), dict(has_mask=True),
     "mask must be bool or uint8"),
    ((jnp.zeros((1, 1, 4, 6), bool),), dict(has_mask=True), r"mask must have rank 4"),
    ((jnp.zeros((3,), jnp.float32),), dict(has_sinks=True), r"sinks must be float32 \[2\]"),
    ((jnp.zeros((2,), jnp.float16),), dict(has_sinks=True), r"sinks must be float32 \[2\]"),
    ((jnp.zeros((2,), jnp.float32),), dict(has_alibi=True),
     r"alibi_slopes must be float32 \[1, 2\], got float32 \[2\]"),
    ((), dict(logits_soft_cap=np.float32(-1.0)), "logits_soft_cap must be a positive finite"),
    ((), dict(logits_soft_cap=np.float32(np.inf)), "logits_soft_cap must be a positive finite"),
])
def test_handler_rejects_bad_feature_operands(operands, attrs, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        fwd_call(_Q, _K, _K, *operands, **attrs)


# ---- profile: the segment-id tile skip -----------------------------------------------------

def _kv_bytes(q_len, segment_len):
    """Bytes of K and V the forward reads at this length with packed segments of segment_len
    (or none): float16, D 64, one head, the tiled forward (BQ 32, BK 64)."""
    q, k, v = qkv(24, 1, q_len, q_len, 1, 1, 64, jnp.float16)
    kw = {}
    if segment_len:
        ids = jnp.asarray(np.arange(q_len)[None] // segment_len, jnp.int32)
        kw = dict(query_segment_ids=ids, key_value_segment_ids=ids)
    [record] = profile_model._recorded(jax.jit(lambda q, k, v: forward(q, k, v, **kw)[0]), q, k, v)
    return record["buffers"][1]["read"] + record["buffers"][2]["read"]


@needs_counting
def test_segments_that_never_meet_are_never_staged():
    """Packed segments of 128 keys: a 32-row block's ids meet the two key blocks of its own
    segment only; the others are skipped before K and V are staged (their ids are read, 4 bytes
    a key), so the K/V bytes grow linearly with the length (unpacked: quadratically) and are a
    quarter of the unpacked call's at length 512."""
    dense = _kv_bytes(512, 0)
    packed, packed_twice = _kv_bytes(512, 128), _kv_bytes(1024, 128)
    assert packed == dense // 4, (packed, dense)
    assert packed_twice == 2 * packed, (packed, packed_twice)
