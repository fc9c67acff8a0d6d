"""``implementation`` as a name or an ordered chain, and the "cudnn" implementation: the static
predicate's rules (``cudnn.unsupported_reason``, mirroring the checks jax.nn makes before it
calls cuDNN: dtype, head dim per compute capability and cuDNN version, equal head dims, windows
only with causal masking) and ours (features cuDNN lacks, alignment, bias and mask, return_lse),
the trace-time choice and its errors off-GPU, the lowering's walk along a chain, the environment
override; on an NVIDIA GPU (skipped elsewhere), the default chain runs cuDNN and matches the
float64 oracle, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tolerance
from api_helpers import make_inputs
from jax_flash_metal import flash_attention
from jax_flash_metal.core import validation
from jax_flash_metal.core.contract import StaticParams
from jax_flash_metal.cudnn import attention as cudnn
from jax_flash_metal.lowering import dispatch

ON_CUDA = cudnn.device_facts()[0] is None
HOPPER = dict(capability=(9, 0), version=91900)
AMPERE = dict(capability=(8, 0), version=90100)


def _params(**kw):
    base = dict(scale=0.125, is_causal=False, window_left=-1, window_right=-1, bottom_right=False,
                has_q_lengths=False, has_kv_lengths=False, implementation=None)
    return StaticParams(**{**base, **kw})


def _arrays(batch=2, q_len=64, kv_len=64, heads=4, kv_heads=2, dk=64, dv=None,
            dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((batch, q_len, heads, dk), dtype),
            jax.ShapeDtypeStruct((batch, kv_len, kv_heads, dk), dtype),
            jax.ShapeDtypeStruct((batch, kv_len, kv_heads, dv or dk), dtype))


def _reason(arrays=None, params=None, return_lse=False, device=HOPPER):
    return cudnn.unsupported_reason(*(arrays or _arrays()), params or _params(),
                                    return_lse=return_lse, **device)


def test_predicate_accepts_what_cudnn_computes_exactly():
    assert _reason() is None
    assert _reason(_arrays(dtype=jnp.float16)) is None
    assert _reason(params=_params(is_causal=True)) is None
    assert _reason(params=_params(is_causal=True, window_left=16, window_right=3)) is None
    assert _reason(params=_params(has_q_lengths=True, has_kv_lengths=True)) is None
    # Bottom-right alignment where it is top-left's: equal lengths, or one row without window.
    assert _reason(params=_params(is_causal=True, bottom_right=True)) is None
    assert _reason(_arrays(q_len=1, kv_len=300), _params(is_causal=True, bottom_right=True,
                                                         has_kv_lengths=True)) is None
    assert _reason(_arrays(q_len=7, kv_len=300)) is None  # GQA, q_len != kv_len, no band


@pytest.mark.parametrize("arrays,params,device,text", [
    # jax's check_layout: Q must be fp16/bf16 (fp8 is not ours).
    (_arrays(dtype=jnp.float32), _params(), HOPPER, "dtype float32"),
    # check_is_flash_attention: head dim a multiple of 8, <= 256 on Hopper (cuDNN >= 9.5 in
    # jax 0.5.0), else <= 128.
    (_arrays(dk=60), _params(), HOPPER, "head dim 60"),
    (_arrays(dk=264), _params(), HOPPER, "up to 256"),
    (_arrays(dk=256), _params(), AMPERE, "up to 128"),
    (_arrays(dk=256), _params(), dict(capability=(9, 0), version=90400), "up to 128"),
    # jax.nn: value head dim as the key's.
    (_arrays(dv=32), _params(), HOPPER, "value head dim 32"),
    # jax.nn: cuDNN's sliding window is causal ("doesn't support right window").
    (_arrays(), _params(window_left=8, window_right=0), HOPPER, "without is_causal"),
    (_arrays(), _params(window_left=8, window_right=8), HOPPER, "without is_causal"),
    # Ours: alignment, features, semantics.
    (_arrays(q_len=4, kv_len=64), _params(is_causal=True, bottom_right=True), HOPPER,
     "bottom_right"),
    (_arrays(), _params(is_causal=True, bottom_right=True, has_kv_lengths=True), HOPPER,
     "bottom_right"),
    (_arrays(q_len=1), _params(is_causal=True, bottom_right=True, window_left=4), HOPPER,
     "bottom_right"),
    (_arrays(), _params(logits_soft_cap=30.0), HOPPER, "logits_soft_cap"),
    (_arrays(), _params(has_sinks=True), HOPPER, "sinks"),
    (_arrays(), _params(has_alibi=True), HOPPER, "alibi_slopes"),
    (_arrays(), _params(dropout_rate=0.1), HOPPER, "dropout"),
    (_arrays(), _params(has_page_table=True), HOPPER, "page_table"),
    (_arrays(), _params(has_segment_ids=True), HOPPER, "segment_ids"),
    (_arrays(), _params(has_bias=True), HOPPER, "bias or mask"),
    (_arrays(), _params(has_mask=True), HOPPER, "bias or mask"),
    (_arrays(kv_len=0), _params(), HOPPER, "empty"),
])
def test_predicate_refuses_with_a_reason(arrays, params, device, text):
    reason = _reason(arrays, params, device=device)
    assert reason is not None and text in reason, reason


def test_predicate_refuses_return_lse():
    """jax.nn's cuDNN backward drops the LSE's cotangent: gradients through it would be 0."""
    assert "return_lse" in _reason(return_lse=True)


@pytest.mark.skipif(ON_CUDA, reason="off-GPU behaviour")
def test_cudnn_alone_off_gpu_is_a_value_error_naming_why():
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="'cudnn' cannot run this call: the default device is"):
        flash_attention(q, q, q, implementation="cudnn")
    with pytest.raises(ValueError, match="'cudnn' cannot run this call"):
        jax.jit(lambda q: flash_attention(q, q, q, implementation=["cudnn"]))(q)


@pytest.mark.skipif(ON_CUDA, reason="off-GPU behaviour")
def test_chain_falls_through_to_xla_off_gpu():
    q, k, v, _, _ = make_inputs(0, 2, 8, 8, 4, 2, 16, jnp.bfloat16)
    want = flash_attention(q, k, v, is_causal=True, implementation="xla")
    for chain in (("cudnn", "xla"), ["cudnn", "xla"], "cudnn,xla"):
        got = jax.jit(lambda q, k, v, c=chain: flash_attention(
            q, k, v, is_causal=True, implementation=c))(q, k, v)
        np.testing.assert_array_equal(got, want)


def test_bad_chains():
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="at least one implementation"):
        flash_attention(q, q, q, implementation=())
    with pytest.raises(ValueError, match="must be one of"):
        flash_attention(q, q, q, implementation=("xla", "cuda"))
    with pytest.raises(TypeError, match="a str or a sequence of str"):
        flash_attention(q, q, q, implementation=("xla", 1))


def test_environment_override_takes_a_chain(monkeypatch):
    q = jnp.ones((1, 5, 2, 16), jnp.float16)
    monkeypatch.setenv("JAX_FLASH_METAL_IMPLEMENTATION", "cudnn,xla")
    assert flash_attention(q, q, q).shape == q.shape
    if not ON_CUDA:
        monkeypatch.setenv("JAX_FLASH_METAL_IMPLEMENTATION", "cudnn")
        with pytest.raises(ValueError, match=r"\$JAX_FLASH_METAL_IMPLEMENTATION='cudnn'"):
            flash_attention(q, q, q)


def test_trace_choice_walks_the_chain():
    ok, refused = (lambda: None), (lambda: "no GPU")
    assert dispatch.trace_choice(None, ok) == (True, None)
    assert dispatch.trace_choice(None, refused) == (False, None)
    assert dispatch.trace_choice(("cudnn", "xla"), ok) == (True, None)
    assert dispatch.trace_choice(("cudnn", "xla"), refused) == (False, ("xla",))
    assert dispatch.trace_choice(("metal", "cudnn"), ok) == (False, ("metal", "cudnn"))
    with pytest.raises(ValueError, match="'cudnn' cannot run this call: no GPU"):
        dispatch.trace_choice(("cudnn",), refused)


def test_resolve_walks_the_chain_at_lowering():
    call = ("fwd", jnp.dtype(jnp.float32), 16, 16)
    assert dispatch.resolve(("cudnn", "xla"), "cuda", call) == "xla"
    assert dispatch.resolve(("metal", "xla"), "cuda", call) == "xla"
    assert dispatch.resolve(("emulator", "metal", "xla"), "tpu", call) == "xla"
    with pytest.raises(NotImplementedError, match="runs only when lowering for the 'cpu'"):
        dispatch.resolve(("xla",)[:0] + ("metal",), "cuda", call)
    with pytest.raises(ValueError, match="'cudnn' runs only through flash_attention"):
        dispatch.resolve(("cudnn",), "cuda", call)


# ------------------------------------------------------------------ on an NVIDIA GPU

GPU_CASES = [  # (batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, keyword arguments)
    (2, 128, 128, 4, 2, 64, jnp.bfloat16, {}),
    (2, 128, 128, 4, 4, 128, jnp.float16, dict(is_causal=True)),
    (1, 96, 160, 4, 2, 64, jnp.bfloat16, dict(is_causal=True, local_window_size=(32, 0))),
    (3, 64, 128, 4, 2, 64, jnp.bfloat16,
     dict(query_seq_lengths=np.array([64, 10, 0]), key_value_seq_lengths=np.array([128, 0, 5]))),
    (3, 64, 64, 4, 2, 64, jnp.bfloat16,
     dict(is_causal=True, key_value_seq_lengths=np.array([64, 33, 0]))),
    (4, 1, 1024, 8, 2, 128, jnp.bfloat16,
     dict(is_causal=True, causal_alignment="bottom_right",
          key_value_seq_lengths=np.array([1024, 700, 1, 0]))),
]


@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU with cuDNN")
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"case{n}" for n in range(len(GPU_CASES))])
def test_default_chain_runs_cudnn_and_matches_the_oracle(case):
    batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, kw = case
    q, k, v, do, _ = make_inputs(kv_len + q_len, batch, q_len, kv_len, heads, kv_heads,
                                 head_dim, dtype)
    kw = {n: (jnp.asarray(x, jnp.int32) if isinstance(x, np.ndarray) else x)
          for n, x in kw.items()}

    def f(q, k, v):
        return flash_attention(q, k, v, **kw)

    hlo = jax.jit(f).lower(q, k, v).as_text()
    assert "cudnn" in hlo.lower() and "fmha" in hlo.lower(), "the default chain ran no cuDNN"
    o, vjp = jax.vjp(jax.jit(f), q, k, v)
    got = dict(zip(("o", "dq", "dk", "dv"), (o, *vjp(do))))
    tolerance.assert_all_match_oracle(got, q, k, v, do, names=("o", "dq", "dk", "dv"), **kw)


def test_rank_three_query_without_an_lse():
    """A rank-3 query loses the batch axis added for it also where the implementation gives no
    LSE (cuDNN): Equinox's attention calls with [T, H, D]."""
    out = jnp.arange(40.0).reshape(1, 5, 2, 4)
    got = validation.restore_rank(np.zeros((5, 2, 4)), out, None, False)
    np.testing.assert_array_equal(got, out[0])


@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU with cuDNN")
def test_default_chain_takes_a_rank_three_query():
    q, k, v, do, _ = make_inputs(3, 1, 64, 64, 4, 2, 64, jnp.bfloat16)
    o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v)[None], q[0], k[0], v[0])
    got = dict(zip(("o", "dq", "dk", "dv"), (o, *(x[None] for x in vjp(do)))))
    tolerance.assert_all_match_oracle(got, q, k, v, do, names=("o", "dq", "dk", "dv"))
