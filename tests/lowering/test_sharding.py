"""flash_attention under jit with sharded operands (lowering/sharding.py), on 8 host devices in a
subprocess (tests/lowering/sharded_checks.py): batch and head splits (grouped-query and multi-query
attention, every optional operand, a value head dim other than the key's with ALiBi slopes,
dropout) compile to no gather of q, k, v, o or dO, keep their sharding and match the float64
oracle, forward and gradients; a sequence split is gathered and exact.
Both partitioners over Auto mesh axes (Shardy and GSPMD), and Explicit axes under jax.set_mesh
(sharding in types: outputs and gradients typed like their inputs; unsharded inputs too)."""

import jax
import pytest

from host_devices import run_script

CASES = ("causal", "gqa", "mqa", "features", "bias_heads", "sequence", "dropout")
XLA_CASES = ("value_dim_alibi",)  # features the fused kernels do not implement yet
# Explicit axes: the same rules, typed; the emulator runs the case with every operand.
EXPLICIT_CASES = {"xla": CASES + XLA_CASES + ("unsharded",)}
EXPLICIT_FUSED_CASES = ("features", "unsharded")


@pytest.mark.parametrize("partitioner", ["--shardy", "--gspmd", "--explicit"])
def test_sharded_jit(implementation, partitioner):
    if partitioner == "--explicit":
        if not hasattr(jax, "set_mesh"):
            pytest.skip("this JAX has no Explicit mesh axes (jax.set_mesh)")
        cases = EXPLICIT_CASES.get(implementation, EXPLICIT_FUSED_CASES)
    else:
        cases = CASES + (XLA_CASES if implementation == "xla" else ())
    out = run_script("lowering/sharded_checks.py", implementation, partitioner, *cases)
    assert out.count(" ok ") == len(cases), out
