"""flash_attention against the float64 oracle: a matrix of dtypes, head dims, shapes and masks
(forward, LSE and gradients, jit of the VJP), plus the rules of docs/design.md#api-semantics one by
one."""

import itertools

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import tolerance
from api_helpers import DTYPES, HEAD_DIMS, check_against_oracle, f64, make_inputs, run_flash
from jax_flash_metal import flash_attention, reference_attention

MASKS = [
    dict(),
    dict(is_causal=True),
    dict(is_causal=True, causal_alignment="bottom_right"),
    dict(local_window_size=(3, 2)),
    dict(local_window_size=2, causal_alignment="bottom_right"),
    dict(is_causal=True, local_window_size=(4, 0), causal_alignment="bottom_right"),
    dict(local_window_size=(None, 1)),
    dict(is_causal=True, local_window_size=(0, None)),
]
# (batch, q_len, kv_len, heads, kv_heads): odd lengths, Tq != Tkv both ways, GQA ratios 1, 2, 4.
SHAPES = [
    (2, 17, 17, 2, 2),
    (1, 1, 33, 4, 1),
    (2, 33, 17, 4, 2),
    (1, 31, 65, 4, 4),
    (2, 5, 3, 2, 1),
    (1, 65, 31, 4, 2),
]


def _matrix():
    """Every (dtype, head_dim) pair; masks and shapes rotate so each mask meets every dtype and
    several head dims, shapes and GQA ratios."""
    cases = []
    for n, (dtype, d) in enumerate(itertools.product(DTYPES, HEAD_DIMS)):
        cases.append(pytest.param(dtype, d, SHAPES[n % len(SHAPES)], MASKS[n % len(MASKS)],
                                  id=f"{dtype}-d{d}-{n % len(SHAPES)}-m{n % len(MASKS)}"))
    return cases


@pytest.mark.parametrize("dtype,head_dim,shape,mask", _matrix())
def test_matrix(implementation, dtype, head_dim, shape, mask):
    b, tq, tkv, h, hkv = shape
    q, k, v, do, g = make_inputs(head_dim, b, tq, tkv, h, hkv, head_dim, DTYPES[dtype])
    check_against_oracle(q, k, v, do, g, implementation=implementation, **mask)


@pytest.mark.parametrize("dtype,mask", [(dtype, m) for m in range(len(MASKS))
                                        for dtype in [list(DTYPES)[m % len(DTYPES)]]])
def test_masks_with_lengths(implementation, dtype, mask):
    """Every mask kind with per-batch lengths (incl. an empty batch entry) and NaN garbage in the
    padded tails of q, k, v: the tails must have no effect anywhere."""
    q, k, v, do, g = make_inputs(7, 3, 19, 23, 4, 2, 32, DTYPES[dtype])
    ql = np.array([19, 7, 0], np.int32)
    kl = np.array([11, 23, 5], np.int32)
    for b in range(3):
        q = q.at[b, ql[b]:].set(jnp.nan)
        k = k.at[b, kl[b]:].set(jnp.nan)
        v = v.at[b, kl[b]:].set(jnp.inf)
    actual, _ = check_against_oracle(q, k, v, do, g, implementation=implementation,
                                     query_seq_lengths=ql, key_value_seq_lengths=kl, **MASKS[mask])
    for b in range(3):
        assert np.all(f64(actual["o"][b, ql[b]:]) == 0)
        assert np.all(f64(actual["lse"][b, :, ql[b]:]) == -np.inf)
        assert np.all(f64(actual["dq"][b, ql[b]:]) == 0)
        assert np.all(f64(actual["dk"][b, kl[b]:]) == 0)
        assert np.all(f64(actual["dv"][b, kl[b]:]) == 0)


@pytest.mark.large
@pytest.mark.parametrize("dtype", DTYPES)
def test_large(implementation, dtype):
    """A bigger problem: several hundred rows, GQA, bottom-right causal, head_dim 128."""
    q, k, v, do, g = make_inputs(3, 2, 300, 513, 8, 2, 128, DTYPES[dtype])
    check_against_oracle(q, k, v, do, g, implementation=implementation, is_causal=True,
                         causal_alignment="bottom_right")


@pytest.mark.parametrize("bound", [2**31 - 1, 2**31, 10**12])
def test_huge_window_bounds_mean_unbounded(implementation, bound):
    """Window bounds past INT32_MAX are accepted and reach as far as no bound (no overflow)."""
    q, k, v, do, g = make_inputs(4, 1, 9, 12, 2, 1, 16, jnp.float32)
    check_against_oracle(q, k, v, do, g, implementation=implementation,
                         local_window_size=(bound, bound), causal_alignment="bottom_right")


@pytest.mark.parametrize("scale", [0.0, -0.7, 2.5, None])
def test_scale_is_literal(implementation, scale):
    q, k, v, do, g = make_inputs(1, 1, 9, 12, 2, 1, 16, jnp.float32)
    actual, _ = check_against_oracle(q, k, v, do, g, implementation=implementation, scale=scale,
                                     is_causal=True)
    if scale == 0.0:  # uniform attention over the visible keys
        want = np.cumsum(f64(v)[0, :9, 0], axis=0) / np.arange(1, 10)[:, None]
        np.testing.assert_allclose(f64(actual["o"][0, :, 0]), want, rtol=1e-6, atol=1e-6)


def test_eager_matches_jit(implementation):
    """Eager calls run the lowering jit uses: bit-identical results on XLA:CPU, which compiles
    the code around the primitives alike both ways; elsewhere (GPU fusion reorders float32 sums)
    equal to float32 rounding. Both match the oracle."""
    q, k, v, do, g = make_inputs(2, 2, 10, 14, 4, 2, 16, jnp.float32)
    kw = dict(is_causal=True, local_window_size=(3, 1), implementation=implementation)
    eager = run_flash(q, k, v, do, g, jit=False, **kw)
    jitted = run_flash(q, k, v, do, g, jit=True, **kw)
    rtol = 0.0 if jax.default_backend() == "cpu" else 1e-5
    for name in eager:
        np.testing.assert_allclose(np.asarray(eager[name]), np.asarray(jitted[name]), rtol=rtol,
                                   atol=rtol, err_msg=name)
    check_against_oracle(q, k, v, do, g, jit=False, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_grad_of_loss(implementation, dtype):
    """The user path: jax.jit(jax.grad(loss)) with return_lse=False."""
    q, k, v, do, _ = make_inputs(4, 2, 13, 21, 4, 1, 64, DTYPES[dtype])

    def loss(q, k, v):
        o = flash_attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                            implementation=implementation)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    kw = dict(is_causal=True, causal_alignment="bottom_right")
    want = oracle.attention_grads(f64(q), f64(k), f64(v), f64(do), **kw)
    base = tolerance.baseline(q, k, v, do, **kw) if dtype != "f32" else None
    for name, got, exp in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert got.dtype == q.dtype
        tolerance.assert_matches_oracle(name, got, exp, None if base is None else base[name])


def test_gradient_through_lse_only(implementation):
    """return_lse=True: a loss on the LSE alone gives the softmax-weighted gradients."""
    q, k, v, _, g = make_inputs(5, 1, 8, 11, 2, 2, 32, jnp.float32)
    zero_do = jnp.zeros_like(q)
    actual, _ = check_against_oracle(q, k, v, zero_do, g, implementation=implementation,
                                     local_window_size=(2, 3))
    assert np.all(f64(actual["dv"]) == 0)  # dV = P^T dO = 0


@pytest.mark.parametrize("case", [
    (0, 16, 16, 4, 2), (2, 0, 16, 4, 2), (2, 16, 0, 4, 2), (0, 0, 0, 1, 1), (1, 3, 0, 2, 1)])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_zero_size(implementation, case, mode):
    b, tq, tkv, h, hkv = case
    q, k, v, do, g = make_inputs(0, b, tq, tkv, h, hkv, 16, jnp.float32)
    out = run_flash(q, k, v, do, g, jit=mode == "jit", implementation=implementation,
                    is_causal=True)
    assert out["o"].shape == q.shape and out["lse"].shape == (b, h, tq)
    assert out["dq"].shape == q.shape and out["dk"].shape == k.shape == out["dv"].shape
    assert np.all(f64(out["o"]) == 0) and np.all(f64(out["lse"]) == -np.inf)
    for name in ("dq", "dk", "dv"):
        assert np.all(f64(out[name]) == 0), name


def test_nan_in_visible_input_propagates(implementation):
    """NaN in a key/value/query some rows can see poisons exactly those rows (as the oracle says);
    rows that cannot see it stay finite and exact."""
    q, k, v, do, g = make_inputs(6, 1, 12, 12, 2, 1, 16, jnp.float32)
    v = v.at[0, 5, 0, 3].set(jnp.nan)   # visible to rows >= 5 under causal
    k = k.at[0, 9, 0, 0].set(jnp.inf)   # visible to rows >= 9
    q = q.at[0, 2, 1, 7].set(jnp.nan)   # row 2 of head 1
    actual, expected = check_against_oracle(q, k, v, do, g, implementation=implementation,
                                            is_causal=True)
    o = f64(actual["o"])
    assert np.isnan(o[0, 5:, :, 3]).all() and np.isnan(o[0, 9:]).all()
    assert np.isnan(o[0, 2, 1]).all()
    assert np.isfinite(o[0, :5, 0]).all() and np.isfinite(o[0, [0, 1, 3, 4], 1]).all()
    assert np.isfinite(np.delete(o[0, 5:9], 3, axis=-1)).all()
    assert np.isfinite(f64(actual["dq"])[0, :2]).all()  # rows 0, 1 see no non-finite input


def test_reference_attention_matches_oracle_and_flash():
    """reference_attention (plain jnp, autodiff) agrees with the oracle, and its autodiff
    gradients agree with the flash FA2 recompute backward."""
    q, k, v, do, g = make_inputs(8, 2, 9, 13, 4, 2, 32, jnp.float32)
    kl = np.array([13, 6], np.int32)
    kw = dict(is_causal=True, local_window_size=(4, 1), causal_alignment="bottom_right",
              key_value_seq_lengths=kl)
    o, lse = jax.jit(lambda q, k, v: reference_attention(q, k, v, return_lse=True, **kw))(q, k, v)
    exp_o, exp_lse = oracle.attention(f64(q), f64(k), f64(v), **kw)
    tolerance.assert_matches_oracle("o", o, exp_o)
    tolerance.assert_matches_oracle("lse", lse, exp_lse)
    ref_grads = jax.jit(lambda *a: jax.vjp(
        lambda q, k, v: reference_attention(q, k, v, return_lse=True, **kw), *a[:3])[1](a[3:])
    )(q, k, v, do, g)
    flash = run_flash(q, k, v, do, g, **kw)
    for name, r in zip(("dq", "dk", "dv"), ref_grads):
        np.testing.assert_allclose(f64(r), f64(flash[name]), rtol=1e-4, atol=1e-5, err_msg=name)


def test_gqa_equals_repeated_heads(implementation):
    """Query head n reads kv head n // group: same as repeating each kv head group times."""
    q, k, v, do, g = make_inputs(9, 1, 7, 10, 6, 2, 16, jnp.float32)
    o = flash_attention(q, k, v, implementation=implementation)
    o_rep = flash_attention(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2),
                            implementation=implementation)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_rep), rtol=1e-6, atol=1e-6)


def test_reference_attention_any_order():
    """reference_attention is plain jnp: forward mode and second order work (the documented
    alternative when flash_attention's first-order reverse mode is not enough)."""
    q, k, v, _, _ = make_inputs(10, 1, 3, 4, 2, 1, 4, jnp.float32)
    jax.test_util.check_grads(
        lambda q, k, v: reference_attention(q, k, v, is_causal=True,
                                            causal_alignment="bottom_right"),
        (q, k, v), order=2, modes=["fwd", "rev"], eps=1e-2, atol=2e-2, rtol=2e-2)
