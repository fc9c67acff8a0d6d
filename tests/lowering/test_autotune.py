"""The on-device autotuner (docs/tuning.md) on the emulated device with injected timings: the
fastest agreeing variant is chosen and reaches the FFI call, persisted and reused by a later
process, retuned when the GPU, macOS or package changes, a corrupt or foreign cache file is
ignored with a warning, concurrent writers leave a valid file, the switches disable tuning or
force a variant, and a variant that disagrees with the xla implementation is rejected."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from api_helpers import needs_emulator
from jax_flash_metal import flash_attention, tune
from jax_flash_metal.core import tuning_cache, variants
from jax_flash_metal.lowering import autotune

SPEC = jax.ShapeDtypeStruct((1, 17, 2, 16), jnp.float32)  # one forward family with 2 variants


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """Each test: its own cache file, tuning on, no forced variant, nothing remembered."""
    monkeypatch.setenv(tuning_cache.ENV, str(tmp_path / "tuning.json"))
    monkeypatch.setenv(variants.AUTOTUNE_ENV, "1")
    monkeypatch.delenv(variants.ENV, raising=False)
    autotune.forget()
    yield
    tune.configure()
    autotune.forget()


def fake_timer(seconds, wrong=()):
    """A timer hook: the variant's outputs as computed (``wrong`` variants' O shifted by 1) and
    the injected ``seconds[variant]``; records the variants timed."""
    def timer(run, implementation, variant):
        timer.timed.append(variant)
        outputs = list(run())
        if variant in wrong:
            outputs[0] = outputs[0] + 1.0
        return outputs, seconds[variant]
    timer.timed = []
    return timer


def lowered_variant() -> int:
    """Lower a fresh forward call; the kernel_variant attribute its FFI call carries."""
    text = jax.jit(lambda q: flash_attention(q, q, q, implementation="emulator")).lower(
        SPEC).as_text()
    [variant] = re.findall(r"kernel_variant = (\d+) : i32", text)
    return int(variant)


def entries():
    with open(tuning_cache.path()) as f:
        return json.load(f)["entries"]


@needs_emulator
@pytest.mark.parametrize("seconds,chosen", [({0: 2.0, 1: 1.0}, 1), ({0: 1.0, 1: 2.0}, 0)])
def test_the_fastest_variant_reaches_the_call_and_the_file(monkeypatch, seconds, chosen):
    timer = fake_timer(seconds)
    monkeypatch.setattr(autotune, "timer", timer)
    assert lowered_variant() == chosen
    assert sorted(timer.timed) == [0, 1]
    [(key, entry)] = entries().items()
    assert entry["variant"] == chosen and entry["seconds"] == {"0": seconds[0], "1": seconds[1]}
    assert "dtype=float32|head_dims=16x16|features=plain|lengths=q32_kv32" in key
    assert lowered_variant() == chosen and len(timer.timed) == 2  # this process remembers


@needs_emulator
def test_a_later_process_reuses_the_file_and_a_version_change_retunes(monkeypatch):
    monkeypatch.setattr(autotune, "timer", fake_timer({0: 2.0, 1: 1.0}))
    assert lowered_variant() == 1
    autotune.forget()  # as a new process: only the file remembers
    reused = fake_timer({0: 1.0, 1: 2.0})
    monkeypatch.setattr(autotune, "timer", reused)
    assert lowered_variant() == 1 and reused.timed == []
    environment = autotune.environment("emulator")
    for field, value in [("package", "9.9.9+0"), ("macos", "99.0"), ("gpu", "Apple M9")]:
        autotune.forget()
        changed = dict(environment, **{field: value})
        monkeypatch.setattr(autotune, "environment", lambda implementation: changed)
        assert lowered_variant() == 0, field  # retuned: variant 0 is now the faster
        assert len(reused.timed) == 2, field
        reused.timed.clear()
    assert len(entries()) == 4


@needs_emulator
@pytest.mark.parametrize("content", ["{not json", '["a", "list"]',
                                     '{"format": "another tool", "entries": {}}'])
def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning(monkeypatch, content):
    with open(tuning_cache.path(), "w") as f:
        f.write(content)
    monkeypatch.setattr(autotune, "timer", fake_timer({0: 2.0, 1: 1.0}))
    with pytest.warns(UserWarning, match="ignoring the tuning cache"):
        assert lowered_variant() == 1
    assert [e["variant"] for e in entries().values()] == [1]  # replaced by a valid file


@needs_emulator
def test_a_variant_that_disagrees_is_rejected(monkeypatch):
    timer = fake_timer({0: 2.0, 1: 1.0}, wrong=(1,))
    monkeypatch.setattr(autotune, "timer", timer)
    with pytest.warns(UserWarning, match="kernel variant 1 disagrees with the xla"):
        assert lowered_variant() == 0
    [entry] = entries().values()
    assert entry["variant"] == 0 and entry["rejected"]["1"].startswith("o: max error")


@needs_emulator
def test_the_switches(monkeypatch):
    timer = fake_timer({0: 2.0, 1: 1.0})
    monkeypatch.setattr(autotune, "timer", timer)
    for name, value, want in [(variants.AUTOTUNE_ENV, "0", 0), (variants.ENV, "1", 1)]:
        monkeypatch.setenv(name, value)
        assert lowered_variant() == want
        monkeypatch.delenv(name)
    monkeypatch.setenv(variants.AUTOTUNE_ENV, "1")
    tune.configure(autotune=False)
    assert lowered_variant() == 0
    tune.configure(variant=1, autotune=True)
    assert lowered_variant() == 1
    tune.configure()
    monkeypatch.delenv(variants.AUTOTUNE_ENV)  # the default: the emulator is not tuned
    assert lowered_variant() == 0
    assert timer.timed == [] and not os.path.exists(tuning_cache.path())
    monkeypatch.setenv(variants.AUTOTUNE_ENV, "sometimes")
    with pytest.raises(ValueError, match="JFM_AUTOTUNE"):
        lowered_variant()
    with pytest.raises(ValueError, match="variant must be"):
        tune.configure(variant=-1)
    with pytest.raises(TypeError, match="variant must be"):
        tune.configure(variant="1")
    tune.configure(variant=np.int64(1))  # any integer type
    assert variants.settings()["variant"] == 1
    tune.configure()


WRITER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("tuning_cache", sys.argv[3])  # stdlib only: fast
tuning_cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tuning_cache)
for n in range(25):
    tuning_cache.store({f"{sys.argv[1]}-{n}": {"variant": n % 2}}, sys.argv[2])
"""


def test_processes_writing_at_once_leave_a_valid_file_with_every_entry():
    path = tuning_cache.path()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, name, path, tuning_cache.__file__])
               for name in ("a", "b")]
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    assert tuning_cache.load(path) == {f"{name}-{n}": {"variant": n % 2}
                                       for name in ("a", "b") for n in range(25)}


@needs_emulator
def test_the_program_tunes_ahead_of_time_and_a_second_run_reads_the_cache(monkeypatch, capsys):
    monkeypatch.setattr(autotune, "timer", fake_timer({0: 2.0, 1: 1.0}))
    argv = ["--shape", "1,17,2,16", "--dtype", "float32", "--causal", "both",
            "--implementation", "emulator"]
    for source in ("tuned", "cache"):
        assert tune.main(argv) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()
                if line.startswith("1,17,17,2,2,16")]
        assert [row[1:] for row in rows] == [
            ["fwd", "float32", features, "q32_kv32", "2000.000", "1000.000", "1", source]
            for features in ("plain", "causal")]
    assert variants.settings() == {"variant": None, "autotune": None}  # restored


@needs_emulator
def test_a_models_calls_are_tuned_with_their_own_features(monkeypatch):
    monkeypatch.setattr(autotune, "timer", fake_timer({0: 2.0, 1: 1.0}))
    bias = jax.ShapeDtypeStruct((1, 2, 17, 17), jnp.float32)

    def step(q, bias):
        return flash_attention(q, q, q, bias, is_causal=True, implementation="emulator").sum()

    rows = tune.tune_function(jax.grad(step), SPEC, bias)
    assert [r["key"].split("|")[3:6] for r in rows] == [
        ["kernels=fwd", "dtype=float32", "head_dims=16x16"],
        ["kernels=bwd_dq+bwd_dkdv", "dtype=float32", "head_dims=16x16"]]
    assert {r["key"].split("|")[6] for r in rows} == {"features=causal+bias"}
    assert [r["variant"] for r in rows] == [1, 1] and len(entries()) == 2


def test_the_cache_never_replaces_what_is_not_a_regular_file(tmp_path):
    """A cache path that is a directory (or a device) is refused, not replaced; a symbolic link
    is written through to its target."""
    with pytest.raises(OSError, match="not a regular file"):
        tuning_cache.store({"k": {"variant": 1}}, str(tmp_path))
    assert tmp_path.is_dir()
    target = tmp_path / "target.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    tuning_cache.store({"k": {"variant": 1}}, str(link))
    assert link.is_symlink() and tuning_cache.load(str(target)) == {"k": {"variant": 1}}


def test_entries_without_a_valid_variant_are_dropped_with_a_warning(tmp_path):
    file = tmp_path / "t.json"
    file.write_text(json.dumps({"format": tuning_cache.FORMAT,
                                "entries": {"a": {"variant": 0}, "b": 5}}))
    with pytest.warns(UserWarning, match="dropped 1 entries"):
        assert tuning_cache.load(str(file)) == {"a": {"variant": 0}}


@needs_emulator
@pytest.mark.parametrize("argv,env,match", [
    (["--shape", "1,64,3,16", "--kv-heads", "2"], {}, "must be a multiple"),
    (["--shape", "1,64,2,17"], {}, "head_dim 17"),
    (["--shape", "1,64,2,16"], {"JFM_KERNEL_VARIANT": "abc"}, "JFM_KERNEL_VARIANT"),
    (["--shape", "1,64,2,16"], {"JFM_TUNE_CACHE": "DIR"}, "not a regular file")])
def test_the_tune_program_refuses_bad_input_in_one_line(tmp_path, monkeypatch, capsys, argv,
                                                       env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path) if value == "DIR" else value)
    if "JFM_TUNE_CACHE" not in env:
        monkeypatch.setenv("JFM_TUNE_CACHE", str(tmp_path / "t.json"))
    with pytest.raises(SystemExit) as exit_:
        tune.main([*argv, "--implementation", "emulator"])
    assert exit_.value.code == 2 and match in capsys.readouterr().err
