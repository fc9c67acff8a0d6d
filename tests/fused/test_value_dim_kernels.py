"""The fused kernels with a value head dim Dv other than the key's Dk
(docs/design.md#value-head-dim) on the emulator, against the float64 oracle: every (Dk, Dv)
family of shaders/kernel_families.h with Dv != Dk, each dtype, every optional feature, forward and
gradients, and the decode's shapes (vector and MMA pass 1). The other pairs are the xla
implementation's (tests/api/test_alibi_value_dim.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tolerance
from api_helpers import DTYPES, VALUE_HEAD_DIM_PAIRS, needs_emulator, normal, run

ext = pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal import flash_attention  # noqa: E402

pytestmark = needs_emulator

B, H, HKV = 2, 4, 2
IDS = [f"dk{dk}-dv{dv}" for dk, dv in VALUE_HEAD_DIM_PAIRS]


def inputs(seed, dk, dv, dtype=jnp.float32, q_len=9, kv_len=11):
    """(q, k, v, do, g): q, k [..., dk]; v, do [..., dv]; g float32 [B, H, q_len]."""
    rng = np.random.default_rng(seed)
    return (normal(rng, (B, q_len, H, dk), dtype), normal(rng, (B, kv_len, HKV, dk), dtype),
            normal(rng, (B, kv_len, HKV, dv), dtype), normal(rng, (B, q_len, H, dv), dtype),
            normal(rng, (B, H, q_len), jnp.float32))


def check(q, k, v, do, g, **kw):
    """The emulator's o, lse, dq, dk, dv (and dbias, dsinks) against the oracle; the result
    shapes are the value head dim's for o and dv."""
    got = run(q, k, v, do, g, implementation="emulator", **kw)
    names = [n for n in ("o", "lse", "dq", "dk", "dv", "dbias", "dsinks") if n in got]
    tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=names, **kw)
    assert got["o"].shape == do.shape and got["dv"].shape == v.shape
    assert got["dq"].shape == q.shape and got["dk"].shape == k.shape
    return got


def test_the_families_are_the_required_pairs():
    assert set(VALUE_HEAD_DIM_PAIRS) == {(192, 128), (128, 64)}


# One fast forward + backward case per pair (the first dtype); the other dtypes are slow.
@pytest.mark.parametrize("dtype", [
    pytest.param(name, marks=[] if n == 0 else pytest.mark.slow)
    for n, name in enumerate(DTYPES)])
@pytest.mark.parametrize("dk,dv", VALUE_HEAD_DIM_PAIRS, ids=IDS)
def test_causal_gqa_every_dtype(dk, dv, dtype):
    check(*inputs(1, dk, dv, DTYPES[dtype]), is_causal=True)


FEATURES = {  # each optional feature once, with its masking or score arguments
    "window-lengths-br": lambda rng: dict(
        local_window_size=(4, 1), query_seq_lengths=np.array([9, 5]),
        key_value_seq_lengths=np.array([7, 11]), causal_alignment="bottom_right"),
    "bias-softcap-sinks": lambda rng: dict(
        bias=np.asarray(normal(rng, (B, 1, 9, 11), jnp.float32)), logits_soft_cap=3.0,
        sinks=np.asarray(normal(rng, (H,), jnp.float32))),
    "segments-mask": lambda rng: dict(
        query_segment_ids=np.sort(rng.integers(0, 3, (B, 9)), axis=1),
        key_value_segment_ids=np.sort(rng.integers(0, 3, (B, 11)), axis=1),
        mask=rng.random((1, H, 9, 11)) > 0.2),
}


@pytest.mark.slow
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dk,dv", VALUE_HEAD_DIM_PAIRS, ids=IDS)
def test_every_feature(dk, dv, feature):
    check(*inputs(2, dk, dv), **FEATURES[feature](np.random.default_rng(3)))


@pytest.mark.parametrize("dk,dv", VALUE_HEAD_DIM_PAIRS, ids=IDS)
def test_every_feature_at_once(dk, dv):
    """Fast: all features in one call per pair."""
    rng = np.random.default_rng(4)
    kw = {}
    for make in FEATURES.values():
        kw.update(make(rng))
    check(*inputs(3, dk, dv, jnp.float16), is_causal=True, **kw)


# Decode: one query head row per KV head pair (the vector pass 1) and a 32-row MMA tile's worth.
DECODE = [(1, "decode_vector"), (4, "decode_partial")]


@pytest.mark.parametrize("q_len,stage", DECODE, ids=[s for _, s in DECODE])
@pytest.mark.parametrize("dk,dv", VALUE_HEAD_DIM_PAIRS, ids=IDS)
def test_decode(dk, dv, q_len, stage):
    """Short queries against 600 keys take the split-KV decode (several splits) of the family;
    its O and LSE against the oracle, with lengths and sinks."""
    heads = 8 if stage == "decode_partial" and dk == 128 else H  # G * q_len past the vector rows
    plan = ext.dispatch_plan("fwd", "f16", B, q_len, 600, heads, HKV, dk,
                             value_head_dim=dv)
    kernels = [d["kernel"] for s in plan for d in s]
    assert kernels[0] == ext.kernel_name(stage, "f16", dk, dv)
    assert kernels[0] != kernels[-1] and plan[0][0]["groups"][0] > 1  # splits, then combine
    rng = np.random.default_rng(5)
    q = normal(rng, (B, q_len, heads, dk), jnp.float16)
    k = normal(rng, (B, 600, HKV, dk), jnp.float16)
    v = normal(rng, (B, 600, HKV, dv), jnp.float16)
    kw = dict(key_value_seq_lengths=np.array([600, 333]), causal_alignment="bottom_right",
              is_causal=True, sinks=np.asarray(normal(rng, (heads,), jnp.float32)))
    o, lse = jax.jit(lambda q, k, v: flash_attention(q, k, v, implementation="emulator",
                                                     return_lse=True, **kw))(q, k, v)
    do = jnp.zeros_like(o)
    tolerance.assert_all_match_oracle(dict(o=o, lse=lse), q, k, v, do, names=("o", "lse"), **kw)
