"""Context parallelism's memory and work per device (prints tables; a measurement, not a test).

Usage: python benchmarks/ring_memory.py [--devices N] [--seq-len T] [--implementation I]

Runs on N host (CPU) devices, also where a GPU is the default backend (sets XLA_FLAGS and
JAX_PLATFORMS itself, before importing JAX). Compiles forward+backward (jax.vjp: O, LSE, then
dQ, dK, dV; batch 1, 4 heads, head dim 64, float32) of flash_attention over the whole sequence
on one device, and of the same call split over N devices with sequence_axis_name inside
shard_map for each sequence_strategy (all_gather, ring; non-causal in the contiguous layout,
causal in the zigzag one), and prints XLA's temporary memory per device (memory_analysis(); the
split call's program is the per-device one) and the same with the arguments and outputs added.
Then, per layout: the causal balance (ring_attention.causal_balance: max / min over devices of
the visible (query, key) pairs), the busiest device's causal work as a fraction of its
non-causal work (visible pairs, and block steps: ring_attention.block_schedule's primitive
calls, each direction). For a fused implementation ("emulator", "metal") the one-device call's
temporary memory is nearly nothing: its kernels' working memory is the FFI handler's, outside
XLA's accounting, so compare the totals there.
"""

import argparse
import os


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8,
                        help="host (CPU) devices the sequence is split over (default: 8)")
    parser.add_argument("--seq-len", type=int, default=16384,
                        help="whole sequence length T, a multiple of --devices (default: 16384)")
    parser.add_argument("--implementation", default="xla",
                        help='flash_attention\'s implementation: "xla", "emulator" or "metal" '
                             '(default: xla)')
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("XLA_FLAGS"),
        f"--xla_force_host_platform_device_count={args.devices}"]))
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from jax_flash_metal import flash_attention
    from jax_flash_metal.ring_attention import (LAYOUTS, block_schedule, causal_balance,
                                                causal_work, shard_map)

    n, t = args.devices, args.seq_len
    x = jax.ShapeDtypeStruct((1, t, 4, 64), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:n]), ("sp",))
    seq, row = P(None, "sp"), P(None, None, "sp")

    def grads(attention):
        def run(q, k, v, do):
            out, vjp = jax.vjp(attention, q, k, v)
            return out, vjp((do, jnp.zeros_like(out[1])))
        return run

    def mib(f):
        """(temporary, arguments + outputs + temporary) MiB per device."""
        m = jax.jit(f).lower(x, x, x, x).compile().memory_analysis()
        temp = m.temp_size_in_bytes
        return temp / 2**20, (temp + m.argument_size_in_bytes + m.output_size_in_bytes) / 2**20

    print(f"T={t}, batch 1, 4 heads, head dim 64, float32, {args.implementation}, "
          f"{n} devices; memory per device (MiB)")
    print(f"{'strategy':>10} {'causal':>6} {'layout':>10} {'temp':>8} {'/1 dev':>7} "
          f"{'total':>8} {'/1 dev':>7}")
    for causal in (False, True):
        def attention(q, k, v, **kw):
            return flash_attention(q, k, v, is_causal=causal, return_lse=True,
                                   implementation=args.implementation, **kw)

        single, single_total = mib(grads(attention))
        print(f"{'1 device':>10} {causal!s:>6} {'-':>10} {single:8.1f} {1:7.3f} "
              f"{single_total:8.1f} {1:7.3f}")
        layout = "zigzag" if causal else "contiguous"
        for strategy in ("all_gather", "ring"):
            split = shard_map(grads(lambda q, k, v, s=strategy: attention(
                q, k, v, sequence_axis_name="sp", sequence_layout=layout,
                sequence_strategy=s)), mesh, (seq,) * 4, ((seq, row), (seq,) * 3))
            temp, total = mib(split)
            print(f"{strategy:>10} {causal!s:>6} {layout:>10} {temp:8.1f} {temp / single:7.3f} "
                  f"{total:8.1f} {total / single_total:7.3f}")

    print(f"\ncausal work per device, busiest device / its non-causal work ({n} devices)")
    print(f"{'layout':>10} {'balance':>8} {'pairs':>6} {'steps':>6}")
    full_pairs = t * t / n
    full_steps = np.count_nonzero(block_schedule(n, t)) / n
    for layout in LAYOUTS:
        schedule = block_schedule(n, t, is_causal=True, sequence_layout=layout)
        steps = np.count_nonzero(schedule.reshape(n, -1), axis=1).max()
        print(f"{layout:>10} {causal_balance(n, t, layout):8.3f} "
              f"{causal_work(n, t, layout).max() / full_pairs:6.3f} {steps / full_steps:6.3f}")


if __name__ == "__main__":
    main()
