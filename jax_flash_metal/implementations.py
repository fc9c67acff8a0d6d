"""The implementations that can run here: "xla" (FlashAttention-2 in ``jax.numpy``, any
platform), "metal" (the Metal kernels through an XLA FFI call on the ``cpu`` platform) and
"emulator" (the same FFI handler on the MSL-on-CPU emulator, for testing); "cudnn" (jax.nn's
cuDNN attention, NVIDIA GPUs) is decided per call when it is traced (docs/gpu.md). Which one
runs a call: docs/design.md#implementation-choice.
"""

from __future__ import annotations

from .core.contract import Implementation
from .fused import loader


def available(platform: str = "cpu") -> list[Implementation]:
    """Names of the implementations that can run for ``platform`` here, "xla" first.

    Tests parametrise over ``available()``; "emulator" and "metal" appear only when the native
    extension is importable (and, for "metal", a Metal device exists).
    """
    names: list[Implementation] = ["xla"]
    if platform == "cpu":
        names += [n for n in loader.FUSED if n in loader.available()[0]]
    return names


def metal_available() -> bool:
    """True when ``implementation="metal"`` can run here: the native extension was built on
    macOS, and the GPU is Apple silicon (GPU family Apple7 or newer, unified memory, 32-wide
    simdgroups) on macOS 13+ (Metal Shading Language 3.0). ``devices()["metal"]`` says why not."""
    return "metal" in loader.available()[0]


def unavailable_reasons() -> dict[str, str]:
    """{implementation: why it cannot run here} for each fused implementation that cannot."""
    return loader.unavailable_reasons()


def devices() -> dict[str, str]:
    """What this installation can run, for lowering on ``cpu``: {implementation: device} for
    "xla", "emulator" and "metal", in that order. An implementation in ``available("cpu")`` maps
    to its device, e.g. ``{"xla": "FlashAttention-2 in jax.numpy (any platform)",
    "emulator": "MSL-on-CPU emulator", "metal": "Apple M2 Pro"}``; one that cannot run here maps
    to ``"unavailable: "`` and the reason, e.g. ``"unavailable: the GPU 'AMD Radeon Pro 5500M'
    is not in GPU family Apple7 or newer ..."`` on an Intel Mac."""
    result = {"xla": "FlashAttention-2 in jax.numpy (any platform)"}
    module, _ = loader.ffi_lowering()
    if module is not None:
        result.update(module.device_names())
    reasons = loader.unavailable_reasons()
    for name in loader.FUSED:
        result.setdefault(name, f"unavailable: {reasons.get(name, 'unknown reason')}")
    return result
