"""Ring attention's memory and work per device (prints a table; a measurement, not a test).

Usage: python benchmarks/ring_memory.py [--devices N] [--seq-len T] [--implementation I]

Runs on N host (CPU) devices, also where a GPU is the default backend (sets XLA_FLAGS and
JAX_PLATFORMS itself, before importing JAX). Compiles
forward+backward (jax.vjp: O, LSE, then dQ, dK, dV; batch 1, 4 heads, head dim 64, float32) of
flash_attention over the whole sequence on one device, and of the same call split over N
devices with sequence_axis_name inside shard_map (ring_attention.py), and prints XLA's
temporary memory per device (memory_analysis(); the ring's program is the per-device one), the
same with the arguments and outputs added, and the block steps of the ring's schedule
(ring_attention.block_schedule: the pairs of query and key pieces that run a primitive call,
each direction), causal and not. For a fused implementation ("emulator", "metal") the one-device
call's temporary memory is nearly nothing: its kernels' working memory is the FFI handler's,
outside XLA's accounting, so compare the totals there.
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
    from jax_flash_metal.ring_attention import block_schedule, shard_map

    n, t = args.devices, args.seq_len
    x = jax.ShapeDtypeStruct((1, t, 4, 64), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:n]), ("sp",))
    seq = P(None, "sp")

    def grads(attention):
        def run(q, k, v, do):
            out, vjp = jax.vjp(attention, q, k, v)
            return out, vjp((do, jnp.zeros(out[1].shape, jnp.float32)))
        return run

    def mib(f):
        """(temporary, arguments + outputs + temporary) MiB per device."""
        m = jax.jit(f).lower(x, x, x, x).compile().memory_analysis()
        temp = m.temp_size_in_bytes
        return temp / 2**20, (temp + m.argument_size_in_bytes + m.output_size_in_bytes) / 2**20

    print(f"T={t}, batch 1, 4 heads, head dim 64, float32, {args.implementation}, "
          f"{n} devices")
    print(f"{'causal':>7} {'temp: 1 device':>15} {'ring/dev':>9} {'ratio':>6} "
          f"{'total: 1 device':>16} {'ring/dev':>9} {'ratio':>6} {'block steps':>12}  (MiB)")
    steps = {}
    for causal in (False, True):
        def attention(q, k, v, **kw):
            return flash_attention(q, k, v, is_causal=causal, return_lse=True,
                                   implementation=args.implementation, **kw)

        ring = shard_map(grads(lambda q, k, v: attention(q, k, v, sequence_axis_name="sp")),
                         mesh, (seq,) * 4, ((seq, P(None, None, "sp")), (seq,) * 3))
        (single, single_total), (sharded, sharded_total) = mib(grads(attention)), mib(ring)
        steps[causal] = np.count_nonzero(block_schedule(n, t, is_causal=causal))
        print(f"{causal!s:>7} {single:15.1f} {sharded:9.1f} {sharded / single:6.3f} "
              f"{single_total:16.1f} {sharded_total:9.1f} {sharded_total / single_total:6.3f} "
              f"{steps[causal]:12d}")
    print(f"causal / non-causal block steps: {steps[True] / steps[False]:.3f}")


if __name__ == "__main__":
    main()
