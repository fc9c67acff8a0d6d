"""Scalar semantics of the emulator's Metal shim (tests/emulator/shaders/types.metal) vs NumPy."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from api_helpers import needs_test_kernels

emulator = pytest.importorskip("jax_flash_metal._ext").emulator
pytestmark = needs_test_kernels


def rounding_inputs():
    rng = np.random.default_rng(6)
    specials = np.array([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8,
                         2.9802322e-08, 5.9604645e-08, 1e-5, 6.1035156e-05, np.inf, -np.inf,
                         np.nan, 1.0009765625, 1.00048828125, 1.00146484375,
                         3.4e38, 1.1754944e-38, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -9],
                        np.float32)
    return np.concatenate([specials, rng.standard_normal(2000).astype(np.float32) * 100,
                           rng.standard_normal(1000).astype(np.float32) * 1e-5])


def test_half_and_bfloat_round_to_nearest_even():
    x = rounding_inputs()
    n = x.size
    hb = np.zeros(n, np.uint16)
    bb = np.zeros(n, np.uint16)
    back = np.zeros((n, 2), np.float32)
    emulator.run("emu_round", {0: x, 1: hb, 2: bb, 3: back}, (n, 1, 1), (1, 1, 1))
    with np.errstate(over="ignore"):
        want_h = x.astype(np.float16)
    want_b = x.astype(ml_dtypes.bfloat16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(hb[~nan], want_h[~nan].view(np.uint16))
    np.testing.assert_array_equal(bb[~nan], want_b[~nan].view(np.uint16))
    assert np.isnan(hb[nan].view(np.float16)).all()
    assert np.isnan(bb[nan].view(ml_dtypes.bfloat16)).all()
    np.testing.assert_array_equal(back[~nan, 0], want_h[~nan].astype(np.float32))
    np.testing.assert_array_equal(back[~nan, 1], want_b[~nan].astype(np.float32))


def test_half_arithmetic_rounds_each_operation():
    rng = np.random.default_rng(7)
    a = (rng.standard_normal(256) * 30).astype(np.float16)
    b = (rng.standard_normal(256) * 30).astype(np.float16)
    s = np.zeros(256, np.float16)
    p = np.zeros(256, np.float16)
    m = np.zeros(256, np.float32)
    emulator.run("emu_half_math", {0: a, 1: b, 2: s, 3: p, 4: m}, (4, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(s, (a.astype(np.float64) + b).astype(np.float16))
    np.testing.assert_array_equal(p, (a.astype(np.float64) * b).astype(np.float16))
    np.testing.assert_array_equal(m, a.astype(np.float32) * np.float32(3.0) + np.float32(0.1))


def test_nan_rules_and_math():
    a = np.array([np.nan, 1.0, np.nan, -3.0, 2.0, 0.5], np.float32)
    b = np.array([2.0, np.nan, np.nan, np.inf, -1.0, 0.25], np.float32)
    out = np.zeros((6, 10), np.float32)
    emulator.run("emu_nan_rules", {0: a, 1: b, 2: out}, (6, 1, 1), (1, 1, 1))
    np.testing.assert_array_equal(out[:, 0], np.fmax(a, b))
    np.testing.assert_array_equal(out[:, 1], np.fmin(a, b))
    np.testing.assert_array_equal(out[:, 2], np.fmax(a, b))
    np.testing.assert_array_equal(out[:, 3], np.fmin(a, b))
    np.testing.assert_array_equal(out[:, 4], np.fmax(a.astype(np.float16), b.astype(np.float16)))
    np.testing.assert_array_equal(out[:, 5], np.where(a < b, b, a))
    np.testing.assert_allclose(out[:, 6], a.astype(np.float64) * b + 1, rtol=1e-7)
    np.testing.assert_array_equal(out[:, 7], np.isnan(a) + 2.0 * np.isinf(b))
    finite = np.isfinite(b)
    np.testing.assert_allclose(out[finite, 8], np.exp2(b[finite].astype(np.float64)) + np.log(2.0),
                               rtol=1e-6)
    # Fast math promises nothing for Inf/NaN: the emulator's fast:: functions return garbage.
    np.testing.assert_array_equal(out[~finite, 8], np.float32(1e30) + np.float32(np.log(2.0)))
    # Metal defines clamp(x, lo, hi) as min(max(x, lo), hi), so NaN clamps to lo.
    np.testing.assert_array_equal(out[:, 9], np.fmin(np.fmax(a, -1), 1))


def test_bf16_bits_convention():
    x = np.random.default_rng(8).standard_normal(500).astype(ml_dtypes.bfloat16)
    out = np.zeros(500, np.uint16)
    emulator.run("emu_bf16_bits", {0: x.view(np.uint16), 1: out}, (500, 1, 1), (1, 1, 1))
    want = (x.astype(np.float32) * np.float32(3)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out, want.view(np.uint16))


def test_vectors_structs_and_long():
    v = np.arange(16, dtype=np.float32).reshape(4, 4)
    out = np.zeros((4, 4), np.float32)
    hout = np.zeros((4, 4), np.float16)
    lout = np.zeros(4, np.int64)
    pair = np.zeros(8, np.float32)  # struct Pair { float4 a; int2 b; } padded to 32 bytes
    pair[:4] = [10, 20, 30, 40]
    pair[4:6] = np.array([5, 6], np.int32).view(np.float32)
    emulator.run("emu_vectors", {0: v, 1: out, 2: hout, 3: lout, 4: pair}, (4, 1, 1), (1, 1, 1))
    want = v * 2 + np.array([1, 2, 3, 4]) + np.array([10, 20, 30, 40])
    want[:, 3] = want[:, 0] + 6
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(hout, want.astype(np.float16))
    np.testing.assert_array_equal(lout, np.arange(4) * 2 ** 32 + 16)  # sizeof(float3) == 16


def test_fast_math_precise_mode(tmp_path):
    """JFM_EMULATOR_FAST_MATH=precise (read once per process): fast:: functions are the precise
    ones for every argument, fast::exp2(-inf) = 0 and fast::exp2(NaN) = NaN."""
    code = ("import json, numpy as np; from jax_flash_metal._ext import emulator; "
            "b = np.array([-np.inf, np.inf, np.nan, 1.0], np.float32); out = np.zeros((4, 10), "
            "np.float32); emulator.run('emu_nan_rules', {0: np.zeros(4, np.float32), 1: b, 2: out},"
            " (4, 1, 1), (1, 1, 1)); print(json.dumps(out[:, 8].tolist()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=tmp_path,  # the installed package, not the source tree
                       env=dict(os.environ, JFM_EMULATOR_FAST_MATH="precise"))
    got = np.array(json.loads(r.stdout), np.float32)
    log2 = np.float32(np.log(2.0))
    np.testing.assert_array_equal(got, [log2, np.inf, np.nan, np.float32(2.0) + log2])
