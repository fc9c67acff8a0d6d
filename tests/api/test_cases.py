"""The regression cases C-01 .. C-09 (docs/testing.md#regression-cases), each with its whole kind.

Every case runs on every available implementation; right values come from the float64 oracle
(tests/helpers/oracle.py) or are exact by construction.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import tolerance
from api_helpers import DTYPES, check_against_oracle, f64, normal, run_flash
from jax_flash_metal import flash_attention


def _qkv(seed, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, scale=1.0):
    rng = np.random.default_rng(seed)
    q = normal(rng, (batch, q_len, heads, head_dim), dtype, scale)
    k = normal(rng, (batch, kv_len, kv_heads, head_dim), dtype, scale)
    v = normal(rng, (batch, kv_len, kv_heads, head_dim), dtype, scale)
    do = normal(rng, (batch, q_len, heads, head_dim), dtype)
    return q, k, v, do


def _empty_rows(q, k, **kw):
    """bool [B, Tq]: rows with no visible key, according to the oracle."""
    keys = {n: kw[n] for n in ("is_causal", "local_window_size", "query_seq_lengths",
                               "key_value_seq_lengths", "causal_alignment") if n in kw}
    return ~oracle.visibility(q.shape[0], q.shape[1], k.shape[1], **keys).any(axis=-1)


def _assert_empty_rows_exact(actual, empty):
    assert empty.any(), "the case must produce empty rows"
    o, lse, dq = f64(actual["o"]), f64(actual["lse"]), f64(actual["dq"])
    assert np.all(o[empty] == 0), "empty rows must output exactly 0"
    assert np.all(lse.transpose(0, 2, 1)[empty] == -np.inf), "empty rows must have LSE -inf"
    assert np.all(dq[empty] == 0), "empty rows get zero dQ"
    for name in ("o", "lse", "dq", "dk", "dv"):
        a = f64(actual[name])
        assert np.isfinite(a[~np.isinf(a)]).all(), f"NaN in {name}"
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(f64(actual[name])).all(), name


# ---- C-01: rows with no visible key gave NaN --------------------------------------------------

C01_MASKS = [
    dict(is_causal=True, local_window_size=(1, 0)),
    dict(is_causal=True, local_window_size=(1, 0), causal_alignment="bottom_right"),
    dict(is_causal=True, causal_alignment="bottom_right"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", range(len(C01_MASKS)))
def test_c01_empty_rows(implementation, dtype, mask):
    q, k, v, do = _qkv(0, 2, 8, 4, 4, 2, 64, DTYPES[dtype])
    kw = C01_MASKS[mask]
    actual, _ = check_against_oracle(q, k, v, do, implementation=implementation, **kw)
    _assert_empty_rows_exact(actual, _empty_rows(q, k, **kw))


@pytest.mark.parametrize("kw", [
    # Other ways to empty a row: a window that misses every key, lengths of 0, bottom-right
    # alignment with q_len > kv_len through the lengths, right-only windows past the end.
    dict(local_window_size=(0, 0)),
    dict(key_value_seq_lengths=np.array([0, 3])),
    dict(is_causal=True, causal_alignment="bottom_right",
         query_seq_lengths=np.array([8, 6]), key_value_seq_lengths=np.array([2, 4])),
    dict(local_window_size=(None, 0), causal_alignment="bottom_right"),
], ids=["window00", "kvlen0", "br-lengths", "br-right0"])
def test_c01_kind_other_empty_rows(implementation, kw):
    q, k, v, do = _qkv(1, 2, 8, 4, 4, 2, 32, jnp.float32)
    g = jnp.ones((2, 4, 8), jnp.float32)  # an LSE cotangent on empty rows must not leak either
    actual, _ = check_against_oracle(q, k, v, do, g, implementation=implementation, **kw)
    _assert_empty_rows_exact(actual, _empty_rows(q, k, **kw))


# ---- C-02: causal backward with q_len > kv_len and a single key ------------------------------

@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_c02_single_key(implementation, dtype, alignment):
    q, k, v, _ = _qkv(0, 1, 76, 1, 1, 1, 32, DTYPES[dtype], scale=3.0)
    do = jnp.ones_like(q)
    actual, _ = check_against_oracle(q, k, v, do, implementation=implementation,
                                     is_causal=True, causal_alignment=alignment)
    for name in ("o", "dq", "dk", "dv"):
        assert np.isfinite(f64(actual[name])).all(), name
    o, dv = f64(actual["o"]), f64(actual["dv"])
    if alignment == "top_left":
        np.testing.assert_array_equal(o[0, :, 0], np.broadcast_to(f64(v)[0, 0, 0], (76, 32)))
        np.testing.assert_array_equal(dv[0, 0, 0], np.full(32, 76.0))
    else:
        np.testing.assert_array_equal(o[0, 75, 0], f64(v)[0, 0, 0])
        assert np.all(o[0, :75] == 0)
        np.testing.assert_array_equal(dv[0, 0, 0], np.ones(32))


@pytest.mark.parametrize("kv_len", [2, 3])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_c02_kind_few_keys(implementation, kv_len, alignment):
    q, k, v, _ = _qkv(2, 2, 37, kv_len, 2, 1, 32, jnp.float16, scale=3.0)
    actual, _ = check_against_oracle(q, k, v, jnp.ones_like(q), implementation=implementation,
                                     is_causal=True, causal_alignment=alignment)
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(f64(actual[name])).all(), name


# ---- C-03: causal alignment for q_len != kv_len ---------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("lens", [
    pytest.param((32, 1024), marks=pytest.mark.large), (1, 16), (3, 4), (5, 2)])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_c03_alignment(implementation, dtype, lens, alignment):
    q, k, v, do = _qkv(3, 1, lens[0], lens[1], 4, 1, 80, DTYPES[dtype])
    actual, _ = check_against_oracle(q, k, v, do, implementation=implementation,
                                     is_causal=True, causal_alignment=alignment)
    if lens == (1, 16):
        if alignment == "top_left":  # the single query sees key 0 only
            np.testing.assert_array_equal(f64(actual["o"])[0, 0], np.repeat(f64(v)[0, 0], 4, 0))
        else:  # the single query is the last one: it sees every key
            plain = flash_attention(q, k, v, implementation=implementation)
            np.testing.assert_array_equal(f64(actual["o"]), f64(plain))


# ---- C-04: lengths that are not multiples of a tile -----------------------------------------

ODD = (1, 17, 127, 129, 191, 192, 255, 257)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("length", [
    n if n < 191 else pytest.param(n, marks=pytest.mark.large) for n in ODD])
def test_c04_odd_lengths(implementation, dtype, length):
    q, k, v, do = _qkv(100, 1, length, length, 8, 8, 16, DTYPES[dtype])
    for causal in (False, True):
        check_against_oracle(q, k, v, do, implementation=implementation, is_causal=causal)


@pytest.mark.parametrize("lens", [(17, 129), (129, 17), (1, 257), (255, 1), (191, 192),
                                  (127, 255)])
def test_c04_mixed_lengths(implementation, lens):
    dtype = jnp.float32 if lens[0] < lens[1] else jnp.bfloat16
    q, k, v, do = _qkv(100, 1, lens[0], lens[1], 8, 8, 16, dtype)
    check_against_oracle(q, k, v, do, implementation=implementation, is_causal=True,
                         causal_alignment="bottom_right" if lens[0] % 2 else "top_left")


def test_c04_kind_padding_via_lengths(implementation):
    """Rows/keys past the lengths inside a tile (and garbage there) never touch real rows."""
    q, k, v, do = _qkv(100, 2, 129, 129, 2, 2, 16, jnp.float32)
    ql, kl = np.array([127, 17]), np.array([129, 1])
    q = q.at[0, 127:].set(jnp.nan).at[1, 17:].set(1e30)
    k = k.at[1, 1:].set(jnp.nan)
    v = v.at[1, 1:].set(-jnp.inf)
    check_against_oracle(q, k, v, do, implementation=implementation, is_causal=True,
                         query_seq_lengths=ql, key_value_seq_lengths=kl)


# ---- C-05: decode (q_len 1) with odd kv_len -------------------------------------------------

@pytest.mark.parametrize("kv_len", [
    n if n < 256 else pytest.param(n, marks=pytest.mark.large)
    for n in (1, 2, 63, 64, 65, 255, 256, 257, 513)])
def test_c05_decode(implementation, kv_len):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.random(shape).astype(np.float32), jnp.bfloat16)
               for shape in ((1, 1, 8, 32), (1, kv_len, 1, 32), (1, kv_len, 1, 32)))
    do = jnp.asarray(rng.random((1, 1, 8, 32)).astype(np.float32), jnp.bfloat16)
    explicit, _ = check_against_oracle(q, k, v, do, implementation=implementation, scale=1 / 32)
    if kv_len in (1, 64, 257):  # the KV-cache form: bottom-right causal sees every key
        check_against_oracle(q, k, v, do, implementation=implementation, scale=1 / 32,
                             is_causal=True, causal_alignment="bottom_right")
    default, _ = check_against_oracle(q, k, v, do, implementation=implementation)
    # LSE = log sum exp(scale * s) differs between scale 1/32 and 1/sqrt(32) by far more than
    # rounding, so the explicit scale was honoured (O can coincide when kv_len is 1).
    assert np.all(np.abs(f64(explicit["lse"]) - f64(default["lse"])) > 1e-2)


# ---- C-06: window semantics -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_c06_windows(implementation, dtype):
    q, k, v, do = _qkv(6, 1, 64, 64, 2, 2, 64, DTYPES[dtype])
    run = {}
    for name, kw in {"w80": dict(local_window_size=(8, 0)),
                     "w80c": dict(local_window_size=(8, 0), is_causal=True),
                     "w00": dict(local_window_size=(0, 0)),
                     "w630": dict(local_window_size=(63, 0)),
                     "causal": dict(is_causal=True),
                     "w32": dict(local_window_size=(3, 2))}.items():
        # With (0, 0) the exact dQ, dK are 0 (one-hot softmax): no relative tolerance applies,
        # they are bounded below instead.
        names = ("o", "lse", "dv") if name == "w00" else ("o", "lse", "dq", "dk", "dv")
        run[name], _ = check_against_oracle(q, k, v, do, implementation=implementation,
                                            names=names, **kw)
    for name in ("o", "lse", "dq", "dk", "dv"):
        np.testing.assert_array_equal(f64(run["w80"][name]), f64(run["w80c"][name]), name)
        np.testing.assert_array_equal(f64(run["w630"][name]), f64(run["causal"][name]), name)
    np.testing.assert_array_equal(f64(run["w00"]["o"]), f64(v))  # each row sees only itself
    for name in ("dq", "dk"):  # rounding of dO.V - rowsum(dO * O) only
        assert np.abs(f64(run["w00"][name])).max() <= (1e-5 if dtype == "f32" else 1e-2), name


@pytest.mark.parametrize("kw,row,key", [
    (dict(local_window_size=(3, 2)), 20, 24),        # just past the right bound
    (dict(local_window_size=(3, 2)), 20, 16),        # just past the left bound
    (dict(local_window_size=(8, 0), is_causal=True), 20, 21),   # the future
    (dict(is_causal=True), 5, 6),
    (dict(local_window_size=(2, 1), causal_alignment="bottom_right"), 3, 15),
], ids=["right", "left", "future", "causal", "bottom-right"])
@pytest.mark.parametrize("new_value", [7.0, np.nan], ids=["finite", "nan"])
def test_c06_kind_invisible_key_has_no_effect(implementation, kw, row, key, new_value):
    """Changing (even to NaN) a key/value a row cannot see leaves that row bit-identical, in the
    output, the LSE and the row's dQ; the bounds themselves are inclusive (the oracle check)."""
    q, k, v, do = _qkv(6, 1, 24 if "causal_alignment" in kw else 32, 32, 2, 2, 64, jnp.float32)
    mask = oracle.visibility(1, q.shape[1], 32, **kw)[0]
    assert not mask[row, key]
    before = run_flash(q, k, v, do, implementation=implementation, **kw)
    k2, v2 = k.at[0, key].set(new_value), v.at[0, key].set(new_value)
    after = run_flash(q, k2, v2, do, implementation=implementation, **kw)
    unaffected = ~mask[:, key]  # every row that cannot see `key`
    for name in ("o", "dq"):
        np.testing.assert_array_equal(f64(before[name])[0, unaffected],
                                      f64(after[name])[0, unaffected], name)
    np.testing.assert_array_equal(f64(before["lse"])[0][:, unaffected],
                                  f64(after["lse"])[0][:, unaffected])
    check_against_oracle(q, k2, v2, do, implementation=implementation, **kw)


# ---- C-07: f16 logits overflow before scaling -----------------------------------------------

@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_c07_large_logits(implementation, dtype):
    dt = DTYPES[dtype]
    x = normal(np.random.default_rng(0), (1, 256, 2, 128), dt, scale=30.0)
    do = normal(np.random.default_rng(1), (1, 256, 2, 128), dt)
    actual = run_flash(x, x, x, do, implementation=implementation)
    for name in actual:
        assert np.isfinite(f64(actual[name])).all(), name
    # q_i . k_i ~ 30^2 * 128 dwarfs every other score: each row copies its own value vector.
    ulp = 2.0 ** -10 if dtype == "f16" else 2.0 ** -7
    np.testing.assert_allclose(f64(actual["o"]), f64(x), rtol=ulp, atol=0)
    _, exp_lse = oracle.attention(f64(x), f64(x), f64(x))
    tolerance.assert_matches_oracle("lse", actual["lse"], exp_lse)  # float32 LSE, f32 scores
    # Exact gradients are ~0 (one-hot softmax); ours must be tiny on the scale of the inputs.
    for name, exp in zip(("dq", "dk", "dv"), oracle.attention_grads(f64(x), f64(x), f64(x),
                                                                     f64(do))):
        err = np.abs(f64(actual[name]) - exp).max()
        assert err <= 1e-3 * np.abs(f64(x)).max() + 2 * ulp * np.abs(exp).max(), (name, err)


# ---- C-08: zero-size inputs -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("lens", [(0, 16, 16), (2, 0, 16), (2, 16, 0)])
@pytest.mark.parametrize("mode", ["eager", "jit", "grad"])
def test_c08_zero_size(implementation, dtype, lens, mode):
    b, tq, tkv = lens
    q, k, v, do = _qkv(8, b, tq, tkv, 4, 2, 64, DTYPES[dtype])

    def forward(q, k, v):
        return flash_attention(q, k, v, return_lse=True, implementation=implementation)

    if mode == "grad":
        out = run_flash(q, k, v, do, implementation=implementation)
        assert out["dq"].shape == q.shape and out["dk"].shape == k.shape
        assert out["dv"].shape == v.shape
        for name in ("dq", "dk", "dv"):
            assert np.all(f64(out[name]) == 0), name
        o, lse = out["o"], out["lse"]
    else:
        o, lse = (jax.jit(forward) if mode == "jit" else forward)(q, k, v)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (b, 4, tq) and lse.dtype == jnp.float32
    assert np.all(f64(o) == 0) and np.all(f64(lse) == -np.inf)  # kv_len 0: O = 0, LSE = -inf


def test_c08_kind_zero_size_under_vmap_and_lengths(implementation):
    q, k, v, _ = _qkv(8, 2, 5, 0, 2, 1, 16, jnp.float32)
    lengths = jnp.zeros((3, 2), jnp.int32)
    out = jax.vmap(lambda q, n: flash_attention(q, k, v, key_value_seq_lengths=n,
                                                implementation=implementation),
                   in_axes=(None, 0))(q, lengths)
    assert out.shape == (3,) + q.shape and np.all(f64(out) == 0)


# ---- C-09: float32 at full precision ---------------------------------------------------------

@pytest.mark.parametrize("length,head_dim", [
    (128, 32), pytest.param(1000, 128, marks=[pytest.mark.large, pytest.mark.slow])])
def test_c09_float32_precision(implementation, length, head_dim):
    q, k, v, do = _qkv(0, 1, length, length, 1, 1, head_dim, jnp.float32)
    # The tolerances are exactly the case's: O within 1e-5, gradients within 1e-4 (relative).
    check_against_oracle(q, k, v, do, implementation=implementation, is_causal=True)
    # ...also when the user lowers JAX's default matmul precision.
    with jax.default_matmul_precision("bfloat16"):
        check_against_oracle(q, k, v, do, implementation=implementation, is_causal=True)
