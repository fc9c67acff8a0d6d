"""Runs the attention kernels of shaders/*.metal on the MSL-on-CPU emulator, the way the host does.

`AttentionParams` is packed with a NumPy structured dtype that mirrors shaders/attention_params.h
field for field; grids follow shaders/tile_shapes.h (read through the extension's `tile_shape`):
(ceil(rows / rows_per_group), heads, batch) threadgroups, rows/heads = q_len/num_heads for fwd
and bwd_dq and kv_len/num_kv_heads for bwd_dkdv (bwd_dk, bwd_dv), and zero-size grids are not
dispatched. Inputs and outputs are NumPy arrays of float32, float16 or ml_dtypes.bfloat16
(passed to the kernels as uint16 bits). Outputs start filled with NaN so anything a kernel fails
to write shows up.
"""

import glob
import math
import os
import shutil
import sys

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal._ext import (  # noqa: E402
    bwd_stages, emulator, kernel_families, kernel_variants, tile_shape)
from jax_flash_metal.core import dropout as dropout_module  # noqa: E402
from jax_flash_metal.profile import NO_COUNTING_MESSAGE  # noqa: E402

# The kernel profile's counting variants are built only with JFM_EMULATOR_COUNTING=ON (.ci/run
# sets it); tests of exact counts skip without them.
needs_counting = pytest.mark.skipif(not emulator.has_counting_variant(),
                                    reason=NO_COUNTING_MESSAGE)

UNBOUNDED = -1  # JFM_UNBOUNDED
EMPTY_ROW_MAX = np.float32(8.50705917e37)  # JFM_EMPTY_ROW_MAX
# The head dims of the kernel families of shaders/kernel_families.h with Dv = Dk, as the
# extension lists them.
HEAD_DIMS = tuple(dk for suffix, dk, dv in kernel_families() if suffix == "f32" and dk == dv)
DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
          "bf16": np.dtype(ml_dtypes.bfloat16)}

# JFM_BUFFER_* of attention_params.h.
Q, K, V, O, LSE, DO, DELTA, G_LSE, Q_LENGTHS, KV_LENGTHS, DQ, DK, DV, PARAMS, ROW_MAX = range(15)
Q_SEGMENT_IDS, KV_SEGMENT_IDS, BIAS, MASK, SINKS, DBIAS, LOG_SUM, DROPOUT = range(16, 24)
ALIBI_SLOPES, DALIBI = 26, 24
PAGE_TABLE = 25

PARAMS_DTYPE = np.dtype([
    ("batch", "<u4"), ("q_len", "<u4"), ("kv_len", "<u4"), ("num_heads", "<u4"),
    ("num_kv_heads", "<u4"), ("head_dim", "<u4"), ("scale", "<f4"), ("padding", "<u4"),
    ("window_left", "<i4"), ("window_right", "<i4"), ("causal", "<u4"), ("bottom_right", "<u4"),
    ("has_q_lengths", "<u4"), ("has_kv_lengths", "<u4"),
    ("block_offset", "<u4"), ("head_offset", "<u4"), ("batch_offset", "<u4"),
    ("splits", "<u4"),
    # The optional features of the FFI contract: left 0 here (their tests go through the FFI
    # handler, tests/fused/test_kernels_features_fwd.py).
    ("has_segment_ids", "<u4"), ("has_bias", "<u4"), ("has_mask", "<u4"), ("has_sinks", "<u4"),
    ("bias_grad", "<u4"), ("soft_cap", "<f4"), ("has_alibi", "<u4"), ("alibi_grad", "<u4"),
    ("dropout_threshold", "<u4"), ("dropout_scale", "<f4"), ("page_size", "<u4"),
    ("num_pages", "<u4"),
    ("bias_strides", "<i8", (4,)), ("mask_strides", "<i8", (4,)),
])
assert PARAMS_DTYPE.itemsize == 184  # static_assert in attention_params.h
assert PARAMS_DTYPE.fields["bias_strides"][1] == 120

# Bound where a lengths buffer is absent and at the optional feature buffers (flags 0), as the
# host does; the kernels must not read it (if they did, these values would empty every row and
# the comparison with the oracle would fail).
_PLACEHOLDER = np.full(4, -7, dtype=np.int32)

# Whether the sanitizer's reports name shader lines: the build kept the counting variant's line
# tables next to the module (Linux, with objcopy) and addr2line can read them; elsewhere reports
# give code offsets.
_EXT_FOLDER = os.path.dirname(sys.modules["jax_flash_metal._ext"].__file__)
SANITIZER_LINES = (bool(glob.glob(os.path.join(_EXT_FOLDER, "_ext*.so.debug")))
                   and shutil.which("addr2line") is not None)


def type_name(dtype):
    """'f32' | 'f16' | 'bf16' for a NumPy dtype."""
    for name, dt in DTYPES.items():
        if np.dtype(dtype) == dt:
            return name
    raise TypeError(f"unsupported dtype {dtype}")


def kernel_name(kind, dtype, head_dim, variant=0):
    """Host name, e.g. kernel_name('fwd', np.float16, 64) == 'flash_attention_fwd_f16_d64'; a
    tile variant's (one the extension lists for the family, kernel_variants) has its stage."""
    if variant:
        [stage] = [v["stage"] for v in kernel_variants(kind, type_name(dtype), head_dim)
                   if v["variant"] == variant]
        kind = stage
    return f"flash_attention_{kind}_{type_name(dtype)}_d{head_dim}"


def window_bounds(local_window_size):
    """(left, right) with UNBOUNDED for None, from None, an int or a pair (entries may be None)."""
    if local_window_size is None:
        return UNBOUNDED, UNBOUNDED
    if isinstance(local_window_size, (int, np.integer)):
        return int(local_window_size), int(local_window_size)
    left, right = local_window_size
    return (UNBOUNDED if left is None else int(left)), (UNBOUNDED if right is None else int(right))


def pack_params(q_shape, kv_shape, *, scale=None, is_causal=False, local_window_size=None,
                query_seq_lengths=None, key_value_seq_lengths=None, causal_alignment="top_left",
                bias_grad=False, dropout_rate=0.0, dropout=None):
    """AttentionParams as uint8 bytes [184] for q [B, Tq, H, D] and k/v [B, Tkv, HKV, D]
    (``dropout``, the operand, is bound by ``forward`` / ``backward``)."""
    batch, q_len, heads, head_dim = q_shape
    _, kv_len, kv_heads, _ = kv_shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    left, right = window_bounds(local_window_size)
    p = np.zeros((), dtype=PARAMS_DTYPE)
    p["batch"], p["q_len"], p["kv_len"] = batch, q_len, kv_len
    p["num_heads"], p["num_kv_heads"], p["head_dim"] = heads, kv_heads, head_dim
    p["scale"] = np.float32(scale)
    p["window_left"], p["window_right"] = left, right
    p["causal"] = int(bool(is_causal))
    p["bottom_right"] = int(causal_alignment == "bottom_right")
    p["has_q_lengths"] = int(query_seq_lengths is not None)
    p["has_kv_lengths"] = int(key_value_seq_lengths is not None)
    p["bias_grad"] = int(bias_grad)
    if dropout_rate > 0:  # the host's threshold and scale (ffi/attention_ffi.cc)
        p["dropout_threshold"] = dropout_module.threshold(dropout_rate)
        p["dropout_scale"] = np.float32(dropout_module.keep_scale(dropout_rate))
    return np.frombuffer(p.tobytes(), dtype=np.uint8).copy()


def _device(x):
    """A C-contiguous array the kernel can bind: bf16 as uint16 bits; zero-size -> 16-byte dummy."""
    x = np.ascontiguousarray(x)
    if x.size == 0:
        return np.zeros(16, dtype=np.uint8)
    return x.view(np.uint16) if x.dtype == DTYPES["bf16"] else x


def _output(shape, dtype):
    return np.full(shape, np.nan, dtype=dtype)


def _lengths(lengths):
    if lengths is None:
        return _PLACEHOLDER
    return np.ascontiguousarray(np.asarray(lengths, dtype=np.int32))


def _dispatch(kind, dtype, head_dim, buffers, rows, heads, batch, schedule, seed, variant=0):
    shape = tile_shape(kind, type_name(dtype), head_dim, variant)
    groups = (math.ceil(rows / shape["rows"]), heads, batch)
    if 0 in groups:
        return  # the host never dispatches an empty grid
    bound = {index: _device(array) for index, array in buffers.items()}
    for index in (Q_SEGMENT_IDS, KV_SEGMENT_IDS, BIAS, MASK, SINKS, DROPOUT, PAGE_TABLE,
                  ALIBI_SLOPES):
        bound.setdefault(index, _PLACEHOLDER)
    # Outputs are created C-contiguous, so `bound` holds them or uint16 views of them.
    emulator.run(kernel_name(kind, dtype, head_dim, variant), bound, groups,
                 (shape["threads"], 1, 1), schedule=schedule, seed=seed)


def _dropout(mask):
    """The dropout operand's binding (uint32 [B, H, 8], ``mask["dropout"]``), if any."""
    x = mask.get("dropout")
    return {} if x is None else {DROPOUT: np.ascontiguousarray(x, dtype=np.uint32)}


def stages_of(head_dim):
    """The tiled stages of a family whose tiles are chosen by `head_dim` (tile_head_dim)."""
    return ("fwd", "decode_partial", *bwd_stages(head_dim))


def variants_of(dtype, head_dim):
    """The tile variants any tiled stage of the family lists (``_ext.kernel_variants``), sorted;
    dtype 'f32' | 'f16' | 'bf16'."""
    return sorted({v["variant"] for s in stages_of(head_dim)
                   for v in kernel_variants(s, dtype, head_dim)})


def blocks(stage, dtype, head_dim):
    """(rows per threadgroup, block of the traversed dimension) of a stage (tile_shapes.h);
    dtype 'f32' | 'f16' | 'bf16'."""
    shape = tile_shape(stage, dtype, head_dim)
    return shape["rows"], shape["cols"]


def forward(q, k, v, *, schedule="forward", seed=0, variant=0, **mask):
    """Runs flash_attention_fwd (in tile variant `variant`). Returns (o [B, Tq, H, D] in q's
    dtype, lse [B, H, Tq] float32, residuals: the pair (row_max, log_sum) of float32 [B, H, Tq]
    the backward takes).

    mask: scale, is_causal, local_window_size, query_seq_lengths, key_value_seq_lengths,
    causal_alignment (the oracle's keywords); dropout_rate with dropout (the operand).
    """
    batch, q_len, heads, head_dim = q.shape
    params = pack_params(q.shape, k.shape, **mask)
    o = _output(q.shape, q.dtype)
    lse = _output((batch, heads, q_len), np.float32)
    row_max, log_sum = (_output((batch, heads, q_len), np.float32) for _ in range(2))
    _dispatch("fwd", q.dtype, head_dim,
              {Q: q, K: k, V: v, Q_LENGTHS: _lengths(mask.get("query_seq_lengths")),
               KV_LENGTHS: _lengths(mask.get("key_value_seq_lengths")), O: o, LSE: lse,
               ROW_MAX: row_max, LOG_SUM: log_sum, PARAMS: params, **_dropout(mask)},
              q_len, heads, batch, schedule, seed, variant)
    return o, lse, (row_max, log_sum)


def backward(q, k, v, o, residuals, do, g_lse=None, *, schedule="forward", seed=0,
             bias_grad=False, variant=0, **mask):
    """Runs the backward stages as the host does (bwd_stages, in tile variant `variant`): bwd_dq,
    which also writes delta
    (and with bias_grad dbias), then bwd_dkdv (or bwd_dk and bwd_dv). Returns (dq, dk, dv,
    delta), and dbias float32 [B, H, Tq, Tkv] after them with bias_grad.

    o, residuals: the forward's outputs; do like o; g_lse float32 [B, H, Tq] or None (zeros).
    dq has q's shape and dtype, dk/dv k's; delta is float32 [B, H, Tq].
    """
    batch, q_len, heads, head_dim = q.shape
    _, kv_len, kv_heads, _ = k.shape
    params = pack_params(q.shape, k.shape, bias_grad=bias_grad, **mask)
    # Without bias_grad the host binds a placeholder the kernel never touches.
    dbias = _output((batch, heads, q_len, kv_len) if bias_grad else (4,), np.float32)
    if g_lse is None:
        g_lse = np.zeros((batch, heads, q_len), np.float32)
    delta = _output((batch, heads, q_len), np.float32)
    dq = _output(q.shape, q.dtype)
    dk = _output(k.shape, k.dtype)
    dv = _output(v.shape, v.dtype)
    inputs = {Q: q, K: k, V: v, DO: do, ROW_MAX: residuals[0], LOG_SUM: residuals[1],
              PARAMS: params,
              Q_LENGTHS: _lengths(mask.get("query_seq_lengths")),
              KV_LENGTHS: _lengths(mask.get("key_value_seq_lengths")), **_dropout(mask)}
    dq_stage, *dkdv_stages = bwd_stages(head_dim)
    _dispatch(dq_stage, q.dtype, head_dim,
              {**inputs, O: o, G_LSE: np.ascontiguousarray(g_lse, dtype=np.float32),
               DELTA: delta, DQ: dq, DBIAS: dbias, DALIBI: _output((4,), np.float32)},
              q_len, heads, batch, schedule, seed, variant)
    for stage in dkdv_stages:
        _dispatch(stage, q.dtype, head_dim, {**inputs, DELTA: delta, DK: dk, DV: dv},
                  kv_len, kv_heads, batch, schedule, seed, variant)
    return (dq, dk, dv, delta) + ((dbias,) if bias_grad else ())


# ---- inputs and oracle comparison shared by tests/fused/test_kernels*.py ----

def _valid_lengths(lengths, allocated, batch):
    if lengths is None:
        return [allocated] * batch
    return [int(np.clip(n, 0, allocated)) for n in lengths]


def random_inputs(dtype, batch, q_len, kv_len, heads, kv_heads, head_dim, *, seed=0,
                  query_seq_lengths=None, key_value_seq_lengths=None, pad=np.nan, scale_x=1.0):
    """q, k, v, do, g_lse: N(0,1) * scale_x float32 draws cast to `dtype`; g_lse float32.

    Rows past the per-batch lengths (the padding the kernels must never read) are set to `pad`.
    """
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)

    def draw(shape):
        return (scale_x * rng.standard_normal(shape)).astype(np.float32)

    q = draw((batch, q_len, heads, head_dim))
    k = draw((batch, kv_len, kv_heads, head_dim))
    v = draw((batch, kv_len, kv_heads, head_dim))
    do = draw((batch, q_len, heads, head_dim))
    g_lse = rng.standard_normal((batch, heads, q_len)).astype(np.float32)
    for b, n in enumerate(_valid_lengths(query_seq_lengths, q_len, batch)):
        q[b, n:], do[b, n:], g_lse[b, :, n:] = pad, pad, pad
    for b, n in enumerate(_valid_lengths(key_value_seq_lengths, kv_len, batch)):
        k[b, n:], v[b, n:] = pad, pad
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), do.astype(dtype), g_lse


def _yardstick_input(x, lengths, axis_len):
    """Copy of x [B, T, ...] with rows past the lengths and every non-finite value set to 0.

    The jnp yardstick only measures a dtype's typical rounding error; non-finite values would
    spread NaN over all of it (0 * NaN in its masked products) and leave no yardstick.
    """
    x = np.where(np.isfinite(np.asarray(x, np.float32)), x, np.zeros((), x.dtype)).astype(x.dtype)
    for b, n in enumerate(_valid_lengths(lengths, axis_len, x.shape[0])):
        x[b, n:] = 0
    return x


def yardstick_inputs(q, k, v, do, g_lse, mask):
    """(q, k, v, do, g_lse) for tolerance.baseline: padding and non-finite values zeroed
    (_yardstick_input), NaN cotangents 0."""
    qs, ks = mask.get("query_seq_lengths"), mask.get("key_value_seq_lengths")
    q_len, kv_len = q.shape[1], k.shape[1]
    g = None if g_lse is None else np.nan_to_num(g_lse, nan=0.0)
    return (_yardstick_input(q, qs, q_len), _yardstick_input(k, ks, kv_len),
            _yardstick_input(v, ks, kv_len), _yardstick_input(do, qs, q_len), g)


def check_against_oracle(q, k, v, do, g_lse=None, *, schedule="forward", seed=0, variant=0,
                         **mask):
    """Runs forward and backward kernels (in tile variant `variant`) and asserts O, LSE, dQ, dK,
    dV against the oracle.

    Tolerances are docs/testing.md#tolerances (tests/helpers/tolerance.py); for f16/bf16 the
    yardstick is plain same-dtype jnp attention on the same inputs with padding and non-finite
    values zeroed. Zero-size problems are checked for their exact values instead. Returns the kernel
    outputs as a dict (o, lse, row_max, log_sum, dq, dk, dv, delta).
    """
    import tolerance

    o, lse, residuals = forward(q, k, v, schedule=schedule, seed=seed, variant=variant, **mask)
    dq, dk, dv, delta = backward(q, k, v, o, residuals, do, g_lse, schedule=schedule, seed=seed,
                                 variant=variant, **mask)
    got = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
    return _assert_against_oracle(got, q, k, v, do, g_lse, tolerance.OUTPUTS, mask,
                                  row_max=residuals[0], log_sum=residuals[1], delta=delta)


def check_residuals(lse, row_max, log_sum):
    """The forward's residuals against their definition: on rows with a visible key (or a sink)
    LSE = m + log(l) in float32, bit for bit, with log(l) >= 0 (the max contributes 1 to l);
    m = JFM_EMPTY_ROW_MAX and log(l) = 0 on the others (LSE -inf)."""
    lse, row_max, log_sum = (np.asarray(x, np.float32) for x in (lse, row_max, log_sum))
    empty = np.isneginf(lse)
    assert (row_max[empty] == EMPTY_ROW_MAX).all(), "m of rows with no visible key"
    assert (log_sum[empty] == 0).all(), "log(l) of rows with no visible key"
    np.testing.assert_array_equal(row_max[~empty] + log_sum[~empty], lse[~empty])
    assert (log_sum[~empty] >= 0).all()


def check_forward_against_oracle(q, k, v, *, schedule="forward", seed=0, **mask):
    """Runs only the forward kernel and asserts O and LSE against the oracle (tolerances as in
    check_against_oracle) and the residuals against their definition (check_residuals).
    Returns dict(o, lse, row_max, log_sum)."""
    o, lse, (row_max, log_sum) = forward(q, k, v, schedule=schedule, seed=seed, **mask)
    check_residuals(lse, row_max, log_sum)
    do = np.zeros(q.shape, q.dtype)
    return _assert_against_oracle(dict(o=o, lse=lse), q, k, v, do, None, ("o", "lse"), mask,
                                  row_max=row_max, log_sum=log_sum)


def _assert_against_oracle(got, q, k, v, do, g_lse, names, mask, **extra):
    import tolerance

    if q.size == 0 or k.size == 0:
        # No (query, key) pair exists, so docs/design.md#empty-rows-and-non-finite-inputs fixes
        # every value exactly (and the oracle's max-reduction needs a key axis): O = 0, LSE = -inf,
        # zero gradients.
        for name, x in got.items():
            expected = -np.inf if name == "lse" else 0.0
            assert (np.asarray(x, np.float64) == expected).all(), name
        got.update(extra)
        return got
    base_inputs = None if q.dtype == np.float32 else yardstick_inputs(q, k, v, do, g_lse, mask)
    tolerance.assert_all_match_oracle(got, q, k, v, do, g_lse, baseline_inputs=base_inputs,
                                      names=names, **mask)
    got.update(extra)
    return got
