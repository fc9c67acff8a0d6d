"""Helpers for the API tests: inputs, running flash_attention forward + VJP, oracle comparison."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tolerance
from jax_flash_metal import flash_attention, implementations
from jax_flash_metal.xla import schedule as xla_schedule

DTYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}

# For tests that name the emulator: skipped without the compiled extension (a source checkout
# run with PYTHONPATH), run with the host's CPU device as the default device (conftest.py).
needs_emulator = pytest.mark.emulator


def _test_kernels_built():
    try:
        from jax_flash_metal import _build_info
    except ImportError:  # a source checkout without a build
        return False
    return _build_info.TEST_KERNELS


# For tests that run the emulator's own test kernels (tests/emulator/shaders): a source install
# builds them, a wheel does not (emulator/CMakeLists.txt, JFM_TEST_KERNELS).
needs_test_kernels = pytest.mark.skipif(
    not _test_kernels_built(), reason="this build has no test kernels (tests/emulator/shaders "
    "are built for source installs only: JFM_TEST_KERNELS=ON)")


def _kernel_families():
    """The (key head dim, value head dim) of the kernel families, in order, as
    shaders/kernel_families.h lists them (its two backward lists; JFM_SAME_DIMS(..., D) is
    (D, D)), read from the header itself: the tests that run without the extension need them
    too."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "shaders", "kernel_families.h"), encoding="utf-8") as f:
        text = f.read()
    families = []
    for macro in ("JFM_JOINT_BWD_HEAD_DIMS", "JFM_SPLIT_BWD_HEAD_DIMS"):
        body = re.search(r"#define " + macro + r"\(T, SUFFIX, X\)((?:.*\\\n)*.*)", text)[1]
        for same, dk, dv in re.findall(
                r"JFM_SAME_DIMS\(T, SUFFIX, X, (\d+)\)|X\(T, SUFFIX, (\d+), (\d+), \w+\)", body):
            families.append((int(same), int(same)) if same else (int(dk), int(dv)))
    return tuple(families)


FAMILIES = _kernel_families()
HEAD_DIMS = tuple(dk for dk, dv in FAMILIES if dk == dv)  # the families with Dv = Dk
VALUE_HEAD_DIM_PAIRS = tuple(f for f in FAMILIES if f[0] != f[1])  # (Dk, Dv), Dv != Dk
MASK_KEYS = ("scale", "is_causal", "local_window_size", "query_seq_lengths",
             "key_value_seq_lengths", "causal_alignment")


def use_xla_schedule(monkeypatch, schedule):
    """Lower the xla implementation with ``schedule`` (an ``xla_schedule.Schedule``) on every
    platform until ``monkeypatch`` is undone. Compiled functions keep the schedule they were
    lowered with, so the compile caches are cleared (the caller clears them again after)."""
    jax.clear_caches()
    for platform in xla_schedule.SCHEDULES:
        monkeypatch.setitem(xla_schedule.SCHEDULES, platform, schedule)


def normal(rng, shape, dtype, scale=1.0):
    """float32 N(0,1) draws (times scale) cast to dtype."""
    return jnp.asarray(scale * rng.standard_normal(shape).astype(np.float32), dtype)


def make_inputs(seed, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, with_g_lse=True):
    """(q, k, v, do, g_lse) with q/k/v/do in dtype and g_lse float32 (or None)."""
    rng = np.random.default_rng(seed)
    q = normal(rng, (batch, q_len, heads, head_dim), dtype)
    k = normal(rng, (batch, kv_len, kv_heads, head_dim), dtype)
    v = normal(rng, (batch, kv_len, kv_heads, head_dim), dtype)
    do = normal(rng, (batch, q_len, heads, head_dim), dtype)
    g_lse = normal(rng, (batch, heads, q_len), jnp.float32) if with_g_lse else None
    return q, k, v, do, g_lse


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _forward_and_vjp(q, k, v, do, g, q_lengths, kv_lengths, static):
    def f(q, k, v):
        return flash_attention(q, k, v, return_lse=True, query_seq_lengths=q_lengths,
                               key_value_seq_lengths=kv_lengths, **dict(static))

    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse) + vjp((do, g))


# One compilation per (shapes, static arguments), shared by every test that repeats them.
_forward_and_vjp_jit = jax.jit(_forward_and_vjp, static_argnames="static")


def run_flash(q, k, v, do, g_lse=None, *, jit=True, implementation=None, **kwargs):
    """o, lse and (dq, dk, dv) = VJP of (o, lse) at cotangents (do, g_lse or 0)."""
    q_lengths = kwargs.pop("query_seq_lengths", None)
    kv_lengths = kwargs.pop("key_value_seq_lengths", None)
    window = kwargs.get("local_window_size")
    if isinstance(window, list):
        kwargs["local_window_size"] = tuple(window)
    static = tuple(sorted(dict(kwargs, implementation=implementation).items()))
    g = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32) if g_lse is None else g_lse
    fn = _forward_and_vjp_jit if jit else _forward_and_vjp
    out = fn(q, k, v, do, g, q_lengths, kv_lengths, static=static)
    return dict(zip(("o", "lse", "dq", "dk", "dv"), out))


def oracle_all(q, k, v, do, g_lse=None, **kwargs):
    """The oracle's outputs for flash_attention keyword arguments (non-mask ones ignored)."""
    return tolerance.oracle_outputs(q, k, v, do, g_lse,
                                    **{k_: kwargs[k_] for k_ in MASK_KEYS if k_ in kwargs})


def check_against_oracle(q, k, v, do, g_lse=None, *, implementation=None, jit=True,
                         names=tolerance.OUTPUTS, **kwargs):
    """Run flash_attention (forward + VJP) and assert every output is within the tolerances
    of the float64 oracle. Returns (actual, expected) dicts."""
    actual = run_flash(q, k, v, do, g_lse, jit=jit, implementation=implementation, **kwargs)
    for name in names:
        assert actual[name].dtype == (jnp.float32 if name == "lse" else q.dtype), name
    kw = {k_: kwargs[k_] for k_ in MASK_KEYS if k_ in kwargs}
    expected = tolerance.assert_all_match_oracle(actual, q, k, v, do, g_lse, names=names, **kw)
    return actual, expected


def run(q, k, v, do, g, *, implementation="xla", **kw):
    """o, lse, dq, dk, dv and, when given, dbias / dsinks / dalibi_slopes (VJP at cotangents
    do, g)."""
    diff = {n: kw.pop(n) for n in ("bias", "sinks", "alibi_slopes") if kw.get(n) is not None}

    def f(q, k, v, diff):
        return flash_attention(q, k, v, diff.get("bias"), sinks=diff.get("sinks"),
                               alibi_slopes=diff.get("alibi_slopes"),
                               implementation=implementation, return_lse=True, **kw)

    (o, lse), vjp = jax.vjp(jax.jit(f), q, k, v, diff)
    dq, dk, dv, ddiff = vjp((do, g))
    out = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
    out.update({"d" + n: x for n, x in ddiff.items()})
    return out


def alibi_bias(slopes, batch, q_len, kv_len, *, query_seq_lengths=None,
               key_value_seq_lengths=None, causal_alignment="top_left", **unused):
    """The ALiBi term materialised from its definition (docs/design.md#alibi), float64:
    (-slope[b, n] * |i + off_b - j| [B, H, Tq, Tkv], -|i + off_b - j| [B, 1, Tq, Tkv]) with
    off_b = clamped kv_len_b - q_len_b for bottom-right alignment, else 0. ``slopes``: [H] or
    [B, H]."""
    del unused
    slopes = np.broadcast_to(np.asarray(slopes, np.float64), (batch, np.shape(slopes)[-1]))
    dist = np.zeros((batch, 1, q_len, kv_len))
    for b in range(batch):
        ql = q_len if query_seq_lengths is None else int(np.clip(query_seq_lengths[b], 0, q_len))
        kl = (kv_len if key_value_seq_lengths is None
              else int(np.clip(key_value_seq_lengths[b], 0, kv_len)))
        off = kl - ql if causal_alignment == "bottom_right" else 0
        dist[b, 0] = -np.abs(np.arange(q_len)[:, None] + off - np.arange(kv_len)[None, :])
    return slopes[:, :, None, None] * dist, dist
