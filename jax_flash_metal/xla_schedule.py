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
  ``xla_decode`` (the cache read span by span, not laid out in blocks) instead of the block
  loops. On XLA:CPU
  its fused multiply-and-sum is not fused: the products of every span are stored, more memory
  than the block loops' layout copy, so the cpu schedule keeps the block loops.
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
    # XLA:CPU runs a loop iteration's kernels at no launch cost, and a 128 x 128 float32 score
    # tile (64 KiB per batch-head) stays in cache. Up to 256 the dense tile's scores are small
    # and it saves the loops' compile time. XLA:CPU has no faster half-precision matmul, so
    # half inputs are multiplied as float32. Its matmuls read a transposed operand about 1.5x
    # slower, hence the pinned transposes. It runs a variadic reduction element by element:
    # one-pass row statistics made forward+backward 1.4-1.9x slower.
    "cpu": Schedule(dense_max_len=256, block_q=128, block_k=128, half_operands=False,
                    pinned_transposes=True),
    # Accelerators (GPUs, TPUs, Apple-GPU plugins) launch each kernel of a loop iteration
    # separately, so few, large iterations: a 1024 x 1024 tile is 2^26 scores at
    # batch x heads 64 (matmuls of a fraction of a millisecond on an H200, far above a launch)
    # and 256 MiB in float32, which keeps the temporaries flat in the length (under a quarter of
    # jax.nn's at 4096 on an H200; 1024 x 2048 and 2048 x 1024 tiles ran 5-10% faster there and
    # at 16384 but reach a quarter at 4096 causal, 2048 x 2048 goes over it).
    # Where the band skips no block, half-precision inputs take 1024 x 4096 forward tiles
    # (4096 x 1024 backward): an H200's bf16 forward+backward at 4096 took 13.3 ms against
    # 17.3 ms with 1024 x 1024 tiles and the same tile math, and 12.2 ms once P and dP - D are
    # rounded (xla_tiles), which XLA fuses into the matmuls of such tiles (16384: 218 against
    # 255 ms), at under a fifth of jax.nn's temporaries at 4096 (2048 x 4096: 3% faster, a
    # third). With causal masks they ran slower than squares (14.2 against 11.8 ms at 4096, at
    # a third of jax.nn's temporaries); float32 operands, bound by their matmuls, ran 5% faster
    # with twice the temporaries (0.29 of jax.nn's).
    # Up to 1024, one dense tile is jax.nn's algorithm at about jax.nn's memory; its row
    # statistics in one pass over the scores made bf16 forward+backward at 1024 10% faster on
    # an H200 (1.05 against 1.17 ms; 1.28 against 1.37 causal), and float32 slower
    # (non-causal 1.12 against 1.04x jax.nn's time at "highest", in two runs). In the
    # tiled forward it was slower (12.5 against 12.2 ms, bf16 at 4096): its exponentials were
    # not fused into the P V matmul, so P still took a pass of its own.
    # Half-precision operands run the matmuls on the half-precision matrix units (float32
    # operands at float32 precision ran an H200 at about 34 TFLOP/s). Its matmuls read either
    # operand layout at the same speed (pinning the transposes cost 3-4% on an H200).
    # Decoding (a few query rows): the block loops copy the whole cache into their layout first;
    # the split-KV decode copies less (an H100's figures and what is still missing: docs/gpu.md).
    "default": Schedule(dense_max_len=1024, block_q=1024, block_k=1024, half_operands=True,
                        inner_block=4096, one_pass_statistics=True, split_kv_decode=True),
}


def for_platform(platform: str) -> Schedule:
    """The schedule of a lowering platform name ("cpu", "cuda", "METAL", ...)."""
    return SCHEDULES.get(platform, SCHEDULES["default"])
