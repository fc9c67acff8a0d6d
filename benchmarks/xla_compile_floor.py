"""The compile-time floor of a loop-based FlashAttention-2 on XLA:CPU (prints a table; a model
of where the xla implementation's compile time goes, not a test).

Usage: python benchmarks/xla_compile_floor.py [--seq-len T] [--rounds R]

Compiles forward+backward (batch 2, 8 heads, head dim 64, float32, not causal) of
jax.nn.dot_product_attention, of flash_attention(implementation="xla"), and of two bare
FlashAttention-2s written here with nothing but the algorithm (no masks, lengths, score
features, grouped-query heads or NaN placement; T a multiple of 128):
- "two loops": query blocks, and in each the key blocks (the xla implementation's structure,
  which lets it skip blocks outside a causal or local band);
- "one loop": every query row against one key block per step (nothing can be skipped).
XLA:CPU compiles every fusion of a program as its own kernel, a few ms each, so the fusion
count sets the compile time; loops need fusions for their bodies, state and indices that a
loop-free program does not. Compile seconds are the median of R fresh jax.jit compiles, as in
python -m jax_flash_metal.benchmark.
"""

import argparse
import re
import statistics

import jax
import jax.numpy as jnp

from jax_flash_metal import flash_attention
from jax_flash_metal.tools.benchmark_model import compile_seconds, inputs
from jax_flash_metal.tools.cli import HelpFormatter, add_flags

BLOCK = 128


def _dot(spec, a, b):
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)


def _heads(x):
    """[B, T, H, D] <-> [B, H, T, D]."""
    return x.transpose(0, 2, 1, 3)


def _blocks(x):
    """[B, H, T, ...] -> [T / BLOCK, B, H, BLOCK, ...]."""
    b, h, t = x.shape[:3]
    return jnp.moveaxis(x.reshape(b, h, t // BLOCK, BLOCK, *x.shape[3:]), 2, 0)


def _unblocks(x):
    n, b, h, r = x.shape[:4]
    return jnp.moveaxis(x, 0, 2).reshape(b, h, n * r, *x.shape[4:])


def _softmax_step(state, q, k, v):
    """One online-softmax step of queries q against one key block: state (m, l, acc)."""
    m, l, acc = state
    s = _dot("bhqd,bhkd->bhqk", q, k)
    m_new = jnp.maximum(m, s.max(-1))
    p, alpha = jnp.exp(s - m_new[..., None]), jnp.exp(m - m_new)
    return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + _dot("bhqk,bhkd->bhqd", p, v)


def _start(q):
    return jnp.full(q.shape[:-1], -1e30), jnp.zeros(q.shape[:-1]), jnp.zeros(q.shape)


def _finish(state):
    m, l, acc = state
    return acc / l[..., None], m + jnp.log(l)


def _backward_step(q, lse, delta, do, k, v):
    """dQ, dK, dV contributions of queries q against one key block."""
    p = jnp.exp(_dot("bhqd,bhkd->bhqk", q, k) - lse[..., None])
    ds = p * (_dot("bhqd,bhkd->bhqk", do, v) - delta[..., None])
    return (_dot("bhqk,bhkd->bhqd", ds, k), _dot("bhqk,bhqd->bhkd", ds, q),
            _dot("bhqk,bhqd->bhkd", p, do))


def _bare(one_loop):
    """A bare FlashAttention-2 (custom_vjp) with one or two loop levels per direction; q, k, v
    [B, H, T, D] inside."""
    @jax.custom_vjp
    def attention(q, k, v):
        return forward(q, k, v)[0]

    def forward(q, k, v):
        qh, kb, vb = _heads(q) / 8.0, _blocks(_heads(k)), _blocks(_heads(v))
        if one_loop:
            state = jax.lax.scan(lambda st, kv: (_softmax_step(st, qh, *kv), None),
                                 _start(qh), (kb, vb))[0]
            o, lse = _finish(state)
        else:
            def query_block(_, q_r):
                return None, _finish(jax.lax.fori_loop(
                    0, kb.shape[0], lambda c, st: _softmax_step(st, q_r, kb[c], vb[c]),
                    _start(q_r)))
            o, lse = map(_unblocks, jax.lax.scan(query_block, None, _blocks(qh))[1])
        o = _heads(o)
        return o, (q, k, v, o, lse)

    def backward(res, do):
        q, k, v, o, lse = res
        qh, kb, vb, doh = _heads(q) / 8.0, _blocks(_heads(k)), _blocks(_heads(v)), _heads(do)
        delta = jnp.einsum("bqhd,bqhd->bhq", do, o)
        if one_loop:
            def key_block(dq, kv):
                part = _backward_step(qh, lse, delta, doh, *kv)
                return dq + part[0], part[1:]
            dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qh.shape), (kb, vb))
        else:
            qb, lse_b, delta_b, dob = map(_blocks, (qh, lse, delta, doh))

            def key_block(dq, kv):
                def query_block(r, acc):
                    dq, dk, dv = acc
                    part = _backward_step(qb[r], lse_b[r], delta_b[r], dob[r], *kv)
                    return dq.at[r].add(part[0]), dk + part[1], dv + part[2]
                zeros = jnp.zeros(kv[0].shape)
                dq, dk, dv = jax.lax.fori_loop(0, qb.shape[0], query_block, (dq, zeros, zeros))
                return dq, (dk, dv)
            dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qb.shape), (kb, vb))
            dq = _unblocks(dq)
        return _heads(dq) / 8.0, _heads(_unblocks(dk)), _heads(_unblocks(dv))

    attention.defvjp(forward, backward)
    return lambda q, k, v, causal: attention(q, k, v)


METHODS = {
    "jax.nn": lambda q, k, v, causal: jax.nn.dot_product_attention(q, k, v, is_causal=causal),
    "flash:xla": lambda q, k, v, causal: flash_attention(q, k, v, is_causal=causal,
                                                         implementation="xla"),
    "bare FA-2, two loops": _bare(one_loop=False),
    "bare FA-2, one loop": _bare(one_loop=True),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    add_flags(parser, notes=dict(seq_len=f"a multiple of {BLOCK}",
                                 rounds="interleaved compiles; the median is shown"),
              seq_len=1024, rounds=5)
    args = parser.parse_args()
    if args.seq_len % BLOCK:
        parser.error(f"--seq-len must be a multiple of {BLOCK}")
    q, k, v, ct = inputs(batch=2, seq_len=args.seq_len, heads=8, kv_heads=8, head_dim=64,
                         dtype=jnp.float32)
    results = {}
    for _ in range(args.rounds):  # interleaved rounds, as the benchmark's compile time
        for name, fn in METHODS.items():
            compiled, seconds = compile_seconds(fn, False, q, k, v, ct)
            results.setdefault(name, [compiled, []])[1].append(seconds)
    base = statistics.median(results["jax.nn"][1])
    print(f"forward+backward compile, T={args.seq_len}, not causal, jax {jax.__version__}")
    print(f"{'method':<22}{'compile s':>10}{'x jax.nn':>10}{'fusions':>9}")
    for name, (compiled, times) in results.items():
        seconds = statistics.median(times)
        fusions = len(re.findall(r" fusion\(", compiled.as_text()))
        print(f"{name:<22}{seconds:>10.3f}{seconds / base:>10.2f}{fusions:>9}")


if __name__ == "__main__":
    main()
