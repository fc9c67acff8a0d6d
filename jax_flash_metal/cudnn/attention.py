"""The "cudnn" implementation: ``jax.nn.dot_product_attention(..., implementation="cudnn")``
(NVIDIA's cuDNN flash attention, through JAX's public API) for the calls it computes exactly as
``flash_attention`` defines them, and the one static predicate that says which those are.

``unsupported_reason`` mirrors the checks JAX makes before it calls cuDNN
(jax/_src/nn/functions.py and jax/_src/cudnn/fused_attention_stablehlo.py, jax 0.5.0 through
0.12: ``check_layout``, ``check_is_flash_attention`` and the window rule of
``dot_product_attention``) and adds ours: a feature jax.nn's cuDNN path lacks (soft cap, sinks,
ALiBi, our dropout, a page table, segment ids, gradients through the returned LSE), or a
semantic it does not keep (a bias or mask can hide every key of a row, which would not output
0; bottom-right causal alignment with lengths). It looks only at static facts (shapes, dtypes,
static params and the device), so the choice is made at trace time. docs/gpu.md has the rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..core import visibility
from ..core._jax_private import cudnn_version

DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def device_facts():
    """(reason or None, compute capability (major, minor) or None, cuDNN version or None) of the
    default device: the reason says why cuDNN cannot run there (not an NVIDIA GPU, or no cuDNN
    loaded)."""
    device = jax.devices()[0]
    if platform_of(device) != "cuda":
        return (f"the default device is {device.platform!r}, not an NVIDIA GPU (cuDNN runs on "
                "CUDA devices only)"), None, None
    version = cudnn_version()
    if version is None:
        return "cuDNN is not loaded by this jaxlib (no CUDA plugin with cuDNN)", None, None
    capability = tuple(int(x) for x in str(device.compute_capability).split(".")[:2])
    return None, capability, version


def platform_of(device) -> str:
    """A device's lowering platform: "cuda" or "rocm" for a GPU (JAX names both "gpu"), else
    ``device.platform``."""
    if device.platform != "gpu":
        return device.platform
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version else "cuda"


def max_head_dim(capability, version) -> int:
    """The largest head dim cuDNN's flash attention takes: 256 from Hopper (compute capability
    9.0) with cuDNN 9.5, else 128 (``check_is_flash_attention``: jax 0.5.0 asks for both, newer
    JAX for Hopper only, which ships with a newer cuDNN)."""
    return 256 if capability >= (9, 0) and version >= 90500 else 128


def unsupported_reason(q, k, v, params, *, return_lse, capability, version) -> str | None:
    """Why cuDNN cannot run this call exactly as flash_attention defines it, or None.

    Args:
      q, k, v: the validated rank-4 query [B, Tq, H, Dk], key and value [B, Tkv, HKV, D] (or
        pages with ``params.has_page_table``): anything with ``shape`` and ``dtype``.
      params: the call's ``contract.StaticParams``.
      return_lse: whether the caller gets the LSE (jax.nn's cuDNN backward drops its
        cotangent, so gradients through it would be silently wrong).
      capability, version: the device's compute capability (major, minor) and cuDNN version
        (``device_facts``).
    """
    batch, q_len, _, head_dim = q.shape
    kv_len, value_dim = k.shape[1], v.shape[3]
    if jnp.dtype(q.dtype) not in DTYPES:
        return f"dtype {jnp.dtype(q.dtype)}: cuDNN flash attention takes float16 and bfloat16"
    if value_dim != head_dim:
        return (f"value head dim {value_dim} differs from the query/key head dim {head_dim} "
                "(jax.nn's cuDNN path needs them equal)")
    limit = max_head_dim(capability, version)
    if head_dim % 8 or head_dim > limit:
        return (f"head dim {head_dim}: cuDNN takes multiples of 8 up to {limit} on this device "
                f"(compute capability {'.'.join(map(str, capability))}, cuDNN {version})")
    if 0 in (batch, q_len, kv_len):
        return "an empty problem (a zero batch or length)"
    lacking = [name for name, present in (
        ("logits_soft_cap", params.logits_soft_cap is not None),
        ("sinks", params.has_sinks), ("alibi_slopes", params.has_alibi),
        ("dropout_rate > 0 (our dropout mask)", params.dropout_rate > 0),
        ("page_table", params.has_page_table),
        ("query_segment_ids / key_value_segment_ids", params.has_segment_ids),
        ("return_lse=True (jax.nn's cuDNN backward drops the LSE's cotangent)", return_lse),
    ) if present]
    if lacking:
        return f"{lacking[0]} is not available through jax.nn's cuDNN attention"
    if params.has_bias or params.has_mask:
        return ("a bias or mask can hide every key of a row, which must output 0; cuDNN (with "
                "the mask folded into a finite bias by jax.nn) would not")
    band = params.is_causal or params.window_left >= 0 or params.window_right >= 0
    if band and not params.is_causal:
        return ("local_window_size without is_causal: cuDNN's sliding window has no keys "
                "right of the diagonal (jax.nn takes (left, 0) windows only)")
    if band and params.bottom_right and not _bottom_right_is_top_left(params, q_len, kv_len):
        return ("causal_alignment='bottom_right' where its diagonal is not the top-left one "
                "(per-batch lengths, q_len != kv_len, or a window at q_len 1): jax.nn's cuDNN "
                "path aligns the causal diagonal top-left")
    return None


def _bottom_right_is_top_left(params, q_len, kv_len) -> bool:
    """Whether a bottom-right causal band is what top-left causal (or no band) gives: equal
    lengths without per-batch lengths (offset 0), or one query row and no window (that row
    sees every valid key: ``attend`` then drops the causal mask)."""
    no_lengths = not (params.has_q_lengths or params.has_kv_lengths)
    return (no_lengths and q_len == kv_len) or (q_len == 1 and params.window_left < 0)


def attend(q, k, v, operands, params):
    """flash_attention's output [B, Tq, H, Dv] for a call ``unsupported_reason`` accepts, from
    ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (differentiable through its
    cuDNN backward). Rows that see no key (past ``query_seq_lengths``, a zero
    ``key_value_seq_lengths``, or before a window's reach) are set to exactly 0."""
    batch, q_len, _, _ = q.shape
    kv_len = k.shape[1]
    causal = params.is_causal and not (params.bottom_right and q_len == 1)
    # A left bound reaching past every key is no bound (and keeps cuDNN's window length,
    # left + 1, within int32).
    left = params.window_left if 0 <= params.window_left < q_len + kv_len else -1
    window = (left, 0) if causal and left >= 0 else None
    out = jax.nn.dot_product_attention(
        q, k, v, scale=params.scale, is_causal=causal, query_seq_lengths=operands.q_lengths,
        key_value_seq_lengths=operands.kv_lengths, local_window_size=window,
        implementation="cudnn")
    band = visibility.Band(batch, q_len, kv_len, operands.q_lengths, operands.kv_lengths,
                           is_causal=causal, window_left=left if causal else -1,
                           window_right=-1, bottom_right=False)
    lo, hi = band.key_intervals(np.arange(q_len, dtype=np.int32))
    if isinstance(hi, np.ndarray) and bool(np.all(hi > lo)):
        return out  # every row sees a key
    return jnp.where((hi > lo)[:, :, None, None], out, jnp.zeros((), out.dtype))
