"""python -m jax_flash_metal.selfcheck on the emulator, with a tiny grid (--quick, one kernel
family): every step passes and the JSON report has the keys docs/selfcheck.md documents. The
families and dropout_paging steps compare with the self-check's float64 oracle; the correctness
step with the xla implementation, which the rest of the suite checks against tests/oracle.py."""

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal import selfcheck  # noqa: E402
from jax_flash_metal.core import tolerance  # noqa: E402
from jax_flash_metal.tools import chip_peaks  # noqa: E402


def test_selfcheck_passes_on_the_emulator_and_writes_its_report(tmp_path):
    path = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "jax_flash_metal.selfcheck", "--implementation",
                        "emulator", "--json", str(path), "--quick", "--families", "f32/16/16",
                        "--head-dims", "16", "--features", "plain", "causal_lengths",
                        "--seq-len", "64", "--repeats", "1"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all steps passed" in r.stdout
    assert "  metal: " in r.stdout  # every device is listed, Metal's with why it cannot run
    report = json.loads(path.read_text())
    assert set(report) == {"schema_version", "implementation", "device", "quick", "environment",
                           "passed", "steps"}
    assert report["implementation"] == "emulator" and report["passed"] is True
    assert report["environment"]["devices"]["emulator"] == "MSL-on-CPU emulator"
    assert list(report["steps"]) == ["lane_layout", "compile", "families", "dropout_paging",
                                     "correctness", "profile", "timings", "tuning", "speed"]
    for name, step in report["steps"].items():
        assert {"passed", "seconds", "detail"} <= set(step), name
        assert step["passed"] in (True, None), (name, step["detail"])
        assert f"{name} (" in r.stdout
    cases = report["steps"]["correctness"]["cases"]
    assert [(c["head_dim"], c["feature"]) for c in cases] == [(16, "plain"),
                                                              (16, "causal_lengths")]
    assert all(set(c["max_abs_error"]) == {"o", "lse", "dq", "dk", "dv"} for c in cases)
    families = report["steps"]["families"]["cases"]
    assert [(c["dtype"], c["head_dims"], c["path"]) for c in families] == [
        ("f32", [16, 16], path) for path in ("forward_backward", "decode_vector",
                                             "decode_partial")]
    kernels = {k for c in families for k in c["kernels"]}
    assert {k.split("_f32_")[0] for k in kernels} == {
        "flash_attention_" + s for s in ("fwd", "decode_vector", "decode_partial",
                                          "decode_combine", "bwd_dq", "bwd_dkdv")}
    paths = [(c["feature"], c["path"]) for c in report["steps"]["dropout_paging"]["cases"]]
    assert paths == [("dropout", "forward_backward")] + [
        ("paged", p) for p in ("forward_backward", "decode_vector", "decode_partial")]
    tuning = report["steps"]["tuning"]
    assert tuning["meaningful"] is False and tuning["cache"] is None  # nothing cached
    assert [(r["key"].split("|")[3], r["variant"] is not None) for r in tuning["rows"]] == [
        ("kernels=fwd", True), ("kernels=bwd_dq+bwd_dkdv", True),
        ("kernels=decode_partial+decode_combine", True)]
    assert [r["speed"]["kind"] for r in tuning["rows"]] == ["forward", "backward", "decode"]
    speed = report["steps"]["speed"]
    assert speed["meaningful"] is False and [r["kind"] for r in speed["rows"]] == ["forward",
                                                                                  "decode"]


def test_family_errors_are_judged_against_the_oracle():
    """A fused result off by more than the tolerance fails its case (the check can fail)."""
    want = {"o": np.ones(4)}
    assert tolerance.within("o", np.ones(4) + 1e-6, want["o"])[0]
    assert not tolerance.within("o", np.ones(4) + 1e-3, want["o"])[0]
    baseline = np.ones(4) + 1e-3  # a half-precision baseline 1e-3 off allows 2e-3 + 1e-5
    assert tolerance.within("o", np.ones(4) + 2e-3, want["o"], baseline)[0]
    assert not tolerance.within("o", np.ones(4) + 3e-3, want["o"], baseline)[0]


def test_chip_peaks_scale_binned_parts_and_know_their_limits():
    full = chip_peaks.peak("Apple M1 Max", 32, 32)
    assert (full["tflops"], full["gb_per_s"]) == (10.4, 400.0) and full["source"]
    assert chip_peaks.peak("Apple M1 Max", 24, 32)["tflops"] == 10.4 * 24 / 32
    assert chip_peaks.peak("Apple M3 Max", 40, 40)["tflops"] is None
    assert chip_peaks.peak("MSL-on-CPU emulator", 32, 10)["source"] is None


def test_a_failing_step_fails_the_report(monkeypatch):
    """A step that raises is reported as failed with its error, and the report fails."""
    def broken(*args):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(selfcheck, "lane_layout", broken)
    monkeypatch.setattr(selfcheck, "correctness", lambda *a: (True, "skipped here", []))
    monkeypatch.setattr(selfcheck, "families", lambda *a: (True, "skipped here", []))
    monkeypatch.setattr(selfcheck, "dropout_and_paging", lambda *a: (True, "skipped here", []))
    monkeypatch.setattr(selfcheck, "speed", lambda *a: (True, "skipped here", {}))
    monkeypatch.setattr(selfcheck, "tuning", lambda *a: (True, "skipped here", {}))
    monkeypatch.setattr(selfcheck, "kernel_profile", lambda *a: (None, "skipped here"))
    monkeypatch.setattr(selfcheck, "timings", lambda *a: (True, "skipped here"))
    report = selfcheck.run("emulator", [16], ["plain"], 64, 1)
    assert report["passed"] is False
    assert report["steps"]["lane_layout"]["passed"] is False
    assert "RuntimeError: probe exploded" in report["steps"]["lane_layout"]["detail"]
    assert "FAIL lane_layout" in selfcheck.format_report(report)


def test_selfcheck_refuses_a_head_dim_without_kernels(capsys):
    """Before any step runs, naming the option and the head dims the kernels take."""
    with pytest.raises(SystemExit) as exit_:
        selfcheck.main(["--implementation", "emulator", "--head-dim", "16", "17"])
    assert exit_.value.code == 2 and "--head-dim: the kernels take" in capsys.readouterr().err
