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
import platform
import re
import statistics
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash_metal
from jax_flash_metal import flash_attention, implementations, reference_attention, roofline
from jax_flash_metal._cli import (WIDTH, HelpFormatter, aligned, count, progress_bar,
                                  split_columns)
from jax_flash_metal._extras import install_hint

EMULATOR_NOTE = ("flash:emulator runs the Metal kernels in the MSL-on-CPU emulator: slow by design "
                 "(it exists to test the kernels without a Mac), so it is timed only at small "
                 "sizes")


def methods(impls: list[str] | None = None) -> dict:
    """Benchmarked attention functions by name: ``flash:<implementation>`` for each available
    implementation, ``flash:xla+dropout`` (the xla implementation with attention dropout at
    rate 0.1, a fixed key: its cost next to the plain call's), ``reference`` and ``jax.nn``.
    Each maps (q, k, v, is_causal) -> out.

    ``impls`` selects and orders them; an unknown or unavailable name raises ValueError.
    """
    table = {}
    for impl in implementations.available():
        table[f"flash:{impl}"] = (lambda impl: lambda q, k, v, causal: flash_attention(
            q, k, v, is_causal=causal, implementation=impl))(impl)
        if impl == "xla":
            table["flash:xla+dropout"] = lambda q, k, v, causal: flash_attention(
                q, k, v, is_causal=causal, implementation="xla", dropout_rate=0.1,
                dropout_rng=jax.random.key(0))
    table["reference"] = lambda q, k, v, causal: reference_attention(q, k, v, is_causal=causal)
    # jax.nn's XLA path on every platform (None could pick cuDNN on a GPU).
    table["jax.nn"] = lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla")
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


def system_gpu_cores() -> int | None:
    """The GPU core count ``system_profiler`` reports (macOS), or None where it cannot be read."""
    try:
        info = subprocess.run(["system_profiler", "SPDisplaysDataType"], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    cores = re.search(r"Total Number of Cores:\s*(\d+)", info)
    return int(cores.group(1)) if cores else None


def apple_gpu_peak_tflops(gpu_name: str, cores: int | None) -> tuple[float | None, str]:
    """(estimated peak FP32 TFLOP/s, description) of the Apple GPU named ``gpu_name`` (as reported
    by ``jax_flash_metal.devices()["metal"]``, e.g. "Apple M2 Pro") with ``cores`` GPU cores
    (``system_gpu_cores()``; None = not known), or (None, reason).

    Peak = cores x 128 ALUs x 2 (FMA) x clock, the clock from ``roofline.GPUS``: the entry of that
    chip ("Apple M1 Max" -> "M1 Max"), else of its generation's first entry (e.g. M2 Pro -> the
    M2 Max clock, said in the description). Without ``cores`` the table's core count (largest
    configuration) is used for a chip in the table; for another chip the peak is unknown.
    """
    chip = re.match(r"Apple (M\d+)\b(.*)$", gpu_name)
    if not chip:
        return None, f"{gpu_name}: not an Apple M-series GPU, peak unknown (pass --peak-tflops)"
    name = f"{chip.group(1)}{chip.group(2).rstrip()}"
    gpu = roofline.GPUS.get(name)
    note = ""
    if gpu is None:
        gpu = next((g for g in roofline.GPUS.values() if g.name.split()[0] == chip.group(1)), None)
        if gpu is None or cores is None:
            return None, f"{gpu_name}: peak unknown (pass --peak-tflops)"
        note = f", {gpu.name} clock assumed"
    n = gpu.cores if cores is None else cores
    source = "" if cores is not None else " (largest configuration)"
    peak = gpu.peak_flops * n / gpu.cores / 1e12
    return peak, (f"{gpu_name}, {n} GPU cores{source}, {gpu.clock_ghz} GHz{note}, estimated peak "
                  f"{peak:.1f} TFLOP/s FP32")


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
    compile_s: float | None = None
    q_len: int | None = None  # decode rows: q_len queries against seq_len keys (else q = seq_len)
    fwd_gpu_ms: float | None = None  # flash:metal only: median GPU time of the timed calls
    fwdbwd_gpu_ms: float | None = None
    noisy: bool = False  # NOISY_NOTE


def _temp_bytes(compiled) -> int | None:
    """Compiled temporary memory, or None where this JAX/backend does not report it."""
    try:
        stats = compiled.memory_analysis()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    return None if stats is None else int(stats.temp_size_in_bytes)


def _call_s(compiled, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start


def inputs(*, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, dtype,
           seed: int = 0, q_len: int | None = None):
    """Random q [batch, q_len (default seq_len), heads, head_dim], k/v [batch, seq_len,
    kv_heads, head_dim] and an output cotangent like q, in ``dtype``."""
    kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (batch, q_len or seq_len, heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, seq_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (batch, seq_len, kv_heads, head_dim), dtype)
    return q, k, v, jax.random.normal(kc, q.shape, dtype)


def _forward_backward(fn, causal: bool):
    def forward(q, k, v):
        return fn(q, k, v, causal)

    def forward_backward(q, k, v, ct):
        return jax.vjp(forward, q, k, v)[1](ct)

    return forward, forward_backward


def compile_seconds(fn, causal: bool, q, k, v, ct) -> tuple[object, float]:
    """(compiled forward+backward, wall seconds of ``jax.jit(...).lower(...).compile()``); a
    fresh ``jax.jit`` each call, so nothing is reused from an earlier compile of it."""
    start = time.perf_counter()
    compiled = jax.jit(_forward_backward(fn, causal)[1]).lower(q, k, v, ct).compile()
    return compiled, time.perf_counter() - start


def compile_pair(fn, causal: bool, q, k, v, ct):
    """(compiled forward, compiled forward+backward, forward+backward compile seconds)."""
    fwd = jax.jit(_forward_backward(fn, causal)[0]).lower(q, k, v).compile()
    return (fwd, *compile_seconds(fn, causal, q, k, v, ct))


def metal_gpu_seconds() -> float:
    """The Metal device's process-wide GPU seconds so far (``_ext.gpu_seconds_total``)."""
    from jax_flash_metal import _ext  # the native extension: only imported where metal runs
    return _ext.gpu_seconds_total("metal")


# Timings whose interquartile range stays above this share of the median are marked noisy.
NOISE = 0.1
NOISY_NOTE = (f"noisy: after 3 x --repeats rounds the times' interquartile range was still over "
              f"{NOISE:.0%} of the median, or forward took longer than forward+backward (machine "
              f"load); rerun on a quieter machine before trusting that row")


def _spread(times: list[float]) -> float:
    """Interquartile range over median."""
    q1, median, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times * 3)
    return (q3 - q1) / median if median else 0.0


def time_interleaved(compiled: dict, args: dict, repeats: int,
                     gpu_timers: dict | None = None, on_round=None) -> tuple[dict, dict, set]:
    """(wall ms, GPU ms, noisy names): median milliseconds per name of
    ``compiled[name](*args[name])``: one warm-up call each, then ``repeats`` rounds that call
    every function once in turn, and more rounds (up to 3 x ``repeats`` in all) while some
    name's times spread over more than NOISE of their median; the names still spread so are
    returned as noisy.

    ``gpu_timers`` maps some names to a function returning cumulative GPU seconds (e.g.
    ``metal_gpu_seconds``); for those, the GPU ms are the median of its increase over each timed
    call. Names without a timer are not in the GPU ms dict. ``on_round``, if given, is called
    after the warm-up and after each round.
    """
    gpu_timers = gpu_timers or {}
    on_round = on_round or (lambda: None)
    for name, fn in compiled.items():
        jax.block_until_ready(fn(*args[name]))
    on_round()
    times: dict[str, list[float]] = {name: [] for name in compiled}
    gpu: dict[str, list[float]] = {name: [] for name in compiled if name in gpu_timers}
    def noisy():
        return {name for name, t in times.items() if _spread(t) > NOISE}

    for done in range(3 * repeats):
        if done >= repeats and not noisy():
            break
        for name, fn in compiled.items():
            timer = gpu_timers.get(name)
            before = timer() if timer else 0.0
            times[name].append(_call_s(fn, args[name]))
            if timer:
                gpu[name].append(timer() - before)
        on_round()

    def median_ms(series):
        return {name: 1e3 * statistics.median(t) for name, t in series.items()}
    return median_ms(times), median_ms(gpu), noisy()


def is_timed(method: str, seq_len: int, q_len: int | None, run_up_to: int,
             emulator_max_len: int) -> bool:
    """Whether a (method, point) is run and timed, not only compiled: kv length <= ``run_up_to``;
    for flash:emulator also at most the query-key pairs of length ``emulator_max_len`` (a decode
    row of 1 x 2048 is 2048 pairs, less than 256 x 256)."""
    if seq_len > run_up_to:
        return False
    return method != "flash:emulator" or (q_len or seq_len) * seq_len <= emulator_max_len ** 2


def run_benchmark(*, seq_lens, head_dims, causal_modes, method_names=None, batch=1, heads=8,
                  kv_heads=None, dtype="float32", repeats=5, run_up_to=2048,
                  emulator_max_len=256, bar=None, decode_kv_lens=(),
                  decode_q_len=1, gpu_timers=None, compile_rounds=1) -> list[Row]:
    """Measure every (method, head_dim, causal, seq_len), then every (method, head_dim, kv_len
    of ``decode_kv_lens``) with ``decode_q_len`` queries; returns the rows in that order.

    The methods of one (head_dim, causal, seq_len) are timed interleaved (``time_interleaved``).
    Points ``is_timed`` rejects are only compiled: their rows have memory and compile time but
    no times.

    ``bar``, if given, is a progress bar (``tqdm``-like: ``total``, ``update``,
    ``set_postfix_str``); its total is set here to the number of steps (each compile and each
    timed round). ``gpu_timers`` maps method names to cumulative GPU-seconds functions
    (``time_interleaved``); default: ``metal_gpu_seconds`` for flash:metal when it is
    benchmarked. The compile time is the median of ``compile_rounds`` rounds that compile every
    method's forward+backward once.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    table = methods(method_names)
    if gpu_timers is None:
        gpu_timers = {"flash:metal": metal_gpu_seconds} if "flash:metal" in table else {}
    rows = {}
    # Square points, then decode points: decode_q_len new queries against a cache of kv_len
    # keys, all visible (what causal bottom-right alignment gives the newest rows); the fused
    # kernels take the split-KV path.
    points = [(d, c, t, None) for d in head_dims for c in causal_modes for t in seq_lens]
    points += [(d, False, t, decode_q_len) for d in head_dims for t in decode_kv_lens]

    def timed_here(name, seq_len, q_len):
        return is_timed(name, seq_len, q_len, run_up_to, emulator_max_len)

    def steps(seq_len, q_len):
        timed = any(timed_here(name, seq_len, q_len) for name in table)
        return len(table) * compile_rounds + (repeats + 1) * timed

    if bar is not None:
        bar.total = sum(steps(t, q) for _, _, t, q in points)
        if hasattr(bar, "refresh"):
            bar.refresh()
    step = (lambda: None) if bar is None else (lambda: bar.update(1))

    def measure_point(head_dim, causal, seq_len, q_len):
        """Every method at one point, timed interleaved; q_len None = seq_len (square)."""
        q, k, v, ct = inputs(batch=batch, seq_len=seq_len, heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=jnp.dtype(dtype), q_len=q_len)
        if bar is not None:
            shape = f"seq {seq_len}" if q_len is None else f"decode {q_len}x{seq_len}"
            bar.set_postfix_str(f"{shape} hdim {head_dim}{' causal' if causal else ''}")
        compiled, timed, timers = {}, {}, {}
        for name, fn in table.items():
            compiled[name] = compile_pair(fn, causal, q, k, v, ct)
            step()
        # More compile rounds, every method once per round; the median drops the one-time cost
        # of a process's first compilations, which would fall on whichever method comes first.
        compile_s = {name: [compiled[name][2]] for name in table}
        for _ in range(compile_rounds - 1):
            for name, fn in table.items():
                compile_s[name].append(compile_seconds(fn, causal, q, k, v, ct)[1])
                step()
        for name, fn in table.items():
            compiled[name] = (*compiled[name][:2], statistics.median(compile_s[name]))
            if timed_here(name, seq_len, q_len):
                for part, call in ((" fwd", compiled[name][0]), (" fwd+bwd", compiled[name][1])):
                    timed[name + part] = call
                    if name in gpu_timers:
                        timers[name + part] = gpu_timers[name]
        ms, gpu_ms, noisy = {}, {}, set()
        if timed:
            ms, gpu_ms, noisy = time_interleaved(
                timed, {n: (q, k, v) if n.endswith(" fwd") else (q, k, v, ct) for n in timed},
                repeats, timers, on_round=step)
        flops = attention_flops(batch, heads, q_len or seq_len, seq_len, head_dim, causal)
        for name, (fwd, fwdbwd, compile_s) in compiled.items():
            rows[name, head_dim, causal, seq_len, q_len] = Row(
                name, seq_len, head_dim, causal, ms.get(name + " fwd"),
                ms.get(name + " fwd+bwd"), _temp_bytes(fwd), _temp_bytes(fwdbwd), *flops,
                compile_s, q_len=q_len, fwd_gpu_ms=gpu_ms.get(name + " fwd"),
                fwdbwd_gpu_ms=gpu_ms.get(name + " fwd+bwd"),
                noisy=bool({name + " fwd", name + " fwd+bwd"} & noisy)
                or ms.get(name + " fwd", 0) > ms.get(name + " fwd+bwd", float("inf")))

    for point in points:
        measure_point(*point)
    square = [rows[m, d, c, t, None] for m in table for d in head_dims for c in causal_modes
              for t in seq_lens]
    return square + [rows[m, d, False, t, decode_q_len] for m in table for d in head_dims
                     for t in decode_kv_lens]


def ratios(rows: list[Row], method: str = "flash:xla", baseline: str = "jax.nn") -> list[dict]:
    """Per (seq_len, head_dim, causal) measured for both: ``method`` / ``baseline`` ratios of
    forward+backward time, compile time and forward+backward temporary memory (None where
    either side was not measured)."""
    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    rows = [r for r in rows if r.q_len is None]  # the decode rows are compared nowhere
    base = {(r.seq_len, r.head_dim, r.causal): r for r in rows if r.method == baseline}
    out = []
    for r in rows:
        b = base.get((r.seq_len, r.head_dim, r.causal))
        if r.method != method or b is None:
            continue
        out.append(dict(seq_len=r.seq_len, head_dim=r.head_dim, causal=r.causal,
                        fwdbwd_time=ratio(r.fwdbwd_ms, b.fwdbwd_ms),
                        compile_time=ratio(r.compile_s, b.compile_s),
                        fwdbwd_temp=ratio(r.fwdbwd_temp, b.fwdbwd_temp)))
    return out


def memory_growth(rows: list[Row]) -> list[dict]:
    """Forward+backward temporary memory at each length divided by that at the previous
    length, per (method, head_dim, causal)."""
    out = []
    series: dict[tuple, list[Row]] = {}
    for r in (r for r in rows if r.q_len is None):  # the decode rows are not a length sweep
        series.setdefault((r.method, r.head_dim, r.causal), []).append(r)
    for (method, head_dim, causal), pts in series.items():
        pts = sorted(pts, key=lambda r: r.seq_len)
        for a, b in zip(pts, pts[1:]):
            if a.fwdbwd_temp and b.fwdbwd_temp is not None:
                out.append(dict(method=method, head_dim=head_dim, causal=causal,
                                from_len=a.seq_len, to_len=b.seq_len,
                                growth=b.fwdbwd_temp / a.fwdbwd_temp))
    return out


def format_ratios(entries: list[dict], method: str, baseline: str) -> str:
    """``ratios`` output as a table."""
    body = [[str(e["seq_len"]), str(e["head_dim"]), "yes" if e["causal"] else "no",
             _fmt(e["fwdbwd_time"], ".2f"), _fmt(e["compile_time"], ".2f"),
             _fmt(e["fwdbwd_temp"], ".3f")] for e in entries]
    return (f"{method} / {baseline} (forward+backward; < 1 means {method} is faster/smaller):\n"
            + aligned(["seq", "hdim", "causal", "time", "compile", "temp"], body, left=0))


def format_growth(entries: list[dict]) -> str:
    """``memory_growth`` output: one row per (method, head dim, causal), one column per step
    between consecutive lengths."""
    steps = sorted({(e["from_len"], e["to_len"]) for e in entries})
    series: dict[tuple, dict] = {}
    for e in entries:
        key = (e["method"], e["head_dim"], e["causal"])
        series.setdefault(key, {})[e["from_len"], e["to_len"]] = e["growth"]
    body = [[m, str(d), "yes" if c else "no"] + [_fmt(g.get(st), ".2f") for st in steps]
            for (m, d, c), g in series.items()]
    return ("forward+backward temporary memory growth (x) from one length to the next:\n"
            + aligned(["method", "hdim", "causal"] + [f"{a}->{b}" for a, b in steps], body))


# Printed tables repeat these columns in each part that fits WIDTH (split_columns).
KEY_COLUMNS = 4
MEMORY_NOTE = ("temp MiB: XLA's compiled temporaries (memory_analysis().temp_size_in_bytes), "
               "beyond inputs and outputs. For flash:metal and flash:emulator that is the "
               "buffers their custom calls declare (e.g. the decode's workspace); what the FFI "
               "handler itself uses (threadgroup memory, Metal staging copies) is outside XLA "
               "and not counted here.")
COLUMNS = ("method", "seq", "hdim", "causal", "fwd ms", "fwd+bwd ms", "fwd temp MiB",
           "fwd+bwd temp MiB", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "compile s", "fwd GPU ms",
           "fwd+bwd GPU ms", "fwd GPU TFLOP/s", "fwd+bwd GPU TFLOP/s", "timing")


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _tflops(flops: int, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def table_cells(row: Row, peak_tflops: float | None = None) -> list[str]:
    """The text cells of one row, in COLUMNS order (plus "% peak" cells when a peak is given:
    of the GPU-time TFLOP/s where measured, else of the wall-time TFLOP/s)."""
    fwd_tf, fb_tf = _tflops(row.fwd_flops, row.fwd_ms), _tflops(row.fwdbwd_flops, row.fwdbwd_ms)
    fwd_gpu_tf = _tflops(row.fwd_flops, row.fwd_gpu_ms)
    fb_gpu_tf = _tflops(row.fwdbwd_flops, row.fwdbwd_gpu_ms)
    mib = 1 << 20
    seq = str(row.seq_len) if row.q_len is None else f"{row.q_len}x{row.seq_len}"
    cells = [row.method, seq, str(row.head_dim), "yes" if row.causal else "no",
             _fmt(row.fwd_ms, ".2f"), _fmt(row.fwdbwd_ms, ".2f"),
             _fmt(None if row.fwd_temp is None else row.fwd_temp / mib, ".1f"),
             _fmt(None if row.fwdbwd_temp is None else row.fwdbwd_temp / mib, ".1f"),
             _fmt(fwd_tf, ".3g"), _fmt(fb_tf, ".3g"), _fmt(row.compile_s, ".2f"),
             _fmt(row.fwd_gpu_ms, ".3f"), _fmt(row.fwdbwd_gpu_ms, ".3f"),
             _fmt(fwd_gpu_tf, ".3g"), _fmt(fb_gpu_tf, ".3g")]
    if peak_tflops:
        for gpu_tf, wall_tf in ((fwd_gpu_tf, fwd_tf), (fb_gpu_tf, fb_tf)):
            tf = gpu_tf if gpu_tf is not None else wall_tf
            cells.append(_fmt(None if tf is None else 100 * tf / peak_tflops, ".1f"))
    return cells + ["noisy" if row.noisy else "-"]


def format_table(rows: list[Row], peak_tflops: float | None = None, width: int = WIDTH) -> str:
    """Aligned plain-text table of ``rows`` (``aligned``), split into tables of at most
    ``width`` columns that each repeat the KEY_COLUMNS (``split_columns``). Columns without a
    value in any row are left out (e.g. the GPU-time columns off a Mac: they are measured for
    flash:metal only); ``--json`` keeps every field."""
    header = (list(COLUMNS[:-1]) + (["fwd % peak", "fwd+bwd % peak"] if peak_tflops else [])
              + [COLUMNS[-1]])
    body = [table_cells(r, peak_tflops) for r in rows]
    keep = [i for i in range(len(header)) if any(line[i] != "-" for line in body)] \
        if body else list(range(len(header)))
    parts = split_columns([header[i] for i in keep], [[line[i] for i in keep] for line in body],
                          KEY_COLUMNS, width)
    return "\n\n".join(aligned(h, b) for h, b in parts)


def _pyplot():
    """matplotlib.pyplot (file-only backend); SystemExit with an install hint if it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"--plot needs matplotlib, which is not installed; install the [plot] "
                         f"extra, {install_hint('plot')}") from None
    return plt


def plot(rows: list[Row], path: str) -> None:
    """Save to ``path``: forward+backward time and temporary memory against sequence length
    (square rows), and forward time against the KV-cache length (decode rows, if any); one
    legend below the panels, outside the data.

    Raises SystemExit with an install hint if matplotlib is missing.
    """
    plt = _pyplot()
    decode = [r for r in rows if r.q_len is not None and r.fwd_ms is not None]
    rows = [r for r in rows if r.q_len is None]
    panels = 3 if decode else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    ax_t, ax_m = axes[:2]
    series = sorted({(r.method, r.head_dim, r.causal) for r in rows + decode})
    for color, (method, head_dim, causal) in enumerate(series):
        style = dict(color=f"C{color % 10}", label=f"{method} d={head_dim}"
                     f"{' causal' if causal else ''}")
        pts = [r for r in rows if (r.method, r.head_dim, r.causal) == (method, head_dim, causal)]
        timed = [r for r in pts if r.fwdbwd_ms is not None]
        if timed:
            ax_t.plot([r.seq_len for r in timed], [r.fwdbwd_ms for r in timed], "o-", **style)
        mem = [(r.seq_len, r.fwdbwd_temp) for r in pts if r.fwdbwd_temp is not None]
        if mem:
            ax_m.plot([t for t, _ in mem], [max(m, 1) / (1 << 20) for _, m in mem], "o-",
                      **style)
        dec = [r for r in decode if (r.method, r.head_dim, r.causal) == (method, head_dim,
                                                                          causal)]
        if dec:
            axes[2].plot([r.seq_len for r in dec], [r.fwd_ms for r in dec], "s--", **style)
    titles = [(ax_t, "forward+backward time (ms)", "sequence length"),
              (ax_m, "forward+backward compiled temp memory (MiB)", "sequence length")]
    if decode:
        titles.append((axes[2], f"decode forward time (ms), {decode[0].q_len} query",
                       "KV-cache length"))
    for ax, title, xlabel in titles:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    # One legend for every panel, below them: it never covers a point.
    handles: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="lower center", fontsize=7,
               ncol=min(4, len(handles)), frameon=False)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(handles) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=120)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    metal = "metal" in implementations.available()
    p = argparse.ArgumentParser(
        prog="python -m jax_flash_metal.benchmark",
        description="Benchmark flash_attention, reference_attention and "
                    "jax.nn.dot_product_attention. The defaults take a few minutes on 2 CPU "
                    "cores.",
        formatter_class=HelpFormatter)
    p.add_argument("--seq-lens", type=_int_list, default="256,1024,4096,16384",
                   help="comma-separated sequence lengths (query = key length)")
    p.add_argument("--head-dims", type=_int_list, default="64", help="comma-separated head dims")
    p.add_argument("--decode-kv-lens", type=_int_list, default="2048",
                   help="KV-cache lengths of the decode rows (1 query against each; shown as "
                        "seq 1xN); empty for none")
    p.add_argument("--causal", choices=["both", "on", "off"], default="both",
                   help="causal masking: both settings, on or off")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="input dtype")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads (grouped-query attention) (default: --heads)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls after one warm-up; median")
    p.add_argument("--compile-rounds", type=int, default=3,
                   help="forward+backward compiles per method, interleaved; median")
    p.add_argument("--impls", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="comma-separated methods (default: all available here: "
                        + ", ".join(methods()) + ")")
    p.add_argument("--run-up-to", type=int, default=16384 if metal else 2048,
                   help="longest sequence that is run; longer ones are only compiled for memory "
                        "(16384 where metal runs, else 2048)")
    p.add_argument("--emulator-max-len", type=int, default=256,
                   help="flash:emulator is timed up to this length's query-key pairs (N x N; a "
                        "decode row 1 x N*N); larger: memory only")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s to report percentages against (default: estimated on "
                        "Apple silicon with metal, none elsewhere)")
    p.add_argument("--ratio-method", default="flash:xla",
                   help="method whose ratios to jax.nn are printed")
    p.add_argument("--json", metavar="PATH", help="also write rows, ratios and environment as JSON")
    p.add_argument("--plot", metavar="PNG", help="also save a plot (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
        peak, gpu = apple_gpu_peak_tflops(where["metal"], system_gpu_cores())
    causal_modes = {"both": [False, True], "on": [True], "off": [False]}[args.causal]
    environment = (f"jax_flash_metal {jax_flash_metal.__version__}, jax {jax.__version__}, "
                   f"{platform.machine()} {platform.system()}, {jax.device_count()} "
                   f"{jax.default_backend()} device(s), numpy {np.__version__}")
    print(environment)
    print(textwrap.fill("implementations: " + "; ".join(f"{k}: {v}" for k, v in where.items()),
                        WIDTH))
    print(textwrap.fill(
        f"batch {args.batch}, heads {args.heads}/{args.kv_heads or args.heads} (q/kv), "
        f"{args.dtype}, median of {args.repeats} (up to {3 * args.repeats} while noisy) after 1 "
        f"warm-up; compile time median of {count(args.compile_rounds, 'round')}; lengths > "
        f"{args.run_up_to} compile-only (memory only)", WIDTH))
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
    bar = progress_bar(0, "benchmark", enabled=not args.no_progress)
    try:
        rows = run_benchmark(
            seq_lens=args.seq_lens, head_dims=args.head_dims, causal_modes=causal_modes,
            method_names=names, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
            dtype=args.dtype, repeats=args.repeats, run_up_to=args.run_up_to,
            emulator_max_len=args.emulator_max_len, decode_kv_lens=args.decode_kv_lens,
            compile_rounds=args.compile_rounds, bar=bar)
    finally:
        bar.close()
    print(format_table(rows, peak))
    print(textwrap.fill(MEMORY_NOTE, WIDTH))
    if any(r.noisy for r in rows):
        print(textwrap.fill(NOISY_NOTE, WIDTH))
    entries = ratios(rows, args.ratio_method)
    dropout = ratios(rows, "flash:xla+dropout", "flash:xla")
    growth = memory_growth(rows)
    if entries:
        print()
        print(format_ratios(entries, args.ratio_method, "jax.nn"))
    if dropout:
        print()
        print(format_ratios(dropout, "flash:xla+dropout", "flash:xla"))
    if growth:
        print()
        print(format_growth(growth))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=environment, devices=where, batch=args.batch,
                           heads=args.heads, kv_heads=args.kv_heads or args.heads,
                           dtype=args.dtype, repeats=args.repeats,
                           rows=[dataclasses.asdict(r) for r in rows], ratios=entries,
                           dropout_ratios=dropout,
                           memory_growth=growth), f, indent=1)
        print(f"JSON written to {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot saved to {args.plot}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
