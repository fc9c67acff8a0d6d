"""How fast the MSL-on-CPU emulator runs kernels (prints a table; timing never gates a test).

Usage: python benchmarks/emulator_speed.py [--workers N] [--repeat R]

Rows: a 64x64x64 simdgroup_matrix GEMM (tests/emulator/shaders/bench.metal, float and half inputs), a
256-thread kernel with 2 threadgroup barriers per round, and one forward + backward of the
attention kernels (shaders/*.metal) at a small shape, per dtype. Needs the built extension
(jax_flash_metal._ext). Times are the best of --repeat runs.
"""

import argparse
import os
import sys
import time

import numpy as np

from jax_flash_metal.tools.cli import HelpFormatter
from jax_flash_metal._ext import emulator

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


def attention_rows(repeat):
    """One causal forward and backward per dtype through tests/helpers/kernel_harness.py, which binds
    and dispatches the attention kernels the way the host does (all cores)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import kernel_harness as kh

    rows = []
    batch, seq, heads, kv_heads, d = 1, 256, 4, 2, 64
    for tname, dtype in kh.DTYPES.items():
        q, k, v, do, g_lse = kh.random_inputs(dtype, batch, seq, seq, heads, kv_heads, d, seed=1)
        o, _, residuals = kh.forward(q, k, v, is_causal=True)
        shape = f"[{batch},{seq},{heads}/{kv_heads},{d}] causal"
        rows.append((f"attention fwd {tname} {shape}",
                     best(lambda: kh.forward(q, k, v, is_causal=True), repeat), None, ""))
        rows.append((f"attention bwd {tname} {shape}",
                     best(lambda: kh.backward(q, k, v, o, residuals, do, g_lse, is_causal=True),
                          repeat),
                     None, ""))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--workers", type=int, default=0, help="OS threads (0 = all cores)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed runs of each kernel; the fastest is shown")
    args = ap.parse_args()
    rows = [gemm_row(np.float32, "emu_gemm_tiled_f32", args.workers, args.repeat),
            gemm_row(np.float16, "emu_gemm_tiled_f16", args.workers, args.repeat),
            barrier_row(args.workers, args.repeat)]
    names = set(emulator.kernel_names())
    if "flash_attention_fwd_f32_d64" in names:
        rows += attention_rows(args.repeat)
    print(f"{'kernel':<52} {'time':>10} {'collectives/s':>14}  note")
    for name, t, ops, note in rows:
        rate = f"{ops / t:14.3g}" if ops else f"{'':14}"
        print(f"{name:<52} {t * 1e3:8.2f}ms {rate}  {note}")


if __name__ == "__main__":
    main()
