"""Kernel variants as data (docs/kernels.md#kernel-variants): the tile/register strategies of
shaders/tile_shapes.h, each instantiated under its own kernel names.

Every family lists its distinct variants with their shapes and register estimates; for head dims
up to 128 every kernel has a variant within the register budget; each variant of each kernel
matches the float64 oracle on the emulator under the forward, reverse and random schedules with
results bit-identical across them (deterministic), on one representative family per tile class
(not the whole matrix: variants multiply the kernel tests' time); the FFI takes the variant as
its ``kernel_variant`` attribute, forced by ``$JFM_KERNEL_VARIANT``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_harness as kh
import tolerance
from api_helpers import needs_emulator, normal, run
from jax_flash_metal import _ext, flash_attention
from jax_flash_metal.tools.roofline import REGISTER_BUDGET

pytestmark = needs_emulator

TILED = ("fwd", "decode_partial", "bwd_dq", "bwd_dkdv", "bwd_dk", "bwd_dv")
SCHEDULES = (("forward", 0), ("reverse", 0), ("random", 5))
# One family per tile class where variant 1 differs: Q resident vs reloaded at D 64 and 128
# (f32: the backward's halved simdgroups); f16/bf16 above 128: a halved key block and the split
# backward's halved simdgroups.
REPRESENTATIVE = [("f32", 64), ("f16", 128), ("bf16", 192)]


def test_every_family_lists_its_variants():
    names = set(_ext.kernel_names("emulator"))
    for suffix, dk, dv in _ext.kernel_families():
        d = _ext.tile_head_dim(dk, dv)
        for stage in kh.stages_of(d):
            variants = _ext.kernel_variants(stage, suffix, d)
            assert [v["variant"] for v in variants][:1] == [0]
            assert len(variants) <= _ext.tile_variants(stage) == 2
            for v in variants:
                assert _ext.kernel_name(v["stage"], suffix, dk, dv) in names
                shape = {k: x for k, x in v.items() if k not in ("variant", "stage")}
                assert shape == _ext.tile_shape(stage, suffix, d, v["variant"])
            if d <= 128:  # at least one variant within the register budget
                assert min(v["registers"] for v in variants) <= REGISTER_BUDGET, (stage, d)
        # Where the forward has a second strategy at D <= 128, it reloads Q (fewer registers).
        fwd = _ext.kernel_variants("fwd", suffix, d)
        if d <= 128:
            assert [v["q_in_registers"] for v in fwd] == [True, False]
            assert fwd[1]["registers"] <= fwd[0]["registers"]
    for stage in ("decode_vector", "decode_combine"):
        assert _ext.tile_variants(stage) == 1
    with pytest.raises(ValueError, match="variant 2"):
        _ext.tile_shape("fwd", "f16", 64, 2)


CASES = [(dtype, d, v) for dtype, d in REPRESENTATIVE for v in kh.variants_of(dtype, d)]


@pytest.mark.parametrize("dtype,head_dim,variant", CASES,
                         ids=[f"{t}-d{d}-var{v}" for t, d, v in CASES])
def test_each_variant_against_the_oracle_under_every_schedule(dtype, head_dim, variant):
    """Forward and backward kernels of the variant, grouped-query heads, causal with lengths
    cutting blocks: O, LSE, dQ, dK, dV against the oracle under each schedule, and bit-identical
    across the schedules."""
    bq, bk = kh.blocks("fwd", dtype, head_dim)
    lengths = dict(query_seq_lengths=np.array([bq + 3, 5], np.int32),
                   key_value_seq_lengths=np.array([2 * bk + 1, bk], np.int32))
    mask = dict(lengths, is_causal=True, causal_alignment="bottom_right")
    q, k, v, do, g = kh.random_inputs(kh.DTYPES[dtype], 2, bq + 5, 2 * bk + 3, 4, 2, head_dim,
                                      seed=variant, **lengths)
    results = [kh.check_against_oracle(q, k, v, do, g, schedule=s, seed=seed, variant=variant,
                                       **mask) for s, seed in SCHEDULES]
    for other in results[1:]:
        for name in ("o", "lse", "dq", "dk", "dv"):
            np.testing.assert_array_equal(np.asarray(other[name]), np.asarray(results[0][name]),
                                          err_msg=name)


def _plan_kernels(direction, dtype, head_dim, q_len, variant):
    return {d["kernel"] for sub in _ext.dispatch_plan(direction, dtype, 1, q_len, 64, 4, 4,
                                                      head_dim, variant=variant) for d in sub}


def test_the_plan_runs_the_variants_kernels():
    assert _plan_kernels("fwd", "f16", 128, 64, 1) == {"flash_attention_fwd_var1_f16_d128"}
    assert _plan_kernels("bwd", "f16", 128, 64, 1) == {"flash_attention_bwd_dq_var1_f16_d128",
                                                      "flash_attention_bwd_dkdv_var1_f16_d128"}
    # Decode: pass 1 in the variant; the vector pass 1 and pass 2 have one strategy.
    decode = _plan_kernels("fwd", "f16", 128, 12, 1)
    assert "flash_attention_decode_partial_var1_f16_d128" in decode
    assert "flash_attention_decode_combine_f16_d128" in decode


@pytest.mark.parametrize("q_len,kernel", [(20, "fwd_var1"), (20, "bwd_dkdv_var1"),
                                          (8, "decode_partial_var1")])
def test_the_environment_variable_forces_a_variant(monkeypatch, q_len, kernel):
    """$JFM_KERNEL_VARIANT reaches the FFI attribute: a fault injected into the variant's kernel
    fails the call (so that kernel ran), and without it the tiled forward, the decode (8 rows per
    KV head: decode_partial) and the backward of variant 1 match the oracle."""
    monkeypatch.setenv("JFM_KERNEL_VARIANT", "1")
    rng = np.random.default_rng(q_len)
    q = normal(rng, (1, q_len, 4, 64), jnp.float32)
    k, v = (normal(rng, (1, 40, 1, 64), jnp.float32) for _ in range(2))
    do = normal(rng, (1, q_len, 4, 64), jnp.float32)
    g = jnp.zeros((1, 4, q_len), jnp.float32)
    kw = dict(is_causal=True, causal_alignment="bottom_right")
    name = f"flash_attention_{kernel}_f32_d64"
    _ext.testing.set_emulator_fault(name)
    try:
        with pytest.raises(Exception, match=name):
            jax.block_until_ready(run(q, k, v, do, g, implementation="emulator", **kw))
    finally:
        _ext.testing.set_emulator_fault("")
    got = run(q, k, v, do, g, implementation="emulator", **kw)
    tolerance.assert_all_match_oracle(got, q, k, v, do, g, **kw)


@pytest.mark.parametrize("value,match", [("x", "JFM_KERNEL_VARIANT must be a non-negative"),
                                         ("-1", "JFM_KERNEL_VARIANT must be a non-negative"),
                                         ("7", r"or \$JFM_KERNEL_VARIANT\) must be in \[0, ")])
def test_a_bad_variant_is_refused_by_name(monkeypatch, value, match):
    monkeypatch.setenv("JFM_KERNEL_VARIANT", value)
    q = jnp.ones((1, 8, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda q: flash_attention(q, q, q, implementation="emulator"))(q)
