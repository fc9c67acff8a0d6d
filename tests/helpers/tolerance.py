"""The tolerances of docs/testing.md#tolerances against the float64 oracle.

float32: max error <= 1e-5 x max|oracle| on outputs (O, LSE), 1e-4 x max|oracle| on gradients
(plus a 1e-6 floor for all-zero references). float16/bfloat16: max error <= 2 x the error of plain
same-dtype `jnp` attention (computed here by `baseline`) + 1e-5.
Non-finite oracle entries must match: -inf/+inf exactly, NaN by any non-finite value.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import oracle

FLOAT32_RTOL = {"o": 1e-5, "lse": 1e-5, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4, "dbias": 1e-4,
                "dsinks": 1e-4}


def baseline(q, k, v, do, g_lse=None, **mask_kwargs):
    """Plain attention computed in the inputs' dtype with jnp, and its autodiff gradients.

    Returns a dict with o, lse, dq, dk, dv (and dbias / dsinks with a bias / sinks) as float64
    NumPy — the error yardstick for half-precision results. ``dropout_mask`` and
    ``dropout_rate`` as the oracle's. Invisible keys are masked in the
    dtype; empty rows give 0.
    """
    q, k, v, do = (jnp.asarray(x) for x in (q, k, v, do))
    b, tq, h, d = q.shape
    mask_kwargs = dict(mask_kwargs)
    scale = mask_kwargs.pop("scale", None)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    cap = mask_kwargs.pop("logits_soft_cap", None)
    sinks = mask_kwargs.pop("sinks", None)
    keep = mask_kwargs.pop("dropout_mask", None)
    rate = mask_kwargs.pop("dropout_rate", 0.0)
    z = jnp.ones((), q.dtype) if keep is None else jnp.asarray(
        np.asarray(keep, bool) / (1.0 - rate), q.dtype)
    bias = mask_kwargs.get("bias")
    mask = jnp.asarray(oracle.full_visibility(b, h, tq, k.shape[1], **mask_kwargs))
    has_bias, has_sinks = bias is not None, sinks is not None
    bias = jnp.zeros((), q.dtype) if bias is None else jnp.asarray(bias, jnp.float32).astype(
        q.dtype)
    bias = jnp.where(jnp.isneginf(bias), 0, bias)  # -inf entries are masked instead
    sinks = jnp.zeros(h, q.dtype) if sinks is None else jnp.asarray(sinks, jnp.float32).astype(
        q.dtype)
    # Keys no row may see are zeroed so padded garbage cannot reach the baseline.
    key_used = mask.any(axis=(1, 2))[:, :, None, None]

    g = jnp.zeros((b, h, tq), jnp.float32) if g_lse is None else jnp.asarray(g_lse, jnp.float32)
    # One compiled function per shape instead of dozens of eagerly compiled ops.
    o, lse, dq, dk, dv, dbias, dsinks = _baseline_compiled(
        q, k, v, do, g, mask, key_used, bias, sinks, z, scale=float(scale), cap=cap,
        has_sinks=has_sinks)
    out = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
    if has_bias:
        out["dbias"] = jnp.reshape(dbias, np.shape(mask_kwargs["bias"]))
    if has_sinks:
        out["dsinks"] = dsinks
    return {name: np.asarray(x, dtype=np.float64) for name, x in out.items()}


@functools.partial(jax.jit, static_argnames=("scale", "cap", "has_sinks"))
def _baseline_compiled(q, k, v, do, g, mask, key_used, bias, sinks, z, *, scale, cap,
                       has_sinks):
    dtype = q.dtype
    h, hkv = q.shape[2], k.shape[2]
    sinks = sinks if has_sinks else None

    def attend(q, k, v, bias, sinks):
        k = jnp.repeat(jnp.where(key_used, k, 0), h // hkv, axis=2)
        v = jnp.repeat(jnp.where(key_used, v, 0), h // hkv, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(scale, dtype)
        if cap is not None:
            s = jnp.asarray(cap, dtype) * jnp.tanh(s / jnp.asarray(cap, dtype))
        s = jnp.where(mask, s + bias, jnp.asarray(-jnp.inf, dtype))
        m = s.max(axis=-1, keepdims=True)
        if sinks is not None:
            m = jnp.maximum(m, sinks[None, :, None, None])
        m = jax.lax.stop_gradient(m)
        m = jnp.where(jnp.isfinite(m), m, 0)
        p = jnp.where(mask, jnp.exp(s - m), 0)
        denom = p.sum(axis=-1, keepdims=True)
        if sinks is not None:
            denom = denom + jnp.exp(sinks[None, :, None, None] - m)
        safe = jnp.where(denom == 0, jnp.ones_like(denom), denom)
        o = jnp.einsum("bhqk,bkhd->bqhd", p / safe * z, v)
        lse = jnp.where(denom[..., 0] == 0, -jnp.inf, (m + jnp.log(safe))[..., 0])
        return o, lse.astype(jnp.float32)

    (o, lse), vjp = jax.vjp(attend, q, k, v, bias, sinks)
    g = jnp.where(jnp.isfinite(lse), g, 0)
    dq, dk, dv, dbias, dsinks = vjp((do.astype(dtype), g))
    return o, lse, dq, dk, dv, dbias, jnp.zeros(h) if dsinks is None else dsinks


def assert_matches_oracle(name, actual, expected, baseline_value=None, kind=None,
                          input_dtype=None):
    """Asserts `actual` (any dtype) is within the tolerances of the float64 `expected`.

    kind: one of o, lse, dq, dk, dv, dbias, dsinks (defaults to `name`), selecting the float32
    tolerance. input_dtype: the dtype of the attention inputs the value was computed from
    (default: its own; a float32 dbias of bfloat16 inputs is a half-precision result).
    baseline_value: the same quantity from `baseline(...)`; required for f16/bf16.
    """
    kind = kind or name
    actual_dtype = np.asarray(actual).dtype if input_dtype is None else np.dtype(input_dtype)
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != oracle {e.shape}"
    finite = np.isfinite(e)
    assert np.array_equal(a[np.isinf(e)], e[np.isinf(e)]), f"{name}: infinities differ from oracle"
    assert np.isnan(a[np.isnan(e)]).all(), f"{name}: NaN in oracle not propagated as NaN"
    assert np.isfinite(a[finite]).all(), f"{name}: non-finite values where the oracle is finite"
    if not finite.any():
        return
    err = np.abs(a[finite] - e[finite]).max()
    if actual_dtype == np.float32 or actual_dtype == np.float64:
        tol = FLOAT32_RTOL[kind] * np.abs(e[finite]).max() + 1e-6
    else:
        assert baseline_value is not None, f"{name}: half-precision check needs the baseline"
        b = np.asarray(baseline_value, dtype=np.float64)
        base_err = np.abs(b[finite] - e[finite])
        base_err = base_err[np.isfinite(base_err)].max(initial=0.0)
        tol = 2.0 * base_err + 1e-5
    assert err <= tol, f"{name}: max error {err:.3e} exceeds tolerance {tol:.3e}"


OUTPUTS = ("o", "lse", "dq", "dk", "dv")


def oracle_outputs(q, k, v, do, g_lse=None, **mask_kwargs):
    """The float64 oracle's o, lse, dq, dk, dv (and dbias / dsinks with a bias / sinks) as a
    dict."""
    want = dict(zip(("o", "lse"), oracle.attention(q, k, v, **mask_kwargs)))
    want.update(oracle.gradients(q, k, v, do, g_lse, **mask_kwargs))
    return want


def assert_all_match_oracle(got, q, k, v, do, g_lse=None, *, baseline_inputs=None,
                            names=OUTPUTS, **mask_kwargs):
    """Asserts each got[name] (name in o, lse, dq, dk, dv) against the float64 oracle.

    For f16/bf16 inputs the yardstick is `baseline` on `baseline_inputs` (q, k, v, do, g_lse),
    which default to the inputs themselves. Returns the oracle's values as a dict.
    """
    want = oracle_outputs(q, k, v, do, g_lse, **mask_kwargs)
    base = None
    if np.dtype(q.dtype) != np.float32:
        base = baseline(*(baseline_inputs or (q, k, v, do, g_lse)), **mask_kwargs)
    for name in names:
        # dbias and dsinks are float32 whatever the inputs: judge them by the inputs' dtype.
        assert_matches_oracle(name, got[name], want[name], None if base is None else base[name],
                              input_dtype=q.dtype if name in ("dbias", "dsinks") else None)
    return want
