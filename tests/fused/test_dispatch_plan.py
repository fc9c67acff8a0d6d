"""The dispatch plan (ffi/dispatch_plan.h): submissions cut by batch, head and row block under a
time budget so no command buffer trips the GPU watchdog.

The plan is read through ``_ext.dispatch_plan``, which runs the handlers' own planning code; the
split runs compare the emulated device's results under a tiny budget bit for bit with the
unsplit run, and both with the float64 oracle.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from api_helpers import check_against_oracle, make_inputs, run_flash
from ffi_targets import submission_budget

ext = pytest.importorskip("jax_flash_metal._ext")



def _plan(direction, batch, q_len, kv_len, heads, kv_heads, head_dim=32, dtype="f32"):
    return ext.dispatch_plan(direction, dtype, batch, q_len, kv_len, heads, kv_heads, head_dim)


def _check_plan(direction, batch, q_len, kv_len, heads, kv_heads, head_dim, budget_seconds):
    """Every (row block, head, batch) threadgroup of every stage exactly once, stages in order,
    every submission within the budget unless it is one threadgroup."""
    with submission_budget(budget_seconds):
        plan = _plan(direction, batch, q_len, kv_len, heads, kv_heads, head_dim)
    budget = budget_seconds * ext.multiply_adds_per_second("emulator")
    dispatches = [d for submission in plan for d in submission]
    kernels = list(dict.fromkeys(d["kernel"] for d in dispatches))  # in order of appearance
    suffix = f"_f32_d{head_dim}"
    splits, _ = ext.decode_splits("f32", batch, q_len, kv_len, heads, kv_heads, head_dim)
    # (stage, rows, heads) of each kernel: fwd and bwd_dq own query rows, the dK/dV stages keys,
    # the decode's pass 1 key splits and pass 2 the query rows of one KV head.
    if direction == "bwd":
        stages = [(s, q_len, heads) if n == 0 else (s, kv_len, kv_heads)
                  for n, s in enumerate(ext.bwd_stages(head_dim))]
    elif splits:
        vector = heads // kv_heads * q_len <= ext.tile_shape("decode_vector", "f32",
                                                             head_dim)["rows"]
        stages = [("decode_vector" if vector else "decode_partial", splits, kv_heads),
                  ("decode_combine", heads // kv_heads * q_len, kv_heads)]
    else:
        stages = [("fwd", q_len, heads)]
    empty = batch == 0 or q_len == 0 or heads == 0
    if empty:
        assert plan == []
        return plan
    assert kernels == [f"flash_attention_{s}{suffix}" for s, _, _ in stages]
    # All dispatches of a stage come before any of the next one.
    stage_of = [kernels.index(d["kernel"]) for d in dispatches]
    assert stage_of == sorted(stage_of)
    for kernel, (_, rows, stage_heads) in zip(kernels, stages):
        mine = [d for d in dispatches if d["kernel"] == kernel]
        rows_per_group = mine[0]["rows_per_group"]
        blocks = math.ceil(rows / rows_per_group)
        count = np.zeros((blocks, stage_heads, batch), np.int64)
        for d in mine:
            gx, gy, gz = d["groups"]
            x0, y0, z0 = d["block_offset"], d["head_offset"], d["batch_offset"]
            assert x0 + gx <= blocks and y0 + gy <= stage_heads and z0 + gz <= batch, d
            count[x0:x0 + gx, y0:y0 + gy, z0:z0 + gz] += 1
        assert (count == 1).all(), (kernel, np.argwhere(count != 1)[:5])
    for submission in plan:
        work = sum(d["multiply_adds"] for d in submission)
        single = len(submission) == 1 and math.prod(submission[0]["groups"]) == 1
        assert work <= budget * (1 + 1e-9) or single, (work, budget)
    return plan


def test_plan_covers_every_threadgroup_once_for_shapes_and_budgets():
    """A seeded property test over shapes (odd lengths, GQA, zero sizes) and budgets from one
    threadgroup per submission to everything in one."""
    rng = np.random.default_rng(11)
    budgets = [1e-12, 1e-8, 3e-7, 1e-6, 1e-5, 0.1]
    for _ in range(60):
        kv_heads = int(rng.integers(1, 4))
        heads = kv_heads * int(rng.integers(1, 4))
        shape = (int(rng.integers(0, 4)), int(rng.integers(0, 70)), int(rng.integers(1, 70)),
                 heads, kv_heads, int(rng.choice([16, 64, 256])))
        for direction in ("fwd", "bwd"):
            _check_plan(direction, *shape, float(rng.choice(budgets)))


def test_default_budget_keeps_small_calls_whole_and_splits_long_ones():
    assert len(_plan("fwd", 4, 512, 512, 8, 8)) == 1
    assert len(_plan("bwd", 4, 512, 512, 8, 8)) == 1
    # One long sequence of one head: 2 * 65536^2 * 128 multiply-adds, far beyond 0.1 s at the
    # initial throughput figure, is cut into runs of row blocks.
    plan = _check_plan("fwd", 1, 65536, 65536, 1, 1, 128, ext.testing.set_submission_budget(0.1))
    seconds = 2 * 65536**2 * 128 / ext.multiply_adds_per_second("emulator")
    assert len(plan) >= math.floor(seconds / 0.1)
    assert {d["block_offset"] for s in plan for d in s} != {0}


def test_plan_binding_rejects_bad_names():
    with pytest.raises(ValueError, match="direction"):
        ext.dispatch_plan("sideways", "f32", 1, 1, 1, 1, 1, 16)
    with pytest.raises(ValueError, match="dtype"):
        ext.dispatch_plan("fwd", "f64", 1, 1, 1, 1, 1, 16)


@pytest.mark.parametrize("config", [dict(is_causal=True), dict(local_window_size=(9, 3))],
                         ids=["causal", "window"])
def test_split_run_is_bit_identical_for_one_long_sequence(config):
    """Batch 1, one head, a sequence long enough for many row blocks (5 forward blocks of 32):
    under a tiny budget every stage is split into row-block submissions (at least 4 each way),
    and nothing changes."""
    inputs = make_inputs(5, 1, 130, 130, 1, 1, 32, jnp.float32)
    tiny = 1e-12  # below one threadgroup: every threadgroup is its own submission
    with submission_budget(tiny):
        fwd_plan, bwd_plan = _plan("fwd", 1, 130, 130, 1, 1), _plan("bwd", 1, 130, 130, 1, 1)
        split = run_flash(*inputs, implementation="emulator", **config)
    assert len(fwd_plan) >= 4 and len(bwd_plan) >= 4 * len(ext.bwd_stages(32))
    assert len(_plan("fwd", 1, 130, 130, 1, 1)) == 1  # the default budget: one submission
    whole, _ = check_against_oracle(*inputs, implementation="emulator", **config)
    for name in whole:
        np.testing.assert_array_equal(np.asarray(split[name]), np.asarray(whole[name]),
                                      err_msg=name)


def test_split_by_heads_and_batch_is_bit_identical():
    """Budgets that cut between heads of one batch element and between batch elements (GQA,
    lengths, bottom-right causal)."""
    inputs = make_inputs(6, 3, 9, 13, 4, 2, 16, jnp.float32)
    config = dict(is_causal=True, causal_alignment="bottom_right",
                  query_seq_lengths=jnp.array([9, 4, 7], jnp.int32),
                  key_value_seq_lengths=jnp.array([13, 6, 2], jnp.int32))
    whole, _ = check_against_oracle(*inputs, implementation="emulator", **config)
    forward_group = 2 * 13 * 16 * 4  # multiply-adds of one forward threadgroup (4 query rows)
    rate = ext.multiply_adds_per_second("emulator")
    for groups in (3, 7):  # 3: runs of row blocks and heads; 7: whole heads
        with submission_budget(groups * forward_group / rate):
            assert len(_plan("fwd", 3, 9, 13, 4, 2, 16)) > 1
            split = run_flash(*inputs, implementation="emulator", **config)
        for name in whole:
            np.testing.assert_array_equal(np.asarray(split[name]), np.asarray(whole[name]),
                                          err_msg=f"{groups} groups: {name}")


def test_barriers_only_between_dependent_kernels():
    """mark_barriers: a barrier before a dispatch of another kernel that reads what an earlier
    dispatch since the last barrier wrote, writes what one read, or writes what one wrote; none
    between chunks of one kernel (disjoint parts of the same results) or between kernels that
    only share inputs. Addresses are plain numbers: nothing is dereferenced."""
    q, k, o, delta, dk, dv = (n * 1000 for n in range(1, 7))
    dq = [("dq", [(q, 100, False), (k, 100, False), (o, 100, False), (delta, 50, True)])] * 2
    dk_ = ("dk", [(q, 100, False), (delta, 50, False), (dk, 100, True)])
    dv_ = ("dv", [(q, 100, False), (delta, 50, False), (dv, 100, True)])
    assert ext.testing.mark_barriers([*dq, dk_, dk_, dv_]) == [False, False, True, False, False]
    # overlapping, not equal, ranges count; touching ones do not
    assert ext.testing.mark_barriers([("a", [(o, 100, True)]), ("b", [(o + 99, 1, False)])]) == [
        False, True]
    assert ext.testing.mark_barriers([("a", [(o, 100, True)]), ("b", [(o + 100, 8, False)])]) == [
        False, False]
    # write after read, and write after write, need one too; a barrier clears the history
    assert ext.testing.mark_barriers([("a", [(q, 8, False)]), ("b", [(q, 8, True)]),
                               ("c", [(q, 8, False)])]) == [False, True, True]
    marks = ext.testing.mark_barriers([("a", [(dv, 8, True)]), ("b", [(dv, 8, True)])])
    assert marks == [False, True]
