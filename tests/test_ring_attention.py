"""Context parallelism (ring_attention.py): flash_attention(..., sequence_axis_name=...) inside
shard_map on 8 host devices, in a subprocess (tests/ring_checks.py), against the float64 oracle:
forward and gradients, causal and not, windows, lengths, bottom-right alignment, segment ids,
sinks with a soft cap, grouped-query and multi-query attention. Here: the block schedule (hidden
pairs are skipped) and the argument's errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from host_devices import run_script
from jax_flash_metal import flash_attention
from jax_flash_metal.ring_attention import (FULL, HIDDEN, PARTIAL, block_schedule, stripe,
                                            unstripe)

CASES = ("full", "causal", "window", "causal_window", "lengths", "bottom_right", "segments",
         "sinks_cap", "mqa", "striped_causal", "striped_full", "striped_window_segments")


def test_ring_matches_oracle(implementation):
    out = run_script("ring_checks.py", implementation, *CASES, timeout=900)
    assert out.count(" ok") == len(CASES), out


def test_causal_schedule_skips_the_hidden_half():
    causal = block_schedule(8, 16384, is_causal=True)
    full = block_schedule(8, 16384)
    # Device i's queries see key slices j < i whole, its own slice in part, none after it.
    i, j = np.indices((8, 8))
    np.testing.assert_array_equal(causal, np.select([j < i, j == i], [FULL, PARTIAL], HIDDEN))
    assert np.all(full == FULL)
    assert np.count_nonzero(causal) <= 0.6 * np.count_nonzero(full)


def test_striped_schedule_balances_causal_work():
    # Every pair of striped slices is half visible: no device idles, none does more.
    causal = block_schedule(8, 16384, is_causal=True, sequence_layout="striped")
    assert np.all(causal == PARTIAL)


def test_stripe_round_trip():
    x = jnp.arange(2 * 12 * 3).reshape(2, 12, 3)
    striped = stripe(x, 4)
    # Device 1 of 4 (positions 3..5 after the reorder) holds positions 1, 5, 9.
    np.testing.assert_array_equal(striped[:, 3:6], x[:, 1::4])
    np.testing.assert_array_equal(unstripe(striped, 4), x)


def test_window_schedule():
    # 8 slices of 8 positions, keys within 3 before and 0 after each query: slice i sees
    # part of slice i - 1 and its own diagonal.
    schedule = block_schedule(8, 64, local_window_size=(3, 0))
    i, j = np.indices((8, 8))
    np.testing.assert_array_equal(schedule, np.where((j == i) | (j == i - 1), PARTIAL, HIDDEN))


def test_errors():
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="sequence_axis_name='sp' is not a bound axis"):
        flash_attention(q, q, q, sequence_axis_name="sp")
    with pytest.raises(TypeError, match="sequence_axis_name must be one mesh axis name"):
        flash_attention(q, q, q, sequence_axis_name=["sp"])
    with pytest.raises(ValueError, match="sequence_layout='striped' needs sequence_axis_name"):
        flash_attention(q, q, q, sequence_layout="striped")
    with pytest.raises(ValueError, match="sequence_layout must be one of"):
        block_schedule(4, 16, sequence_layout="zigzag")
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
