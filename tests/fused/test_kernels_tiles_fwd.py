"""The tiled forward kernel around its tile shapes (shaders/tile_shapes.h), on the emulator.

Lengths just below, at and above each family's query block BQ and key block BK (and several
blocks plus one), causal with q_len much larger and much smaller than kv_len, windows narrower
than a key block, grouped-query groups of 1 to 8, bit-identical results under every emulator
schedule, and a bounded random differential test over the feature space (fixed seeds). Forward
only (O, LSE and the residuals) against the float64 oracle with the tolerances of
docs/testing.md#tolerances; the backward has its own tests.
"""

import numpy as np
import pytest

import kernel_harness as kh

# One (dtype, head dim) per forward family of tile_shapes.h: every BQ/BK and K/V layout.
FAMILIES = [("f16", 16), ("bf16", 64), ("f32", 32), ("bf16", 128), ("f32", 112), ("f16", 192),
            ("f32", 256)]


def _inputs(dtype, batch, q_len, kv_len, heads, kv_heads, head_dim, seed=0, **lengths):
    return kh.random_inputs(kh.DTYPES[dtype], batch, q_len, kv_len, heads, kv_heads, head_dim,
                            seed=seed, **lengths)[:3]


@pytest.mark.parametrize("dtype,head_dim", FAMILIES)
def test_lengths_around_the_tiles(dtype, head_dim):
    """q_len and kv_len at tile - 1, tile, tile + 1 and 3 tiles + 1, causal or not, one length
    buffer cutting a block in the middle."""
    bq, bk = kh.blocks("fwd", dtype, head_dim)
    for n, (q_len, kv_len) in enumerate(zip((bq - 1, bq, bq + 1, 3 * bq + 1),
                                            (bk + 1, bk - 1, 3 * bk + 1, bk))):
        mask = dict(is_causal=n % 2 == 1, causal_alignment="bottom_right" if n == 3 else
                    "top_left")
        q, k, v = _inputs(dtype, 1, q_len, kv_len, 2, 1, head_dim, seed=n)
        kh.check_forward_against_oracle(q, k, v, **mask)
    lengths = dict(query_seq_lengths=np.array([bq // 2 + 1], np.int32),
                   key_value_seq_lengths=np.array([bk + bk // 2], np.int32))
    q, k, v = _inputs(dtype, 1, 2 * bq, 2 * bk, 1, 1, head_dim, seed=9, **lengths)
    kh.check_forward_against_oracle(q, k, v, is_causal=True, **lengths)


@pytest.mark.parametrize("dtype,head_dim", [("f32", 16), ("bf16", 128)])
@pytest.mark.parametrize("q_len,kv_len", [(150, 7), (5, 150)])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_with_unequal_lengths(dtype, head_dim, q_len, kv_len, alignment):
    """Many more queries than keys (most blocks empty or one edge tile) and the reverse (one
    query block against many key blocks, full ones included)."""
    q, k, v = _inputs(dtype, 1, q_len, kv_len, 2, 2, head_dim, seed=q_len)
    kh.check_forward_against_oracle(q, k, v, is_causal=True, causal_alignment=alignment)


@pytest.mark.parametrize("dtype,head_dim", [("f16", 32), ("f32", 128)])
@pytest.mark.parametrize("window,causal", [((3, 2), False), ((0, 5), False), ((7, 0), True),
                                           ((0, 0), False)])
def test_windows_narrower_than_a_tile(dtype, head_dim, window, causal):
    """A band a few keys wide crosses key blocks at every row block: edge tiles only."""
    q, k, v = _inputs(dtype, 1, 70, 90, 1, 1, head_dim, seed=4)
    kh.check_forward_against_oracle(q, k, v, local_window_size=window, is_causal=causal)


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_grouped_query_groups(kv_heads):
    """8 query heads over 8, 4, 2 or 1 kv heads (groups of 1, 2, 4, 8)."""
    q, k, v = _inputs("bf16", 2, 33, 40, 8, kv_heads, 16, seed=kv_heads)
    kh.check_forward_against_oracle(q, k, v, is_causal=kv_heads % 2 == 0)


@pytest.mark.parametrize("dtype,head_dim", [("f16", 64), ("f32", 128), ("f32", 256)])
def test_schedules_are_bit_identical(dtype, head_dim):
    """Barriers order every tile load before its use: resume order cannot change a bit."""
    bq, bk = kh.blocks("fwd", dtype, head_dim)
    mask = dict(is_causal=True, local_window_size=(bk + 3, None),
                query_seq_lengths=np.array([2 * bq + 1, bq], np.int32),
                key_value_seq_lengths=np.array([2 * bk + 5, 2 * bk], np.int32))
    q, k, v = _inputs(dtype, 2, 2 * bq + 3, 2 * bk + 7, 2, 1, head_dim, seed=7,
                      query_seq_lengths=mask["query_seq_lengths"],
                      key_value_seq_lengths=mask["key_value_seq_lengths"])
    reference = kh.check_forward_against_oracle(q, k, v, **mask)
    for schedule, seed in (("reverse", 0), ("random", 1), ("random", 2)):
        o, lse, residuals = kh.forward(q, k, v, schedule=schedule, seed=seed, **mask)
        for name, x in zip(("o", "lse", "row_max", "log_sum"), (o, lse, *residuals)):
            assert x.tobytes() == reference[name].tobytes(), (schedule, seed, name)


def _random_problem(index):
    """Problem `index` of a fixed-seed draw over the forward's feature space: dtype, head dim,
    shapes, GQA, causal with either alignment, windows (a side may be unbounded), per-batch
    lengths (clamped from either side), scale."""
    rng = np.random.default_rng([2026, index])
    dtype = str(rng.choice(list(kh.DTYPES)))
    head_dim = int(rng.choice(kh.HEAD_DIMS))
    kv_heads = int(rng.choice([1, 2]))
    heads = kv_heads * int(rng.choice([1, 2, 4]))
    batch = int(rng.integers(1, 3))
    q_len, kv_len = int(rng.integers(1, 90)), int(rng.integers(1, 90))
    mask = dict(is_causal=bool(rng.integers(2)),
                causal_alignment=str(rng.choice(["top_left", "bottom_right"])),
                scale=None if rng.integers(2) else float(rng.uniform(-0.5, 0.5)))
    if rng.integers(2):
        mask["local_window_size"] = tuple(
            None if rng.integers(3) == 0 else int(rng.integers(0, 40)) for _ in range(2))
    if rng.integers(2):
        mask["query_seq_lengths"] = rng.integers(-2, q_len + 3, batch).astype(np.int32)
        mask["key_value_seq_lengths"] = rng.integers(-2, kv_len + 3, batch).astype(np.int32)
    return dtype, head_dim, batch, q_len, kv_len, heads, kv_heads, mask


@pytest.mark.parametrize("index", range(10))
def test_random_problems_match_the_oracle(index):
    """A bounded random differential test (fixed seeds, small shapes): emulator vs oracle."""
    dtype, head_dim, batch, q_len, kv_len, heads, kv_heads, mask = _random_problem(index)
    q, k, v = _inputs(dtype, batch, q_len, kv_len, heads, kv_heads, head_dim, seed=index,
                      query_seq_lengths=mask.get("query_seq_lengths"),
                      key_value_seq_lengths=mask.get("key_value_seq_lengths"))
    kh.check_forward_against_oracle(q, k, v, **mask)
