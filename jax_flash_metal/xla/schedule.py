"""The xla implementation's block sizes per lowering platform: the one table of them.

The primitives lower the xla implementation with ``for_platform("cpu")`` on ``cpu`` and with
``SCHEDULES["default"]`` on every other platform (cuda, rocm, tpu, METAL and the Apple-GPU
plugins), so a compiled program keeps the schedule of the platform it was lowered for. The
schedules differ in block sizes and in how the same math is laid out for the compiler: every
semantic, and every result up to float32 summation order, is the same on every platform, except
where ``half_operands`` says how half-precision inputs enter the matmuls.

- ``dense_max_len``: both lengths at most this run as one dense tile (no loops).
- ``block_q`` / ``block_k``: Br query rows by Bc keys per tile of the tiled path; causal,
  local-window, length and segment block skipping works at this granularity.
- ``inner_block``: None, or for half-precision operands (``half_operands``) where the band
  hides no pair (not causal, no local window) the extent of each loop's inner blocks: the
  forward's key blocks (Bc) and the backward's query blocks (Br: the backward loops over key
  blocks outside, query blocks inside), the other side staying ``block_q`` / ``block_k``. Fewer,
  longer inner steps: the forward rescales its running output less often and the backward
  accumulates dK/dV less often.
- ``one_pass_statistics``: for half-precision operands (``half_operands``), the dense tile's
  forward takes the row max and the row sum of exponentials in one pass over the scores
  (``xla_tiles.row_statistics``, a variadic reduction) instead of two.
- ``pinned_transposes``: the backward keeps the small transposes of dK and dV's operands as
  ops of their own (``xla_tiles``), where the compiler would otherwise fold them into a slower
  transposed-operand matmul.
- ``split_kv_decode``: a forward with few query rows over more keys than the dense tile runs
  ``decode`` (the cache read span by span, not laid out in blocks) instead of the block loops.
  On XLA:CPU its multiply-and-sum is not fused: the products of every span are stored, more
  memory than the block loops' layout copy, so the cpu schedule keeps the block loops.
- ``half_operands``: float16/bfloat16 inputs enter every matmul in their own dtype with float32
  accumulation (the scores ``scale * (q . k)`` with the scale applied in float32 after the
  product, whose half-precision products are exact in float32; P and dS rounded to the input
  dtype for their matmuls, as FlashAttention-2 does), instead of as float32 operands. The
  backward forms dS = P (dP - D) from that rounded P and from dP - D rounded to the dtype too
  (``xla_tiles.backward_tile``). Everything else (softmax, statistics, sums of gradients)
  stays float32.
"""

from __future__ import annotations

from typing import NamedTuple


class Schedule(NamedTuple):
    dense_max_len: int
    block_q: int
    block_k: int
    half_operands: bool = False
    inner_block: int | None = None
    pinned_transposes: bool = False
    one_pass_statistics: bool = False
    split_kv_decode: bool = False


SCHEDULES = {
    # No launch cost per loop iteration, cache-sized tiles, no faster half-precision matmul,
    # slower transposed operands (docs/benchmarks.md#why-the-xla-schedules).
    "cpu": Schedule(dense_max_len=256, block_q=128, block_k=128, half_operands=False,
                    pinned_transposes=True),
    # A launch per kernel of each loop iteration: few, large tiles; half-precision matrix units
    # (docs/benchmarks.md#why-the-xla-schedules). Decoding (a few query rows) reads the cache
    # span by span (split_kv_decode; an H100's figures: docs/gpu.md).
    "default": Schedule(dense_max_len=1024, block_q=1024, block_k=1024, half_operands=True,
                        inner_block=4096, one_pass_statistics=True, split_kv_decode=True),
}


def for_platform(platform: str) -> Schedule:
    """The schedule of a lowering platform name ("cpu", "cuda", "METAL", ...)."""
    return SCHEDULES.get(platform, SCHEDULES["default"])
