"""The kernel profile's tables: counts, roofline model and occupancy per launch, and paged
against contiguous device bytes."""

from __future__ import annotations

import textwrap

from .cli import WIDTH, aligned, split_columns
from .profile_model import _stage
from .roofline import REGISTER_BUDGET


def _ratio(a, b, fmt):
    return fmt.format(a / b) if b else "-"


BOUND_ABBREVIATIONS = {"compute": "comp", "device": "dev", "threadgroup": "tg"}


def _titled_parts(title: str, header: list[str], body: list[list[str]], keys: int) -> list[str]:
    """Lines of a table split into parts of at most WIDTH characters (``split_columns``, the
    first ``keys`` columns in each), each under ``title`` wrapped to WIDTH."""
    parts = split_columns(header, body, keys, WIDTH)
    out = []
    for n, (head, cells) in enumerate(parts, 1):
        part = f" (part {n} of {len(parts)})" if len(parts) > 1 else ""
        out += ["", *textwrap.wrap(title[:-1] + part + ":", WIDTH), aligned(head, cells, keys)]
    return out


def format_tables(records: list[dict], gpus) -> str:
    """The measured table (one row per launch) and the roofline-model table, each split to
    fit WIDTH columns."""
    header = ["kernel", "pass", "threadgroups (grid)", "thr/tg", "tg KB", "dev MB rd",
              "dev MB wr", "tg MB", "useful GF", "MMA GF", "dev FLOP/B", "MMA share", "ALU/MA",
              "regs", "FFI B"]
    name = _kernel_names(records)
    body = []
    for r in records:
        tg_mb = (r["threadgroup_bytes_read"] + r["threadgroup_bytes_written"]) / 1e6
        device = r["device_bytes_read"] + r["device_bytes_written"]
        body.append([
            name(r), r["pass"], f"{r['threadgroups']} ({'x'.join(map(str, r['groups']))})",
            str(r["threads_per_threadgroup"]), f"{r['threadgroup_memory_bytes'] / 1024:.1f}",
            f"{r['device_bytes_read'] / 1e6:.1f}", f"{r['device_bytes_written'] / 1e6:.2f}",
            f"{tg_mb:.1f}", f"{r['useful_flops'] / 1e9:.3f}", f"{r['mma_flops'] / 1e9:.3f}",
            _ratio(r["useful_flops"], device, "{:.2f}"),
            _ratio(r["mma_flops"], r["executed_flops"], "{:.0%}"),
            _ratio(2 * r["alu_ops"], r["useful_flops"], "{:.2f}"),
            _registers_cell(r["registers"]), str(r["ffi_call_bytes"])])
    lines = _titled_parts("measured (exact, emulator counting variant):", header, body, 2)
    lines += _per_gpu_table(
        records, gpus,
        "roofline MODEL (not measured; per GPU: bound (comp = compute, dev = device memory, "
        "tg = threadgroup memory), modelled time, modelled % of peak FLOP/s; see "
        "jax_flash_metal/tools/roofline.py):",
        lambda m: (f"{BOUND_ABBREVIATIONS[m['bound']]} {m['seconds'] * 1e3:.3f}ms "
                   f"{m['percent_of_peak']:.1f}%"), "model")
    lines += _per_gpu_table(
        records, gpus,
        "occupancy MODEL (per core: threadgroups/simdgroups that fit, and the binding limit: "
        "mem = threadgroup memory, thr = threads, reg = registers; "
        "jax_flash_metal/tools/roofline.py):",
        lambda o: f"{o['threadgroups']}/{o['simdgroups']} {OCCUPANCY_LIMITS[o['limit']]}",
        "occupancy")
    return "\n".join(lines[1:])


def format_paged_table(records: list[dict]) -> str:
    """Device bytes read by each forward launch of the paged runs (pass "pagedN") over the
    contiguous forward's launch of the same stage (pass "forward")."""
    name = _kernel_names(records)
    point = lambda r: (r["dtype"], r["head_dim"], r["causal"], _stage(r["kernel"]))
    contiguous = {point(r): r["device_bytes_read"] for r in records
                  if r["pass"] == "forward" and r["variant"] == 0}
    head = (f"{'kernel':<40} {'page size':>9} {'contiguous B rd':>16} {'paged B rd':>16} "
            f"{'paged/contiguous':>16}")
    lines = ["paged KV cache: device bytes read (exact counts, emulator), paged over contiguous:",
             head, "-" * len(head)]
    for r in records:
        if not r["pass"].startswith("paged"):
            continue
        base = contiguous.get(point(r), 0)
        lines.append(f"{name(r):<40} {r['pass'][len('paged'):]:>9} {base:>16} "
                     f"{r['device_bytes_read']:>16} "
                     f"{_ratio(r['device_bytes_read'], base, '{:.4f}'):>16}")
    return "\n".join(lines)


def _per_gpu_table(records, gpus, title, cell_text, key) -> list[str]:
    """A titled table of one column per GPU, each cell ``cell_text(record[key][gpu])``."""
    name = _kernel_names(records)
    return _titled_parts(title, ["kernel", *gpus],
                         [[name(r), *(cell_text(r[key][g]) for g in gpus)] for r in records], 1)


def _kernel_names(records):
    """A record's kernel cell: its kernel, marked "causal" where the records hold both
    settings (--causal both)."""
    mixed = len({r["causal"] for r in records}) > 1
    return lambda r: r["kernel"] + (" causal" if mixed and r["causal"] else "")


OCCUPANCY_LIMITS = {"memory": "mem", "threads": "thr", "registers": "reg"}


def _registers_cell(n: int) -> str:
    """The register estimate, flagged "!" above the budget (spill risk)."""
    return f"{n}!" if n > REGISTER_BUDGET else str(n)
