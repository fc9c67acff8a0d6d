"""simdgroup_matrix on the emulator (tests/emulator/shaders/matrix.metal) against NumPy."""

import numpy as np
import pytest

from api_helpers import needs_test_kernels

emulator = pytest.importorskip("jax_flash_metal._ext").emulator
pytestmark = needs_test_kernels


def frag_coord(lane):
    """Apple's 8x8 simdgroup_matrix layout: lane -> (row, first of its two columns)."""
    q = lane // 4
    return (q & 4) + (lane // 2) % 4, (q & 2) * 2 + (lane % 2) * 2


def test_layout_covers_each_element_once():
    seen = set()
    for lane in range(32):
        r, c = frag_coord(lane)
        seen |= {(r, c), (r, c + 1)}
    assert seen == {(r, c) for r in range(8) for c in range(8)}


@pytest.mark.parametrize("dtype,name",
                         [(np.float32, "emu_gemm8_f32"), (np.float16, "emu_gemm8_f16")])
def test_gemm8(dtype, name):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((8, 8)).astype(dtype)
    b = rng.standard_normal((8, 8)).astype(dtype)
    c = np.zeros((8, 8), dtype)
    emulator.run(name, {0: a, 1: b, 2: c}, (1, 1, 1), (32, 1, 1))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(c.astype(np.float64), ref, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("dtype,name",
                         [(np.float32, "emu_gemm16_f32"), (np.float16, "emu_gemm16_f16")])
@pytest.mark.parametrize("schedule", ["forward", "random"])
def test_gemm16_tiled(dtype, name, schedule):
    rng = np.random.default_rng(5)
    k = 24
    a = rng.standard_normal((16, k)).astype(dtype)
    b = rng.standard_normal((k, 16)).astype(dtype)
    c0 = rng.standard_normal((16, 16)).astype(np.float32)
    c = c0.copy()
    emulator.run(name, {0: a, 1: b, 2: c, 3: np.array([k], np.uint32)}, (1, 1, 1), (128, 1, 1),
                 schedule=schedule, seed=9)
    ref = a.astype(np.float64) @ b.astype(np.float64) + c0
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-5)


def test_thread_elements_layout_transpose_filled_and_diagonal():
    m = np.arange(64, dtype=np.float32).reshape(8, 8)
    elems = np.zeros((32, 4), np.float32)
    filled = np.zeros(128, np.float32)
    emulator.run("emu_thread_elements", {0: m, 1: elems, 2: filled}, (1, 1, 1), (32, 1, 1))
    for lane in range(32):
        r, c = frag_coord(lane)
        assert list(elems[lane]) == [m[r, c], m[r, c + 1], m[c, r], m[c + 1, r]], lane
    f = filled[:64].reshape(8, 8)
    expected = np.full((8, 8), 2.5, np.float32)
    expected[:, 1::2] = 1.0  # each lane overwrote its second element (odd columns)
    np.testing.assert_array_equal(f, expected)
    np.testing.assert_array_equal(filled[64:].reshape(8, 8), 3.0 * np.eye(8, dtype=np.float32))


def test_matrix_ops_need_a_full_simdgroup():
    a = np.zeros(64, np.float32)
    with pytest.raises(RuntimeError, match="needs a full simdgroup"):
        emulator.run("emu_gemm8_f32", {0: a, 1: a, 2: a}, (1, 1, 1), (16, 1, 1))


@pytest.mark.parametrize("dtype,name", [(np.float32, "emu_gemm_tiled_f32"),
                                        (np.float16, "emu_gemm_tiled_f16")])
def test_gemm_tiled_from_device_memory(dtype, name):
    """The benchmark's GEMM (tests/emulator/shaders/bench.metal): 24x40 = (24x16) (16x40)."""
    m, n, k = 24, 40, 16
    rng = np.random.default_rng(12)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    c = np.full((m, n), np.nan, np.float32)
    tiles = (m // 8) * (n // 8)
    emulator.run(name, {0: a, 1: b, 2: c, 3: np.array([m, n, k], np.uint32)},
                 ((tiles + 3) // 4, 1, 1), (128, 1, 1), num_workers=2)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5,
                               atol=1e-5)


def test_non_uniform_simdgroup_load_reported():
    a = np.zeros(80, np.float32)
    with pytest.raises(RuntimeError) as e:
        emulator.run("emu_nonuniform_load", {0: a, 1: a}, (1, 1, 1), (32, 1, 1))
    msg = str(e.value)
    assert "emu_nonuniform_load" in msg
    assert "simdgroup_load arguments differ between lanes" in msg and "matrix.metal:73" in msg
