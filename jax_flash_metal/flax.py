"""``attention_fn`` for Flax: ``flash_attention`` behind Flax's attention-function signature.

Use it as ``flax.nnx.MultiHeadAttention(..., attention_fn=attention_fn)`` or
``flax.linen.MultiHeadDotProductAttention(..., attention_fn=attention_fn)``. Needs the ``[flax]``
extra; importing ``jax_flash_metal`` itself does not import Flax.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._extras import needs
from .attention import attend
from .core.contract import Implementation
from .core.options import Options

with needs("flax", "jax_flash_metal.flax", ("flax",)):
    from flax.linen.dtypes import canonicalize_dtype


def _refuse(name: str, value: Any, why: str) -> None:
    raise NotImplementedError(f"jax_flash_metal.flax.attention_fn: {name}={value!r} cannot be "
                              f"honoured: {why}")


def _one_batch_axis(x: jax.Array | None, batch_shape: tuple[int, ...], name: str):
    """A mask or bias broadcastable to [batch..., heads, q_len, kv_len] as
    [prod(batch), heads or 1, q_len or 1, kv_len or 1] (None stays None)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    rank = len(batch_shape) + 3
    if x.ndim > rank:
        raise ValueError(f"{name} has shape {x.shape}: rank {x.ndim} is more than the {rank} of "
                         f"[batch..., num_heads, q_len, kv_len] with batch axes {batch_shape}")
    x = x.reshape((1,) * (rank - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, batch_shape + x.shape[len(batch_shape):])
    return x.reshape((math.prod(batch_shape),) + x.shape[len(batch_shape):])


def attention_fn(query: jax.Array, key: jax.Array, value: jax.Array,
                 bias: jax.Array | None = None, mask: jax.Array | None = None,
                 broadcast_dropout: bool = True, dropout_rng: jax.Array | None = None,
                 dropout_rate: float = 0.0, deterministic: bool = False, dtype: Any = None,
                 precision: Any = None, module: Any = None,
                 promote_dtype: Callable[..., Any] | None = None, is_causal: bool = False,
                 force_fp32_for_softmax: bool = False,
                 einsum_dot_general: Callable[..., Any] | None = None,
                 qk_attn_weights_einsum: Callable[..., Any] | None = None,
                 attn_weights_value_einsum: Callable[..., Any] | None = None,
                 input_positions: jax.Array | None = None,
                 implementation: Implementation | None = None) -> jax.Array:
    """Flax's ``dot_product_attention`` contract, computed by ``flash_attention``.

    Takes every argument ``flax.nnx.MultiHeadAttention`` and ``flax.linen.
    MultiHeadDotProductAttention`` pass (linen passes only those a function names, so all are
    named here), with the meaning of ``flax.nnx.dot_product_attention`` /
    ``flax.linen.dot_product_attention``:
      query [batch..., q_len, num_heads, head_dim]; key, value [batch..., kv_len, num_kv_heads,
      head_dim] (any number of leading batch axes, also none; num_heads % num_kv_heads == 0).
      bias (float) and mask (bool, True = attend) broadcastable to [batch..., num_heads, q_len,
      kv_len], as Flax's, including nnx's and linen's decode-cache mask; is_causal adds a causal
      mask (key j visible to query i iff j <= i). Scores are scaled by 1/sqrt(head_dim).
      dtype: the computation dtype; None promotes query, key and value as Flax does
      (``promote_dtype``, or ``flax.linen.dtypes.canonicalize_dtype`` when None). It must be
      float32, float16 or bfloat16 (flash_attention's dtypes).
      force_fp32_for_softmax: always honoured (the softmax is float32 for every dtype).
      dropout_rate, dropout_rng, deterministic, broadcast_dropout: attention dropout, active
        when dropout_rate > 0 and not deterministic, as flash_attention's (dropout_rng
        required then; O = (P * M / (1 - rate)) V with M = ``jax_flash_metal.dropout_mask``
        over the flattened batch axes); broadcast_dropout=True (Flax's default) uses one mask
        for every batch entry and head, M[0, 0], as Flax broadcasts its mask.
      implementation: flash_attention's (bind it with functools.partial; Flax never passes it).
    Returns:
      [batch..., q_len, num_heads, head_dim] in the computation dtype.
    Raises:
      NotImplementedError for what flash_attention cannot honour: ``module``
      (``sow_weights=True``: the attention weights are never formed), ``precision`` other than
      None (the products are computed at flash_attention's fixed precision with float32
      accumulation), custom einsums (``einsum_dot_general``, ``qk_attn_weights_einsum``,
      ``attn_weights_value_einsum``), ``input_positions`` (rotary embeddings inside the
      attention function), and an explicit fused ``implementation`` with active dropout.
      ValueError for key/value batch axes or lengths that differ from the query's, or a mask or
      bias of too high a rank, or active dropout without dropout_rng; flash_attention's errors
      for everything else.
    Difference from Flax: a query row whose every key is masked outputs 0 (Flax: the mean of the
    values), as flash_attention documents.
    """
    if module is not None:
        _refuse("module", type(module).__name__, "the attention weights are never formed, so "
                "they cannot be sown (sow_weights=True)")
    if precision is not None:
        _refuse("precision", precision, "flash_attention computes its products at a fixed "
                "precision with float32 accumulation; pass precision=None")
    for name, fn in (("einsum_dot_general", einsum_dot_general),
                     ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                     ("attn_weights_value_einsum", attn_weights_value_einsum)):
        if fn is not None:
            _refuse(name, fn, "flash_attention computes its products in its own kernels")
    if input_positions is not None:
        _refuse("input_positions", "<array>", "apply rotary embeddings to query and key before "
                "the attention function")

    if promote_dtype is None:
        dtype = canonicalize_dtype(query, key, value, dtype=dtype)
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    else:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)

    batch_shape = query.shape[:-3]
    for name, x in (("key", key), ("value", value)):
        if x.shape[:-3] != batch_shape:
            raise ValueError(f"{name} has batch axes {x.shape[:-3]}, query has {batch_shape}")
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(f"key and value lengths differ: {key.shape[-3]} and {value.shape[-3]}")
    bias, mask = (_one_batch_axis(x, batch_shape, name) for name, x in (("bias", bias),
                                                                         ("mask", mask)))
    if mask is not None:
        mask = mask.astype(jnp.bool_)  # Flax also takes 0/1 float masks
    b = math.prod(batch_shape)
    q, k, v = (x.reshape((b,) + x.shape[-3:]) for x in (query, key, value))
    options = Options(is_causal=is_causal, implementation=implementation)
    if dropout_rate > 0.0 and not deterministic:
        options = options._replace(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    out = attend(q, k, v, bias, mask, options, dropout_broadcast=bool(broadcast_dropout))
    return out.reshape(query.shape[:-1] + value.shape[-1:])
