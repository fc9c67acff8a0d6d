"""The emulator's sanitizer on its fixtures (tests/emulator/shaders/sanitizer.metal): each fault
class is reported with the kernel, both threads, the memory location and the source lines; the
legal kernels run clean. docs/testing.md describes the checks.
"""

import pathlib
import re

import numpy as np
import pytest

from api_helpers import needs_test_kernels

emulator = pytest.importorskip("jax_flash_metal._ext").emulator
import kernel_harness as kh  # noqa: E402
pytestmark = [
    needs_test_kernels,
    pytest.mark.skipif(
        not emulator.has_counting_variant(),
        reason="the sanitizer runs the counting variant: build with JFM_EMULATOR_COUNTING=ON"),
]

FIXTURES = pathlib.Path(__file__).parent / "shaders" / "sanitizer.metal"
THREADS = (64, 1, 1)
LINES = kh.SANITIZER_LINES


def line_of(text):
    """'tests/emulator/shaders/sanitizer.metal:N' of the first line containing `text`, or '' (found in
    every report) where reports carry no shader lines."""
    lines = FIXTURES.read_text().splitlines()
    n = next(i for i, l in enumerate(lines) if text in l) + 1
    return f"tests/emulator/shaders/sanitizer.metal:{n}" if LINES else ""


def buffers(groups=1):
    rng = np.random.default_rng(0)
    return {0: rng.standard_normal(64 * groups).astype(np.float32),
            1: np.zeros(64 * groups, np.float32)}


def findings(kernel, groups=1, outputs=(1,), sanitize="first", schedule="forward", bufs=None):
    """The sanitizer's report of one launch ('' when clean)."""
    try:
        emulator.run(kernel, bufs or buffers(groups), (groups, 1, 1), THREADS,
                     schedule=schedule, sanitize=sanitize, outputs=list(outputs))
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_racecheck_missing_barrier(schedule):
    report = findings("racecheck_missing_barrier", schedule=schedule)
    assert "racecheck (threadgroup memory) in kernel racecheck_missing_barrier" in report
    assert "threadgroup array 'tile' element" in report
    # Both accesses, each with its thread and source line.
    assert line_of("tile[tid] = tile[tid] + 1.0f;") in report
    assert line_of("out[tid] = tile[(tid + 1) % 64];") in report
    assert len(re.findall(r"thread \d+ \(simdgroup \d, lane \d+\)", report)) == 2, report
    assert "no threadgroup_barrier(mem_flags::mem_threadgroup) between them" in report


def test_racecheck_write_write():
    report = findings("racecheck_write_write")
    assert "racecheck (threadgroup memory)" in report
    assert report.count("write by thread") == 2 and ", then write by thread" in report, report
    assert "'shared_value' element 0" in report
    if LINES:
        assert report.count(line_of("shared_value[0] = float(tid);")) == 2, report


def test_racecheck_simdgroup_barrier_orders_lanes():
    bufs = buffers()
    assert findings("racecheck_simdgroup_ordered", bufs=bufs) == ""
    x = buffers()[0]
    np.testing.assert_array_equal(bufs[1], x[np.arange(64) ^ 1] + x[63 - np.arange(64)])


def test_racecheck_simd_shuffle_orders_no_memory():
    report = findings("racecheck_shuffle_unordered")
    assert "racecheck (threadgroup memory)" in report
    assert "nor a simdgroup_barrier of their simdgroup" in report
    assert line_of("out[tid] = x + tile[tid ^ 1];") in report


def test_initcheck_threadgroup_memory():
    report = findings("initcheck_threadgroup")
    assert "initcheck in kernel initcheck_threadgroup" in report
    assert "no thread of the threadgroup has written" in report
    assert "'tile' element 63" in report  # thread 0 reads the mirrored, unwritten element
    assert line_of("out[tid] = tile[63 - tid];") in report


def test_initcheck_unwritten_output_element():
    bufs = buffers()
    report = findings("initcheck_unwritten_output", bufs=bufs)
    assert "initcheck: 4 of the 256 bytes of output [[buffer(1)]] 'out'" in report, report
    assert "(first: byte 252)" in report
    # Outputs start poisoned, as Metal leaves new buffers undefined.
    assert np.isnan(bufs[1][63])


def test_initcheck_read_of_output_before_write():
    report = findings("initcheck_output_read")
    assert "initcheck in kernel initcheck_output_read" in report
    assert "no dispatch of this call has written" in report
    assert line_of("out[tid] += in[tid];") in report
    # An input (not declared an output) may be read: the same kernel is clean then.
    assert findings("initcheck_output_read", outputs=()) == ""


def test_racecheck_across_threadgroups():
    report = findings("racecheck_cross_threadgroup", groups=3, outputs=())
    assert "racecheck (device memory)" in report
    assert "threadgroup (0,0,0) thread 0" in report and "threadgroup (1,0,0) thread 0" in report
    assert "[[buffer(1)]] 'out' element 0" in report
    assert "threadgroups of one dispatch are unordered" in report


def test_memcheck_device_buffer_past_end():
    report = findings("memcheck_device_past_end")
    assert "memcheck in kernel memcheck_device_past_end" in report
    assert "read of 4 bytes by threadgroup (0,0,0) thread 63" in report
    assert "[[buffer(0)]] 'in' element 64 (4-byte access, 64 elements bound)" in report
    assert line_of("out[tid] = in[tid + 1];") in report


def test_memcheck_threadgroup_array_past_end():
    report = findings("memcheck_threadgroup_past_end")
    assert "memcheck in kernel memcheck_threadgroup_past_end" in report
    assert "write of 4 bytes by thread 63" in report
    assert "0 bytes past the end of 'tile'" in report
    assert line_of("tile[tid + 1] = in[tid];") in report


def plan_buffers():
    return {0: np.arange(64, dtype=np.float32), 1: np.zeros(64, np.float32),
            2: np.zeros(64, np.float32)}


def test_racecheck_dispatch_without_plan_barrier():
    steps = [("sanitizer_produce", (2, 1, 1), (32, 1, 1), False),
             ("sanitizer_consume", (2, 1, 1), (32, 1, 1), False)]
    with pytest.raises(RuntimeError) as e:
        emulator.run_plan(steps, plan_buffers(), outputs=[1, 2])
    report = str(e.value)
    assert "racecheck (device memory) in kernel sanitizer_consume" in report
    assert "dispatch 1 (kernel sanitizer_produce)" in report
    assert "no memory barrier of the plan between the two dispatches" in report
    assert line_of("mid[i] = in[i] * 2.0f;") in report
    assert line_of("out[i] = mid[i] + 1.0f;") in report
    # With the barrier the plan is legal, and computes what it should.
    bufs = plan_buffers()
    emulator.run_plan([steps[0], steps[1][:3] + (True,)], bufs, outputs=[1, 2])
    np.testing.assert_array_equal(bufs[2], np.arange(64, dtype=np.float32) * 2 + 1)


def test_sanitizer_legal_kernel_is_clean_and_correct():
    for schedule in ["forward", "reverse", "random"]:
        bufs = buffers(groups=2)
        bufs[2] = np.array([0.5], np.float32)
        assert findings("sanitizer_legal_reduce", groups=2, bufs=bufs, schedule=schedule) == ""
        want = np.repeat(buffers(groups=2)[0].reshape(2, 64).sum(1) * np.float32(0.5), 64)
        np.testing.assert_allclose(bufs[1], want, rtol=1e-5)


def test_sanitizer_collect_all_lists_every_finding():
    report = findings("racecheck_missing_barrier", sanitize="all")
    races = [l for l in report.splitlines() if l.startswith("sanitizer: racecheck")]
    assert len(races) >= 2, report  # one per pair of source lines, not only the first
    assert findings("racecheck_simdgroup_ordered", sanitize="all") == ""


def test_sanitizer_arguments():
    with pytest.raises(ValueError, match="sanitize must be"):
        findings("sanitizer_legal_reduce", sanitize="yes")
    with pytest.raises(ValueError, match="outputs needs sanitize"):
        emulator.run("sanitizer_legal_reduce", buffers(), (1, 1, 1), THREADS, outputs=[1])


def test_initcheck_output_written_twice_breaks_the_contract():
    report = findings("initcheck_output_written_twice")
    assert "initcheck (output contract) in kernel initcheck_output_written_twice" in report
    assert "[[buffer(1)]] 'out' element" in report and "writes it once" in report, report
    assert line_of("out[tid] = 0.0f;") in report and line_of("out[63 - tid] = in[tid];") in report
    assert len(re.findall(r"thread \d+ \(simdgroup \d, lane \d+\)", report)) == 2, report


def test_initcheck_accumulated_output_one_store_per_dispatch():
    produce = ("sanitizer_produce", (2, 1, 1), (32, 1, 1), False)
    accumulate = ("sanitizer_accumulate", (2, 1, 1), (32, 1, 1), True)
    twice = ("initcheck_accumulate_twice", (2, 1, 1), (32, 1, 1), True)
    bufs = plan_buffers()
    emulator.run_plan([produce, accumulate, accumulate], bufs, outputs=[1], accumulated=[1])
    np.testing.assert_array_equal(bufs[1], np.arange(64, dtype=np.float32) * 2 + 2)
    # Written once by contract: the accumulating step is a second store.
    with pytest.raises(RuntimeError, match=r"already stored; the contract of output 'mid' "
                                           r"writes it once"):
        emulator.run_plan([produce, accumulate], plan_buffers(), outputs=[1])
    with pytest.raises(RuntimeError, match="one store per dispatch") as e:
        emulator.run_plan([produce, twice], plan_buffers(), outputs=[1], accumulated=[1])
    assert line_of("mid[i] *= 2.0f;") in str(e.value)
    with pytest.raises(ValueError, match="accumulated: buffer 2 is not in outputs"):
        emulator.run_plan([produce], plan_buffers(), outputs=[1], accumulated=[2])


def test_reports_name_the_function_constants():
    assert "kernel racecheck_write_write with function constants all true (unspecialised)" in \
        findings("racecheck_write_write")
    with pytest.raises(RuntimeError, match=r"kernel racecheck_write_write with function "
                                           r"constants causal\+sinks:"):
        emulator.run("racecheck_write_write", buffers(), (1, 1, 1), THREADS, sanitize="first",
                     function_constants=0b1001)
