"""The FFI handlers are asynchronous: XLA:CPU runs independent work of the same program while an
attention call is in flight on the device.

The emulated device's test hold (``testing.set_emulator_hold``) keeps every emulated run waiting
on its worker thread; a host callback at the end of an independent computation of the same jitted
program records how many runs are held when it runs, then releases them. A handler that blocked
XLA until its kernels finished could never let that callback run first: the call would fail when
the hold times out instead. Ordering, not timing: the test asserts what the callback saw.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import tolerance

ext = pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal import flash_attention  # noqa: E402

WAIT_SECONDS = 20  # bounded waits: a regression fails, it does not hang


def _release_when_held(seen):
    """A pure_callback body: waits until an emulated run is held, records the count, releases."""

    def callback(x):
        deadline = time.monotonic() + WAIT_SECONDS
        while ext.testing.emulator_runs_held() == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append(ext.testing.emulator_runs_held())
        ext.testing.set_emulator_hold(False)
        return x

    return callback


def test_independent_work_completes_while_attention_is_in_flight():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 24, 2, 16)), jnp.float32) for _ in range(3))
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    seen = []

    @jax.jit
    def program(q, k, v, x):
        # Every result of the attention call is returned (O and, through the pullback, the
        # backward's residuals): XLA:CPU would otherwise reuse the memory of a dead result for
        # later work, which orders that work after the call.
        out, pullback = jax.vjp(
            lambda q, k, v: flash_attention(q, k, v, implementation="emulator"), q, k, v)
        # Independent of the attention: enough separate operations, on buffers above XLA:CPU's
        # small-buffer limit, that its executor runs the program as a graph, not in sequence.
        extras = [x[i:i + 16] @ x[:, i:i + 16] for i in range(10)]
        y = jax.pure_callback(_release_when_held(seen), jax.ShapeDtypeStruct(x.shape, x.dtype),
                              x)
        return out, jax.tree_util.tree_leaves(pullback), extras, y

    ext.testing.set_emulator_hold(True)
    try:
        out, *_ = jax.block_until_ready(program(q, k, v, x))
    finally:
        ext.testing.set_emulator_hold(False)
    assert seen == [1], f"runs held when the independent computation finished: {seen}"
    want, _ = oracle.attention(q, k, v)
    tolerance.assert_matches_oracle("o", out, want)
