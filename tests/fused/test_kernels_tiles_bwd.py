"""The tiled backward kernels around their tile shapes (shaders/tile_shapes.h), on the emulator.

Forward and backward (O, LSE, dQ, dK, dV) against the float64 oracle with the tolerances of
docs/testing.md#tolerances: lengths just below, at and above each backward family's owner block
(query rows of dQ, key rows of dK/dV) and streamed block, several blocks plus one, causal with q_len
much larger and much smaller than kv_len, windows narrower than a block, grouped-query groups of 1
to 8, the split dK/dV kernels and the one-streamed-tile kernels, exact one-hot rows, and
bit-identical results under every emulator schedule.
"""

import numpy as np
import pytest

import kernel_harness as kh
import oracle
import tolerance
from jax_flash_metal._ext import bwd_stages

# One (dtype, head dim) per backward family of tile_shapes.h: 32/32, 32/16, 16/8 (one dK/dV
# kernel), 16/8 split, 8/8 with one streamed tile (split), and the smallest head dim.
FAMILIES = [("f16", 16), ("f32", 64), ("bf16", 128), ("f32", 112), ("f16", 192), ("f32", 160),
            ("bf16", 8)]


def _inputs(dtype, batch, q_len, kv_len, heads, kv_heads, head_dim, seed=0, **lengths):
    return kh.random_inputs(kh.DTYPES[dtype], batch, q_len, kv_len, heads, kv_heads, head_dim,
                            seed=seed, **lengths)


def test_families_cover_every_layout():
    """The FAMILIES above reach every backward layout the table has."""
    layouts = set()
    for dtype, head_dim in FAMILIES:
        layouts.add((kh.blocks("bwd_dq", dtype, head_dim), tuple(bwd_stages(head_dim))))
    assert {rows for (rows, _), _ in layouts} == {8, 16, 32}
    assert {cols for (_, cols), _ in layouts} == {8, 16, 32}
    assert {len(stages) for _, stages in layouts} == {2, 3}


@pytest.mark.parametrize("dtype,head_dim", FAMILIES)
def test_lengths_around_the_tiles(dtype, head_dim):
    """q_len and kv_len at block - 1, block, block + 1 and 3 blocks + 1 of the owner and the
    streamed block, causal or not, and length buffers cutting blocks in the middle."""
    rows, cols = kh.blocks("bwd_dq", dtype, head_dim)
    pairs = [(rows - 1, cols + 1), (rows, cols - 1), (rows + 1, 3 * cols + 1),
             (3 * rows + 1, cols)]
    for n, (q_len, kv_len) in enumerate(pairs):
        mask = dict(is_causal=n % 2 == 1,
                    causal_alignment="bottom_right" if n == 3 else "top_left")
        kh.check_against_oracle(*_inputs(dtype, 1, q_len, kv_len, 2, 1, head_dim, seed=n),
                                **mask)
    lengths = dict(query_seq_lengths=np.array([rows // 2 + 1], np.int32),
                   key_value_seq_lengths=np.array([cols + cols // 2], np.int32))
    kh.check_against_oracle(*_inputs(dtype, 1, 2 * rows, 2 * cols + 1, 1, 1, head_dim, seed=9,
                                     **lengths), is_causal=True, **lengths)


@pytest.mark.parametrize("dtype,head_dim", [("f32", 16), ("bf16", 96)])
@pytest.mark.parametrize("q_len,kv_len", [(100, 7), (5, 100)])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_with_unequal_lengths(dtype, head_dim, q_len, kv_len, alignment):
    """Many more queries than keys (empty query blocks, keys seen by long query ranges) and the
    reverse (keys no query sees get exactly zero gradients)."""
    got = kh.check_against_oracle(*_inputs(dtype, 1, q_len, kv_len, 2, 2, head_dim, seed=q_len),
                                  is_causal=True, causal_alignment=alignment)
    if q_len < kv_len and alignment == "top_left":  # keys past the last query's diagonal
        for name in ("dk", "dv"):
            assert (np.asarray(got[name][:, q_len:], np.float64) == 0).all(), name


@pytest.mark.parametrize("dtype,head_dim", [("f16", 32), ("f32", 128)])
@pytest.mark.parametrize("window,causal", [((3, 2), False), ((0, 5), False), ((7, 0), True)])
def test_windows_narrower_than_a_tile(dtype, head_dim, window, causal):
    """A band a few keys wide crosses blocks at every owner block: edge tiles only."""
    kh.check_against_oracle(*_inputs(dtype, 1, 45, 51, 1, 1, head_dim, seed=4),
                            local_window_size=window, is_causal=causal)


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_grouped_query_groups(kv_heads):
    """8 query heads over 8, 4, 2 or 1 kv heads: dK/dV sum over the group in a fixed order."""
    kh.check_against_oracle(*_inputs("bf16", 2, 21, 40, 8, kv_heads, 16, seed=kv_heads),
                            is_causal=kv_heads % 2 == 0)


@pytest.mark.parametrize("dtype,head_dim", [("f32", 8), ("bf16", 72), ("f16", 112),
                                            ("f32", 192)])
def test_one_hot_rows_are_exact(dtype, head_dim):
    """Window (0, 0): every row sees only its own key, so P = 1 exactly in the backward
    (scores bit-identical to the forward's): dV = dO bit for bit, and dP - D = 0 exactly, so
    dQ = dK = 0."""
    q, k, v, do, g_lse = _inputs(dtype, 1, 19, 19, 2, 1, head_dim, seed=6)
    o, _, residuals = kh.forward(q, k, v, local_window_size=(0, 0))
    dq, dk, dv, _ = kh.backward(q, k, v, o, residuals, do, None, local_window_size=(0, 0))
    dv_sum = do[:, :, 0].astype(np.float32) + do[:, :, 1].astype(np.float32)  # 2 query heads
    assert dv[:, :, 0].tobytes() == dv_sum.astype(dv.dtype).tobytes()
    assert (np.asarray(dq, np.float64) == 0).all() and (np.asarray(dk, np.float64) == 0).all()


@pytest.mark.parametrize("dtype,head_dim", [("f16", 64), ("bf16", 128), ("f32", 160)])
def test_schedules_are_bit_identical(dtype, head_dim):
    """Every output tile has one owner and a fixed reduction order; barriers order every tile
    load before its use: resume order cannot change a bit."""
    rows, cols = kh.blocks("bwd_dq", dtype, head_dim)
    mask = dict(is_causal=True, local_window_size=(cols + 3, None),
                query_seq_lengths=np.array([2 * rows + 1, rows], np.int32),
                key_value_seq_lengths=np.array([2 * cols + 5, 2 * cols], np.int32))
    q, k, v, do, g_lse = _inputs(dtype, 2, 2 * rows + 3, 2 * cols + 7, 4, 2, head_dim, seed=7,
                                 query_seq_lengths=mask["query_seq_lengths"],
                                 key_value_seq_lengths=mask["key_value_seq_lengths"])
    reference = kh.check_against_oracle(q, k, v, do, g_lse, **mask)
    for schedule, seed in (("reverse", 0), ("random", 1), ("random", 2)):
        got = kh.backward(q, k, v, reference["o"],
                          (reference["row_max"], reference["log_sum"]), do, g_lse,
                          schedule=schedule, seed=seed, **mask)
        for name, x in zip(("dq", "dk", "dv", "delta"), got):
            assert x.tobytes() == reference[name].tobytes(), (schedule, seed, name)


@pytest.mark.parametrize("dtype,head_dim", [("f32", 16), ("f16", 64), ("f32", 160)])
def test_dbias_is_written_everywhere(dtype, head_dim):
    """With bias_grad the dQ kernel writes every element of dbias [B, H, Tq, Tkv] (outputs start
    as NaN): dS = P (dP - D) where visible, 0 in skipped key blocks, hidden entries and rows past
    the lengths; a zero full-shape bias leaves the scores as they are, so the oracle's dbias is
    dS. The other gradients are bit for bit those without bias_grad."""
    rows, cols = kh.blocks("bwd_dq", dtype, head_dim)
    lengths = dict(query_seq_lengths=np.array([rows + 5, rows // 2], np.int32),
                   key_value_seq_lengths=np.array([3 * cols + 2, cols + 1], np.int32))
    mask = dict(is_causal=True, local_window_size=(cols // 2, 3), **lengths)
    q, k, v, do, g_lse = _inputs(dtype, 2, rows + 5, 3 * cols + 2, 4, 2, head_dim, seed=8,
                                 **lengths)
    o, _, residuals = kh.forward(q, k, v, **mask)
    *grads, dbias = kh.backward(q, k, v, o, residuals, do, g_lse, bias_grad=True, **mask)
    zero_bias = dict(bias=np.zeros(dbias.shape, np.float32), **mask)
    want = oracle.gradients(q, k, v, do, g_lse, **zero_bias)["dbias"]
    base = None if dtype == "f32" else tolerance.baseline(
        *kh.yardstick_inputs(q, k, v, do, g_lse, mask), **zero_bias)["dbias"]
    tolerance.assert_matches_oracle("dbias", dbias, want, base, input_dtype=q.dtype)
    assert (dbias[want == 0] == 0).all()
    for got, plain in zip(grads, kh.backward(q, k, v, o, residuals, do, g_lse, **mask)):
        assert got.tobytes() == plain.tobytes()
