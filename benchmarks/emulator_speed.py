"""How fast the MSL-on-CPU emulator runs kernels (prints a table; timing never gates a test).

Usage: python benchmarks/emulator_speed.py [--workers N] [--repeat R]

Rows: a 64x64x64 simdgroup_matrix GEMM (tests/shaders/bench.metal, float and half inputs), a
256-thread kernel with 2 threadgroup barriers per round, and one forward + backward of the
attention kernels (shaders/*.metal) at a small shape, per dtype. Needs the built extension
(jax_flash_metal._ext). Times are the best of --repeat runs.
"""

import argparse
import math
import time

import ml_dtypes
import numpy as np

from jax_flash_metal._ext import emulator

# AttentionParams of shaders/attention_params.h (14 four-byte fields).
PARAMS = np.dtype([(n, "<u4") for n in ("batch", "q_len", "kv_len", "num_heads", "num_kv_heads",
                                        "head_dim")]
                  + [("scale", "<f4"), ("scale_log2", "<f4"), ("window_left", "<i4"),
                     ("window_right", "<i4")]
                  + [(n, "<u4") for n in ("causal", "bottom_right", "has_q_lengths",
                                          "has_kv_lengths")])


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def gemm_row(dtype, name, workers, repeat):
    m = n = k = 64
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    c = np.zeros((m, n), np.float32)
    dims = np.array([m, n, k], np.uint32)
    groups = ((m // 8) * (n // 8) // 4, 1, 1)
    t = best(lambda: emulator.run(name, {0: a, 1: b, 2: c, 3: dims}, groups, (128, 1, 1),
                                  num_workers=workers), repeat)
    err = np.abs(c - a.astype(np.float64) @ b.astype(np.float64)).max()
    ops = groups[0] * 4 * (k // 8) * 3 + groups[0] * 4 * 2  # collectives per run
    return f"gemm 64x64x64 {np.dtype(dtype).name} (simdgroup_matrix)", t, ops, f"max err {err:.1e}"


def barrier_row(workers, repeat):
    n, rounds, groups = 256, 64, 8
    out = np.zeros(groups * n, np.float32)
    r = np.array([rounds], np.uint32)
    t = best(lambda: emulator.run("emu_barrier_heavy", {0: out, 1: r}, (groups, 1, 1),
                                  (n, 1, 1), num_workers=workers), repeat)
    return (f"barriers: {groups} groups x 256 threads x {2 * rounds + 1}", t,
            groups * (2 * rounds + 1), "")


def attention_rows(workers, repeat):
    rows = []
    batch, seq, heads, kv_heads, d = 1, 256, 4, 2, 64
    for tname, dtype in (("f32", np.float32), ("f16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        rng = np.random.default_rng(1)

        def draw(shape):
            x = rng.standard_normal(shape).astype(dtype)
            return x.view(np.uint16) if tname == "bf16" else x

        q, do = draw((batch, seq, heads, d)), draw((batch, seq, heads, d))
        k, v = draw((batch, seq, kv_heads, d)), draw((batch, seq, kv_heads, d))
        p = np.zeros((), PARAMS)
        p["batch"], p["q_len"], p["kv_len"] = batch, seq, seq
        p["num_heads"], p["num_kv_heads"], p["head_dim"] = heads, kv_heads, d
        p["scale"] = 1 / math.sqrt(d)
        p["scale_log2"] = p["scale"] * math.log2(math.e)
        p["window_left"] = p["window_right"] = -1
        p["causal"] = 1
        params = np.frombuffer(p.tobytes(), np.uint8).copy()
        lengths = np.zeros(4, np.int32)
        o, dq = np.zeros_like(q), np.zeros_like(q)
        dk, dv = np.zeros_like(k), np.zeros_like(k)
        lse = np.zeros((batch, heads, seq), np.float32)
        delta, g_lse = np.zeros_like(lse), np.zeros_like(lse)
        grid_q = (math.ceil(seq / 4), heads, batch)
        grid_kv = (math.ceil(seq / 4), kv_heads, batch)
        common = {0: q, 1: k, 2: v, 8: lengths, 9: lengths, 13: params}

        def fwd():
            emulator.run(f"flash_attention_fwd_{tname}_d{d}", {**common, 3: o, 4: lse}, grid_q,
                         (128, 1, 1), num_workers=workers)

        def bwd():
            b = {**common, 3: o, 4: lse, 5: do, 6: delta, 7: g_lse}
            emulator.run(f"flash_attention_bwd_preprocess_{tname}_d{d}", b, grid_q, (128, 1, 1),
                         num_workers=workers)
            emulator.run(f"flash_attention_bwd_dq_{tname}_d{d}", {**b, 10: dq}, grid_q,
                         (128, 1, 1), num_workers=workers)
            emulator.run(f"flash_attention_bwd_dkdv_{tname}_d{d}", {**b, 11: dk, 12: dv},
                         grid_kv, (128, 1, 1), num_workers=workers)

        shape = f"[{batch},{seq},{heads}/{kv_heads},{d}] causal"
        rows.append((f"attention fwd {tname} {shape}", best(fwd, repeat), None, ""))
        rows.append((f"attention bwd {tname} {shape}", best(bwd, repeat), None, ""))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=0, help="OS threads (0 = all cores)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = [gemm_row(np.float32, "emu_gemm_tiled_f32", args.workers, args.repeat),
            gemm_row(np.float16, "emu_gemm_tiled_f16", args.workers, args.repeat),
            barrier_row(args.workers, args.repeat)]
    names = set(emulator.kernel_names())
    if "flash_attention_fwd_f32_d64" in names:
        rows += attention_rows(args.workers, args.repeat)
    print(f"{'kernel':<52} {'time':>10} {'collectives/s':>14}  note")
    for name, t, ops, note in rows:
        rate = f"{ops / t:14.3g}" if ops else f"{'':14}"
        print(f"{name:<52} {t * 1e3:8.2f}ms {rate}  {note}")


if __name__ == "__main__":
    main()
