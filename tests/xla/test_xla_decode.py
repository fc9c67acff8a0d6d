"""The xla implementation's short-query forward (``xla/decode.py``: split-KV over the cache in
place) against the float64 oracle: q_len 1 and 4, per-batch lengths (0 included), GQA, both
alignments, windows, soft cap, sinks, ALiBi, float32 / float16 / bfloat16, spans that overlap
at the cache's end, a paged cache, and non-finite entries where no visible pair reads them.
The backward is the block loops' (from the residuals this forward writes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tolerance
from api_helpers import alibi_bias, make_inputs, normal, run
from jax_flash_metal import flash_attention
from jax_flash_metal.xla import decode as xla_decode
from jax_flash_metal.xla import schedule as xla_schedule
from paged_helpers import check, paged_cache

# (batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, keyword arguments); every kv_len is
# past the cpu schedule's dense tile (256), so the decode path runs.
CASES = [
    (2, 1, 700, 8, 2, 32, jnp.bfloat16, dict(key_value_seq_lengths=np.array([700, 3]))),
    (2, 4, 700, 4, 1, 16, jnp.float32,
     dict(is_causal=True, causal_alignment="bottom_right",
          key_value_seq_lengths=np.array([0, 650]), query_seq_lengths=np.array([4, 2]))),
    (1, 4, 600, 4, 4, 16, jnp.float16, dict(is_causal=True, local_window_size=(50, 0))),
    (1, 3, 800, 6, 3, 8, jnp.float32,
     dict(local_window_size=(100, 10), causal_alignment="bottom_right", logits_soft_cap=3.0,
          sinks=np.array([0.5, -1.0, 2.0, 0.0, 1.0, -3.0], np.float32))),
    (2, 1, 1000, 4, 2, 16, jnp.bfloat16,
     dict(key_value_seq_lengths=np.array([1000, 517]), scale=0.3,
          alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32))),
]


@pytest.fixture(params=[8192, 256], ids=["one-span", "spans-256-row-groups-1"])
def span(request, monkeypatch):
    """The decode's span: the default (one span here, the fast path's batch rows in one group)
    or 256 keys (several spans, the last one overlapping its predecessor, and the fast path's
    batch rows one group each); every platform's schedule with the split-KV decode and a
    dense tile of at most 256 keys, so the decode path runs on cpu and on an accelerator."""
    monkeypatch.setattr(xla_decode, "SPAN", request.param)
    if request.param == 256:
        monkeypatch.setattr(xla_decode, "SCORE_BYTES", 1)
    jax.clear_caches()
    for name, schedule in list(xla_schedule.SCHEDULES.items()):
        monkeypatch.setitem(xla_schedule.SCHEDULES, name,
                            schedule._replace(dense_max_len=256, split_kv_decode=True))
    yield request.param
    jax.clear_caches()


@pytest.mark.parametrize("case", CASES, ids=[f"case{n}" for n in range(len(CASES))])
def test_decode_matches_the_oracle(span, case):
    batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, kw = case
    q, k, v, do, g = make_inputs(kv_len + q_len, batch, q_len, kv_len, heads, kv_heads,
                                 head_dim, dtype)
    kw = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    got = run(q, k, v, do, g, **kw)
    oracle_kw = {n: x for n, x in kw.items() if n != "alibi_slopes"}
    if "alibi_slopes" in kw:
        oracle_kw["bias"], _ = alibi_bias(kw["alibi_slopes"], batch, q_len, kv_len, **kw)
    names = ("o", "lse", "dq", "dk", "dv") + (("dsinks",) if "sinks" in kw else ())
    tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=names, **oracle_kw)


def test_decode_reads_a_paged_cache(span):
    """Pages in shuffled order, a shared page, NaN in unused pages and past each length,
    garbage table entries past the last page (``test_paged.paged_cache``)."""
    lengths = np.array([300, 0, 517])
    cache = paged_cache(11, lengths, 16, 40)
    for q_len, kw in ((1, {}), (4, dict(is_causal=True, causal_alignment="bottom_right"))):
        q = normal(np.random.default_rng(q_len), (3, q_len, 4, 16), jnp.float32)
        check(q, cache, lengths, implementation="xla", **kw)


def test_decode_nonfinite_values_reach_only_the_rows_that_see_them(span):
    """A NaN value at a key that only the last query row sees (bottom-right causal) makes only
    that row NaN; NaN keys and values past a length are never weighed."""
    q, k, v, _, _ = make_inputs(3, 2, 4, 600, 4, 2, 16, jnp.float32)
    lengths = jnp.array([600, 400])
    v = v.at[0, 599, 0, 3].set(jnp.nan)  # key 599 of batch 0: seen by row 3 only
    k = k.at[1, 450:].set(jnp.nan)
    v = v.at[1, 450:].set(jnp.inf)
    o = np.asarray(flash_attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                   key_value_seq_lengths=lengths, implementation="xla"))
    nan = np.isnan(o)
    assert nan[0, 3, :2, 3].all() and nan.sum() == 2  # row 3, both heads of kv head 0, entry 3
    assert np.isfinite(o[1]).all()
