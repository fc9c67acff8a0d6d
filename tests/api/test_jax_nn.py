"""flash_attention as a drop-in for jax.nn.dot_product_attention: every keyword jax.nn takes on
the installed JAX is accepted with its meaning, and each row of docs/jax-nn.md's table of
differences is pinned here (the behaviour, not only that one exists)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from api_helpers import make_inputs
from jax_flash_metal import flash_attention

JAX_NN_KEYWORDS = frozenset(inspect.signature(jax.nn.dot_product_attention).parameters)
B, TQ, TK, H, HKV, D = 2, 9, 11, 4, 2, 8


def _jax_nn_arguments():
    """A value for every argument jax.nn.dot_product_attention has ever taken, chosen so each
    is not its default and every row that takes part sees a key (where the two agree)."""
    q, k, v, _, _ = make_inputs(40, B, TQ, TK, H, HKV, D, jnp.float32)
    rng = np.random.default_rng(41)
    mask = rng.random((B, 1, TQ, TK)) > 0.3
    mask[..., np.arange(TQ), np.arange(TQ)] = True  # the diagonal: visible under causal+window
    return dict(query=q, key=k, value=v,
                bias=jnp.asarray(rng.standard_normal((1, H, TQ, TK)), jnp.float32),
                mask=jnp.asarray(mask), scale=0.3, is_causal=True,
                query_seq_lengths=jnp.array([9, 6], jnp.int32),
                key_value_seq_lengths=jnp.array([11, 8], jnp.int32),
                local_window_size=(3, 1), implementation=None, return_residual=True)


def test_forwards_every_jax_nn_keyword():
    """A layer written for jax.nn hands its captured **kwargs to flash_attention unchanged."""
    values = _jax_nn_arguments()
    unknown = JAX_NN_KEYWORDS - set(values)
    assert not unknown, f"jax.nn.dot_product_attention takes new arguments: {sorted(unknown)}"
    captured = {}

    def layer(**kwargs):  # a call site written for jax.nn
        captured.update(kwargs)
        return jax.nn.dot_product_attention(**kwargs)

    want = layer(**{name: values[name] for name in JAX_NN_KEYWORDS})
    got = flash_attention(**captured)
    if "return_residual" not in JAX_NN_KEYWORDS:  # jax < 0.5.1 has no residual
        want, got = (want, None), (got, None)
    np.testing.assert_allclose(got[0], want[0], atol=2e-6)
    if got[1] is not None:
        assert got[1].shape == want[1].shape and got[1].dtype == want[1].dtype
        rows = np.arange(TQ)[None, :] < np.asarray(values["query_seq_lengths"])[:, None]
        np.testing.assert_allclose(np.asarray(got[1])[rows], np.asarray(want[1])[rows],
                                   atol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rank", [3, 4])
def test_residual_layout_and_dtype(rank, dtype):
    """return_residual: [batch, q_len, num_heads] (no batch for rank 3) in the query's dtype,
    the float64 oracle's LSE; return_lse: float32 [batch, num_heads, q_len]."""
    q, k, v, _, _ = make_inputs(42, 1, TQ, TK, H, HKV, D, dtype)
    want = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), is_causal=True)[1]
    if rank == 3:
        q, k, v = q[0], k[0], v[0]
    out, residual = flash_attention(q, k, v, is_causal=True, return_residual=True)
    _, lse = flash_attention(q, k, v, is_causal=True, return_lse=True)
    assert residual.dtype == out.dtype == dtype and lse.dtype == jnp.float32
    assert residual.shape == q.shape[:-1] and lse.shape == (*q.shape[:-3], H, TQ)
    np.testing.assert_allclose(np.asarray(residual, np.float64),
                               np.swapaxes(np.reshape(want, lse.shape), -1, -2),
                               rtol=1e-5 if dtype == jnp.float32 else 1e-2)
    with pytest.raises(ValueError, match="return_residual"):
        flash_attention(q, k, v, return_lse=True, return_residual=True)
    with pytest.raises(TypeError, match="return_residual"):
        flash_attention(q, k, v, return_residual="yes")


def test_residual_has_no_gradient_and_lse_has():
    """As jax.nn: the residual is stop_gradient'ed; return_lse's LSE carries gradients."""
    q, k, v, _, _ = make_inputs(43, 1, TQ, TK, H, HKV, D, jnp.float32)
    residual_grad = jax.grad(lambda q: jnp.sum(flash_attention(
        q, k, v, return_residual=True)[1]))(q)
    lse_grad = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, return_lse=True)[1]))(q)
    assert np.all(np.asarray(residual_grad) == 0)
    assert np.any(np.asarray(lse_grad) != 0)
    if "return_residual" in JAX_NN_KEYWORDS:
        nn_grad = jax.grad(lambda q: jnp.sum(jax.nn.dot_product_attention(
            q, k, v, return_residual=True)[1]))(q)
        assert np.all(np.asarray(nn_grad) == 0)


def test_row_with_no_visible_key(implementation):
    """Output 0 and residual -inf (jax.nn: the mean of V and a large negative residual); a
    bias of -inf over the whole row hides it the same way (jax.nn: NaN)."""
    q, k, v, _, _ = make_inputs(44, 1, TQ, TK, H, HKV, D, jnp.float32)
    mask = np.ones((1, 1, TQ, TK), bool)
    mask[..., 2, :] = False
    out, residual = flash_attention(q, k, v, mask=mask, return_residual=True,
                                    implementation=implementation)
    assert np.all(np.asarray(out[0, 2]) == 0) and np.all(np.asarray(residual[0, 2]) == -np.inf)
    bias = np.where(mask, 0.0, -np.inf).astype(np.float32)
    out_bias = flash_attention(q, k, v, bias, implementation=implementation)
    assert np.all(np.asarray(out_bias[0, 2]) == 0)
    nn = jax.nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(nn[0, 2], jnp.repeat(v[0].mean(0), H // HKV, axis=0), atol=1e-6)
    assert np.all(np.isnan(np.asarray(jax.nn.dot_product_attention(q, k, v, bias)[0, 2])))


def test_non_finite_value_gives_nan(implementation):
    """+inf in V at (key 3, kv head 0, column 1): NaN in column 1 of the rows of query heads 0
    and 1 that see key 3 (jax.nn: +inf), every other entry finite."""
    q, k, v, _, _ = make_inputs(45, 1, TQ, TK, H, HKV, D, jnp.float32)
    v = v.at[0, 3, 0, 1].set(jnp.inf)
    out = np.asarray(flash_attention(q, k, v, is_causal=True, implementation=implementation))
    expect = np.zeros(out.shape, bool)
    expect[0, 3:, :2, 1] = True  # causal: rows i >= 3 see key 3; heads 0, 1 read kv head 0
    np.testing.assert_array_equal(np.isnan(out), expect)
    nn = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True))
    assert np.all(np.isposinf(nn[0, 3:, :2, 1]) | np.isnan(nn[0, 3:, :2, 1]))


def test_non_finite_key_gives_nan_in_every_row_that_sees_it(implementation):
    """+inf in K: every row of heads 0 and 1 that sees that key is NaN whatever the sign of
    its score (jax.nn: a -inf score hides the key, a +inf one gives NaN)."""
    q, k, v, _, _ = make_inputs(46, 1, TQ, TK, H, HKV, D, jnp.float32)
    k = k.at[0, 3, 0, 1].set(jnp.inf)
    out = np.asarray(flash_attention(q, k, v, is_causal=True, implementation=implementation))
    expect = np.zeros(out.shape, bool)
    expect[0, 3:, :2, :] = True
    np.testing.assert_array_equal(np.isnan(out), expect)


def test_overflowing_scores(implementation):
    """scale * q.k beyond float32's range: every row with a +inf score is NaN (as jax.nn); rows
    whose scores overflow only to -inf may be NaN too (docs/jax-nn.md says why)."""
    q, k, v, _, _ = make_inputs(47, 1, TQ, TK, H, HKV, D, jnp.float32)
    scores = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.repeat(np.float64(k), 2, axis=2))
    with np.errstate(over="ignore"):
        plus_inf = np.isposinf((scores * 1e38).astype(np.float32)).any(-1)  # [b, h, q]
    out = np.asarray(flash_attention(q, k, v, scale=1e38, implementation=implementation))
    assert plus_inf.any()
    assert np.all(np.isnan(out).all(-1)[np.swapaxes(plus_inf, 1, 2)])


def test_integer_and_float64_inputs_raise():
    """jax.nn computes integer attention in int32 (truncated weights) and float64 under
    jax_enable_x64; here both raise TypeError naming the argument."""
    q = jnp.ones((1, 4, 2, 8), jnp.int32)
    with pytest.raises(TypeError, match="query dtype must be float32, float16 or bfloat16"):
        flash_attention(q, q, q)
    jax.config.update("jax_enable_x64", True)
    try:
        q = jnp.ones((1, 4, 2, 8), jnp.float64)
        with pytest.raises(TypeError, match="query dtype must be float32, float16 or bfloat16"):
            flash_attention(q, q, q)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_scale_must_be_static_and_finite():
    """A traced scale raises TypeError (it is compiled in), NaN or inf ValueError; jax.nn
    takes both."""
    q, k, v, _, _ = make_inputs(48, 1, TQ, TK, H, HKV, D, jnp.float32)
    with pytest.raises(TypeError, match="scale"):
        jax.jit(lambda s: flash_attention(q, k, v, scale=s))(0.5)
    with pytest.raises(ValueError, match="scale"):
        flash_attention(q, k, v, scale=float("inf"))
    jax.jit(lambda s: jax.nn.dot_product_attention(q, k, v, scale=s))(0.5)


def test_is_causal_takes_concrete_bool_likes():
    """As jax.nn's `if is_causal:`: a NumPy or JAX 0-d bool, or the integer 0 or 1, known at
    trace time; a traced flag raises TypeError naming is_causal (it selects the computation)."""
    q, k, v, _, _ = make_inputs(49, 1, TQ, TK, H, HKV, D, jnp.float32)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    for flag, causal in [(jnp.array(True), True), (np.array(True), True), (1, True),
                         (np.int32(0), False), (jnp.array(False), False)]:
        want = oracle.attention(q64, k64, v64, is_causal=causal)[0]
        np.testing.assert_allclose(flash_attention(q, k, v, is_causal=flag), want, atol=2e-6)
    with pytest.raises(TypeError, match="is_causal must be a bool known at trace time .a traced"):
        jax.jit(lambda flag: flash_attention(q, k, v, is_causal=flag))(True)
    with pytest.raises(TypeError, match="is_causal"):
        flash_attention(q, k, v, is_causal=2)


def test_low_precision_bias_with_float32_query(implementation):
    """As jax.nn: a float16 bias is added to the float32 scores exactly (no error, no
    rounding of the scores to float16); its gradient comes back in float16."""
    q, k, v, _, _ = make_inputs(50, 1, TQ, TK, H, HKV, D, jnp.float32)
    bias = jnp.asarray(np.random.default_rng(50).standard_normal((1, H, TQ, TK)), jnp.float16)
    want = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                            bias=np.asarray(bias, np.float64))[0]
    out = flash_attention(q, k, v, bias, implementation=implementation)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, atol=2e-6)
    dbias = jax.grad(lambda b: jnp.sum(flash_attention(q, k, v, b,
                                                       implementation=implementation)))(bias)
    assert dbias.dtype == jnp.float16
