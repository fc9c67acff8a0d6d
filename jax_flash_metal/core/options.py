"""The keywords of ``flash_attention`` (everything after query, key, value, bias and mask),
declared once.

``Options`` is what ``attention.attend``, ``reference_attention``, ring attention, the argument
checks and the Flax integration take. The public signatures (``flash_attention`` and its typing
overloads, ``reference_attention``) spell the keywords out for readers and static checkers;
``tests/api/test_typing_and_imports.py`` checks them, and the API table of docs/api.md, against
this declaration. Adding a keyword: a field here, then the line the test asks for in each
signature and in the table.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, NamedTuple, Optional, Tuple, Union

from jax.typing import ArrayLike

from .contract import ImplementationChoice

# local_window_size: None, w, or (left, right) with None for an unbounded side.
Window = Optional[Union[int, Tuple[Optional[int], Optional[int]]]]


class Options(NamedTuple):
    """``flash_attention``'s keywords with their defaults (docs/api.md gives their meaning)."""

    scale: ArrayLike | None = None
    is_causal: bool = False
    query_seq_lengths: ArrayLike | None = None
    key_value_seq_lengths: ArrayLike | None = None
    local_window_size: Window = None
    implementation: ImplementationChoice | None = None
    query_segment_ids: ArrayLike | None = None
    key_value_segment_ids: ArrayLike | None = None
    logits_soft_cap: float | None = None
    sinks: ArrayLike | None = None
    causal_alignment: str = "top_left"
    alibi_slopes: ArrayLike | None = None
    page_table: ArrayLike | None = None
    sequence_axis_name: Hashable | None = None
    sequence_layout: str = "contiguous"
    sequence_strategy: str | None = None
    dropout_rate: float = 0.0
    dropout_rng: ArrayLike | None = None
    return_lse: bool = False
    return_residual: bool = False

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> "Options":
        """The options among ``arguments`` (a function's ``locals()``); defaults for the rest."""
        return cls(**{name: arguments[name] for name in cls._fields if name in arguments})


# Keywords of flash_attention that reference_attention does not take: it is the one dense
# computation, on one device, and returns the log-sum-exp in one layout (return_lse).
NOT_IN_REFERENCE = frozenset({"implementation", "sequence_axis_name", "sequence_layout",
                              "sequence_strategy", "return_residual"})
