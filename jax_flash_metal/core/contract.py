"""The contract of the two attention primitives: what the primitive layer (``primitives``), the
argument checks (``validation``) and the FFI lowering (``ffi_lowering``) agree on. Operand
layout, static parameters and their exact types, once; the design is
docs/design.md#the-contract.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, NamedTuple, Sequence, Union

import jax.numpy as jnp

Implementation = Literal["xla", "emulator", "metal", "cudnn"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(Implementation)
# What ``implementation`` takes: one name, or names to try in order (the first that can run the
# call runs it).
ImplementationChoice = Union[Implementation, Sequence[Implementation]]
# The dtypes with kernels, by the suffix their kernel names carry
# (flash_attention_<stage>_<suffix>_d<Dk>[_v<Dv>]).
KERNEL_DTYPE_SUFFIXES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def kernel_suffix(dtype) -> str | None:
    """The kernel-name suffix of ``dtype`` (a dtype, type or name): "f32", "f16" or "bf16"; None
    for a dtype without kernels."""
    return KERNEL_DTYPE_SUFFIXES.get(jnp.dtype(dtype).name)


UNBOUNDED = -1  # window bound sentinel, same value as JFM_UNBOUNDED in shaders/attention_params.h

# The main operands of each direction's primitive, before the optional ones (Operands).
MAIN_OPERANDS = {"fwd": ("q", "k", "v"),
                 "bwd": ("q", "k", "v", "o", "lse", "row_max", "log_sum", "do", "g_lse")}


# The static params that are no FFI attribute: the implementation chain picks the FFI target,
# and the fused kernels implement every feature and read the dropout positions themselves.
# Moving one into JFM_FFI_ATTRIBUTES (ffi/attention_ffi.h) takes it out of this list.
HOST_ONLY_PARAMS = ("implementation", "dropout_key_groups")


class StaticParams(NamedTuple):
    """The static parameters of both primitives, with their exact types (``coerce_params``).
    Every field but ``HOST_ONLY_PARAMS`` is also an FFI attribute of the same name
    (``JFM_FFI_ATTRIBUTES`` in ffi/attention_ffi.h, with the backward's ``bias_grad`` and
    ``alibi_grad``)."""

    scale: float
    is_causal: bool
    window_left: int
    window_right: int
    bottom_right: bool
    has_q_lengths: bool
    has_kv_lengths: bool
    implementation: tuple[str, ...] | None  # names to try in order (lowering/dispatch.py)
    has_segment_ids: bool = False
    has_bias: bool = False
    has_mask: bool = False
    has_sinks: bool = False
    logits_soft_cap: float | None = None
    has_alibi: bool = False
    has_page_table: bool = False
    dropout_rate: float = 0.0
    # Whether every row's keys lie at unit stride from a multiple of 4 in the keep mask's
    # positions (the dropout operand's k_stride == 1, k_first % 4 == 0): then the xla
    # implementation draws one Philox call per 4 keys with no branch per tile
    # (core/dropout.keep). False only for ring attention's pieces that are not.
    dropout_key_groups: bool = True
    # The fused kernels' tile variant, or variants.AUTO: the lowering chooses (docs/tuning.md).
    kernel_variant: int = -1


class Operands(NamedTuple):
    """The optional array operands of both primitives, in their operand order (after the main
    ones): the one list of them, each field annotated with the static param that says it is
    present (``OPERAND_FLAGS``; dropout: ``dropout_rate`` > 0). Each is None when absent.
    ffi/attention_ffi.h's JFM_OPTIONAL_OPERANDS is this list for the FFI handlers
    (tests/fused/test_ffi.py checks that they agree); every operand position on either side is
    derived from it (``operand_roles``), never counted.

    q_lengths, kv_lengths: int32 [B]. q_segment_ids: int32 [B, Tq]; kv_segment_ids: int32
    [B, Tkv] (both or neither: ``has_segment_ids``). bias: float [b, h, tq, tkv] and mask: bool
    [b, h, tq, tkv], rank 4, each axis 1 (broadcast) or the full size of [B, H, Tq, Tkv].
    sinks: float32 [H]. alibi_slopes: float32 [B, H]. page_table: int32 [B, max_pages]; with
    it, k and v are pages [num_pages, page_size, HKV, D] and Tkv = max_pages * page_size.
    dropout: uint32 [B, H, 8] (dropout_rate > 0 only): per batch row and query head the PRNG
    key's two words, the (b, n) of the keep mask's counter and the global positions of the
    call's rows and keys (``dropout.FIELDS``).
    """

    # Each a JAX array (validation) or an abstract value (primitive rules), hence Any.
    q_lengths: Annotated[Any, "has_q_lengths"] = None
    kv_lengths: Annotated[Any, "has_kv_lengths"] = None
    q_segment_ids: Annotated[Any, "has_segment_ids"] = None
    kv_segment_ids: Annotated[Any, "has_segment_ids"] = None
    bias: Annotated[Any, "has_bias"] = None
    mask: Annotated[Any, "has_mask"] = None
    sinks: Annotated[Any, "has_sinks"] = None
    alibi_slopes: Annotated[Any, "has_alibi"] = None
    page_table: Annotated[Any, "has_page_table"] = None
    dropout: Annotated[Any, "dropout_rate"] = None

    def present(self):
        return [x for x in self if x is not None]

    @classmethod
    def from_list(cls, xs, flags):
        """Inverse of ``present`` for the given ``flags`` (``operand_flags``); checks the
        count."""
        xs = list(xs)
        if len(xs) != sum(flags):
            raise ValueError(f"expected {sum(flags)} optional operands, got {len(xs)}")
        return cls(*(xs.pop(0) if f else None for f in flags))


# Each Operands field's presence flag, a StaticParams field, in operand order.
OPERAND_FLAGS: dict[str, str] = {
    name: hint.__metadata__[0]
    for name, hint in typing.get_type_hints(Operands, include_extras=True).items()}


def operand_flags(params) -> tuple[bool, ...]:
    """Which ``Operands`` fields a primitive's static ``params`` say are present, in field
    order (an absent flag is False; a rate is present when > 0)."""
    return tuple(params.get(flag, False) > 0 for flag in OPERAND_FLAGS.values())


def operand_roles(direction: str, params) -> list[str]:
    """The role of each operand of a ``direction`` ("fwd" or "bwd") call: the main operand's
    name (``MAIN_OPERANDS``) or the ``Operands`` field name."""
    return [*MAIN_OPERANDS[direction],
            *(n for n, f in zip(Operands._fields, operand_flags(params)) if f)]


def _names(value) -> tuple[str, ...]:
    """Names in order: a str is one name (``implementation="xla"``), not its characters."""
    return (value,) if isinstance(value, str) else tuple(value)


def _coercion(hint):
    """(the function a ``StaticParams`` field is coerced with, whether it may be None)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if args else hint
    kind = _names if typing.get_origin(kind) is tuple else kind
    return kind, bool(args)


_COERCIONS = {name: _coercion(hint) for name, hint in typing.get_type_hints(StaticParams).items()}


def coerce_params(*, bias_grad=None, alibi_grad=None, **params):
    """The static params (``StaticParams``'s fields, by keyword; TypeError for an unknown or
    missing one) with the exact Python types of ``StaticParams``'s annotations (FFI attributes
    are typed), in field order. ``bias_grad`` and ``alibi_grad`` (backward only) are included
    when given."""
    coerced = {}
    for name, value in StaticParams(**params)._asdict().items():
        kind, optional = _COERCIONS[name]
        coerced[name] = None if value is None and optional else kind(value)
    for name, value in (("bias_grad", bias_grad), ("alibi_grad", alibi_grad)):
        if value is not None:
            coerced[name] = bool(value)
    return coerced
