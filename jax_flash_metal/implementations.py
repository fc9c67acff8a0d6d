"""Which implementation runs a flash_attention call: "xla", "emulator" or "metal".

- "xla": FlashAttention-2 in ``jax.numpy``/``lax`` (xla_attention.py). Runs on every platform.
- "metal": the fused Metal kernels via an XLA FFI custom call on the ``cpu`` platform; needs the
  native extension and an Apple GPU.
- "emulator": the same FFI handler driving the MSL-on-CPU emulator (testing; slow).

``implementation=None`` means: $JAX_FLASH_METAL_IMPLEMENTATION if set, else "metal" when lowering
for ``cpu`` on a machine where Metal is available, else "xla". The choice is made at lowering time,
so a compiled function keeps the implementation it was compiled with.

The fused implementations are provided by ``ffi_lowering`` (the FFI side of the package); it reports
which of them can run here through ``ffi_lowering.available_implementations()``.
"""

from __future__ import annotations

import functools
import os
import warnings

from . import validation

FUSED = ("emulator", "metal")


def _ffi_lowering():
    """The ffi_lowering module, or (None, reason) when the fused side cannot be imported."""
    try:
        from . import ffi_lowering
    except ImportError as e:
        reason = f"the FFI lowering could not be imported ({e})"
        if _is_unbuilt_source_tree():
            reason += (f"; jax_flash_metal was imported from its source folder {_PACKAGE_DIR}, "
                       "which has no compiled extension: run from another directory so the "
                       "installed package is used")
            _warn_once(reason)
        return None, reason
    return ffi_lowering, None


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_unbuilt_source_tree() -> bool:
    """True when this package is the checkout's folder (e.g. `python -m` run from the repository
    root puts it ahead of the installed copy) and no extension was built into it."""
    has_ext = any(name.startswith("_ext.") for name in os.listdir(_PACKAGE_DIR))
    return not has_ext and os.path.exists(os.path.join(_PACKAGE_DIR, "..", "pyproject.toml"))


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _fused_available():
    module, reason = _ffi_lowering()
    if module is None:
        return [], reason
    report = getattr(module, "available_implementations", None)
    if report is None:
        return [], "ffi_lowering does not report any available implementation"
    names = [n for n in report() if n in FUSED]
    return names, None


def available(platform: str = "cpu") -> list[str]:
    """Names of the implementations that can run for ``platform`` here, "xla" first.

    Tests parametrise over ``available()``; "emulator" and "metal" appear only when the native
    extension is importable (and, for "metal", a Metal device exists).
    """
    names = ["xla"]
    if platform == "cpu":
        names += [n for n in FUSED if n in _fused_available()[0]]
    return names


def resolve(implementation: str | None, platform: str) -> str:
    """The implementation to lower with for ``platform`` (a JAX platform name such as "cpu").

    Raises:
      ValueError: unknown name (argument or environment variable).
      NotImplementedError: a fused implementation was asked for explicitly where it cannot run.
    """
    implementation = validation.check_implementation(implementation)
    source = "implementation"
    if implementation is None:
        implementation = validation.env_implementation()
        source = f"${validation.ENV_IMPLEMENTATION}"
        if implementation is None:
            return "metal" if platform == "cpu" and "metal" in available("cpu") else "xla"
    if implementation == "xla":
        return "xla"
    if platform != "cpu":
        raise NotImplementedError(
            f"flash_attention {source}={implementation!r} runs only when lowering for the 'cpu' "
            f"platform (an XLA FFI call on the host), but this computation lowers for "
            f"{platform!r}; use implementation=None or 'xla' there"
        )
    names, reason = _fused_available()
    if implementation not in names:
        why = reason or (
            "no Metal device was found" if implementation == "metal"
            else "the native extension does not provide it"
        )
        raise NotImplementedError(
            f"flash_attention {source}={implementation!r} is not available here: {why}. "
            f"Available: {available(platform)}"
        )
    return implementation


def metal_available() -> bool:
    """True when ``implementation="metal"`` can run here: the native extension was built on
    macOS and an Apple GPU is present (macOS 13+, for Metal Shading Language 3.0)."""
    return "metal" in _fused_available()[0]


def devices() -> dict[str, str]:
    """What this installation can run, for lowering on ``cpu``: {implementation: device} for
    every name in ``available("cpu")``, e.g. ``{"xla": "jax.numpy reference (any platform)",
    "emulator": "MSL-on-CPU emulator", "metal": "Apple M2 Pro"}``."""
    result = {"xla": "jax.numpy reference (any platform)"}
    module, _ = _ffi_lowering()
    if module is not None:
        result.update(module.device_names())
    return result
