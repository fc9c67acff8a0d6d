"""The attention kernels (shaders/*.metal) on the MSL-on-CPU emulator vs the float64 oracle.

The matrix covers every dtype x head dim once, and rotates masking (causal, windows, both
alignments), GQA ratios, odd lengths, Tq != Tkv, length buffers (with NaN padding the kernels
must never read) and literal scales across those runs, so each feature meets every dtype with
small shapes. Further tests pin down exact properties: schedule independence, padding
isolation, empty rows, zero-size launches, NaN propagation.
"""

import itertools

import numpy as np
import pytest

import kernel_harness as kh
import oracle
from jax_flash_metal._ext import bwd_stages, emulator

MASKS = [
    dict(),
    dict(is_causal=True),
    dict(is_causal=True, causal_alignment="bottom_right"),
    dict(local_window_size=(3, 5)),
    dict(local_window_size=(7, 0), causal_alignment="bottom_right"),
    dict(is_causal=True, local_window_size=(16, None)),
    dict(local_window_size=(None, 2), causal_alignment="bottom_right"),
    dict(local_window_size=4, is_causal=True, causal_alignment="bottom_right"),
]
LENGTHS = [(17, 33), (65, 17), (1, 129), (33, 33), (129, 65), (17, 1), (33, 65)]
HEADS = [(4, 2), (4, 1), (2, 2)]
SCALES = [None, None, None, 0.37, -0.25]


def _matrix():
    cases = []
    for n, (dtype, head_dim) in enumerate(itertools.product(kh.DTYPES, kh.HEAD_DIMS)):
        q_len, kv_len = LENGTHS[n % len(LENGTHS)]
        heads, kv_heads = HEADS[n % len(HEADS)]
        mask = dict(MASKS[n % len(MASKS)], scale=SCALES[n % len(SCALES)])
        batch = 1
        if n % 2:  # with length buffers: one short row range, one clamped from above/below
            batch = 2
            mask["query_seq_lengths"] = np.array([q_len - q_len // 3, q_len + 5], np.int32)
            mask["key_value_seq_lengths"] = np.array([kv_len // 2 + 1, -3 if n % 3 else kv_len],
                                                     np.int32)
        name = (f"{dtype}-d{head_dim}-q{q_len}-kv{kv_len}-h{heads}/{kv_heads}-m{n % len(MASKS)}"
                f"-s{mask['scale']}-{'len' if n % 2 else 'full'}")
        cases.append(pytest.param(dtype, head_dim, batch, q_len, kv_len, heads, kv_heads, mask,
                                  id=name))
    return cases


@pytest.mark.parametrize("dtype,head_dim,batch,q_len,kv_len,heads,kv_heads,mask", _matrix())
def test_matrix_matches_oracle(dtype, head_dim, batch, q_len, kv_len, heads, kv_heads, mask):
    q, k, v, do, g_lse = kh.random_inputs(
        kh.DTYPES[dtype], batch, q_len, kv_len, heads, kv_heads, head_dim, seed=head_dim,
        query_seq_lengths=mask.get("query_seq_lengths"),
        key_value_seq_lengths=mask.get("key_value_seq_lengths"))
    kh.check_against_oracle(q, k, v, do, g_lse, **mask)


def test_every_kernel_is_instantiated():
    names = set(emulator.kernel_names())
    for dtype, head_dim in itertools.product(kh.DTYPES.values(), kh.HEAD_DIMS):
        for stage in ("fwd", *bwd_stages(head_dim)):
            assert kh.kernel_name(stage, dtype, head_dim) in names


def _run_all(q, k, v, do, g_lse, schedule="forward", seed=0, **mask):
    o, lse, residuals = kh.forward(q, k, v, schedule=schedule, seed=seed, **mask)
    dq, dk, dv, delta = kh.backward(q, k, v, o, residuals, do, g_lse, schedule=schedule,
                                    seed=seed, **mask)
    return dict(o=o, lse=lse, row_max=residuals[0], log_sum=residuals[1], dq=dq, dk=dk, dv=dv,
                delta=delta)


def _assert_bit_identical(a, b):
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("dtype,head_dim,mask", [
    ("f32", 48, dict(is_causal=True, query_seq_lengths=np.array([30, 9], np.int32),
                     key_value_seq_lengths=np.array([40, 21], np.int32))),
    ("bf16", 80, dict(local_window_size=(5, 9), causal_alignment="bottom_right")),
    ("f16", 256, dict(is_causal=True, local_window_size=(40, 3))),
    # Dropout with rows and keys at strided global positions (one Philox call per key).
    ("f32", 64, dict(is_causal=True, dropout_rate=0.5, dropout=np.concatenate([
        np.tile(np.array([7, 9], np.uint32), (2, 4, 1)),
        np.stack(np.meshgrid(np.arange(2), np.arange(4), indexing="ij"), -1).astype(np.uint32),
        np.tile(np.array([5, 3, 3, 2], np.uint32), (2, 4, 1))], axis=-1))),
])
def test_schedules_are_bit_identical(dtype, head_dim, mask):
    """Each output element is written by one simdgroup: resume order cannot change a bit."""
    q, k, v, do, g_lse = kh.random_inputs(
        kh.DTYPES[dtype], 2, 37, 45, 4, 2, head_dim, seed=3,
        query_seq_lengths=mask.get("query_seq_lengths"),
        key_value_seq_lengths=mask.get("key_value_seq_lengths"))
    reference = _run_all(q, k, v, do, g_lse, **mask)
    _assert_bit_identical(reference, _run_all(q, k, v, do, g_lse, **mask))
    _assert_bit_identical(reference, _run_all(q, k, v, do, g_lse, schedule="reverse", **mask))
    for seed in (1, 2):
        _assert_bit_identical(reference,
                              _run_all(q, k, v, do, g_lse, schedule="random", seed=seed, **mask))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_padding_past_lengths_is_never_read(dtype):
    """NaN, Inf or zeros past q_len/kv_len give bit-identical, finite results."""
    mask = dict(is_causal=True, causal_alignment="bottom_right",
                query_seq_lengths=np.array([7, 33], np.int32),
                key_value_seq_lengths=np.array([19, 40], np.int32))
    results = []
    for pad in (np.nan, np.inf, 0.0):
        q, k, v, do, g_lse = kh.random_inputs(kh.DTYPES[dtype], 2, 33, 40, 2, 1, 32, seed=5,
                                              pad=pad, query_seq_lengths=[7, 33],
                                              key_value_seq_lengths=[19, 40])
        results.append(_run_all(q, k, v, do, g_lse, **mask))
    for name, x in results[0].items():
        assert np.isfinite(np.asarray(x, np.float64)).all() or name == "lse", name
    assert np.isfinite(results[0]["lse"][0, :, :7]).all()
    _assert_bit_identical(results[0], results[1])
    _assert_bit_identical(results[0], results[2])


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_empty_rows_are_exact(dtype):
    """Rows that see no key: O = 0, LSE = -inf, residuals m = JFM_EMPTY_ROW_MAX and
    log(l) = 0 exactly, zero dQ; unseen keys: zero dK/dV."""
    # Window (2, -) with causal and bottom_right over q 12 / kv 5: early rows see nothing.
    mask = dict(is_causal=True, local_window_size=(2, None), causal_alignment="bottom_right",
                query_seq_lengths=np.array([12, 3], np.int32),
                key_value_seq_lengths=np.array([5, 0], np.int32))
    q, k, v, do, g_lse = kh.random_inputs(kh.DTYPES[dtype], 2, 12, 9, 4, 2, 64, seed=11,
                                          query_seq_lengths=[12, 3], key_value_seq_lengths=[5, 0])
    got = kh.check_against_oracle(q, k, v, do, g_lse, **mask)
    visible = oracle.visibility(2, 12, 9, **{n: x for n, x in mask.items()})
    empty = ~visible.any(axis=2)  # [B, Tq]
    unseen = ~visible.any(axis=1)  # [B, Tkv]
    assert empty[0, :7].all() and not empty[0, 7:].any() and empty[1].all()
    o, dq = (np.asarray(got[n], np.float64) for n in ("o", "dq"))
    lse = got["lse"]
    for b in range(2):
        assert (o[b, empty[b]] == 0).all() and (dq[b, empty[b]] == 0).all()
        assert np.isneginf(lse[b][:, empty[b]]).all()
        assert np.isfinite(lse[b][:, ~empty[b]]).all()
        assert (got["row_max"][b][:, empty[b]] == kh.EMPTY_ROW_MAX).all()
        assert (got["log_sum"][b][:, empty[b]] == 0).all()
        for name in ("dk", "dv"):
            assert (np.asarray(got[name][b, unseen[b]], np.float64) == 0).all()
    assert (got["delta"][1][:, 3:] == 0).all()  # rows past q_len


def test_kv_len_zero():
    """An empty key sequence: O = 0, LSE = -inf, dQ = 0; dK/dV are empty (never dispatched)."""
    q, k, v, do, g_lse = kh.random_inputs(np.float32, 2, 5, 0, 4, 2, 64)
    got = kh.check_against_oracle(q, k, v, do, g_lse)
    assert (got["o"] == 0).all() and np.isneginf(got["lse"]).all() and (got["dq"] == 0).all()
    assert got["dk"].shape == (2, 0, 2, 64)


def test_q_len_zero():
    """No query rows: only the dK/dV kernel is dispatched, and it writes zero dK/dV."""
    q, k, v, do, g_lse = kh.random_inputs(kh.DTYPES["bf16"], 2, 0, 16, 4, 2, 64)
    got = kh.check_against_oracle(q, k, v, do, g_lse, is_causal=True)
    assert got["o"].shape == (2, 0, 4, 64)
    assert (np.asarray(got["dk"], np.float64) == 0).all()
    assert (np.asarray(got["dv"], np.float64) == 0).all()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("tensor,value", [("v", np.nan), ("k", np.inf), ("k", -np.inf),
                                          ("q", np.inf)])
def test_visible_non_finite_propagates(dtype, tensor, value):
    """NaN/Inf at row 5 of q, k or v reaches exactly the rows that see it, forward and backward.

    Causal over 8 rows: a poisoned key 5 is seen by rows 5..7, a poisoned query row 5 only by
    itself; the oracle marks those outputs NaN and the kernels must not drop the value (an Inf
    key scoring -inf would otherwise get probability 0).
    """
    q, k, v, do, g_lse = kh.random_inputs(kh.DTYPES[dtype], 1, 8, 8, 1, 1, 16, seed=2)
    poisoned = dict(q=q, k=k, v=v)[tensor]
    poisoned[0, 5, 0, 3] = value
    got = kh.check_against_oracle(q, k, v, do, g_lse, is_causal=True)
    o = np.asarray(got["o"], np.float64)
    assert np.isfinite(o[0, :5]).all() and np.isfinite(got["lse"][0, 0, :5]).all()
    affected = [5] if tensor == "q" else [5, 6, 7]
    assert not np.isfinite(o[0, affected]).all(axis=-1).any()
    if tensor == "v":  # NaN stays NaN through the f16/bf16 stores (never rounds to an infinity)
        assert np.isnan(o[0, 5:, 0, 3]).all()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_zero_width_window_copies_v(dtype):
    """Window (0, 0): each row sees only its own key, so O = V and dV = dO bit for bit.

    dV needs the backward to recompute P = 1 exactly: scores bit-identical to the forward's and
    P = exp2((S - m) log2(e) - log(l) log2(e)) = 1 exactly for a one-hot row (S = m, l = 1).
    """
    q, k, v, do, g_lse = kh.random_inputs(kh.DTYPES[dtype], 1, 33, 33, 2, 2, 48, seed=4)
    o, _, residuals = kh.forward(q, k, v, local_window_size=(0, 0))
    assert o.tobytes() == v.tobytes()
    assert (residuals[1] == 0).all()  # log(1)
    _, _, dv, _ = kh.backward(q, k, v, o, residuals, do, g_lse, local_window_size=(0, 0))
    assert dv.tobytes() == do.tobytes()


def test_bf16_store_rounds_to_nearest_even():
    """V rows hold values exactly representable; scale 0 averages two keys, forcing a rounding.

    With two visible keys and scale 0, O = (v0 + v1) / 2 in float32, stored to bf16 with
    round-to-nearest-even; checked against ml_dtypes' conversion of the exact average.
    """
    rng = np.random.default_rng(9)
    v = rng.standard_normal((1, 2, 1, 16)).astype(np.float32).astype(kh.DTYPES["bf16"])
    q = np.ones((1, 1, 1, 16), kh.DTYPES["bf16"])
    k = np.ones((1, 2, 1, 16), kh.DTYPES["bf16"])
    o, lse, (row_max, log_sum) = kh.forward(q, k, v, scale=0.0)
    mean = (v[0, 0].astype(np.float32) + v[0, 1].astype(np.float32)) * np.float32(0.5)
    assert o[0, 0].tobytes() == mean.astype(kh.DTYPES["bf16"]).tobytes()
    np.testing.assert_allclose(lse, np.log(2.0), rtol=1e-6)
    np.testing.assert_array_equal(row_max, 0.0)  # every score is 0
    np.testing.assert_allclose(log_sum, np.log(2.0), rtol=1e-6)


def test_huge_window_bounds_equal_unbounded():
    """Window bounds near INT32_MAX are computed in 64 bits: same bits as no window at all."""
    q, k, v, do, g_lse = kh.random_inputs(np.float32, 1, 9, 40, 2, 1, 32, seed=8)
    huge = 2**31 - 1
    for mask in (dict(), dict(is_causal=True, causal_alignment="bottom_right")):
        plain = _run_all(q, k, v, do, g_lse, **mask)
        _assert_bit_identical(plain, _run_all(q, k, v, do, g_lse, local_window_size=(huge, huge),
                                              **mask))
