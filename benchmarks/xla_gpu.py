"""The xla implementation on an accelerator against jax.nn.dot_product_attention (prints a table;
a benchmark, not a test).

Usage: python benchmarks/xla_gpu.py [--lengths 1024,4096,16384,32768] [--dtypes bfloat16,float32]
           [--schedules default,cpu,1024x2048,...] [--repeats 10] [--json PATH]

Run from the repository root with PYTHONPATH=. (only the xla implementation is needed) and
XLA_PYTHON_CLIENT_PREALLOCATE=false, so the compiled temporaries are what a program pays. For each
length, dtype, causal setting and schedule it times forward+backward (``jax.vjp`` of the attention
with a random output cotangent, returning dq, dk, dv; median of ``--repeats`` calls after one
warm-up, methods interleaved) of flash_attention(implementation="xla"), of
jax.nn.dot_product_attention with implementation="xla" and "cudnn" (where cuDNN takes the dtype),
and reports forward+backward TFLOP/s (14 B H P D model FLOPs, P the visible pairs, as
``python -m jax_flash_metal.benchmark``) and the compiled temporary memory
(``memory_analysis().temp_size_in_bytes``). A jax.nn xla program whose temporaries exceed
``--max-temp-gib`` is compiled but not run.

``--schedules`` names the xla implementation's schedules to compare (``xla_schedule``): "default"
(the table entry of this device's platform), "cpu" (the cpu entry, run on this device; only at
lengths up to ``--cpu-max-len``, it is slow here), "BQxBK" (that entry with block_q BQ and
block_k BK) or "BQxBKxINNER" (and inner_block INNER, 0 for none). For float32 inputs jax.nn's
xla path is also timed at ``jax.default_matmul_precision("highest")`` (its default on GPUs is
TF32), the precision the xla implementation keeps.
"""

import argparse
import contextlib
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jax_flash_metal import flash_attention
from jax_flash_metal.xla import schedule as xla_schedule
from jax_flash_metal.tools.benchmark_model import attention_flops, inputs


def _fwd_bwd(attention, causal):
    def run(q, k, v, ct):
        return jax.vjp(lambda q, k, v: attention(q, k, v, causal), q, k, v)[1](ct)
    return run


def _schedule(name, platform):
    if name in ("default", "cpu"):
        return xla_schedule.for_platform(platform if name == "default" else name)
    sizes = [int(n) for n in name.split("x")]
    schedule = xla_schedule.for_platform(platform)._replace(block_q=sizes[0], block_k=sizes[1])
    if len(sizes) == 3:  # BQxBKxINNER, INNER 0 for none
        schedule = schedule._replace(inner_block=sizes[2] or None)
    return schedule


def _compile(fn, args):
    """(compiled, temporary bytes, compile seconds) or (None, None, error text)."""
    start = time.perf_counter()
    try:
        compiled = jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 (cuDNN refusing a dtype or shape, out of memory)
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    seconds = time.perf_counter() - start
    return compiled, compiled.memory_analysis().temp_size_in_bytes, seconds


def _median_ms(compiled: dict, args, repeats):
    """Median ms per name (one warm-up each, then ``repeats`` interleaved rounds); a call that
    fails (out of memory) gives its error text."""
    result, live = {}, {}
    for name, fn in compiled.items():
        try:
            jax.block_until_ready(fn(*args))
            live[name] = []
        except Exception as e:  # noqa: BLE001
            result[name] = f"{type(e).__name__}"
    for _ in range(repeats):
        for name, times in live.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            times.append(time.perf_counter() - start)
    result.update({name: 1e3 * statistics.median(t) for name, t in live.items()})
    return result


def _nn(implementation):
    return lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=implementation)


def _flash(q, k, v, causal):
    return flash_attention(q, k, v, is_causal=causal, implementation="xla")


def measure(length, dtype, causal, schedules, args):
    q, k, v, ct = inputs(batch=args.batch, seq_len=length, heads=args.heads, kv_heads=args.heads,
                         head_dim=args.head_dim, dtype=jnp.dtype(dtype))
    operands = (q, k, v, ct)
    compiled, temp, notes = {}, {}, {}
    platform = jax.devices()[0].platform
    entry = platform if platform in xla_schedule.SCHEDULES else "default"
    table = dict(xla_schedule.SCHEDULES)
    for name in schedules:
        if name == "cpu" and length > args.cpu_max_len:
            continue
        # The table entry this device lowers with, set for this compile only.
        xla_schedule.SCHEDULES[entry] = _schedule(name, platform)
        try:
            fn, temp[f"flash:{name}"], notes[f"flash:{name}"] = _compile(
                _fwd_bwd(_flash, causal), operands)
        finally:
            xla_schedule.SCHEDULES.clear()
            xla_schedule.SCHEDULES.update(table)
        compiled[f"flash:{name}"] = fn
    nn = [("jax.nn xla", "xla", None), ("jax.nn cudnn", "cudnn", None)]
    if jnp.dtype(dtype) == jnp.float32:
        nn.insert(1, ("jax.nn xla highest", "xla", "highest"))
    for name, impl, precision in nn:
        with (contextlib.nullcontext() if precision is None
              else jax.default_matmul_precision(precision)):
            fn, temp[name], notes[name] = _compile(_fwd_bwd(_nn(impl), causal), operands)
        if fn is not None and temp[name] > args.max_temp_gib * 2 ** 30:
            notes[name], fn = "temporaries over --max-temp-gib: not run", None
        compiled[name] = fn
    ms = _median_ms({n: f for n, f in compiled.items() if f is not None}, operands, args.repeats)
    flops = attention_flops(args.batch, args.heads, length, length, args.head_dim, causal)[1]
    rows = []
    for name in compiled:
        t = ms.get(name)
        rows.append(dict(length=length, dtype=dtype, causal=causal, method=name,
                         ms=t if isinstance(t, float) else None,
                         tflops=flops / (t * 1e-3) / 1e12 if isinstance(t, float) else None,
                         temp_mib=None if temp.get(name) is None else temp[name] / 2 ** 20,
                         note=t if isinstance(t, str) else (
                             notes[name] if isinstance(notes[name], str) else None),
                         compile_s=notes[name] if isinstance(notes[name], float) else None))
    return rows


def _cell(x, spec):
    return "-" if x is None else format(x, spec)


def format_rows(rows):
    head = ("length", "dtype", "causal", "method", "fwd+bwd ms", "TFLOP/s", "temp MiB",
            "compile s", "note")
    body = [(str(r["length"]), r["dtype"], "yes" if r["causal"] else "no", r["method"],
             _cell(r["ms"], ".2f"), _cell(r["tflops"], ".1f"), _cell(r["temp_mib"], ".0f"),
             _cell(r["compile_s"], ".1f"), r["note"] or "") for r in rows]
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths))
                     for line in [head, *body])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    names = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--lengths", type=ints, default=[1024, 4096, 16384, 32768])
    p.add_argument("--dtypes", type=names, default=["bfloat16", "float32"])
    p.add_argument("--causal", choices=["both", "on", "off"], default="both")
    p.add_argument("--schedules", type=names, default=["default"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--cpu-max-len", type=int, default=4096)
    p.add_argument("--max-temp-gib", type=float, default=100.0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, batch {args.batch}, heads "
          f"{args.heads}, head dim {args.head_dim}, jax_default_matmul_precision "
          f"{jax.config.jax_default_matmul_precision}; forward+backward, median of "
          f"{args.repeats}", flush=True)
    causal_modes = {"both": [False, True], "on": [True], "off": [False]}[args.causal]
    rows = []
    for dtype in args.dtypes:
        for causal in causal_modes:
            for length in args.lengths:
                point = measure(length, dtype, causal, args.schedules, args)
                print(format_rows(point).split("\n", 1)[1], flush=True)
                rows += point
    print()
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
