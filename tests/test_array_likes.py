"""Array-likes as jax.nn.dot_product_attention takes them (NumPy arrays, nested Python lists,
scalars) for every array argument, and lengths clamped exactly to [0, len] before the int32 cast
(2**40 means "all of them", not 2**40 mod 2**32 = 0); results against the float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import tolerance
from jax_flash_metal import flash_attention, reference_attention

B, TQ, TKV, H, HKV, D = 2, 5, 7, 2, 1, 8
RNG = np.random.default_rng(0)
Q = RNG.standard_normal((B, TQ, H, D)).astype(np.float32)
K = RNG.standard_normal((B, TKV, HKV, D)).astype(np.float32)
V = RNG.standard_normal((B, TKV, HKV, D)).astype(np.float32)
FEATURES = dict(
    bias=RNG.standard_normal((TQ, TKV)).astype(np.float32),
    mask=np.tril(np.ones((TQ, TKV), bool), 3),
    query_segment_ids=np.array([[0, 0, 1, 1, 1], [0] * TQ], np.int32),
    key_value_segment_ids=np.array([[0, 0, 0, 1, 1, 1, 1], [0] * TKV], np.int32),
    sinks=np.array([0.5, -1.0], np.float32),
    query_seq_lengths=np.array([4, 5], np.int32),
    key_value_seq_lengths=np.array([7, 3], np.int32),
)
FUNCTIONS = [flash_attention, reference_attention]


def _oracle_o(q, k, v, **kw):
    return oracle.attention(q, k, v, **kw)[0]


def _check(fn, implementation, q, k, v, expected_kw, **kw):
    extra = {} if fn is reference_attention else dict(implementation=implementation)
    out = fn(q, k, v, **kw, **extra)
    tolerance.assert_matches_oracle("o", out, _oracle_o(Q, K, V, **expected_kw))


@pytest.mark.parametrize("fn", FUNCTIONS, ids=["flash", "reference"])
@pytest.mark.parametrize("kind", ["numpy", "list"])
def test_every_array_argument(fn, implementation, kind):
    """query/key/value and every optional array as NumPy arrays or nested Python lists."""
    convert = (lambda x: x) if kind == "numpy" else (lambda x: x.tolist())
    _check(fn, implementation, convert(Q), convert(K), convert(V), FEATURES,
           **{name: convert(x) for name, x in FEATURES.items()})


@pytest.mark.parametrize("fn", FUNCTIONS, ids=["flash", "reference"])
def test_scalar_bias_and_mask(fn, implementation):
    """A scalar bias shifts every score (the softmax does not change); a scalar False mask hides
    every key (rows output 0), as in jax.nn."""
    _check(fn, implementation, Q, K, V, dict(bias=np.full((TQ, TKV), 3.0, np.float32)),
           bias=3.0)
    _check(fn, implementation, Q, K, V, dict(mask=np.zeros((TQ, TKV), bool)), mask=False)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=["flash", "reference"])
@pytest.mark.parametrize("lengths,clamped", [
    (np.array([2**40, 3]), [TKV, 3]),               # int64 past int32: all keys, not 0
    (np.array([2**32 + 2, 3], np.uint64), [TKV, 3]),
    (np.array([-2**40, 2**31]), [0, TKV]),          # negative: none
    ([2**40, 3], [TKV, 3]),                         # a Python list too
], ids=["int64", "uint64", "negative", "list"])
def test_concrete_lengths_clamp_exactly(fn, implementation, lengths, clamped):
    _check(fn, implementation, Q, K, V, dict(key_value_seq_lengths=np.array(clamped)),
           key_value_seq_lengths=lengths)


def test_traced_narrow_lengths_clamp_in_their_dtype():
    """A traced int8 length against kv_len 130: the bound 130 does not fit int8, so clamping
    with it in int8 would wrap it to a negative bound."""
    q, k, v = (x[:, :2] for x in (Q, K, V))
    k, v = (np.concatenate([x] * 19, axis=1)[:, :130] for x in (k, v))
    f = jax.jit(lambda lengths: flash_attention(q, k, v, key_value_seq_lengths=lengths))
    out = f(jnp.array([5, 100], jnp.int8))
    tolerance.assert_matches_oracle(
        "o", out, _oracle_o(q, k, v, key_value_seq_lengths=np.array([5, 100])))


@pytest.mark.parametrize("overrides,text", [
    (dict(key=[[1.0], [2.0, 3.0]]), "key must be an array-like"),
    (dict(mask="yes"), "mask must be an array-like"),
    (dict(key_value_seq_lengths=[1, "2"]), "key_value_seq_lengths must have an integer dtype"),
    (dict(key_value_seq_lengths=[[1], [2, 3]]), "key_value_seq_lengths must be an array-like"),
    (dict(sinks=object()), "sinks must be an array-like"),
], ids=["ragged", "string", "string-list", "ragged-lengths", "object"])
@pytest.mark.parametrize("fn", FUNCTIONS, ids=["flash", "reference"])
def test_not_array_like_is_a_type_error(fn, overrides, text):
    args = dict(query=Q, key=K, value=V)
    args.update(overrides)
    with pytest.raises(TypeError, match=text):
        fn(args.pop("query"), args.pop("key"), args.pop("value"), **args)
