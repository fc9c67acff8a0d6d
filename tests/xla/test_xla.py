"""The xla implementation's blockwise FlashAttention-2 (jax_flash_metal.xla.attention).

The rest of the suite uses small shapes, which take the dense path; here the size rule is covered
from both sides with the real block sizes, and the blockwise path with shrunken blocks (many
blocks from small shapes) against the float64 oracle: every mask kind, lengths around block
edges, padding full of NaN, NaN placement across blocks, check_grads, determinism, each with
square blocks and with Br != Bc (``xla_schedule``). Memory linear in the sequence
length is asserted through the compiled temporary size, and the accelerators' large tiles through
the StableHLO lowered for cuda (structural properties).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from api_helpers import (check_against_oracle, f64, make_inputs, normal, run_flash,
                         use_xla_schedule)
from jax_flash_metal import flash_attention
from jax_flash_metal.xla import blocks as xla_blocks
from jax_flash_metal.xla import schedule as xla_schedule
from jax_flash_metal.xla import tiles

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


# Schedules scaled down (many blocks from small shapes, dense only up to 8): square blocks with
# pinned transposes, as the cpu one in xla_schedule, and Br != Bc (the accelerators' longer
# inner blocks, which only half operands take, are HALF["blocks"]'s below).
SMALL = {"square": xla_schedule.Schedule(dense_max_len=8, block_q=8, block_k=8,
                                         pinned_transposes=True),
         "wide": xla_schedule.Schedule(dense_max_len=8, block_q=8, block_k=16)}


def _use_small(monkeypatch, name):
    use_xla_schedule(monkeypatch, SMALL[name])


@pytest.fixture(params=list(SMALL))
def small_blocks(request, monkeypatch):
    _use_small(monkeypatch, request.param)
    yield
    jax.clear_caches()


@pytest.mark.parametrize("platform", ["cpu", "cuda", "METAL"])
def test_size_rule(platform):
    schedule = xla_schedule.for_platform(platform)
    assert schedule == xla_schedule.SCHEDULES["cpu" if platform == "cpu" else "default"]
    limit = schedule.dense_max_len
    assert xla_blocks.tiling(limit, limit, schedule).dense
    assert xla_blocks.tiling(1, limit, schedule).dense
    for q_len, kv_len in [(limit + 1, limit), (limit, limit + 1), (1, 4 * limit)]:
        t = xla_blocks.tiling(q_len, kv_len, schedule)
        assert not t.dense
        assert t.nq * t.br >= q_len and t.nk * t.bc >= kv_len
        assert t.br <= schedule.block_q and t.bc <= schedule.block_k


def test_inner_block_where_the_band_skips_nothing():
    """The accelerators' schedule: for half operands without causal or window masks
    (``long_inner``) the forward's key blocks and the backward's query blocks (each loop's
    inner ones) take ``inner_block``; otherwise, and on cpu, every tile is block_q x block_k."""
    schedule = xla_schedule.SCHEDULES["default"]
    n = 4 * schedule.inner_block
    forward = xla_blocks.tiling(n, n, schedule, long_inner=True)
    backward = xla_blocks.tiling(n, n, schedule, long_inner=True, backward=True)
    assert (forward.br, forward.bc) == (schedule.block_q, schedule.inner_block)
    assert (backward.br, backward.bc) == (schedule.inner_block, schedule.block_k)
    for name, long_inner, is_backward in [("default", False, False), ("default", False, True),
                                          ("cpu", True, True)]:
        s = xla_schedule.SCHEDULES[name]
        t = xla_blocks.tiling(n, n, s, long_inner=long_inner, backward=is_backward)
        assert (t.br, t.bc) == (s.block_q, s.block_k)


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


# The accelerators' half-precision arithmetic (``half_operands``: half operands, float32
# accumulation, the scale applied to float32 scores), on the dense tile (with its one-pass row
# statistics) and on blocks (without causal or window masks: forward 8 x 24, backward 24 x 16
# tiles).
HALF = {"dense": xla_schedule.Schedule(dense_max_len=64, block_q=8, block_k=8,
                                       half_operands=True, one_pass_statistics=True),
        "blocks": xla_schedule.Schedule(dense_max_len=8, block_q=8, block_k=16,
                                        half_operands=True, inner_block=24)}


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("schedule", list(HALF))
@pytest.mark.parametrize("mask", [MASKS[0], MASKS[5]])
def test_half_operands(monkeypatch, schedule, dtype, mask):
    use_xla_schedule(monkeypatch, HALF[schedule])
    q, k, v, do, g = make_inputs(56, 2, 33, 47, 4, 2, 16, dtype)
    check_against_oracle(q, k, v, do, g, implementation="xla",
                         key_value_seq_lengths=jnp.array([47, 30]), **mask)
    jax.clear_caches()


@pytest.mark.parametrize("schedule", list(HALF))
def test_half_operands_one_hot_softmax(monkeypatch, schedule):
    """Scores of about 1e4 (q = k = v = 30 N(0, 1)): each row's softmax is one-hot, so exact
    gradients are about 0, and a recomputed P whose row sums to 1 + 1e-3 must not make them
    1e-3 |dP| (case C-07 with half operands)."""
    use_xla_schedule(monkeypatch, HALF[schedule])
    x = normal(np.random.default_rng(0), (1, 40, 2, 128), jnp.bfloat16, scale=30.0)
    do = normal(np.random.default_rng(1), (1, 40, 2, 128), jnp.bfloat16)
    actual = run_flash(x, x, x, do, implementation="xla")
    for name in ("dq", "dk"):
        assert np.abs(f64(actual[name])).max() <= 1e-3 * np.abs(f64(x)).max(), name
    jax.clear_caches()


def test_one_pass_row_statistics():
    """xla_tiles.row_statistics against float64 numpy: m = max(LOWEST, max s) and
    l = sum exp(s - m), for rows with scores far apart, hidden pairs (-inf), no visible score,
    a NaN, and one score."""
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((6, 37)) * np.array([[1.0], [30.0], [1e4], [1.0], [1.0], [1.0]]))
    s[3, ::2] = -np.inf
    s[4] = -np.inf
    s[5, 7] = np.nan
    s = s.astype(np.float32)
    m, l = jax.jit(tiles.row_statistics)(jnp.asarray(s))
    m, l = np.asarray(m), np.asarray(l)
    want_m = np.maximum(np.max(s[:5].astype(np.float64), axis=1), tiles.LOWEST)
    want_l = np.sum(np.exp(s[:5].astype(np.float64) - want_m[:, None]), axis=1)
    np.testing.assert_array_equal(m[:5], want_m.astype(np.float32))
    np.testing.assert_allclose(l[:5], want_l, rtol=1e-5)
    assert l[4] == 0 and np.isnan(m[5]) and np.isnan(l[5])
    one = np.asarray(jax.jit(tiles.row_statistics)(jnp.full((2, 1), 3.0)))
    np.testing.assert_array_equal(one, [[3.0, 3.0], [1.0, 1.0]])


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


@pytest.mark.parametrize("blocks", [None, *SMALL])
def test_nan_placement_without_hidden_pairs(monkeypatch, blocks):
    """With no mask of any kind every pair is visible but the zero padding of the last blocks
    (33 rows, 47 keys), and the matmuls place NaN themselves: Inf and NaN in each input reach
    exactly the outputs the oracle says (an Inf value must give NaN, not Inf)."""
    if blocks is not None:
        _use_small(monkeypatch, blocks)
    q, k, v, do, g = make_inputs(55, 2, 33, 47, 4, 2, 16, jnp.float32)
    v = v.at[0, 21, 0, 3].set(jnp.inf)
    k = k.at[1, 40, 1, 0].set(-jnp.inf)
    q = q.at[0, 12, 3, 7].set(jnp.nan)
    do = do.at[1, 5, 0, 2].set(jnp.inf)
    actual, _ = check_against_oracle(q, k, v, do, g, implementation="xla")
    o = np.asarray(actual["o"])
    assert np.isnan(o[0, :, :2, 3]).all() and np.isfinite(o[0, :12, :2, :3]).all()
    jax.clear_caches()


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


def _fwd_bwd(is_causal):
    def f(q, k, v, ct):
        return jax.vjp(lambda q, k, v: flash_attention(q, k, v, is_causal=is_causal,
                                                       implementation="xla"), q, k, v)[1](ct)
    return f


def _fwd_bwd_temp_bytes(seq_len, is_causal):
    x = jax.ShapeDtypeStruct((1, seq_len, 2, 16), jnp.float32)
    compiled = jax.jit(_fwd_bwd(is_causal)).lower(x, x, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("is_causal", [False, True])
def test_memory_linear_in_length(is_causal):
    """Compiled forward+backward temporaries grow about 4x for 4x the length (quadratic would be
    16x) and stay far below one materialised score matrix, at 8 and 32 blocks of the schedule of
    the platform the suite runs on."""
    schedule = xla_schedule.for_platform(jax.default_backend())
    length = 8 * max(schedule.block_q, schedule.block_k)
    short, long = _fwd_bwd_temp_bytes(length, is_causal), _fwd_bwd_temp_bytes(4 * length,
                                                                              is_causal)
    assert long <= 5 * short
    assert long < 2 * (4 * length) ** 2 * 4 / 8  # an eighth of a [heads, T, T] float32 tensor


def _elements(tensor_type):
    """The element count of a StableHLO tensor type's dims ("4x16x1024" -> 65536)."""
    return int(np.prod([int(n) for n in tensor_type.split("x")]))


def test_accelerator_lowering_has_large_tiles():
    """Lowered for cuda (no GPU needed), a causal bfloat16 forward+backward at length 16384
    (batch 4, 16 heads, head dim 128) multiplies score tiles of at least 2^24 elements (a few
    large loop iterations, not many tiny kernels) and holds no tensor of more than 1/8 of the
    batch x heads x q_len x kv_len score elements (memory stays linear)."""
    b, t, h, d = 4, 16384, 16, 128
    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    text = jax.jit(_fwd_bwd(True)).trace(x, x, x, x).lower(
        lowering_platforms=("cuda",)).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*->\s*tensor<([0-9x]+)x[a-z]", text)
    assert dots and max(_elements(s) for s in dots) >= 2 ** 24
    largest = max(_elements(s) for s in re.findall(r"tensor<([0-9x]+)x[a-z]", text))
    assert largest <= b * h * t * t // 8
