"""The xla implementation's blockwise FlashAttention-2 (jax_flash_metal.xla_attention).

The rest of the suite uses small shapes, which take the dense path; here the size rule is covered
from both sides with the real block sizes, and the blockwise path with shrunken blocks (many
blocks from small shapes) against the float64 oracle: every mask kind, lengths around block
edges, padding full of NaN, NaN placement across blocks, check_grads, determinism. Memory linear
in the sequence length is asserted through the compiled temporary size (a structural property).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from api_helpers import check_against_oracle, make_inputs
from jax_flash_metal import flash_attention, xla_attention

MASKS = [
    dict(),
    dict(is_causal=True),
    dict(is_causal=True, causal_alignment="bottom_right"),
    dict(local_window_size=(5, 3)),
    dict(local_window_size=(None, 9), causal_alignment="bottom_right"),
    dict(is_causal=True, local_window_size=(11, 0), causal_alignment="bottom_right"),
    dict(local_window_size=(0, None)),
]
# (batch, q_len, kv_len, heads, kv_heads): block multiples, one past and one short of them,
# Tq != Tkv both ways, a single query row, GQA.
SHAPES = [(2, 33, 47, 4, 2), (1, 16, 32, 2, 1), (2, 40, 9, 2, 2), (1, 1, 40, 2, 1),
          (2, 17, 31, 4, 1), (1, 24, 24, 2, 2), (2, 9, 65, 2, 1)]


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 query rows x 16 keys, dense only up to 8."""
    jax.clear_caches()  # compiled functions keep the tiling they were lowered with
    monkeypatch.setattr(xla_attention, "DENSE_MAX_LEN", 8)
    monkeypatch.setattr(xla_attention, "BLOCK_Q", 8)
    monkeypatch.setattr(xla_attention, "BLOCK_K", 16)
    yield
    jax.clear_caches()


def test_size_rule():
    limit = xla_attention.DENSE_MAX_LEN
    assert xla_attention.tiling(limit, limit).dense
    assert xla_attention.tiling(1, limit).dense
    for q_len, kv_len in [(limit + 1, limit), (limit, limit + 1), (1, 4 * limit)]:
        t = xla_attention.tiling(q_len, kv_len)
        assert not t.dense
        assert t.nq * t.br >= q_len and t.nk * t.bc >= kv_len
        assert t.br <= xla_attention.BLOCK_Q and t.bc <= xla_attention.BLOCK_K


@pytest.mark.parametrize("q_len,kv_len", [(256, 256), (257, 255), (129, 300)])
def test_both_sides_of_the_dense_limit(q_len, kv_len):
    """The real size rule and block sizes, with lengths and bottom-right causal."""
    q, k, v, do, g = make_inputs(40, 2, q_len, kv_len, 2, 1, 8, jnp.float32)
    check_against_oracle(q, k, v, do, g, implementation="xla", is_causal=True,
                         causal_alignment="bottom_right",
                         query_seq_lengths=jnp.array([q_len, q_len - 3]),
                         key_value_seq_lengths=jnp.array([kv_len - 1, kv_len]))


@pytest.mark.parametrize("n", range(len(MASKS)))
def test_blockwise_matrix(small_blocks, n):
    shape = SHAPES[n % len(SHAPES)]
    q, k, v, do, g = make_inputs(41 + n, *shape, 16, jnp.float32)
    check_against_oracle(q, k, v, do, g, implementation="xla", **MASKS[n])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_blockwise_half_precision(small_blocks, dtype):
    q, k, v, do, g = make_inputs(50, 2, 33, 47, 4, 2, 16, dtype)
    check_against_oracle(q, k, v, do, g, implementation="xla", is_causal=True)


@pytest.mark.parametrize("mask", [MASKS[1], MASKS[2], MASKS[5]])
def test_blockwise_lengths_with_nan_padding(small_blocks, mask):
    """Per-batch lengths (one of them 0) that end inside blocks; NaN in every padded tail."""
    q, k, v, do, g = make_inputs(51, 3, 33, 47, 4, 2, 16, jnp.float32)
    ql, kl = np.array([33, 17, 0]), np.array([9, 47, 30])
    for b in range(3):
        q = q.at[b, ql[b]:].set(jnp.nan)
        k = k.at[b, kl[b]:].set(jnp.nan)
        v = v.at[b, kl[b]:].set(jnp.nan)
        do = do.at[b, ql[b]:].set(jnp.nan)
    check_against_oracle(q, k, v, do, g, implementation="xla", query_seq_lengths=jnp.array(ql),
                         key_value_seq_lengths=jnp.array(kl), **mask)


def test_blockwise_nan_placement(small_blocks):
    """Non-finite q, k, v and dO in different blocks reach exactly the outputs the oracle says."""
    q, k, v, do, g = make_inputs(52, 1, 40, 40, 2, 1, 16, jnp.float32)
    v = v.at[0, 21, 0, 3].set(jnp.nan)
    k = k.at[0, 30, 0, 0].set(jnp.inf)
    q = q.at[0, 12, 1, 7].set(jnp.nan)
    do = do.at[0, 5, 0, 2].set(jnp.nan)
    actual, _ = check_against_oracle(q, k, v, do, g, implementation="xla", is_causal=True,
                                     local_window_size=(12, None))
    o = np.asarray(actual["o"])  # head 0, rows 21..29: only v[21, :, 3] is non-finite there
    assert np.isnan(o[0, 21:30, 0, 3]).all() and np.isfinite(o[0, 21:30, 0, :3]).all()


@pytest.mark.parametrize("blocks", [False, True])
def test_nan_placement_without_hidden_pairs(request, blocks):
    """With no mask of any kind every pair is visible but the zero padding of the last blocks
    (33 rows, 47 keys), and the matmuls place NaN themselves: Inf and NaN in each input reach
    exactly the outputs the oracle says (an Inf value must give NaN, not Inf)."""
    if blocks:
        request.getfixturevalue("small_blocks")
    q, k, v, do, g = make_inputs(55, 2, 33, 47, 4, 2, 16, jnp.float32)
    v = v.at[0, 21, 0, 3].set(jnp.inf)
    k = k.at[1, 40, 1, 0].set(-jnp.inf)
    q = q.at[0, 12, 3, 7].set(jnp.nan)
    do = do.at[1, 5, 0, 2].set(jnp.inf)
    actual, _ = check_against_oracle(q, k, v, do, g, implementation="xla")
    o = np.asarray(actual["o"])
    assert np.isnan(o[0, :, :2, 3]).all() and np.isfinite(o[0, :12, :2, :3]).all()


@pytest.mark.parametrize("kw", [MASKS[0], MASKS[5]])
def test_blockwise_check_grads(small_blocks, kw):
    q, k, v, _, _ = make_inputs(53, 1, 20, 23, 2, 1, 8, jnp.float32)
    check_grads(lambda q, k, v: flash_attention(q, k, v, implementation="xla", **kw),
                (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=5e-3, rtol=5e-3)


def test_blockwise_backward_is_deterministic(small_blocks):
    q, k, v, do, g = make_inputs(54, 2, 33, 47, 4, 1, 16, jnp.float32)

    def grads(q, k, v, do, g):
        f = lambda q, k, v: flash_attention(q, k, v, is_causal=True, return_lse=True,  # noqa
                                            implementation="xla")
        return jax.vjp(f, q, k, v)[1]((do, g))

    first = jax.jit(grads)(q, k, v, do, g)
    again = jax.jit(lambda *a: grads(*a))(q, k, v, do, g)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _fwd_bwd_temp_bytes(seq_len, is_causal):
    shape = (1, seq_len, 2, 16)
    x = jax.ShapeDtypeStruct(shape, jnp.float32)

    def f(q, k, v, ct):
        return jax.vjp(lambda q, k, v: flash_attention(q, k, v, is_causal=is_causal,
                                                       implementation="xla"), q, k, v)[1](ct)

    return jax.jit(f).lower(x, x, x, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("is_causal", [False, True])
def test_memory_linear_in_length(is_causal):
    """Compiled forward+backward temporaries grow about 4x for 4x the length (quadratic would be
    16x) and stay far below one materialised score matrix."""
    short, long = _fwd_bwd_temp_bytes(1024, is_causal), _fwd_bwd_temp_bytes(4096, is_causal)
    assert long <= 5 * short
    assert long < 2 * 4096 * 4096 * 4 / 8  # an eighth of one [heads, T, T] float32 score tensor
