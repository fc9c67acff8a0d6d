"""Specialised pipelines: the Metal function constants of shaders/function_constants.h.

The emulator binds a kernel's bool function constants per launch (emulator/README.md,
"Function constants"); the host picks one constant set per dispatch from the call's features,
masked by what the stage's kernels read (``_ext.stage_function_constants``). Checked here: the
translator's binding; every constant set the host can pick, generated from the host's own
masks, dispatched exactly for the call that needs it and matching the float64 oracle; and that a
pipeline whose feature constants are off has no feature code left to run (its counted work and
memory traffic do not depend on the feature flags of AttentionParams at all).
"""

import jax.numpy as jnp
import numpy as np
import pytest

import kernel_harness as kh
import oracle
import tolerance
from api_helpers import needs_emulator, normal
from constant_sets import BIT, D, DECODE, NAMES, PREFILL, label, run_constant_set
from jax_flash_metal import _ext

pytestmark = needs_emulator

FEATURE_BUFFERS = (kh.Q_LENGTHS, kh.KV_LENGTHS, kh.Q_SEGMENT_IDS, kh.KV_SEGMENT_IDS, kh.BIAS,
                   kh.MASK, kh.SINKS, kh.DROPOUT, kh.PAGE_TABLE, kh.ALIBI_SLOPES)


def test_the_translator_binds_function_constants_per_launch():
    out = np.zeros(8, np.uint32)
    for constants, want in ((0, 0), (1, 1), (1 << 5, 2), (0xFFFFFFFF, 3), (0b011110, 0)):
        kh.emulator.run("emu_function_constants", {0: out}, (2, 1, 1), (4, 1, 1),
                        function_constants=constants)
        assert (out == want).all(), constants


def test_the_host_lists_one_name_per_constant_and_masks_per_stage():
    assert NAMES == ["causal", "lengths", "score_features", "sinks", "dropout", "paged"]
    assert _ext.stage_function_constants("fwd") == (1 << len(NAMES)) - 1
    assert _ext.stage_function_constants("decode_combine") == BIT["sinks"]
    for stage in ("bwd_dq", "bwd_dkdv", "bwd_dk", "bwd_dv"):
        assert _ext.stage_function_constants(stage) & (BIT["paged"] | BIT["sinks"]) == 0
    assert _ext.stage_function_constants("nonsense") == 0


# ---- every constant set the host can pick (constant_sets.py), through the FFI handler ----

def dispatched(records):
    """{stage: set of function-constant sets} of the recorded dispatches."""
    out = {}
    for r in records:
        stage = r["kernel"][len("flash_attention_"):].rsplit("_", 2)[0]
        out.setdefault(stage, set()).add(r["function_constants"])
    return out


def check_dispatches(records, constants):
    stages = dispatched(records)
    assert stages, "no kernel ran"
    for stage, sets in stages.items():
        assert sets == {constants & _ext.stage_function_constants(stage)}, (stage, sets)
    return stages


def check_constant_set(constants, q_len):
    _ext.set_emulator_profiling(True)
    try:
        run_constant_set(constants, q_len)
    finally:
        records = _ext.take_emulator_profile()
        _ext.set_emulator_profiling(False)
    if constants & BIT["paged"]:  # a paged call has key lengths, so the lengths constant
        constants |= BIT["lengths"]
    return check_dispatches(records, constants)


# The plain call, each feature alone and all together run in CI's quick set; every other
# combination is in the slow set.
QUICK = {0, max(PREFILL)} | {1 << n for n in range(len(NAMES))}


def cases(sets, q_len):
    return [pytest.param(c, q_len, id=f"q{q_len}-{label(c)}",
                         marks=() if c in QUICK else pytest.mark.slow) for c in sets]


@kh.needs_counting
@pytest.mark.parametrize("constants,q_len", cases(PREFILL, 20) + cases(DECODE, 1))
def test_every_constant_set_the_host_picks(constants, q_len):
    """The call using exactly these features: each dispatch carries the set masked by its
    stage's list, and O, LSE (and without paging dQ, dK, dV, dbias, dsinks) match the oracle."""
    stages = check_constant_set(constants, q_len)
    if q_len == 1 and not constants & BIT["dropout"]:
        assert stages.keys() & {"decode_partial", "decode_vector"}, stages


# ---- a pipeline with its feature constants off has no feature code ----

def forward_profile(params, constants, q, k, v):
    """(o, counts) of the forward kernel with `params` bytes and feature buffers of garbage."""
    batch, q_len, heads, _ = q.shape
    shape = kh.tile_shape("fwd", "f32", D)
    o = np.full(q.shape, np.nan, np.float32)
    stats = [np.full((batch, heads, q_len), np.nan, np.float32) for _ in range(3)]
    garbage = np.full(64, -7, np.int32)
    buffers = {kh.Q: q, kh.K: k, kh.V: v, kh.O: o, kh.LSE: stats[0], kh.ROW_MAX: stats[1],
               kh.LOG_SUM: stats[2], kh.PARAMS: params}
    buffers.update({index: garbage for index in FEATURE_BUFFERS})
    counts = kh.emulator.run(kh.kernel_name("fwd", np.float32, D), buffers,
                             (-(-q_len // shape["rows"]), heads, batch), (shape["threads"], 1, 1),
                             profile=True, function_constants=constants)
    return o, counts


@kh.needs_counting
def test_a_plain_pipeline_has_no_feature_code():
    """With every feature constant off, AttentionParams claiming every feature (causal, lengths,
    bias, mask, segment ids, soft cap, ALiBi, sinks, dropout, paging; their buffers garbage)
    gives the plain result and exactly the plain call's counted instructions and traffic: no
    feature buffer byte is read, so no feature code is left in the pipeline."""
    q, k, v = (np.array(normal(np.random.default_rng(s), (1, 16, 2, D), jnp.float32))
               for s in range(3))
    plain = kh.pack_params(q.shape, k.shape)
    p = np.frombuffer(plain.tobytes(), dtype=kh.PARAMS_DTYPE).copy()
    for name in ("causal", "has_q_lengths", "has_kv_lengths", "has_segment_ids", "has_mask",
                 "has_sinks", "has_alibi"):
        p[name] = 1
    p["has_bias"], p["soft_cap"], p["page_size"], p["num_pages"] = 2, 1.5, 16, 4
    p["dropout_threshold"], p["dropout_scale"] = 1 << 31, 2.0
    p["bias_strides"], p["mask_strides"] = [1, 1, 1, 1], [1, 1, 1, 1]
    claimed = np.frombuffer(p.tobytes(), np.uint8).copy()
    o_plain, counts_plain = forward_profile(plain, 0, q, k, v)
    o_claimed, counts_claimed = forward_profile(claimed, 0, q, k, v)
    assert counts_claimed == counts_plain
    for index in FEATURE_BUFFERS:
        assert counts_claimed["buffers"][index]["read"] == 0, index
    np.testing.assert_array_equal(o_claimed, o_plain)
    want_o, _ = oracle.attention(q, k, v)
    tolerance.assert_matches_oracle("o", o_plain, want_o)
