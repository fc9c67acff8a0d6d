"""Kernel profile: exact counts of every Metal kernel an attention call launches, and a roofline
model of them on named Apple GPUs.

Run ``python -m jax_flash_metal.profile --help``. The problem given by the flags runs through
``flash_attention(..., implementation="emulator")`` under ``jax.jit`` (the forward, and
``jax.vjp``'s backward for the backward pass), so the real dispatch plan decides which kernels run
with which grids. While it runs, the emulated device executes the counting variant of each kernel
(ffi/emulator/README.md, "Kernel profile") and records one profile per launch.

Measured (exact counts on the emulator): threadgroups, threads per threadgroup, static threadgroup
memory, device bytes read / written (through ``device`` pointers, at the size of each access),
threadgroup bytes, ``simdgroup_matrix`` multiply-accumulates (8x8x8 each), other simd
collectives, threadgroup barriers, scalar ``fma`` calls, and other scalar math-function calls
(exp2, max, ...; operators such as ``*`` and ``+`` are not calls and are not counted).

Analytic: useful FLOPs, 4·D per visible (query, key) pair for the forward and 10·D for the
backward as a whole (visible pairs counted exactly from causal / window / lengths with
``reference.visibility``). Of the backward's 10·D, the dK/dV kernel is credited 8·D (recomputed
scores and dP, dV, dK) and the dQ kernel 2·D; the preprocess (rowsum(dO·O)) 0.
Derived: MMA FLOPs = mma_ops · 2 · 512; executed matmul FLOPs = MMA FLOPs + 2 · scalar fma calls
(every dot product and axpy of the kernels is written with fma; other arithmetic, e.g. exp2, is
not counted); MMA share = MMA FLOPs / executed matmul FLOPs; device intensity = useful FLOPs per
device byte (read + written); ALU ops = MMA multiply-adds (512 per MMA op) + scalar fma calls +
other math calls, reported over the useful multiply-adds (useful FLOPs / 2).

Estimated (``_ext.tile_shape``, shaders/tile_shapes.h ``jfm_tile_registers``): live 32-bit
registers per thread, flagged ``!`` above ``roofline.REGISTER_BUDGET`` (spill risk).

Modelled (``roofline.py``, not measured): per launch and GPU, the bound (compute / device /
threadgroup memory), the modelled time and the modelled percent of peak FLOP/s; and the
occupancy: threadgroups and simdgroups per core that fit the GPU's threadgroup memory, thread
limit and register file (``roofline.occupancy``).

``--page-size N [N ...]`` (forward only) also runs the problem with the K/V cache held as pages
of N keys (``page_table``, pages in shuffled order) and prints the device bytes each paged
forward reads next to the contiguous cache's (both with key/value lengths, which a paged call
needs): paged kernels read K and V in place through the table, so the two should agree up to
the table's own bytes.

``--variant V [V ...]`` (default 0) profiles the kernels' tile variants V
(docs/kernels.md#kernel-variants; ``all``: every distinct variant of each problem's family), one
row per launch and variant: the variant is part of the kernel name (``..._fwd_var1_...``) and its
register estimate is that variant's.

``--json PATH`` writes a JSON list with one record per launch, in launch order, with exactly the
keys of ``JSON_KEYS``: the problem (kernel, variant: the tile variant, dtype, head_dim,
value_head_dim, batch, q_len, kv_len, heads, kv_heads, causal, alibi, dropout: the rate), the exact
counts (threadgroups, threads_per_threadgroup, threadgroup_memory_bytes, device_bytes_read,
device_bytes_written, threadgroup_bytes_read, threadgroup_bytes_written: bytes; mma_ops, simd_ops,
barriers, fma_ops, math_ops: counts as defined in ffi/emulator/README.md), useful_flops (analytic),
registers (estimated live 32-bit registers per thread), ``model``: the roofline MODEL, not a
measurement, {GPU name: {"bound": "compute" | "device" | "threadgroup", "seconds": modelled time,
"percent_of_peak": modelled useful FLOP/s over peak FLOP/s, in percent}}, and ``occupancy``: {GPU
name: {"threadgroups", "simdgroups": per core, "limit": "memory" | "threads" | "registers"}} (a
model).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import contract, reference, validation, variants
from ._cli import HelpFormatter, progress_bar
from .attention import flash_attention
from .roofline import GPUS, REGISTER_BUDGET, model_launch, occupancy

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
PASSES = ("forward", "backward")

PROBLEM_KEYS = ("dtype", "head_dim", "value_head_dim", "batch", "q_len", "kv_len", "heads",
                "kv_heads", "causal", "alibi", "dropout")
# Exact counts of one launch, as the emulator reports them.
COUNT_KEYS = ("threadgroups", "threads_per_threadgroup", "threadgroup_memory_bytes",
              "device_bytes_read", "device_bytes_written", "threadgroup_bytes_read",
              "threadgroup_bytes_written", "mma_ops", "simd_ops", "barriers", "fma_ops", "math_ops")
# Keys of each --json record, in order.
JSON_KEYS = ("kernel", "variant", *PROBLEM_KEYS, *COUNT_KEYS, "useful_flops", "registers", "model",
             "occupancy")

# Useful FLOPs per visible (query, key) pair credited to each kernel stage (kernel names are
# flash_attention_<stage>_<dtype>_d<Dk>[_v<Dv>]), as (coefficient of the key head dim Dk,
# coefficient of the value head dim Dv): forward Q K^T and P V, 2·Dk + 2·Dv (4·D); backward
# S = Q K^T recomputed and dS K, dS^T Q over Dk, dP = dO V^T and P^T dO over Dv, 6·Dk + 4·Dv
# (10·D) as a whole. A new kernel stage must be added here.
USEFUL_FLOPS_PER_PAIR = {"fwd": (2, 2), "decode_partial": (2, 2), "decode_vector": (2, 2),
                         "decode_combine": (0, 0),
                         "bwd_dq": (2, 0),  # dS K (its S and dP are counted with dK/dV)
                         "bwd_dkdv": (4, 4),
                         "bwd_dk": (4, 2), "bwd_dv": (0, 2)}  # the split pair: as bwd_dkdv
MMA_FLOPS = 2 * 8 * 8 * 8  # one simdgroup_multiply_accumulate: an 8x8x8 multiply-add
KERNEL_NAME = re.compile(
    r"^flash_attention_(?P<stage>\w+?)(?:_var(?P<variant>\d+))?_(?P<dtype>f32|f16|bf16)"
    r"_d(?P<d>\d+)(?:_v(?P<dv>\d+))?$")
# The stages whose kernels come in tile variants (docs/kernels.md#kernel-variants).
TILED_STAGES = ("fwd", "decode_partial", "bwd_dq", "bwd_dkdv", "bwd_dk", "bwd_dv")

# The counting variants are built only when asked (ffi/emulator/CMakeLists.txt).
NO_COUNTING_MESSAGE = ("this build has no counting kernel variants (they are built only when "
                       "asked): reinstall with JFM_EMULATOR_COUNTING=ON in the environment, e.g. "
                       "JFM_EMULATOR_COUNTING=ON pip install .")


def _ext():
    from . import _ext as ext  # the native extension; absent in an unbuilt source tree
    return ext


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _window(text):
    """"W" -> (W, W); "L,R" -> (L, R); an empty side ("L," or ",R") is unbounded (None), as
    flash_attention's local_window_size takes it."""
    parts = text.split(",")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"expected W or LEFT,RIGHT, got {text!r}")
    try:
        bounds = [None if p == "" else int(p) for p in parts]
        left, right = validation.check_window(bounds[0] if len(bounds) == 1 else tuple(bounds))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"bad window {text!r}: {e}") from None
    return tuple(None if b == contract.UNBOUNDED else b for b in (left, right))


def _lengths(text):
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if any(x < 0 for x in values):
        raise argparse.ArgumentTypeError(f"lengths must be >= 0, got {text!r}")
    return values


def _rate(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a rate in [0, 1), got {text!r}")
    return value


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_flash_metal.profile",
        description="Exact per-launch counts of the attention kernels (MSL-on-CPU emulator, "
                    "through the real dispatch plan) and a roofline MODEL of them per Apple GPU.",
        formatter_class=HelpFormatter)
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["float16"],
                   help="input dtype(s)")
    p.add_argument("--head-dim", nargs="+", type=_positive, default=[64, 128],
                   help="head dim(s) D")
    p.add_argument("--value-head-dim", type=_positive, default=None,
                   help="head dim of value (and O) for every --head-dim (default: each --head-dim)")
    p.add_argument("--batch", type=_positive, default=1, help="batch size")
    p.add_argument("--q-len", type=_positive, default=1024, help="query length")
    p.add_argument("--kv-len", type=_positive, default=None,
                   help="key/value length (default: --q-len)")
    p.add_argument("--heads", type=_positive, default=4, help="query heads")
    p.add_argument("--kv-heads", type=_positive, default=4,
                   help="key/value heads (divides --heads)")
    p.add_argument("--causal", action="store_true", help="causal masking")
    p.add_argument("--causal-alignment", choices=("top_left", "bottom_right"), default="top_left",
                   help="alignment of the causal diagonal and the window")
    p.add_argument("--window", type=_window, default=None, metavar="W|LEFT,RIGHT",
                   help="local window (inclusive); an empty side is unbounded (default: none)")
    p.add_argument("--q-lengths", type=_lengths, default=None, metavar="N,N,...",
                   help="valid query length per batch entry (default: all of --q-len)")
    p.add_argument("--kv-lengths", type=_lengths, default=None, metavar="N,N,...",
                   help="valid key/value length per batch entry (default: all of --kv-len)")
    p.add_argument("--alibi", action="store_true",
                   help="ALiBi with BLOOM's slopes 2^(-8n/heads); the backward also forms the "
                        "slopes' gradient")
    p.add_argument("--dropout", type=_rate, default=0.0, metavar="RATE",
                   help="attention dropout rate (a fixed key from --seed; default: none)")
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES),
                   help="which kernels to run: the forward's and/or the backward's")
    p.add_argument("--page-size", nargs="+", type=_positive, default=None, metavar="N",
                   help="also run the forward on the K/V cache as pages of N keys and compare "
                        "its device bytes read with the contiguous cache's (forward only)")
    p.add_argument("--variant", nargs="+", default=["0"], metavar="V",
                   help="tile variants to profile (docs/kernels.md#kernel-variants): indices "
                        "(default: 0), or 'all': every distinct variant of each problem's family")
    p.add_argument("--gpu", nargs="+", choices=list(GPUS), default=list(GPUS),
                   metavar="GPU", help=f"GPUs of the roofline model: {', '.join(GPUS)}")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write one JSON record per launch to PATH")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


class Problem:
    """One attention problem of the profile: shapes, dtype, masking."""

    def __init__(self, args, dtype: str, head_dim: int):
        self.dtype, self.head_dim = dtype, head_dim
        self.value_head_dim = args.value_head_dim or head_dim
        self.batch, self.q_len, self.heads, self.kv_heads = (args.batch, args.q_len, args.heads,
                                                             args.kv_heads)
        self.kv_len = args.kv_len or args.q_len
        self.causal = args.causal
        self.bottom_right = args.causal_alignment == "bottom_right"
        self.window = args.window
        self.q_lengths, self.kv_lengths = args.q_lengths, args.kv_lengths
        self.alibi = args.alibi
        self.seed = args.seed
        self.dropout = args.dropout
        self.page_size = None  # a paged K/V cache of this many keys per page (paged())

    def paged(self, page_size: int) -> Problem:
        """This problem with its K/V cache held as pages of ``page_size`` keys."""
        other = Problem.__new__(Problem)
        other.__dict__.update(self.__dict__, page_size=page_size)
        return other

    def page_table(self) -> np.ndarray:
        """int32 [batch, max_pages]: every sequence's pages, handed out in shuffled order."""
        max_pages = -(-self.kv_len // self.page_size)
        order = np.random.default_rng(self.seed + 2).permutation(self.batch * max_pages)
        return order.reshape(self.batch, max_pages).astype(np.int32)

    def _to_pages(self, x):
        """[batch, kv_len, HKV, D] -> pages [batch * max_pages, page_size, HKV, D] laid out
        by page_table()."""
        table = self.page_table()
        pad = table.shape[1] * self.page_size - self.kv_len
        x = np.pad(np.asarray(x), ((0, 0), (0, pad), (0, 0), (0, 0)))
        blocks = x.reshape(table.size, self.page_size, *x.shape[2:])
        pages = np.empty_like(blocks)
        pages[table.reshape(-1)] = blocks
        return jnp.asarray(pages)

    def shapes(self):
        """The operands' shapes: q, k, v (v with the value head dim), and with ALiBi the
        float32 [heads] slopes."""
        dtype = DTYPES[self.dtype]
        q = jax.ShapeDtypeStruct((self.batch, self.q_len, self.heads, self.head_dim), dtype)
        k, v = (jax.ShapeDtypeStruct((self.batch, self.kv_len, self.kv_heads, d), dtype)
                for d in (self.head_dim, self.value_head_dim))
        slopes = [jax.ShapeDtypeStruct((self.heads,), jnp.float32)] if self.alibi else []
        return [q, k, v, *slopes]

    def dims(self) -> str:
        """The head dim, or "Dk/Dv" where the value head dim differs."""
        return (str(self.head_dim) if self.value_head_dim == self.head_dim
                else f"{self.head_dim}/{self.value_head_dim}")

    def attention(self, q, k, v, alibi_slopes=None):
        lengths = {}
        if self.q_lengths is not None:
            lengths["query_seq_lengths"] = jnp.asarray(self.q_lengths, jnp.int32)
        if self.kv_lengths is not None:
            lengths["key_value_seq_lengths"] = jnp.asarray(self.kv_lengths, jnp.int32)
        paged = {}
        if self.page_size is not None:  # k and v are pages
            paged["page_table"] = self.page_table()
            lengths.setdefault("key_value_seq_lengths",
                               jnp.full(self.batch, self.kv_len, jnp.int32))
        return flash_attention(
            q, k, v, is_causal=self.causal, local_window_size=self.window,
            causal_alignment="bottom_right" if self.bottom_right else "top_left",
            alibi_slopes=alibi_slopes, dropout_rate=self.dropout,
            dropout_rng=jax.random.key(self.seed) if self.dropout > 0 else None,
            implementation="emulator", **lengths, **paged)

    def check(self):
        """Lowers the forward and backward (the kernels of this dtype and head dim must exist);
        raises the library's ValueError / TypeError / NotImplementedError otherwise."""
        shapes = self.shapes()
        if self.page_size is not None:  # forward only, on the pages
            jax.jit(self.attention).lower(*self.inputs())
            return
        jax.jit(self.attention).lower(*shapes)
        loss = lambda *x: self.attention(*x).astype(jnp.float32).sum()
        jax.jit(jax.grad(loss, argnums=tuple(range(len(shapes))))).lower(*shapes)

    def visibility(self) -> np.ndarray:
        """bool [batch, q_len, kv_len]: may query row i see key j (reference.visibility)."""
        left, right = validation.check_window(self.window)
        lengths = [None if x is None else jnp.asarray(x, jnp.int32)
                   for x in (self.q_lengths, self.kv_lengths)]
        mask, _ = reference.visibility(self.batch, self.q_len, self.kv_len, *lengths,
                                       is_causal=self.causal, window_left=left,
                                       window_right=right, bottom_right=self.bottom_right)
        return np.asarray(mask)

    def visible_pairs(self) -> np.ndarray:
        """Visible (query, key) pairs per batch entry, one head (int64 [batch])."""
        return self.visibility().sum(axis=(1, 2), dtype=np.int64)

    def inputs(self):
        """Random q, k, v, and with ALiBi BLOOM's slopes."""
        rng = np.random.default_rng(self.seed)
        q, k, v, *slopes = self.shapes()
        q, k, v = [jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in (q, k, v)]
        if self.page_size is not None:
            k, v = self._to_pages(k), self._to_pages(v)
        bloom = [2.0 ** (-8.0 * jnp.arange(1, self.heads + 1, dtype=jnp.float32) / self.heads)]
        return [q, k, v] + (bloom if slopes else [])


def _recorded(fn, *args):
    """Runs fn(*args) with the emulated device's profiling on; returns its launch records."""
    ext = _ext()
    ext.set_emulator_profiling(True)
    try:
        jax.block_until_ready(fn(*args))
        return ext.take_emulator_profile()
    finally:
        ext.set_emulator_profiling(False)


def run_problem(problem: Problem, passes) -> list[tuple[str, dict]]:
    """(pass name, launch record) for every kernel launch of the forward and/or backward."""
    inputs = problem.inputs()
    runs = []
    if "forward" in passes:
        runs += [("forward", r) for r in _recorded(jax.jit(problem.attention), *inputs)]
    if "backward" in passes:
        out, vjp = jax.vjp(problem.attention, *inputs)  # forward run without profiling
        ct = jnp.asarray(np.random.default_rng(problem.seed + 1).standard_normal(out.shape),
                         out.dtype)
        backward = jax.jit(lambda vjp, ct: vjp(ct))  # vjp is a pytree (jax.tree_util.Partial)
        runs += [("backward", r) for r in _recorded(backward, vjp, ct)]
    return runs


def _stage(kernel: str) -> str:
    m = KERNEL_NAME.match(kernel)
    if not m or m.group("stage") not in USEFUL_FLOPS_PER_PAIR:
        raise ValueError(f"profile: no useful-FLOPs rule for kernel {kernel!r}: add its stage to "
                         "USEFUL_FLOPS_PER_PAIR in jax_flash_metal/profile.py")
    return m.group("stage")


def useful_flops(problem: Problem, runs: list[tuple[str, dict]]) -> list[int]:
    """Analytic useful FLOPs of each launch of ``runs`` ((pass, record) pairs).

    A stage's total ((USEFUL_FLOPS_PER_PAIR[stage] · (Dk, Dv)) · visible pairs · query heads) is
    exact.
    When a call is split into several submissions a stage has several launches; they share the
    total in proportion to their executed matmul FLOPs (exact for today's kernels, whose fma count
    is proportional to the visible pairs they cover; by threadgroups if a stage executes none).
    """
    pairs = int(problem.visible_pairs().sum()) * problem.heads
    weights: list[int] = []
    members: dict[tuple[str, str], list[int]] = {}
    for n, (pass_name, r) in enumerate(runs):
        stage = _stage(r["kernel"])
        weights.append(_executed_flops(r))
        members.setdefault((pass_name, stage), []).append(n)
    flops = [0] * len(runs)
    for (_, stage), launches in members.items():
        per_key_dim, per_value_dim = USEFUL_FLOPS_PER_PAIR[stage]
        total = (per_key_dim * problem.head_dim + per_value_dim * problem.value_head_dim) * pairs
        w = [weights[n] for n in launches]
        if not sum(w):
            w = [runs[n][1]["threadgroups"] for n in launches]
        shares = [total * x // max(sum(w), 1) for x in w]
        shares[-1] += total - sum(shares)  # integer shares that add up to the total
        for n, share in zip(launches, shares):
            flops[n] = share
    return flops


def _executed_flops(r: dict) -> int:
    """Executed matmul FLOPs of a launch record: MMA (8x8x8 each) plus scalar fma."""
    return r["mma_ops"] * MMA_FLOPS + 2 * r["fma_ops"]


def alu_ops(r: dict) -> int:
    """ALU operations of a launch record: MMA multiply-adds (512 per op), scalar fma calls and
    other scalar math-function calls (ffi/emulator/README.md: operators are not counted)."""
    return r["mma_ops"] * (MMA_FLOPS // 2) + r["fma_ops"] + r["math_ops"]


def registers(kernel: str) -> int:
    """Estimated live 32-bit registers per thread of a kernel (shaders/tile_shapes.h
    jfm_tile_registers), from its name."""
    m = KERNEL_NAME.match(kernel)
    if not m:
        raise ValueError(f"profile: not an attention kernel name: {kernel!r}")
    d = int(m.group("d"))
    tile_dim = _ext().tile_head_dim(d, int(m.group("dv") or d))
    return _ext().tile_shape(m.group("stage"), m.group("dtype"), tile_dim,
                             kernel_variant(kernel))["registers"]


def kernel_variant(kernel: str) -> int:
    """The tile variant of a kernel, from its name ("..._fwd_var1_..." is 1; 0 without)."""
    m = KERNEL_NAME.match(kernel)
    return int(m.group("variant") or 0) if m else 0


def problem_variants(problem: Problem) -> list[int]:
    """The distinct tile variants of the problem's family over the tiled stages
    (``_ext.kernel_variants``)."""
    suffix = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[problem.dtype]
    tile_dim = _ext().tile_head_dim(problem.head_dim, problem.value_head_dim)
    return sorted({v["variant"] for stage in TILED_STAGES
                   for v in _ext().kernel_variants(stage, suffix, tile_dim)})


def variant_records(problem: Problem, passes, gpus, variant: int) -> list[dict]:
    """profile_records with the kernels' tile variant forced ($JFM_KERNEL_VARIANT, read when
    the calls are traced: the caches are cleared first)."""
    previous = os.environ.get(variants.ENV)
    os.environ[variants.ENV] = str(variant)
    jax.clear_caches()
    try:
        return profile_records(problem, passes, gpus)
    finally:
        if previous is None:
            del os.environ[variants.ENV]
        else:
            os.environ[variants.ENV] = previous
        jax.clear_caches()


def profile_records(problem: Problem, passes, gpus) -> list[dict]:
    """One record per launch: the JSON keys plus "pass" and derived figures for the table."""
    runs = run_problem(problem, passes)
    flops = useful_flops(problem, runs)
    out = []
    for (pass_name, r), useful in zip(runs, flops):
        device_bytes = r["device_bytes_read"] + r["device_bytes_written"]
        tg_bytes = r["threadgroup_bytes_read"] + r["threadgroup_bytes_written"]
        mma_flops = r["mma_ops"] * MMA_FLOPS
        executed = _executed_flops(r)
        record = {
            "kernel": r["kernel"], "variant": kernel_variant(r["kernel"]),
            **{k: getattr(problem, k) for k in PROBLEM_KEYS},
            **{k: r[k] for k in COUNT_KEYS},
            "useful_flops": useful,
            "registers": registers(r["kernel"]),
            "model": {g: model_launch(GPUS[g], executed_flops=executed, useful_flops=useful,
                                      device_bytes=device_bytes, threadgroup_bytes=tg_bytes,
                                      threadgroups=r["threadgroups"]) for g in gpus},
        }
        record["occupancy"] = {
            g: occupancy(GPUS[g], threadgroup_bytes=r["threadgroup_memory_bytes"],
                         threads_per_threadgroup=r["threads_per_threadgroup"],
                         registers=record["registers"]) for g in gpus}
        record.update({"pass": pass_name, "groups": r["groups"], "mma_flops": mma_flops,
                       "executed_flops": executed, "alu_ops": alu_ops(r)})
        out.append(record)
    return out


def _ratio(a, b, fmt):
    return fmt.format(a / b) if b else "-"


BOUND_ABBREVIATIONS = {"compute": "comp", "device": "dev", "threadgroup": "tg"}


def format_tables(records: list[dict], gpus) -> str:
    """The measured table (one row per launch) and the roofline-model table."""
    head = (f"{'kernel':<40} {'pass':<8} {'threadgroups (grid)':>20} {'thr/tg':>6} {'tg KB':>6} "
            f"{'dev MB rd':>10} {'dev MB wr':>9} {'tg MB':>9} {'useful GF':>9} {'MMA GF':>7} "
            f"{'dev FLOP/B':>10} {'MMA share':>9} {'ALU/MA':>6} {'regs':>5}")
    lines = ["measured (exact, emulator counting variant):", head, "-" * len(head)]
    for r in records:
        tg_mb = (r["threadgroup_bytes_read"] + r["threadgroup_bytes_written"]) / 1e6
        device = r["device_bytes_read"] + r["device_bytes_written"]
        grid = f"{r['threadgroups']} ({'x'.join(str(g) for g in r['groups'])})"
        lines.append(
            f"{r['kernel']:<40} {r['pass']:<8} {grid:>20} {r['threads_per_threadgroup']:>6} "
            f"{r['threadgroup_memory_bytes'] / 1024:>6.1f} {r['device_bytes_read'] / 1e6:>10.1f} "
            f"{r['device_bytes_written'] / 1e6:>9.2f} {tg_mb:>9.1f} "
            f"{r['useful_flops'] / 1e9:>9.3f} "
            f"{r['mma_flops'] / 1e9:>7.3f} {_ratio(r['useful_flops'], device, '{:.2f}'):>10} "
            f"{_ratio(r['mma_flops'], r['executed_flops'], '{:.0%}'):>9} "
            f"{_ratio(2 * r['alu_ops'], r['useful_flops'], '{:.2f}'):>6} "
            f"{_registers_cell(r['registers']):>5}")
    lines += _per_gpu_table(
        records, gpus, 23,  # "comp 12345.678ms 100.0%"
        "roofline MODEL (not measured; per GPU: bound (comp = compute, dev = device memory, "
        "tg = threadgroup memory), modelled time, modelled % of peak FLOP/s; see "
        "jax_flash_metal/roofline.py):",
        lambda m: (f"{BOUND_ABBREVIATIONS[m['bound']]:>4} {m['seconds'] * 1e3:>9.3f}ms "
                   f"{m['percent_of_peak']:>5.1f}%"), "model")
    lines += _per_gpu_table(
        records, gpus, 14,  # "24/24 reg"
        "occupancy MODEL (per core: threadgroups/simdgroups that fit, and the binding limit: "
        "mem = threadgroup memory, thr = threads, reg = registers; jax_flash_metal/roofline.py):",
        lambda o: f"{o['threadgroups']}/{o['simdgroups']} {OCCUPANCY_LIMITS[o['limit']]}",
        "occupancy")
    return "\n".join(lines)


def format_paged_table(records: list[dict]) -> str:
    """Device bytes read by each forward launch of the paged runs (pass "pagedN") over the
    contiguous forward's launch of the same stage (pass "forward")."""
    contiguous = {(r["dtype"], r["head_dim"], _stage(r["kernel"])): r["device_bytes_read"]
                  for r in records if r["pass"] == "forward" and r["variant"] == 0}
    head = (f"{'kernel':<40} {'page size':>9} {'contiguous B rd':>16} {'paged B rd':>16} "
            f"{'paged/contiguous':>16}")
    lines = ["paged KV cache: device bytes read (exact counts, emulator), paged over contiguous:",
             head, "-" * len(head)]
    for r in records:
        if not r["pass"].startswith("paged"):
            continue
        base = contiguous.get((r["dtype"], r["head_dim"], _stage(r["kernel"])), 0)
        lines.append(f"{r['kernel']:<40} {r['pass'][len('paged'):]:>9} {base:>16} "
                     f"{r['device_bytes_read']:>16} "
                     f"{_ratio(r['device_bytes_read'], base, '{:.4f}'):>16}")
    return "\n".join(lines)


def _per_gpu_table(records, gpus, cell, title, cell_text, key) -> list[str]:
    """A titled table of one column per GPU, each cell ``cell_text(record[key][gpu])``."""
    head = f"{'kernel':<40} " + " ".join(f"{g:>{cell}}" for g in gpus)
    return ["", title, head, "-" * len(head)] + [
        f"{r['kernel']:<40} " + " ".join(f"{cell_text(r[key][g]):>{cell}}" for g in gpus)
        for r in records]


OCCUPANCY_LIMITS = {"memory": "mem", "threads": "thr", "registers": "reg"}


def _registers_cell(n: int) -> str:
    """The register estimate, flagged "!" above the budget (spill risk)."""
    return f"{n}!" if n > REGISTER_BUDGET else str(n)


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    for name in ("q_lengths", "kv_lengths"):
        values = getattr(args, name)
        if values is not None and len(values) != args.batch:
            parser.error(f"--{name.replace('_', '-')} needs {args.batch} values (--batch), got "
                         f"{len(values)}")
    if args.page_size and args.passes != ["forward"]:
        parser.error("--page-size needs --passes forward (a paged cache is forward only)")
    if args.page_size and args.kv_lengths is None:  # a paged call has them: so has its baseline
        args.kv_lengths = [args.kv_len or args.q_len] * args.batch
    problems = [Problem(args, d, h) for d in args.dtype for h in args.head_dim]
    page_sizes = args.page_size or ()
    for problem in problems + [p.paged(n) for p in problems for n in page_sizes]:
        try:
            problem.check()
        except (TypeError, ValueError, NotImplementedError) as e:
            parser.error(f"--dtype {problem.dtype} --head-dim {problem.head_dim} "
                         f"--value-head-dim {problem.value_head_dim}: {e}")
    if not _ext().emulator.has_counting_variant():
        parser.error(NO_COUNTING_MESSAGE)
    chosen = {}
    for problem in problems:
        listed = problem_variants(problem)
        asked = listed if args.variant == ["all"] else args.variant
        if not all(str(v).isdigit() and int(v) in listed for v in asked):
            parser.error(f"--variant {' '.join(args.variant)}: the variants of --dtype "
                         f"{problem.dtype} --head-dim {problem.head_dim} are {listed} (or 'all')")
        chosen[id(problem)] = [int(v) for v in asked]
    records = []
    bar = progress_bar(sum(map(len, chosen.values())) * len(args.passes), "profile",
                       enabled=not args.no_progress)
    try:
        for problem in problems:
            start, new = time.perf_counter(), []
            for variant in chosen[id(problem)]:
                for pass_name in (p for p in PASSES if p in args.passes):
                    bar.set_postfix_str(f"{problem.dtype} D={problem.dims()} variant {variant} "
                                        f"{pass_name}")
                    new += variant_records(problem, (pass_name,), args.gpu, variant)
                    bar.update(1)
            for n in page_sizes:
                runs = profile_records(problem.paged(n), ("forward",), args.gpu)
                new += [dict(r, **{"pass": f"paged{n}"}) for r in runs]
            records += new
            bar.write(f"# {problem.dtype} D={problem.dims()} batch={problem.batch} "
                      f"q_len={problem.q_len} kv_len={problem.kv_len} heads={problem.heads} "
                      f"kv_heads={problem.kv_heads} causal={problem.causal} "
                      f"window={problem.window} alibi={problem.alibi} "
                      f"dropout={problem.dropout}: {len(new)} launches, "
                      f"{time.perf_counter() - start:.0f} s on the emulator", file=sys.stderr)
    finally:
        bar.close()
    print(format_tables(records, args.gpu))
    if page_sizes:
        print()
        print(format_paged_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in JSON_KEYS} for r in records], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
