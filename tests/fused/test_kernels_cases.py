"""The regression cases C-01 .. C-09 (docs/testing.md#regression-cases) run directly on the
attention kernels.

Each recipe follows the case table; values come from the float64 oracle (tests/helpers/oracle.py)
with the tolerances of docs/testing.md#tolerances, plus the exact properties each case names.
"""

import ml_dtypes
import numpy as np
import pytest

import kernel_harness as kh
import oracle

BF16 = kh.DTYPES["bf16"]


def _normal(shape, seed, dtype, factor=1.0):
    """N(0,1) float32 draws from default_rng(seed), times factor, cast to dtype."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return (np.float32(factor) * x).astype(dtype)


def _qkv(seed, dtype, batch, q_len, kv_len, heads, kv_heads, head_dim, factor=1.0):
    """q, k, v and dO as consecutive draws of one N(0,1) seed stream."""
    rng = np.random.default_rng(seed)
    draw = lambda shape: (np.float32(factor) * rng.standard_normal(shape).astype(np.float32)
                          ).astype(dtype)
    return (draw((batch, q_len, heads, head_dim)), draw((batch, kv_len, kv_heads, head_dim)),
            draw((batch, kv_len, kv_heads, head_dim)), draw((batch, q_len, heads, head_dim)))


def _f64(x):
    return np.asarray(x, np.float64)


# ---- C-01: rows with no visible key ----

# (mask, the rows of the 8 that see no key among the 4)
C01_MASKS = [
    (dict(is_causal=True, local_window_size=(1, 0), causal_alignment="top_left"), [5, 6, 7]),
    (dict(is_causal=True, local_window_size=(1, 0), causal_alignment="bottom_right"),
     [0, 1, 2, 3]),
    (dict(is_causal=True, causal_alignment="bottom_right"), [0, 1, 2, 3]),
]


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("mask,empty_rows", C01_MASKS,
                         ids=["window-top_left", "window-bottom_right", "causal-bottom_right"])
def test_c01_empty_rows(dtype, mask, empty_rows):
    q, k, v, do = _qkv(0, kh.DTYPES[dtype], 2, 8, 4, 4, 2, 64)
    g_lse = np.zeros((2, 4, 8), np.float32)
    got = kh.check_against_oracle(q, k, v, do, g_lse, **mask)
    empty = np.isin(np.arange(8), empty_rows)[None].repeat(2, axis=0)  # [B, Tq]
    assert (empty == ~oracle.visibility(2, 8, 4, **mask).any(axis=2)).all()
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(_f64(got[name])).all(), name
    for b in range(2):
        assert (_f64(got["o"])[b, empty[b]] == 0).all()
        assert np.isneginf(got["lse"][b][:, empty[b]]).all()
        assert (_f64(got["dq"])[b, empty[b]] == 0).all()


# ---- C-02: causal, q_len > kv_len = 1 ----

@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_c02_single_key(dtype, alignment):
    q, k, v, _ = _qkv(0, kh.DTYPES[dtype], 1, 76, 1, 1, 1, 32, factor=3.0)
    do = np.ones_like(q)
    mask = dict(is_causal=True, causal_alignment=alignment)
    got = kh.check_against_oracle(q, k, v, do, None, **mask)
    for name in ("o", "dq", "dk", "dv"):
        assert not np.isnan(_f64(got[name])).any(), name
    o, dv = _f64(got["o"]), _f64(got["dv"])
    if alignment == "top_left":
        assert (o[0, :, 0] == _f64(v)[0, 0, 0]).all()
        assert (dv[0, 0, 0] == 76.0).all()
    else:
        assert (o[0, :75] == 0).all() and np.isneginf(got["lse"][0, 0, :75]).all()
        assert (o[0, 75, 0] == _f64(v)[0, 0, 0]).all()
        assert (dv[0, 0, 0] == 1.0).all()


# ---- C-03: alignment for q_len != kv_len ----

C03_RUNS = ([(dtype, q_len, kv_len, alignment) for dtype in ("f32", "bf16")
             for q_len, kv_len in ((1, 16), (3, 4), (5, 2))
             for alignment in ("top_left", "bottom_right")]
            # The 32 x 1024 shape runs twice to bound the suite's time.
            + [pytest.param("f32", 32, 1024, "bottom_right", marks=pytest.mark.slow),
               pytest.param("bf16", 32, 1024, "top_left", marks=pytest.mark.slow)])


@pytest.mark.parametrize("dtype,q_len,kv_len,alignment", C03_RUNS)
def test_c03_alignment(dtype, q_len, kv_len, alignment):
    q, k, v, do = _qkv(3, kh.DTYPES[dtype], 1, q_len, kv_len, 4, 1, 80)
    mask = dict(is_causal=True, causal_alignment=alignment)
    got = kh.check_against_oracle(q, k, v, do, None, **mask)
    if (q_len, kv_len) == (1, 16):
        if alignment == "bottom_right":
            plain, plain_lse, _ = kh.forward(q, k, v)
            assert got["o"].tobytes() == plain.tobytes()
            assert got["lse"].tobytes() == plain_lse.tobytes()
        else:
            assert (_f64(got["o"])[0, 0] == _f64(v)[0, 0, 0][None, :]).all()


# ---- C-04: lengths that are not tile multiples ----

C04_LENGTHS = [1, 17, 127, 129, 191, 192, 255, 257]
C04_RUNS = ([(n, n, n % 2 == 1, "f32") for n in C04_LENGTHS]
            + [(n, n, n % 2 == 0, "bf16") for n in (17, 129, 192, 257)]
            + [(17, 257, True, "f32"), (257, 129, False, "bf16"), (191, 1, True, "bf16"),
               (1, 255, False, "f32")])


@pytest.mark.parametrize("q_len,kv_len,causal,dtype", C04_RUNS)
def test_c04_odd_lengths(q_len, kv_len, causal, dtype):
    q, k, v, do = _qkv(100, kh.DTYPES[dtype], 1, q_len, kv_len, 8, 8, 16)
    kh.check_against_oracle(q, k, v, do, None, is_causal=causal)


# ---- C-05: decode with odd kv_len and an explicit scale ----

@pytest.mark.parametrize("kv_len", [1, 2, 63, 64, 65, 255, 256, 257, 513])
def test_c05_decode(kv_len):
    rng = np.random.default_rng(0)
    draw = lambda shape: rng.random(shape, dtype=np.float32).astype(BF16)
    q, k, v, do = (draw((1, 1, 8, 32)), draw((1, kv_len, 1, 32)), draw((1, kv_len, 1, 32)),
                   draw((1, 1, 8, 32)))
    got = kh.check_against_oracle(q, k, v, do, None, scale=1 / 32)
    if kv_len > 1:
        default_o, default_lse, _ = kh.forward(q, k, v)
        assert not np.array_equal(default_lse, got["lse"])


# ---- C-06: window semantics ----

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_c06_windows(dtype):
    q, k, v, do = _qkv(6, kh.DTYPES[dtype], 1, 64, 64, 2, 2, 64)
    for mask in (dict(local_window_size=(8, 0)), dict(local_window_size=(8, 0), is_causal=True),
                 dict(local_window_size=(3, 2))):
        kh.check_against_oracle(q, k, v, do, None, **mask)
    # (8, 0) is the same with or without causal.
    a = kh.forward(q, k, v, local_window_size=(8, 0))
    b = kh.forward(q, k, v, local_window_size=(8, 0), is_causal=True)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    # (0, 0) gives O = V exactly.
    o, _, _ = kh.forward(q, k, v, local_window_size=(0, 0))
    assert o.tobytes() == v.tobytes()
    # (63, 0) over length 64 equals plain causal.
    c = kh.forward(q, k, v, local_window_size=(63, 0))
    d = kh.forward(q, k, v, is_causal=True)
    assert c[0].tobytes() == d[0].tobytes() and c[1].tobytes() == d[1].tobytes()
    # Changing keys outside row 40's window (3, 2) leaves row 40 bit-identical.
    k2, v2 = k.copy(), v.copy()
    k2[0, :37] = k2[0, :37] * 2 + 1
    v2[0, 43:] = np.nan
    e = kh.forward(q, k, v, local_window_size=(3, 2))
    f = kh.forward(q, k2, v2, local_window_size=(3, 2))
    assert e[0][0, 40].tobytes() == f[0][0, 40].tobytes()
    assert e[1][0, :, 40].tobytes() == f[1][0, :, 40].tobytes()


# ---- C-07: large logits in half precision ----

@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_c07_large_logits(dtype):
    x = _normal((1, 256, 2, 128), 0, kh.DTYPES[dtype], factor=30.0)
    q = k = v = x
    do = _normal((1, 256, 2, 128), 1, kh.DTYPES[dtype])
    o, lse, residuals = kh.forward(q, k, v)
    dq, dk, dv, _ = kh.backward(q, k, v, o, residuals, do)
    for name, got in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.isfinite(_f64(got)).all(), name
    want_o, want_lse = oracle.attention(q, k, v)
    want_dq, want_dk, want_dv = oracle.attention_grads(q, k, v, do)
    # Scores are ~1e4 apart: softmax is one-hot up to f32 rounding, so O = V to storage rounding
    # (scores formed in half precision would overflow to inf and give NaN instead).
    eps = float(ml_dtypes.finfo(kh.DTYPES[dtype]).eps)
    np.testing.assert_allclose(_f64(o), _f64(v), rtol=eps, atol=0)
    np.testing.assert_allclose(_f64(o), want_o, rtol=eps, atol=0)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    assert np.abs(_f64(dv) - want_dv).max() <= eps * np.abs(want_dv).max()
    # dS = P (dP - delta) cancels exactly in float64 (dQ = dK = 0 there); in float32, dP and
    # delta = rowsum(dO * O) differ by rounding of sums of |dO_d v_d| terms. Bound the error by a
    # few float32 ulps of those sums, carried through scale * K (resp. Q).
    scale = 1 / np.sqrt(128)
    dp_terms = np.abs(_f64(do) * _f64(v)).sum(axis=-1).max()
    bound = 16 * float(np.finfo(np.float32).eps) * scale * dp_terms * np.abs(_f64(x)).max()
    assert np.abs(_f64(dq) - want_dq).max() <= bound
    assert np.abs(_f64(dk) - want_dk).max() <= bound


# ---- C-08: zero-size inputs ----

@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("batch,q_len,kv_len", [(0, 16, 16), (2, 0, 16), (2, 16, 0)])
def test_c08_zero_size(dtype, batch, q_len, kv_len):
    q, k, v, do = _qkv(8, kh.DTYPES[dtype], batch, q_len, kv_len, 4, 2, 64)
    got = kh.check_against_oracle(q, k, v, do, None)
    assert got["o"].shape == q.shape and got["lse"].shape == (batch, 4, q_len)
    assert got["dq"].shape == q.shape and got["dk"].shape == k.shape
    for name in ("o", "dq", "dk", "dv"):
        assert not np.isnan(_f64(got[name])).any(), name
    if kv_len == 0:
        assert (_f64(got["o"]) == 0).all() and np.isneginf(got["lse"]).all()
        assert (_f64(got["dq"]) == 0).all()


# ---- C-09: float32 at full precision ----

@pytest.mark.parametrize("length,head_dim", [(128, 32), pytest.param(1000, 128,
                                                                     marks=pytest.mark.slow)])
def test_c09_float32_precision(length, head_dim):
    q, k, v, do = _qkv(0, np.float32, 1, length, length, 1, 1, head_dim)
    # check_against_oracle applies 1e-5 (O, LSE) and 1e-4 (gradients) relative to max |oracle|.
    kh.check_against_oracle(q, k, v, do, None, is_causal=True)
