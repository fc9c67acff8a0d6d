"""jax_flash_metal.flax.attention_fn in flax.nnx and flax.linen modules, against Flax's own
attention with the same weights and inputs (outputs and gradients)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework_helpers import assert_close, assert_half_close

pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from jax_flash_metal import dropout_mask, implementations  # noqa: E402
from jax_flash_metal.flax import attention_fn  # noqa: E402

FEATURES, HEADS, LEN = 32, 2, 8  # head_dim 16, the smallest the kernels have


def inputs(shape=(2, LEN, FEATURES), seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def nnx_module(fn, dtype=jnp.float32, **kw):
    return nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, dtype=dtype, attention_fn=fn,
                                  rngs=nnx.Rngs(0), **kw)


def ours(implementation):
    return functools.partial(attention_fn, implementation=implementation)


def nnx_output_and_grads(module, x, **call):
    """Output and gradients (w.r.t. the parameters and x) of sum(out * c), c fixed."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def run(params, x):
        return nnx.merge(graphdef, params, rest)(x, **call)

    c = jax.random.normal(jax.random.PRNGKey(9), x.shape)
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(run(p, x).astype(jnp.float32) * c),
                             (0, 1)))(params, x)
    return jax.jit(run)(params, x), grads


def masks(case, x):
    """Call keywords: {"mask": Flax-style mask for the self-attention of x [batch..., len,
    features], [batch..., 1, len, len] bool}, or {} for case "none"."""
    if case == "none":
        return {}
    tokens = x[..., 0]
    causal = nnx.make_causal_mask(tokens, dtype=jnp.bool_)
    lengths = jnp.arange(tokens.size // LEN).reshape(tokens.shape[:-1]) % LEN + 1
    key_valid = jnp.arange(LEN) < lengths[..., None]  # every row keeps key 0: no empty row
    padding = nnx.make_attention_mask(jnp.ones_like(key_valid), key_valid, dtype=jnp.bool_)
    return {"mask": {"causal": causal, "padding": padding,
                     "causal+padding": causal & padding}[case]}


def test_nnx_unmasked(implementation):
    x = inputs()
    got = nnx_output_and_grads(nnx_module(ours(implementation)), x)
    want = nnx_output_and_grads(nnx_module(nnx.dot_product_attention), x)
    assert_close("output", got[0], want[0])
    assert_close("gradient", got[1], want[1])


# Masked calls, on every implementation: the fused kernels read the mask per tile.
@pytest.mark.parametrize("case", ["causal", "padding", "causal+padding"])
@pytest.mark.parametrize("shape", [(2, LEN, FEATURES), (2, 3, LEN, FEATURES)],
                         ids=["one-batch-axis", "two-batch-axes"])
def test_nnx_masks(implementation, case, shape):
    x = inputs(shape)
    got = nnx_output_and_grads(nnx_module(ours(implementation)), x, **masks(case, x))
    want = nnx_output_and_grads(nnx_module(nnx.dot_product_attention), x, **masks(case, x))
    assert_close("output", got[0], want[0])
    assert_close("gradient", got[1], want[1])


def test_nnx_extra_batch_axes_unmasked():
    x = inputs((2, 3, LEN, FEATURES))
    got = nnx_output_and_grads(nnx_module(ours("xla")), x)
    want = nnx_output_and_grads(nnx_module(nnx.dot_product_attention), x)
    assert_close("output", got[0], want[0])
    assert_close("gradient", got[1], want[1])


@pytest.mark.parametrize("case", ["none", "causal"])
def test_nnx_bfloat16(case):
    x, dtype = inputs(), jnp.bfloat16
    call = masks(case, x)
    got = nnx_output_and_grads(nnx_module(attention_fn, dtype), x, **call)
    framework = nnx_output_and_grads(nnx_module(nnx.dot_product_attention, dtype), x, **call)
    reference = nnx_output_and_grads(nnx_module(nnx.dot_product_attention), x, **call)
    assert got[0].dtype == framework[0].dtype == dtype
    assert_half_close(got, framework, reference)


def nnx_decode(module, x):
    """Outputs [batch, len, features] of feeding x one position at a time through the cache."""
    module.init_cache(x.shape)
    return jnp.concatenate([module(x[:, t:t + 1]) for t in range(x.shape[1])], axis=1)


def test_nnx_decode_with_cache():
    x = inputs()
    ours_m, flax_m = (nnx.MultiHeadAttention(HEADS, FEATURES, decode=True, attention_fn=fn,
                                             rngs=nnx.Rngs(0))
                      for fn in (attention_fn, nnx.dot_product_attention))
    graphdef, state = nnx.split(ours_m)
    flax_graphdef, flax_state = nnx.split(flax_m)

    def decoded(graphdef, state, x):
        return nnx_decode(nnx.merge(graphdef, state), x)

    c = jax.random.normal(jax.random.PRNGKey(9), x.shape)
    got, got_dx = (f(graphdef, state, x) for f in (
        decoded, jax.grad(lambda g, s, x: jnp.sum(decoded(g, s, x) * c), 2)))
    want, want_dx = (f(flax_graphdef, flax_state, x) for f in (
        decoded, jax.grad(lambda g, s, x: jnp.sum(decoded(g, s, x) * c), 2)))
    assert_close("output", got, want)
    assert_close("gradient", got_dx, want_dx)
    # Decoding step by step is causal self-attention.
    full = nnx_module(nnx.dot_product_attention)(x, **masks("causal", x))
    assert_close("output", got, full)


def linen_pair(implementation, x):
    module = functools.partial(nn.MultiHeadDotProductAttention, num_heads=HEADS,
                               qkv_features=FEATURES)
    ours_m, flax_m = module(attention_fn=ours(implementation)), module()
    return ours_m, flax_m, flax_m.init(jax.random.PRNGKey(0), x)


def test_linen_unmasked(implementation):
    x = inputs()
    ours_m, flax_m, params = linen_pair(implementation, x)
    assert_close("output", ours_m.apply(params, x), flax_m.apply(params, x))


def test_linen_mask_is_applied():
    x = inputs()
    ours_m, flax_m, params = linen_pair(None, x)
    mask = masks("causal+padding", x)["mask"]

    def loss(module, params, x):
        return jnp.sum(module.apply(params, x, mask=mask) ** 2)

    got = ours_m.apply(params, x, mask=mask)
    want = flax_m.apply(params, x, mask=mask)
    assert_close("output", got, want)
    assert np.max(np.abs(want - flax_m.apply(params, x))) > 0.1  # the mask matters here
    assert_close("gradient", jax.grad(functools.partial(loss, ours_m), (0, 1))(params, x),
                 jax.grad(functools.partial(loss, flax_m), (0, 1))(params, x))


def test_bias_with_extra_batch_axes():
    q, k, v = (inputs((2, 3, LEN, HEADS, 16), seed) for seed in range(3))
    bias = inputs((2, 3, 1, LEN, LEN), 3)
    mask = inputs((2, 3, HEADS, LEN, LEN), 4) > -1.0

    def run(fn):
        out = lambda q, k, v, bias: fn(q, k, v, bias=bias, mask=mask)  # noqa: E731
        c = inputs(q.shape, 5)
        grads = jax.grad(lambda *a: jnp.sum(out(*a) * c), (0, 1, 2, 3))(q, k, v, bias)
        return out(q, k, v, bias), grads

    got, want = run(attention_fn), run(nnx.dot_product_attention)
    assert_close("output", got[0], want[0])
    assert_close("gradient", got[1], want[1])


def dense_with_our_mask(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                        dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                        **unused):
    """Flax's attention with ``dropout_mask``'s M instead of Flax's own draw: the dense formula
    the adapter must reproduce (M[0, 0] for every batch entry and head when broadcast)."""
    weights = nn.dot_product_attention_weights(query, key, bias, mask, dtype=dtype)
    if dropout_rate > 0.0 and not deterministic:
        b, h, tq, tk = weights.shape
        keep = dropout_mask(dropout_rng, (1, 1, tq, tk) if broadcast_dropout else (b, h, tq, tk),
                            dropout_rate)
        weights = weights * keep / (1.0 - dropout_rate)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value)


@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout_is_the_dense_formula_with_dropout_mask(implementation, broadcast):
    """nnx.MultiHeadAttention(dropout_rate=0.3) not deterministic, with the same rngs: output
    and input gradient as the dense formula with M, on every implementation."""
    x = inputs()
    kw = dict(dropout_rate=0.3, broadcast_dropout=broadcast)
    c = jax.random.normal(jax.random.PRNGKey(9), x.shape)

    def output_and_grad(fn):
        module = nnx_module(fn, **kw)

        def run(x):
            return module(x, deterministic=False, rngs=nnx.Rngs(dropout=5))

        return run(x), jax.grad(lambda x: jnp.sum(run(x) * c))(x)

    want = output_and_grad(dense_with_our_mask)
    got = output_and_grad(ours(implementation))
    assert_close("output", got[0], want[0])
    assert_close("gradient", got[1], want[1])
    # Inactive dropout (deterministic) is plain attention.
    plain = nnx_module(nnx.dot_product_attention, **kw)(x, deterministic=True)
    assert_close("output", nnx_module(ours("xla"), **kw)(x, deterministic=True), plain)


def test_refusals():
    x = inputs()
    with pytest.raises(NotImplementedError, match="sow_weights"):
        nnx_module(ours("xla"))(x, sow_weights=True)
    ours_m, _, params = linen_pair("xla", x)
    with pytest.raises(NotImplementedError, match="sow_weights"):
        ours_m.apply(params, x, sow_weights=True, mutable=["intermediates"])
    with pytest.raises(NotImplementedError, match="precision"):
        nnx_module(ours("xla"), precision=jax.lax.Precision.HIGHEST)(x)
    q = x.reshape(2, LEN, HEADS, FEATURES // HEADS)
    for name in ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum"):
        with pytest.raises(NotImplementedError, match=name):
            attention_fn(q, q, q, **{name: jnp.einsum})
    with pytest.raises(NotImplementedError, match="input_positions"):
        attention_fn(q, q, q, input_positions=jnp.arange(LEN))


def test_bad_shapes_name_the_argument():
    q = inputs((2, LEN, HEADS, 16))
    with pytest.raises(ValueError, match="key has batch axes"):
        attention_fn(q, q[None], q[None])
    with pytest.raises(ValueError, match="mask has shape"):
        attention_fn(q, q, q, mask=jnp.ones((1, 1, 2, HEADS, LEN, LEN), bool))


def test_dtype_promotion_like_flax():
    q = inputs((2, LEN, HEADS, 16)).astype(jnp.bfloat16)
    k = inputs((2, LEN, HEADS, 16), seed=1)  # float32: promoted together to float32
    assert attention_fn(q, k, k).dtype == nnx.dot_product_attention(q, k, k).dtype == jnp.float32
    got = attention_fn(q, k, k, dtype=jnp.bfloat16)
    assert got.dtype == nnx.dot_product_attention(q, k, k, dtype=jnp.bfloat16).dtype


def test_nnx_training_matches_flax(implementation):
    from jax_flash_metal.examples import train_flax

    cfg = train_flax.TINY  # causal: its mask reaches the fused kernels
    data = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 20, np.uint8)
    want, _ = train_flax.train(cfg, data, nnx.dot_product_attention)
    got, _ = train_flax.train(cfg, data, ours(implementation))
    assert len(got) == cfg.steps == 20
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert want[-1] < want[0] - 1.0  # it trains


def test_train_flax_example(tmp_path, capsys):
    from jax_flash_metal.examples import train_flax

    text = tmp_path / "text.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 20)
    result = train_flax.main(["--text", str(text), "--tiny", "--steps", "6"])
    out = capsys.readouterr().out
    assert "median ms per step" in out and "causal" in out
    (flax_name, want), (ours_name, got) = result["losses"].items()
    assert flax_name in out and ours_name in out
    # Labelled with the implementation that ran (implementation=None picks it), not "default".
    ran = ours_name.removeprefix("jax_flash_metal[").removesuffix("]")
    assert ran in implementations.available() and f"attention implementation: {ran}" in out
    assert len(got) == len(want) == 6
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert set(result["step_seconds"]) == {flax_name, ours_name}
