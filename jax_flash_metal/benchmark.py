"""Time and memory of flash_attention against reference_attention and jax.nn.dot_product_attention.

Run ``python -m jax_flash_metal.benchmark --help``. For each method, sequence length, head dim and
causal setting it reports:

- forward and forward+backward wall time: the jit-compiled function is called once to warm up,
  then ``--repeats`` times; the median is shown. forward+backward is ``jax.vjp`` of the attention
  with a fixed random output cotangent, returning (dq, dk, dv).
- compiled temporary memory: ``memory_analysis().temp_size_in_bytes`` of the compiled function
  (XLA's scratch space beyond inputs and outputs), i.e. what the score matrix costs.
- achieved TFLOP/s from model FLOPs (same count for every method, see ``attention_flops``), and on
  Apple silicon with the metal implementation the percentage of the GPU's estimated peak.

Lengths above ``--run-up-to`` are only compiled (memory column filled, times shown as "-"), so the
memory of long sequences is reported without running them. The "emulator" implementation
interprets the Metal kernels on the CPU: it is slow by design and timed only up to
``--emulator-max-len`` (longer lengths: memory only).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash_metal
from jax_flash_metal import flash_attention, implementations, reference_attention

# GPU clock (GHz) of Apple-silicon generations; peak FP32 = cores x 128 ALUs x 2 (FMA) x clock.
# Only generations whose clock is published reliably are listed; use --peak-tflops for others.
_APPLE_GPU_GHZ = {"M1": 1.278, "M2": 1.398}
EMULATOR_NOTE = ("flash:emulator runs the Metal kernels in the MSL-on-CPU emulator: slow by design "
                 "(it exists to test the kernels without a Mac), so it is timed only at small "
                 "sizes")


def methods(impls: list[str] | None = None) -> dict:
    """Benchmarked attention functions by name: ``flash:<implementation>`` for each available
    implementation, ``reference`` and ``jax.nn``. Each maps (q, k, v, is_causal) -> out.

    ``impls`` selects and orders them; an unknown or unavailable name raises ValueError.
    """
    table = {
        f"flash:{impl}": (lambda impl: lambda q, k, v, causal: flash_attention(
            q, k, v, is_causal=causal, implementation=impl))(impl)
        for impl in implementations.available()
    }
    table["reference"] = lambda q, k, v, causal: reference_attention(q, k, v, is_causal=causal)
    table["jax.nn"] = lambda q, k, v, causal: jax.nn.dot_product_attention(q, k, v,
                                                                          is_causal=causal)
    if impls is None:
        return table
    unknown = [m for m in impls if m not in table]
    if unknown:
        raise ValueError(f"unknown or unavailable method(s) {unknown}; "
                         f"available here: {list(table)}")
    return {m: table[m] for m in impls}


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    causal: bool) -> tuple[int, int]:
    """Model FLOPs (forward, forward+backward) of attention.

    forward = 4 * batch * heads * P * head_dim, where P is the number of visible (query, key)
    pairs: q_len * kv_len, or for causal (top-left) sum_i min(i + 1, kv_len), about half. The 4 is
    two matmuls (Q K^T and P V) at 2 FLOPs per multiply-add. The backward counts 5 such matmuls
    (recomputed Q K^T, dO V^T, P^T dO, dS K, dS^T Q) = 10 * batch * heads * P * head_dim, the
    FlashAttention-2 paper's 2.5x-forward convention; forward+backward = 14 * ... Softmax and
    elementwise work are not counted.
    """
    if causal:
        n = min(q_len, kv_len)
        pairs = n * (n + 1) // 2 + (q_len - n) * kv_len
    else:
        pairs = q_len * kv_len
    unit = batch * heads * pairs * head_dim
    return 4 * unit, 14 * unit


def apple_gpu_peak_tflops(gpu_name: str) -> tuple[float | None, str]:
    """(estimated peak FP32 TFLOP/s, description) of the Apple GPU named ``gpu_name`` (as reported
    by ``jax_flash_metal.devices()["metal"]``, e.g. "Apple M2 Pro"), or (None, reason).

    The GPU core count comes from ``system_profiler`` (macOS only)."""
    gen = re.match(r"Apple (M\d+)", gpu_name)
    if not gen or gen.group(1) not in _APPLE_GPU_GHZ:
        return None, f"{gpu_name}: peak unknown (pass --peak-tflops)"
    try:
        info = subprocess.run(["system_profiler", "SPDisplaysDataType"], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{gpu_name}: could not read the GPU core count ({e})"
    cores = re.search(r"Total Number of Cores:\s*(\d+)", info)
    if not cores:
        return None, f"{gpu_name}: GPU core count unknown (pass --peak-tflops)"
    n = int(cores.group(1))
    peak = n * 128 * 2 * _APPLE_GPU_GHZ[gen.group(1)] / 1e3
    return peak, f"{gpu_name}, {n} GPU cores, estimated peak {peak:.1f} TFLOP/s FP32"


@dataclasses.dataclass
class Row:
    """One measured configuration. Times in milliseconds, memory in bytes; None = not measured."""

    method: str
    seq_len: int
    head_dim: int
    causal: bool
    fwd_ms: float | None
    fwdbwd_ms: float | None
    fwd_temp: int | None
    fwdbwd_temp: int | None
    fwd_flops: int
    fwdbwd_flops: int


def _temp_bytes(compiled) -> int | None:
    """Compiled temporary memory, or None where this JAX/backend does not report it."""
    try:
        stats = compiled.memory_analysis()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    return None if stats is None else int(stats.temp_size_in_bytes)


def _median_ms(compiled, args, repeats: int) -> float:
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(fn, *, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
            causal: bool, dtype, repeats: int, run: bool, seed: int = 0
            ) -> tuple[float | None, float | None, int | None, int | None]:
    """(fwd_ms, fwdbwd_ms, fwd_temp, fwdbwd_temp) of attention ``fn`` on random inputs
    q [batch, seq_len, heads, head_dim], k/v [batch, seq_len, kv_heads, head_dim] in ``dtype``.
    With ``run=False`` only compiles (times are None)."""
    kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (batch, seq_len, heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, seq_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (batch, seq_len, kv_heads, head_dim), dtype)
    ct = jax.random.normal(kc, q.shape, dtype)

    def forward(q, k, v):
        return fn(q, k, v, causal)

    def forward_backward(q, k, v, ct):
        return jax.vjp(forward, q, k, v)[1](ct)

    fwd = jax.jit(forward).lower(q, k, v).compile()
    fwdbwd = jax.jit(forward_backward).lower(q, k, v, ct).compile()
    times = (_median_ms(fwd, (q, k, v), repeats), _median_ms(fwdbwd, (q, k, v, ct), repeats)) \
        if run else (None, None)
    return (*times, _temp_bytes(fwd), _temp_bytes(fwdbwd))


def run_benchmark(*, seq_lens, head_dims, causal_modes, method_names=None, batch=1, heads=8,
                  kv_heads=None, dtype="float32", repeats=5, run_up_to=2048,
                  emulator_max_len=256, progress=None) -> list[Row]:
    """Measure every (method, head_dim, causal, seq_len); returns the rows in that order.

    Lengths above ``run_up_to`` (for flash:emulator, above ``emulator_max_len`` too) are only
    compiled: their rows have memory but no times.

    ``progress``, if given, is called with each finished row (for printing as we go).
    """
    kv_heads = heads if kv_heads is None else kv_heads
    rows = []
    for name, fn in methods(method_names).items():
        for head_dim in head_dims:
            for causal in causal_modes:
                for seq_len in seq_lens:
                    longest = min(run_up_to, emulator_max_len) if name == "flash:emulator" \
                        else run_up_to
                    times_mem = measure(fn, batch=batch, seq_len=seq_len, heads=heads,
                                        kv_heads=kv_heads, head_dim=head_dim, causal=causal,
                                        dtype=jnp.dtype(dtype), repeats=repeats,
                                        run=seq_len <= longest)
                    flops = attention_flops(batch, heads, seq_len, seq_len, head_dim, causal)
                    rows.append(Row(name, seq_len, head_dim, causal, *times_mem, *flops))
                    if progress is not None:
                        progress(rows[-1])
    return rows


COLUMNS = ("method", "seq", "hdim", "causal", "fwd ms", "fwd+bwd ms", "fwd temp MiB",
           "fwd+bwd temp MiB", "fwd TFLOP/s", "fwd+bwd TFLOP/s")


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table_cells(row: Row, peak_tflops: float | None = None) -> list[str]:
    """The text cells of one row, in COLUMNS order (plus "% peak" cells when a peak is given)."""
    fwd_tf = None if row.fwd_ms is None else row.fwd_flops / (row.fwd_ms * 1e-3) / 1e12
    fb_tf = None if row.fwdbwd_ms is None else row.fwdbwd_flops / (row.fwdbwd_ms * 1e-3) / 1e12
    mib = 1 << 20
    cells = [row.method, str(row.seq_len), str(row.head_dim), "yes" if row.causal else "no",
             _fmt(row.fwd_ms, ".2f"), _fmt(row.fwdbwd_ms, ".2f"),
             _fmt(None if row.fwd_temp is None else row.fwd_temp / mib, ".1f"),
             _fmt(None if row.fwdbwd_temp is None else row.fwdbwd_temp / mib, ".1f"),
             _fmt(fwd_tf, ".3g"), _fmt(fb_tf, ".3g")]
    if peak_tflops:
        cells += [_fmt(None if fwd_tf is None else 100 * fwd_tf / peak_tflops, ".1f"),
                  _fmt(None if fb_tf is None else 100 * fb_tf / peak_tflops, ".1f")]
    return cells


def format_table(rows: list[Row], peak_tflops: float | None = None) -> str:
    """Aligned plain-text table of ``rows`` (text columns left-aligned, numbers right-aligned)."""
    header = list(COLUMNS) + (["fwd % peak", "fwd+bwd % peak"] if peak_tflops else [])
    body = [table_cells(r, peak_tflops) for r in rows]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep] + [line(c) for c in body])


def _pyplot():
    """matplotlib.pyplot (file-only backend); SystemExit with an install hint if it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'jax_flash_metal[plot]' "
                         "(or pip install matplotlib)") from None
    return plt


def plot(rows: list[Row], path: str) -> None:
    """Save forward+backward time and temporary memory against sequence length to ``path``.

    Raises SystemExit with an install hint if matplotlib is missing.
    """
    plt = _pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = sorted({(r.method, r.head_dim, r.causal) for r in rows})
    for color, (method, head_dim, causal) in enumerate(series):
        pts = [r for r in rows if (r.method, r.head_dim, r.causal) == (method, head_dim, causal)]
        label = f"{method} d={head_dim}{' causal' if causal else ''}"
        timed = [r for r in pts if r.fwdbwd_ms is not None]
        if timed:
            ax_t.plot([r.seq_len for r in timed], [r.fwdbwd_ms for r in timed], "o-",
                      color=f"C{color % 10}", label=label)
        mem = [(r.seq_len, r.fwdbwd_temp) for r in pts if r.fwdbwd_temp is not None]
        if mem:
            ax_m.plot([t for t, _ in mem], [max(m, 1) / (1 << 20) for _, m in mem],
                      "o-", color=f"C{color % 10}", label=label)
    for ax, title in ((ax_t, "forward+backward time (ms)"),
                      (ax_m, "forward+backward compiled temp memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_m.legend(fontsize=7)  # every series has memory points; some have no timed ones
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    metal = "metal" in implementations.available()
    p = argparse.ArgumentParser(
        prog="python -m jax_flash_metal.benchmark",
        description="Benchmark flash_attention, reference_attention and "
                    "jax.nn.dot_product_attention.")
    p.add_argument("--seq-lens", type=_int_list, default=[256, 1024, 4096, 16384],
                   help="comma-separated sequence lengths (query = key length)")
    p.add_argument("--head-dims", type=_int_list, default=[64, 128])
    p.add_argument("--causal", choices=["both", "on", "off"], default="both")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls after one warm-up; median")
    p.add_argument("--impls", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="comma-separated methods (default all available here: "
                        + ", ".join(methods()) + ")")
    p.add_argument("--run-up-to", type=int, default=16384 if metal else 2048,
                   help="longest sequence that is run; longer ones are only compiled for memory "
                        "(default 16384 with metal, else 2048)")
    p.add_argument("--emulator-max-len", type=int, default=256,
                   help="longest sequence timed for flash:emulator (longer: memory only)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s to report percentages against (default: estimated on "
                        "Apple silicon with metal)")
    p.add_argument("--plot", metavar="PNG", help="also save a plot (needs matplotlib)")
    return p.parse_args(argv)


def main(argv=None) -> list[Row]:
    """Command-line entry point; prints the table and returns the rows."""
    args = parse_args(argv)
    if args.plot:
        _pyplot()  # fail before measuring, not after
    names = list(methods(args.impls))
    where = jax_flash_metal.devices()
    peak, gpu = args.peak_tflops, None
    if peak is None and "flash:metal" in names:
        peak, gpu = apple_gpu_peak_tflops(where["metal"])
    causal_modes = {"both": [False, True], "on": [True], "off": [False]}[args.causal]
    print(f"jax_flash_metal {jax_flash_metal.__version__}, jax {jax.__version__}, "
          f"{platform.machine()} {platform.system()}, {jax.device_count()} {jax.default_backend()} "
          f"device(s), numpy {np.__version__}")
    print("implementations: " + "; ".join(f"{k}: {v}" for k, v in where.items()))
    print(f"batch {args.batch}, heads {args.heads}/{args.kv_heads or args.heads} (q/kv), "
          f"{args.dtype}, median of {args.repeats} after 1 warm-up; lengths > {args.run_up_to} "
          f"compile-only (memory only)")
    if gpu:
        print(f"GPU: {gpu}")
    if "flash:emulator" in names:
        print(f"{EMULATOR_NOTE} (lengths <= {args.emulator_max_len}; longer: memory only)")
    print("FLOPs: forward 4*B*H*P*D, forward+backward 14*B*H*P*D, P = visible (query, key) pairs "
          "(T*T, or T*(T+1)/2 causal)")
    print(flush=True)
    rows = run_benchmark(
        seq_lens=args.seq_lens, head_dims=args.head_dims, causal_modes=causal_modes,
        method_names=names, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
        dtype=args.dtype, repeats=args.repeats, run_up_to=args.run_up_to,
        emulator_max_len=args.emulator_max_len,
        progress=lambda r: print(f"  measured {r.method} T={r.seq_len} D={r.head_dim} "
                                 f"causal={r.causal}", file=sys.stderr, flush=True))
    print(format_table(rows, peak))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot saved to {args.plot}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
