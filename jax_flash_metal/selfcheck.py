"""First-run self-check: does the fused implementation work on this machine, and how fast is it?

    python -m jax_flash_metal.selfcheck [--implementation metal|emulator] [--json PATH] [--quick]
                                        [--families DTYPE/DK/DV ...]

Steps, one readable report, and with ``--json`` one JSON object (its schema: docs/selfcheck.md):

- ``lane_layout``: runs the probe kernel ``shaders/simdgroup_layout_probe.metal`` (one
  simdgroup): each lane's ``thread_elements()`` of an 8x8 ``simdgroup_matrix`` loaded from 0..63
  must be the elements the attention kernels assume it holds (``jfm_frag_coord``), and a product
  of fragments written in that layout must be the matrix product.
- ``compile``: every shader library the Metal device compiles (``shader_libraries.libraries()``:
  one per source and (dtype, head dim) family); on the emulator, whose kernels are compiled at
  build time, that every kernel of them exists.
- ``families``: every kernel family (``--families``; three with ``--quick``) on the tiled
  forward with its backward (joint or split), the vector decode and the grouped decode, against
  the float64 oracle (``selfcheck_oracle``) with the tolerances of docs/testing.md#tolerances.
- ``dropout_paging``: dropout (forward and backward) and a paged K/V cache on the same paths.
- ``correctness``: forward (O, LSE) and backward (dQ, dK, dV) against the xla implementation,
  float32, over ``--head-dim`` x ``--features`` (``FEATURES``), max |fused - xla| within
  ``TOLERANCE`` times max |xla| + ``TOLERANCE``.
- ``profile``: the kernel profile's measured table of one small forward and backward
  (``jax_flash_metal.profile``; the emulator's counting variant, skipped without it).
- ``timings``: forward + backward wall time, median of ``--repeats``, of the fused
  implementation and of ``jax.nn.dot_product_attention`` on the CPU, at ``--seq-len``.
- ``tuning``: tunes the training shape of ``speed`` (forward and backward) and a grouped decode
  (``jax_flash_metal.tune``): each variant's time, the choice, and the chosen variants' TFLOP/s
  and GB/s against the chip's peak; on the emulator against a temporary cache.
- ``speed``: achieved TFLOP/s (training-size forward) and GB/s (decode) against the chip's
  published peak (``chip_peaks``), with the tuned variants; meaningless on the emulator, and
  marked so.

Exit status 0 when no step failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable, cast

import jax
import jax.numpy as jnp
import numpy as np

from . import __version__, dropout_mask, flash_attention, implementations, paging, tune
from .core import tolerance, tuning_cache, variants
from .core.contract import Implementation
from .fused import shader_libraries
from .lowering import autotune
import jax_flash_metal._ext as _ext
from .tools import chip_peaks, profile_model, profile_tables, selfcheck_oracle
from .tools.cli import HelpFormatter, add_flags, check_implementation, count

PROBE = "jfm_simdgroup_layout_probe"
TOLERANCE = 2e-4  # float32 kernels against float32 xla: rounding differences only
BATCH, HEADS, KV_HEADS, Q_LEN, KV_LEN = 2, 4, 2, 19, 23  # odd lengths: partial tiles


def _feature_arguments(rng: np.random.Generator) -> dict[str, dict]:
    """flash_attention keyword arguments of each feature case of the correctness grid."""
    return {
        "plain": {},
        "causal_lengths": dict(is_causal=True, causal_alignment="bottom_right",
                               query_seq_lengths=jnp.array([Q_LEN, 11], jnp.int32),
                               key_value_seq_lengths=jnp.array([KV_LEN, 9], jnp.int32)),
        "window": dict(local_window_size=(5, 3)),
        "bias_mask": dict(bias=jnp.asarray(rng.normal(size=(Q_LEN, KV_LEN)), jnp.float32),
                          mask=jnp.asarray(rng.random((BATCH, 1, Q_LEN, KV_LEN)) < 0.8)),
        "softcap_sinks": dict(logits_soft_cap=5.0,
                              sinks=jnp.asarray(rng.normal(size=HEADS), jnp.float32)),
    }


FEATURES = ("plain", "causal_lengths", "window", "bias_mask", "softcap_sinks")


def lane_layout(implementation: str) -> tuple[bool, str]:
    iota = np.arange(64, dtype=np.float32)
    lanes = np.zeros((32, 4), np.float32)
    product = np.zeros(64, np.float32)
    _ext.run_kernel(implementation, PROBE, {0: iota, 1: lanes, 2: product}, {1, 2},
                    (1, 1, 1), (32, 1, 1))
    wrong = [lane for lane in range(32) if not np.array_equal(lanes[lane, :2], lanes[lane, 2:])]
    a = iota.reshape(8, 8)
    product_error = float(np.abs(product.reshape(8, 8) - a @ a.T).max())
    if wrong:
        shown = ", ".join(f"lane {lane} holds {lanes[lane, :2].tolist()}, kernels assume "
                          f"{lanes[lane, 2:].tolist()}" for lane in wrong[:4])
        return False, f"{len(wrong)} of 32 lanes differ from the assumed layout: {shown}"
    if product_error > 0:
        return False, f"fragment product differs from A @ B by up to {product_error}"
    return True, "32 lanes hold the assumed elements; the fragment product is exact"


def compile_libraries(implementation: str) -> tuple[bool, str]:
    libraries = shader_libraries.libraries()
    failed = [library.name for library in libraries
              if not all(_ext.has_kernel(implementation, k) for k in library.kernels)]
    kernels = sum(len(library.kernels) for library in libraries)
    if failed:
        return False, (f"{len(failed)} of {len(libraries)} libraries failed: {', '.join(failed)}"
                       f"\n{_ext.library_error(implementation)}")
    how = "compiled" if implementation == "metal" else "present (built with the extension)"
    return True, (f"{count(len(libraries), 'library', 'libraries')}, "
                  f"{count(kernels, 'kernel')} {how}")


def _inputs(rng: np.random.Generator, head_dim: int):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return (normal(BATCH, Q_LEN, HEADS, head_dim), normal(BATCH, KV_LEN, KV_HEADS, head_dim),
            normal(BATCH, KV_LEN, KV_HEADS, head_dim), normal(BATCH, Q_LEN, HEADS, head_dim))


def _forward_backward(implementation: str, q, k, v, do, kwargs):
    def f(q, k, v):
        return flash_attention(q, k, v, implementation=implementation, return_lse=True, **kwargs)

    (o, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
    dq, dk, dv = vjp((do, jnp.zeros_like(lse)))
    return dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)


def correctness(implementation: str, head_dims, features) -> tuple[bool, str, list[dict]]:
    rng = np.random.default_rng(0)
    cases = []
    for head_dim in head_dims:
        q, k, v, do = _inputs(rng, head_dim)
        arguments = _feature_arguments(rng)
        for feature in features:
            fused = _forward_backward(implementation, q, k, v, do, arguments[feature])
            xla = _forward_backward("xla", q, k, v, do, arguments[feature])
            errors = {}
            for name in fused:
                got, want = np.asarray(fused[name]), np.asarray(xla[name])
                finite = np.isfinite(want)
                same_nonfinite = np.array_equal(got[~finite], want[~finite])
                error = float(np.abs(got[finite] - want[finite]).max(initial=0.0))
                scale = float(np.abs(want[finite]).max(initial=0.0))
                errors[name] = error if same_nonfinite else float("inf")
                errors[name + "_limit"] = TOLERANCE * scale + TOLERANCE
            passed = all(errors[n] <= errors[n + "_limit"] for n in fused)
            cases.append(dict(head_dim=head_dim, feature=feature, passed=passed,
                              max_abs_error={n: errors[n] for n in fused}))
    bad = [f"D={c['head_dim']} {c['feature']}" for c in cases if not c["passed"]]
    detail = (f"{len(cases)} cases (head dims {list(head_dims)} x {list(features)}), forward and "
              f"backward, " + (f"FAILED: {', '.join(bad)}" if bad else "all within tolerance"))
    return not bad, detail, cases


DTYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}
# (batch, q_len, kv_len, num_heads, num_kv_heads) of each kernel path: the tiled forward (and the
# backward, joint or split by head dim) with partial tiles, the one-query decode (decode_vector)
# and a few-query grouped decode (decode_partial), each decode followed by decode_combine.
PATHS = {"forward_backward": (1, 19, 23, 2, 1), "decode_vector": (1, 1, 40, 4, 2),
         "decode_partial": (1, 8, 40, 4, 2)}
QUICK_FAMILIES = [("f32", 16, 16), ("f16", 64, 64), ("bf16", 192, 128)]
STAGES = ("fwd", "decode_vector", "decode_partial", "decode_combine", "bwd_dq", "bwd_dkdv",
          "bwd_dk", "bwd_dv")
DROPOUT_RATE, PAGE_SIZE = 0.25, 16


def _stage_of(kernel: str) -> str:
    """'flash_attention_bwd_dq_f16_d64' -> 'bwd_dq'."""
    return next(s for s in sorted(STAGES, key=len, reverse=True)
                if kernel.startswith(f"flash_attention_{s}_"))


def _kernels(implementation, suffix, dk, dv, shape, backward, dropout) -> list[str]:
    b, tq, tkv, h, hkv = shape
    directions = ("fwd", "bwd") if backward else ("fwd",)
    return [d["kernel"] for direction in directions
            for submission in _ext.dispatch_plan(direction, suffix, b, tq, tkv, h, hkv, dk,
                                                 implementation, dv, dropout)
            for d in submission]


def check_case(implementation: str, suffix: str, dk: int, dv: int, path: str,
               rng: np.random.Generator, feature: str = "causal") -> dict:
    """One call of ``path`` (PATHS) for one kernel family against the float64 oracle.

    feature: "causal", "dropout" (rate DROPOUT_RATE, backward too) or "paged" (the K/V cache
    in pages of PAGE_SIZE keys, forward only). Returns the case's report entry."""
    b, tq, tkv, h, hkv = PATHS[path]
    backward = path == "forward_backward" and feature != "paged"
    dtype = DTYPES[suffix]
    normal = lambda *shape: np.asarray(jnp.asarray(rng.standard_normal(shape), dtype), np.float64)
    q, k, v, do = (normal(b, tq, h, dk), normal(b, tkv, hkv, dk), normal(b, tkv, hkv, dv),
                   normal(b, tq, h, dv))
    fused_kwargs: dict[str, Any] = {"is_causal": True}
    oracle_kwargs: dict[str, Any] = {"is_causal": True}
    k_in, v_in = k, v
    if feature == "dropout":
        key = jax.random.key(int(rng.integers(1 << 30)))
        fused_kwargs.update(dropout_rate=DROPOUT_RATE, dropout_rng=key)
        oracle_kwargs.update(keep=np.asarray(dropout_mask(key, (b, h, tq, tkv), DROPOUT_RATE)),
                             rate=DROPOUT_RATE)
    if feature == "paged":  # pages in reverse order, the last one partly used
        pages = -(-tkv // PAGE_SIZE)
        order = np.arange(pages)[::-1].copy()
        pad = pages * PAGE_SIZE - tkv
        split = lambda x: np.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))[0].reshape(
            pages, PAGE_SIZE, hkv, -1)[np.argsort(order)]
        k_in, v_in = split(k), split(v)
        lengths = np.full(b, tkv, np.int32)
        fused_kwargs = {"is_causal": True, "page_table": jnp.asarray(order[None], jnp.int32),
                        "key_value_seq_lengths": jnp.asarray(lengths)}
        gathered = [np.asarray(paging.gather(jnp.asarray(x), jnp.asarray(order[None]),
                                             jnp.asarray(lengths)), np.float64)
                    for x in (k_in, v_in)]
        assert all(np.array_equal(g[:, :tkv], x) for g, x in zip(gathered, (k, v)))
    arrays = [jnp.asarray(x, dtype) for x in (q, k_in, v_in, do)]

    def attention(q, k, v):
        return flash_attention(q, k, v, implementation=implementation, return_lse=True,
                               **fused_kwargs)

    if backward:
        (o, lse), pullback = jax.vjp(jax.jit(attention), *arrays[:3])
        got = dict(o=o, lse=lse, **dict(zip(("dq", "dk", "dv"),
                                            pullback((arrays[3], jnp.zeros_like(lse))))))
    else:
        o, lse = jax.jit(attention)(*arrays[:3])
        got = dict(o=o, lse=lse)
    inputs = [q, k, v] + ([do] if backward else [])
    want = selfcheck_oracle.oracle(inputs, **oracle_kwargs)
    baseline = None
    if suffix != "f32":
        baseline = selfcheck_oracle.dense(*(jnp.asarray(x, dtype) for x in inputs),
                                          **oracle_kwargs)
    errors, passed = {}, True
    for name, value in got.items():
        ok, error, limit = tolerance.within(
            name, value, want[name], None if baseline is None else baseline[name])
        passed &= ok
        errors[name] = [error, limit]
    return dict(dtype=suffix, head_dims=[dk, dv], path=path, feature=feature, passed=passed,
                kernels=_kernels(implementation, suffix, dk, dv, (b, tq, tkv, h, hkv), backward,
                                 feature == "dropout"),
                max_abs_error=errors)


def _summary(cases: list[dict], what: str) -> tuple[bool, str, list[dict]]:
    bad = [f"{c['dtype']} {c['head_dims']} {c['path']} {c['feature']}" for c in cases
           if not c["passed"]]
    stages = {_stage_of(k) for c in cases for k in c["kernels"]}
    missing = [s for s in STAGES if s not in stages]
    detail = (f"{len(cases)} {what} against the float64 oracle; kernels run: "
              f"{', '.join(s for s in STAGES if s in stages)}"
              + (f" (not reached: {', '.join(missing)})" if missing else "")
              + (f"; FAILED: {', '.join(bad)}" if bad else "; all within tolerance"))
    return not bad, detail, cases


def families(implementation: str, chosen) -> tuple[bool, str, list[dict]]:
    """The kernel families ``chosen`` ((dtype suffix, key head dim, value head dim), e.g. every
    one of ``_ext.kernel_families()``) on every path of PATHS."""
    rng = np.random.default_rng(2)
    cases = [check_case(implementation, suffix, dk, dv, path, rng)
             for suffix, dk, dv in chosen for path in PATHS]
    return _summary(cases, f"cases ({len(chosen)} families x {len(PATHS)} paths)")


def dropout_and_paging(implementation: str, chosen) -> tuple[bool, str, list[dict]]:
    """Dropout (forward and backward) and a paged K/V cache (tiled forward and both decodes) for
    the kernel families ``chosen``."""
    rng = np.random.default_rng(3)
    cases = [check_case(implementation, suffix, dk, dv, "forward_backward", rng, "dropout")
             for suffix, dk, dv in chosen]
    cases += [check_case(implementation, suffix, dk, dv, path, rng, "paged")
              for suffix, dk, dv in chosen for path in PATHS]
    return _summary(cases, "dropout and paged-cache cases")


def _peak(implementation: str) -> dict:
    name = _ext.device_name(implementation)
    return chip_peaks.peak(name, _ext.gpu_cores(implementation), _ext.gpu_cores_by_name(name))


def _figures(kind: str, shape, flops: float, moved: float, seconds: float, peak: dict) -> dict:
    """A speed row: achieved TFLOP/s and GB/s, and their fractions of the chip's peak."""
    row = dict(kind=kind, shape=list(shape), dtype="float16", seconds=seconds,
               tflops=flops / seconds / 1e12, gb_per_s=moved / seconds / 1e9)
    row["tflops_of_peak"] = row["tflops"] / peak["tflops"] if peak["tflops"] else None
    row["gb_per_s_of_peak"] = row["gb_per_s"] / peak["gb_per_s"] if peak["gb_per_s"] else None
    return row


def _speed_text(rows: list[dict], metal: bool, peak: dict) -> str:
    text = "; ".join(f"{r['kind']} {r['shape']}: {r['tflops']:.3g} TFLOP/s, "
                     f"{r['gb_per_s']:.3g} GB/s" + (
                         f" ({r['tflops_of_peak']:.0%} / {r['gb_per_s_of_peak']:.0%} of peak)"
                         if r["tflops_of_peak"] is not None else "") for r in rows)
    if not metal:
        return text + " (emulated device: these speeds mean nothing)"
    return text + (f" (no published peak for {peak['chip']})" if peak["source"] is None else "")


def _speed_shapes(metal: bool, quick: bool) -> dict:
    """(batch, q_len, kv_len, heads, kv_heads, head_dim) of the training-size forward and the
    decode; short with --quick or on the emulator, with a quarter of the heads there."""
    seq = 2048 if metal and not quick else 64
    kv = 8192 if metal and not quick else 256
    heads = 1 if metal else 4  # the emulator: the same kernels on fewer threadgroups
    return {"forward": (1, seq, seq, 16 // heads, 16 // heads, 128),
            "decode": (1, 1, kv, 32 // heads, 8 // heads, 128)}


def speed(implementation: str, quick: bool, repeats: int) -> tuple[bool, str, dict]:
    """Achieved TFLOP/s of a training-size forward and GB/s of a decode, float16, against the
    chip's published peak (chip_peaks), with the tuned kernel variants; on the emulator the
    figures mean nothing."""
    metal = implementation == "metal"
    peak = _peak(implementation)
    rng = np.random.default_rng(4)
    rows = []
    for kind, (b, tq, tkv, h, hkv, d) in _speed_shapes(metal, quick).items():
        q = jnp.asarray(rng.standard_normal((b, tq, h, d)), jnp.float16)
        k = jnp.asarray(rng.standard_normal((b, tkv, hkv, d)), jnp.float16)
        fn = jax.jit(lambda q, k, v: flash_attention(
            q, k, v, implementation=cast(Implementation, implementation)))
        seconds = autotune.measure(lambda: fn(q, k, k), implementation, repeats=repeats)[1]
        flops = 4.0 * b * h * tq * tkv * d  # QK^T and PV, 2 FLOP per multiply-add
        moved = 2.0 * (q.size * 2 + k.size * 2)  # f16 bytes: Q and O, K and V once each
        rows.append(_figures(kind, (b, tq, tkv, h, hkv, d), flops, moved, seconds, peak))
    return True, _speed_text(rows, metal, peak), dict(peak=peak, meaningful=metal, rows=rows)


DECODE_QUERIES = 4  # the tuned decode: a grouped decode (decode_partial, which has variants)


def tuning(implementation: str, quick: bool, repeats: int) -> tuple[bool | None, str, dict]:
    """Tunes the speed step's training shape (forward and backward, float16) and a decode of
    DECODE_QUERIES queries against its cache (``jax_flash_metal.tune``); reports each key's
    variants and the chosen one's TFLOP/s and GB/s against the chip's peak."""
    metal = implementation == "metal"
    if variants.from_env() != variants.AUTO:
        return None, f"skipped: a kernel variant is forced (${variants.ENV})", dict(
            meaningful=metal, rows=[], cache=None)
    peak = _peak(implementation)
    shapes = _speed_shapes(metal, quick)
    _, t, _, h, _, d = shapes["forward"]
    kv = shapes["decode"][2]
    repeats = repeats if metal else 1  # the emulator's timings mean nothing: one run each
    rows = tune.tune([(1, t, h, d)], backward=True, implementation=implementation,
                     repeats=repeats)
    rows += tune.tune([(1, kv, shapes["decode"][3], d)], q_len=DECODE_QUERIES,
                      kv_heads=shapes["decode"][4], implementation=implementation,
                      repeats=repeats)
    for row in rows:
        if row["variant"] is None:
            continue
        b, tq, tkv, h, hkv, d, dv = row["problem"]
        backward = "bwd_" in row["key"]
        kind = "backward" if backward else "decode" if "decode" in row["key"] else "forward"
        pairs = b * h * tq * tkv
        flops = (10.0 if backward else 4.0) * pairs * d  # the backward: 2.5 forwards
        moved = 2.0 * b * (tq * h + tkv * hkv) * (d + dv) * (2 if backward else 1)
        row["speed"] = _figures(kind, row["problem"], flops,
                                moved, row["seconds"][str(row["variant"])], peak)
    text = "\n" + tune.format_table(rows) + "\nchosen variants: " + _speed_text(
        [r["speed"] for r in rows if "speed" in r], metal, peak)
    if not metal:
        text += "; not cached"
    passed = all(r["key"] is None or r["variant"] is not None for r in rows)
    return passed, text, dict(meaningful=metal, rows=rows,
                              cache=tuning_cache.path() if metal else None)


def kernel_profile(head_dim: int) -> tuple[bool | None, str]:
    if not _ext.emulator.has_counting_variant():
        return None, "skipped: this build has no counting kernel variants"
    from . import profile

    args = profile.make_parser().parse_args(
        ["--dtype", "float16", "--head-dim", str(head_dim), "--q-len", "64", "--heads", "2",
         "--kv-heads", "1"])
    problem = profile_model.Problem(args, "float16", head_dim, True)
    records = profile_model.profile_records(problem, args.passes, args.gpu)
    return True, profile_tables.format_tables(records, args.gpu)


def _median_seconds(fn: Callable, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def timings(implementation: Implementation, seq_len: int, head_dim: int,
            repeats: int) -> tuple[bool, str]:
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, seq_len, HEADS, head_dim)), jnp.float32)

    def grad_of(attention):
        loss = lambda q, k, v: attention(q, k, v).sum()
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    fused = grad_of(lambda q, k, v: flash_attention(q, k, v, is_causal=True,
                                                    implementation=implementation))
    reference = grad_of(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    with jax.default_device(jax.devices("cpu")[0]):
        t_fused = _median_seconds(fused, (q, q, q), repeats)
        t_nn = _median_seconds(reference, (q, q, q), repeats)
    return True, (f"forward+backward, causal, float32 [1, {seq_len}, {HEADS}, {head_dim}]: "
                  f"{implementation} {t_fused * 1e3:.1f} ms, jax.nn.dot_product_attention (cpu) "
                  f"{t_nn * 1e3:.1f} ms, ratio {t_fused / t_nn:.2f}")


SCHEMA_VERSION = 2


@contextlib.contextmanager
def _autotune(implementation: str, on: bool):
    """The autotuner on or off (a forced variant stays forced); on the emulated device, when
    on, against a temporary cache file (its timings mean nothing, so nothing it picks may reach
    the user's cache)."""
    previous, cache = variants.settings(), os.environ.get(tuning_cache.ENV)
    with tempfile.TemporaryDirectory() as scratch:
        if on and implementation != "metal":
            os.environ[tuning_cache.ENV] = os.path.join(scratch, "tuning.json")
        tune.configure(**dict(previous, autotune=on))
        try:
            yield
        finally:
            tune.configure(**previous)
            if cache is None:
                os.environ.pop(tuning_cache.ENV, None)
            else:
                os.environ[tuning_cache.ENV] = cache


def environment() -> dict:
    """What a bug report needs to know about this installation."""
    import jaxlib

    return {"jax_flash_metal": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "machine": platform.machine(), "devices": implementations.devices()}


def run(implementation: str, head_dims, features, seq_len: int, repeats: int,
        quick: bool = False, kernel_families=None) -> dict:
    """Runs every step; returns the report (the JSON object of docs/selfcheck.md).
    ``kernel_families``: those of the families and dropout_paging steps (default: every one, or
    QUICK_FAMILIES with ``quick``; dropout and paging take at most three)."""
    chosen = kernel_families or (QUICK_FAMILIES if quick else _ext.kernel_families())
    steps: dict[str, dict] = {}

    def step(name: str, fn: Callable, *args):
        start = time.perf_counter()
        try:
            passed, detail, *extra = fn(*args)
        except Exception as e:  # a step that raises failed; the report says why
            passed, detail, extra = False, f"{type(e).__name__}: {e}", []
        entry = dict(passed=passed, seconds=round(time.perf_counter() - start, 3), detail=detail)
        if extra:
            entry.update(extra[0] if isinstance(extra[0], dict) else {"cases": extra[0]})
        steps[name] = entry

    # The checks and timings run variant 0 (or a forced one); tuning has its own steps.
    with _autotune(implementation, on=False):
        step("lane_layout", lane_layout, implementation)
        step("compile", compile_libraries, implementation)
        step("families", families, implementation, chosen)
        step("dropout_paging", dropout_and_paging, implementation,
             chosen if len(chosen) <= 3 else QUICK_FAMILIES)
        step("correctness", correctness, implementation, head_dims, features)
        step("profile", kernel_profile, head_dims[0])
        step("timings", timings, implementation, seq_len, head_dims[0], repeats)
    with _autotune(implementation, on=True):
        step("tuning", tuning, implementation, quick, repeats)
        step("speed", speed, implementation, quick, repeats)
    return dict(schema_version=SCHEMA_VERSION, implementation=implementation,
                device=_ext.device_name(implementation), quick=quick,
                environment=environment(),
                passed=all(s["passed"] is not False for s in steps.values()), steps=steps)


def format_report(report: dict) -> str:
    lines = [f"jax_flash_metal self-check: {report['implementation']} on {report['device']}"]
    # Every implementation's device, so a Mac that fell back to the emulator says why.
    devices = report.get("environment", {}).get("devices", {})
    lines += [f"  {name}: {device}" for name, device in devices.items()]
    for name, s in report["steps"].items():
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[s["passed"]]
        lines.append(f"{verdict} {name} ({s['seconds']:.1f} s): {s['detail']}")
    lines.append("all steps passed" if report["passed"] else "SOME STEPS FAILED")
    return "\n".join(lines)


def _family(text: str) -> tuple[str, int, int]:
    """'f16/128/64' -> ('f16', 128, 64), checked against the built kernel families."""
    parts = text.split("/")
    family = (parts[0], int(parts[1]), int(parts[2])) if len(parts) == 3 and all(
        p.isdigit() for p in parts[1:]) else None
    if family is None or family not in _ext.kernel_families():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a kernel family DTYPE/DK/DV of this build, e.g. f16/64/64")
    return cast(tuple[str, int, int], family)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_flash_metal.selfcheck",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_flags(p, notes=dict(head_dim="of the correctness grid", seq_len="of the timings"),
              implementation=None, head_dim=[16, 64], seq_len=256, repeats=3)
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--features", nargs="+", choices=FEATURES, default=list(FEATURES),
                   help="feature cases of the correctness grid")
    p.add_argument("--quick", action="store_true",
                   help="the families and dropout/paging steps on three families only "
                        f"({', '.join(f'{t} {k}/{v}' for t, k, v in QUICK_FAMILIES)}), and the "
                        "speed step at small sizes")
    p.add_argument("--families", nargs="+", metavar="DTYPE/DK/DV", type=_family,
                   help="kernel families of the families step, e.g. f16/64/64 (default: every "
                        "one; with --quick those named there)")
    args = p.parse_args(argv)
    check_implementation(p, args)
    head_dims = sorted({dk for dtype, dk, dv in _ext.kernel_families()
                        if dtype == "f32" and dk == dv})  # the correctness grid's float32
    if set(args.head_dim) - set(head_dims):
        p.error(f"--head-dim: the kernels take {head_dims}, not "
                f"{sorted(set(args.head_dim) - set(head_dims))}")
    report = run(args.implementation, args.head_dim, args.features, args.seq_len, args.repeats,
                 args.quick, args.families)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
