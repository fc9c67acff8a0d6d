"""The emulator's FFI targets called directly (no primitive, no Python-side validation), and the
extension's submission-budget hook, for the tests of the FFI handlers, the dispatch plan and the
kernels' features.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ext = pytest.importorskip("jax_flash_metal._ext")

FWD = "jax_flash_metal_attention_fwd_emulator"
BWD = "jax_flash_metal_attention_bwd_emulator"


def attributes(**overrides):
    """The FFI attributes of a call with their exact types: a non-causal, unbounded call with
    scale 0.25 and no optional operand, changed by ``overrides``."""
    attrs = dict(scale=np.float32(0.25), is_causal=False, window_left=np.int32(-1),
                 window_right=np.int32(-1), bottom_right=False, has_q_lengths=False,
                 has_kv_lengths=False, has_segment_ids=False, has_bias=False, has_mask=False,
                 has_sinks=False, logits_soft_cap=np.float32(0.0), has_alibi=False,
                 has_page_table=False, dropout_rate=np.float64(0.0),
                 kernel_variant=np.int32(0), bias_grad=False, alibi_grad=False)
    attrs.update(overrides)
    return attrs


def forward_workspace(q, k):
    """The forward's workspace result as the lowering sizes it (_ext.decode_splits)."""
    if q.ndim != 4 or k.ndim != 4:
        return jax.ShapeDtypeStruct((0,), jnp.float32)  # the handler rejects the ranks first
    dtype = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}.get(q.dtype, "bf16")
    _, elements = ext.decode_splits(dtype, q.shape[0], q.shape[1], k.shape[1], q.shape[2],
                                    k.shape[2], q.shape[3])
    return jax.ShapeDtypeStruct((elements,), jnp.float32)


def fwd_call(q, k, v, *lengths, lse_shape=None, residual_shape=None, workspace=None, **attrs):
    """The forward target called directly (no primitive, no Python-side validation):
    (o, lse, residuals), residuals the pair (row_max, log_sum)."""
    b, tq, h = q.shape[:3]
    residual = jax.ShapeDtypeStruct(residual_shape or (b, h, tq), jnp.float32)
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype),
           jax.ShapeDtypeStruct(lse_shape or (b, h, tq), jnp.float32), residual, residual,
           forward_workspace(q, k) if workspace is None else workspace)
    o, lse, row_max, log_sum, _ = jax.block_until_ready(
        jax.ffi.ffi_call(FWD, out)(q, k, v, *lengths, **attributes(**attrs)))
    return o, lse, (row_max, log_sum)


def bwd_call(q, k, v, o, residuals, do, g_lse, *optional, bias_grad=False, alibi_grad=False,
             **attrs):
    """The backward target called directly: (dq, dk, dv, dbias, delta), then dalibi with
    alibi_grad; residuals the forward's (row_max, log_sum); dbias is float32 [B, H, Tq, Tkv]
    with bias_grad, else [0]; dalibi float32 [B, H, Tq] (each row's share of the slopes'
    gradient)."""
    b, tq, h, _ = q.shape
    dbias = (b, h, tq, k.shape[1]) if bias_grad else (0,)
    dalibi = (b, h, tq) if alibi_grad else (0,)
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
           jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(dbias, jnp.float32),
           jax.ShapeDtypeStruct(dalibi, jnp.float32), jax.ShapeDtypeStruct((b, h, tq), jnp.float32))
    *grads, dalibi, delta = jax.block_until_ready(jax.ffi.ffi_call(BWD, out)(
        q, k, v, o, *residuals, do, g_lse, *optional,
        **attributes(bias_grad=np.bool_(bias_grad), alibi_grad=np.bool_(alibi_grad), **attrs)))
    return (*grads, delta) + ((dalibi,) if alibi_grad else ())


@contextlib.contextmanager
def submission_budget(seconds):
    """Plan submissions under a budget of ``seconds`` of estimated GPU time (the extension's test
    hook), restoring the previous budget afterwards."""
    previous = ext.testing.set_submission_budget(seconds)
    try:
        yield
    finally:
        ext.testing.set_submission_budget(previous)
