"""Attention dropout (docs/design.md#dropout): the keep mask ``dropout_mask`` against Philox's
known answers, its construction and statistics; ``flash_attention`` with dropout against the
float64 oracle given that mask (every feature, three dtypes, forward and gradients, dense and
blockwise xla), the mask read back bit for bit through O and dV, finite differences, vmap with
batched keys, keys as traced operands, and the errors.

So far only the xla implementation has dropout: the fused ones are checked to refuse it by
name (an explicit request) or to hand it to xla (``implementation=None``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import tolerance
from api_helpers import make_inputs, run
from jax_flash_metal import dropout, dropout_mask, flash_attention, reference_attention

B, TQ, TK, H, HKV, D = 2, 9, 11, 4, 2, 16
KEY = jax.random.key(7)

# Random123's known-answer vectors for Philox-4x32-10 (its kat_vectors file): counter words,
# key words, output words.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,want", KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, want):
    got = dropout.philox4x32([np.uint32(c) for c in counter], [np.uint32(k) for k in key])
    assert [int(x) for x in got] == list(want)


def test_mask_construction():
    """M[b, n, i, j] = word j % 4 of Philox((j // 4, i, n, b), key) >= floor(rate * 2**32),
    spelled out entry by entry; the legacy uint32 [2] key of the same data gives the same mask;
    a sub-shape's mask is the slice of a larger one."""
    rate, shape = 0.3, (2, 3, 5, 10)
    mask = np.asarray(dropout_mask(KEY, shape, rate))
    words = np.asarray(jax.random.key_data(KEY))
    assert dropout.threshold(rate) == int(rate * 2 ** 32)
    b, n, i, j = (x.astype(np.uint32) for x in np.indices(shape))
    out = np.stack([np.asarray(w) for w in dropout.philox4x32((j // 4, i, n, b), list(words))])
    word = np.take_along_axis(out, (j % 4)[None].astype(np.int64), axis=0)[0]
    np.testing.assert_array_equal(mask, word >= dropout.threshold(rate))
    np.testing.assert_array_equal(np.asarray(dropout_mask(jnp.asarray(words), shape, rate)),
                                  mask)
    larger = np.asarray(dropout_mask(KEY, (3, 4, 8, 17), rate))
    np.testing.assert_array_equal(larger[:2, :3, :5, :10], mask)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_within_four_standard_deviations(rate):
    mask = np.asarray(dropout_mask(KEY, (2, 4, 128, 256), rate))
    n, p = mask.size, 1.0 - rate
    assert abs(mask.sum() - n * p) <= 4 * np.sqrt(n * p * (1 - p))


def test_different_keys_and_indices_give_different_masks():
    a = np.asarray(dropout_mask(jax.random.key(0), (2, 2, 16, 16), 0.5))
    b = np.asarray(dropout_mask(jax.random.key(1), (2, 2, 16, 16), 0.5))
    assert (a != b).mean() > 0.4
    assert (a[0] != a[1]).mean() > 0.4 and (a[:, 0] != a[:, 1]).mean() > 0.4
    assert np.asarray(dropout_mask(KEY, (1, 1, 4, 4), 0.0)).all()


def inputs(seed=0, dtype=jnp.float32, **kw):
    shape = dict(batch=B, q_len=TQ, kv_len=TK, heads=H, kv_heads=HKV)
    shape.update(kw)
    return make_inputs(seed, *shape.values(), D, dtype)


def check(q, k, v, do, g, rate, rng=KEY, implementation="xla", **kw):
    """run() with dropout against the oracle given ``dropout_mask``'s M; also the reference."""
    got = run(q, k, v, do, g, implementation=implementation, dropout_rate=rate, dropout_rng=rng,
              **kw)
    keep = np.asarray(dropout_mask(rng, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), rate))
    want = tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=tuple(got),
                                             dropout_mask=keep, dropout_rate=rate, **kw)
    ref = reference_attention(q, k, v, dropout_rate=rate, dropout_rng=rng, return_lse=True,
                              **{n: x for n, x in kw.items() if n != "implementation"})
    for name, x in zip(("o", "lse"), ref):
        tolerance.assert_matches_oracle(name, x, want[name],
                                        None if q.dtype == jnp.float32 else
                                        tolerance.baseline(q, k, v, do, g, dropout_mask=keep,
                                                           dropout_rate=rate, **kw)[name])
    return got, want


_RNG = np.random.default_rng(3)
FEATURES = {
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(3, 2), causal_alignment="bottom_right"),
    "lengths": dict(query_seq_lengths=np.array([9, 5]), key_value_seq_lengths=np.array([7, 11])),
    "bias": dict(bias=_RNG.standard_normal((1, H, TQ, TK)).astype(np.float32)),
    "mask": dict(mask=_RNG.random((B, 1, TQ, TK)) > 0.3),
    "segment_ids": dict(query_segment_ids=np.repeat([[1, 1, 2]], 3, 1).repeat(B, 0),
                        key_value_segment_ids=np.array([[1] * 5 + [2] * 6] * B)),
    "soft_cap": dict(logits_soft_cap=2.0),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32)),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_feature_against_the_oracle(blocks, feature):
    """Grouped-query heads (4 query heads, 2 KV heads) with each feature at rate 0.5."""
    check(*inputs(1), 0.5, **FEATURES[feature])


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_rates_and_dtypes_against_the_oracle(rate, dtype):
    dtype = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}[dtype]
    check(*inputs(2, dtype), rate, is_causal=True)


def test_mask_read_back_bit_for_bit(blocks):
    """O[i, :, j] = P_ij Z_ij with V = the identity over keys, and dV[j, :, i] = P_ij Z_ij with
    dO = the identity over rows: both are non-zero exactly where dropout_mask keeps (every P_ij
    > 0 here), on the dense and the blockwise schedule, forward and backward."""
    tq, tk, heads = 7, 13, 2
    q, k, _, _, _ = inputs(4, batch=2, q_len=tq, kv_len=tk, heads=heads, kv_heads=heads)
    v = jnp.broadcast_to(jnp.eye(tk, D)[None, :, None], (2, tk, heads, D))
    do = jnp.broadcast_to(jnp.eye(tq, D)[None, :, None], (2, tq, heads, D))
    rate = 0.5
    o, vjp = jax.vjp(lambda v: flash_attention(q, k, v, dropout_rate=rate, dropout_rng=KEY,
                                               implementation="xla"), v)
    (dv,) = vjp(do)
    keep = np.asarray(dropout_mask(KEY, (2, heads, tq, tk), rate))
    np.testing.assert_array_equal(np.asarray(o)[..., :tk].transpose(0, 2, 1, 3) != 0, keep)
    np.testing.assert_array_equal(np.asarray(dv)[..., :tq].transpose(0, 2, 3, 1) != 0, keep)


def test_check_grads_with_a_fixed_key():
    q, k, v, _, _ = inputs(5, batch=1, q_len=5, kv_len=6, heads=2, kv_heads=1)

    def f(q, k, v):
        return flash_attention(q, k, v, is_causal=True, dropout_rate=0.4, dropout_rng=KEY,
                               implementation="xla")

    check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=5e-3, rtol=5e-3)


def test_vmap_with_batched_keys():
    """Each mapped element uses its own key, as a call per element does (outputs and
    gradients); a rank-3 call is batch entry 0."""
    q, k, v, do, _ = inputs(6)
    keys = jax.random.split(KEY, 3)

    def loss(q, key):
        return jnp.sum(flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=key,
                                       implementation="xla") * do)

    got = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0))(q, keys)
    for n, key in enumerate(keys):
        want = jax.value_and_grad(loss)(q, key)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g[n]), np.asarray(w), rtol=1e-6, atol=1e-6)
    one = flash_attention(q[0], k[0], v[0], dropout_rate=0.5, dropout_rng=KEY)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(flash_attention(
        q[:1], k[:1], v[:1], dropout_rate=0.5, dropout_rng=KEY))[0])


def test_keys_are_traced_operands():
    """A new key reaches a jitted call without retracing; a different key, a different O."""
    q, k, v, _, _ = inputs(7)
    traces = []

    @jax.jit
    def f(key):
        traces.append(1)
        return flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=key)

    a, b = f(jax.random.key(1)), f(jax.random.key(2))
    assert len(traces) == 1 and not np.array_equal(np.asarray(a), np.asarray(b))
    plain = flash_attention(q, k, v)
    np.testing.assert_array_equal(np.asarray(flash_attention(q, k, v, dropout_rate=0.0,
                                                             dropout_rng=KEY)), np.asarray(plain))


def test_fused_implementations_refuse_dropout_or_fall_back(implementation):
    q, k, v, _, _ = inputs(8)
    kw = dict(dropout_rate=0.5, dropout_rng=KEY)
    want = flash_attention(q, k, v, implementation="xla", **kw)
    np.testing.assert_array_equal(np.asarray(flash_attention(q, k, v, **kw)), np.asarray(want))
    if implementation == "xla":
        return
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attention(q, k, v, implementation=implementation, **kw)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_rate=0.1), ValueError, "needs dropout_rng"),
    (dict(dropout_rate=1.0, dropout_rng=KEY), ValueError, "dropout_rate must be in"),
    (dict(dropout_rate=-0.1, dropout_rng=KEY), ValueError, "dropout_rate must be in"),
    (dict(dropout_rate=float("nan"), dropout_rng=KEY), ValueError, "dropout_rate must be in"),
    (dict(dropout_rate="0.1", dropout_rng=KEY), TypeError, "dropout_rate must be a real"),
    (dict(dropout_rate=0.1, dropout_rng=jnp.zeros(2, jnp.int32)), TypeError, "dropout_rng"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.split(KEY)), ValueError, "dropout_rng"),
    (dict(dropout_rate=0.0, dropout_rng=jnp.zeros(3, jnp.uint32)), TypeError, "dropout_rng"),
])
def test_errors_name_the_argument(kwargs, error, match):
    q, k, v, _, _ = inputs(9)
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, **kwargs)


def test_refused_with_a_sequence_axis():
    q, k, v, _, _ = inputs(9)
    with pytest.raises(ValueError, match="dropout_rate > 0 is not supported with sequence_axis"):
        flash_attention(q, k, v, sequence_axis_name="sp", dropout_rate=0.1, dropout_rng=KEY)
