"""flash_attention on an NVIDIA GPU against jax.nn.dot_product_attention (prints tables; a
benchmark, not a test).

Usage: python benchmarks/xla_gpu.py [--modes train decode] [--lengths 1024 4096 16384 32768]
           [--dtype bfloat16 float16] [--schedules default cpu 1024x2048 ...]
           [--decode-kv 8192 32768 131072] [--decode-q 1 4] [--decode-spans 4096 32768 ...]
           [--methods flash "jax.nn cudnn"] [--repeats 10] [--json PATH]

Run from the repository root with PYTHONPATH=. and XLA_PYTHON_CLIENT_PREALLOCATE=false, so the
compiled temporaries are what a program pays. Methods, interleaved, median of ``--repeats``
rounds after one warm-up, each round's time per call over calls dispatched back to back
(``_median_ms``: the device's time, without the host's dispatch): "flash" (flash_attention
with the default chain: cuDNN where its predicate accepts the call, else the xla
implementation), "flash xla" (implementation="xla"), "jax.nn xla" and "jax.nn cudnn"
(jax.nn.dot_product_attention with that implementation).

``train`` rows: for each length, dtype and causal setting, forward+backward (``jax.vjp`` with a
random output cotangent, returning dq, dk, dv), forward+backward TFLOP/s (14 B H P D model
FLOPs, P the visible pairs, as ``python -m jax_flash_metal.benchmark``) and the compiled
temporary memory (``memory_analysis().temp_size_in_bytes``). A jax.nn xla program whose
temporaries exceed ``--max-temp-gib`` is compiled but not run. ``--schedules`` adds "flash xla"
rows with other schedules of the xla implementation (``xla_schedule``): "cpu" (only up to
``--cpu-max-len``), "BQxBK" or "BQxBKxINNER" (INNER 0 for none).

``decode`` rows: the forward of q_len ``--decode-q`` queries against a KV cache of
``--decode-kv`` keys (batch 8, 32 query / 8 KV heads, D 128, bfloat16 by default), with per-batch
lengths from the full cache down to 9/16 of it; GB/s counts the K/V bytes of the valid keys, %
compares it with the measured copy bandwidth of this device (a jitted elementwise pass over a
2 GiB array, bytes read + written). ``--decode-spans`` adds "flash xla" rows with other
``SPAN`` sizes (keys per span at least) of ``xla/decode.py``.
"""

import argparse
import contextlib
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash_metal import flash_attention
from jax_flash_metal.tools.benchmark_model import attention_flops, inputs
from jax_flash_metal.xla import decode as xla_decode
from jax_flash_metal.xla import schedule as xla_schedule
from jax_flash_metal.tools.cli import CAUSAL, HelpFormatter, add_flags, positive_int


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
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:40]}"
    seconds = time.perf_counter() - start
    return compiled, compiled.memory_analysis().temp_size_in_bytes, seconds


PIPELINE_MS = 20.0  # each timed round dispatches calls back to back for about this long


def _median_ms(compiled: dict, args, repeats):
    """Median ms per call, per name (one warm-up each, then ``repeats`` interleaved rounds); a
    call that fails (out of memory) gives its error text. A round dispatches as many calls back
    to back as fill ``PIPELINE_MS`` (one for a longer call) and waits for them all, so the
    host's dispatch overlaps the device's work: the time is the device's per call, where a
    single call timed alone would add tens of microseconds of dispatch and synchronisation."""
    result, depth = {}, {}
    for name, fn in compiled.items():
        try:
            jax.block_until_ready(fn(*args))
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            once_ms = 1e3 * (time.perf_counter() - start)
            depth[name] = max(1, min(100, round(PIPELINE_MS / max(once_ms, 1e-3))))
        except Exception as e:  # noqa: BLE001
            result[name] = f"{type(e).__name__}"
    times = {name: [] for name in depth}
    for _ in range(repeats):
        for name, calls in depth.items():
            start = time.perf_counter()
            jax.block_until_ready([compiled[name](*args) for _ in range(calls)])
            times[name].append((time.perf_counter() - start) / calls)
    result.update({name: 1e3 * statistics.median(t) for name, t in times.items()})
    return result


def _nn(implementation):
    return lambda q, k, v, causal, **kw: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=implementation, **kw)


def _flash(implementation):
    return lambda q, k, v, causal, **kw: flash_attention(
        q, k, v, is_causal=causal, implementation=implementation, **kw)


@contextlib.contextmanager
def _patched(module, **values):
    """Module attributes set to ``values`` for one compile."""
    saved = {n: getattr(module, n) for n in values}
    for n, x in values.items():
        setattr(module, n, x)
    try:
        yield
    finally:
        for n, x in saved.items():
            setattr(module, n, x)


def _schedule_table(name, platform):
    entry = platform if platform in xla_schedule.SCHEDULES else "default"
    return _patched_item(xla_schedule.SCHEDULES, entry, _schedule(name, platform))


@contextlib.contextmanager
def _patched_item(table, key, value):
    saved = table[key]
    table[key] = value
    try:
        yield
    finally:
        table[key] = saved


def _chosen(methods, args):
    """The methods ``--methods`` names (all by default)."""
    return {n: m for n, m in methods.items() if not args.methods or n in args.methods}


def _compile_all(methods, operands, args):
    """{name: compiled or None}, {name: temp bytes}, {name: compile seconds or error text}
    for methods {name: (function, context manager factory or None)}."""
    compiled, temp, notes = {}, {}, {}
    for name, (fn, context) in methods.items():
        with (context() if context else contextlib.nullcontext()):
            compiled[name], temp[name], notes[name] = _compile(fn, operands)
        if (name.startswith("jax.nn xla") and compiled[name] is not None
                and temp[name] > args.max_temp_gib * 2 ** 30):
            notes[name], compiled[name] = "temporaries over --max-temp-gib: not run", None
    return compiled, temp, notes


def _rows(compiled, temp, notes, ms, **fields):
    rows = []
    for name in compiled:
        t = ms.get(name)
        rows.append(dict(fields, method=name, ms=t if isinstance(t, float) else None,
                         temp_mib=None if temp.get(name) is None else temp[name] / 2 ** 20,
                         note=t if isinstance(t, str) else (
                             notes[name] if isinstance(notes[name], str) else None),
                         compile_s=notes[name] if isinstance(notes[name], float) else None))
    return rows


def measure(length, dtype, causal, schedules, args):
    q, k, v, ct = inputs(batch=args.batch, seq_len=length, heads=args.heads, kv_heads=args.heads,
                         head_dim=args.head_dim, dtype=jnp.dtype(dtype))
    operands = (q, k, v, ct)
    platform = jax.devices()[0].platform
    methods = {"flash": (_fwd_bwd(_flash(None), causal), None)}
    for name in schedules:
        if name == "cpu" and length > args.cpu_max_len:
            continue
        label = "flash xla" if name == "default" else f"flash xla:{name}"
        methods[label] = (_fwd_bwd(_flash("xla"), causal),
                          lambda name=name: _schedule_table(name, platform))
    methods["jax.nn xla"] = (_fwd_bwd(_nn("xla"), causal), None)
    methods["jax.nn cudnn"] = (_fwd_bwd(_nn("cudnn"), causal), None)
    if jnp.dtype(dtype) == jnp.float32:
        methods["jax.nn xla highest"] = (_fwd_bwd(_nn("xla"), causal),
                                         lambda: jax.default_matmul_precision("highest"))
    compiled, temp, notes = _compile_all(_chosen(methods, args), operands, args)
    ms = _median_ms({n: f for n, f in compiled.items() if f is not None}, operands, args.repeats)
    flops = attention_flops(args.batch, args.heads, length, length, args.head_dim, causal)[1]
    rows = _rows(compiled, temp, notes, ms, length=length, dtype=dtype, causal=causal)
    for r in rows:
        r["tflops"] = None if r["ms"] is None else flops / (r["ms"] * 1e-3) / 1e12
    return rows


def copy_bandwidth(repeats, gib=2):
    """GB/s (1e9 bytes) of a jitted elementwise pass over a ``gib`` GiB bfloat16 array, bytes
    read plus written: the device's practical memory bandwidth."""
    x = jnp.ones((gib * 2 ** 29,), jnp.bfloat16)
    f = jax.jit(lambda x: x * jnp.bfloat16(1.5)).lower(x).compile()
    ms = _median_ms({"copy": f}, (x,), repeats)["copy"]
    return 2 * x.nbytes / (ms * 1e-3) / 1e9


def _decode_lengths(batch, kv_len):
    """int32 [batch]: kv_len down to 9/16 of it in equal steps."""
    return jnp.asarray([kv_len - (b * kv_len) // (2 * batch) for b in range(batch)], jnp.int32)


def measure_decode(kv_len, q_len, spans, copy_gbs, args):
    dtype = jnp.dtype(args.decode_dtype)
    q, k, v, _ = inputs(batch=args.decode_batch, seq_len=kv_len, heads=args.decode_heads,
                        kv_heads=args.decode_kv_heads, head_dim=args.head_dim, dtype=dtype,
                        q_len=q_len)
    lengths = _decode_lengths(args.decode_batch, kv_len)
    operands = (q, k, v, lengths)

    def forward(attention):
        return lambda q, k, v, n: attention(q, k, v, False, key_value_seq_lengths=n)

    methods = {"flash": (forward(_flash(None)), None),
               "flash xla": (forward(_flash("xla")), None)}
    for span in spans:
        methods[f"flash xla:{span}"] = (forward(_flash("xla")),
                                        lambda s=span: _patched(xla_decode, SPAN=s))
    methods["jax.nn xla"] = (forward(_nn("xla")), None)
    methods["jax.nn cudnn"] = (forward(_nn("cudnn")), None)
    compiled, temp, notes = _compile_all(_chosen(methods, args), operands, args)
    ms = _median_ms({n: f for n, f in compiled.items() if f is not None}, operands, args.repeats)
    valid = int(np.sum(np.asarray(lengths))) * args.decode_kv_heads * args.head_dim * 2
    valid_bytes = valid * dtype.itemsize
    rows = _rows(compiled, temp, notes, ms, length=kv_len, dtype=dtype.name, q_len=q_len,
                 kv_gib=2 * k.nbytes / 2 ** 30)
    for r in rows:
        r["gbs"] = None if r["ms"] is None else valid_bytes / (r["ms"] * 1e-3) / 1e9
        r["pct_copy"] = None if r["gbs"] is None else 100 * r["gbs"] / copy_gbs
    return rows


def _cell(x, spec):
    return "-" if x is None else format(x, spec)


def _table(head, body):
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths))
                     for line in [head, *body])


def format_rows(rows):
    head = ("length", "dtype", "causal", "method", "fwd+bwd ms", "TFLOP/s", "temp MiB",
            "compile s", "note")
    body = [(str(r["length"]), r["dtype"], "yes" if r["causal"] else "no", r["method"],
             _cell(r["ms"], ".2f"), _cell(r["tflops"], ".1f"), _cell(r["temp_mib"], ".0f"),
             _cell(r["compile_s"], ".1f"), r["note"] or "") for r in rows]
    return _table(head, body)


def format_decode_rows(rows):
    head = ("kv_len", "q_len", "method", "fwd ms", "GB/s", "% copy", "temp MiB", "K/V GiB",
            "note")
    body = [(str(r["length"]), str(r["q_len"]), r["method"], _cell(r["ms"], ".3f"),
             _cell(r["gbs"], ".0f"), _cell(r["pct_copy"], ".0f"), _cell(r["temp_mib"], ".0f"),
             f"{r['kv_gib']:.2f}", r["note"] or "") for r in rows]
    return _table(head, body)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--modes", nargs="+", choices=("train", "decode"), default=["train", "decode"],
                   help='"train" (forward+backward rows), "decode" rows')
    add_flags(p, notes=dict(lengths="of the train rows", dtype="of the train rows",
                            batch="of the train rows",
                            heads="and key/value heads, of the train rows"),
              lengths=[1024, 4096, 16384, 32768], dtype=["bfloat16", "float16"], causal="both",
              batch=4, heads=16, head_dim=[128], repeats=10)
    p.add_argument("--schedules", nargs="+", default=["default"],
                   help='xla schedules: "default", "cpu", "BQxBK" or "BQxBKxINNER" (see above)')
    p.add_argument("--decode-kv", nargs="+", type=positive_int, default=[8192, 32768, 131072],
                   help="KV cache lengths of the decode rows")
    p.add_argument("--decode-q", nargs="+", type=positive_int, default=[1, 4],
                   help="query lengths of the decode rows")
    p.add_argument("--decode-batch", type=int, default=8, help="batch size of the decode rows")
    p.add_argument("--decode-heads", type=int, default=32, help="query heads of the decode rows")
    p.add_argument("--decode-kv-heads", type=int, default=8, help="kv heads of the decode rows")
    p.add_argument("--decode-dtype", default="bfloat16", help="dtype of the decode rows")
    p.add_argument("--decode-spans", nargs="*", type=positive_int, default=[],
                   help="SPAN sizes (keys) of the xla decode to compare (default: its own only)")
    p.add_argument("--methods", nargs="*", default=[],
                   help='only these methods, e.g. flash "jax.nn cudnn" (default: all)')
    p.add_argument("--cpu-max-len", type=int, default=4096,
                   help='longest length the "cpu" schedule runs at')
    p.add_argument("--max-temp-gib", type=float, default=100.0,
                   help="a jax.nn xla program with more temporaries (GiB) is compiled, not run")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = p.parse_args()
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {device.device_kind}, jax_default_matmul_precision "
          f"{jax.config.jax_default_matmul_precision}; median of {args.repeats}", flush=True)
    rows = {"train": [], "decode": []}
    for head_dim in args.head_dim:  # every mode for each head dim in turn
        one = argparse.Namespace(**dict(vars(args), head_dim=head_dim))
        for mode, rows_of in (("train", _train_rows), ("decode", _decode_rows)):
            if mode in args.modes:
                rows[mode] += [dict(r, head_dim=head_dim) for r in rows_of(one)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


def _train_rows(args) -> list[dict]:
    print(f"train: batch {args.batch}, heads {args.heads}, head dim {args.head_dim}, "
          "forward+backward", flush=True)
    rows = []
    for dtype in args.dtype:
        for causal in CAUSAL[args.causal]:
            for length in args.lengths:
                point = measure(length, dtype, causal, args.schedules, args)
                print(format_rows(point).split("\n", 1)[1], flush=True)
                rows += point
    print()
    print(format_rows(rows), flush=True)
    return rows


def _decode_rows(args) -> list[dict]:
    copy_gbs = copy_bandwidth(args.repeats)
    print(f"\ndecode: copy bandwidth {copy_gbs:.0f} GB/s; batch {args.decode_batch}, heads "
          f"{args.decode_heads}/{args.decode_kv_heads}, head dim {args.head_dim}, "
          f"{args.decode_dtype}, per-batch lengths kv_len .. 9/16 kv_len, forward", flush=True)
    rows = []
    for q_len in args.decode_q:
        for kv_len in args.decode_kv:
            point = measure_decode(kv_len, q_len, args.decode_spans, copy_gbs, args)
            print(format_decode_rows(point).split("\n", 1)[1], flush=True)
            rows += point
    print()
    print(format_decode_rows(rows))
    return rows


if __name__ == "__main__":
    main()
