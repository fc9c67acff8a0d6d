"""The split-KV decode path (docs/kernels.md#decode-split-kv; shaders/flash_attention_decode.metal)
through the emulated device's FFI handler: when it is chosen and which pass 1 (the MMA tile or
the vector kernel) runs, its results against the float64 oracle (forward and, through the
residuals it writes, the regular backward) and against the tiled forward kernel for the same
call, non-finite values, bit-identical results under every emulator schedule, and the
structural properties of its profile (device bytes read against the visible K/V, ALU operations
against the useful multiply-adds).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_harness as kh
from api_helpers import check_against_oracle, make_inputs

ext = pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal import profile  # noqa: E402
from jax_flash_metal.fused import ffi_lowering  # noqa: E402,F401 (registers the targets)
from jax_flash_metal.tools import profile_model  # noqa: E402

TYPE = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(jnp.bfloat16): "bf16"}
FWD = "jax_flash_metal_attention_fwd_emulator"


def _decode_splits(q, k):
    """(splits, workspace elements) of the forward call on q, k (the handler's rule)."""
    return ext.decode_splits(TYPE[np.dtype(q.dtype)], q.shape[0], q.shape[1], k.shape[1],
                             q.shape[2], k.shape[2], q.shape[3])


def _pass1(heads, kv_heads, q_len, head_dim, dtype="f16"):
    """The decode's pass-1 kernel stage of a call (kv_len 8192)."""
    plan = ext.dispatch_plan("fwd", dtype, 1, q_len, 8192, heads, kv_heads, head_dim)
    kernels = list(dict.fromkeys(d["kernel"] for s in plan for d in s))
    assert kernels[1:] == [f"flash_attention_decode_combine_{dtype}_d{head_dim}"]
    return kernels[0].removeprefix("flash_attention_").removesuffix(f"_{dtype}_d{head_dim}")


def test_decode_is_chosen_for_short_queries_whose_rows_fit_a_tile():
    assert ext.tile_shape("decode_partial", "f16", 128)["rows"] == 32
    assert ext.tile_shape("decode_vector", "f16", 128)["rows"] == 8
    assert ext.tile_shape("decode_vector", "f32", 256)["rows"] == 4
    assert ext.decode_splits("f16", 1, 16, 8192, 16, 8, 128)[0] > 0  # G * q_len = 32
    assert ext.decode_splits("f16", 1, 17, 8192, 8, 8, 128)[0] == 0  # q_len > 16
    assert ext.decode_splits("f16", 1, 9, 8192, 32, 8, 128)[0] == 0  # G * q_len = 36 > 32
    assert ext.decode_splits("f32", 1, 5, 100, 16, 4, 256)[0] == 0  # 20 rows > the 16 of f32 D256
    # Pass 1: the vector kernel up to 8 rows (4 above D 128), else the MMA tile.
    assert _pass1(32, 8, 1, 128) == "decode_vector"  # G * q_len = 4
    assert _pass1(8, 8, 8, 128) == "decode_vector"   # 8 rows
    assert _pass1(8, 8, 9, 128) == "decode_partial"  # 9 rows
    assert _pass1(4, 1, 1, 256) == "decode_vector"   # 4 rows at D 256
    assert _pass1(8, 1, 1, 256) == "decode_partial"  # 8 rows at D 256
    # Splits (the emulator's 32 cores): the MMA pass 1 aims at 4 threadgroups per core with at
    # least 256 keys each; the vector pass 1's single simdgroups at 16 with at least 128 keys.
    assert ext.gpu_cores("emulator") == 32
    assert ext.decode_splits("f16", 1, 3, 8192, 32, 8, 128) == (16, 16 * 1 * 32 * 3 * 130)
    assert ext.decode_splits("f16", 8, 3, 8192, 32, 8, 128)[0] == 2
    assert ext.decode_splits("f16", 1, 3, 700, 32, 8, 128)[0] == 3
    assert ext.decode_splits("f16", 1, 1, 8192, 32, 8, 128) == (64, 64 * 1 * 32 * 1 * 130)
    assert ext.decode_splits("f16", 8, 1, 8192, 32, 8, 128)[0] == 8
    assert ext.decode_splits("f16", 1, 1, 700, 32, 8, 128)[0] == 6
    assert ext.decode_splits("f16", 1, 1, 1, 32, 8, 128)[0] == 1
    assert ext.gpu_cores_by_name("Apple M2 Max") == 38
    assert ext.gpu_cores_by_name("Some future GPU") == 10


# (batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, mask): q_len 1-16, kv_len 1 to a few
# thousand around the split minimums and the key blocks, GQA groups 1-8, lengths (0 included),
# windows, both alignments, every pass-1 tile layout (Q in registers or not, one or two K/V
# buffers, 16-row f32 D256 tiles) and the vector pass 1 (G * q_len <= 8, 4 above D 128: cases
# 0, 1, 4, 9-13; head dims below 32 and not multiples of 32, a lane with no element).
CASES = [
    (1, 1, 1, 1, 1, 16, jnp.float32, {}),
    (1, 1, 257, 8, 1, 16, jnp.float32, {}),
    (2, 4, 511, 8, 2, 32, jnp.float16,
     dict(is_causal=True, causal_alignment="bottom_right",
          key_value_seq_lengths=np.array([0, 300], np.int32))),
    (3, 16, 777, 2, 2, 16, jnp.float32,
     dict(is_causal=True, causal_alignment="bottom_right",
          key_value_seq_lengths=np.array([777, 5, 400], np.int32),
          query_seq_lengths=np.array([16, 3, 0], np.int32))),
    (1, 2, 3001, 4, 4, 16, jnp.bfloat16,
     dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(64, 0))),
    (2, 8, 300, 8, 2, 64, jnp.float32, dict(is_causal=True, local_window_size=(None, 40))),
    (1, 5, 1000, 6, 3, 8, jnp.float32, dict(local_window_size=(10, 10))),
    (1, 16, 2000, 2, 1, 128, jnp.float16, dict(is_causal=True, causal_alignment="bottom_right")),
    (1, 4, 600, 4, 1, 256, jnp.float32,
     dict(key_value_seq_lengths=np.array([513], np.int32), scale=0.3)),
    (4, 1, 1500, 4, 2, 96, jnp.bfloat16,
     dict(is_causal=True, causal_alignment="bottom_right",
          key_value_seq_lengths=np.array([1500, 1, 0, 256], np.int32))),
    (2, 1, 1000, 8, 1, 128, jnp.float16, dict(key_value_seq_lengths=np.array([1000, 333]))),
    (1, 3, 700, 4, 2, 48, jnp.float32,
     dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(100, 0))),
    (2, 2, 300, 2, 1, 256, jnp.float32,
     dict(is_causal=True, query_seq_lengths=np.array([1, 2], np.int32), scale=0.2)),
    (1, 8, 450, 1, 1, 8, jnp.bfloat16, dict(local_window_size=(30, 5))),
]
VECTOR_CASES = (0, 1, 4, 9, 10, 11, 12, 13)


def _mask(mask):
    return {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in mask.items()}


@pytest.mark.parametrize("case", CASES, ids=[f"case{n}" for n in range(len(CASES))])
def test_decode_matches_the_oracle_forward_and_backward(case):
    batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, mask = case
    q, k, v, do, g_lse = make_inputs(q_len * 31 + kv_len, batch, q_len, kv_len, heads, kv_heads,
                                     head_dim, dtype)
    assert _decode_splits(q, k)[0] > 0
    pass1 = _pass1(heads, kv_heads, q_len, head_dim, TYPE[np.dtype(dtype)])
    assert (pass1 == "decode_vector") == (CASES.index(case) in VECTOR_CASES)
    check_against_oracle(q, k, v, do, g_lse, implementation="emulator", **_mask(mask))


def _ffi_forward(q, k, v, mask):
    """(o, lse, row_max, log_sum) of the forward target called directly (the last two: the
    backward's residuals)."""
    _, elements = _decode_splits(q, k)
    b, tq, h, _ = q.shape
    left, right = kh.window_bounds(mask.get("local_window_size"))
    lengths = [jnp.asarray(mask[n]) for n in ("query_seq_lengths", "key_value_seq_lengths")
               if n in mask]
    scale = mask.get("scale", 1.0 / np.sqrt(q.shape[3]))
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, tq), jnp.float32),
           jax.ShapeDtypeStruct((b, h, tq), jnp.float32),
           jax.ShapeDtypeStruct((b, h, tq), jnp.float32),
           jax.ShapeDtypeStruct((elements,), jnp.float32))
    attrs = ffi_lowering._attributes(
        scale=scale, is_causal=mask.get("is_causal", False), window_left=left,
        window_right=right, bottom_right=mask.get("causal_alignment") == "bottom_right",
        has_q_lengths="query_seq_lengths" in mask, has_kv_lengths="key_value_seq_lengths" in mask,
        has_segment_ids=False, has_bias=False, has_mask=False, has_sinks=False,
        has_alibi=False, logits_soft_cap=None, has_page_table=False, dropout_rate=0.0,
        kernel_variant=0)
    return [np.asarray(x) for x in jax.ffi.ffi_call(FWD, out)(q, k, v, *lengths, **attrs)[:4]]


@pytest.mark.parametrize("case", [CASES[n] for n in (2, 3, 4, 5, 10)],
                         ids=[f"case{n}" for n in (2, 3, 4, 5, 10)])
def test_decode_agrees_with_the_tiled_forward(case):
    """O, LSE and the residuals of the decode path and of the tiled forward kernel (run
    directly) for the same call: within tolerance (not bits; the splits sum in another order);
    empty rows alike."""
    batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, mask = case
    q, k, v, _, _ = make_inputs(7, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)
    o, lse, *residuals = _ffi_forward(q, k, v, mask)
    fo, flse, tiled_residuals = kh.forward(*(np.array(x) for x in (q, k, v)), **mask)
    kh.check_residuals(lse, *residuals)
    empty = np.isneginf(flse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], flse[~empty], rtol=1e-5, atol=1e-5)
    for x, tiled in zip(residuals, tiled_residuals):
        np.testing.assert_array_equal(x[empty], tiled[empty])
        np.testing.assert_allclose(x[~empty], tiled[~empty], rtol=1e-5, atol=1e-5)
    atol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(fo, np.float32), atol=atol)


@pytest.mark.parametrize("case", [3, 10], ids=["partial", "vector"])
def test_decode_is_bit_identical_under_every_schedule(case):
    batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, mask = CASES[case]
    q, k, v, _, _ = make_inputs(3, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)
    before = ext.emulator_schedule()
    runs = []
    try:
        for name, seed in (("forward", 0), ("reverse", 0), ("random", 5)):
            ext.set_emulator_schedule(name, seed)
            runs.append(_ffi_forward(q, k, v, mask))
    finally:
        ext.set_emulator_schedule(*before)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


def _problem(dtype, head_dim, **fields):
    """A profile problem: the profile's defaults, causal bottom-right, with ``fields`` set."""
    args = profile.make_parser().parse_args(["--causal", "--causal-alignment", "bottom_right"])
    vars(args).update(fields)
    return profile_model.Problem(args, dtype, head_dim, True)


@kh.needs_counting
@pytest.mark.parametrize("q_len, pass1, bound", [(1, "decode_vector", 1.15),
                                                  (3, "decode_partial", 1.2)])
@pytest.mark.parametrize("kv_lengths", [None, [2048, 100, 0, 1500]])
def test_decode_profile_reads_each_visible_key_and_value_about_once(kv_lengths, q_len, pass1,
                                                                     bound):
    """Device bytes read by both passes <= bound x the visible K and V bytes (each K/V element
    of a KV head read once, Q and the workspace small next to them: 1.2 for 12 rows and short
    caches); pass 1 has splits x kv heads x batch threadgroups."""
    batch = 1 if kv_lengths is None else len(kv_lengths)
    problem = _problem("float16", 32, batch=batch, q_len=q_len, kv_len=2048, heads=8, kv_heads=2,
                       kv_lengths=kv_lengths)
    runs = profile_model.run_problem(problem, ["forward"])
    kernels = [r["kernel"] for _, r in runs]
    assert kernels == [f"flash_attention_{pass1}_f16_d32",
                       "flash_attention_decode_combine_f16_d32"]
    splits, _ = ext.decode_splits("f16", batch, q_len, 2048, 8, 2, 32)
    assert runs[0][1]["threadgroups"] == splits * 2 * batch
    visible_keys = sum(kv_lengths or [2048])
    kv_bytes = 2 * visible_keys * 2 * 32 * 2  # K and V, kv heads, head dim, 2 bytes
    read = sum(r["device_bytes_read"] for _, r in runs)
    assert runs[0][1]["buffers"][1]["read"] == kv_bytes // 2  # K: every visible element once
    assert read <= bound * kv_bytes, (read, kv_bytes)
    # Useful FLOPs: 4 D per visible (query, key) pair and query head, all credited to pass 1.
    pairs = int(problem.visible_pairs().sum())
    assert profile_model.useful_flops(problem, runs) == [4 * 32 * pairs * 8, 0]


def test_vector_decode_poisons_exactly_the_rows_that_see_a_non_finite_value():
    """A non-finite V element at a visible key makes that O element NaN in every row of its KV
    head's group; hidden past a length it changes nothing; a non-finite K element makes the
    rows that see it NaN (docs/design.md#empty-rows-and-non-finite-inputs)."""
    q, k, v, _, _ = make_inputs(5, 2, 1, 400, 4, 2, 32, jnp.float32)
    v = v.at[:, 300, 0, 3].set(jnp.inf)
    k = k.at[:, 200, 1, 0].set(jnp.nan)
    lengths = np.array([250, 400], np.int32)
    assert _pass1(4, 2, 1, 32, "f32") == "decode_vector"
    o, lse, *_ = _ffi_forward(q, k, v, dict(key_value_seq_lengths=lengths))
    assert np.isfinite(o[0, :, :2]).all()       # batch 0: V's Inf at 300 is past its length
    assert np.isnan(o[:, 0, 2:]).all()          # K's NaN at 200 is seen by kv head 1's rows
    assert np.isnan(o[1, 0, :2, 3]).all()       # batch 1: V's Inf at 300 is seen
    assert np.isfinite(np.delete(o[1, 0, :2], 3, axis=-1)).all()


@kh.needs_counting
def test_vector_decode_profile_reads_keys_once_and_does_no_padded_work():
    """Grouped-query decode of one token (G * q_len = 1, f16, D 128, kv 8192, the issue's shape):
    device bytes read <= 1.05x the visible K/V bytes, and ALU operations (fma and math calls;
    no MMA) <= 3x the useful multiply-adds (2 D per visible pair)."""
    problem = _problem("float16", 128, batch=1, q_len=1, kv_len=8192, heads=2, kv_heads=2,
                       causal=False)
    records = profile_model.profile_records(problem, ["forward"], ["M1"])
    assert [r["kernel"] for r in records] == ["flash_attention_decode_vector_f16_d128",
                                              "flash_attention_decode_combine_f16_d128"]
    assert records[0]["mma_ops"] == 0 and records[0]["threadgroup_memory_bytes"] == 0
    kv_bytes = 2 * 8192 * 2 * 128 * 2  # K and V, kv heads, head dim, 2 bytes
    read = sum(r["device_bytes_read"] for r in records)
    assert read <= 1.05 * kv_bytes, (read, kv_bytes)
    useful_multiply_adds = sum(r["useful_flops"] for r in records) // 2
    assert useful_multiply_adds == 2 * 128 * 8192 * 2
    alu = sum(r["alu_ops"] for r in records)
    assert alu <= 3 * useful_multiply_adds, (alu, useful_multiply_adds)
    assert records[0]["fma_ops"] >= useful_multiply_adds  # every useful multiply-add is an fma
