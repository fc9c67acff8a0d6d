"""The xla implementation's float32 matmuls ask for full precision themselves (an NVIDIA GPU's
default precision runs float32 matmuls in TF32), whatever JAX's default matmul precision is:
the block loops (forward and backward) and the short-query decode."""

import re

import jax
import jax.numpy as jnp
import pytest

from api_helpers import use_xla_schedule
from jax_flash_metal import flash_attention
from jax_flash_metal.xla import schedule as xla_schedule


@pytest.mark.parametrize("q_len", [300, 1], ids=["blocks", "decode"])
def test_float32_matmuls_name_full_precision(q_len, monkeypatch):
    # The decode path on cpu too.
    use_xla_schedule(monkeypatch, xla_schedule.for_platform("cpu")._replace(split_kv_decode=True))
    q = jnp.ones((1, q_len, 2, 16), jnp.float32)
    k = jnp.ones((1, 300, 2, 16), jnp.float32)

    def loss(q, k):
        return flash_attention(q, k, k, implementation="xla").sum()

    with jax.default_matmul_precision("bfloat16"):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(q, k).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    assert dots, "no matmul found"
    assert all("precision = [HIGHEST, HIGHEST]" in d for d in dots), \
        [d[:160] for d in dots if "HIGHEST, HIGHEST" not in d]
