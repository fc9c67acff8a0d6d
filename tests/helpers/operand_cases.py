"""Cases for the operand-slot tests (test_operand_pairs.py): the features of a call, one per
optional-operand flag of ``contract.Operands`` (``contract.OPERAND_FLAGS``) plus the static ones
(soft cap, window, causal, bottom-right alignment, Dk != Dv, GQA), each an example that turns it
on, and what the float64 oracle needs to judge the result.

The operand features come from the contract's list, so a new optional operand is a feature here
with no edit; ``OPERAND_EXAMPLES`` must then give it an example (test_operand_pairs checks that
every flag has one).
"""

import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np

import oracle
import tolerance
from api_helpers import alibi_bias, normal
from jax_flash_metal import dropout_mask, flash_attention
from jax_flash_metal.core import contract

B, PAGE = 2, 16  # batch; keys per page (the smallest page size the kernels take)
TKV = 2 * PAGE  # two pages of keys
# The smallest query lengths of each plan (ffi/dispatch_plan.h decode_splits): a q_len of at
# most JFM_DECODE_MAX_Q_LEN takes the split-KV decode, one more the tiled forward.
Q_LEN = {"decode": 2, "tiled": 17}
PLANS = tuple(Q_LEN)
DROPOUT_RATE, DROPOUT_KEY = 0.25, 7


# Each example: (case, rng) -> flash_attention keyword arguments; `case` holds the shapes.
OPERAND_EXAMPLES = {
    "has_q_lengths": lambda c, rng: dict(query_seq_lengths=np.array([c.q_len, c.q_len // 2])),
    "has_kv_lengths": lambda c, rng: dict(key_value_seq_lengths=np.array([TKV - 5, PAGE + 3])),
    "has_segment_ids": lambda c, rng: dict(
        query_segment_ids=rng.integers(0, 2, (B, c.q_len)).astype(np.int32),
        key_value_segment_ids=rng.integers(0, 2, (B, TKV)).astype(np.int32)),
    "has_bias": lambda c, rng: dict(bias=rng.standard_normal((B, 1, c.q_len, TKV)).astype(
        np.float32)),
    "has_mask": lambda c, rng: dict(mask=rng.random((1, c.heads, c.q_len, TKV)) > 0.25),
    "has_sinks": lambda c, rng: dict(sinks=rng.standard_normal(c.heads).astype(np.float32)),
    "has_alibi": lambda c, rng: dict(alibi_slopes=(0.5 * rng.random((B, c.heads))).astype(
        np.float32)),
    "has_page_table": lambda c, rng: dict(page_table=rng.permutation(B * TKV // PAGE).reshape(
        B, TKV // PAGE).astype(np.int32)),
    "dropout_rate": lambda c, rng: dict(dropout_rate=DROPOUT_RATE,
                                        dropout_rng=jax.random.key(DROPOUT_KEY)),
}
STATIC_EXAMPLES = {
    "soft_cap": dict(logits_soft_cap=2.0),
    "window": dict(local_window_size=(6, 3)),
    "causal": dict(is_causal=True),
    "bottom_right": dict(causal_alignment="bottom_right"),
    "value_dim": {},  # Dk != Dv: the shapes (Case)
    "gqa": {},  # two query heads per key/value head: the shapes (Case)
}
OPERAND_FEATURES = tuple(dict.fromkeys(contract.OPERAND_FLAGS.values()))
FEATURES = OPERAND_FEATURES + tuple(STATIC_EXAMPLES)
# A feature the API refuses without another one, by name at trace time.
REQUIRES = {"has_page_table": "has_kv_lengths"}
# Features the API refuses to differentiate (forward only).
FORWARD_ONLY = ("has_page_table",)


class Case:
    """A call: the features turned on, the plan (its query length) and the shapes they imply."""

    def __init__(self, features, plan):
        self.features = frozenset(features) | {REQUIRES[f] for f in features if f in REQUIRES}
        self.plan = plan
        self.q_len = Q_LEN[plan]
        self.heads, self.kv_heads = (2, 1) if "gqa" in self.features else (2, 2)
        # The one family with Dv != Dk that takes every feature in both directions.
        self.head_dim, self.value_head_dim = (128, 64) if "value_dim" in self.features else (16, 16)
        self.differentiable = not self.features & set(FORWARD_ONLY)

    def __repr__(self):
        return f"{self.plan}:{'+'.join(sorted(self.features)) or 'none'}"


def pairs(plans=PLANS):
    """Every pair of features (and every feature alone), each pair in one plan, taking the
    plans in turn so that each feature meets both."""
    combos = [(f,) for f in FEATURES] + list(itertools.combinations(FEATURES, 2))
    return [Case(c, plans[n % len(plans)]) for n, c in enumerate(combos)]


def random_cases(count, seed, size=5):
    """``count`` random combinations of ``size`` features, the plans in turn."""
    rng = random.Random(seed)
    return [Case(rng.sample(FEATURES, size), PLANS[n % len(PLANS)]) for n in range(count)]


def arguments(case, seed=0):
    """(q, k, v, do, g_lse, flash_attention keyword arguments, the oracle's keyword arguments,
    the contiguous k and v the oracle reads, the ALiBi distances [B, 1, Tq, Tkv] or None)."""
    rng = np.random.default_rng(seed)
    shape = (B, TKV, case.kv_heads)
    q = normal(rng, (B, case.q_len, case.heads, case.head_dim), jnp.float32)
    k = normal(rng, shape + (case.head_dim,), jnp.float32)
    v = normal(rng, shape + (case.value_head_dim,), jnp.float32)
    do = normal(rng, (B, case.q_len, case.heads, case.value_head_dim), jnp.float32)
    g = normal(rng, (B, case.heads, case.q_len), jnp.float32)
    kw = {}
    for feature in FEATURES:
        if feature in case.features:
            example = OPERAND_EXAMPLES.get(feature)
            kw.update(example(case, rng) if example else STATIC_EXAMPLES[feature])
    want = {n: x for n, x in kw.items()
            if n not in ("alibi_slopes", "page_table", "dropout_rng")}
    if "dropout_rng" in kw:
        want["dropout_mask"] = np.asarray(dropout_mask(
            kw["dropout_rng"], (B, case.heads, case.q_len, TKV), kw["dropout_rate"]))
    dist = None
    if "alibi_slopes" in kw:  # the oracle takes ALiBi as its bias term, over the full scores
        term, dist = alibi_bias(kw["alibi_slopes"], B, case.q_len, TKV, **kw)
        want["bias"] = term + np.asarray(kw.get("bias", 0.0))
    k_api, v_api = k, v
    if "page_table" in kw:  # page table[b, p] holds keys p * PAGE ... of batch row b
        order = np.argsort(kw["page_table"].reshape(-1))
        k_api, v_api = (x.reshape((B * TKV // PAGE, PAGE) + x.shape[2:])[order] for x in (k, v))
    return q, k_api, v_api, do, g, kw, want, (k, v), dist


def run(case, implementation, seed=0):
    """flash_attention's o, lse and, when the case is differentiable, the VJP at (do, g_lse)
    with respect to q, k, v and each differentiable operand, as a dict, and the oracle's."""
    q, k, v, do, g, kw, want_kw, (k_oracle, v_oracle), dist = arguments(case, seed)
    diff = {n: kw.pop(n) for n in ("bias", "sinks", "alibi_slopes") if n in kw}

    def f(q, k, v, diff):
        return flash_attention(q, k, v, implementation=implementation, return_lse=True,
                               **diff, **kw)

    want = dict(zip(("o", "lse"), oracle.attention(q, k_oracle, v_oracle, **want_kw)))
    if not case.differentiable:
        return dict(zip(("o", "lse"), jax.jit(f)(q, k, v, diff))), want
    (o, lse), vjp = jax.vjp(jax.jit(f), q, k, v, diff)
    dq, dk, dv, ddiff = vjp((do, g))
    got = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv, **{"d" + n: x for n, x in ddiff.items()})
    want.update(oracle.gradients(q, k_oracle, v_oracle, do, g, **want_kw))
    if dist is not None:  # d/d slope[b, n] of -slope[b, n] |i + off - j| summed over (i, j)
        want["dalibi_slopes"] = (want["dbias"] * dist).sum(axis=(2, 3))
        if "bias" in diff:  # the oracle's dbias is over the full scores: sum to the bias's shape
            axes = tuple(n for n, size in enumerate(diff["bias"].shape) if size == 1)
            want["dbias"] = want["dbias"].sum(axis=axes, keepdims=True)
        else:
            del want["dbias"]
    return got, want


# The float32 tolerance each output is judged by (docs/testing.md#tolerances).
_KIND = {"dalibi_slopes": "dbias"}


def assert_matches(got, want, case):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name in got:
        tolerance.assert_matches_oracle(f"{case} {name}", got[name], want[name],
                                        kind=_KIND.get(name, name))
