"""Context parallelism (ring_attention.py): flash_attention(..., sequence_axis_name=...) inside
shard_map (with its default checks of varying manual axes; also manual over the sequence axis
only, the batch axis Explicit under jax.set_mesh) on 8 host devices, in a subprocess
(tests/api/ring_checks.py), against the float64 oracle: forward and gradients, both strategies
(all_gather, ring) and the three layouts (contiguous, striped, zigzag), causal and not,
windows, lengths, bottom-right alignment, segment ids, sinks with a soft cap, ALiBi, dropout
(the whole call's keep mask, read back bit for bit), grouped-query and multi-query attention,
a value head dim other than the key's, and slices cut into several pieces. Here: the block schedule (hidden pairs are skipped), the causal balance of
the layouts, the backward's structure (no forward recomputed), the per-device memory at the
issue's shape (benchmarks/ring_memory.py) and the arguments' errors."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from host_devices import environment, run_script
from jax_flash_metal import flash_attention
from jax_flash_metal.ring_attention import (FULL, HIDDEN, PARTIAL, block_schedule,
                                            causal_balance, causal_work, piece_length, shard_map,
                                            stripe, unstripe, unzigzag, zigzag)

# CASE[/LAYOUT][@STRATEGY] (ring_checks.py): the default strategy (all_gather) and the ring,
# each of the three layouts, causal ("mqa", "alibi", "pieces_striped") and not ("full").
CASES = ("full", "window", "causal_window_sinks_cap", "lengths_segments", "bottom_right", "mqa",
         "value_dim", "striped_window_segments", "pieces_lengths_segments", "pieces_striped",
         "alibi", "full@ring", "mqa@ring", "lengths_segments@ring", "full/striped@ring",
         "full/zigzag", "full/zigzag@ring", "mqa/zigzag", "mqa/zigzag@ring",
         "pieces_striped@ring", "alibi/zigzag@ring", "alibi/striped",
         "explicit:causal_window_sinks_cap", "explicit:alibi@ring", "explicit:lengths_segments")
# The ring's logic is the same for every implementation: the emulator (slow) runs the cases
# that reach each kind of primitive call (masked, with residual features, in pieces, striped,
# the ALiBi bias) once per strategy.
EMULATOR_CASES = ("causal_window_sinks_cap@ring", "mqa/zigzag", "striped_window_segments@ring",
                  "pieces_lengths_segments", "alibi/zigzag@ring", "explicit:mqa")


def test_ring_matches_oracle(implementation):
    cases = CASES if implementation == "xla" else EMULATOR_CASES
    if not hasattr(jax, "set_mesh"):  # "explicit:" cases need Explicit mesh axes
        cases = tuple(c for c in cases if not c.startswith("explicit:"))
    out = run_script("api/ring_checks.py", implementation, *cases, timeout=900)
    assert out.count(" ok") == len(cases), out


# Dropout across the axis: every strategy, layout and causal or not (causal on the striped
# layout in pieces); each strategy and layout once in the quick set, the rest ``slow``. The
# emulator runs the kernels' strided and offset keys once per strategy.
DROPOUT_CASES = tuple(f"{case}/{layout}@{strategy}" for strategy in ("all_gather", "ring")
                      for layout in ("contiguous", "striped", "zigzag")
                      for case in ("dropout", ("pieces_" if layout == "striped" else "")
                                   + "dropout_causal"))
QUICK_DROPOUT_CASES = DROPOUT_CASES[1::4] + DROPOUT_CASES[2::4] + ("pieces2_dropout@ring",)
EMULATOR_DROPOUT_CASES = ("pieces_dropout_causal/striped@all_gather",
                          "dropout_causal/zigzag@ring")
if hasattr(jax, "set_mesh"):  # the batch Explicit over "data": its global indices
    QUICK_DROPOUT_CASES += ("explicit:dropout_causal@ring",)


def _check_dropout(cases, implementation):
    out = run_script("api/ring_checks.py", implementation, *cases, timeout=900)
    assert out.count(" ok") == len(cases), out


def test_ring_dropout_is_the_whole_calls(implementation):
    """A split call with dropout applies the unsplit call's keep mask: O and gradients against
    the oracle given that mask, and the mask read back bit for bit (ring_checks.py)."""
    _check_dropout(QUICK_DROPOUT_CASES if implementation == "xla" else EMULATOR_DROPOUT_CASES,
                   implementation)


@pytest.mark.slow
def test_ring_dropout_every_strategy_layout_and_causal():
    _check_dropout(tuple(c for c in DROPOUT_CASES if c not in QUICK_DROPOUT_CASES), "xla")


def test_causal_schedule_skips_the_hidden_half():
    # 8 slices of 2048 positions, each in 4 pieces of 512 (ring_attention.piece_length): query
    # piece a (over the whole sequence) sees key pieces b < a whole, its own in part, none after.
    causal = block_schedule(8, 16384, is_causal=True)
    full = block_schedule(8, 16384)
    a, b = np.indices((32, 32))
    np.testing.assert_array_equal(causal, np.select([b < a, b == a], [FULL, PARTIAL], HIDDEN))
    assert np.all(full == FULL)
    assert np.count_nonzero(causal) <= 0.6 * np.count_nonzero(full)


def test_striped_schedule_balances_causal_work():
    # Piece r of every striped query slice against piece p of every key slice: whole for
    # p < r, about half visible for p == r (whichever two devices), hidden for p > r: every
    # device does the same work, none idles.
    causal = block_schedule(8, 16384, is_causal=True, sequence_layout="striped")
    i, r, j, p = np.indices((8, 4, 8, 4))
    want = np.select([p < r, p == r], [FULL, PARTIAL], HIDDEN).reshape(32, 32)
    np.testing.assert_array_equal(causal, want)


def test_zigzag_schedule_is_balanced():
    # Slices of 2048 as two chunks of 1024, each in 2 pieces of 512: device i's query pieces
    # run the same number of block steps as every other device's.
    causal = block_schedule(8, 16384, is_causal=True, sequence_layout="zigzag")
    steps = np.count_nonzero(causal.reshape(8, 4, 32), axis=(1, 2))
    assert np.all(steps == steps[0]), steps
    assert steps.sum() <= 0.55 * causal.size


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_causal_balance(layout):
    """Visible (query, key) pairs per device under causal attention: even for the balanced
    layouts at n = 8 (max / min <= 1.1, each device about half its non-causal work), not for
    the contiguous one (device 7 sees 15 times device 0's pairs)."""
    assert causal_balance(8, 16384, layout) <= 1.1
    assert causal_work(8, 16384, layout).max() <= 0.55 * 16384 ** 2 / 8
    assert causal_balance(8, 16384, "contiguous") == pytest.approx(15, rel=0.01)
    # The definition, by brute force on a small sequence: device i's queries see p + 1 keys.
    rows = np.arange(32).reshape(4, 8)  # contiguous positions per device
    np.testing.assert_array_equal(causal_work(4, 32), (rows + 1).sum(axis=1))


def test_piece_length():
    assert [piece_length(n) for n in (16, 512, 2048, 3000, 1031)] == [16, 512, 512, 375, 1031]


def test_backward_runs_no_forward():
    """The ring's backward is one backward primitive call per visible pair with the whole
    call's residuals: the forward primitive appears only in the forward."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    q = jnp.zeros((1, 16, 2, 8))

    def attention(q, k, v):
        return flash_attention(q, k, v, is_causal=True, sequence_axis_name="sp",
                               implementation="xla")

    ring = shard_map(attention, mesh, (P(None, "sp"),) * 3, P(None, "sp"))

    def grads(q, k, v):
        out, vjp = jax.vjp(ring, q, k, v)
        return vjp(out)

    forward, both = (str(jax.make_jaxpr(f)(q, q, q)) for f in (ring, grads))
    assert forward.count("flash_attention_bwd") == 0 < both.count("flash_attention_bwd")
    assert both.count("flash_attention_fwd") == forward.count("flash_attention_fwd") > 0


@pytest.mark.slow
def test_ring_memory_is_a_sixth_of_one_device():
    """8 host devices, T = 16384, batch 1, 4 heads, head dim 64, xla: each device's compiled
    temporary memory for forward and backward with the ring strategy is at most 1/6 of the
    one-device call's, causal and not; the busiest device's causal work with a balanced layout
    is at most 0.55 of its non-causal work (compiles only: nothing runs)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks",
                          "ring_memory.py")
    proc = subprocess.run([sys.executable, script], env=environment(None), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    ring = [row for row in rows if row[:1] == ["ring"]]
    assert len(ring) == 2, proc.stdout
    for row in ring:  # strategy, causal, layout, temp, temp / 1 device, ...
        assert float(row[4]) <= 1 / 6, proc.stdout
    balanced = [row for row in rows if row[:1] in (["striped"], ["zigzag"])]
    assert len(balanced) == 2 and all(float(row[2]) <= 0.55 for row in balanced), proc.stdout


def test_stripe_round_trip():
    x = jnp.arange(2 * 12 * 3).reshape(2, 12, 3)
    striped = stripe(x, 4)
    # Device 1 of 4 (positions 3..5 after the reorder) holds positions 1, 5, 9.
    np.testing.assert_array_equal(striped[:, 3:6], x[:, 1::4])
    np.testing.assert_array_equal(unstripe(striped, 4), x)


def test_zigzag_round_trip():
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    zigzagged = zigzag(x, 4)
    # 8 chunks of 2; device 1 of 4 (positions 4..7 after the reorder) holds chunks 1 and 6.
    np.testing.assert_array_equal(zigzagged[:, 4:8], jnp.concatenate([x[:, 2:4], x[:, 12:14]],
                                                                      axis=1))
    np.testing.assert_array_equal(unzigzag(zigzagged, 4), x)
    np.testing.assert_array_equal(unzigzag(zigzag(x, 2, axis=1), 2, axis=1), x)


def test_window_schedule():
    # 8 slices of 8 positions, keys within 3 before and 0 after each query: slice i sees
    # part of slice i - 1 and its own diagonal.
    schedule = block_schedule(8, 64, local_window_size=(3, 0))
    i, j = np.indices((8, 8))
    np.testing.assert_array_equal(schedule, np.where((j == i) | (j == i - 1), PARTIAL, HIDDEN))


@pytest.mark.parametrize("lengths", [(1000, None), (1002, 1000)])
def test_schedule_of_uneven_slices_is_refused(lengths):
    with pytest.raises(ValueError, match="is not a multiple of 3 .num_devices=3"):
        block_schedule(3, *lengths, is_causal=True)


def test_errors():
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="sequence_axis_name='sp' is not a bound axis"):
        flash_attention(q, q, q, sequence_axis_name="sp")
    with pytest.raises(TypeError, match="sequence_axis_name must be one mesh axis name"):
        flash_attention(q, q, q, sequence_axis_name=["sp"])
    with pytest.raises(ValueError, match="sequence_layout='striped' needs sequence_axis_name"):
        flash_attention(q, q, q, sequence_layout="striped")
    with pytest.raises(ValueError, match="sequence_strategy='ring' needs sequence_axis_name"):
        flash_attention(q, q, q, sequence_strategy="ring")
    with pytest.raises(ValueError, match="sequence_strategy must be one of"):
        flash_attention(q, q, q, sequence_axis_name="sp", sequence_strategy="tree")
    with pytest.raises(ValueError, match="sequence_layout must be one of"):
        block_schedule(4, 16, sequence_layout="diagonal")
    with pytest.raises(ValueError, match="q_len=12 is not a multiple of 8"):
        block_schedule(4, 12, sequence_layout="zigzag")
    for name in ("bias", "mask"):
        x = jnp.zeros((8, 8), jnp.bool_ if name == "mask" else jnp.float32)
        with pytest.raises(ValueError, match=f"{name} is not supported with sequence_axis_name"):
            flash_attention(q, q, q, **{name: x}, sequence_axis_name="sp")


def test_segment_ids_of_two_dtypes_are_refused():
    """Ids the ring would have to rank per device (their slices travel apart) are refused."""
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(TypeError, match="segment ids with sequence_axis_name need one integer"):
        flash_attention(q, q, q, sequence_axis_name="sp",
                        query_segment_ids=jnp.zeros((1, 8), jnp.int32),
                        key_value_segment_ids=jnp.zeros((1, 8), jnp.uint32))
