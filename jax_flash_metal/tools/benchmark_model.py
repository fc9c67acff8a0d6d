"""The benchmark's measurements (``python -m jax_flash_metal.benchmark``): the methods timed,
their model FLOPs, inputs, compile and call timings, temporary memory, and the run over a grid of
lengths, head dims and causal settings. What each figure means: the benchmark's docstring and
docs/benchmarks.md."""

from __future__ import annotations

import dataclasses
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from .. import flash_attention, implementations, reference_attention
from ..core.contract import kernel_suffix
from . import roofline


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
    ffi_bytes: int | None = None  # flash:emulator / flash:metal only: ffi_working_bytes
    dtype: str = "float32"


def ffi_working_bytes(method: str, batch: int, q_len: int, kv_len: int, heads: int,
                      kv_heads: int, head_dim: int, dtype) -> int | None:
    """Bytes of host memory the FFI handler itself allocates for the larger of a
    forward+backward's two calls (the kernels' parameter blocks and copied lengths), which XLA's
    memory analysis does not see; from the extension's plan (``_ext.working_memory``), for the
    methods that run the FFI (flash:emulator, flash:metal), else None. Metal staging copies are
    measured only as calls run (``_ext.take_working_memory``) and are not in it."""
    impl = method.removeprefix("flash:")
    if impl not in ("emulator", "metal"):
        return None
    from .._ext import working_memory
    return max(working_memory(direction, kernel_suffix(dtype), batch, q_len, kv_len, heads, kv_heads,
                              head_dim, implementation=impl) for direction in ("fwd", "bwd"))


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


def unsupported(fn, dtype, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the method ``fn`` cannot compile forward+backward in ``dtype`` on this backend (the
    first line of the error, at a tiny shape), or None."""
    q, k, v, ct = inputs(batch=1, seq_len=8, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         dtype=jnp.dtype(dtype))
    try:
        compile_seconds(fn, False, q, k, v, ct)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        return str(e).splitlines()[0]
    return None


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
    after the warm-up and after each of the first ``repeats`` rounds (the steps a progress
    total counts; the extra rounds of a noisy point do not advance it).
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
        if done < repeats:
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
    for name in list(table):
        reason = unsupported(table[name], dtype, heads, kv_heads, min(head_dims))
        if reason is not None:  # e.g. XLA:CPU has no float16 dot with float32 accumulation
            print(f"{name}: not run in {jnp.dtype(dtype).name} here: {reason}", file=sys.stderr)
            del table[name]
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
                or ms.get(name + " fwd", 0) > ms.get(name + " fwd+bwd", float("inf")),
                ffi_bytes=ffi_working_bytes(name, batch, q_len or seq_len, seq_len, heads,
                                            kv_heads, head_dim, dtype),
                dtype=dtype)

    for point in points:
        measure_point(*point)
    square = [rows[m, d, c, t, None] for m in table for d in head_dims for c in causal_modes
              for t in seq_lens]
    return square + [rows[m, d, False, t, decode_q_len] for m in table for d in head_dims
                     for t in decode_kv_lens]
