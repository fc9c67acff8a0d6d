"""python -m jax_flash_metal.selfcheck on the emulator, with a tiny grid: every step passes and
the JSON report has its documented keys. The correctness step compares with the xla
implementation, which the rest of the suite checks against the float64 oracle."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal import selfcheck  # noqa: E402


def test_selfcheck_passes_on_the_emulator_and_writes_its_report(tmp_path):
    path = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "jax_flash_metal.selfcheck", "--implementation",
                        "emulator", "--json", str(path), "--head-dims", "16", "--features",
                        "plain", "causal_lengths", "--seq-len", "64", "--repeats", "1"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all steps passed" in r.stdout
    report = json.loads(path.read_text())
    assert set(report) == {"implementation", "device", "passed", "steps"}
    assert report["implementation"] == "emulator" and report["passed"] is True
    assert list(report["steps"]) == ["lane_layout", "compile", "correctness", "profile",
                                     "timings"]
    for name, step in report["steps"].items():
        assert {"passed", "seconds", "detail"} <= set(step), name
        assert step["passed"] in (True, None), (name, step["detail"])
        assert f"{name} (" in r.stdout
    cases = report["steps"]["correctness"]["cases"]
    assert [(c["head_dim"], c["feature"]) for c in cases] == [(16, "plain"),
                                                              (16, "causal_lengths")]
    assert all(set(c["max_abs_error"]) == {"o", "lse", "dq", "dk", "dv"} for c in cases)


def test_a_failing_step_fails_the_report(monkeypatch):
    """A step that raises is reported as failed with its error, and the report fails."""
    def broken(*args):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(selfcheck, "lane_layout", broken)
    monkeypatch.setattr(selfcheck, "correctness", lambda *a: (True, "skipped here", []))
    monkeypatch.setattr(selfcheck, "kernel_profile", lambda *a: (None, "skipped here"))
    monkeypatch.setattr(selfcheck, "timings", lambda *a: (True, "skipped here"))
    report = selfcheck.run("emulator", [16], ["plain"], 64, 1)
    assert report["passed"] is False
    assert report["steps"]["lane_layout"]["passed"] is False
    assert "RuntimeError: probe exploded" in report["steps"]["lane_layout"]["detail"]
    assert "FAIL lane_layout" in selfcheck.format_report(report)
