"""The FFI handler's own working memory (ffi/working_memory.h): what a call allocates for the
kernels' arguments, outside XLA's memory analysis, measured by the handler
(``_ext.take_working_memory``) against the plan's formula (``_ext.working_memory``): one
parameter block per dispatch of the dispatch plan and the copied q/kv lengths. Structural, not
timed; also shows that the handler's plan cache follows a change of the submission budget.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ffi_targets import submission_budget

ext = pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal import flash_attention  # noqa: E402

B, T, H, HKV, D = 2, 32, 4, 2, 16


def _inputs(q_len):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, q_len, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, HKV, D)), jnp.float32) for _ in range(2))
    return q, k, v


def _dispatches(direction, q_len):
    return sum(len(s) for s in ext.dispatch_plan(direction, "f32", B, q_len, T, H, HKV, D))


def _formula(direction, q_len):
    return ext.working_memory(direction, "f32", B, q_len, T, H, HKV, D)


def _measured(f, *args):
    ext.take_working_memory()  # zero the figures
    jax.block_until_ready(f(*args))
    return ext.take_working_memory()


def test_formula_is_a_block_per_dispatch_and_the_lengths():
    """working_memory grows by one parameter block per dispatch: two plans of the same call
    under different budgets differ by a whole number of equal blocks."""
    one, split = _formula("fwd", 16), None
    with submission_budget(1e-9):  # every threadgroup its own dispatch
        split = _formula("fwd", 16)
        many = _dispatches("fwd", 16)
    few = _dispatches("fwd", 16)
    assert many > few >= 1
    block = (split - one) // (many - few)
    assert block > 0 and block % 4 == 0 and (split - one) == block * (many - few)
    assert one == few * block + 2 * 4 * B  # the q and kv lengths: int32 [batch] each


@pytest.mark.parametrize("q_len", [1, 16])  # the split-KV decode and the tiled forward
def test_forward_call_measures_the_formula(q_len):
    q, k, v = _inputs(q_len)
    f = jax.jit(lambda q, k, v: flash_attention(q, k, v, implementation="emulator"))
    got = _measured(f, q, k, v)
    assert got["calls"] == 1
    assert got["last_bytes"] == got["peak_bytes"] == _formula("fwd", q_len)
    assert got["staging_calls"] == 0  # the emulated device stages nothing


def test_forward_and_backward_under_a_tiny_budget():
    """Each call measures its own plan; the cached plan is re-cut when the budget changes."""
    q, k, v = _inputs(16)

    def loss(q, k, v):
        return flash_attention(q, k, v, implementation="emulator").sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    plain = _measured(grad, q, k, v)
    with submission_budget(1e-9):
        split = _measured(grad, q, k, v)
        want = max(_formula("fwd", 16), _formula("bwd", 16))
    assert plain["calls"] == split["calls"] == 2
    assert plain["peak_bytes"] == max(_formula("fwd", 16), _formula("bwd", 16))
    assert split["peak_bytes"] == want > plain["peak_bytes"]
