"""ALiBi slopes and a value head dim Dv other than Dk (docs/design.md#alibi,
docs/design.md#value-head-dim) against the float64 oracle, forward and gradients.

ALiBi is judged against the oracle given the bias materialised from the formula
(``api_helpers.alibi_bias``); the slopes' gradient against sum_ij dbias_ij * -|i + off - j| of
the oracle's bias gradient. Run on the xla implementation, dense and blockwise, and ALiBi on
the emulator's kernels (tiled forward, both decode pass 1 kernels, the backward with the slopes'
gradient). The fused kernels have a few (Dk, Dv) pairs only (tests/fused/test_value_dim_kernels.py):
an explicit fused implementation refuses another pair naming it, and implementation=None runs it
on xla.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import tolerance
from api_helpers import alibi_bias, make_inputs, needs_emulator, normal, run
from jax_flash_metal import flash_attention, reference_attention
from jax_flash_metal.lowering import dispatch

B, TQ, TK, H, HKV = 2, 9, 11, 4, 2


def inputs(seed, dk=16, dv=16, dtype=jnp.float32, q_len=TQ, kv_len=TK, kv_heads=HKV):
    """(q, k, v, do, g) with v and do in the value head dim ``dv``."""
    q, k, _, _, g = make_inputs(seed, B, q_len, kv_len, H, kv_heads, dk, dtype)
    rng = np.random.default_rng(seed + 100)
    return (q, k, normal(rng, (B, kv_len, kv_heads, dv), dtype),
            normal(rng, (B, q_len, H, dv), dtype), g)


def check(q, k, v, do, g, alibi_slopes=None, implementation="xla", **kw):
    """run() against the oracle; ALiBi through the materialised bias. Returns run()'s dict."""
    got = run(q, k, v, do, g, alibi_slopes=alibi_slopes, implementation=implementation, **kw)
    oracle_kw = dict(kw)
    names = [n for n in ("o", "lse", "dq", "dk", "dv", "dbias", "dsinks") if n in got]
    if alibi_slopes is not None:
        term, dist = alibi_bias(alibi_slopes, B, q.shape[1], k.shape[1], **kw)
        user_bias = kw.get("bias")
        bias = term if user_bias is None else term + np.asarray(user_bias, np.float64)
        oracle_kw["bias"] = bias
        names = [n for n in names if n != "dbias"]
    want = tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=names, **oracle_kw)
    if alibi_slopes is not None:
        dbias = np.broadcast_to(want["dbias"], (B, H) + dist.shape[2:])
        want_slopes = (dbias * dist).sum(axis=(2, 3))
        if np.ndim(alibi_slopes) == 1:
            want_slopes = want_slopes.sum(axis=0)
        tolerance.assert_matches_oracle("dalibi_slopes", got["dalibi_slopes"], want_slopes,
                                        kind="dbias")
        if user_bias is not None:
            summed = tuple(n for n, size in enumerate(np.shape(user_bias)) if size == 1)
            tolerance.assert_matches_oracle("dbias", got["dbias"], np.sum(
                dbias, axis=summed, keepdims=True).reshape(np.shape(user_bias)))
    return got


def slopes_of(shape, seed=0):
    """ALiBi slopes like BLOOM's (2^(-8n/H)), jittered so heads differ at random."""
    rng = np.random.default_rng(seed)
    geometric = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    return (np.broadcast_to(geometric, shape) * (0.5 + rng.random(shape))).astype(np.float32)


BANDS = [  # (slopes shape, band)
    ((H,), dict()),
    ((B, H), dict(is_causal=True)),
    ((H,), dict(is_causal=True, causal_alignment="bottom_right")),
    ((B, H), dict(query_seq_lengths=np.array([9, 4]), key_value_seq_lengths=np.array([6, 11]),
                  causal_alignment="bottom_right")),
    ((H,), dict(is_causal=True, query_seq_lengths=np.array([7, 9]),
                key_value_seq_lengths=np.array([11, 3]))),
]


@pytest.mark.parametrize("shape,band", BANDS, ids=["plain", "causal", "causal-br",
                                                   "lengths-br", "causal-lengths"])
def test_alibi_equals_the_materialised_bias(blocks, shape, band):
    """Both alignments (off_b from the valid lengths), causal, lengths, GQA, slopes per head
    and per (batch, head); forward, dq, dk, dv and the slopes' gradient."""
    q, k, v, do, g = inputs(1)
    check(q, k, v, do, g, alibi_slopes=slopes_of(shape), **band)


def test_alibi_with_bias_soft_cap_and_sinks(blocks):
    """ALiBi is added after the soft cap, together with the bias (one score term)."""
    q, k, v, do, g = inputs(2)
    rng = np.random.default_rng(3)
    check(q, k, v, do, g, alibi_slopes=slopes_of((B, H), 1), logits_soft_cap=3.0,
          bias=np.asarray(normal(rng, (1, H, TQ, TK), jnp.float32)),
          sinks=np.asarray(normal(rng, (H,), jnp.float32)), is_causal=True,
          causal_alignment="bottom_right")


def test_alibi_check_grads():
    """Reverse-mode gradients w.r.t. query and the slopes by finite differences."""
    q, k, v, _, _ = inputs(4, kv_len=6, q_len=5)

    def f(q, slopes):
        return flash_attention(q, k, v, alibi_slopes=slopes, is_causal=True,
                               causal_alignment="bottom_right", implementation="xla")

    check_grads(f, (q, jnp.asarray(slopes_of((H,)))), order=1, modes=["rev"], atol=1e-2,
                rtol=1e-2)


# The emulator's kernels: (q_len, kv_len, slopes shape, band, pass 1 of the decode or None for
# the tiled forward), with H = 4 query heads over HKV = 2 (GQA).
FUSED_CASES = [
    (20, 23, (H,), dict(is_causal=True, causal_alignment="bottom_right",
                        query_seq_lengths=np.array([20, 13]),
                        key_value_seq_lengths=np.array([23, 9])), None),
    (20, 18, (B, H), dict(local_window_size=(5, 3), query_seq_lengths=np.array([17, 20])), None),
    (9, 30, (B, H), dict(is_causal=True, causal_alignment="bottom_right",
                         key_value_seq_lengths=np.array([30, 12])), "decode_partial"),
    (3, 37, (H,), dict(causal_alignment="bottom_right", query_seq_lengths=np.array([3, 2]),
                       key_value_seq_lengths=np.array([37, 20])), "decode_vector"),
]


@needs_emulator
@pytest.mark.parametrize("q_len,kv_len,shape,band,decode", FUSED_CASES,
                         ids=["fwd-causal-br-lengths", "fwd-window", "decode-partial",
                              "decode-vector"])
def test_alibi_in_the_kernels(q_len, kv_len, shape, band, decode):
    """The emulator's kernels against the oracle with the materialised bias: O, LSE, dQ, dK, dV
    and the slopes' gradient (the dQ kernel's per-row sums), both alignments, lengths, GQA,
    the tiled forward and both decode pass 1 kernels."""
    from jax_flash_metal import _ext
    plan = _ext.dispatch_plan("fwd", "f32", B, q_len, kv_len, H, HKV, 16, "emulator")
    assert plan[0][0]["kernel"] == f"flash_attention_{decode or 'fwd'}_f32_d16"
    q, k, v, do, g = inputs(11, q_len=q_len, kv_len=kv_len)
    check(q, k, v, do, g, alibi_slopes=slopes_of(shape, 4), implementation="emulator", **band)


@needs_emulator
@pytest.mark.slow
def test_alibi_in_the_kernels_with_bias_soft_cap_and_sinks():
    """The kernels add ALiBi after the soft cap, together with a broadcast bias."""
    q, k, v, do, g = inputs(12, q_len=20, kv_len=23)
    rng = np.random.default_rng(13)
    check(q, k, v, do, g, alibi_slopes=slopes_of((B, H), 5), logits_soft_cap=3.0,
          bias=np.asarray(normal(rng, (1, H, 20, 23), jnp.float32)),
          sinks=np.asarray(normal(rng, (H,), jnp.float32)), is_causal=True,
          implementation="emulator")


def test_alibi_equals_reference_attention_under_vmap():
    """vmap over per-example slopes: each example gets its own, as reference_attention."""
    q, k, v, _, _ = inputs(5)
    slopes = jnp.asarray(slopes_of((3, H), 2))
    got = jax.vmap(lambda s: flash_attention(q, k, v, alibi_slopes=s))(slopes)
    want = jax.vmap(lambda s: reference_attention(q, k, v, alibi_slopes=s))(slopes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


PAIRS = [(16, 8), (8, 24)]


@pytest.mark.parametrize("dk,dv", PAIRS, ids=[f"dk{a}-dv{b}" for a, b in PAIRS])
def test_value_head_dim_with_every_feature(blocks, dk, dv):
    """Dv != Dk with mask, bias, segment ids, soft cap, sinks, ALiBi, window, lengths and GQA:
    o and dv have Dv, dq and dk Dk, scale=None is 1/sqrt(Dk)."""
    q, k, v, do, g = inputs(6, dk, dv)
    rng = np.random.default_rng(7)
    got = check(q, k, v, do, g, alibi_slopes=slopes_of((H,), 3),
                bias=np.asarray(normal(rng, (B, 1, TQ, TK), jnp.float32)),
                mask=rng.random((1, H, TQ, TK)) > 0.2,
                query_segment_ids=np.sort(rng.integers(0, 3, (B, TQ)), axis=1),
                key_value_segment_ids=np.sort(rng.integers(0, 3, (B, TK)), axis=1),
                logits_soft_cap=4.0, sinks=np.asarray(normal(rng, (H,), jnp.float32)),
                local_window_size=(6, 2), query_seq_lengths=np.array([9, 7]),
                key_value_seq_lengths=np.array([10, 11]), causal_alignment="bottom_right")
    assert got["o"].shape == (B, TQ, H, dv) and got["dv"].shape == (B, TK, HKV, dv)
    assert got["dq"].shape == (B, TQ, H, dk) and got["dk"].shape == (B, TK, HKV, dk)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_value_head_dim_half_precision(dtype):
    """Half precision within twice plain same-dtype attention's error; rank-3 inputs too."""
    q, k, v, do, g = inputs(8, 16, 8, dtype)
    tolerance.assert_all_match_oracle(run(q, k, v, do, g, is_causal=True), q, k, v, do, g,
                                      is_causal=True)
    o = flash_attention(q[0], k[0], v[0])
    assert o.shape == (TQ, H, 8) and o.dtype == dtype


@needs_emulator
def test_fused_implementations_refuse_a_pair_without_kernels(monkeypatch):
    """Explicit fused: ValueError naming the (Dk, Dv) pair that has no kernels.
    implementation=None with a fused implementation preferred: the call runs on xla, forward
    and backward."""
    q, k, v, do, g = inputs(9, 16, 8)
    message = "key head dim 16 with value head dim 8 with dtype float32 is not supported"
    with pytest.raises(ValueError, match=re.escape(message)):
        jax.jit(lambda q: flash_attention(q, k, v, implementation="emulator"))(q)
    monkeypatch.delenv("JAX_FLASH_METAL_IMPLEMENTATION", raising=False)
    monkeypatch.setattr(dispatch, "_PREFERENCE", ("emulator",))
    grad = jax.jit(jax.grad(lambda q: flash_attention(q, k, v).sum()))
    assert "jax_flash_metal_attention" not in grad.lower(q).as_text()
    want = jax.grad(lambda q: reference_attention(q, k, v).sum())(q)
    np.testing.assert_allclose(grad(q), want, rtol=1e-4, atol=1e-5)
