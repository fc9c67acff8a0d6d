"""First-run self-check: does the fused implementation work on this machine, and how fast is it?

    python -m jax_flash_metal.selfcheck [--implementation metal|emulator] [--json PATH]

Five steps, one readable report (and with ``--json`` one JSON object: ``implementation``,
``device``, ``passed`` and ``steps``, a dict of the steps below by name, each with ``passed``
(True, False, or None when skipped), ``seconds`` and ``detail``):

- ``lane_layout``: runs the probe kernel ``shaders/simdgroup_layout_probe.metal`` (one
  simdgroup): each lane's ``thread_elements()`` of an 8x8 ``simdgroup_matrix`` loaded from 0..63
  must be the elements the attention kernels assume it holds (``jfm_frag_coord``), and a product
  of fragments written in that layout must be the matrix product.
- ``compile``: every shader library the Metal device compiles (``shader_libraries.libraries()``:
  one per source and (dtype, head dim) family); on the emulator, whose kernels are compiled at
  build time, that every kernel of them exists.
- ``correctness``: forward (O, LSE) and backward (dQ, dK, dV) against the xla implementation,
  float32, over ``--head-dims`` x ``--features`` (``FEATURES``), max |fused - xla| within
  ``TOLERANCE`` times max |xla| + ``TOLERANCE``.
- ``profile``: the kernel profile's measured table of one small forward and backward
  (``jax_flash_metal.profile``; the emulator's counting variant, skipped without it).
- ``timings``: forward + backward wall time, median of ``--repeats``, of the fused
  implementation and of ``jax.nn.dot_product_attention`` on the CPU, at ``--seq-len``.

Exit status 0 when no step failed. Defaults run in about a minute on the emulator.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import flash_attention, implementations, shader_libraries
from ._cli import count
from .contract import Implementation
import jax_flash_metal._ext as _ext

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


def kernel_profile(head_dim: int) -> tuple[bool | None, str]:
    if not _ext.emulator.has_counting_variant():
        return None, "skipped: this build has no counting kernel variants"
    from . import profile

    args = profile.make_parser().parse_args(
        ["--dtype", "float16", "--head-dim", str(head_dim), "--q-len", "64", "--heads", "2",
         "--kv-heads", "1", "--causal"])
    records = profile.profile_records(profile.Problem(args, "float16", head_dim), args.passes,
                                      args.gpu)
    return True, profile.format_tables(records, args.gpu)


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


def run(implementation: str, head_dims, features, seq_len: int, repeats: int) -> dict:
    """Runs every step; returns the report (the JSON object described in the module docstring)."""
    steps: dict[str, dict] = {}

    def step(name: str, fn: Callable, *args):
        start = time.perf_counter()
        try:
            passed, detail, *extra = fn(*args)
        except Exception as e:  # a step that raises failed; the report says why
            passed, detail, extra = False, f"{type(e).__name__}: {e}", []
        steps[name] = dict(passed=passed, seconds=round(time.perf_counter() - start, 3),
                           detail=detail, **({"cases": extra[0]} if extra else {}))

    step("lane_layout", lane_layout, implementation)
    step("compile", compile_libraries, implementation)
    step("correctness", correctness, implementation, head_dims, features)
    step("profile", kernel_profile, head_dims[0])
    step("timings", timings, implementation, seq_len, head_dims[0], repeats)
    return dict(implementation=implementation, device=_ext.device_name(implementation),
                passed=all(s["passed"] is not False for s in steps.values()), steps=steps)


def format_report(report: dict) -> str:
    lines = [f"jax_flash_metal self-check: {report['implementation']} on {report['device']}"]
    for name, s in report["steps"].items():
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[s["passed"]]
        lines.append(f"{verdict} {name} ({s['seconds']:.1f} s): {s['detail']}")
    lines.append("all steps passed" if report["passed"] else "SOME STEPS FAILED")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    fused = [n for n in implementations.available() if n in ("metal", "emulator")]
    p = argparse.ArgumentParser(prog="python -m jax_flash_metal.selfcheck",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--implementation", choices=("metal", "emulator"),
                   default="metal" if "metal" in fused else "emulator",
                   help="the fused implementation to check (default: metal where available)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--head-dims", type=int, nargs="+", default=[16, 64],
                   help="head dims of the correctness grid (default: %(default)s)")
    p.add_argument("--features", nargs="+", choices=FEATURES, default=list(FEATURES),
                   help="feature cases of the correctness grid (default: all)")
    p.add_argument("--seq-len", type=int, default=256,
                   help="sequence length of the timings (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (default: %(default)s)")
    args = p.parse_args(argv)
    if args.implementation not in fused:
        p.error(f"--implementation {args.implementation} is not available here: "
                f"{implementations.unavailable_reasons().get(args.implementation, '')}")
    report = run(args.implementation, args.head_dims, args.features, args.seq_len, args.repeats)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
