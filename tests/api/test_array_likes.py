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


SEGMENTS = (FEATURES["query_segment_ids"], FEATURES["key_value_segment_ids"])
WIDE_SEGMENTS = [
    # Equal after a cast to int32 (2**32 + 1 wraps to 1), different as given.
    (SEGMENTS[0].astype(np.int64), np.where(SEGMENTS[1] == 1, 2**32 + 1, 0)),
    (SEGMENTS[0].astype(np.uint64), np.where(SEGMENTS[1] == 1, 2**33 + 1, 2**40).astype(np.uint64)),
    # int32 -1 and uint32 2**32 - 1 meet in an int32 cast.
    (np.where(SEGMENTS[0] == 1, -1, 0).astype(np.int32),
     np.where(SEGMENTS[1] == 1, 2**32 - 1, 0).astype(np.uint32)),
]


def _ranks(query_ids, kv_ids):
    """The ids as ranks among both arrays' values compared as Python ints (exact for every
    dtype): the segment structure the oracle sees."""
    both = [int(x) for x in np.concatenate([query_ids.ravel(), kv_ids.ravel()])]
    rank = {x: i for i, x in enumerate(sorted(set(both)))}
    ranks = np.array([rank[x] for x in both], np.int32)
    return (ranks[:query_ids.size].reshape(query_ids.shape),
            ranks[query_ids.size:].reshape(kv_ids.shape))


@pytest.mark.parametrize("query_ids,kv_ids", WIDE_SEGMENTS, ids=["int64", "uint64", "int32-uint32"])
@pytest.mark.parametrize("fn", FUNCTIONS, ids=["flash", "reference"])
def test_segment_ids_compare_exactly(fn, implementation, query_ids, kv_ids):
    """Segment ids keep exactly the equalities they have as given, whatever their dtypes: no
    pair of different ids becomes equal in the int32 the kernels compare."""
    expected_q, expected_kv = _ranks(query_ids, kv_ids)
    _check(fn, implementation, Q, K, V,
           dict(query_segment_ids=expected_q, key_value_segment_ids=expected_kv),
           query_segment_ids=query_ids, key_value_segment_ids=kv_ids)


def test_traced_mixed_segment_id_dtypes_are_exact_or_refused():
    """JAX arrays of int32 and uint32 ids have no exact common dtype without x64: a TypeError
    naming both, not an int32 cast in which -1 and 2**32 - 1 meet."""
    query_ids, kv_ids = WIDE_SEGMENTS[2]
    f = jax.jit(lambda a, b: flash_attention(Q, K, V, query_segment_ids=a,
                                             key_value_segment_ids=b))
    with pytest.raises(TypeError, match="query_segment_ids .int32. and key_value_segment_ids"):
        f(jnp.asarray(query_ids), jnp.asarray(kv_ids))
    expected_q, expected_kv = _ranks(query_ids, kv_ids)  # one dtype: a cast, exact
    tolerance.assert_matches_oracle(
        "o", f(jnp.asarray(expected_q, jnp.uint32), jnp.asarray(expected_kv, jnp.uint32)),
        _oracle_o(Q, K, V, query_segment_ids=expected_q, key_value_segment_ids=expected_kv))


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
