"""JAX transformations around flash_attention: vmap (batching rules of both primitives), jit,
check_grads, determinism, and the primitive contract itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import oracle
import tolerance
from api_helpers import f64, make_inputs, oracle_all
from jax_flash_metal import flash_attention
from jax_flash_metal.core.contract import coerce_params
from jax_flash_metal.lowering.primitives import bwd_p, fwd_p


def test_vmap_extra_leading_axes(implementation):
    """Two nested vmaps (extra leading axes 3 x 2), every operand batched, incl. gradients."""
    q, k, v, do, _ = make_inputs(11, 12, 9, 12, 4, 2, 16, jnp.float32)
    q, k, v, do = (x.reshape((3, 2, 2) + x.shape[1:]) for x in (q, k, v, do))

    def attn(q, k, v):
        return flash_attention(q, k, v, is_causal=True, implementation=implementation)

    def grads(q, k, v, do):
        return jax.vjp(attn, q, k, v)[1](do)

    o = jax.jit(jax.vmap(jax.vmap(attn)))(q, k, v)
    dq, dk, dv = jax.jit(jax.vmap(jax.vmap(grads)))(q, k, v, do)
    flat = [x.reshape((-1,) + x.shape[3:]) for x in (q, k, v, do)]
    want = oracle_all(*flat, is_causal=True)
    for name, got in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        tolerance.assert_matches_oracle(name, got.reshape(want[name].shape), want[name])


@pytest.mark.parametrize("axes", [(0, None, None), (None, 1, 1), (2, None, 0), (None, 0, None)],
                         ids=["q-only", "kv-only", "mixed-axes", "k-only"])
def test_vmap_unbatched_operands(implementation, axes):
    """Any mix of batched / unbatched operands and batch axes not in front."""
    n = 3
    q, k, v, do, _ = make_inputs(12, 2, 7, 10, 4, 2, 16, jnp.float32)
    rng = np.random.default_rng(1)

    def stack(x, axis):
        if axis is None:
            return x
        xs = jnp.stack([x + 0.1 * i * jnp.asarray(rng.standard_normal(x.shape), x.dtype)
                        for i in range(n)])
        return jnp.moveaxis(xs, 0, axis)

    bq, bk, bv = stack(q, axes[0]), stack(k, axes[1]), stack(v, axes[2])

    def loss(q, k, v):
        o = flash_attention(q, k, v, local_window_size=(2, 3), implementation=implementation)
        return jnp.sum(o * do)

    fn = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2)), in_axes=axes))
    _, (dq, dk, dv) = fn(bq, bk, bv)
    for i in range(n):
        take = [x if a is None else jnp.take(x, i, axis=a) for x, a in zip((bq, bk, bv), axes)]
        want = oracle_all(*take, do, local_window_size=(2, 3))
        tolerance.assert_matches_oracle("dq", dq[i], want["dq"])
        tolerance.assert_matches_oracle("dk", dk[i], want["dk"])
        tolerance.assert_matches_oracle("dv", dv[i], want["dv"])


def test_vmap_batched_lengths(implementation):
    """Lengths vmapped while q/k/v are shared; and lengths shared while q is vmapped."""
    q, k, v, do, g = make_inputs(13, 2, 8, 11, 2, 1, 16, jnp.float32)
    kls = jnp.array([[11, 3], [0, 7], [5, 11]], jnp.int32)
    qls = jnp.array([[8, 2], [1, 8], [6, 0]], jnp.int32)

    def attn(ql, kl):
        return flash_attention(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl,
                               is_causal=True, causal_alignment="bottom_right", return_lse=True,
                               implementation=implementation)

    def grads(ql, kl):
        return jax.vjp(lambda q, k, v: flash_attention(
            q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, is_causal=True,
            causal_alignment="bottom_right", return_lse=True, implementation=implementation),
            q, k, v)[1]((do, g))

    o, lse = jax.jit(jax.vmap(attn))(qls, kls)
    dq, dk, dv = jax.jit(jax.vmap(grads))(qls, kls)
    for i in range(3):
        want = oracle_all(q, k, v, do, g, query_seq_lengths=np.asarray(qls[i]),
                          key_value_seq_lengths=np.asarray(kls[i]), is_causal=True,
                          causal_alignment="bottom_right")
        for name, got in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
            tolerance.assert_matches_oracle(name, got[i], want[name])

    # Shared lengths, batched query.
    qs = jnp.stack([q, 2 * q])
    out = jax.vmap(lambda q: flash_attention(q, k, v, key_value_seq_lengths=kls[0],
                                             implementation=implementation))(qs)
    for i in range(2):
        want, _ = oracle.attention(f64(qs[i]), f64(k), f64(v),
                                   key_value_seq_lengths=np.asarray(kls[0]))
        tolerance.assert_matches_oracle("o", out[i], want)


def test_vmap_of_zero_size_batch(implementation):
    q, k, v, do, _ = make_inputs(0, 0, 4, 6, 2, 2, 16, jnp.float32)
    q = jnp.stack([q] * 2)
    out = jax.vmap(lambda q: flash_attention(q, k, v, implementation=implementation))(q)
    assert out.shape == q.shape
    out = jax.vmap(lambda q: flash_attention(q, k, v, implementation=implementation))(q[:0])
    assert out.shape == q[:0].shape


def test_vmap_with_no_operand_batched(implementation):
    """Attention on closed-over operands inside vmap: the batching rules are called with every
    operand unbatched, bind once on the unbatched shapes and leave the outputs unbatched."""
    q, k, v, do, _ = make_inputs(18, 2, 5, 7, 4, 2, 16, jnp.float32)
    scales = jnp.array([1.0, -2.0, 0.5], jnp.float32)

    def fn(s):
        o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, implementation=implementation),
                         q, k, v)
        return (s * o,) + tuple(s * d for d in vjp(do))

    jaxpr = jax.make_jaxpr(jax.vmap(fn))(scales)
    prims = [e for e in jaxpr.eqns if e.primitive in (fwd_p, bwd_p)]
    assert sorted(e.primitive.name for e in prims) == [bwd_p.name, fwd_p.name]
    assert all(e.invars[0].aval.shape == q.shape for e in prims)
    got = jax.jit(jax.vmap(fn))(scales)
    want = oracle_all(q, k, v, do)
    for i, s in enumerate(np.asarray(scales, np.float64)):
        for name, x in zip(("o", "dq", "dk", "dv"), got):
            tolerance.assert_matches_oracle(name, x[i], s * want[name])


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True, local_window_size=(2, 1),
                                             causal_alignment="bottom_right")])
def test_check_grads(implementation, kw):
    """jax.test_util.check_grads: reverse mode against numerical differences (float32)."""
    q, k, v, _, _ = make_inputs(14, 1, 5, 6, 2, 1, 16, jnp.float32)
    check_grads(lambda q, k, v: flash_attention(q, k, v, implementation=implementation, **kw),
                (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=5e-3, rtol=5e-3)
    check_grads(lambda q, k, v: flash_attention(q, k, v, return_lse=True,
                                                implementation=implementation, **kw)[1],
                (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backward_is_deterministic(implementation, dtype):
    """Repeated runs, and a fresh compilation, give bit-identical gradients."""
    q, k, v, do, g = make_inputs(15, 2, 33, 47, 4, 1, 32, dtype)

    def grads(q, k, v, do, g):
        f = lambda q, k, v: flash_attention(q, k, v, is_causal=True, return_lse=True,  # noqa
                                            implementation=implementation)
        return jax.vjp(f, q, k, v)[1]((do, g))

    first = jax.jit(grads)(q, k, v, do, g)
    again = jax.jit(grads)(q, k, v, do, g)
    fresh = jax.jit(lambda *a: grads(*a))(q, k, v, do, g)
    for a, b, c in zip(first, again, fresh):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


def test_primitives_directly(implementation):
    """The contract of both primitives: operands, optional lengths, params, result avals."""
    q, k, v, do, g = make_inputs(16, 2, 6, 9, 4, 2, 16, jnp.float32)
    ql, kl = jnp.array([6, 3], jnp.int32), jnp.array([9, 4], jnp.int32)
    params = coerce_params(scale=0.3, is_causal=True, window_left=-1, window_right=2,
                           bottom_right=True, has_q_lengths=True, has_kv_lengths=True,
                           implementation=implementation)
    o, lse, row_max, log_sum = jax.jit(lambda *a: fwd_p.bind(*a, **params))(q, k, v, ql, kl)
    dq, dk, dv = jax.jit(lambda *a: bwd_p.bind(*a, **params))(q, k, v, o, lse, row_max, log_sum,
                                                              do, g, ql, kl)
    kw = dict(scale=0.3, is_causal=True, local_window_size=(None, 2),
              causal_alignment="bottom_right", query_seq_lengths=np.asarray(ql),
              key_value_seq_lengths=np.asarray(kl))
    want = oracle_all(q, k, v, do, g, **kw)
    for name, got in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        tolerance.assert_matches_oracle(name, got, want[name])
    # Abstract evaluation: shapes/dtypes without running anything.
    shapes = jax.eval_shape(lambda *a: fwd_p.bind(*a, **params), q.astype(jnp.bfloat16),
                            k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), ql, kl)
    assert [(s.shape, s.dtype) for s in shapes] == [(q.shape, jnp.bfloat16),
                                                    ((2, 4, 6), jnp.float32),
                                                    ((2, 4, 6), jnp.float32),
                                                    ((2, 4, 6), jnp.float32)]
    # Eager binding takes the same path as jit.
    eager = fwd_p.bind(q, k, v, ql, kl, **params)
    np.testing.assert_array_equal(np.asarray(eager[0]), np.asarray(o))


def test_primitives_in_jaxpr():
    """Under jit the fused primitives stay opaque (not inlined into jnp ops)."""
    q, k, v, _, _ = make_inputs(17, 1, 4, 4, 2, 2, 16, jnp.float32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q: flash_attention(q, k, v).sum()))(q)
    text = str(jaxpr)
    assert "flash_attention_fwd" in text and "flash_attention_bwd" in text


def test_coerce_params_exact_types():
    params = coerce_params(scale=np.float32(0.5), is_causal=np.bool_(True), window_left=np.int64(3),
                           window_right=-1, bottom_right=0, has_q_lengths=False,
                           has_kv_lengths=1, implementation=None)
    assert params == dict(scale=0.5, is_causal=True, window_left=3, window_right=-1,
                          bottom_right=False, has_q_lengths=False, has_kv_lengths=True,
                          implementation=None, has_segment_ids=False, has_bias=False,
                          has_mask=False, has_sinks=False, logits_soft_cap=None,
                          has_alibi=False, has_page_table=False, dropout_rate=0.0,
                          dropout_key_groups=True,
                          kernel_variant=-1)  # variants.AUTO: the lowering chooses
    assert [type(x) for x in params.values()] == [float, bool, int, int, bool, bool, bool,
                                                  type(None), bool, bool, bool, bool, type(None),
                                                  bool, bool, float, bool, int]
    full = coerce_params(scale=1, is_causal=False, window_left=-1, window_right=-1,
                         bottom_right=False, has_q_lengths=False, has_kv_lengths=False,
                         implementation="xla", has_bias=np.bool_(True),
                         logits_soft_cap=np.int32(30), bias_grad=1, alibi_grad=np.bool_(False))
    assert (type(full["logits_soft_cap"]), full["logits_soft_cap"], full["bias_grad"]) == (
        float, 30.0, True)
    assert full["alibi_grad"] is False
