"""The kernel profile's tables: counts, roofline model and occupancy per launch, and paged
against contiguous device bytes."""

from __future__ import annotations

from .profile_model import _stage
from .roofline import REGISTER_BUDGET

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
        "jax_flash_metal/tools/roofline.py):",
        lambda m: (f"{BOUND_ABBREVIATIONS[m['bound']]:>4} {m['seconds'] * 1e3:>9.3f}ms "
                   f"{m['percent_of_peak']:>5.1f}%"), "model")
    lines += _per_gpu_table(
        records, gpus, 14,  # "24/24 reg"
        "occupancy MODEL (per core: threadgroups/simdgroups that fit, and the binding limit: "
        "mem = threadgroup memory, thr = threads, reg = registers; "
        "jax_flash_metal/tools/roofline.py):",
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
