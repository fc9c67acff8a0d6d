"""jax_flash_metal.equinox.MultiheadAttention against equinox.nn.MultiheadAttention with the same
weights and inputs (outputs and gradients), and the parameter pytree they share."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework_helpers import assert_close, assert_half_close

eqx = pytest.importorskip("equinox")
import optax  # noqa: E402

from jax_flash_metal import dropout_mask  # noqa: E402
from jax_flash_metal.equinox import MultiheadAttention  # noqa: E402

LEN, KV_LEN, SIZE = 8, 12, 32
SIZES = {"num_heads": 2, "query_size": SIZE}  # head size 16, the smallest the kernels have


def pair(**kw):
    """(Equinox's module, ours), built from the same key: the same weights."""
    args = {**SIZES, **kw}
    return (eqx.nn.MultiheadAttention(**args, key=jax.random.PRNGKey(0)),
            MultiheadAttention(**args, key=jax.random.PRNGKey(0)))


def inputs(seed=0, q_len=LEN, kv_len=KV_LEN, size=SIZE):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, (q_len, size)), jax.random.normal(k2, (kv_len, size)),
            jax.random.normal(k3, (kv_len, size)))


def output_and_grads(module, args, **call):
    """Output and gradients (w.r.t. the module's arrays and the inputs) of sum(out * c)."""
    def run(module, *args):
        return module(*args, **call)

    c = jax.random.normal(jax.random.PRNGKey(9), (args[0].shape[0], module.output_size))
    loss = lambda m, *a: jnp.sum(run(m, *a).astype(jnp.float32) * c)  # noqa: E731
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, a: loss(m, *a)))(module, args)
    return eqx.filter_jit(run)(module, *args), eqx.filter(grads, eqx.is_array)


def test_same_pytree_and_serialisation(tmp_path):
    theirs, mine = pair(qk_size=16, vo_size=24, use_query_bias=True, use_output_bias=True)
    # Same fields, same leaves: only the class differs.
    assert [f for f in vars(theirs)] == [f for f in vars(mine)]
    for a, b in zip(jax.tree.leaves(theirs), jax.tree.leaves(mine)):
        np.testing.assert_array_equal(a, b)
    # Weights saved from Equinox's module load unchanged into ours.
    trained = jax.tree.map(lambda x: x + 1.0 if eqx.is_inexact_array(x) else x, theirs)
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, trained)
    buffer.seek(0)
    loaded = eqx.tree_deserialise_leaves(buffer, mine)
    assert isinstance(loaded, MultiheadAttention)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)


def test_unmasked(implementation):
    theirs, mine = pair()
    args = inputs()
    got = output_and_grads(mine, args, implementation=implementation)
    want = output_and_grads(theirs, args)
    assert_close("output", got[0], want[0])
    assert_close("gradient", got[1], want[1])


def test_different_qk_and_vo_sizes():
    # flash_attention has one head_dim: q and k (16) are zero-padded to the value size (24).
    theirs, mine = pair(qk_size=16, vo_size=24, output_size=20, key_size=28, value_size=36)
    args = inputs()[0], inputs()[1][:, :28], jnp.tile(inputs()[2], (1, 2))[:, :36]
    got, want = output_and_grads(mine, args), output_and_grads(theirs, args)
    assert got[0].shape == (LEN, 20)
    assert_close("output", got[0], want[0])
    assert_close("gradient", got[1], want[1])


def masks(case):
    rows, cols = jnp.arange(LEN)[:, None], jnp.arange(KV_LEN)[None, :]
    causal = cols <= rows + (KV_LEN - LEN)  # a cache of KV_LEN - LEN earlier positions
    per_head = jnp.stack([causal, cols < jnp.arange(1, LEN + 1)[:, None]])  # [2, LEN, KV_LEN]
    return {"causal": causal, "padding": jnp.broadcast_to(cols < 5, (LEN, KV_LEN)),
            "per-head": per_head}[case]


# Masked calls, on every implementation: the fused kernels read the mask per tile.
@pytest.mark.parametrize("case", ["causal", "padding", "per-head"])
def test_masks(implementation, case):
    theirs, mine = pair()
    args = inputs()
    got = output_and_grads(mine, args, mask=masks(case), implementation=implementation)
    want = output_and_grads(theirs, args, mask=masks(case))
    assert_close("output", got[0], want[0])
    assert_close("gradient", got[1], want[1])


def test_vmapped_batch_and_process_heads():
    theirs, mine = pair()
    q, k, v = (jnp.stack([a, 2 * a]) for a in inputs())

    def process_heads(q, k, v):  # a position-dependent rescaling, as rotary embeddings are
        scale = 1.0 + jnp.arange(q.shape[0])[:, None, None] / q.shape[0]
        return q * scale, k * (1.0 + jnp.arange(k.shape[0])[:, None, None] / 10), v

    def run(module):
        return jax.vmap(lambda q, k, v: module(q, k, v, process_heads=process_heads))(q, k, v)

    assert_close("output", run(mine), run(theirs))


def test_bfloat16():
    theirs, mine = pair(dtype=jnp.bfloat16)
    reference, _ = pair()
    reference = jax.tree.map(lambda r, t: t.astype(jnp.float32) if eqx.is_array(t) else r,
                             reference, theirs)  # float32 copy of the same bfloat16 weights
    args = tuple(a.astype(jnp.bfloat16) for a in inputs())
    got, framework = output_and_grads(mine, args), output_and_grads(theirs, args)
    assert got[0].dtype == framework[0].dtype == jnp.bfloat16
    want = output_and_grads(reference, tuple(a.astype(jnp.float32) for a in args))
    assert_half_close(got, framework, want)


def test_inactive_dropout_is_plain_attention():
    """inference=True at the call, at construction, or the deprecated deterministic=True."""
    theirs, mine = pair(dropout_p=0.1)
    args = inputs()
    want = theirs(*args, inference=True)
    assert_close("output", mine(*args, inference=True), want)
    assert_close("output", eqx.nn.inference_mode(mine)(*args), want)
    with pytest.warns(UserWarning, match="deprecated"):
        assert_close("output", mine(*args, deterministic=True), want)


def test_bad_mask_and_lengths():
    _, mine = pair()
    q, k, v = inputs()
    with pytest.raises(ValueError, match="mask must have shape"):
        mine(q, k, v, mask=jnp.ones((LEN, LEN), bool))
    with pytest.raises(ValueError, match="equal length"):
        mine(q, k, v[:-1])


TOKENS = np.frombuffer(b"the quick brown fox jumps over the lazy dog", np.uint8)[:LEN * 4]


def train(cls, dropout_p=0.0, **call):
    """Losses of 20 Adam steps of a one-layer causal byte model with attention ``cls``; with
    dropout, a new key per step and sequence."""
    tokens = jnp.asarray(TOKENS.reshape(4, LEN).astype(np.int32))
    causal = jnp.tril(jnp.ones((LEN - 1, LEN - 1), bool))
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    params = (eqx.nn.Embedding(256, SIZE, key=k1), cls(**SIZES, dropout_p=dropout_p, key=k2))

    def loss(model, key):
        embed, attn = model

        def one(seq, key):
            x = jax.vmap(embed)(seq[:-1])
            logits = (x + attn(x, x, x, mask=causal, key=key, **call)) @ embed.weight.T
            return optax.softmax_cross_entropy_with_integer_labels(logits, seq[1:]).mean()

        return jax.vmap(one)(tokens, jax.random.split(key, len(tokens))).mean()

    optimizer = optax.adam(1e-2)
    state = optimizer.init(eqx.filter(params, eqx.is_array))

    @eqx.filter_jit
    def step(params, state, key):
        value, grads = eqx.filter_value_and_grad(loss)(params, key)
        updates, state = optimizer.update(grads, state)
        return eqx.apply_updates(params, updates), state, value

    losses = []
    for n in range(20):
        params, state, value = step(params, state, jax.random.key(n))
        losses.append(float(value))
    return losses


def test_training_matches_equinox(implementation):
    """20 Adam steps of a one-layer byte model: the same losses as with Equinox's attention.
    The causal mask reaches the fused kernels as a mask operand."""
    want = train(eqx.nn.MultiheadAttention)
    got = train(MultiheadAttention, implementation=implementation)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert want[-1] < want[0] - 1.0  # it trains


def test_training_with_dropout(implementation):
    """The byte model trains with attention dropout (0.2) on every implementation; a fused
    one draws the same masks as xla (the same losses)."""
    want = train(MultiheadAttention, dropout_p=0.2, implementation="xla")
    assert want[-1] < want[0] - 1.0
    assert want != train(MultiheadAttention, implementation="xla")  # dropout is active
    if implementation != "xla":
        np.testing.assert_allclose(
            train(MultiheadAttention, dropout_p=0.2, implementation=implementation), want,
            rtol=0, atol=1e-4)


def test_dropout_is_the_dense_formula_with_dropout_mask():
    """Attention dropout with ``key``: softmax(q k^T / sqrt(d)) * M[0] / (1 - p) times V for
    the module's own heads (read through process_heads), M = dropout_mask(key, ...)."""
    _, mine = pair(dropout_p=0.3)
    q, k, v = inputs()
    key = jax.random.key(5)
    heads = []
    out = mine(q, k, v, key=key, process_heads=lambda *h: heads.extend(h) or h)
    qh, kh, vh = heads  # [len, num_heads, 16]
    p = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", qh, kh) / np.sqrt(16), axis=-1)
    keep = dropout_mask(key, (1, 2, LEN, KV_LEN), 0.3)[0]
    attn = jnp.einsum("hqk,khd->qhd", p * keep / 0.7, vh).reshape(LEN, -1)
    assert_close("output", out, jax.vmap(mine.output_proj)(attn))
    with pytest.raises(ValueError, match="key"):
        mine(q, k, v)


def test_vmapped_keys_give_each_sequence_its_own_mask():
    _, mine = pair(dropout_p=0.5)
    q, k, v = inputs()
    keys = jax.random.split(jax.random.key(1), 3)
    got = jax.vmap(lambda key: mine(q, k, v, key=key))(keys)
    for n, key in enumerate(keys):
        assert_close("output", got[n], mine(q, k, v, key=key))
    assert not np.allclose(got[0], got[1])
