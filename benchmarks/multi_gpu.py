"""flash_attention over many devices: batch/head sharding and context parallelism against one
device (prints tables; a measurement, not a test).

Usage: python benchmarks/multi_gpu.py [--sections shard context train] [--devices 1 2 4 8]
           [--lengths 32768 131072 524288] [--shard-length 16384] [--repeats 5] [--json PATH]
       python benchmarks/multi_gpu.py --host-devices 8 --tiny   (a rehearsal on host CPU devices)
       (one process per GPU: start it once per GPU with --distributed and the usual
       JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; process 0 prints)

Run from the repository root with PYTHONPATH=., XLA_PYTHON_CLIENT_PREALLOCATE=false and
NCCL_NVLS_ENABLE=0 (NVLink multicast off). The problem: batch 1, --heads 16 query / --kv-heads 4
key/value heads, head dim 128, bfloat16; every time is forward+backward (``jax.vjp``: O, LSE,
then dQ, dK, dV), the median of --repeats calls after one warm-up; TFLOP/s per device counts
14 B H P D model FLOPs (P the visible pairs, as ``python -m jax_flash_metal.benchmark``)
divided by the devices. Sections:

``shard``: batch/head sharding at T = --shard-length over n devices, with an Auto mesh and an
Explicit one (JAX with ``AxisType``): "batch" rows split a batch of n (one sequence per
device: per-device work as one device's), "heads" rows split the heads of batch 1 (n must
divide --kv-heads). "per dev" is the per-device TFLOP/s over one device's (1.0: linear), "coll"
the collectives in the compiled program (all-gather, all-reduce, reduce-scatter, all-to-all,
collective-permute; 0 expected).

``context``: ``sequence_axis_name`` inside ``shard_map`` over n devices, each
``sequence_strategy`` x ``sequence_layout`` x causal, at each length. "eff" is the parallel
efficiency against one device at that length (t1 / (n tn); "-" where one device does not fit it);
"mem" the compiled per-device memory (``memory_analysis()``: arguments + outputs + temporaries)
and "/1" its ratio to the one-device program's; "comm" the time of the strategy's collectives
alone (the same K/V, and dK/dV in float32, moved as the strategy moves them, no compute);
"exposed" an estimate of the step's communication not hidden behind compute:
(tn - t1 w) / tn, w the busiest device's share of the visible pairs
(``ring_attention.causal_work``), a model, not a profile. "diff" is max |O - O1| / max |O1|
against the one-device call (the check: <= 2^-7, twice bfloat16's rounding unit).

``train``: the example model (``examples/train_lm.py``) trained --train-steps steps on one device
and with data x sequence parallelism (its ``--mesh`` data=2, sp=n/2) over n devices: the seconds
of each run (compilation included) and the largest loss difference (float32 rounding of the
batch mean's order of summation only).
"""

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(")
TOLERANCE = 2.0 ** -7
SECTIONS = ("shard", "context", "train")


def parse_args(argv=None):
    from jax_flash_metal.ring_attention import LAYOUTS, STRATEGIES
    from jax_flash_metal.tools.cli import (HelpFormatter, add_flags, add_problem_flags,
                                           check_problem_flags, positive_int)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="sections to run")
    parser.add_argument("--devices", nargs="+", type=positive_int, default=[1, 2, 4, 8],
                        help="device counts to run (those above the devices present are skipped)")
    parser.add_argument("--shard-length", type=int, default=16384,
                        help="sequence length of the shard section")
    add_flags(parser, notes=dict(lengths="whole sequences, of the context section"),
              lengths=[32768, 131072, 524288], head_dim=[128], dtype=["bfloat16"], repeats=5)
    parser.add_argument("--implementation", default=None,
                        help="flash_attention's implementation (default: the platform's chain)")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
                        help="sequence_strategy values of the context section")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                        help="sequence_layout values of the context section")
    parser.add_argument("--train-steps", type=int, default=20, help="steps of the train section")
    parser.add_argument("--host-devices", type=positive_int, default=None,
                        help="run on this many host (CPU) devices instead (a rehearsal)")
    parser.add_argument("--tiny", action="store_true",
                        help="rehearsal sizes: lengths 256, shard length 256, head dim 32, "
                             "float32, 2 train steps, 1 repeat")
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() first (one process per GPU)")
    parser.add_argument("--json", default=None, help="also write every row to this JSON file")
    add_problem_flags(parser, heads=16, kv_heads=4)
    args = parser.parse_args(argv)
    check_problem_flags(parser, args)
    if args.implementation is not None:
        from jax_flash_metal import implementations
        if args.implementation not in implementations.available():
            parser.error(f"--implementation {args.implementation!r}: not one of "
                         f"{implementations.available()} here")
    if args.tiny:
        args.lengths, args.shard_length, args.head_dim = [256], 256, [32]
        args.dtype, args.train_steps, args.repeats = ["float32"], 2, 1
    return args


def median_ms(fn, *xs, repeats):
    import jax
    jax.block_until_ready(fn(*xs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*xs))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def out_of_memory(error):
    return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


class Runner:
    """The problem, its inputs placed on device meshes, and the timed programs."""

    def __init__(self, args):
        import jax
        import numpy as np
        from jax_flash_metal.tools.benchmark_model import attention_flops
        self.args, self.jax, self.np = args, jax, np
        self.flops = attention_flops
        self.devices = jax.devices()
        self.rows = []

    def arrays(self, batch, seq_len):
        """Global NumPy q, k, v and the output cotangent (the same on every process)."""
        a, np = self.args, self.np
        rng = np.random.default_rng(seq_len)
        dtype = self.jax.numpy.dtype(a.dtype)
        q = rng.standard_normal((batch, seq_len, a.heads, a.head_dim), np.float32)
        k, v = (rng.standard_normal((batch, seq_len, a.kv_heads, a.head_dim), np.float32)
                for _ in range(2))
        return [x.astype(dtype) for x in (q, k, v, rng.standard_normal(q.shape, np.float32))]

    def place(self, xs, sharding):
        return [self.jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i])
                for x in xs]

    def attention(self, causal, **kw):
        from jax_flash_metal import flash_attention

        def step(q, k, v, do):
            out, vjp = self.jax.vjp(lambda q, k, v: flash_attention(
                q, k, v, is_causal=causal, return_lse=True,
                implementation=self.args.implementation, **kw), q, k, v)
            return out[0], vjp((do, self.jax.numpy.zeros_like(out[1])))
        return step

    def tflops_per_device(self, batch, seq_len, causal, ms, n):
        a = self.args
        flops = self.flops(batch, a.heads, seq_len, seq_len, a.head_dim, causal)[1]
        return flops / (ms * 1e-3) / n / 1e12

    def one_device(self, seq_len, causal, batch=1):
        """(ms, O, memory bytes) of the call on one device, or (None, None, bytes) when it does
        not fit."""
        jax = self.jax
        device = jax.local_devices()[0]
        xs = [jax.device_put(x, device) for x in self.arrays(batch, seq_len)]
        compiled = jax.jit(self.attention(causal)).lower(*xs).compile()
        memory = _memory(compiled)
        try:
            ms = median_ms(compiled, *xs, repeats=self.args.repeats)
        except Exception as e:  # noqa: BLE001
            if not out_of_memory(e):
                raise
            return None, None, memory
        return ms, self.np.asarray(compiled(*xs)[0], self.np.float32), memory


def _memory(compiled):
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes


def _collectives(compiled):
    return len(COLLECTIVES.findall(compiled.as_text()))


def _meshes(jax, devices, names):
    """(kind, mesh) pairs: an Auto mesh, and an Explicit one where this JAX has AxisType."""
    from jax.sharding import Mesh
    import numpy as np
    shape = (len(devices),) + (1,) * (len(names) - 1)
    yield "auto", Mesh(np.array(devices).reshape(shape), names)
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is not None:
        yield "explicit", Mesh(np.array(devices).reshape(shape), names,
                               axis_types=(axis_type.Explicit,) * len(names))


def _using(jax, mesh):
    """The context that makes ``mesh`` the current one (jax.set_mesh, or the older use_mesh)."""
    import contextlib
    for owner, name in ((jax, "set_mesh"), (jax.sharding, "use_mesh")):
        if hasattr(owner, name):
            return getattr(owner, name)(mesh)
    return contextlib.nullcontext()


def shard_section(r: Runner, counts):
    jax, a = r.jax, r.args
    from jax.sharding import NamedSharding, PartitionSpec as P
    t = a.shard_length
    base = {c: r.one_device(t, c)[0] for c in (False, True)}
    print(f"\nbatch/head sharding, T={t}, {a.heads}/{a.kv_heads} heads, D={a.head_dim}, "
          f"{a.dtype}; one device: {base[False]:.2f} ms, causal {base[True]:.2f} ms")
    print(f"{'split':>6} {'mesh':>8} {'n':>2} {'causal':>6} {'ms':>9} {'TF/s/dev':>9} "
          f"{'per dev':>7} {'coll':>4}")
    for n in counts:
        for split, batch, spec in (("batch", n, P("x")), ("heads", 1, P(None, None, "x"))):
            if split == "heads" and a.kv_heads % n:
                continue
            for kind, mesh in _meshes(jax, r.devices[:n], ("x",)):
                for causal in (False, True):
                    xs = r.place(r.arrays(batch, t), NamedSharding(mesh, spec))
                    with _using(jax, mesh):
                        compiled = jax.jit(r.attention(causal)).lower(*xs).compile()
                        ms = median_ms(compiled, *xs, repeats=a.repeats)
                    per_dev = r.tflops_per_device(batch, t, causal, ms, n)
                    one = r.tflops_per_device(1, t, causal, base[causal], 1)
                    row = dict(section="shard", split=split, mesh=kind, devices=n,
                               causal=causal, ms=ms, tflops_per_device=per_dev,
                               per_device_vs_one=per_dev / one,
                               collectives=_collectives(compiled))
                    r.rows.append(row)
                    print(f"{split:>6} {kind:>8} {n:2d} {causal!s:>6} {ms:9.2f} {per_dev:9.2f} "
                          f"{per_dev / one:7.3f} {row['collectives']:4d}")


def _comm_only(r: Runner, mesh, strategy, n, xs):
    """ms of the strategy's collectives alone on the local K/V shards (no attention)."""
    jax, jnp = r.jax, r.jax.numpy
    from jax.sharding import PartitionSpec as P
    from jax_flash_metal.ring_attention import shard_map
    perm = [(i, (i + 1) % n) for i in range(n)]

    def moves(k, v):
        if strategy == "all_gather":
            k, v = (jax.lax.all_gather(x, "sp", axis=1, tiled=True) for x in (k, v))
            dk, dv = (jax.lax.psum_scatter(x.astype(jnp.float32), "sp", scatter_dimension=1,
                                           tiled=True) for x in (k, v))
            return dk, dv
        rotate = lambda _, xs: tuple(jax.lax.ppermute(x, "sp", perm) for x in xs)  # noqa: E731
        k, v = jax.lax.fori_loop(0, n - 1, rotate, (k, v))
        return jax.lax.fori_loop(0, n - 1, rotate, (k, v, k.astype(jnp.float32),
                                                    v.astype(jnp.float32)))[2:]

    seq = P(None, "sp")
    fn = jax.jit(shard_map(moves, mesh, (seq, seq), (seq, seq)))
    return median_ms(fn, xs[1], xs[2], repeats=r.args.repeats)


def context_section(r: Runner, counts):
    jax, np, a = r.jax, r.np, r.args
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax_flash_metal import ring_attention as ra
    print(f"\ncontext parallelism, batch 1, {a.heads}/{a.kv_heads} heads, D={a.head_dim}, "
          f"{a.dtype} (comm and exposed: estimates, see --help)")
    header = (f"{'T':>7} {'n':>2} {'strategy':>10} {'layout':>10} {'causal':>6} {'ms':>9} "
              f"{'TF/s/dev':>8} {'eff':>5} {'mem MiB':>8} {'/1':>5} {'comm':>7} "
              f"{'exposed':>7} {'diff':>7}")
    for t in a.lengths:
        print(header)
        for causal in (False, True):
            t1, o1, m1 = r.one_device(t, causal)
            print(f"{t:7d} {1:2d} {'1 device':>10} {'-':>10} {causal!s:>6} "
                  + (f"{t1:9.2f} {r.tflops_per_device(1, t, causal, t1, 1):8.2f}"
                     if t1 else f"{'no fit':>9} {'-':>8}")
                  + f" {'-':>5} {m1 / 2**20:8.0f}")
            for n in counts:
                if n == 1:
                    continue
                mesh = Mesh(np.array(r.devices[:n]), ("sp",))
                seq = NamedSharding(mesh, P(None, "sp"))
                for strategy in a.strategies:
                    for layout in a.layouts:
                        order, undo = _REORDER[layout](ra)
                        xs = r.place([np.asarray(order(x, n)) for x in r.arrays(1, t)], seq)
                        step = ra.shard_map(r.attention(causal, sequence_axis_name="sp",
                                                        sequence_strategy=strategy,
                                                        sequence_layout=layout),
                                            mesh, (P(None, "sp"),) * 4,
                                            (P(None, "sp"), (P(None, "sp"),) * 3))
                        compiled = jax.jit(step).lower(*xs).compile()
                        ms = median_ms(compiled, *xs, repeats=a.repeats)
                        comm = _comm_only(r, mesh, strategy, n, xs)
                        busiest = (ra.causal_work(n, t, layout).max() / (t * (t + 1) / 2)
                                   if causal else 1 / n)
                        o = np.asarray(undo(np.asarray(compiled(*xs)[0], np.float32), n))
                        diff = (float(np.abs(o - o1).max() / np.abs(o1).max())
                                if o1 is not None else None)
                        mem = _memory(compiled)
                        row = dict(section="context", seq_len=t, devices=n, strategy=strategy,
                                   layout=layout, causal=causal, ms=ms, comm_ms=comm,
                                   tflops_per_device=r.tflops_per_device(1, t, causal, ms, n),
                                   efficiency=t1 / (n * ms) if t1 else None,
                                   exposed=max(0.0, (ms - t1 * busiest) / ms) if t1 else None,
                                   memory=mem, memory_vs_one=mem / m1, diff=diff,
                                   within_tolerance=None if diff is None else diff <= TOLERANCE)
                        r.rows.append(row)
                        print(f"{t:7d} {n:2d} {strategy:>10} {layout:>10} {causal!s:>6} "
                              f"{ms:9.2f} {row['tflops_per_device']:8.2f} "
                              f"{_opt(row['efficiency'], 5, 3)} {mem / 2**20:8.0f} "
                              f"{mem / m1:5.3f} {comm:7.2f} {_opt(row['exposed'], 7, 3)} "
                              f"{_opt(diff, 7, 1, 'e')}")


# Per sequence_layout: (the whole arrays' reordering before the split, its inverse).
_REORDER = {"contiguous": lambda ra: ((lambda x, n: x),) * 2,
            "striped": lambda ra: (ra.stripe, ra.unstripe),
            "zigzag": lambda ra: (ra.zigzag, ra.unzigzag)}


def _opt(x, width, digits, kind="f"):
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{digits}{kind}}"


def train_section(r: Runner, counts):
    np, a = r.np, r.args
    from jax.sharding import Mesh
    from jax_flash_metal.examples import train_lm
    data = np.frombuffer(train_lm.stdlib_corpus(1 << 18)[0], np.uint8)
    print(f"\ntraining the example model ({a.train_steps} steps), one device vs data x "
          f"sequence parallel")
    print(f"{'mesh':>14} {'s':>7} {'max |loss diff|':>16}")
    for n in counts:
        if n < 2 or n % 2:
            continue
        cfg = dataclasses.replace(train_lm.TINY if a.tiny else train_lm.DEFAULT,
                                  steps=a.train_steps)
        results = []
        for mesh in (None, Mesh(np.array(r.devices[:n]).reshape(2, n // 2), ("data", "sp"))):
            start = time.perf_counter()
            _, losses = train_lm.train(cfg, data, a.implementation, progress=False,
                                       mesh=mesh)
            results.append((losses, time.perf_counter() - start))
        diff = float(np.max(np.abs(np.array(results[0][0]) - np.array(results[1][0]))))
        r.rows.append(dict(section="train", devices=n, data=2, sp=n // 2,
                           seconds=results[1][1], one_device_seconds=results[0][1],
                           max_loss_diff=diff))
        print(f"{'1 device':>14} {results[0][1]:7.1f}")
        print(f"{f'data=2,sp={n // 2}':>14} {results[1][1]:7.1f} {diff:16.2e}")


def main(argv=None):
    # Host devices are fixed when JAX reads its flags: set them before anything imports JAX.
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--host-devices", type=int, default=None)
    host_devices = early.parse_known_args(argv)[0].host_devices
    if host_devices:
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [
            os.environ.get("XLA_FLAGS"),
            f"--xla_force_host_platform_device_count={host_devices}"]))
        os.environ["JAX_PLATFORMS"] = "cpu"
    args = parse_args(argv)
    import jax
    if args.distributed:
        jax.distributed.initialize()
    if jax.process_index() != 0:
        sys.stdout = open(os.devnull, "w")
    device = jax.devices()[0]
    print(f"{len(jax.devices())} x {device.device_kind} ({device.platform}), "
          f"{jax.process_count()} process(es), jax {jax.__version__}")
    skipped = [n for n in args.devices if n > len(jax.devices())]
    if skipped:
        print(f"--devices {' '.join(map(str, skipped))}: skipped, more than the "
              f"{len(jax.devices())} devices present")
    sections = {"shard": shard_section, "context": context_section}
    rows = []
    for dtype in args.dtype:  # the attention sections for each dtype and head dim in turn
        for head_dim in args.head_dim:
            r = Runner(argparse.Namespace(**dict(vars(args), dtype=dtype, head_dim=head_dim)))
            counts = [n for n in args.devices if n <= len(r.devices)]
            for name in (n for n in args.sections if n in sections):
                sections[name](r, counts)
            rows += [dict(row, dtype=dtype, head_dim=head_dim) for row in r.rows]
    if "train" in args.sections:  # the example model: its own dtype and head dim
        r = Runner(args)
        train_section(r, [n for n in args.devices if n <= len(r.devices)])
        rows += r.rows
    if args.json and jax.process_index() == 0:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "jax": jax.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
