"""Comparisons of a framework's own attention with the same module using flash_attention.

The framework's module is the reference here (the adapters must reproduce it). Tolerances follow
docs/testing.md#tolerances scaled to whole modules: float32 max error <= 1e-5 x max|reference| on
outputs and 1e-4 x max|reference| on gradients, per leaf, with a floor of 1e-6 x the largest entry
of the whole tree (a leaf whose exact value is 0, e.g. the key bias's gradient, holds float32 noise
of the other leaves' size); bfloat16: error against the float32 reference <= 2 x the framework's
own bfloat16 error (relative to each leaf's max|reference|, worst leaf) + 1e-5, and a leaf whose
exact value is 0 within the dtype's unit roundoff of the tree's largest entry.
"""

import jax
import jax.numpy as jnp
import numpy as np

RTOL = {"output": 1e-5, "gradient": 1e-4}

def _pairs(got, want):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) > 0
    return [(np.asarray(g, np.float64), np.asarray(w, np.float64))
            for g, w in zip(got_leaves, want_leaves)]


def assert_close(kind, got, want):
    """Every leaf of ``got`` within float32 tolerance (``kind``: "output" or "gradient") of the
    same leaf of ``want``."""
    pairs = _pairs(got, want)
    floor = 1e-6 * max(1.0, max(np.max(np.abs(w), initial=0) for _, w in pairs))
    for i, (g, w) in enumerate(pairs):
        assert g.shape == w.shape, (kind, i, g.shape, w.shape)
        err, scale = np.max(np.abs(g - w), initial=0), np.max(np.abs(w), initial=0)
        assert err <= RTOL[kind] * scale + floor, (f"{kind} leaf {i}: max error {err:.3g}, "
                                                   f"max |reference| {scale:.3g}")


def assert_half_close(got, framework_half, reference32):
    """Half-precision ``got`` no further from the float32 reference than twice the framework's own
    half-precision result: the worst leaf's max error relative to that leaf's max|reference|,
    over the whole tree (projections in half precision make single leaves noisy), + 1e-5.

    A leaf whose exact value is 0 (the key bias's gradient: each row's score gradient sums to 0)
    holds nothing but rounding noise, whose size follows from how D = rowsum(dO O) is formed
    (FlashAttention-2 forms it from the rounded O; plain attention from the rounded P and dP),
    not from the accuracy of any entry: over 30 cases (15 seeds, with and without a causal mask)
    ours ranged 1-4x the framework's noise. It is held instead to the half dtype's unit roundoff
    (eps / 2) times the tree's largest entry: ours stayed under 0.6 of that; a D 1% off reaches
    0.8-1.3 of it, 10% off ten times.
    """
    pairs = _pairs(got, reference32)
    top = max(np.max(np.abs(r), initial=0) for _, r in pairs)
    exact_zero = [np.max(np.abs(r), initial=0) <= 1e-3 * top for _, r in pairs]

    def worst(tree):
        return max(np.max(np.abs(a - r), initial=0) / np.max(np.abs(r))
                   for (a, r), zero in zip(_pairs(tree, reference32), exact_zero) if not zero)

    ours, own = worst(got), worst(framework_half)
    assert ours <= 2 * own + 1e-5, f"relative error {ours:.3g} > 2 x the framework's {own:.3g}"
    unit = float(jnp.finfo(got[0].dtype).eps) / 2  # got[0]: the output, in the half dtype
    for i, ((a, _), zero) in enumerate(zip(pairs, exact_zero)):
        assert not zero or np.max(np.abs(a)) <= unit * top, (
            f"leaf {i} (exactly 0): max |value| {np.max(np.abs(a)):.3g} > {unit:.3g} x {top:.3g}")
