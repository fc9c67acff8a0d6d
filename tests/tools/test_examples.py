"""Smoke tests of the training example and the benchmark on tiny sizes (seconds each)."""

import dataclasses
import importlib.util
import json
import re
import time

import numpy as np
import pytest

from api_helpers import needs_emulator
from jax_flash_metal import benchmark
from jax_flash_metal.tools import benchmark_model, benchmark_tables, cli

HAVE_EXAMPLE_DEPS = all(importlib.util.find_spec(m) for m in ("optax", "tqdm"))
needs_examples = pytest.mark.skipif(not HAVE_EXAMPLE_DEPS,
                                    reason="the training example needs the [examples] extra")
if HAVE_EXAMPLE_DEPS:
    from jax_flash_metal.examples import train_lm

TEXT = b"the quick brown fox jumps over the lazy dog. " * 40


@needs_examples
def test_training_loss_decreases():
    cfg = dataclasses.replace(train_lm.TINY, steps=30)
    _, losses = train_lm.train(cfg, np.frombuffer(TEXT, np.uint8), "xla", progress=False)
    assert len(losses) == 30 and np.all(np.isfinite(losses))
    assert abs(losses[0] - np.log(256)) < 0.5  # starts near uniform over bytes
    assert np.mean(losses[-5:]) < losses[0] - 2.0  # the repetitive text is quickly learned


@needs_examples
def test_train_lm_main(implementation, tmp_path, capsys):
    # "implementation" is parametrised over implementations.available() by conftest.py.
    text = tmp_path / "text.txt"
    text.write_bytes(TEXT)
    steps = 10 if implementation == "emulator" else 30  # the emulator is slow by design
    result = train_lm.main(["--text", str(text), "--tiny", "--steps", str(steps), "--no-progress",
                            "--implementation", implementation, "--sample-bytes", "16",
                            "--prompt", "the "])
    out = capsys.readouterr().out
    assert result["implementation"] == implementation
    assert f"attention implementation: {implementation}" in out
    assert "loss (nats/byte): start" in out and "gradient check" in out
    assert len(result["losses"]) == steps
    drop = 1.0 if implementation == "emulator" else 2.0
    assert result["final_eval"] < result["initial_eval"] - drop
    assert result["sample"].startswith(b"the ") and len(result["sample"]) == 4 + 16
    assert result["sample_tokens_per_second"] > 0 and "tokens/s" in out
    check = result["check"]
    assert check["scale"] > 0
    for name in ("dq", "dk", "dv"):  # float32 attention: agreement to float32 rounding
        assert check[name] <= 1e-5 * check["scale"] + 1e-6, (name, check)


@needs_examples
@pytest.mark.parametrize("impl", ["xla", pytest.param("emulator", marks=needs_emulator)])
def test_kv_cache_sampling_reproduces_full_window_recomputation(impl):
    """The same bytes for the same seed, with a context restart (prompt + sample > seq_len)."""
    import jax

    cfg = train_lm.TINY
    params = train_lm.init_params(cfg, jax.random.PRNGKey(3))
    prompt, length = b"the q", cfg.seq_len + 8
    cached = train_lm.generate(params, cfg, impl, prompt, length, seed=4)
    full = train_lm.generate(params, cfg, impl, prompt, length, seed=4, cache=False)
    assert len(cached) == len(prompt) + length
    assert cached == full


@needs_examples
def test_paged_kv_cache_sampling_equals_the_contiguous_cache():
    """--paged: the same bytes for the same seed as the contiguous cache, across a context
    restart (the pages are handed out in shuffled order, one spare)."""
    import jax

    cfg = train_lm.TINY
    params = train_lm.init_params(cfg, jax.random.PRNGKey(5))
    prompt, length = b"for i", cfg.seq_len + 8
    paged = train_lm.generate(params, cfg, "xla", prompt, length, seed=6, paged=True)
    assert paged == train_lm.generate(params, cfg, "xla", prompt, length, seed=6)


@needs_examples
def test_train_lm_rejects_short_text(tmp_path):
    text = tmp_path / "short.txt"
    text.write_bytes(b"abc")
    with pytest.raises(ValueError, match="too short"):
        train_lm.main(["--text", str(text), "--tiny", "--no-progress", "--implementation", "xla"])


def split_cells(line):
    """The cells of a table line (cells are separated by two or more spaces)."""
    return re.split(r" {2,}", line.strip())


def assert_aligned(table, left=1):
    """Every row of a benchmark table (header, dashed rule, rows) puts each cell within its
    column of the rule: the first ``left`` columns left-aligned, the others right-aligned."""
    lines = table.strip("\n").splitlines()
    spans = [m.span() for m in re.finditer(r"-+", lines[1])]
    assert len(spans) == len(split_cells(lines[0])), lines[:2]
    for line in [lines[0]] + lines[2:]:
        cells = split_cells(line)
        assert len(cells) == len(spans), line
        for n, (cell, (start, end)) in enumerate(zip(cells, spans)):
            where = (start, start + len(cell)) if n < left else (end - len(cell), end)
            assert line[where[0]:where[1]] == cell, (line, cell, (start, end))


def joined_parts(text, keys=benchmark_tables.KEY_COLUMNS, width=cli.WIDTH):
    """The cells of each line of a table that ``format_table`` split into parts (each aligned,
    within ``width``, repeating the first ``keys`` columns), joined back into one table."""
    parts = text.split("\n\n")
    lines = None
    for part in parts:
        assert_aligned(part)
        assert max(len(line) for line in part.splitlines()) <= width
        cells = [line.split() if n != 1 else ["rule"] for n, line in enumerate(part.splitlines())]
        cells[0] = split_cells(part.splitlines()[0])
        if lines is None:
            lines = cells
        else:
            assert [c[:keys] for c in cells] == [c[:keys] for c in lines]
            lines = [a + b[keys:] for a, b in zip(lines, cells)]
    return lines


def test_attention_flops():
    # B=2, H=3, D=5; T=4: 16 pairs, causal 4*5/2 = 10 pairs.
    assert benchmark_model.attention_flops(2, 3, 4, 4, 5, False) == (4 * 30 * 16, 14 * 30 * 16)
    assert benchmark_model.attention_flops(2, 3, 4, 4, 5, True) == (4 * 30 * 10, 14 * 30 * 10)
    # Tq > Tkv, top-left causal: rows 0..2 see 1, 2, 3 keys, rows 3..5 see all 3.
    assert benchmark_model.attention_flops(1, 1, 6, 3, 1, True)[0] == 4 * (1 + 2 + 3 + 3 * 3)


@pytest.mark.host  # the benchmark lists and runs flash:emulator
def test_benchmark_decode_rows():
    rows = benchmark_model.run_benchmark(seq_lens=[], head_dims=[16], causal_modes=[True], batch=1,
                                   heads=4, kv_heads=2, repeats=1, run_up_to=64,
                                   emulator_max_len=64, decode_kv_lens=[64])
    assert [(r.method, r.q_len, r.seq_len) for r in rows] == \
        [(m, 1, 64) for m in benchmark_model.methods()]
    for r in rows:
        assert r.fwd_ms > 0 and r.fwd_flops == 4 * 4 * 64 * 16
    for line, r in zip(benchmark_tables.format_table(rows).splitlines()[2:], rows):
        assert line.split()[:4] == [r.method, "1x64", "16", "no"]


@pytest.mark.host
def test_benchmark_table():
    rows = benchmark_model.run_benchmark(seq_lens=[16, 64], head_dims=[16], causal_modes=[True],
                                   batch=1, heads=2, kv_heads=1, repeats=1, run_up_to=16,
                                   emulator_max_len=16)
    names = list(benchmark_model.methods())
    expected = [(m, t, True) for m in names for t in (16, 64)]
    assert [(r.method, r.seq_len, r.causal) for r in rows] == expected
    for r in rows:
        timed = r.seq_len <= 16
        assert (r.fwd_ms is not None) == timed and (r.fwdbwd_ms is not None) == timed
        assert r.fwd_ms is None or r.fwd_ms > 0
    text = benchmark_tables.format_table(rows)
    lines = joined_parts(text)
    # Columns with no value in any row are left out: off a Mac, the GPU-time ones (and the
    # timing note where no row is noisy).
    shown = [c for c in benchmark_tables.COLUMNS if ("flash:metal" in names or "GPU" not in c)
             and (c != "timing" or any(r.noisy for r in rows))
             and (c != "FFI KiB" or any(r.ffi_bytes is not None for r in rows))]
    assert lines[0] == shown
    assert len(lines) == 2 + len(rows)
    for cells, r in zip(lines[2:], rows):
        assert cells[:4] == [r.method, str(r.seq_len), "16", "yes"]
        assert len(cells) == len(shown)
        if r.seq_len > 16:
            assert cells[4:6] == ["-", "-"]  # compile-only: memory but no time
        if r.method != "flash:metal":  # GPU time is measured for Metal only
            assert r.fwd_gpu_ms is None and r.fwdbwd_gpu_ms is None
    # XLA:CPU reports memory on every supported JAX, also for compile-only rows.
    assert all(r.fwd_temp is not None and r.fwdbwd_temp is not None for r in rows)
    # The FFI handler's own working memory: for the methods that run the FFI, from its plan.
    for r in rows:
        assert (r.ffi_bytes is not None) == (r.method in ("flash:emulator", "flash:metal"))
        if r.method == "flash:emulator":
            from jax_flash_metal._ext import working_memory
            assert r.ffi_bytes == max(working_memory(d, "f32", 1, r.seq_len, r.seq_len, 2, 1, 16)
                                      for d in ("fwd", "bwd"))
    # The plain-jnp reference materialises the scores: temp memory grows with the sequence length.
    ref = {r.seq_len: r.fwd_temp for r in rows if r.method == "reference"}
    assert ref[64] > ref[16]


def test_benchmark_main_prints_table(capsys, tmp_path):
    path = tmp_path / "bench.json"
    rows = benchmark.main(["--lengths", "32", "--head-dim", "16", "--causal", "on",
                           "--heads", "2", "--repeats", "1", "--compile-rounds", "1",
                           "--impls", "flash:xla", "jax.nn", "--decode-kv-lens", "48",
                           "--json", str(path)])
    out = capsys.readouterr().out
    assert [(r.method, r.q_len) for r in rows] == [("flash:xla", None), ("jax.nn", None),
                                                   ("flash:xla", 1), ("jax.nn", 1)]
    assert "1x48" in out
    assert "fwd+bwd TFLOP/s" in out and "GPU" not in out  # no GPU timer off Metal
    assert "flash:xla" in out and "jax.nn" in out
    records = json.loads(path.read_text())["rows"]
    assert [(r["method"], r["fwd_gpu_ms"], r["fwdbwd_gpu_ms"]) for r in records] == \
        [(r.method, None, None) for r in rows]  # no GPU timer off Metal


def test_benchmark_gpu_time_is_the_timer_increase_within_each_call():
    gpu_seconds = [0.0]

    def call(x):  # stands in for a compiled call whose command buffers take 2 ms of GPU time
        gpu_seconds[0] += 2e-3
        return x

    x = np.zeros(3)
    ms, gpu_ms, _ = benchmark_model.time_interleaved({"a": call, "b": lambda x: x},
                                                     {"a": (x,), "b": (x,)}, 3,
                                                     {"a": lambda: gpu_seconds[0]})
    assert set(ms) == {"a", "b"} and list(gpu_ms) == ["a"]
    assert gpu_ms["a"] == pytest.approx(2.0)  # the warm-up call is not counted
    # The warm-up, 3 rounds, and up to 6 more while the times spread (noise).
    assert round(gpu_seconds[0] / 2e-3) in range(4, 11)


def test_benchmark_noisy_timings_take_more_rounds_and_are_marked():
    delays = iter([0.0] + [0.001, 0.02] * 20)  # warm-up, then alternating 1 and 20 ms

    def call(x):
        time.sleep(next(delays))
        return x

    _, _, noisy = benchmark_model.time_interleaved({"a": call}, {"a": (np.zeros(1),)}, 2)
    assert noisy == {"a"} and len(list(delays)) == 40 - 6  # stopped after 3 x 2 rounds


def test_benchmark_gpu_columns_and_percent_of_peak():
    row = benchmark_model.Row("flash:metal", 1024, 64, False, fwd_ms=2.0, fwdbwd_ms=8.0, fwd_temp=0,
                        fwdbwd_temp=0, fwd_flops=2 * 10**9, fwdbwd_flops=7 * 10**9,
                        compile_s=1.0, fwd_gpu_ms=1.0, fwdbwd_gpu_ms=3.5)
    cells = benchmark_tables.table_cells(row, peak_tflops=4.0)
    # wall 1 and 0.875 TFLOP/s; GPU 2 and 2 TFLOP/s = 50% of the 4 TFLOP/s peak
    assert cells[8] == "-"  # FFI KiB: not given for this row
    assert cells[9:11] == ["1", "0.875"]
    assert cells[12:] == ["1.000", "3.500", "2", "2", "50.0", "50.0", "-"]
    wall_only = dataclasses.replace(row, method="flash:xla", fwd_gpu_ms=None, fwdbwd_gpu_ms=None,
                                    noisy=True)
    assert benchmark_tables.table_cells(wall_only, peak_tflops=4.0)[12:] == \
        ["-"] * 4 + ["25.0", "21.9", "noisy"]


def test_apple_gpu_peak_from_the_roofline_table():
    # M1: 8 cores x 256 FLOPs/cycle x 1.278 GHz = 2.617 TFLOP/s (roofline.GPUS)
    peak, text = benchmark_model.apple_gpu_peak_tflops("Apple M1", None)
    assert peak == pytest.approx(8 * 256 * 1.278e-3) and "largest configuration" in text
    peak, _ = benchmark_model.apple_gpu_peak_tflops("Apple M1 Max", 24)  # binned part: 24 cores
    assert peak == pytest.approx(24 * 256 * 1.296e-3)
    peak, text = benchmark_model.apple_gpu_peak_tflops("Apple M2 Pro", 19)  # M2 Max clock
    assert peak == pytest.approx(19 * 256 * 1.398e-3) and "M2 Max clock assumed" in text
    for gpu in ("Apple M1 Max", "Apple M2 Max", "Apple M3 Max", "Apple M4", "Apple M4 Max"):
        assert benchmark_model.apple_gpu_peak_tflops(gpu, None)[0] > 0
    assert benchmark_model.apple_gpu_peak_tflops("Apple M2 Pro", None)[0] is None  # cores unknown
    assert benchmark_model.apple_gpu_peak_tflops("AMD Radeon Pro 5500M", 24)[0] is None


@pytest.mark.parametrize("argv,match", [
    (["--impls", "bogus"], "--impls: unknown"), (["--ratio-method", "bogus"], "--ratio-method"),
    (["--peak-tflops", "-1"], "must be positive"), (["--json", "/no/such/folder/a.json"], "--json")])
def test_benchmark_refuses_bad_options_before_measuring(capsys, argv, match):
    with pytest.raises(SystemExit) as exit_:
        benchmark.parse_args(argv)
    assert exit_.value.code == 2 and match in capsys.readouterr().err


def test_benchmark_rejects_unknown_method():
    with pytest.raises(ValueError, match="unknown or unavailable"):
        benchmark_model.methods(["flash:nonexistent"])


def test_benchmark_leaves_out_a_method_that_cannot_compile_the_dtype(monkeypatch, capsys):
    """A method XLA cannot compile in the dtype (float16 jax.nn on XLA:CPU) is left out with a
    note naming it and the reason; the others run."""
    def fails(q, k, v, causal):
        raise ValueError("no float16 dot here\nmore")
    table = {"jax.nn": fails, "flash:xla": benchmark_model.methods(["flash:xla"])["flash:xla"]}
    monkeypatch.setattr(benchmark_model, "methods", lambda names=None: dict(table))
    rows = benchmark_model.run_benchmark(seq_lens=[16], head_dims=[16], causal_modes=[False],
                                         batch=1, heads=2, kv_heads=2, repeats=1, run_up_to=16,
                                         decode_kv_lens=[], dtype="float16")
    assert [r.method for r in rows] == ["flash:xla"]
    assert "jax.nn: not run in float16 here: no float16 dot here\n" in capsys.readouterr().err


def test_benchmark_ratios_and_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rows = benchmark.main(["--lengths", "16", "32", "--head-dim", "8", "--causal", "off",
                           "--heads", "2", "--repeats", "1", "--compile-rounds", "1",
                           "--impls", "flash:xla", "flash:xla+dropout", "jax.nn", "--json",
                           str(path)])
    out = capsys.readouterr().out
    assert "flash:xla / jax.nn" in out and "memory growth" in out
    # After the header lines: the table's parts and its notes, the ratios to jax.nn, those of
    # dropout, the memory growth.
    blocks = out.split("\n\n")[1:]
    first_ratio = next(n for n, b in enumerate(blocks) if b.startswith("flash:xla / jax.nn"))
    table = "\n\n".join(blocks[:first_ratio])
    assert "temp MiB: XLA's compiled temporaries" in table  # what the memory columns count
    joined_parts(table[:table.index("\ntemp MiB:")])
    assert blocks[first_ratio + 1].startswith("flash:xla+dropout / flash:xla")
    assert len(blocks) == first_ratio + 3
    for block, left in zip(blocks[first_ratio:], (0, 0, 1)):  # ratios: every column a number
        assert_aligned(block.split(":\n", 1)[-1].split("\nJSON")[0], left)
    growth = blocks[-1].split("\nJSON")[0].splitlines()
    assert split_cells(growth[1]) == ["method", "hdim", "causal", "16->32"]
    assert len(growth) == 3 + 3  # title, header, rule, one row per method
    data = json.loads(path.read_text())
    assert [r["method"] for r in data["rows"]] == [r.method for r in rows]
    assert [(e["seq_len"], e["causal"]) for e in data["ratios"]] == [(16, False), (32, False)]
    by = {(r.method, r.seq_len): r for r in rows}
    for e in data["dropout_ratios"]:
        mine, base = by["flash:xla+dropout", e["seq_len"]], by["flash:xla", e["seq_len"]]
        assert e["fwdbwd_time"] == mine.fwdbwd_ms / base.fwdbwd_ms
    for e in data["ratios"]:
        mine, base = by["flash:xla", e["seq_len"]], by["jax.nn", e["seq_len"]]
        assert e["fwdbwd_time"] == mine.fwdbwd_ms / base.fwdbwd_ms
        assert e["compile_time"] == mine.compile_s / base.compile_s > 0
    growth = {(g["method"], g["from_len"], g["to_len"]) for g in data["memory_growth"]}
    assert growth == {("flash:xla", 16, 32), ("flash:xla+dropout", 16, 32), ("jax.nn", 16, 32)}


def test_compile_floor_fixtures_are_attention():
    """benchmarks/xla_compile_floor.py's bare FlashAttention-2s (what its compile-time floor is
    measured on) compute attention and its gradients (float64 oracle)."""
    import pathlib

    import jax
    import jax.numpy as jnp
    import tolerance
    from api_helpers import make_inputs

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "xla_compile_floor.py"
    spec = importlib.util.spec_from_file_location("xla_compile_floor", path)
    floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floor)
    q, k, v, do, _ = make_inputs(3, 1, 256, 256, 2, 2, 64, jnp.float32)
    for name in ("bare FA-2, two loops", "bare FA-2, one loop"):
        o, vjp = jax.vjp(lambda q, k, v: floor.METHODS[name](q, k, v, False), q, k, v)
        got = dict(zip(("o", "dq", "dk", "dv"), (o, *vjp(do))))
        tolerance.assert_all_match_oracle(got, q, k, v, do, names=tuple(got))


def test_benchmark_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: [256, 1024, 4096, 16384])", "(default: [64])", "(default: [2048])",
                    "(default: both)", "(default: 5)", "(default: 3)", "(default: --heads)",
                    "(default: flash:xla)", "(default: False)"):
        assert default in text
    assert "(default: None)" not in text


def test_benchmark_defaults_time_every_row_here():
    """The default run is short (one head dim) and its decode rows are timed here: their KV
    length is within --run-up-to, and small enough for the emulator."""
    args = benchmark.parse_args([])
    assert args.head_dim == [64] and args.lengths == [256, 1024, 4096, 16384]
    for kv_len in args.decode_kv_lens:
        for method in benchmark_model.methods():
            assert benchmark_model.is_timed(method, kv_len, 1, args.run_up_to,
                                            args.emulator_max_len)
    assert not benchmark_model.is_timed("flash:emulator", 512, None, 2048, 256)
    assert not benchmark_model.is_timed("jax.nn", 4096, None, 2048, 256)


def test_benchmark_progress_bar_counts_every_step(capsys):
    """One step per compile and per timed round (warm-up included): 2 points x (2 methods x 2
    compile rounds + 1 + 2 rounds), then a compile-only point (64 > --run-up-to): 2 x 2."""
    benchmark.main(["--lengths", "16", "64", "--head-dim", "8", "--causal", "off", "--heads",
                    "1", "--repeats", "2", "--compile-rounds", "2", "--impls", "flash:xla",
                    "jax.nn",
                    "--decode-kv-lens", "16", "--run-up-to", "16"])
    err = capsys.readouterr().err
    total = 2 * (2 * 2 + 1 + 2) + 2 * 2
    assert f"{total}/{total}" in err and "benchmark" in err
    benchmark.main(["--lengths", "16", "--head-dim", "8", "--heads", "1", "--repeats", "1",
                    "--compile-rounds", "1", "--impls", "jax.nn", "--decode-kv-lens",
                    "--no-progress"])
    assert capsys.readouterr().err == ""


def test_progress_without_tqdm_prints_plain_lines(monkeypatch, capsys):
    """Without tqdm the CLIs still report progress (done/total lines) and say how to get a bar."""
    import sys

    from jax_flash_metal.tools.cli import progress_bar
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    bar = progress_bar(2, "benchmark")
    bar.update(1)
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert "pip install tqdm" in err and "benchmark: 1/2" in err and "benchmark: 2/2" in err
    quiet = progress_bar(2, "benchmark", enabled=False)
    quiet.update(2)
    assert capsys.readouterr().err == ""
