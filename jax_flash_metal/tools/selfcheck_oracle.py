"""The self-check's float64 oracle (``python -m jax_flash_metal.selfcheck``).

``dense`` is plain softmax attention written out in one dtype, with gradients by ``jax.vjp``: run
on float64 inputs (under 64-bit mode) it is the float64 oracle the self-check compares the fused
kernels with; run on the inputs' own float16/bfloat16 it is the baseline the half-precision
tolerances (``core.tolerance``) scale with.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np


def x64():
    """A context with 64-bit JAX types on (``jax.enable_x64`` where it exists, else the
    ``jax.experimental`` one of older JAX)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # JAX before enable_x64 moved to the top level

    return enable_x64()


def dense(q, k, v, do=None, *, is_causal=False, kv_lengths=None, keep=None, rate=0.0):
    """{o, lse[, dq, dk, dv]} of softmax(q k^T / sqrt(D)) v in q's dtype, as numpy arrays.

    q [B, Tq, H, D], k [B, Tkv, HKV, D], v [B, Tkv, HKV, Dv] (query head n reads key/value head
    n // (H // HKV)); ``is_causal``: key j visible to row i iff j <= i (top-left alignment);
    ``kv_lengths`` int [B]: keys past a row's length hidden; ``keep`` bool [B, H, Tq, Tkv] with
    ``rate``: dropout, kept weights scaled by 1 / (1 - rate). Every row must see a key. With
    ``do`` (the O cotangent; the LSE cotangent is 0) also the gradients.
    """
    b, tq, h, d = q.shape
    tkv, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    visible = np.ones((b, 1, 1, tq, tkv), bool)
    if is_causal:
        visible &= np.tril(np.ones((tq, tkv), bool))
    if kv_lengths is not None:
        visible &= (np.arange(tkv) < np.asarray(kv_lengths)[:, None])[:, None, None, None, :]
    weight = None
    if keep is not None:
        weight = np.where(np.asarray(keep), 1.0 / (1.0 - rate), 0.0).reshape(b, hkv, g, tq, tkv)

    def attention(q, k, v):
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(b, tq, hkv, g, d), k) * (d ** -0.5)
        s = jnp.where(visible, s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - m)
        total = jnp.sum(p, axis=-1, keepdims=True)
        lse = (m + jnp.log(total))[..., 0].reshape(b, h, tq)
        p = p / total
        if weight is not None:
            p = p * weight.astype(p.dtype)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v).reshape(b, tq, h, v.shape[-1])
        return o, lse

    (o, lse), pullback = jax.vjp(attention, q, k, v)
    out = {"o": o, "lse": lse}
    if do is not None:
        out.update(zip(("dq", "dk", "dv"), pullback((do, jnp.zeros_like(lse)))))
    return {name: np.asarray(x) for name, x in out.items()}


def oracle(arrays, **kwargs):
    """``dense`` in float64 of numpy ``arrays`` (q, k, v[, do])."""
    with x64():
        return dense(*(jnp.asarray(np.asarray(a, np.float64)) for a in arrays), **kwargs)

