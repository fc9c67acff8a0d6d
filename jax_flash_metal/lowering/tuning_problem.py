"""The problem the autotuner times for a call being lowered
(docs/tuning.md#what-is-timed-and-checked): the call's shapes, dtype and features, with the
lengths and batch capped so that timing every variant and the xla reference check stays cheap,
and synthetic operands that give every feature real work (full lengths, a random bias, a page
table that reads every page).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from ..core import contract, dropout

# Query rows and score entries of the timed problem: above them the variants' ranking no
# longer changes (every GPU core is busy), while the reference check grows with them.
MAX_ROWS, MAX_ROW_KEYS, MAX_SCORES = 1024, 1 << 20, 1 << 24
MAX_KEYS = 1 << 15


@dataclasses.dataclass(frozen=True)
class Problem:
    """One timed problem: ``direction`` "fwd" or "bwd", the query/key/value shapes (kv_len the
    logical length; ``page_size`` for a paged cache, else 0), the bias and mask shapes (each axis
    1 or full; None when absent) and the primitive's static ``params``."""

    direction: str
    dtype: str
    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    value_head_dim: int
    page_size: int
    bias: tuple | None
    mask: tuple | None
    params: tuple  # sorted (name, value) pairs

    @property
    def options(self) -> dict:
        return dict(self.params)

    def capped(self) -> "Problem":
        """This problem with q_len, kv_len and batch cut to the timed sizes (MAX_*)."""
        q = min(self.q_len, MAX_ROWS)
        kv = min(self.kv_len, max(MAX_ROWS, MAX_ROW_KEYS // q), MAX_KEYS)
        if self.page_size:  # whole pages
            kv = -(-kv // self.page_size) * self.page_size
        batch = max(1, min(self.batch, MAX_SCORES // (self.heads * q * kv)))
        full = (self.batch, self.heads, self.q_len, self.kv_len)
        cut = (batch, self.heads, q, kv)

        def broadcast(shape):
            return None if shape is None else tuple(
                c if n == f and f != 1 else n for n, f, c in zip(shape, full, cut))
        return dataclasses.replace(self, batch=batch, q_len=q, kv_len=kv,
                                   bias=broadcast(self.bias), mask=broadcast(self.mask))

    def features(self) -> str:
        """The feature class of the key: the features present, or "plain"."""
        p = self.options
        on = {"causal": p["is_causal"],
              "window": (p["window_left"], p["window_right"]) != (contract.UNBOUNDED,) * 2,
              "lengths": p["has_q_lengths"] or p["has_kv_lengths"],
              "segments": p["has_segment_ids"], "bias": p["has_bias"], "mask": p["has_mask"],
              "sinks": p["has_sinks"], "softcap": p["logits_soft_cap"] is not None,
              "alibi": p["has_alibi"], "paged": p["has_page_table"],
              "dropout": p["dropout_rate"] > 0, "dbias": p.get("bias_grad", False),
              "dslopes": p.get("alibi_grad", False)}
        return "+".join(name for name, present in on.items() if present) or "plain"

    def length_bucket(self) -> str:
        """Powers of two at or above the (capped) query and key lengths."""
        up = lambda n: 1 << max(0, math.ceil(math.log2(max(n, 1))))
        return f"q{up(self.q_len)}_kv{up(self.kv_len)}"

    def forward_operands(self, rng: np.random.Generator) -> list:
        """q, k, v and the optional operands of the forward primitive, in operand order."""
        p, dtype = self.options, jnp.dtype(self.dtype)
        normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
        b, tq, tkv, hkv = self.batch, self.q_len, self.kv_len, self.kv_heads
        kv_shape = (b, tkv, hkv)
        x: dict = {}
        if self.page_size:
            pages = tkv // self.page_size
            kv_shape = (b * pages, self.page_size, hkv)
            x["page_table"] = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
        if p["has_q_lengths"]:
            x["q_lengths"] = jnp.full((b,), tq, jnp.int32)
        if p["has_kv_lengths"]:
            x["kv_lengths"] = jnp.full((b,), tkv, jnp.int32)
        if p["has_segment_ids"]:
            x["q_segment_ids"] = jnp.zeros((b, tq), jnp.int32)
            x["kv_segment_ids"] = jnp.zeros((b, tkv), jnp.int32)
        if self.bias is not None:
            x["bias"] = normal(*self.bias)
        if self.mask is not None:
            x["mask"] = jnp.ones(self.mask, bool)
        if p["has_sinks"]:
            x["sinks"] = jnp.asarray(rng.standard_normal(self.heads), jnp.float32)
        if p["has_alibi"]:
            x["alibi_slopes"] = jnp.full((b, self.heads), 0.1, jnp.float32)
        if p["dropout_rate"] > 0:
            key = jnp.asarray(rng.integers(0, 1 << 32, 2, dtype=np.uint32))
            x["dropout"] = dropout.operand(p["dropout_rate"], key, b, self.heads)[1]
        return [normal(b, tq, self.heads, self.head_dim), normal(*kv_shape, self.head_dim),
                normal(*kv_shape, self.value_head_dim), *contract.Operands(**x).present()]


def from_avals(direction: str, avals, params: dict) -> Problem:
    """The Problem of a primitive call with operands ``avals`` and static ``params``."""
    roles = contract.operand_roles(direction, params)
    q, k, v = avals[:3]
    page_size, kv_len = 0, k.shape[1]
    if params.get("has_page_table"):
        page_size = k.shape[1]
        kv_len = avals[roles.index("page_table")].shape[1] * page_size
    shape = lambda role: tuple(avals[roles.index(role)].shape) if role in roles else None
    return Problem(direction, jnp.dtype(q.dtype).name, q.shape[0], q.shape[1], kv_len,
                   q.shape[2], k.shape[2], q.shape[3], v.shape[3], page_size, shape("bias"),
                   shape("mask"), tuple(sorted(params.items())))


def upcast(arrays, dtype) -> list:
    """``arrays`` with those of ``dtype`` (the call's half-precision operands) in float32."""
    return [x.astype(jnp.float32) if x.dtype == dtype else x for x in arrays]

