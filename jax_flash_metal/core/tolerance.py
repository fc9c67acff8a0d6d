"""The package's copy of the oracle tolerances of docs/testing.md#tolerances, used where the
package itself judges results: the self-check against its float64 oracle and the autotuner's
agreement check between kernel variants (docs/tuning.md).

float32 results: max |error| <= ``FLOAT32_RTOL[output]`` x max |reference| + 1e-6.
float16/bfloat16 results: max |error| <= 2 x the error of the same attention computed in that
dtype (the baseline) + 1e-5. Non-finite reference entries must match: infinities exactly, NaN by
any non-finite value.
"""

from __future__ import annotations

import numpy as np

# Outputs (O, LSE) and gradients; dbias, dsinks and dslopes are gradients too.
FLOAT32_RTOL = {"o": 1e-5, "lse": 1e-5, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4, "dbias": 1e-4,
                "dsinks": 1e-4, "dslopes": 1e-4}
FLOAT32_FLOOR = 1e-6
HALF_FACTOR, HALF_FLOOR = 2.0, 1e-5


def max_error(got, want) -> float:
    """max |got - want| over the entries where ``want`` is finite, in float64; inf where a
    non-finite entry of ``want`` is not matched (an infinity exactly, NaN by a non-finite
    value) or ``got`` is non-finite where ``want`` is finite."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    infinite = np.isinf(want)
    if (not np.array_equal(got[infinite], want[infinite])
            or np.isfinite(got[np.isnan(want)]).any() or not np.isfinite(got[finite]).all()):
        return float("inf")
    return float(np.abs(got[finite] - want[finite]).max(initial=0.0))


def limit(output: str, want, baseline=None) -> float:
    """The largest error allowed for ``output`` (a key of FLOAT32_RTOL) against the reference
    ``want``: the float32 rule without ``baseline``, else the half-precision rule with
    ``baseline``, the same attention computed in the inputs' float16/bfloat16."""
    if baseline is None:
        want = np.asarray(want, np.float64)
        scale = float(np.abs(want[np.isfinite(want)]).max(initial=0.0))
        return FLOAT32_RTOL[output] * scale + FLOAT32_FLOOR
    want = np.asarray(want, np.float64)
    finite = np.isfinite(want)
    base = np.abs(np.asarray(baseline, np.float64)[finite] - want[finite])
    return HALF_FACTOR * float(base[np.isfinite(base)].max(initial=0.0)) + HALF_FLOOR


def within(output: str, got, want, baseline=None) -> tuple[bool, float, float]:
    """(passed, max error, limit) of ``got`` against the reference ``want``."""
    error, allowed = max_error(got, want), limit(output, want, baseline)
    return error <= allowed, error, allowed


def agree(output: str, got, reference, baseline=None) -> tuple[bool, float, float]:
    """(passed, max error, limit) of ``got`` against ``reference``, a float32 result that is
    itself within the oracle tolerance (the autotuner's check of a kernel variant against the
    xla implementation). float32: each within ``limit`` of the exact result, so at most twice
    it apart; float16/bfloat16 (``baseline`` given): the half-precision limit, against which
    the float32 reference's own error is negligible."""
    error, allowed = max_error(got, reference), limit(output, reference, baseline)
    allowed *= 1.0 if baseline is not None else 2.0
    return error <= allowed, error, allowed
