"""The host path of one decode call: what the FFI handler does on the CPU before the kernels run
(prints a table; a measurement, not a test).

Usage: python benchmarks/host_path.py [--rounds R] [--calls N] [--kv-len T] [--head-dim D ...]
                                     [--dtype DTYPE ...]

Runs a jitted decode forward (batch 1, one query, 8 heads over 2 key/value heads) R rounds of N
calls on the
emulated device, which stands in for the Metal device in everything the two share: decoding the
attributes and checking them and the operands ("validate"), the kernels' check ("lookup":
Device::has_kernel as the device implements it, once per cached plan), the dispatch plan (from
the handler's per-thread plan cache after the first call) with each dispatch's parameters and
bindings ("plan"), and handing the submissions to the device
("launch": on Metal, encoding and committing the command buffers; on the emulated device,
starting its worker thread, which no Metal call pays). The handler times each phase with a
steady clock while ``testing.set_host_timing`` is on; the table gives, per phase, the median and
the minimum over the rounds of each round's mean microseconds per call (on a busy machine the
minimum is the figure least disturbed by other processes), and the "shared" phases (validate,
lookup, plan) against the 10 us target. The kernels' time (the emulator's, here) is not in any
phase. Two things make these figures pessimistic for a Mac: each phase includes one clock read
(about 0.1-0.3 us in this virtual machine), and the emulator's kernels run on this CPU between
two calls, so each call starts with cold caches (on a Mac the GPU runs them).
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash_metal._ext as _ext
from jax_flash_metal import flash_attention
from jax_flash_metal.tools.cli import HelpFormatter, add_flags

SHARED = ("validate", "lookup", "plan")
TARGET_US = 10.0


def measure(rounds: int, calls: int, kv_len: int, head_dim: int, dtype) -> list[dict]:
    """Each round's mean microseconds per handler call, by phase."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 1, 8, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((1, kv_len, 2, head_dim)), dtype) for _ in range(2))
    lengths = jnp.array([kv_len - 3], jnp.int32)
    decode = jax.jit(lambda q, k, v, n: flash_attention(
        q, k, v, key_value_seq_lengths=n, implementation="emulator"))
    for _ in range(5):  # compile and first-use work (kernel tables, thread start-up)
        jax.block_until_ready(decode(q, k, v, lengths))
    results = []
    _ext.testing.set_host_timing(True)
    try:
        for _ in range(rounds):
            for _ in range(calls):
                jax.block_until_ready(decode(q, k, v, lengths))
            timed, seconds = _ext.testing.take_host_times()
            assert timed == calls, f"timed {timed} handler calls, expected {calls}"
            per_call = {name: s / calls * 1e6 for name, s in seconds.items()}
            per_call["shared"] = sum(per_call[name] for name in SHARED)
            results.append(per_call)
    finally:
        _ext.testing.set_host_timing(False)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--calls", type=int, default=20,
                   help="decode calls per round (each round reports its mean per call)")
    add_flags(p, notes=dict(rounds="the table gives the median and minimum over them",
                            kv_len="keys in the cache", head_dim="of value too"),
              rounds=20, kv_len=128, head_dim=[64], dtype=["float16"])
    args = p.parse_args()
    for dtype in args.dtype:
        for head_dim in args.head_dim:
            rounds = measure(args.rounds, args.calls, args.kv_len, head_dim, jnp.dtype(dtype))
            print(f"host path of one decode call ({dtype}, kv_len {args.kv_len}, head dim "
                  f"{head_dim}, 8 query / 2 key-value heads) on the emulated device: mean us "
                  f"per call of each of {args.rounds} rounds of {args.calls} calls")
            print(f"{'phase':<10} {'median':>8} {'min':>8}")
            for name in rounds[0]:
                values = [r[name] for r in rounds]
                print(f"{name:<10} {np.median(values):8.2f} {min(values):8.2f}")
    print(f"shared = {' + '.join(SHARED)}; target <= {TARGET_US:g} us; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
