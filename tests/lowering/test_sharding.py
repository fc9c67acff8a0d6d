"""flash_attention under jit with sharded operands (lowering/sharding.py), on 8 host devices in a
subprocess (tests/lowering/sharded_checks.py): batch and head splits (grouped-query and multi-query
attention, every optional operand, a value head dim other than the key's with ALiBi slopes)
compile to no gather of q, k, v, o or dO, keep their sharding and match the float64 oracle,
forward and gradients; a sequence split is gathered and exact.
Both partitioners: Shardy and GSPMD."""

import pytest

from host_devices import run_script

CASES = ("causal", "gqa", "mqa", "features", "bias_heads", "sequence")
XLA_CASES = ("value_dim_alibi",)  # features the fused kernels do not implement yet


@pytest.mark.parametrize("partitioner", ["--shardy", "--gspmd"])
def test_sharded_jit(implementation, partitioner):
    cases = CASES + (XLA_CASES if implementation == "xla" else ())
    out = run_script("lowering/sharded_checks.py", implementation, partitioner, *cases)
    assert out.count(" ok ") == len(cases), out
