"""The MSL-on-CPU emulator: launches, ids, barriers, threadgroup memory, schedules, errors.

Kernels are in tests/emulator/shaders/basic.metal (compiled into the extension by the build).
"""

import numpy as np
import pytest

from api_helpers import needs_test_kernels

emulator = pytest.importorskip("jax_flash_metal._ext").emulator
pytestmark = needs_test_kernels

SCHEDULES = ["forward", "reverse", "random"]


def run(kernel, buffers, groups, group_size, **kw):
    emulator.run(kernel, buffers, groups, group_size, **kw)


def test_kernel_names_sorted_and_include_tests():
    names = emulator.kernel_names()
    assert names == sorted(names)
    for n in ["emu_axpy", "emu_reduce", "emu_gemm8_f32", "emu_simd_ops"]:
        assert n in names


@pytest.mark.parametrize("workers", [1, 2])
def test_axpy(workers):
    a = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    out = np.zeros_like(a)
    run("emu_axpy", {0: a, 1: out, 2: np.array([2.5], np.float32)}, (10, 1, 1), (100, 1, 1),
        num_workers=workers)
    np.testing.assert_array_equal(out, a * np.float32(2.5) + np.arange(1000, dtype=np.float32))


def test_builtin_ids():
    groups, size = (3, 2, 2), (8, 4, 2)
    grid = tuple(g * s for g, s in zip(groups, size))
    n = grid[0] * grid[1] * grid[2]
    out = np.zeros((n, 16), np.uint32)
    run("emu_ids", {0: out}, groups, size, schedule="random", seed=3)
    got = {}
    for row in out:
        got[(row[0], row[1], row[2])] = row
    assert len(got) == n
    for (x, y, z), row in got.items():
        lx, ly, lz = x % size[0], y % size[1], z % size[2]
        tiitg = (lz * size[1] + ly) * size[0] + lx
        expected = [x, y, z, lx, ly, x // size[0], y // size[1], z // size[2], 64, 6,
                    tiitg, tiitg % 32, tiitg // 32, 32, grid[0], 7]
        assert list(row) == expected


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_barrier_reduction(schedule):
    x = np.random.default_rng(1).standard_normal(256 * 5).astype(np.float32)
    out = np.zeros(5, np.float32)
    run("emu_reduce", {0: x, 1: out}, (5, 1, 1), (256, 1, 1), schedule=schedule, seed=7)
    np.testing.assert_allclose(out, x.reshape(5, 256).astype(np.float64).sum(1), rtol=1e-5,
                               atol=1e-5)


def test_racy_kernel_differs_between_schedules_and_fixed_one_does_not():
    results = {}
    for name in ["emu_racy", "emu_racy_fixed"]:
        for schedule in SCHEDULES:
            out = np.zeros(64, np.float32)
            run(name, {0: out}, (1, 1, 1), (64, 1, 1), schedule=schedule, seed=1)
            results[name, schedule] = out
    expected = ((np.arange(64) + 1) % 64).astype(np.float32)
    for schedule in SCHEDULES:
        np.testing.assert_array_equal(results["emu_racy_fixed", schedule], expected)
    # Forward: each thread reads its successor's slot before the successor wrote it (NaN fill);
    # reverse: successors ran first.
    assert np.isnan(results["emu_racy", "forward"][:63]).all()
    np.testing.assert_array_equal(results["emu_racy", "reverse"][:63], expected[:63])
    assert not np.array_equal(results["emu_racy", "forward"], results["emu_racy", "reverse"],
                              equal_nan=True)


def test_divergent_barrier_reported_with_kernel_and_threads():
    out = np.zeros(64, np.float32)
    with pytest.raises(RuntimeError) as e:
        run("emu_divergent_barrier", {0: out}, (2, 1, 1), (64, 1, 1))
    msg = str(e.value)
    assert "emu_divergent_barrier" in msg
    assert "barrier divergence" in msg
    assert "threads 0-31" in msg and "threads 32-63" in msg
    assert "basic.metal:74" in msg and "basic.metal:77" in msg
    # The process survives and the emulator keeps working.
    test_axpy(1)


def test_thread_returning_while_others_wait():
    out = np.zeros(64, np.float32)
    with pytest.raises(RuntimeError) as e:
        run("emu_early_exit", {0: out}, (1, 1, 1), (64, 1, 1))
    msg = str(e.value)
    assert "emu_early_exit" in msg and "threads 0-7" in msg and "returned while" in msg
    assert "threads 8-63" in msg and "threadgroup_barrier" in msg


def test_uninitialized_threadgroup_memory_reads_nan():
    out = np.zeros(32, np.float32)
    run("emu_uninitialized", {0: out}, (1, 1, 1), (32, 1, 1))
    assert np.isnan(out).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_threadgroup_arrays_shared_per_group(schedule):
    out = np.zeros(3, np.float32)
    run("emu_threadgroup_2d", {0: out}, (3, 1, 1), (8, 4, 1), schedule=schedule, seed=11)
    base = np.arange(32, dtype=np.float64).sum()
    np.testing.assert_array_equal(out, [base + 100 * 32 * g for g in range(3)])


def test_device_atomics():
    n = 4096
    x = np.full(n, 0.5, np.float32)
    counts = np.zeros(4, np.int32)
    fsum = np.zeros(1, np.float32)
    maxv = np.zeros(1, np.uint32)
    run("emu_atomics", {0: x, 1: counts, 2: fsum, 3: maxv}, (n // 64, 1, 1), (64, 1, 1),
        num_workers=2)
    np.testing.assert_array_equal(counts, [n // 4] * 4)
    assert fsum[0] == n * 0.5  # exact: every partial sum is a multiple of 0.5 below 2^24
    assert maxv[0] == (n - 1) * 3


def test_threadgroup_memory_limit():
    with pytest.raises(RuntimeError, match=r"threadgroup memory exceeds 32768 bytes with 'big' "
                                           r"\(36000 bytes, .*basic.metal:134\)"):
        run("emu_too_much_threadgroup", {0: np.zeros(32, np.float32)}, (1, 1, 1), (32, 1, 1))


def test_unknown_kernel():
    with pytest.raises(RuntimeError, match="unknown kernel 'no_such_kernel'"):
        run("no_such_kernel", {}, (1, 1, 1), (1, 1, 1))


@pytest.mark.parametrize("size,match", [((0, 1, 1), "zero dimension"),
                                        ((1025, 1, 1), "exceeds the limit of 1024"),
                                        ((32, 32, 2), "exceeds the limit of 1024")])
def test_bad_threadgroup_size(size, match):
    out = np.zeros(4096, np.float32)
    with pytest.raises(RuntimeError, match=match):
        run("emu_axpy", {0: out, 1: out, 2: np.ones(1, np.float32)}, (1, 1, 1), size)


def test_missing_and_short_buffers():
    a = np.zeros(8, np.float32)
    with pytest.raises(RuntimeError, match=r"\[\[buffer\(2\)\]\] \(scale\) is not bound"):
        run("emu_axpy", {0: a, 1: a}, (1, 1, 1), (8, 1, 1))
    with pytest.raises(RuntimeError, match=r"\(scale\) has 2 bytes, needs 4"):
        run("emu_axpy", {0: a, 1: a, 2: np.zeros(1, np.float16)}, (1, 1, 1), (8, 1, 1))


def test_bad_arrays_and_schedule():
    a = np.zeros(16, np.float32)
    s = np.ones(1, np.float32)
    with pytest.raises(ValueError, match="not C-contiguous"):
        run("emu_axpy", {0: a[::2], 1: a, 2: s}, (1, 1, 1), (8, 1, 1))
    ro = a.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="not writeable"):
        run("emu_axpy", {0: a, 1: ro, 2: s}, (1, 1, 1), (8, 1, 1))
    with pytest.raises(ValueError, match="schedule"):
        run("emu_axpy", {0: a, 1: a, 2: s}, (1, 1, 1), (8, 1, 1), schedule="sideways")


def test_zero_groups_is_a_no_op():
    a = np.ones(8, np.float32)
    out = np.full(8, 3.0, np.float32)
    run("emu_axpy", {0: a, 1: out, 2: np.ones(1, np.float32)}, (0, 1, 1), (8, 1, 1))
    np.testing.assert_array_equal(out, 3.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_barrier_heavy(schedule):
    """The benchmark's barrier kernel (tests/emulator/shaders/bench.metal): after r rounds thread t
    holds ((t + r) mod n) + r."""
    n, rounds = 96, 10
    out = np.zeros(2 * n, np.float32)
    run("emu_barrier_heavy", {0: out, 1: np.array([rounds], np.uint32)}, (2, 1, 1), (n, 1, 1),
        schedule=schedule, seed=4)
    t = np.arange(n)
    np.testing.assert_array_equal(out, np.tile((t + rounds) % n + rounds, 2))
