"""Every attention kernel the host can launch under the emulator's sanitizer (racecheck,
initcheck with the output write contract, memcheck; docs/testing.md, "Sanitizer coverage"):
every family in f32, f16 and bf16 in each of its tile variants, forward and backward (joint and
split); every function-constant set the host can pick (tests/helpers/constant_sets.py); the
decode (both passes and the combine) in each pass-1 variant; every score feature, dropout and
paging; on small shapes with partial tiles, lengths and fully masked rows. A finding fails the
call (an FFI error naming both accesses and their shader lines); the results must still match
the float64 oracle, as the sanitizer poisons every output before the call.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tolerance
from api_helpers import DTYPES, check_against_oracle, make_inputs, needs_emulator, normal
from api_helpers import run as run_with_gradients
from ffi_targets import submission_budget
from jax_flash_metal.core import variants

ext = pytest.importorskip("jax_flash_metal._ext")
import kernel_harness as kh  # noqa: E402
from constant_sets import DECODE, PREFILL, label, run_constant_set  # noqa: E402
from jax_flash_metal import flash_attention  # noqa: E402

pytestmark = [
    needs_emulator,
    pytest.mark.skipif(not ext.emulator.has_counting_variant(),
                       reason="the sanitizer runs the counting variant: build with "
                              "JFM_EMULATOR_COUNTING=ON"),
]


@pytest.fixture(autouse=True)
def sanitizer():
    before = ext.emulator_sanitizer()
    ext.set_emulator_sanitizer("first")
    try:
        yield
    finally:
        ext.set_emulator_sanitizer(before)


# Every kernel instantiation of the prefill path: (dtype, Dk, Dv, tile variant).
KERNELS = [pytest.param(dtype, dk, dv, variant, id=f"{dtype}-d{dk}_v{dv}-var{variant}")
           for dtype, dk, dv in ext.kernel_families()
           for variant in kh.variants_of(dtype, ext.tile_head_dim(dk, dv))]


@pytest.mark.parametrize("dtype,dk,dv,variant", KERNELS)
def test_sanitizer_every_family_dtype_and_variant(monkeypatch, dtype, dk, dv, variant):
    """Forward and backward of one kernel instantiation: batch 2 with lengths cutting both
    directions, bottom-right causal with more queries than keys (the first rows of the first
    batch element see no key), partial tiles of at least two blocks in both directions,
    grouped-query heads; the odd variants add a local window."""
    monkeypatch.setenv(variants.ENV, str(variant))
    q_len, kv_len = 45, 37
    q, k, v, do, g = make_inputs(variant, 2, q_len, kv_len, 2, 1, dk, DTYPES[dtype])
    if dv != dk:
        rng = np.random.default_rng(variant + 1)
        v = normal(rng, (2, kv_len, 1, dv), DTYPES[dtype])
        do = normal(rng, (2, q_len, 2, dv), DTYPES[dtype])
    kw = dict(is_causal=True, causal_alignment="bottom_right",
              query_seq_lengths=np.array([q_len, 7], np.int32),
              key_value_seq_lengths=np.array([kv_len, 11], np.int32))
    if variant % 2:
        kw["local_window_size"] = (6, 2)
    check_against_oracle(q, k, v, do, g, implementation="emulator", **kw)


# 20 queries: the tiled forward (past the decode's JFM_DECODE_MAX_Q_LEN of 16) and the
# backward; one query: the decode's vector pass 1; 8 queries: its tiled pass 1. Both decodes end
# with the combine.
CONSTANT_SETS = [pytest.param(c, q_len, id=f"q{q_len}-{label(c)}")
                 for sets, q_lens in ((PREFILL, (20,)), (DECODE, (1, 8))) for q_len in q_lens
                 for c in sets]


@pytest.mark.parametrize("constants,q_len", CONSTANT_SETS)
def test_sanitizer_every_constant_set(monkeypatch, constants, q_len):
    """Each function-constant set the host can pick, in the call that uses exactly its features.
    The tile variant alternates with the parity of the set's size, so each constant alone, and
    each pair of constants, runs in both variants (a set and its one-larger supersets)."""
    monkeypatch.setenv(variants.ENV, str(bin(constants).count("1") % 2))
    run_constant_set(constants, q_len)


@pytest.mark.parametrize("q_len", [45, 8], ids=["prefill", "decode"])
def test_sanitizer_plan_cut_into_one_threadgroup_submissions(q_len):
    """Under a budget of one threadgroup per submission, every stage is cut into chunks across
    many command buffers: each output is still written once in all (the write contract), and
    the chunks' dispatches of one stage and the stages' barriers order every access."""
    q, k, v, do, g = make_inputs(10, 2, q_len, 37, 4, 2, 16, jnp.float32)
    kw = dict(is_causal=True, causal_alignment="bottom_right",
              key_value_seq_lengths=np.array([37, 20], np.int32))
    with submission_budget(1e-12):
        check_against_oracle(q, k, v, do, g, implementation="emulator", **kw)


def test_sanitizer_every_score_feature_forward_and_backward():
    rng = np.random.default_rng(4)
    q, k, v, do, g = make_inputs(4, 2, 17, 29, 4, 2, 16, jnp.float32)
    ids_q = jnp.asarray(np.sort(rng.integers(0, 3, (2, 17)), 1), jnp.int32)
    ids_k = jnp.asarray(np.sort(rng.integers(0, 3, (2, 29)), 1), jnp.int32)
    out = run_with_gradients(
        q, k, v, do, g, implementation="emulator", is_causal=True,
        causal_alignment="bottom_right",
        bias=normal(rng, (2, 4, 17, 29), jnp.float32),
        mask=jnp.asarray(rng.random((2, 4, 17, 29)) < 0.7),
        query_segment_ids=ids_q, key_value_segment_ids=ids_k, logits_soft_cap=3.0,
        sinks=normal(rng, (4,), jnp.float32), alibi_slopes=jnp.asarray(
            rng.uniform(0.1, 0.5, (4,)), jnp.float32))
    # The sanitizer's verdict is the point (the feature matrices check the values); no output
    # may hold the poison (NaN) either.
    for name, x in out.items():
        if name != "lse":
            assert np.isfinite(np.asarray(x, np.float32)).all(), name


# (query rows, heads, KV heads, dtype, variant): the vector pass 1 (a few rows per KV head) and
# the tiled one (decode_partial) in each variant, each followed by the combine.
DECODES = [(1, 8, 1, "f32", 0), (1, 2, 2, "f16", 0), (8, 4, 1, "bf16", 0), (8, 4, 1, "f32", 1),
           (5, 4, 2, "f16", 1)]


@pytest.mark.parametrize("q_len,heads,kv_heads,dtype,variant", DECODES,
                         ids=[f"q{c[0]}-h{c[1]}_{c[2]}-{c[3]}-var{c[4]}" for c in DECODES])
def test_sanitizer_decode_both_passes_and_the_combine(monkeypatch, q_len, heads, kv_heads,
                                                      dtype, variant):
    # A few queries against a long cache: the split-KV decode (pass 1 per split, then the
    # combine); the second batch element's shorter length leaves the later splits few or no keys.
    monkeypatch.setenv(variants.ENV, str(variant))
    dtype = DTYPES[dtype]
    rng = np.random.default_rng(5)
    q = normal(rng, (2, q_len, heads, 64), dtype)
    k = normal(rng, (2, 517, kv_heads, 64), dtype)
    v = normal(rng, (2, 517, kv_heads, 64), dtype)
    lengths = np.array([517, 200], np.int32)
    o, lse = flash_attention(q, k, v, key_value_seq_lengths=lengths, implementation="emulator",
                             return_lse=True)
    do = jnp.zeros(q.shape, q.dtype)
    tolerance.assert_all_match_oracle(dict(o=o, lse=lse), q, k, v, do, names=("o", "lse"),
                                      key_value_seq_lengths=lengths)


def test_sanitizer_dropout_forward_and_backward():
    q, k, v, do, g = make_inputs(6, 1, 23, 31, 2, 1, 32, jnp.float32)
    out = run_with_gradients(q, k, v, do, g, implementation="emulator", dropout_rate=0.25,
                             dropout_rng=jax.random.key(3), is_causal=True)
    assert all(np.isfinite(np.asarray(x)).all() for n, x in out.items() if n != "lse")


def test_sanitizer_paged_cache():
    rng = np.random.default_rng(7)
    page, pages = 16, 4
    q = normal(rng, (2, 5, 4, 32), jnp.float32)
    k_pages = normal(rng, (9, page, 2, 32), jnp.float32)
    v_pages = normal(rng, (9, page, 2, 32), jnp.float32)
    table = jnp.asarray(rng.permutation(9)[:8].reshape(2, pages), jnp.int32)
    lengths = np.array([50, 17], np.int32)
    o, lse = flash_attention(q, k_pages, v_pages, page_table=table, key_value_seq_lengths=lengths,
                             is_causal=True, causal_alignment="bottom_right",
                             implementation="emulator", return_lse=True)
    k = np.asarray(k_pages)[np.asarray(table)].reshape(2, page * pages, 2, 32)
    v = np.asarray(v_pages)[np.asarray(table)].reshape(2, page * pages, 2, 32)
    tolerance.assert_all_match_oracle(dict(o=o, lse=lse), q, k, v, jnp.zeros(q.shape),
                                      names=("o", "lse"), key_value_seq_lengths=lengths,
                                      is_causal=True, causal_alignment="bottom_right")


def test_memcheck_sees_the_attention_kernels_accesses():
    # The forward kernel bound to an O one query row short, as a host sizing bug would: the last
    # row's store lands past the buffer (where Metal may have mapped another one) and is reported
    # with the kernel's shader line; the declared outputs start poisoned.
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 19, 2, 16)).astype(np.float32) for _ in range(3))
    lse, row_max, log_sum = (np.zeros((1, 2, 19), np.float32) for _ in range(3))
    bound = {kh.Q: q, kh.K: k, kh.V: v, kh.Q_LENGTHS: kh._PLACEHOLDER,
             kh.KV_LENGTHS: kh._PLACEHOLDER, kh.O: np.zeros((1, 19, 2, 16), np.float32)[:, :18]
             .copy(), kh.LSE: lse, kh.ROW_MAX: row_max, kh.LOG_SUM: log_sum,
             kh.PARAMS: kh.pack_params(q.shape, k.shape)}
    for index in (kh.Q_SEGMENT_IDS, kh.KV_SEGMENT_IDS, kh.BIAS, kh.MASK, kh.SINKS, kh.DROPOUT,
                  kh.PAGE_TABLE, kh.ALIBI_SLOPES):
        bound[index] = kh._PLACEHOLDER
    shape = kh.tile_shape("fwd", "f32", 16)
    kernel = kh.kernel_name("fwd", np.float32, 16)
    run = lambda: ext.emulator.run(  # noqa: E731
        kernel, bound, (-(-19 // shape["rows"]), 2, 1), (shape["threads"], 1, 1),
        sanitize="first", outputs=[kh.O, kh.LSE, kh.ROW_MAX, kh.LOG_SUM])
    with pytest.raises(RuntimeError) as e:
        run()
    report = str(e.value)
    assert (f"memcheck in kernel {kernel} with function constants all true (unspecialised): "
            "write of") in report, report
    assert "[[buffer(3)]] 'o' element" in report and "outside its buffer" in report
    if kh.SANITIZER_LINES:
        assert "at shaders/flash_attention_" in report  # the store's line in the kernel source
    # Bound at its size, the same launch runs clean.
    bound[kh.O] = np.zeros((1, 19, 2, 16), np.float32)
    run()


@pytest.mark.parametrize("head_dim,q_len", [(16, 19), (256, 9), (64, 1)],
                         ids=["fwd", "fwd_one_kv_buffer", "decode"])
def test_racecheck_nonfinite_v_flag_has_one_writer_per_simdgroup(head_dim, q_len):
    # Regression: every thread that staged a non-finite V element stored the block's index to one
    # shared threadgroup word (a write-write race the schedules could not expose, as all
    # threads store the same value). The rows that see the NaN must still output NaN exactly
    # where the oracle does.
    rng = np.random.default_rng(9)
    q = normal(rng, (1, q_len, 4, head_dim), jnp.float32)
    k = normal(rng, (1, 40, 2, head_dim), jnp.float32)
    v = np.asarray(normal(rng, (1, 40, 2, head_dim), jnp.float32)).copy()
    v[0, 7, 1, 3] = np.nan
    v[0, 30, 0, 0] = np.inf
    v = jnp.asarray(v)
    kw = dict(is_causal=True, causal_alignment="bottom_right")
    o, lse = flash_attention(q, k, v, implementation="emulator", return_lse=True, **kw)
    tolerance.assert_all_match_oracle(dict(o=o, lse=lse), q, k, v, jnp.zeros(q.shape),
                                      names=("o", "lse"), **kw)
    assert np.isnan(np.asarray(o)).any()
