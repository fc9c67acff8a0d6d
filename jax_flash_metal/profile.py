"""Kernel profile: exact counts of every Metal kernel an attention call launches, and a roofline
model of them on named Apple GPUs.

Run ``python -m jax_flash_metal.profile --help``. The problem given by the flags runs through
``flash_attention(..., implementation="emulator")`` under ``jax.jit`` (the forward, and
``jax.vjp``'s backward for the backward pass), so the real dispatch plan decides which kernels run
with which grids. While it runs, the emulated device executes the counting variant of each kernel
(emulator/README.md, "Kernel profile") and records one profile per launch.

Measured (exact counts on the emulator): threadgroups, threads per threadgroup, static threadgroup
memory, device bytes read / written (through ``device`` pointers, at the size of each access),
threadgroup bytes, ``simdgroup_matrix`` multiply-accumulates (8x8x8 each), other simd
collectives, threadgroup barriers, scalar ``fma`` calls, and other scalar math-function calls
(exp2, max, ...; operators such as ``*`` and ``+`` are not calls and are not counted).

Analytic: useful FLOPs, 4·D per visible (query, key) pair for the forward and 10·D for the
backward as a whole (visible pairs counted exactly from causal / window / lengths with
``visibility.whole_matrix``). Of the backward's 10·D, the dK/dV kernel is credited 8·D (recomputed
scores and dP, dV, dK) and the dQ kernel 2·D; the preprocess (rowsum(dO·O)) 0.
Derived: MMA FLOPs = mma_ops · 2 · 512; executed matmul FLOPs = MMA FLOPs + 2 · scalar fma calls
(every dot product and axpy of the kernels is written with fma; other arithmetic, e.g. exp2, is
not counted); MMA share = MMA FLOPs / executed matmul FLOPs; device intensity = useful FLOPs per
device byte (read + written); ALU ops = MMA multiply-adds (512 per MMA op) + scalar fma calls +
other math calls, reported over the useful multiply-adds (useful FLOPs / 2).

Estimated (``_ext.tile_shape``, shaders/tile_shapes.h ``jfm_tile_registers``): live 32-bit
registers per thread, flagged ``!`` above ``roofline.REGISTER_BUDGET`` (spill risk).

Modelled (``tools/roofline.py``, not measured): per launch and GPU, the bound (compute / device /
threadgroup memory), the modelled time and the modelled percent of peak FLOP/s; and the
occupancy: threadgroups and simdgroups per core that fit the GPU's threadgroup memory, thread
limit and register file (``roofline.occupancy``).

``--page-size N [N ...]`` (forward only) also runs the problem with the K/V cache held as pages
of N keys (``page_table``, pages in shuffled order) and prints the device bytes each paged
forward reads next to the contiguous cache's (both with key/value lengths, which a paged call
needs): paged kernels read K and V in place through the table, so the two should agree up to
the table's own bytes.

``--variant V [V ...]`` (default 0) profiles the kernels' tile variants V
(docs/kernels.md#kernel-variants; ``all``: every distinct variant of each problem's family), one
row per launch and variant: the variant is part of the kernel name (``..._fwd_var1_...``) and its
register estimate is that variant's.

``--json PATH`` writes a JSON list with one record per launch, in launch order, with exactly the
keys of ``tools.profile_model.json_keys()``: the problem (kernel, variant: the tile variant, dtype, head_dim,
value_head_dim, batch, q_len, kv_len, heads, kv_heads, causal, alibi, dropout: the rate), the
exact counts (threadgroups, threads_per_threadgroup, threadgroup_memory_bytes,
device_bytes_read, device_bytes_written, threadgroup_bytes_read, threadgroup_bytes_written:
bytes; mma_ops, simd_ops, barriers, fma_ops, math_ops: counts as defined in emulator/README.md),
ffi_call_bytes (the table's "FFI B": host bytes the FFI handler allocated for the call the
launch belongs to, its kernels' parameter blocks and copied lengths, measured by the extension;
outside XLA's memory analysis, which counts only the buffers a custom call declares), useful_flops (analytic), registers (estimated live 32-bit registers per thread), ``model``: the
roofline MODEL, not a measurement, {GPU name: {"bound": "compute" | "device" | "threadgroup",
"seconds": modelled time, "percent_of_peak": modelled useful FLOP/s over peak FLOP/s, in
percent}}, and ``occupancy``: {GPU name: {"threadgroups", "simdgroups": per core, "limit":
"memory" | "threads" | "registers"}} (a model).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .core import contract, validation
from .tools import profile_model
from .tools.cli import (CAUSAL, HelpFormatter, add_flags, add_problem_flags,
                        check_problem_flags, emulator_on_the_host, positive_int, progress_bar)
from .tools.profile_model import (NO_COUNTING_MESSAGE, PASSES, Problem, json_keys,
                                  problem_variants, profile_records, variant_records)
from .tools.profile_tables import format_paged_table, format_tables
from .tools.roofline import GPUS

def _window(text):
    """"W" -> (W, W); "L,R" -> (L, R); an empty side ("L," or ",R") is unbounded (None), as
    flash_attention's local_window_size takes it."""
    parts = text.split(",")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"expected W or LEFT,RIGHT, got {text!r}")
    try:
        bounds = [None if p == "" else int(p) for p in parts]
        left, right = validation.check_window(bounds[0] if len(bounds) == 1 else tuple(bounds))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"bad window {text!r}: {e}") from None
    return tuple(None if b == contract.UNBOUNDED else b for b in (left, right))


def _length(text):
    """An argparse type: an int >= 0 (a sequence may be empty)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"lengths must be >= 0, got {text}")
    return value


def _rate(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a rate in [0, 1), got {text!r}")
    return value


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_flash_metal.profile",
        description="Exact per-launch counts of the attention kernels (MSL-on-CPU emulator, "
                    "through the real dispatch plan) and a roofline MODEL of them per Apple GPU.",
        formatter_class=HelpFormatter)
    add_flags(p, notes=dict(value_head_dim="default: each --head-dim", kv_len="default: --q-len"),
              dtype=["float16"], head_dim=[64, 128], value_head_dim=None, q_len=1024,
              kv_len=None, causal="off")
    p.add_argument("--causal-alignment", choices=("top_left", "bottom_right"), default="top_left",
                   help="alignment of the causal diagonal and the window")
    p.add_argument("--window", type=_window, default=None, metavar="W|LEFT,RIGHT",
                   help="local window (inclusive); an empty side is unbounded (default: none)")
    p.add_argument("--q-lengths", nargs="+", type=_length, default=None, metavar="N",
                   help="valid query length per batch entry (default: all of --q-len)")
    p.add_argument("--kv-lengths", nargs="+", type=_length, default=None, metavar="N",
                   help="valid key/value length per batch entry (default: all of --kv-len)")
    p.add_argument("--alibi", action="store_true",
                   help="ALiBi with BLOOM's slopes 2^(-8n/heads); the backward also forms the "
                        "slopes' gradient")
    p.add_argument("--dropout", type=_rate, default=0.0, metavar="RATE",
                   help="attention dropout rate (a fixed key from --seed; 0: none)")
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES),
                   help="which kernels to run: the forward's and/or the backward's")
    p.add_argument("--page-size", nargs="+", type=positive_int, default=None, metavar="N",
                   help="also run the forward on the K/V cache as pages of N keys and compare "
                        "its device bytes read with the contiguous cache's (forward only)")
    p.add_argument("--variant", nargs="+", default=["0"], metavar="V",
                   help="tile variants to profile (docs/kernels.md#kernel-variants): indices "
                        "(default: 0), or 'all': every distinct variant of each problem's family")
    p.add_argument("--gpu", nargs="+", choices=list(GPUS), default=list(GPUS),
                   metavar="GPU", help=f"GPUs of the roofline model: {', '.join(GPUS)}")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write one JSON record per launch to PATH")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    add_problem_flags(p, heads=4)
    return p


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    check_problem_flags(parser, args)
    for name in ("q_lengths", "kv_lengths"):
        values = getattr(args, name)
        if values is not None and len(values) != args.batch:
            parser.error(f"--{name.replace('_', '-')} needs {args.batch} values (--batch), got "
                         f"{len(values)}")
    if args.page_size and args.passes != ["forward"]:
        parser.error("--page-size needs --passes forward (a paged cache is forward only)")
    if args.page_size and args.kv_lengths is None:  # a paged call has them: so has its baseline
        args.kv_lengths = [args.kv_len or args.q_len] * args.batch
    emulator_on_the_host()
    problems = [Problem(args, d, h, c) for d in args.dtype for h in args.head_dim
                for c in CAUSAL[args.causal]]
    page_sizes = args.page_size or ()
    for problem in problems + [p.paged(n) for p in problems for n in page_sizes]:
        try:
            problem.check()
        except (TypeError, ValueError, NotImplementedError) as e:
            parser.error(f"--dtype {problem.dtype} --head-dim {problem.head_dim} "
                         f"--value-head-dim {problem.value_head_dim}: {e}")
    if not profile_model._ext().emulator.has_counting_variant():
        parser.error(NO_COUNTING_MESSAGE)
    chosen = {}
    for problem in problems:
        listed = problem_variants(problem)
        asked = listed if args.variant == ["all"] else args.variant
        if not all(str(v).isdigit() and int(v) in listed for v in asked):
            parser.error(f"--variant {' '.join(args.variant)}: the variants of --dtype "
                         f"{problem.dtype} --head-dim {problem.head_dim} are {listed} (or 'all')")
        chosen[id(problem)] = [int(v) for v in asked]
    records = []
    bar = progress_bar(sum(map(len, chosen.values())) * len(args.passes), "profile",
                       enabled=not args.no_progress)
    try:
        for problem in problems:
            start, new = time.perf_counter(), []
            for variant in chosen[id(problem)]:
                for pass_name in (p for p in PASSES if p in args.passes):
                    bar.set_postfix_str(f"{problem.dtype} D={problem.dims()} variant {variant} "
                                        f"{pass_name}")
                    new += variant_records(problem, (pass_name,), args.gpu, variant)
                    bar.update(1)
            for n in page_sizes:
                runs = profile_records(problem.paged(n), ("forward",), args.gpu)
                new += [dict(r, **{"pass": f"paged{n}"}) for r in runs]
            records += new
            bar.write(f"# {problem.dtype} D={problem.dims()} batch={problem.batch} "
                      f"q_len={problem.q_len} kv_len={problem.kv_len} heads={problem.heads} "
                      f"kv_heads={problem.kv_heads} causal={problem.causal} "
                      f"window={problem.window} alibi={problem.alibi} "
                      f"dropout={problem.dropout}: {len(new)} launches, "
                      f"{time.perf_counter() - start:.0f} s on the emulator", file=sys.stderr)
    finally:
        bar.close()
    print(format_tables(records, args.gpu))
    if page_sizes:
        print()
        print(format_paged_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in json_keys()} for r in records], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
