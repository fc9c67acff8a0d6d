"""The benchmark's tables: ratios to a baseline, memory growth, the aligned text table and the
optional plot."""

from __future__ import annotations

from .._extras import install_hint
from .benchmark_model import Row
from .cli import WIDTH, aligned, split_columns


def ratios(rows: list[Row], method: str = "flash:xla", baseline: str = "jax.nn") -> list[dict]:
    """Per (seq_len, head_dim, causal) measured for both: ``method`` / ``baseline`` ratios of
    forward+backward time, compile time and forward+backward temporary memory (None where
    either side was not measured)."""
    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    rows = [r for r in rows if r.q_len is None]  # the decode rows are compared nowhere
    base = {(r.seq_len, r.head_dim, r.causal): r for r in rows if r.method == baseline}
    out = []
    for r in rows:
        b = base.get((r.seq_len, r.head_dim, r.causal))
        if r.method != method or b is None:
            continue
        out.append(dict(seq_len=r.seq_len, head_dim=r.head_dim, causal=r.causal,
                        fwdbwd_time=ratio(r.fwdbwd_ms, b.fwdbwd_ms),
                        compile_time=ratio(r.compile_s, b.compile_s),
                        fwdbwd_temp=ratio(r.fwdbwd_temp, b.fwdbwd_temp)))
    return out


def memory_growth(rows: list[Row]) -> list[dict]:
    """Forward+backward temporary memory at each length divided by that at the previous
    length, per (method, head_dim, causal)."""
    out = []
    series: dict[tuple, list[Row]] = {}
    for r in (r for r in rows if r.q_len is None):  # the decode rows are not a length sweep
        series.setdefault((r.method, r.head_dim, r.causal), []).append(r)
    for (method, head_dim, causal), pts in series.items():
        pts = sorted(pts, key=lambda r: r.seq_len)
        for a, b in zip(pts, pts[1:]):
            if a.fwdbwd_temp and b.fwdbwd_temp is not None:
                out.append(dict(method=method, head_dim=head_dim, causal=causal,
                                from_len=a.seq_len, to_len=b.seq_len,
                                growth=b.fwdbwd_temp / a.fwdbwd_temp))
    return out


def format_ratios(entries: list[dict], method: str, baseline: str) -> str:
    """``ratios`` output as a table."""
    body = [[str(e["seq_len"]), str(e["head_dim"]), "yes" if e["causal"] else "no",
             _fmt(e["fwdbwd_time"], ".2f"), _fmt(e["compile_time"], ".2f"),
             _fmt(e["fwdbwd_temp"], ".3f")] for e in entries]
    return (f"{method} / {baseline} (forward+backward; < 1 means {method} is faster/smaller):\n"
            + aligned(["seq", "hdim", "causal", "time", "compile", "temp"], body, left=0))


def format_growth(entries: list[dict]) -> str:
    """``memory_growth`` output: one row per (method, head dim, causal), one column per step
    between consecutive lengths."""
    steps = sorted({(e["from_len"], e["to_len"]) for e in entries})
    series: dict[tuple, dict] = {}
    for e in entries:
        key = (e["method"], e["head_dim"], e["causal"])
        series.setdefault(key, {})[e["from_len"], e["to_len"]] = e["growth"]
    body = [[m, str(d), "yes" if c else "no"] + [_fmt(g.get(st), ".2f") for st in steps]
            for (m, d, c), g in series.items()]
    return ("forward+backward temporary memory growth (x) from one length to the next:\n"
            + aligned(["method", "hdim", "causal"] + [f"{a}->{b}" for a, b in steps], body))


# Printed tables repeat these columns in each part that fits WIDTH (split_columns).
KEY_COLUMNS = 4
MEMORY_NOTE = ("temp MiB: XLA's compiled temporaries (memory_analysis().temp_size_in_bytes), "
               "beyond inputs and outputs. For flash:metal and flash:emulator that is the "
               "buffers their custom calls declare (e.g. the decode's workspace). FFI KiB: "
               "what the FFI handler itself allocates, outside XLA, for the larger of the "
               "forward and backward calls (the kernels' parameter blocks and copied lengths, "
               "from the extension's plan); not counted: Metal staging copies of host ranges "
               "that cannot be wrapped in place (_ext.take_working_memory reports them as "
               "calls run) and on-chip threadgroup memory (python -m jax_flash_metal.profile).")
COLUMNS = ("method", "seq", "hdim", "causal", "fwd ms", "fwd+bwd ms", "fwd temp MiB",
           "fwd+bwd temp MiB", "FFI KiB", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "compile s", "fwd GPU ms",
           "fwd+bwd GPU ms", "fwd GPU TFLOP/s", "fwd+bwd GPU TFLOP/s", "timing")


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _tflops(flops: int, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def table_cells(row: Row, peak_tflops: float | None = None) -> list[str]:
    """The text cells of one row, in COLUMNS order (plus "% peak" cells when a peak is given:
    of the GPU-time TFLOP/s where measured, else of the wall-time TFLOP/s)."""
    fwd_tf, fb_tf = _tflops(row.fwd_flops, row.fwd_ms), _tflops(row.fwdbwd_flops, row.fwdbwd_ms)
    fwd_gpu_tf = _tflops(row.fwd_flops, row.fwd_gpu_ms)
    fb_gpu_tf = _tflops(row.fwdbwd_flops, row.fwdbwd_gpu_ms)
    mib = 1 << 20
    seq = str(row.seq_len) if row.q_len is None else f"{row.q_len}x{row.seq_len}"
    cells = [row.method, seq, str(row.head_dim), "yes" if row.causal else "no",
             _fmt(row.fwd_ms, ".2f"), _fmt(row.fwdbwd_ms, ".2f"),
             _fmt(None if row.fwd_temp is None else row.fwd_temp / mib, ".1f"),
             _fmt(None if row.fwdbwd_temp is None else row.fwdbwd_temp / mib, ".1f"),
             _fmt(None if row.ffi_bytes is None else row.ffi_bytes / 1024, ".1f"),
             _fmt(fwd_tf, ".3g"), _fmt(fb_tf, ".3g"), _fmt(row.compile_s, ".2f"),
             _fmt(row.fwd_gpu_ms, ".3f"), _fmt(row.fwdbwd_gpu_ms, ".3f"),
             _fmt(fwd_gpu_tf, ".3g"), _fmt(fb_gpu_tf, ".3g")]
    if peak_tflops:
        for gpu_tf, wall_tf in ((fwd_gpu_tf, fwd_tf), (fb_gpu_tf, fb_tf)):
            tf = gpu_tf if gpu_tf is not None else wall_tf
            cells.append(_fmt(None if tf is None else 100 * tf / peak_tflops, ".1f"))
    return cells + ["noisy" if row.noisy else "-"]


def format_table(rows: list[Row], peak_tflops: float | None = None, width: int = WIDTH) -> str:
    """Aligned plain-text table of ``rows`` (``aligned``), split into tables of at most
    ``width`` columns that each repeat the KEY_COLUMNS (``split_columns``). Columns without a
    value in any row are left out (e.g. the GPU-time columns off a Mac: they are measured for
    flash:metal only); ``--json`` keeps every field."""
    header = (list(COLUMNS[:-1]) + (["fwd % peak", "fwd+bwd % peak"] if peak_tflops else [])
              + [COLUMNS[-1]])
    body = [table_cells(r, peak_tflops) for r in rows]
    keep = [i for i in range(len(header)) if any(line[i] != "-" for line in body)] \
        if body else list(range(len(header)))
    parts = split_columns([header[i] for i in keep], [[line[i] for i in keep] for line in body],
                          KEY_COLUMNS, width)
    return "\n\n".join(aligned(h, b) for h, b in parts)


def _pyplot():
    """matplotlib.pyplot (file-only backend); SystemExit with an install hint if it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"--plot needs matplotlib, which is not installed; install the [plot] "
                         f"extra, {install_hint('plot')}") from None
    return plt


def plot(rows: list[Row], path: str) -> None:
    """Save to ``path``: forward+backward time and temporary memory against sequence length
    (square rows), and forward time against the KV-cache length (decode rows, if any); one
    legend below the panels, outside the data.

    Raises SystemExit with an install hint if matplotlib is missing.
    """
    plt = _pyplot()
    decode = [r for r in rows if r.q_len is not None and r.fwd_ms is not None]
    rows = [r for r in rows if r.q_len is None]
    panels = 3 if decode else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    ax_t, ax_m = axes[:2]
    series = sorted({(r.method, r.head_dim, r.causal, r.dtype) for r in rows + decode})
    several_dtypes = len({key[3] for key in series}) > 1
    for color, key in enumerate(series):
        method, head_dim, causal, dtype = key
        style = dict(color=f"C{color % 10}", label=f"{method} d={head_dim}"
                     f"{' causal' if causal else ''}{' ' + dtype if several_dtypes else ''}")
        pts = [r for r in rows if (r.method, r.head_dim, r.causal, r.dtype) == key]
        timed = [r for r in pts if r.fwdbwd_ms is not None]
        if timed:
            ax_t.plot([r.seq_len for r in timed], [r.fwdbwd_ms for r in timed], "o-", **style)
        mem = [(r.seq_len, r.fwdbwd_temp) for r in pts if r.fwdbwd_temp is not None]
        if mem:
            ax_m.plot([t for t, _ in mem], [max(m, 1) / (1 << 20) for _, m in mem], "o-",
                      **style)
        dec = [r for r in decode if (r.method, r.head_dim, r.causal, r.dtype) == key]
        if dec:
            axes[2].plot([r.seq_len for r in dec], [r.fwd_ms for r in dec], "s--", **style)
    titles = [(ax_t, "forward+backward time (ms)", "sequence length"),
              (ax_m, "forward+backward compiled temp memory (MiB)", "sequence length")]
    if decode:
        titles.append((axes[2], f"decode forward time (ms), {decode[0].q_len} query",
                       "KV-cache length"))
    for ax, title, xlabel in titles:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    # One legend for every panel, below them: it never covers a point.
    handles: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="lower center", fontsize=7,
               ncol=min(4, len(handles)), frameon=False)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(handles) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=120)
