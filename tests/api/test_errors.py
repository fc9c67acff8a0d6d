"""Every validation error names its argument; unavailable implementations and unsupported
differentiation modes fail clearly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash_metal import flash_attention, implementations, reference_attention

Q = jnp.zeros((2, 5, 4, 16), jnp.float32)
K = jnp.zeros((2, 7, 2, 16), jnp.float32)

BAD_INPUTS = [
    # (overrides of (query, key, value) or keyword arguments, error type, text in the message)
    (dict(query=Q[0, 0]), ValueError, "query must have rank 4"),
    (dict(key=K[..., None]), ValueError, "key must have rank 4"),
    (dict(value=K[0, 0]), ValueError, "value must have rank 4"),
    (dict(query=[[1.0]]), ValueError, "query must have rank 4"),
    (dict(query=Q.astype(jnp.int32)), TypeError, "query dtype"),
    (dict(key=K.astype(jnp.float16)), TypeError, "share one dtype"),
    (dict(value=K[:, :6]), ValueError,
     "key and value must agree on [batch, kv_len, num_kv_heads] (only their head dims"),
    (dict(key=K[:1], value=K[:1]), ValueError, "batch"),
    (dict(key=K[..., :8], value=K[..., :8]), ValueError, "head_dim"),
    (dict(key=jnp.zeros((2, 7, 3, 16)), value=jnp.zeros((2, 7, 3, 16))), ValueError,
     "num_heads (4) must be a multiple of key/value num_kv_heads (3)"),
    (dict(key=jnp.zeros((2, 7, 0, 16)), value=jnp.zeros((2, 7, 0, 16))), ValueError,
     "at least one head"),
    (dict(query_seq_lengths=jnp.array([1.0, 2.0])), TypeError, "query_seq_lengths must have an "
     "integer dtype"),
    (dict(key_value_seq_lengths=jnp.array([1, 2, 3])), ValueError,
     "key_value_seq_lengths must have shape [batch]"),
    (dict(key_value_seq_lengths=3), ValueError, "key_value_seq_lengths must have shape [batch]"),
    (dict(local_window_size=-1), ValueError, "local_window_size must be a non-negative"),
    (dict(local_window_size=(2, -3)), ValueError, "local_window_size[1] (right)"),
    (dict(local_window_size=(1.5, 2)), TypeError, "local_window_size[0] (left)"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "(left, right) pair"),
    (dict(local_window_size="4"), TypeError, "local_window_size must be None"),
    (dict(causal_alignment="top-left"), ValueError, "causal_alignment must be one of"),
    (dict(scale=jnp.ones(2)), TypeError, "scale must be a real number known at trace time"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
    (dict(scale=jnp.float32(-jnp.inf)), ValueError, "scale must be a finite number"),
    (dict(scale="0.5"), TypeError, "scale must be"),
    (dict(bias=jnp.zeros((5, 7), jnp.int32)), TypeError, "bias must have a floating dtype"),
    (dict(bias=jnp.zeros((3, 5, 7))), ValueError, "bias of shape (1, 3, 5, 7) is not broadcast"),
    (dict(bias=jnp.zeros((1, 2, 4, 5, 7))), ValueError, "bias must have rank <= 4"),
    (dict(bias=[[0.0], [1.0, 2.0]]), TypeError, "bias must be an array-like"),
    (dict(mask=jnp.ones((5, 7), jnp.int32)), TypeError, "mask must be a bool array"),
    (dict(mask=jnp.ones((2, 4, 5, 6), bool)), ValueError, "mask of shape (2, 4, 5, 6) is not"),
    (dict(query_segment_ids=jnp.zeros((2, 5), jnp.int32)), ValueError,
     "query_segment_ids was given without its partner"),
    (dict(key_value_segment_ids=jnp.zeros((2, 7), jnp.int32)), ValueError,
     "key_value_segment_ids was given without its partner"),
    (dict(query_segment_ids=jnp.zeros((2, 5)), key_value_segment_ids=jnp.zeros((2, 7))),
     TypeError, "query_segment_ids must have an integer dtype"),
    (dict(query_segment_ids=jnp.zeros((2, 5), jnp.int32),
          key_value_segment_ids=jnp.zeros((2, 5), jnp.int32)), ValueError,
     "key_value_segment_ids must have shape [batch, len] = (2, 7)"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be a positive"),
    (dict(logits_soft_cap=-30.0), ValueError, "logits_soft_cap must be a positive"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap must be a positive"),
    (dict(logits_soft_cap="50"), TypeError, "logits_soft_cap must be a real number"),
    (dict(sinks=jnp.zeros((2,))), ValueError, "sinks must have shape [num_heads] = (4,)"),
    (dict(sinks=jnp.zeros((4,), jnp.int32)), TypeError, "sinks must have a floating dtype"),
    (dict(alibi_slopes=jnp.zeros(3)), ValueError,
     "alibi_slopes must have shape [num_heads] = (4,) or [batch, num_heads] = (2, 4)"),
    (dict(alibi_slopes=jnp.zeros(4, jnp.int32)), TypeError, "alibi_slopes must have a floating"),
    (dict(page_table=jnp.zeros((2, 1), jnp.int32)), ValueError,
     "page_table needs key_value_seq_lengths"),
    (dict(page_table=jnp.zeros((3, 1), jnp.int32), key_value_seq_lengths=[1, 1]), ValueError,
     "page_table must have shape [batch, max_pages] with batch = 2"),
    (dict(page_table=jnp.zeros((2, 1)), key_value_seq_lengths=[1, 1]), TypeError,
     "page_table must have an integer dtype"),
    (dict(page_table=jnp.zeros((2, 1), jnp.int32), key=K[0], value=K[0]), ValueError,
     "key with page_table must be pages [num_pages, page_size, num_kv_heads, head_dim]"),
    (dict(page_table=jnp.zeros((2, 1), jnp.int32), value=K[:1]), ValueError,
     "key and value must agree on [num_pages, page_size, num_kv_heads]"),
    (dict(is_causal=2), TypeError, "is_causal must be a bool"),
    (dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
]


def _call(fn, overrides):
    args = dict(query=Q, key=K, value=K)
    args.update(overrides)
    return fn(args.pop("query"), args.pop("key"), args.pop("value"), **args)


@pytest.mark.parametrize("fn", [flash_attention, reference_attention])
@pytest.mark.parametrize("overrides,error,text", BAD_INPUTS, ids=[b[2][:30] for b in BAD_INPUTS])
def test_bad_input(fn, overrides, error, text):
    with pytest.raises(error) as info:
        _call(fn, overrides)
    assert text in str(info.value)


@pytest.mark.parametrize("name,kwargs", [
    ("page_table", dict(page_table=jnp.zeros((2, 1), jnp.int32)))])
def test_ring_attention_refuses(name, kwargs):
    """Paged caches are not supported with a sequence axis."""
    with pytest.raises(ValueError, match=f"{name} is not supported with sequence_axis_name"):
        flash_attention(Q, K, K, sequence_axis_name="sp", **kwargs)


@pytest.mark.parametrize("overrides,error,text", BAD_INPUTS[:6], ids=[b[2][:30] for b in
                                                                      BAD_INPUTS[:6]])
def test_bad_input_under_jit(overrides, error, text):
    """Validation happens at trace time, before anything runs."""
    with pytest.raises(error) as info:
        jax.jit(lambda: _call(flash_attention, overrides))()
    assert text in str(info.value)


@pytest.mark.parametrize("name", ["scale", "logits_soft_cap"])
def test_traced_static_number_is_an_error(name):
    """scale and the soft cap must be known at trace time; a traced one is named."""
    with pytest.raises(TypeError, match=f"{name} must be a real number known at trace time "
                                        r"\(Python, NumPy or a concrete JAX scalar, not a traced"):
        jax.jit(lambda x: flash_attention(Q, K, K, **{name: x}))(jnp.float32(0.5))


def test_unknown_implementation():
    with pytest.raises(ValueError, match="implementation must be one of"):
        flash_attention(Q, K, K, implementation="cuda")
    with pytest.raises(TypeError, match="implementation must be None, a str or a sequence"):
        flash_attention(Q, K, K, implementation=1)


@pytest.mark.parametrize("name", [n for n in ("emulator", "metal")
                                  if n not in implementations.available()])
def test_unavailable_implementation(name):
    """Asking for a fused implementation that cannot run raises, naming it and why: not
    available here (on the cpu platform), or not for this platform (any other default one)."""
    why = ("is not available" if jax.default_backend() == "cpu"
           else "runs only when lowering for the 'cpu' platform")
    with pytest.raises(NotImplementedError, match=f"implementation='{name}' {why}"):
        jax.jit(lambda q: flash_attention(q, K, K, implementation=name))(Q)


@pytest.mark.host
def test_environment_variable(monkeypatch):
    """$JAX_FLASH_METAL_IMPLEMENTATION replaces the None default at lowering time."""
    q = jnp.ones((1, 3, 2, 16), jnp.float32)  # shapes used by no other test: fresh lowering
    monkeypatch.setenv("JAX_FLASH_METAL_IMPLEMENTATION", "nonsense")
    with pytest.raises(ValueError, match="JAX_FLASH_METAL_IMPLEMENTATION must be one of"):
        jax.jit(lambda q: flash_attention(q, q, q))(q)
    # Which implementation a lowering took shows in its custom calls.
    for name in ["xla", *(n for n in ("emulator",) if n in implementations.available())]:
        monkeypatch.setenv("JAX_FLASH_METAL_IMPLEMENTATION", name)
        hlo = jax.jit(lambda q: flash_attention(q, q, q)).lower(q).as_text()
        assert ("jax_flash_metal_attention_fwd_emulator" in hlo) == (name == "emulator"), name
    if "metal" not in implementations.available():
        q2 = jnp.ones((1, 3, 2, 32), jnp.float32)
        monkeypatch.setenv("JAX_FLASH_METAL_IMPLEMENTATION", "metal")
        with pytest.raises(NotImplementedError, match="JAX_FLASH_METAL_IMPLEMENTATION='metal'"):
            jax.jit(lambda q: flash_attention(q, q, q))(q2)


@pytest.mark.parametrize("name", ["metal", "emulator"])
def test_fused_implementation_off_cpu_is_an_error(name):
    """Lowering for another platform: an explicit fused implementation is refused, None and
    "xla" use the jnp reference."""
    def lower(impl, platforms):
        f = jax.jit(lambda q: flash_attention(q, K, K, implementation=impl))
        return f.trace(Q).lower(lowering_platforms=platforms)

    with pytest.raises(NotImplementedError, match="runs only when lowering for the 'cpu'"):
        lower(name, ("cuda",))
    for impl in (None, "xla"):
        assert "custom_call" not in lower(impl, ("cuda", "tpu")).as_text()


def _loss(q):
    return flash_attention(q, K, K).sum()


@pytest.mark.parametrize("transform", [
    lambda: jax.jvp(_loss, (Q,), (Q,)),
    lambda: jax.jacfwd(_loss)(Q),
    lambda: jax.grad(lambda q: jax.grad(_loss)(q).sum())(Q),
    lambda: jax.hessian(_loss)(Q),
], ids=["jvp", "jacfwd", "grad-of-grad", "hessian"])
def test_forward_mode_and_second_order_are_clear_errors(transform):
    with pytest.raises(TypeError) as info:
        transform()
    message = str(info.value)
    assert "flash_attention supports only first-order reverse-mode differentiation" in message
    assert "reference_attention" in message
    assert "flash_attention_fwd" not in message and "flash_attention_bwd" not in message
