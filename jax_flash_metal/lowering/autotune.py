"""The on-device autotuner: which kernel variant a fused call runs (docs/tuning.md).

``choose`` is called when a fused primitive call is lowered, where its variant must become the
static ``kernel_variant`` attribute. A call traced with a forced variant keeps it; otherwise,
with tuning on (``variants.autotune_enabled``), its key (GPU, macOS, package and shader build,
the kernels the call runs, dtype, head dims, feature class, length bucket) is looked up in this
process, then in the cache file (``tuning_cache``); on a miss the call's eligible variants (those
whose dispatch plan differs) are timed on the capped problem (``tuning_problem``) through
private jitted calls with the variant forced, each checked against the xla implementation
within the oracle tolerance (``tolerance.agree``); the fastest agreeing one is kept, in this
process and in the file. Only lowerings of the same key wait for a tuning (one lock per key).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import platform
import threading
import time
import warnings
from typing import Any, Callable

import jax
import numpy as np

from ..core import tolerance, tuning_cache, variants
from ..core.contract import kernel_suffix
from . import tuning_problem

_LOG = logging.getLogger("jax_flash_metal")
REPEATS = 5  # timed runs after the warm-up; the median is kept
OUTPUTS = {"fwd": ("o", "lse"), "bwd": ("dq", "dk", "dv")}

_memo: dict[tuple[str, str], int] = {}  # (cache file, key) -> variant, this process
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()  # held only to find a key's lock
history: list[dict] = []  # each tuning and cache-file hit of this process, for tune's table


def measure(run: Callable[[], Any], implementation: str, variant: int | None = None,
            repeats: int | None = None) -> tuple[Any, float]:
    """(outputs of the first run, median seconds of ``repeats`` further runs): a warm-up
    (compile, first-use pipeline builds) gives the outputs; the runs are timed by the GPU's own
    clock on Metal (``_ext.gpu_seconds_total``), by the wall clock elsewhere. ``variant`` is
    unused here; a replacement ``timer`` (tests) gets it."""
    import jax_flash_metal._ext as _ext

    outputs = jax.block_until_ready(run())
    times = []
    for _ in range(REPEATS if repeats is None else repeats):
        gpu_before = _ext.gpu_seconds_total(implementation)
        start = time.perf_counter()
        jax.block_until_ready(run())
        wall = time.perf_counter() - start
        gpu = _ext.gpu_seconds_total(implementation)
        times.append(wall if gpu is None else gpu - gpu_before)
    return outputs, float(np.median(times))


timer = measure  # the hook: (run, implementation, variant) -> (outputs, seconds)


def _kernels(problem, implementation: str, variant: int) -> tuple[str, ...]:
    import jax_flash_metal._ext as _ext

    p = problem.options
    return tuple(d["kernel"] for submission in _ext.dispatch_plan(
        problem.direction, kernel_suffix(problem.dtype), problem.batch, problem.q_len,
        problem.kv_len, problem.heads, problem.kv_heads, problem.head_dim, implementation,
        problem.value_head_dim, p["dropout_rate"] > 0, variant) for d in submission)


def candidates(problem, implementation: str) -> list[int]:
    """The variants whose kernels differ for ``problem`` (variant 0 first)."""
    import jax_flash_metal._ext as _ext

    seen, chosen = set(), []
    for variant in range(_ext.tile_variants("fwd")):
        kernels = _kernels(problem, implementation, variant)
        if kernels not in seen:
            seen.add(kernels)
            chosen.append(variant)
    return chosen


@functools.cache
def _build() -> str:
    """The package version and a digest of the embedded shader sources."""
    import jax_flash_metal._ext as _ext

    try:
        version = importlib.metadata.version("jax_flash_metal")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    digest = hashlib.sha256(repr(sorted(_ext.shader_sources().items())).encode()).hexdigest()
    return f"{version}+{digest[:12]}"


def environment(implementation: str) -> dict[str, str]:
    """The key's fields that name this machine and installation."""
    import jax_flash_metal._ext as _ext

    return {"gpu": _ext.device_name(implementation), "macos": platform.mac_ver()[0] or "none",
            "package": _build()}


def key(problem, implementation: str) -> str:
    """The cache key of a (capped) problem."""
    stages = dict.fromkeys(k[len("flash_attention_"):].split(f"_{kernel_suffix(problem.dtype)}_d")[0]
                           for k in _kernels(problem, implementation, 0))
    return tuning_cache.key(**environment(implementation), kernels="+".join(stages),
                            dtype=problem.dtype,
                            head_dims=(problem.head_dim, problem.value_head_dim),
                            features=problem.features(), lengths=problem.length_bucket())


def _bind(prim, params: dict, implementation: str, variant: int):
    params = dict(params, implementation=(implementation,), kernel_variant=variant)
    return jax.jit(lambda *args: prim.bind(*args, **params))


def _operands(problem, primitives, rng) -> list:
    """The timed call's operands: the forward's, or for the backward the forward's residuals
    (from the xla implementation) with a random dO and zero dLSE."""
    forward = problem.forward_operands(rng)
    if problem.direction == "fwd":
        return forward
    p = {k: v for k, v in problem.options.items() if k not in ("bias_grad", "alibi_grad")}
    o, lse, row_max, log_sum = _bind(primitives["fwd"], p, "xla", variants.AUTO)(*forward)
    do = jax.numpy.asarray(rng.standard_normal(o.shape), o.dtype)
    return [*forward[:3], o, lse, row_max, log_sum, do, jax.numpy.zeros_like(lse),
            *forward[3:]]


def _names(problem) -> tuple[str, ...]:
    p = problem.options
    return (OUTPUTS[problem.direction] + ("dbias",) * p.get("bias_grad", False)
            + ("dslopes",) * p.get("alibi_grad", False))


def tune(problem, implementation: str, primitives) -> dict:
    """Time and check every candidate variant of ``problem``; the cache entry: ``variant``
    (the fastest agreeing one; None when none agrees), ``seconds`` and ``rejected``
    ({variant: why}), ``problem`` (the timed shape)."""
    rng = np.random.default_rng(0)
    prim, params = primitives[problem.direction], problem.options
    args = _operands(problem, primitives, rng)
    dtype = jax.numpy.dtype(problem.dtype)
    reference = _bind(prim, params, "xla", variants.AUTO)(
        *tuning_problem.upcast(args, dtype))
    baseline = None if dtype == np.float32 else _bind(prim, params, "xla", variants.AUTO)(*args)
    seconds, rejected = {}, {}
    for variant in candidates(problem, implementation):
        call = _bind(prim, params, implementation, variant)
        outputs, took = timer(lambda: call(*args), implementation, variant)
        for name, got, want, base in zip(_names(problem), outputs, reference,
                                         baseline or [None] * len(outputs)):
            ok, error, allowed = tolerance.agree(name, got, want, base)
            if not ok:
                rejected[str(variant)] = f"{name}: max error {error:.3g} > {allowed:.3g}"
                break
        else:
            seconds[str(variant)] = took
    best = min(seconds, key=seconds.__getitem__) if seconds else None
    return dict(variant=None if best is None else int(best), seconds=seconds,
                rejected=rejected, problem=[problem.batch, problem.q_len, problem.kv_len,
                                            problem.heads, problem.kv_heads, problem.head_dim,
                                            problem.value_head_dim])


def forget() -> None:
    """Forget this process's choices: the next lowering of each key reads the cache file."""
    _memo.clear()


def _lock(memo_key) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(memo_key, threading.Lock())


def choose(direction: str, implementation: str, avals, params: dict, primitives) -> int:
    """The kernel variant of a fused call being lowered (``params["kernel_variant"]`` unless it
    is ``variants.AUTO``). ``primitives``: {"fwd": fwd_p, "bwd": bwd_p}."""
    if params["kernel_variant"] != variants.AUTO:
        return params["kernel_variant"]
    if not variants.autotune_enabled(implementation):
        return 0
    problem = tuning_problem.from_avals(direction, avals, params).capped()
    if len(candidates(problem, implementation)) < 2:
        return 0
    memo_key = (tuning_cache.path(), key(problem, implementation))
    if memo_key in _memo:
        return _memo[memo_key]
    with _lock(memo_key):  # lowerings of other keys go on; this key's wait for its tuning
        if memo_key not in _memo:
            _memo[memo_key] = _lookup_or_tune(memo_key, problem, implementation, primitives)
    return _memo[memo_key]


def _lookup_or_tune(memo_key, problem, implementation: str, primitives) -> int:
    file, name = memo_key
    entry = tuning_cache.load(file).get(name)
    if entry is not None and entry["variant"] in candidates(problem, implementation):
        history.append(dict(entry, key=name, cached=True))
        return entry["variant"]
    entry = tune(problem, implementation, primitives)
    history.append(dict(entry, key=name, cached=False))
    for variant, why in entry["rejected"].items():
        warnings.warn(f"jax_flash_metal: kernel variant {variant} disagrees with the xla "
                      f"implementation on {name} ({why}); it is not used", stacklevel=2)
    if entry["variant"] is None:
        warnings.warn(f"jax_flash_metal: no kernel variant agrees with the xla implementation "
                      f"on {name}; running variant 0 untuned (please report this)",
                      stacklevel=2)
        return 0
    _LOG.info("jax_flash_metal: tuned %s: variant %d (%s)", name, entry["variant"],
              entry["seconds"])
    try:
        tuning_cache.store({name: entry}, file)
    except OSError as e:
        warnings.warn(f"jax_flash_metal: could not write the tuning cache {file}: {e}",
                      stacklevel=2)
    return entry["variant"]
