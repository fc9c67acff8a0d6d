"""The xla implementation's block sizes per lowering platform: the one table of them.

The primitives lower the xla implementation with ``for_platform("cpu")`` on ``cpu`` and with
``SCHEDULES["default"]`` on every other platform (cuda, rocm, tpu, METAL and the Apple-GPU
plugins), so a compiled program keeps the schedule of the platform it was lowered for. The
schedules differ only in block sizes: the math, and so every semantic and every result up to
float32 summation order, is the same on every platform.

- ``dense_max_len``: both lengths at most this run as one dense tile (no loops).
- ``block_q`` / ``block_k``: Br query rows by Bc keys per tile of the tiled path; causal,
  local-window, length and segment block skipping works at this granularity.
"""

from __future__ import annotations

from typing import NamedTuple


class Schedule(NamedTuple):
    dense_max_len: int
    block_q: int
    block_k: int


SCHEDULES = {
    # XLA:CPU runs a loop iteration's kernels at no launch cost, and a 128 x 128 float32 score
    # tile (64 KiB per batch-head) stays in cache. Up to 256 the dense tile's scores are small
    # and it saves the loops' compile time.
    "cpu": Schedule(dense_max_len=256, block_q=128, block_k=128),
    # Accelerators (GPUs, TPUs, Apple-GPU plugins) launch each kernel of a loop iteration
    # separately, so few, large iterations: a 1024 x 1024 tile is 2^26 scores at
    # batch x heads 64 (matmuls of a fraction of a millisecond on an H200, far above a launch)
    # and 256 MiB in float32, which keeps the temporaries flat in the length (under a quarter of
    # jax.nn's at 4096 on an H200; 1024 x 2048 and 2048 x 2048 tiles go over it).
    # Up to 1024, one dense tile is jax.nn's algorithm at about jax.nn's memory.
    "default": Schedule(dense_max_len=1024, block_q=1024, block_k=1024),
}


def for_platform(platform: str) -> Schedule:
    """The schedule of a lowering platform name ("cpu", "cuda", "METAL", ...)."""
    return SCHEDULES.get(platform, SCHEDULES["default"])
