"""The kernel profile's measurements (``python -m jax_flash_metal.profile``): a problem run on the
emulator's counting kernels, one record per launch with its exact counts, the analytic useful
FLOPs, the register estimate and the roofline model. What each figure means: the profile's
docstring and docs/profile.md."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from ..attention import flash_attention
from ..core import validation, variants, visibility
from ..core.contract import kernel_suffix
from .cli import operand_shape
from .roofline import GPUS, model_launch, occupancy

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
PASSES = ("forward", "backward")

PROBLEM_KEYS = ("dtype", "head_dim", "value_head_dim", "batch", "q_len", "kv_len", "heads",
                "kv_heads", "causal", "alibi", "dropout")

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

# The counting variants are built only when asked (emulator/CMakeLists.txt).
NO_COUNTING_MESSAGE = ("this build has no counting kernel variants (they are built only when "
                       "asked): reinstall with JFM_EMULATOR_COUNTING=ON in the environment, e.g. "
                       "JFM_EMULATOR_COUNTING=ON pip install .")


def _ext():
    from .. import _ext as ext  # the native extension; absent in an unbuilt source tree
    return ext


def count_keys() -> tuple[str, ...]:
    """The exact counts of one launch, in order, as the emulator reports them (its list)."""
    return tuple(_ext().emulator.PROFILE_COUNTS)


def json_keys() -> tuple[str, ...]:
    """The keys of each --json record, in order."""
    return ("kernel", "variant", *PROBLEM_KEYS, *count_keys(), "ffi_call_bytes", "useful_flops",
            "registers",
            "model", "occupancy")


class Problem:
    """One attention problem of the profile: shapes, dtype, masking."""

    def __init__(self, args, dtype: str, head_dim: int, causal: bool):
        self.dtype, self.head_dim, self.causal = dtype, head_dim, causal
        self.value_head_dim = args.value_head_dim or head_dim
        self.batch, self.q_len, self.heads, self.kv_heads = (args.batch, args.q_len, args.heads,
                                                             args.kv_heads)
        self.kv_len = args.kv_len or args.q_len
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
        q = operand_shape((self.batch, self.q_len, self.heads, self.head_dim), dtype)
        k, v = (operand_shape((self.batch, self.kv_len, self.kv_heads, d), dtype)
                for d in (self.head_dim, self.value_head_dim))
        slopes = [operand_shape((self.heads,), jnp.float32)] if self.alibi else []
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
        """bool [batch, q_len, kv_len]: may query row i see key j (visibility.whole_matrix)."""
        left, right = validation.check_window(self.window)
        lengths = [None if x is None else jnp.asarray(x, jnp.int32)
                   for x in (self.q_lengths, self.kv_lengths)]
        mask, _ = visibility.whole_matrix(self.batch, self.q_len, self.kv_len, *lengths,
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
    """Runs fn(*args) with the emulated device's profiling on; returns its launch records, each
    with "ffi_call_bytes": the host memory the FFI handler allocated for the call (the kernels'
    parameter blocks and copied lengths; outside XLA's memory analysis), as it measured it."""
    ext = _ext()
    ext.set_emulator_profiling(True)
    ext.take_working_memory()  # zeroed: the figures of this call only
    try:
        jax.block_until_ready(fn(*args))
        records = ext.take_emulator_profile()
    finally:
        ext.set_emulator_profiling(False)
    call_bytes = ext.take_working_memory()["peak_bytes"]
    return [dict(r, ffi_call_bytes=call_bytes) for r in records]


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
    other scalar math-function calls (emulator/README.md: operators are not counted)."""
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
    suffix = kernel_suffix(problem.dtype)
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
            **{k: r[k] for k in count_keys()},
            "ffi_call_bytes": r["ffi_call_bytes"],
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
