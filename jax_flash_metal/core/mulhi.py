"""The two 32-bit words of a 32 x 32 -> 64-bit unsigned product, for Philox (``dropout``).

JAX without x64 has no 64-bit integers, and the portable formula (four products of 16-bit
halves and their carries, about 15 integer operations) is what made the xla implementation's
dropout mask cost more than the attention around it on a GPU. ``high_and_low`` is one primitive
whose lowering widens to ``ui64`` in StableHLO itself (x64 is a tracing rule; XLA has the type
on CPU and CUDA/ROCm GPUs: one widening multiply, ``mul.wide.u32`` on NVIDIA) and takes both
words from that one product, where a separate 32-bit multiply for the low word cost one more
multiply per Philox product. Other platforms (TPU, the Apple-GPU plugins) lower the
16-bit-halves formula and a 32-bit multiply; both give the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import batching, mlir

_U32 = jnp.uint32
WIDE_PLATFORMS = ("cpu", "cuda", "rocm")


def _halves(b, *, a: int):
    """floor(a * b / 2**32) from 16-bit halves: every partial product and sum fits in 32 bits."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    lo_lo, lo_hi = b_lo * _U32(a_lo), b_hi * _U32(a_lo)
    hi_lo, hi_hi = b_lo * _U32(a_hi), b_hi * _U32(a_hi)
    carry = ((lo_lo >> 16) + (lo_hi & 0xFFFF) + (hi_lo & 0xFFFF)) >> 16
    return hi_hi + (lo_hi >> 16) + (hi_lo >> 16) + carry


def _wide(ctx, b, *, a: int):
    """StableHLO: convert b to ui64, multiply by a; the high word (shifted right by 32) and the
    low word, converted back."""
    shape = ctx.avals_in[0].shape
    u64 = ir.IntegerType.get_unsigned(64)
    wide = ir.RankedTensorType.get(shape, u64)
    narrow = ir.RankedTensorType.get(shape, ir.IntegerType.get_unsigned(32))

    def splat(value):
        return hlo.constant(ir.DenseElementsAttr.get_splat(wide, ir.IntegerAttr.get(u64, value)))

    product = hlo.multiply(hlo.convert(wide, b), splat(a))
    return [hlo.convert(narrow, hlo.shift_right_logical(product, splat(32))),
            hlo.convert(narrow, product)]


def _portable(b, *, a: int):
    return _halves(b, a=a), b * _U32(a)


mulhi_p = Primitive("jax_flash_metal_mulhilo_u32")
mulhi_p.multiple_results = True
mulhi_p.def_impl(lambda b, *, a: jax.jit(lambda b: mulhi_p.bind(b, a=a))(b))
mulhi_p.def_abstract_eval(lambda b, *, a: (b.update(weak_type=False),) * 2)
batching.primitive_batchers[mulhi_p] = (
    lambda args, dims, *, a: (mulhi_p.bind(*args, a=a), dims * 2))  # elementwise
mlir.register_lowering(mulhi_p, mlir.lower_fun(_portable, multiple_results=True))
for _platform in WIDE_PLATFORMS:
    mlir.register_lowering(mulhi_p, _wide, platform=_platform)


def high_and_low(a: int, b):
    """(high, low) uint32 words of the 64-bit product of the constant ``a`` (< 2**32) and the
    uint32 array ``b``: floor(a * b / 2**32) and a * b mod 2**32."""
    if not 0 <= a < 2 ** 32:
        raise ValueError(f"high_and_low: a must be a 32-bit unsigned constant, got {a}")
    hi, lo = mulhi_p.bind(jnp.asarray(b, _U32), a=int(a))
    return hi, lo
