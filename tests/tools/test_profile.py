"""Kernel profile: the emulator's exact counters (tests/emulator/shaders/profile.metal kernels with
counts known by construction, and today's attention kernels against the closed forms of their loop
structure), the CLI ``python -m jax_flash_metal.profile`` (JSON schema, errors) and the roofline
model's figures."""

import json
import math

import numpy as np
import pytest

from api_helpers import needs_test_kernels
from kernel_harness import HEAD_DIMS, needs_counting
from jax_flash_metal import profile
from jax_flash_metal.core import dropout
from jax_flash_metal.tools import roofline
from jax_flash_metal import _ext as ext
from jax_flash_metal._ext import emulator
from jax_flash_metal.tools import profile_model

pytestmark = pytest.mark.host  # the profiled calls run the emulator (conftest.py)

ZERO = dict(threadgroup_bytes_read=0, threadgroup_bytes_written=0, mma_ops=0, simd_ops=0,
            barriers=0, fma_ops=0, math_ops=0, threadgroup_memory_bytes=0)


def counts(kernel, buffers, groups, group_size, **kw):
    """Profiled run; also checks that the counting variant computes what the normal one does."""
    plain = {i: b.copy() for i, b in buffers.items()}
    emulator.run(kernel, plain, groups, group_size, **kw)
    result = emulator.run(kernel, buffers, groups, group_size, profile=True, **kw)
    for i in buffers:
        np.testing.assert_array_equal(buffers[i], plain[i])
    return result


def assert_counts(result, **expected):
    got = {k: result[k] for k in expected}
    assert got == expected


@needs_test_kernels
def test_profile_off_returns_none():
    a = np.ones(8, np.float32)
    assert emulator.run("profile_copy_f32", {0: a, 1: np.zeros_like(a),
                                             2: np.array([8], np.uint32)}, (1, 1, 1),
                        (8, 1, 1)) is None


@needs_test_kernels
@needs_counting
@pytest.mark.parametrize("name,dtype,width", [("profile_copy_f32", np.float32, 1),
                                              ("profile_copy_f16", np.float16, 1),
                                              ("profile_copy_f32x4", np.float32, 4)])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_copy(name, dtype, width, num_workers):
    n, group, groups = 1000, 64, 16  # 1024 threads, the last 24 past n
    src = np.arange(n * width, dtype=dtype)
    dst = np.zeros_like(src)
    r = counts(name, {0: src, 1: dst, 2: np.array([n], np.uint32)}, (groups, 1, 1), (group, 1, 1),
               num_workers=num_workers)
    element = width * np.dtype(dtype).itemsize
    assert_counts(r, threadgroups=groups, threads_per_threadgroup=group,
                  device_bytes_read=n * element, device_bytes_written=n * element, **ZERO)
    # The constant n is read once by every thread; constant bytes are not device bytes.
    assert r["buffers"] == {0: {"read": n * element, "written": 0, "constant": False},
                            1: {"read": 0, "written": n * element, "constant": False},
                            2: {"read": 4 * groups * group, "written": 0, "constant": True}}
    np.testing.assert_array_equal(dst, src)


@needs_test_kernels
@needs_counting
def test_strided_read():
    threads, stride, count = 96, 97, 5
    src = np.arange(threads + stride * count, dtype=np.float32) / 7
    out = np.zeros(threads, np.float32)
    r = counts("profile_strided", {0: src, 1: out, 2: np.array([stride, count], np.uint32)},
               (3, 1, 1), (32, 1, 1))
    assert_counts(r, threadgroups=3, threads_per_threadgroup=32,
                  device_bytes_read=threads * count * 4, device_bytes_written=threads * 4,
                  **{**ZERO, "fma_ops": threads * count, "math_ops": threads * (count + 1)})


@needs_test_kernels
@needs_counting
@pytest.mark.parametrize("schedule", ["forward", "random"])
def test_tiled_gemm(schedule):
    m, n, k = 32, 48, 40
    rng = np.random.default_rng(0)
    a = rng.integers(-4, 5, (m, k)).astype(np.float16)  # small integers: exact products
    b = rng.integers(-4, 5, (k, n)).astype(np.float16)
    c = np.zeros((m, n), np.float32)
    groups = (n // 16) * (m // 16)
    steps = k // 8
    r = counts("profile_gemm", {0: a, 1: b, 2: c, 3: np.array([m, n, k, 0], np.uint32)},
               (n // 16, m // 16, 1), (128, 1, 1), schedule=schedule, seed=3)
    assert_counts(
        r, threadgroups=groups, threads_per_threadgroup=128,
        # Per step every thread stages one half of A and one of B.
        device_bytes_read=groups * steps * 2 * 128 * 2,
        threadgroup_bytes_written=groups * steps * 2 * 128 * 2,
        # Per step each of the 4 simdgroups loads two 8x8 half tiles.
        threadgroup_bytes_read=groups * steps * 4 * 2 * 64 * 2,
        device_bytes_written=m * n * 4,  # simdgroup_store of the float accumulators
        mma_ops=groups * steps * 4, barriers=groups * steps * 2, simd_ops=0, fma_ops=0,
        threadgroup_memory_bytes=2 * 128 * 2)
    np.testing.assert_array_equal(c, a.astype(np.float32) @ b.astype(np.float32))


@needs_test_kernels
@needs_counting
def test_barrier_loop():
    rounds, groups, group = 7, 3, 64
    out = np.zeros(groups * group, np.float32)
    r = counts("profile_barrier_loop", {0: out, 1: np.array([rounds], np.uint32)}, (groups, 1, 1),
               (group, 1, 1), schedule="reverse")
    assert_counts(r, threadgroups=groups, threads_per_threadgroup=group, device_bytes_read=0,
                  device_bytes_written=groups * group * 4,
                  threadgroup_bytes_written=groups * rounds * group * 4,
                  threadgroup_bytes_read=groups * rounds * group * 4,
                  barriers=groups * rounds * 2, simd_ops=groups * rounds * 2 * (group // 32),
                  mma_ops=0, fma_ops=0, threadgroup_memory_bytes=group * 4)


# ---- today's attention kernels: the tiled forward and the tiled backward -----------------------
# The closed forms below follow the loop structure of shaders/flash_attention_{fwd,bwd}.metal.


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
TYPE_NAME = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def tiled_forward_counts(problem, mask):
    """Counts of the tiled forward: per threadgroup (a block of BQ query rows), Q staged once,
    then for every key block meeting the block's visible union [lo, hi]: K and V staged (only
    their rows inside the union read from device memory), S = Q K^T and O += P V as 8x8 MMAs,
    two row-max shuffles; at the end two row-sum shuffles and the stores of O, LSE and the
    residuals m and log(l)."""
    shape = ext.tile_shape("fwd", TYPE_NAME[problem.dtype], problem.head_dim)
    bq, bk, sg, threads = shape["rows"], shape["cols"], shape["simdgroups"], shape["threads"]
    s, d, h = ITEMSIZE[problem.dtype], problem.head_dim, problem.heads
    df, kf = d // 8, bk // 8
    stride = d + 16 // s  # padded tile rows
    lengths_read = 4 * threads * ((problem.q_lengths is not None)
                                  + (problem.kv_lengths is not None))
    q_valid = (np.asarray(problem.q_lengths) if problem.q_lengths is not None
               else np.full(problem.batch, problem.q_len))
    c = dict(threadgroups=0, device_bytes_read=0, device_bytes_written=0,
             threadgroup_bytes_written=0, threadgroup_bytes_read=0, simd_ops=0, barriers=0,
             mma_ops=0, fma_ops=0)
    for b in range(problem.batch):
        for i0 in range(0, problem.q_len, bq):
            rows = min(bq, problem.q_len - i0)
            c["threadgroups"] += 1
            c["device_bytes_read"] += lengths_read
            c["device_bytes_written"] += rows * (d * s + 12)
            c["simd_ops"] += 2 * sg
            keys = np.flatnonzero(mask[b, i0:i0 + bq].any(axis=0))
            if keys.size == 0:
                continue  # no row of the block sees a key: nothing staged
            lo, hi = keys[0], keys[-1]
            blocks = hi // bk - lo // bk + 1
            valid = int(np.clip(q_valid[b] - i0, 0, bq))
            c["device_bytes_read"] += (valid + 2 * (hi - lo + 1)) * d * s
            # + the non-finite-V flags: one int per simdgroup, set once, all read per block
            c["threadgroup_bytes_written"] += bq * d * s + 4 * sg + blocks * 2 * bk * d * s
            q_frag_reads = 1 if shape["q_in_registers"] else blocks
            c["threadgroup_bytes_read"] += threads * (
                q_frag_reads * df * 2 * s + blocks * (2 * kf * df * 2 * s + 4 * sg))
            c["barriers"] += 1 + blocks * (4 if shape["kv_one_buffer"] else 2)
            c["mma_ops"] += blocks * sg * 2 * df * kf
            c["simd_ops"] += blocks * 3 * sg  # 2 row-max/sum shuffles, the non-finite-V vote
    c = {k: int(v) * (h if k != "fma_ops" else 1) for k, v in c.items()}
    kv_rows = (1 if shape["kv_one_buffer"] else 2) * bk
    # Q in registers is staged through the K/V tiles, else it has its own tile.
    tile_rows = max(bq, kv_rows) if shape["q_in_registers"] else bq + kv_rows
    c["threadgroup_memory_bytes"] = tile_rows * stride * s + 4 * sg
    return c


def _union(visible):
    """(lo, hi) of the indices some row of a block sees (visible: bool [rows, cols]), or None."""
    cols = np.flatnonzero(visible.any(axis=0))
    return (cols[0], cols[-1]) if cols.size else None


def tiled_dq_counts(problem, mask):
    """Counts of bwd_dq: per threadgroup (BQ query rows), Q and dO staged, D as the diagonal of
    dO O^T (O read once, 2 row-sum shuffles), m, log(l) and g_lse read by the 4 lanes of each
    valid row,
    D stored; then per key block meeting the block's visible union: V and K staged, dP, S and
    dS K as MMAs; dQ stored."""
    bq, bk, sg, threads, lengths_read = _launch(problem, "bwd_dq")
    one_buffer = profile_shared_stream(problem)
    s, d, h = ITEMSIZE[problem.dtype], problem.head_dim, problem.heads
    df, kf = d // 8, bk // 8
    q_valid = _valid(problem.q_lengths, problem.q_len, problem.batch)
    c = _zero_counts()
    for b in range(problem.batch):
        for i0 in range(0, problem.q_len, bq):
            rows = min(bq, problem.q_len - i0)
            valid = int(np.clip(q_valid[b] - i0, 0, bq))
            c["threadgroups"] += 1
            c["device_bytes_read"] += lengths_read + 3 * valid * d * s + 3 * 4 * 4 * valid
            c["device_bytes_written"] += rows * (d * s + 4)
            c["threadgroup_bytes_written"] += 2 * bq * d * s
            c["threadgroup_bytes_read"] += threads * df * 2 * s
            c["simd_ops"] += 2 * sg
            c["mma_ops"] += sg * df
            c["barriers"] += 1
            union = _union(mask[b, i0:i0 + bq])
            if union is None:
                continue
            lo, hi = union
            blocks = hi // bk - lo // bk + 1
            c["device_bytes_read"] += 2 * (hi - lo + 1) * d * s
            c["threadgroup_bytes_written"] += blocks * 2 * bk * d * s
            c["threadgroup_bytes_read"] += blocks * threads * 2 * s * df * (2 + 3 * kf)
            c["barriers"] += blocks * (4 if one_buffer else 2)
            c["mma_ops"] += blocks * 3 * sg * df * kf
    c = {k: int(v) * h for k, v in c.items()}
    c["threadgroup_memory_bytes"] = (2 * bq + (1 if one_buffer else 2) * bk) * (d * s + 16)
    return c


def tiled_dkdv_counts(problem, mask, stage):
    """Counts of bwd_dkdv (bwd_dk, bwd_dv): per threadgroup (BKV keys), K (and V for dK) staged
    if some query sees a key of the block; per query head of the group and query block meeting
    the visible union: dO and/or Q staged (the one-buffer kernels restage in between), m, log(l)
    and D staged, dP^T (dK), S^T, dK += dS^T Q, dV += P^T dO as MMAs; dK/dV stored."""
    bkv, bq, sg, threads, lengths_read = _launch(problem, stage)
    want_dk, want_dv = stage != "bwd_dv", stage != "bwd_dk"
    one_buffer = profile_shared_stream(problem)
    s, d, hk = ITEMSIZE[problem.dtype], problem.head_dim, problem.kv_heads
    g = problem.heads // hk
    df, qf = d // 8, bq // 8
    kv_valid = _valid(problem.kv_lengths, problem.kv_len, problem.batch)
    c = _zero_counts()
    for b in range(problem.batch):
        for j0 in range(0, problem.kv_len, bkv):
            keys = min(bkv, problem.kv_len - j0)
            c["threadgroups"] += 1
            c["device_bytes_read"] += lengths_read
            c["device_bytes_written"] += keys * d * s * (want_dk + want_dv)
            union = _union(mask[b, :, j0:j0 + bkv].T)
            if union is None:
                continue
            lo, hi = union
            valid = int(np.clip(kv_valid[b] - j0, 0, bkv))
            c["device_bytes_read"] += (1 + want_dk) * valid * d * s
            c["threadgroup_bytes_written"] += (1 + want_dk) * bkv * d * s
            blocks = g * (hi // bq - lo // bq + 1)
            c["device_bytes_read"] += g * (2 * (hi - lo + 1) * d * s + 12 * (hi - lo + 1))
            # Q, dO, (m, log(l) log2(e), D, unused)
            c["threadgroup_bytes_written"] += blocks * (2 * bq * d * s + 16 * bq)
            # S^T, and dP^T, dK += dS^T Q for dK, dV += P^T dO for dV
            c["mma_ops"] += blocks * sg * df * qf * (1 + 2 * want_dk + want_dv)
            abt = (1 + want_dk) * (df + df * qf)  # fragments of S^T (and dP^T)
            ab = (want_dk + want_dv) * df * qf
            stats = 2 * qf * (12 if want_dk else 8)  # (m, log l, D) per element; no D for dV
            c["threadgroup_bytes_read"] += blocks * threads * (2 * s * (abt + ab) + stats)
            c["barriers"] += blocks * (4 if one_buffer else 2)
    c = {k: int(v) * hk for k, v in c.items()}
    stride_bytes = d * s + 16
    c["threadgroup_memory_bytes"] = (bkv * stride_bytes + (bkv * stride_bytes if want_dk else 16)
                                     + (1 if one_buffer else 2) * bq * stride_bytes + 16 * bq)
    return c


def _launch(problem, stage):
    """(rows, cols, simdgroups, threads) of a stage's tile shape, and the bytes every
    threadgroup reads from the length buffers (each thread reads its batch entry)."""
    shape = ext.tile_shape(stage, TYPE_NAME[problem.dtype], problem.head_dim)
    lengths_read = 4 * shape["threads"] * ((problem.q_lengths is not None)
                                           + (problem.kv_lengths is not None))
    return shape["rows"], shape["cols"], shape["simdgroups"], shape["threads"], lengths_read


def profile_shared_stream(problem):
    """Whether the backward kernels of this problem use one streamed tile (tile_shapes.h)."""
    return ITEMSIZE[problem.dtype] * problem.head_dim > 512


def _valid(lengths, allocated, batch):
    return np.asarray(lengths) if lengths is not None else np.full(batch, allocated)


def _zero_counts():
    return dict(threadgroups=0, device_bytes_read=0, device_bytes_written=0,
                threadgroup_bytes_written=0, threadgroup_bytes_read=0, simd_ops=0, barriers=0,
                mma_ops=0, fma_ops=0)


def expected_counts(problem):
    """{stage: counts} of the fwd kernel and of the backward stages (ext.bwd_stages)."""
    mask = problem.visibility()  # visibility.whole_matrix: the semantics, not the kernels
    out = {"fwd": tiled_forward_counts(problem, mask), "bwd_dq": tiled_dq_counts(problem, mask)}
    for stage in ext.bwd_stages(problem.head_dim)[1:]:
        out[stage] = tiled_dkdv_counts(problem, mask, stage)
    return out


ATTENTION_CASES = [
    # rows not a multiple of 4 or 32, grouped-query attention, causal
    ["--dtype", "float32", "--head-dim", "16", "--q-len", "45", "--heads", "4", "--kv-heads", "2",
     "--causal"],
    # cross attention, local window, per-batch lengths (one batch entry with empty rows)
    ["--dtype", "float16", "--head-dim", "32", "--batch", "2", "--q-len", "24", "--kv-len", "70",
     "--heads", "2", "--kv-heads", "2", "--window", "20,3", "--q-lengths", "24", "9",
     "--kv-lengths", "70", "30", "--causal-alignment", "bottom_right"],
    # bf16, D with a partial last chunk of lanes (48 = 32 + 16)
    ["--dtype", "bfloat16", "--head-dim", "48", "--q-len", "33", "--heads", "1", "--kv-heads", "1"],
    # split dK and dV kernels (D >= 160); float32: one streamed tile, one simdgroup
    ["--dtype", "float16", "--head-dim", "192", "--q-len", "21", "--kv-len", "30", "--heads", "2",
     "--kv-heads", "1", "--causal", "--causal-alignment", "bottom_right"],
    ["--dtype", "float32", "--head-dim", "160", "--q-len", "19", "--kv-len", "12", "--heads", "2",
     "--kv-heads", "2", "--window", "5,2"],
]


def make_problem(argv):
    args = profile.make_parser().parse_args(argv)
    return profile_model.Problem(args, args.dtype[0], args.head_dim[0], args.causal == "on")


@needs_counting
@pytest.mark.parametrize("argv", ATTENTION_CASES,
                         ids=["causal-gqa", "window-lengths", "bf16", "split", "one-buffer"])
def test_attention_counts(argv):
    problem = make_problem(argv)
    expected = expected_counts(problem)
    runs = profile_model.run_problem(problem, profile_model.PASSES)
    seen = []
    for _, r in runs:
        stage = profile_model.KERNEL_NAME.match(r["kernel"]).group("stage")
        seen.append(stage)
        shape = ext.tile_shape(stage, TYPE_NAME[problem.dtype], problem.head_dim)
        assert r["threads_per_threadgroup"] == shape["threads"]
        got = {k: r[k] for k in expected[stage]}
        assert got == expected[stage], stage
    assert seen == ["fwd", *ext.bwd_stages(problem.head_dim)]


# ---- CLI ------------------------------------------------------------------------------------

TINY = ["--q-len", "20", "--kv-len", "36", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--causal", "--causal-alignment", "bottom_right"]


@needs_counting
def test_json_schema_and_useful_flops(tmp_path, capsys):
    path = tmp_path / "profile.json"
    assert profile.main([*TINY, "--dtype", "float32", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "roofline MODEL" in out
    for table in out.split("\n\n"):  # aligned: every line after the title as wide as the rule
        lines = table.splitlines()
        lines = lines[next(n for n, line in enumerate(lines) if line.endswith(":")) + 1:]
        assert {len(line) for line in lines} == {len(lines[1])}, table
        assert len(lines[1]) <= 100, table
    records = json.loads(path.read_text())
    assert [r["kernel"] for r in records] == [
        f"flash_attention_{s}_f32_d16" for s in ("fwd", "bwd_dq", "bwd_dkdv")]
    keys = ["kernel", "variant", "dtype", "head_dim", "value_head_dim", "batch", "q_len", "kv_len",
            "heads", "kv_heads", "causal", "alibi", "dropout", "threadgroups",
            "threads_per_threadgroup", "threadgroup_memory_bytes", "device_bytes_read",
            "device_bytes_written", "threadgroup_bytes_read", "threadgroup_bytes_written",
            "mma_ops", "simd_ops", "barriers", "fma_ops", "math_ops", "ffi_call_bytes",
            "useful_flops", "registers", "model", "occupancy"]
    for r in records:
        assert list(r) == keys
        assert (r["dtype"], r["head_dim"], r["q_len"], r["kv_len"], r["causal"]) == (
            "float32", 16, 20, 36, True)
        assert set(r["model"]) == set(roofline.GPUS)
        for m in r["model"].values():
            assert set(m) == {"bound", "seconds", "percent_of_peak"}
            assert m["bound"] in ("compute", "device", "threadgroup")
            assert m["seconds"] > 0 and 0 <= m["percent_of_peak"] <= 100
        assert set(r["occupancy"]) == set(roofline.GPUS)
        for name, o in r["occupancy"].items():
            assert o == roofline.occupancy(
                roofline.GPUS[name], threadgroup_bytes=r["threadgroup_memory_bytes"],
                threads_per_threadgroup=r["threads_per_threadgroup"], registers=r["registers"])
        stage = profile_model.KERNEL_NAME.match(r["kernel"]).group("stage")
        assert r["registers"] == ext.tile_shape(stage, "f32", 16)["registers"]
        # The handler's measured working memory of the launch's call: its plan's formula.
        direction = "fwd" if stage == "fwd" else "bwd"
        assert r["ffi_call_bytes"] == ext.working_memory(direction, "f32", 1, 20, 36, 2, 1, 16)
    # Bottom-right causal with kv_len - q_len = 16: query i sees keys 0..i + 16.
    pairs = sum(i + 17 for i in range(20))
    assert records[0]["useful_flops"] == 4 * 16 * pairs * 2
    assert sum(r["useful_flops"] for r in records[1:]) == 10 * 16 * pairs * 2


@needs_counting
def test_an_unknown_variant_is_refused_with_the_familys_list(capsys):
    with pytest.raises(SystemExit):
        profile.main(["--variant", "7"])
    assert "the variants of --dtype float16 --head-dim 64 are [0, 1]" in capsys.readouterr().err


@needs_counting
def test_every_variant_with_its_register_estimate(tmp_path):
    """--variant all: one record per launch and tile variant, each variant's kernels with its own
    register estimate (the forward's variant 1 reloads Q: fewer registers)."""
    path = tmp_path / "profile.json"
    assert profile.main([*TINY, "--dtype", "float32", "--variant", "all", "--no-progress",
                         "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [(r["kernel"], r["variant"]) for r in records] == [
        ("flash_attention_fwd_f32_d16", 0), ("flash_attention_bwd_dq_f32_d16", 0),
        ("flash_attention_bwd_dkdv_f32_d16", 0), ("flash_attention_fwd_var1_f32_d16", 1),
        ("flash_attention_bwd_dq_var1_f32_d16", 1), ("flash_attention_bwd_dkdv_var1_f32_d16", 1)]
    for r in records:
        stage = profile_model.KERNEL_NAME.match(r["kernel"]).group("stage")
        assert r["registers"] == ext.tile_shape(stage, "f32", 16, r["variant"])["registers"]
    assert records[3]["registers"] < records[0]["registers"]
    # The same useful work in every variant; the forward's tiles keep their blocks, so its MMA
    # operations are the same too.
    for a, b in zip(records[:3], records[3:]):
        assert a["useful_flops"] == b["useful_flops"]
    assert records[0]["mma_ops"] == records[3]["mma_ops"]


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "float64"], "invalid choice: 'float64'"),
    (["--head-dim", "24"], "head_dim 24"),
    (["--heads", "3", "--kv-heads", "2"], "must be a multiple of --kv-heads"),
    (["--batch", "2", "--q-lengths", "5"], "needs 2 values"),
    (["--window", "a,b"], "bad window"),
    (["--q-len", "0"], "must be a positive integer"),
    (["--gpu", "M9"], "invalid choice: 'M9'"),
])
def test_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        profile.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_counting_variants_name_the_build_option(monkeypatch, capsys):
    class NoCounting:
        class emulator:
            @staticmethod
            def has_counting_variant():
                return False

    monkeypatch.setattr(profile_model, "_ext", lambda: NoCounting)
    with pytest.raises(SystemExit) as e:
        profile.main(TINY)
    assert e.value.code == 2
    assert "JFM_EMULATOR_COUNTING=ON" in capsys.readouterr().err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        profile.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: ['float16'])", "(default: [64, 128])",
                    "--batch BATCH batch size (default: 1)",
                    "(default: 1024)", "--heads HEADS query heads (default: 4)",
                    "(default: ['forward', 'backward'])", "length (default: --q-len)"):
        assert default in text
    assert "(default: None)" not in text


# ---- roofline model -------------------------------------------------------------------------

@pytest.mark.parametrize("name,tflops", [("M1", 2.617), ("M1 Max", 10.617), ("M2 Max", 13.6),
                                         ("M3 Max", 14.32), ("M4", 3.76)])
def test_peaks_reproduce_published_figures(name, tflops):
    assert roofline.GPUS[name].peak_flops / 1e12 == pytest.approx(tflops, rel=2e-3)


def test_model_bounds():
    gpu = roofline.GPUS["M1"]
    # 1 GB through DRAM dominates: device-bound, time = bytes / bandwidth.
    m = roofline.model_launch(gpu, executed_flops=1e9, useful_flops=1e9, device_bytes=1e9,
                              threadgroup_bytes=0, threadgroups=1000)
    assert m["bound"] == "device"
    assert m["seconds"] == pytest.approx(1e9 / 68.25e9)
    assert m["percent_of_peak"] == pytest.approx(100 * 1e9 / m["seconds"] / gpu.peak_flops)
    # Compute-bound at full peak; one threadgroup uses one of 8 cores: 8x the time.
    full = roofline.model_launch(gpu, executed_flops=1e12, useful_flops=1e12, device_bytes=0,
                                 threadgroup_bytes=0, threadgroups=8)
    assert full["bound"] == "compute" and full["percent_of_peak"] == pytest.approx(100)
    one = roofline.model_launch(gpu, executed_flops=1e12, useful_flops=1e12, device_bytes=0,
                                threadgroup_bytes=0, threadgroups=1)
    assert one["seconds"] == pytest.approx(8 * full["seconds"])
    # Threadgroup memory: 64 B per core-cycle.
    t = roofline.model_launch(gpu, executed_flops=0, useful_flops=0, device_bytes=0,
                              threadgroup_bytes=64 * 8 * 1.278e9, threadgroups=64)
    assert t["bound"] == "threadgroup" and t["seconds"] == pytest.approx(1.0)
    assert math.isclose(t["percent_of_peak"], 0.0)


def test_occupancy_model():
    gpu = roofline.GPUS["M1"]  # 52 KiB threadgroup memory, 208 KiB registers, 3072 threads
    # 25.5 KiB and 128 threads at 52 registers: threadgroup memory binds at 2 groups.
    assert roofline.occupancy(gpu, threadgroup_bytes=26112, threads_per_threadgroup=128,
                              registers=52) == dict(threadgroups=2, simdgroups=8, limit="memory")
    # 8.5 KiB: registers bind (208 KiB / (86 * 4 B * 128 threads) = 4.8).
    assert roofline.occupancy(gpu, threadgroup_bytes=8704, threads_per_threadgroup=128,
                              registers=86) == dict(threadgroups=4, simdgroups=16,
                                                    limit="registers")
    # No threadgroup memory, one simdgroup: registers again (208 KiB / (124 * 4 * 32) = 13.4).
    assert roofline.occupancy(gpu, threadgroup_bytes=0, threads_per_threadgroup=32,
                              registers=124) == dict(threadgroups=13, simdgroups=13,
                                                     limit="registers")
    assert roofline.occupancy(gpu, threadgroup_bytes=0, threads_per_threadgroup=1024,
                              registers=8) == dict(threadgroups=3, simdgroups=96,
                                                   limit="threads")


STAGES = ("fwd", "bwd_dq", "bwd_dkdv", "bwd_dk", "bwd_dv", "decode_partial", "decode_combine",
          "decode_vector")  # every stage of the tile table


def test_no_family_register_estimate_exceeds_the_budget():
    """jfm_tile_registers (docs/kernels.md#registers) of every stage a call dispatches, for
    every dtype and head dim the kernels are built for, stays within 128 32-bit registers
    (spill risk above; two D-wide dK and dV accumulators would not, hence the split pair)."""
    estimates = {(stage, dtype, d): ext.tile_shape(stage, dtype, d)["registers"]
                 for dtype in ("f32", "f16", "bf16") for d in HEAD_DIMS
                 for stage in STAGES if not stage.startswith("bwd_")
                 or stage in ext.bwd_stages(d)}
    assert max(estimates.values()) <= roofline.REGISTER_BUDGET, max(estimates.items(),
                                                                     key=lambda x: x[1])
    # The closed forms of two families: the forward at f16 D 128 (O 16 fragments, S 2, Q 16 in
    # registers, one K/V fragment) and the vector decode at D 128 (8 rows of q and O, 4 floats
    # each, and 5 per-row values; one key's 4 values).
    assert estimates[("fwd", "f16", 128)] == 16 + 2 * (16 + 2 + 16 + 1)
    assert estimates[("decode_vector", "f16", 128)] == 16 + 8 * (2 * 4 + 5) + 4


@needs_counting
def test_split_submissions_share_counts_and_useful_flops():
    """A call split into many submissions (a tiny time budget: one chunk per threadgroup or so)
    launches every kernel several times; the launches' counts and useful FLOPs add up to those of
    the unsplit call."""
    from jax_flash_metal import _ext
    problem = make_problem(["--dtype", "float32", "--head-dim", "16", "--batch", "2", "--q-len",
                            "12", "--kv-len", "20", "--heads", "2", "--kv-heads", "1",
                            "--q-lengths", "12", "5", "--window", "4,"])
    whole = profile_model.profile_records(problem, profile_model.PASSES, ["M1"])
    previous = _ext.testing.set_submission_budget(1e-12)
    try:
        split = profile_model.profile_records(problem, profile_model.PASSES, ["M1"])
    finally:
        _ext.testing.set_submission_budget(previous)
    assert len(split) > len(whole)
    additive = [k for k in profile_model.count_keys()
                if k not in ("threads_per_threadgroup", "threadgroup_memory_bytes")]
    for r in whole:
        parts = [s for s in split if s["kernel"] == r["kernel"]]
        assert len(parts) >= 2
        for k in additive + ["useful_flops"]:
            assert sum(p[k] for p in parts) == r[k], (r["kernel"], k)
    pairs = problem.visible_pairs().sum()
    assert sum(r["useful_flops"] for r in split if r["pass"] == "forward") == 4 * 16 * 2 * pairs
    assert sum(r["useful_flops"] for r in split if r["pass"] == "backward") == 10 * 16 * 2 * pairs


@needs_counting
@pytest.mark.parametrize("dtype,head_dim", [("float16", 64), ("float32", 128)])
def test_tiled_forward_causal_moves_at_most_six_tenths_of_the_bytes(dtype, head_dim):
    """Key blocks outside a query block's visible union are never staged, so causal attention at
    length 512 moves at most 0.6x the device bytes of non-causal."""
    moved = {}
    for causal in (False, True):
        problem = make_problem(["--dtype", dtype, "--head-dim", str(head_dim), "--q-len", "512",
                                "--heads", "1", "--kv-heads", "1"] + ["--causal"] * causal)
        [(_, r)] = profile_model.run_problem(problem, ("forward",))
        moved[causal] = r["device_bytes_read"] + r["device_bytes_written"]
    assert moved[True] <= 0.6 * moved[False], moved


@needs_counting
def test_alibi_moves_the_plain_calls_device_bytes_but_the_slopes():
    """Per launch, forward (the tiled kernel and the decode) and backward with the slopes'
    gradient: every device buffer but the slopes and dalibi has the plain call's exact bytes
    (the params, in the constant address space, are read more by the feature path);
    each thread reads its row's slope once (per head of its kv head's group in the dK/dV
    kernel, per row in the vector decode), and the dQ kernel writes one float per query row."""
    from kernel_harness import ALIBI_SLOPES, DALIBI
    for q_len, kv_len in ((40, 48), (3, 200)):
        argv = ["--dtype", "float16", "--head-dim", "32", "--q-len", str(q_len), "--kv-len",
                str(kv_len), "--heads", "4", "--kv-heads", "2", "--causal",
                "--causal-alignment", "bottom_right"]
        plain = profile_model.run_problem(make_problem(argv), profile_model.PASSES)
        alibi = profile_model.run_problem(make_problem(argv + ["--alibi"]), profile_model.PASSES)
        assert [r["kernel"] for _, r in plain] == [r["kernel"] for _, r in alibi]
        for (_, p), (_, a) in zip(plain, alibi):
            for index, bound in p["buffers"].items():
                if index not in (ALIBI_SLOPES, DALIBI) and not bound["constant"]:
                    assert a["buffers"][index] == bound, (a["kernel"], index)
            slopes = a["buffers"].get(ALIBI_SLOPES, dict(read=0))["read"]
            threads = a["threadgroups"] * a["threads_per_threadgroup"]
            assert slopes <= 8 * 4 * threads, a["kernel"]  # at most 8 rows (heads) a thread
            written = a["buffers"].get(DALIBI, dict(written=0))["written"]
            assert written == (4 * 4 * q_len if "bwd_dq" in a["kernel"] else 0), a["kernel"]


@needs_counting
def test_dropout_moves_the_plain_calls_device_bytes():
    """Dropout generates its mask in registers: every launch of a dropout call (forward, dQ,
    dK/dV) writes exactly the plain call's device bytes and reads exactly the plain call's plus
    the dropout operand's entry (``dropout.WORDS`` 32-bit words: key, indices, positions), once
    per thread and query head it serves (no mask is read or written: none of it scales with the
    lengths)."""
    plain_argv = ["--dtype", "float16", "--head-dim", "32", "--q-len", "40", "--kv-len", "56",
                  "--heads", "4", "--kv-heads", "2", "--causal"]
    runs = {rate: profile_model.run_problem(make_problem([*plain_argv, "--dropout", rate]),
                                      profile_model.PASSES) for rate in ("0", "0.5")}
    assert [r["kernel"] for _, r in runs["0"]] == [r["kernel"] for _, r in runs["0.5"]]
    for (_, plain), (_, dropped) in zip(runs["0"], runs["0.5"]):
        heads_per_thread = 2 if "dkdv" in plain["kernel"] else 1  # the dK/dV loop over G = 2
        entries = plain["threadgroups"] * plain["threads_per_threadgroup"] * heads_per_thread
        assert dropped["device_bytes_written"] == plain["device_bytes_written"]
        assert dropped["device_bytes_read"] == (plain["device_bytes_read"]
                                                + 4 * dropout.WORDS * entries)
