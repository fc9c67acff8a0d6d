"""MSL forms the translator accepts (tests/emulator/shaders/syntax.metal): [[kernel]], decltype
instantiations, static threadgroup arrays, local includes, namespaces for helpers, program-scope
constant arrays, vector constructors, half literals, numeric_limits, simd_all/any, small integer
types, [[max_total_threads_per_threadgroup]]."""

import numpy as np
import pytest

from api_helpers import needs_test_kernels

emulator = pytest.importorskip("jax_flash_metal._ext").emulator
pytestmark = needs_test_kernels


def test_syntax_kernel():
    x = np.arange(64, dtype=np.float32)
    out = np.zeros((64, 8), np.float32)
    emulator.run("emu_syntax_f32", {0: x, 1: out}, (1, 1, 1), (64, 1, 1), schedule="reverse")
    tid = np.arange(64)
    table = np.array([1, 2, 4, 8], np.float32)[tid % 4]
    np.testing.assert_array_equal(out[:, 0], 2 * x + 1)
    np.testing.assert_array_equal(out[:, 1], 3 * table)
    np.testing.assert_array_equal(out[:, 2], 1.75)
    np.testing.assert_array_equal(out[:, 3], (tid + 250) % 256 - 3)
    any_big = np.repeat([x[:32].max() > 30, x[32:].max() > 30], 32)
    np.testing.assert_array_equal(out[:, 4], 1 + 2 * any_big)
    np.testing.assert_array_equal(out[:, 5], 1)
    np.testing.assert_array_equal(out[:, 6], tid % 32)
    np.testing.assert_array_equal(out[:, 7], 64)


def test_max_total_threads_per_threadgroup():
    out = np.zeros(128, np.float32)
    emulator.run("emu_max_threads", {0: out}, (2, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(out, 1)
    with pytest.raises(RuntimeError, match=r"max_total_threads_per_threadgroup\(64\)"):
        emulator.run("emu_max_threads", {0: out}, (1, 1, 1), (128, 1, 1))
    # The bound of a template kernel may depend on its template parameters.
    emulator.run("emu_max_threads_t2", {0: out}, (2, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(out, 2)
    with pytest.raises(RuntimeError, match=r"max_total_threads_per_threadgroup\(64\)"):
        emulator.run("emu_max_threads_t2", {0: out}, (1, 1, 1), (96, 1, 1))


def test_swizzles():
    v = np.random.default_rng(13).integers(-8, 8, (32, 4)).astype(np.float32)
    out = np.zeros((32, 8), np.float32)
    emulator.run("emu_swizzle", {0: v, 1: out}, (1, 1, 1), (32, 1, 1))
    x, y, z, w = v.T
    nv = np.stack([w, z, z + 10, w + 20], axis=1)  # v.xy = v.wz; v.zw += (10, 20)
    c = np.stack([y, x, z, y], axis=1)  # float4(a.yx, b.xy) with a = (x, y), b = (z, y, x)
    np.testing.assert_array_equal(out[:, 0], nv[:, 0] + nv[:, 1] * 100)
    np.testing.assert_array_equal(out[:, 1], nv[:, 2] + nv[:, 3] * 100)
    np.testing.assert_array_equal(out[:, 2], c[:, 0] * c[:, 2] + c[:, 1] * c[:, 3])
    np.testing.assert_array_equal(out[:, 3], nv[:, 0].sum())
    np.testing.assert_array_equal(out[:, 4], 0)
    np.testing.assert_array_equal(out[:, 5], np.maximum(y, y))
    np.testing.assert_array_equal(out[:, 6], 2 * nv[:, 1] - 2 * nv[:, 0])
    np.testing.assert_array_equal(out[:, 7], nv[:, 3].astype(np.float16))
