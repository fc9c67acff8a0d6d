"""Every pair of optional operands and features reaches the kernels in the right slots
(docs/testing.md#operand-pairs).

The features are generated from the contract's operand list (``contract.OPERAND_FLAGS``, through
tests/operand_cases.py) plus the static ones, so a new optional operand is covered with no edit
here. Each case runs through every implementation against the float64 oracle, forward and,
where the case is differentiable, the gradients of q, k, v, bias, sinks and ALiBi slopes, at the
smallest shapes that reach both forward plans (split-KV decode and tiled). The C++ contract
checks get the same generated coverage: each present operand of every pair of operands, passed
to the FFI targets with a wrong dtype or rank in its own slot, is refused by its own name.
"""

import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import operand_cases as oc
from api_helpers import needs_emulator
from jax_flash_metal import flash_attention, implementations
from jax_flash_metal.core import contract, validation
from jax_flash_metal.core.options import Options

FUSED = [i for i in implementations.available() if i != "xla"]


def covering(seed=0, tries=20):
    """Cases, chosen greedily, in which every pair of (feature, on or off) and (feature, plan)
    values occurs at least once (a pairwise covering array), the refused pairs (``REQUIRES``)
    left out."""
    factors = [(f, (False, True)) for f in oc.FEATURES] + [("plan", oc.PLANS)]
    rng = random.Random(seed)

    def pairs_of(case):
        values = [(f, (f in case.features) if f != "plan" else case.plan) for f, _ in factors]
        return {(a, b) for n, a in enumerate(values) for b in values[n + 1:]}

    def holds(pair):  # the smallest case with the pair's values holds it, unless refused
        values = dict(pair)
        case = oc.Case({f for f, on in values.items() if on is True}, values.get("plan", "tiled"))
        return pair in pairs_of(case)

    values = [(f, v) for f, levels in factors for v in levels]
    everything = {(a, b) for n, a in enumerate(values) for b in values[n + 1:]
                  if a[0] != b[0] and holds((a, b))}
    cases = []
    while everything:
        best = max((oc.Case({f for f in oc.FEATURES if rng.random() < 0.5},
                            rng.choice(oc.PLANS)) for _ in range(tries)),
                   key=lambda c: len(pairs_of(c) & everything))
        cases.append(best)
        everything -= pairs_of(best)
    return cases


def test_every_operand_flag_has_an_example():
    assert set(oc.OPERAND_FEATURES) == set(oc.OPERAND_EXAMPLES), (
        "add an example of each optional operand to tests/operand_cases.py OPERAND_EXAMPLES")


@needs_emulator
@pytest.mark.parametrize("plan", oc.PLANS)
def test_the_shapes_reach_both_plans(plan):
    from jax_flash_metal import _ext
    case = oc.Case((), plan)
    splits, _ = _ext.decode_splits("f32", oc.B, case.q_len, oc.TKV, case.heads, case.kv_heads,
                                   case.head_dim, "emulator", case.value_head_dim, False)
    assert (splits > 0) == (plan == "decode")


@pytest.mark.parametrize("case", oc.pairs(), ids=repr)
@pytest.mark.parametrize("fused", FUSED)
def test_every_pair_on_the_fused_kernels(fused, case):
    oc.assert_matches(*oc.run(case, fused), case)


# The xla implementation compiles slowly on CPU: a covering array (every pair of features, on
# and off, in far fewer calls) instead of every pair alone.
@pytest.mark.parametrize("case", covering(), ids=repr)
def test_every_pair_covered_on_xla(case):
    oc.assert_matches(*oc.run(case, "xla"), case)


@pytest.mark.parametrize("case", oc.random_cases(4, seed=1), ids=repr)
def test_random_larger_combinations(implementation, case):
    oc.assert_matches(*oc.run(case, implementation, seed=2), case)


def _api_names(feature, case):
    example = oc.OPERAND_EXAMPLES[feature](case, np.random.default_rng(0))
    return [n for n in example if n != "dropout_rng"]


@pytest.mark.parametrize("feature,needed", oc.REQUIRES.items())
def test_refused_combinations_name_their_arguments(implementation, feature, needed):
    """Refused at trace time (no FFI call), naming both arguments."""
    case = oc.Case({feature}, "decode")
    q, k, v, _, _, kw, *_ = oc.arguments(case)
    for name in _api_names(needed, case):
        kw.pop(name)
    names = _api_names(feature, case) + _api_names(needed, case)
    with pytest.raises(ValueError, match=".*".join(map(re.escape, names))):
        jax.eval_shape(lambda q, k, v: flash_attention(q, k, v, implementation=implementation,
                                                       **kw), q, k, v)


@pytest.mark.parametrize("feature", oc.FORWARD_ONLY)
def test_forward_only_features_refuse_gradients_by_name(implementation, feature):
    q, k, v, _, _, kw, *_ = oc.arguments(oc.Case({feature}, "decode"))
    with pytest.raises(TypeError, match=re.escape(_api_names(feature, oc.Case((), "decode"))[0])):
        jax.grad(lambda q: flash_attention(q, k, v, implementation=implementation,
                                           **kw).sum())(q)


# ---------------------------------------------------------------- the C++ contract checks

def _wrong_dtype(x):
    return x.astype(jnp.float32 if x.dtype != jnp.float32 else jnp.int32)


def _wrong_rank(x):
    return x[None]


def _slot_cases():
    """Every optional operand, alone and with every other one (the FFI sees no static
    feature), each present operand broken once (a wrong dtype or rank, in turn) for the
    forward; alone also for the backward, whose handler reads its operands with the same
    function."""
    operand_pairs = [c for c in oc.pairs() if c.features <= set(oc.OPERAND_FEATURES)]
    out = []
    for case in operand_pairs:
        present = [n for n, f in contract.OPERAND_FLAGS.items() if f in case.features]
        alone = len(case.features) == 1 and case.differentiable
        for n, name in enumerate(present):
            for direction in ("fwd", "bwd") if alone else ("fwd",):
                out.append(pytest.param(case, name, direction, (_wrong_dtype, _wrong_rank)[n % 2],
                                        id=f"{case}-{name}-{direction}"))
    return out


@needs_emulator
@pytest.mark.parametrize("case,name,direction,break_", _slot_cases())
def test_each_operand_is_checked_in_its_own_slot(case, name, direction, break_):
    """The handler finds each present operand in its own slot: one broken operand is refused
    by its own name, whichever others the call has."""
    from ffi_targets import bwd_call, fwd_call
    from jax_flash_metal import _ext
    from jax_flash_metal.fused import ffi_lowering
    q, k, v, do, g, kw, *_ = oc.arguments(case)
    q, k, v, operands, params = validation.check_inputs(
        q, k, v, kw.pop("bias", None), kw.pop("mask", None), Options(**kw))
    operands = operands._replace(**{name: break_(getattr(operands, name))})
    params = params._replace(kernel_variant=0)  # the lowering resolves AUTO before this point
    attrs = {n: x for n, x in ffi_lowering._attributes(**{
        n: x for n, x in params._asdict().items() if n not in contract.HOST_ONLY_PARAMS}).items()
        if n not in ("bias_grad", "alibi_grad")}  # the forward's: none
    rows = (oc.B, case.heads, case.q_len)
    with pytest.raises(Exception, match=rf"jax_flash_metal: {name}\b"):
        if direction == "fwd":
            _, elements = _ext.decode_splits("f32", oc.B, case.q_len, oc.TKV, case.heads,
                                             case.kv_heads, case.head_dim, "emulator",
                                             case.value_head_dim, params.dropout_rate > 0)
            fwd_call(q, k, v, *operands.present(),
                     workspace=jax.ShapeDtypeStruct((elements,), jnp.float32), **attrs)
        else:
            zeros = jnp.zeros(rows, jnp.float32)
            bwd_call(q, k, v, jnp.zeros(do.shape, do.dtype), (zeros, zeros), do, g,
                     *operands.present(), **attrs)
