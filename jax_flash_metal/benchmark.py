"""Time and memory of flash_attention against reference_attention and jax.nn.dot_product_attention.

Run ``python -m jax_flash_metal.benchmark --help``. For each method, sequence length, head dim and
causal setting it reports:

- forward and forward+backward wall time: each jit-compiled function is called once to warm up,
  then ``--repeats`` rounds call every method once in turn (interleaved, so a change in machine
  load hits all methods alike); the median is shown. forward+backward is ``jax.vjp`` of the
  attention with a fixed random output cotangent, returning (dq, dk, dv).
- compile time of forward+backward: wall time of ``jax.jit(...).lower(...).compile()``, the
  median of ``--compile-rounds`` rounds that each compile every method once (interleaved, like
  the timed calls; the median also drops the one-time cost of the process's first compilations).
- compiled temporary memory: ``memory_analysis().temp_size_in_bytes`` of the compiled function
  (XLA's scratch space beyond inputs and outputs), i.e. what the score matrix costs.
- decode rows (``--decode-kv-lens``, seq shown as ``1xN``): one query against N cached keys, as
  in sampling with a KV cache; the fused implementations run the split-KV decode kernels.
- achieved TFLOP/s from model FLOPs (same count for every method, see ``attention_flops``), and on
  Apple silicon with the metal implementation the percentage of the GPU's estimated peak
  (``apple_gpu_peak_tflops``, from ``roofline.GPUS``).
- flash:metal rows also get GPU time: per timed call, the GPU seconds of its Metal command
  buffers (``MTLCommandBuffer`` ``GPUEndTime - GPUStartTime``, read from the extension's
  process-wide total before and after the call); the median is shown with the TFLOP/s from it.
  The percentage of peak is taken from the GPU time where it was measured, else the wall time.

The table shows only the columns with a value in some row (the GPU columns exist only where
flash:metal runs). After it come, for ``--ratio-method`` (default flash:xla) against jax.nn, the
ratios of forward+backward time, compile time and temporary memory per configuration, and how
each method's forward+backward temporary memory grows from one length to the next (one row per
method, head dim and causal setting). ``--json PATH`` writes all of it (and the environment, and
every column) as JSON. A progress bar (tqdm, on stderr) counts the compiles and timed rounds.

Lengths above ``--run-up-to`` are only compiled (memory column filled, times shown as "-"), so the
memory of long sequences is reported without running them. The "emulator" implementation
interprets the Metal kernels on the CPU: it is slow by design and timed only up to the
query-key pairs of ``--emulator-max-len`` (more: memory only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import textwrap

import jax
import numpy as np

import jax_flash_metal
from jax_flash_metal import implementations
from jax_flash_metal.tools.benchmark_model import (NOISY_NOTE, Row, apple_gpu_peak_tflops,
                                                   methods, run_benchmark, system_gpu_cores)
from jax_flash_metal.tools.benchmark_tables import (MEMORY_NOTE, _pyplot, format_growth,
                                                    format_ratios, format_table, memory_growth,
                                                    plot, ratios)
from jax_flash_metal.tools.cli import (CAUSAL, WIDTH, HelpFormatter, add_flags,
                                       add_problem_flags, check_problem_flags, count,
                                       positive_int, progress_bar)

EMULATOR_NOTE = ("flash:emulator runs the Metal kernels in the MSL-on-CPU emulator: slow by design "
                 "(it exists to test the kernels without a Mac), so it is timed only at small "
                 "sizes")


def parse_args(argv=None) -> argparse.Namespace:
    metal = "metal" in implementations.available()
    p = argparse.ArgumentParser(
        prog="python -m jax_flash_metal.benchmark",
        description="Benchmark flash_attention, reference_attention and "
                    "jax.nn.dot_product_attention. The defaults take a few minutes on 2 CPU "
                    "cores.",
        formatter_class=HelpFormatter)
    p.add_argument("--decode-kv-lens", nargs="*", type=positive_int, default=[2048], metavar="N",
                   help="KV-cache lengths of the decode rows (1 query against each; shown as "
                        "seq 1xN); none for no decode rows")
    add_flags(p, notes=dict(lengths="query = key length"), lengths=[256, 1024, 4096, 16384],
              head_dim=[64], causal="both", dtype=["float32"], repeats=5)
    add_problem_flags(p, heads=8)
    p.add_argument("--compile-rounds", type=positive_int, default=3,
                   help="forward+backward compiles per method, interleaved; median")
    p.add_argument("--impls", nargs="+", default=None, metavar="METHOD",
                   help="methods (default: all available here: " + ", ".join(methods()) + ")")
    p.add_argument("--run-up-to", type=int, default=16384 if metal else 2048,
                   help="longest sequence that is run; longer ones are only compiled for memory "
                        "(16384 where metal runs, else 2048)")
    p.add_argument("--emulator-max-len", type=int, default=256,
                   help="flash:emulator is timed up to this length's query-key pairs (N x N; a "
                        "decode row 1 x N*N); larger: memory only")
    p.add_argument("--peak-tflops", type=_positive_float, default=None,
                   help="peak TFLOP/s to report percentages against (default: estimated on "
                        "Apple silicon with metal, none elsewhere)")
    p.add_argument("--ratio-method", default="flash:xla",
                   help="method whose ratios to jax.nn are printed")
    p.add_argument("--json", metavar="PATH", help="also write rows, ratios and environment as JSON")
    p.add_argument("--plot", metavar="PNG", help="also save a plot (needs matplotlib)")
    args = p.parse_args(argv)
    check_problem_flags(p, args)
    try:
        methods(args.impls)
    except ValueError as e:
        p.error(f"--impls: {e}")
    if args.ratio_method not in methods():
        p.error(f"--ratio-method: {args.ratio_method!r} is not one of {', '.join(methods())}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json: no folder {os.path.dirname(os.path.abspath(args.json))}")
    return args


def _positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def main(argv=None) -> list[Row]:
    """Command-line entry point; prints the table and returns the rows."""
    args = parse_args(argv)
    if args.plot:
        _pyplot()  # fail before measuring, not after
    names = list(methods(args.impls))
    where = jax_flash_metal.devices()
    peak, gpu = args.peak_tflops, None
    if peak is None and "flash:metal" in names:
        peak, gpu = apple_gpu_peak_tflops(where["metal"], system_gpu_cores())
    environment = (f"jax_flash_metal {jax_flash_metal.__version__}, jax {jax.__version__}, "
                   f"{platform.machine()} {platform.system()}, {jax.device_count()} "
                   f"{jax.default_backend()} device(s), numpy {np.__version__}")
    print(environment)
    print(textwrap.fill("implementations: " + "; ".join(f"{k}: {v}" for k, v in where.items()),
                        WIDTH))
    print(textwrap.fill(
        f"batch {args.batch}, heads {args.heads}/{args.kv_heads} (q/kv), "
        f"{', '.join(args.dtype)}, median of {args.repeats} (up to {3 * args.repeats} while "
        f"noisy) after 1 warm-up; compile time median of "
        f"{count(args.compile_rounds, 'round')}; lengths > {args.run_up_to} compile-only "
        f"(memory only)", WIDTH))
    if gpu:
        print(f"GPU: {gpu}")
    if "flash:metal" in names:
        print(textwrap.fill("GPU ms: flash:metal's Metal command buffers (GPUEndTime - "
                            "GPUStartTime), median per call; % peak from GPU time where "
                            "measured, else wall time", WIDTH))
    if "flash:emulator" in names:
        print(textwrap.fill(f"{EMULATOR_NOTE} (up to {args.emulator_max_len} x "
                            f"{args.emulator_max_len} query-key pairs; larger: memory only)",
                            WIDTH))
    print(textwrap.fill("FLOPs: forward 4*B*H*P*D, forward+backward 14*B*H*P*D, P = visible "
                        "(query, key) pairs (T*T, or T*(T+1)/2 causal)", WIDTH))
    print(flush=True)
    rows, entries, dropout, growth = [], [], [], []
    for dtype in args.dtype:
        part = _measure(args, names, dtype)
        rows += part
        if len(args.dtype) > 1:
            print(f"{dtype}:")
        tables = _print_tables(part, peak, args.ratio_method)
        entries += [dict(e, dtype=dtype) for e in tables[0]]
        dropout += [dict(e, dtype=dtype) for e in tables[1]]
        growth += [dict(e, dtype=dtype) for e in tables[2]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=environment, devices=where, batch=args.batch,
                           heads=args.heads, kv_heads=args.kv_heads or args.heads,
                           dtypes=args.dtype, repeats=args.repeats,
                           rows=[dataclasses.asdict(r) for r in rows], ratios=entries,
                           dropout_ratios=dropout,
                           memory_growth=growth), f, indent=1)
        print(f"JSON written to {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot saved to {args.plot}")
    return rows


def _measure(args, names, dtype) -> list[Row]:
    bar = progress_bar(0, f"benchmark {dtype}", enabled=not args.no_progress)
    try:
        return run_benchmark(
            seq_lens=args.lengths, head_dims=args.head_dim, causal_modes=CAUSAL[args.causal],
            method_names=names, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
            dtype=dtype, repeats=args.repeats, run_up_to=args.run_up_to,
            emulator_max_len=args.emulator_max_len, decode_kv_lens=args.decode_kv_lens,
            compile_rounds=args.compile_rounds, bar=bar)
    finally:
        bar.close()


def _print_tables(rows, peak, ratio_method) -> tuple[list[dict], list[dict], list[dict]]:
    """Prints the rows of one dtype and their ratio and growth tables; returns those three."""
    print(format_table(rows, peak))
    print(textwrap.fill(MEMORY_NOTE, WIDTH))
    if any(r.noisy for r in rows):
        print(textwrap.fill(NOISY_NOTE, WIDTH))
    entries = ratios(rows, ratio_method)
    dropout = ratios(rows, "flash:xla+dropout", "flash:xla")
    growth = memory_growth(rows)
    if entries:
        print()
        print(format_ratios(entries, ratio_method, "jax.nn"))
    if dropout:
        print()
        print(format_ratios(dropout, "flash:xla+dropout", "flash:xla"))
    if growth:
        print()
        print(format_growth(growth))
    return entries, dropout, growth


if __name__ == "__main__":
    main(sys.argv[1:])
