"""simd_* collectives on the emulator (tests/emulator/shaders/simd.metal) against NumPy."""

import numpy as np
import pytest

from api_helpers import needs_test_kernels

emulator = pytest.importorskip("jax_flash_metal._ext").emulator
pytestmark = needs_test_kernels


def expected_simd_ops(x):
    """Metal semantics per 32-lane simdgroup (all lanes active)."""
    out = np.zeros((x.size, 12), np.float64)
    for s in range(0, x.size, 32):
        v = x[s:s + 32].astype(np.float64)
        lane = np.arange(32)
        o = out[s:s + 32]
        o[:, 0] = v.sum()
        o[:, 1] = v.max()
        o[:, 2] = v.min()
        o[:, 3] = v[5]
        o[:, 4] = v[lane ^ 3]
        o[:, 5] = np.where(lane >= 2, v[np.maximum(lane - 2, 0)], v)
        o[:, 6] = np.where(lane + 4 < 32, v[np.minimum(lane + 4, 31)], v)
        o[:, 7] = v[7]
        o[:, 8] = np.cumsum(v)
        o[:, 9] = np.cumsum(v) - v
        o[:, 10] = v[(lane + 1) % 32]
        o[:, 11] = v[0]
    return out


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_simd_ops(schedule):
    x = np.random.default_rng(2).integers(-50, 50, 128).astype(np.float32)  # exact sums
    out = np.zeros((128, 12), np.float32)
    emulator.run("emu_simd_ops", {0: x, 1: out}, (2, 1, 1), (64, 1, 1), schedule=schedule, seed=5)
    np.testing.assert_array_equal(out, expected_simd_ops(x))


def test_simd_int_and_half_butterfly():
    rng = np.random.default_rng(3)
    xi = rng.integers(-1000, 1000, 64).astype(np.int32)
    xh = rng.standard_normal(64).astype(np.float16)
    oi = np.zeros((64, 2), np.int32)
    oh = np.zeros(64, np.float16)
    emulator.run("emu_simd_types", {0: xi, 1: xh, 2: oi, 3: oh}, (1, 1, 1), (64, 1, 1))
    for s in (0, 32):
        np.testing.assert_array_equal(oi[s:s + 32, 0], xi[s:s + 32].sum())
        np.testing.assert_array_equal(oi[s:s + 32, 1], xi[s:s + 32].max())
        np.testing.assert_array_equal(oh[s:s + 32], xh[s:s + 32].max())


def test_partial_simdgroup_lanes_that_do_not_exist_are_inactive():
    # 40 threads: simdgroup 1 has 8 lanes; reductions cover those, shuffles from missing lanes
    # give an all-ones (NaN) value, shuffle_down keeps the lane's own value only past lane 31.
    x = np.arange(40, dtype=np.float32) + 1
    out = np.zeros((40, 12), np.float32)
    emulator.run("emu_simd_ops", {0: x, 1: out}, (1, 1, 1), (40, 1, 1))
    tail = x[32:].astype(np.float64)
    np.testing.assert_array_equal(out[32:, 0], tail.sum())
    np.testing.assert_array_equal(out[32:, 1], tail.max())
    np.testing.assert_array_equal(out[32:, 8], np.cumsum(tail))
    np.testing.assert_array_equal(out[32:, 3], tail[5])
    np.testing.assert_array_equal(out[32:, 7], tail[7])  # lane 7 is the last one that exists
    np.testing.assert_array_equal(out[32:36, 6], tail[4:8])
    assert np.isnan(out[36:40, 6]).all()  # shuffle_down(4) from lanes 8..11, which do not exist
    np.testing.assert_array_equal(out[32:39, 10], tail[1:8])
    assert np.isnan(out[39, 10])  # rotate_down(1) on lane 7 reads lane 8
    np.testing.assert_array_equal(out[:32], expected_simd_ops(x[:32]))


def test_simd_divergence_reported():
    out = np.zeros(32, np.float32)
    with pytest.raises(RuntimeError) as e:
        emulator.run("emu_simd_divergent", {0: out}, (1, 1, 1), (32, 1, 1))
    msg = str(e.value)
    assert "emu_simd_divergent" in msg and "simdgroup divergence" in msg
    assert "threads 0-15" in msg and "threads 16-31" in msg
    assert "simd_sum at" in msg and "simd_max at" in msg


def test_returned_lanes_are_inactive_in_simd_sum():
    out = np.full(64, -1.0, np.float32)
    emulator.run("emu_simd_after_return", {0: out}, (1, 1, 1), (64, 1, 1))
    active = np.arange(20).sum()
    for s in (0, 32):
        np.testing.assert_array_equal(out[s:s + 20], active)
        np.testing.assert_array_equal(out[s + 20:s + 32], -1.0)


def test_simd_operation_against_barrier_reported():
    out = np.zeros(32, np.float32)
    with pytest.raises(RuntimeError) as e:
        emulator.run("emu_simd_vs_barrier", {0: out}, (1, 1, 1), (32, 1, 1))
    msg = str(e.value)
    assert "emu_simd_vs_barrier" in msg and "barrier divergence in simdgroup 0" in msg
    assert "threads 0-7 wait at simd_sum" in msg
    assert "threads 8-31 wait at threadgroup_barrier" in msg
