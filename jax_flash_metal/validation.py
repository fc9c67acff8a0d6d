"""Trace-time validation of ``flash_attention`` / ``reference_attention`` arguments.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, bad value)
with a message that names the offending argument. Nothing here looks at array contents, so it
runs at trace time under ``jit``/``vmap``/``grad``.
"""

from __future__ import annotations

import numbers
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
IMPLEMENTATIONS = ("xla", "emulator", "metal")
ALIGNMENTS = ("top_left", "bottom_right")
ENV_IMPLEMENTATION = "JAX_FLASH_METAL_IMPLEMENTATION"
INT32_MAX = 2**31 - 1
UNBOUNDED = -1  # window bound sentinel, same value as JFM_UNBOUNDED in shaders/attention_params.h


class StaticParams(NamedTuple):
    """The static parameters of both primitives, with their exact types (primitives.py)."""

    scale: float
    is_causal: bool
    window_left: int
    window_right: int
    bottom_right: bool
    has_q_lengths: bool
    has_kv_lengths: bool
    implementation: str | None


def _as_array(x, name):
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "__jax_array__"):
        return jnp.asarray(x)
    # Tracers are jax.Array instances; anything else (lists, scalars, None) is rejected.
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def _check_bool(value, name):
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}")


def _window_bound(value, name):
    if value is None:
        return UNBOUNDED
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a non-negative int or None, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int or None, got {value}")
    # Lengths are int32, so a bound past INT32_MAX reaches as far as no bound at all; clamping
    # keeps it representable in the kernels' int32 parameters.
    return min(int(value), INT32_MAX)


def check_window(local_window_size):
    """Return (left, right) with -1 for an unbounded side. An int w means (w, w)."""
    if local_window_size is None:
        return UNBOUNDED, UNBOUNDED
    if isinstance(local_window_size, numbers.Integral) and not isinstance(
        local_window_size, (bool, np.bool_)
    ):
        w = _window_bound(local_window_size, "local_window_size")
        return w, w
    if isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(
                "local_window_size must be an int or a (left, right) pair, got "
                f"{len(local_window_size)} values: {local_window_size!r}"
            )
        return (
            _window_bound(local_window_size[0], "local_window_size[0] (left)"),
            _window_bound(local_window_size[1], "local_window_size[1] (right)"),
        )
    raise TypeError(
        "local_window_size must be None, an int or a (left, right) pair of ints, got "
        f"{local_window_size!r}"
    )


def check_scale(scale, head_dim):
    """None -> 1/sqrt(head_dim); any real Python/NumPy number is used literally as a float."""
    if scale is None:
        return float(1.0 / np.sqrt(head_dim))
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(
            "scale must be None or a Python/NumPy real number (a static value, not an array), "
            f"got {scale!r} of type {type(scale).__name__}"
        )
    return float(scale)


def check_implementation(implementation, name="implementation"):
    if implementation is None:
        return None
    if not isinstance(implementation, str):
        raise TypeError(f"{name} must be None or a str, got {implementation!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{name} must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    return implementation


def env_implementation():
    """The implementation named by $JAX_FLASH_METAL_IMPLEMENTATION, or None when unset/empty."""
    value = os.environ.get(ENV_IMPLEMENTATION, "").strip()
    return check_implementation(value, f"${ENV_IMPLEMENTATION}") if value else None


def _check_lengths(lengths, name, batch, max_len):
    if lengths is None:
        return None
    lengths = _as_array(lengths, name)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape [batch] = ({batch},), got {lengths.shape}")
    # Lengths beyond the array (or negative) are clamped, so every implementation agrees and no
    # kernel ever reads outside its buffers.
    return jnp.clip(lengths, 0, max_len).astype(jnp.int32)


def check_inputs(
    query,
    key,
    value,
    *,
    scale,
    is_causal,
    local_window_size,
    query_seq_lengths,
    key_value_seq_lengths,
    causal_alignment,
    implementation=None,
):
    """Validate everything; return (q, k, v, q_lengths|None, kv_lengths|None, StaticParams).

    Raises TypeError/ValueError naming the argument. Lengths come back as int32 [batch].
    """
    q = _as_array(query, "query")
    k = _as_array(key, "key")
    v = _as_array(value, "value")
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq_len, heads, head_dim], got shape {x.shape}"
            )
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype must be float32, float16 or bfloat16, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.shape != v.shape:
        raise ValueError(
            "key and value must have the same shape [batch, kv_len, num_kv_heads, head_dim], got "
            f"key {k.shape} and value {v.shape}"
        )
    batch, q_len, num_heads, head_dim = q.shape
    _, kv_len, num_kv_heads, kv_head_dim = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"key/value batch {k.shape[0]} must equal query batch {batch}")
    if kv_head_dim != head_dim:
        raise ValueError(f"key/value head_dim {kv_head_dim} must equal query head_dim {head_dim}")
    if head_dim < 1:
        raise ValueError(f"query head_dim must be at least 1, got shape {q.shape}")
    if num_kv_heads < 1 or num_heads < 1:
        raise ValueError(
            f"query and key/value need at least one head, got num_heads={num_heads}, "
            f"num_kv_heads={num_kv_heads}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query num_heads ({num_heads}) must be a multiple of key/value num_kv_heads "
            f"({num_kv_heads})"
        )
    scale = check_scale(scale, head_dim)
    is_causal = _check_bool(is_causal, "is_causal")
    window_left, window_right = check_window(local_window_size)
    if not isinstance(causal_alignment, str) or causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    implementation = check_implementation(implementation)
    q_lengths = _check_lengths(query_seq_lengths, "query_seq_lengths", batch, q_len)
    kv_lengths = _check_lengths(key_value_seq_lengths, "key_value_seq_lengths", batch, kv_len)
    params = StaticParams(
        scale=scale,
        is_causal=is_causal,
        window_left=window_left,
        window_right=window_right,
        bottom_right=causal_alignment == "bottom_right",
        has_q_lengths=q_lengths is not None,
        has_kv_lengths=kv_lengths is not None,
        implementation=implementation,
    )
    return q, k, v, q_lengths, kv_lengths, params
