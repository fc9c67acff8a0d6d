"""Tune the fused kernels ahead of time: ``python -m jax_flash_metal.tune``, ``tune`` and
``tune_function``; and ``configure``, the process's switch for the autotuner and the kernel
variant (docs/tuning.md).

    python -m jax_flash_metal.tune --shape 1,2048,16,128 --dtype float16 --causal --backward
    python -m jax_flash_metal.tune --shape 1,8192,32,128 --q-len 4 --kv-heads 8   # a decode

Each ``--shape B,T,H,D`` (T the key/value length; the query length is ``--q-len``, default T)
is traced and lowered through ``flash_attention`` under ``jax.jit`` with tuning on, so the keys
tuned are exactly those a model's calls of that shape look up; the forward, and with
``--backward`` the backward too. Prints one row per tuned key (each variant's median time, the
choice, whether it came from the cache) and writes the cache file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import jax
import jax.numpy as jnp

from .attention import flash_attention
from .core import tuning_cache, variants
from .lowering import autotune
from .tools.cli import (CAUSAL, HelpFormatter, add_flags, aligned, check_implementation,
                        default_implementation, operand_shape)


def configure(*, variant: int | None = None, autotune: bool | None = None) -> None:
    """Force a kernel variant or switch the autotuner for calls traced from now on. Each call
    sets both settings (an omitted one is None); ``configure()`` returns to the environment.

    Args:
      variant: the kernel variant (docs/kernels.md#kernel-variants) every fused call traced
        afterwards runs; None (default) leaves it to ``$JFM_KERNEL_VARIANT``, else the
        autotuner.
      autotune: True tunes on any fused implementation (the emulator too), False never tunes
        (variant 0 unless forced), None (default) leaves it to ``$JFM_AUTOTUNE``, else tuning
        on "metal" only.

    Raises:
      ValueError: ``variant`` is not a non-negative int. TypeError: ``autotune`` is not a bool
        or None.
    """
    variants.configure(variant=variant, autotune=autotune)


def tune(shapes, *, dtype="float16", q_len: int | None = None, kv_heads: int | None = None,
         value_head_dim: int | None = None, causal: bool = False, backward: bool = False,
         implementation: str | None = None, repeats: int | None = None) -> list[dict]:
    """Tune the calls of ``shapes`` ((batch, kv_len, heads, head_dim) each) and write the
    cache; returns one row per shape and tuned key: ``shape``, ``key``, ``variant``,
    ``seconds`` ({variant: median seconds}), ``rejected``, ``cached``, ``problem`` (the timed
    shape), or ``variant`` None and ``key`` None where the call has one variant only.

    ``implementation``: "metal" (default where available) or "emulator" (whose timings mean
    nothing). ``repeats``: timed runs per variant (default ``autotune.REPEATS``). Raises
    ValueError when ``$JFM_KERNEL_VARIANT`` or ``configure(variant=...)`` forces a variant."""
    implementation = implementation or default_implementation()
    rows = []
    with _tuning(repeats):
        for b, t, h, d in shapes:
            tq, hkv = q_len or t, kv_heads or h
            shape = [b, tq, t, h, hkv, d]
            start = len(autotune.history)
            _lower(b, tq, t, h, hkv, d, value_head_dim or d, dtype, causal, backward,
                   implementation)
            rows += [dict(entry, shape=shape) for entry in _rows(start)]
    return rows


def tune_function(fn, *args, repeats: int | None = None, **kwargs) -> list[dict]:
    """Tune every fused attention call of ``fn(*args, **kwargs)`` (e.g. a model's training
    step) with its exact shapes and features, by lowering ``jax.jit(fn)`` with tuning on;
    ``args`` may be arrays or ``jax.ShapeDtypeStruct``. The calls take the implementation
    they would take anyway (on Linux "xla" unless ``fn`` asks for "emulator"). Returns the rows
    of ``tune`` without ``shape``; errors as ``tune``."""
    with _tuning(repeats):
        start = len(autotune.history)
        jax.jit(fn).lower(*args, **kwargs)
        return _rows(start)


@contextlib.contextmanager
def _tuning(repeats: int | None):
    """Tuning on, ``repeats`` timed runs, every key reported (this process's choices
    forgotten); the settings restored afterwards."""
    if variants.from_env() != variants.AUTO:
        raise ValueError(f"a kernel variant is forced (${variants.ENV} or configure(variant="
                         f"...)): nothing to tune")
    previous, previous_repeats = variants.settings(), autotune.REPEATS
    variants.configure(autotune=True)
    autotune.REPEATS = previous_repeats if repeats is None else repeats
    autotune.forget()
    try:
        yield
    finally:
        variants.configure(**previous)
        autotune.REPEATS = previous_repeats


def _rows(start: int) -> list[dict]:
    """The tuner's records since ``start``; one row saying so when nothing had variants."""
    return autotune.history[start:] or [dict(key=None, variant=None, seconds={}, rejected={},
                                             cached=False, problem=None)]


def _lower(b, tq, tkv, h, hkv, d, dv, dtype, causal, backward, implementation) -> None:
    """Trace and lower one call (forward, or forward and backward): the lowering tunes."""
    def attention(q, k, v):
        return flash_attention(q, k, v, is_causal=causal, implementation=implementation)

    fn = attention
    if backward:
        fn = jax.grad(lambda q, k, v: attention(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))
    spec = lambda *shape: operand_shape(shape, dtype)
    jax.jit(fn).lower(spec(b, tq, h, d), spec(b, tkv, hkv, d), spec(b, tkv, hkv, dv))


def format_table(rows: list[dict]) -> str:
    """One line per row of ``tune``: the key's kernels, dtype, features and lengths, each
    variant's median milliseconds ("x" rejected), the choice and its source."""
    shown = sorted({v for r in rows for v in (*r["seconds"], *r["rejected"])}, key=int)
    body = []
    for r in rows:
        fields = dict(f.split("=", 1) for f in r["key"].split("|")) if r["key"] else {}
        body.append([",".join(map(str, r["shape"])), fields.get("kernels", "-"),
                     fields.get("dtype", "-"), fields.get("features", "-"), fields.get("lengths", "-"),
                     *(f"{r['seconds'][v] * 1e3:.3f}" if v in r["seconds"] else
                       "x" if v in r["rejected"] else "-" for v in shown),
                     "-" if r["variant"] is None else str(r["variant"]),
                     "one variant" if r["key"] is None else
                     "cache" if r["cached"] else "tuned"])
    header = ["shape B,Tq,Tkv,H,Hkv,D", "kernels", "dtype", "features", "lengths",
              *(f"var{v} ms" for v in shown), "chosen", "from"]
    return aligned(header, body, left=5)


def _shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected B,T,H,D (four positive integers), "
                                         f"got {text!r}")
    b, t, h, d = (int(p) for p in parts)
    return b, t, h, d


DESCRIPTION = ("Time the fused kernels' variants on the calls of the given shapes, print the "
               "table and write the choices to the tuning cache (docs/tuning.md).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_flash_metal.tune",
                                description=DESCRIPTION, formatter_class=HelpFormatter)
    p.add_argument("--shape", type=_shape, action="append", required=True, metavar="B,T,H,D",
                   help="batch, key/value length, query heads, head dim (repeatable)")
    add_flags(p, notes=dict(q_len="default: T; 1: a decode", kv_heads="default: H",
                            value_head_dim="default: D"),
              q_len=None, kv_heads=None, value_head_dim=None, dtype=["float16"], causal="off",
              implementation=None, repeats=autotune.REPEATS)
    p.add_argument("--backward", action="store_true", help="tune the backward too")
    p.add_argument("--cache", metavar="PATH",
                   help=f"the cache file (default: ${tuning_cache.ENV}, else "
                        "jax_flash_metal/tuning.json in the user's cache directory)")
    args = p.parse_args(argv)
    check_implementation(p, args)
    if args.cache:
        os.environ[tuning_cache.ENV] = args.cache
    try:
        if variants.from_env() != variants.AUTO:
            p.error(f"${variants.ENV} forces a kernel variant: unset it to tune")
        tuning_cache.store({})  # this program's job is the cache: fail now if it cannot be written
    except (ValueError, OSError) as e:
        p.error(f"{e}")
    try:
        rows = [row for dtype in args.dtype for causal in CAUSAL[args.causal]
                for row in tune(args.shape, dtype=dtype, q_len=args.q_len,
                                kv_heads=args.kv_heads, value_head_dim=args.value_head_dim,
                                causal=causal, backward=args.backward,
                                implementation=args.implementation, repeats=args.repeats)]
    except (ValueError, TypeError) as e:  # a shape the kernels or the API refuse
        p.error(f"{e}")
    print(format_table(rows))
    print(f"cache: {tuning_cache.path()}" + ("" if args.implementation == "metal" else
                                             " (emulated device: these timings mean nothing)"))
    return 0 if all(r["key"] is None or r["variant"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
