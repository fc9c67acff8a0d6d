"""Trace-time validation of ``flash_attention`` / ``reference_attention`` arguments.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, bad value)
with a message that names the offending argument. Nothing here looks at array contents, so it
runs at trace time under ``jit``/``vmap``/``grad``.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .. import paging
from . import arguments, dropout, variants
from .arguments import check_bool
from .contract import IMPLEMENTATIONS, UNBOUNDED, Operands, StaticParams
from .options import Options

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
ALIGNMENTS = ("top_left", "bottom_right")
INT32_MAX = 2**31 - 1


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
    """None -> 1/sqrt(head_dim); any finite real number (Python, NumPy, concrete JAX scalar) is
    used literally as a float. ValueError for NaN or +-inf, which would make every score NaN."""
    if scale is None:
        return float(1.0 / np.sqrt(head_dim))
    value = arguments.static_real(scale, "scale")
    if not np.isfinite(value):
        raise ValueError(f"scale must be a finite number or None, got {value}")
    return value


def check_soft_cap(logits_soft_cap):
    """None, or a positive finite static float c (scores become c * tanh(s / c))."""
    if logits_soft_cap is None:
        return None
    cap = arguments.static_real(logits_soft_cap, "logits_soft_cap")
    if not (np.isfinite(cap) and cap > 0):
        raise ValueError(f"logits_soft_cap must be a positive finite number or None, got {cap}")
    return cap


def check_implementation(implementation, name="implementation"):
    """None, or the names to try in order as a tuple: one name (a str) or a non-empty sequence
    of names, each in ``IMPLEMENTATIONS``; a str may list several separated by commas (as
    $JAX_FLASH_METAL_IMPLEMENTATION does). TypeError for anything but None, a str or a sequence
    of str; ValueError for an unknown name or an empty sequence."""
    if implementation is None:
        return None
    if isinstance(implementation, str):
        names = tuple(n.strip() for n in implementation.split(","))
    elif isinstance(implementation, (tuple, list)) and all(isinstance(n, str)
                                                           for n in implementation):
        names = tuple(implementation)
    else:
        raise TypeError(f"{name} must be None, a str or a sequence of str, got "
                        f"{implementation!r}")
    if not names:
        raise ValueError(f"{name} must name at least one implementation, got {implementation!r}")
    for n in names:
        if n not in IMPLEMENTATIONS:
            raise ValueError(f"{name} must be one of {IMPLEMENTATIONS}, a sequence of them or "
                             f"None, got {implementation!r}")
    return names


def check_lengths(lengths, name, batch, max_len):
    """``lengths`` (array-like integer [batch] or None) clamped exactly to [0, max_len], as int32;
    TypeError / ValueError naming ``name`` for a bad dtype or shape."""
    if lengths is None:
        return None
    # Lengths beyond the array (or negative) are clamped, so every implementation agrees and no
    # kernel ever reads outside its buffers. The clamp is exact, in the lengths' own dtype and
    # before the int32 cast; values known here (NumPy, lists) are clamped in NumPy, since
    # jnp.asarray would first wrap a 64-bit value >= 2**31 to int32.
    xp = jnp if arguments.is_jax(lengths) else np
    lengths = arguments.array_like(lengths, name, xp.asarray)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape [batch] = ({batch},), got {lengths.shape}")
    # A bound past the dtype's range would wrap in it (int8 and a length of 1000).
    top = min(max_len, int(np.iinfo(lengths.dtype).max))
    return jnp.asarray(xp.clip(lengths, 0, top), jnp.int32)


def _with_batch(x, name):
    """A rank-3 [seq_len, heads, head_dim] array as rank 4 with batch 1 (as jax.nn)."""
    if x.ndim == 3:
        return x[None]
    if x.ndim != 4:
        raise ValueError(
            f"{name} must have rank 4 [batch, seq_len, heads, head_dim] or 3 [seq_len, heads, "
            f"head_dim], got shape {x.shape}"
        )
    return x


def _check_broadcastable(x, name, full):
    """x (rank <= 4) as rank 4 with every axis 1 or the size in ``full`` ([B, H, Tq, Tkv])."""
    if x.ndim > 4:
        raise ValueError(f"{name} must have rank <= 4 (broadcastable to [batch, num_heads, q_len, "
                         f"kv_len] = {list(full)}), got shape {x.shape}")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if any(n not in (1, f) for n, f in zip(x.shape, full)):
        raise ValueError(f"{name} of shape {x.shape} is not broadcastable to [batch, num_heads, "
                         f"q_len, kv_len] = {list(full)} (each axis must be 1 or the full size)")
    return x


def _check_bias(bias, full):
    if bias is None:
        return None
    bias = arguments.as_array(bias, "bias")
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias must have a floating dtype (an additive mask uses -inf), got "
                        f"{bias.dtype}; pass boolean masks as mask")
    bias = _check_broadcastable(bias, "bias", full)
    return bias if bias.dtype in SUPPORTED_DTYPES else bias.astype(jnp.float32)


def _check_mask(mask, full):
    if mask is None:
        return None
    mask = arguments.as_array(mask, "mask")
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be a bool array (True = attend), got dtype {mask.dtype}; "
                        "pass an additive float mask as bias")
    return _check_broadcastable(mask, "mask", full)


def _check_segment_ids(query_segment_ids, key_value_segment_ids, batch, q_len, kv_len, rank3):
    if (query_segment_ids is None) != (key_value_segment_ids is None):
        given = "query_segment_ids" if key_value_segment_ids is None else "key_value_segment_ids"
        raise ValueError(f"{given} was given without its partner: pass both query_segment_ids "
                         "and key_value_segment_ids, or neither")
    if query_segment_ids is None:
        return None, None
    out = []
    for name, ids, length in (("query_segment_ids", query_segment_ids, q_len),
                              ("key_value_segment_ids", key_value_segment_ids, kv_len)):
        # NumPy and lists stay NumPy here: jnp.asarray would wrap 64-bit ids to int32 first.
        ids = arguments.array_like(ids, name, jnp.asarray if arguments.is_jax(ids) else np.asarray)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
        if rank3 and ids.ndim == 1:
            ids = ids[None]
        if ids.shape != (batch, length):
            raise ValueError(f"{name} must have shape [batch, len] = ({batch}, {length}), got "
                             f"{ids.shape}")
        out.append(ids)
    return _segment_ids_int32(*out)


def segment_ids_cast_exactly(q_dtype, kv_dtype):
    """Whether ids of these dtypes keep their equalities in a plain int32 cast (one dtype of at
    most 32 bits), so no ranking (which depends on the ids present) is needed."""
    return np.dtype(q_dtype) == np.dtype(kv_dtype) and np.dtype(q_dtype).itemsize <= 4


def _segment_ids_int32(q_ids, kv_ids):
    """Both id arrays as int32 with their equalities kept exactly (the implementations compare
    ids only for equality). Ids of one dtype of at most 32 bits are cast, which is one-to-one;
    otherwise (64-bit ids, or two dtypes whose casts could meet, e.g. int32 -1 and uint32
    2**32 - 1) each id is replaced by its rank among the ids of both arrays, compared in their
    common dtype. TypeError when there is none (uint64 with a signed dtype), or for JAX arrays
    whose common dtype is 64-bit without jax_enable_x64."""
    if segment_ids_cast_exactly(q_ids.dtype, kv_ids.dtype):
        return jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32)
    common = np.promote_types(q_ids.dtype, kv_ids.dtype)
    if not np.issubdtype(common, np.integer):  # uint64 with a signed dtype
        raise TypeError(f"query_segment_ids ({q_ids.dtype}) and key_value_segment_ids "
                        f"({kv_ids.dtype}) have no common integer dtype")
    xp = jnp if arguments.is_jax(q_ids) or arguments.is_jax(kv_ids) else np
    if xp is jnp and common.itemsize > 4 and not jax.config.jax_enable_x64:
        raise TypeError(f"query_segment_ids ({q_ids.dtype}) and key_value_segment_ids "
                        f"({kv_ids.dtype}) as JAX arrays need one dtype (their common dtype "
                        f"{common} needs jax_enable_x64): cast both to one integer dtype")
    both = xp.concatenate([q_ids.ravel().astype(common), kv_ids.ravel().astype(common)])
    if xp is np:
        ranks = np.unique(both, return_inverse=True)[1]
    else:
        ranks = jnp.unique(both, return_inverse=True, size=both.size)[1]
    ranks = jnp.asarray(ranks.reshape(-1), jnp.int32)
    return ranks[:q_ids.size].reshape(q_ids.shape), ranks[q_ids.size:].reshape(kv_ids.shape)


def _check_sinks(sinks, num_heads):
    if sinks is None:
        return None
    sinks = arguments.as_array(sinks, "sinks")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must have a floating dtype, got {sinks.dtype}")
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must have shape [num_heads] = ({num_heads},), got {sinks.shape}")
    return sinks.astype(jnp.float32)


def _check_alibi(slopes, batch, num_heads):
    """float32 [num_heads] or [batch, num_heads] -> float32 [batch, num_heads] (broadcast, so
    the gradient of a [num_heads] one is summed over the batch by autodiff)."""
    if slopes is None:
        return None
    slopes = arguments.as_array(slopes, "alibi_slopes")
    if not jnp.issubdtype(slopes.dtype, jnp.floating):
        raise TypeError(f"alibi_slopes must have a floating dtype, got {slopes.dtype}")
    if slopes.shape not in ((num_heads,), (batch, num_heads)):
        raise ValueError(f"alibi_slopes must have shape [num_heads] = ({num_heads},) or "
                         f"[batch, num_heads] = ({batch}, {num_heads}), got {slopes.shape}")
    return jnp.broadcast_to(slopes.astype(jnp.float32), (batch, num_heads))


def _check_page_table(page_table, pages, batch, rank3):
    """int32 [batch, max_pages] (a rank-3 query takes [max_pages] too), or None."""
    if page_table is None:
        return None
    xp = jnp if arguments.is_jax(page_table) else np
    table = arguments.array_like(page_table, "page_table", xp.asarray)
    if not jnp.issubdtype(table.dtype, jnp.integer):
        raise TypeError(f"page_table must have an integer dtype, got {table.dtype}")
    if rank3 and table.ndim == 1:
        table = table[None]
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(f"page_table must have shape [batch, max_pages] with batch = {batch}, "
                         f"got {table.shape}")
    if pages.shape[1] < 1:
        raise ValueError(f"key/value pages must have page_size >= 1, got shape {pages.shape}")
    if table.shape[1] * pages.shape[1] > INT32_MAX:
        raise ValueError(f"page_table: max_pages * page_size = {table.shape[1] * pages.shape[1]}"
                         f" logical keys exceeds int32")
    return jnp.asarray(table, jnp.int32)


def check_inputs(query, key, value, bias, mask, options: Options, dropout_broadcast=False):
    """Validate everything; return (q, k, v, Operands, StaticParams), q/k/v rank 4.

    ``options``: the call's keywords, for one device (``sequence_axis_name`` None; ring attention
    handles it first); ``return_lse`` is the caller's (``restore_rank``).
    ``dropout_broadcast``: one dropout mask for every batch entry and head (Flax's).
    Rank-3 query/key/value (no batch axis) get batch 1, as in jax.nn; bias and mask come back
    rank 4 (``Operands``). Raises TypeError/ValueError naming the argument. Lengths come back
    clamped int32 [batch], segment ids int32 [batch, len], sinks float32 [num_heads], ALiBi
    slopes float32 [batch, num_heads], the page table int32 [batch, max_pages] (key and value
    then stay pages, and kv_len is max_pages * page_size).
    """
    if options.sequence_axis_name is not None:
        raise ValueError("sequence_axis_name is taken by flash_attention only (ring attention)")
    if options.sequence_layout != "contiguous":
        raise ValueError(f"sequence_layout={options.sequence_layout!r} needs sequence_axis_name "
                         "(the layout of a sequence split over devices)")
    if options.sequence_strategy is not None:
        raise ValueError(f"sequence_strategy={options.sequence_strategy!r} needs "
                         "sequence_axis_name (it describes a sequence split over devices)")
    page_table = options.page_table
    q = arguments.as_array(query, "query")
    k = arguments.as_array(key, "key")
    v = arguments.as_array(value, "value")
    rank3 = q.ndim == 3
    q = _with_batch(q, "query")
    if page_table is None:
        k, v = _with_batch(k, "key"), _with_batch(v, "value")
    else:  # pages have no batch axis
        for name, x in (("key", k), ("value", v)):
            if x.ndim != 4:
                raise ValueError(f"{name} with page_table must be pages [num_pages, page_size, "
                                 f"num_kv_heads, head_dim], got shape {x.shape}")
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype must be float32, float16 or bfloat16, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.shape[:3] != v.shape[:3]:
        axes = "batch, kv_len" if page_table is None else "num_pages, page_size"
        raise ValueError(f"key and value must agree on [{axes}, num_kv_heads] (only their head "
                         f"dims may differ), got key {k.shape} and value {v.shape}")
    batch, q_len, num_heads, head_dim = q.shape
    _, kv_len, num_kv_heads, kv_head_dim = k.shape
    page_table = _check_page_table(page_table, k, batch, rank3)
    if page_table is not None:
        kv_len = paging.logical_len(k, page_table)
    elif k.shape[0] != batch:
        raise ValueError(f"key/value batch {k.shape[0]} must equal query batch {batch}")
    if kv_head_dim != head_dim:
        raise ValueError(f"key head_dim {kv_head_dim} must equal query head_dim {head_dim}")
    if head_dim < 1 or v.shape[3] < 1:
        raise ValueError(f"query/key and value head dims must be at least 1, got query "
                         f"{q.shape} and value {v.shape}")
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
    scale = check_scale(options.scale, head_dim)
    is_causal = check_bool(options.is_causal, "is_causal")
    window_left, window_right = check_window(options.local_window_size)
    alignment = options.causal_alignment
    if not isinstance(alignment, str) or alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    implementation = check_implementation(options.implementation)
    logits_soft_cap = check_soft_cap(options.logits_soft_cap)
    full = (batch, num_heads, q_len, kv_len)
    q_segments, kv_segments = _check_segment_ids(options.query_segment_ids,
                                                 options.key_value_segment_ids, batch, q_len,
                                                 kv_len, rank3)
    operands = Operands(
        q_lengths=check_lengths(options.query_seq_lengths, "query_seq_lengths", batch, q_len),
        kv_lengths=check_lengths(options.key_value_seq_lengths, "key_value_seq_lengths", batch,
                                 kv_len),
        q_segment_ids=q_segments, kv_segment_ids=kv_segments,
        bias=_check_bias(bias, full), mask=_check_mask(mask, full),
        sinks=_check_sinks(options.sinks, num_heads),
        alibi_slopes=_check_alibi(options.alibi_slopes, batch, num_heads), page_table=page_table)
    if page_table is not None and operands.kv_lengths is None:
        raise ValueError("page_table needs key_value_seq_lengths (how many keys of each row's "
                         "pages are in use)")
    dropout_rate, keep = dropout.operand(options.dropout_rate, options.dropout_rng, batch,
                                         num_heads, dropout_broadcast)
    operands = operands._replace(dropout=keep)
    params = StaticParams(
        scale=scale,
        is_causal=is_causal,
        window_left=window_left,
        window_right=window_right,
        bottom_right=alignment == "bottom_right",
        has_q_lengths=operands.q_lengths is not None,
        has_kv_lengths=operands.kv_lengths is not None,
        implementation=implementation,
        has_segment_ids=q_segments is not None,
        has_bias=operands.bias is not None,
        has_mask=operands.mask is not None,
        has_sinks=operands.sinks is not None,
        logits_soft_cap=logits_soft_cap,
        has_alibi=operands.alibi_slopes is not None,
        has_page_table=page_table is not None,
        dropout_rate=dropout_rate,
        kernel_variant=variants.from_env(),
    )
    return q, k, v, operands, params


def restore_rank(query, out, lse, return_lse):
    """out (and lse, when ``return_lse``, a bool checked here; None where the implementation
    gives none) without the batch axis that ``check_inputs`` added for a rank-3 query."""
    return_lse = check_bool(return_lse, "return_lse")
    if np.ndim(query) == 3:  # NumPy's: takes a nested list too (jnp.ndim deprecates that)
        out, lse = out[0], None if lse is None else lse[0]
    return (out, lse) if return_lse else out
