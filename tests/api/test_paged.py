"""A paged KV cache (docs/design.md#paged-kv-cache) against the float64 oracle on the same cache
gathered into contiguous form (in NumPy, here): shuffled page order, pages shared by two
sequences, NaN in unreferenced pages and past each sequence's length, garbage (out-of-range
numbers) in the table entries past a sequence's last page, lengths 0 and partial last pages,
GQA, decode and prefill shapes. Forward only: differentiating raises. The fused kernels read
the pages in place (the emulator, below: the vector and tiled decode and the tiled forward, at
page sizes smaller than, equal to and larger than their key blocks); a page size they do not take
is refused by name with an explicit fused implementation and runs on xla with
implementation=None.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from api_helpers import needs_emulator, normal
from jax_flash_metal import flash_attention, implementations, reference_attention
from jax_flash_metal.lowering import dispatch
from paged_helpers import DK, H, check, paged_cache


CASES = [  # (q_len, lengths, page_size, max_pages, keyword arguments)
    (1, [0, 5, 13], 4, 4, dict()),  # decode: an empty sequence, partial last pages
    (1, [8, 8, 16], 8, 3, dict(causal_alignment="bottom_right", is_causal=True)),  # whole pages
    (5, [7, 2, 12], 4, 3, dict(is_causal=True, causal_alignment="bottom_right")),  # prefill
    (6, [11, 0, 9], 2, 6, dict(query_seq_lengths=np.array([6, 3, 4]), local_window_size=(3, 0),
                               causal_alignment="bottom_right")),
]


@pytest.mark.parametrize("q_len,lengths,page_size,max_pages,kw", CASES,
                         ids=["decode", "decode-whole-pages", "prefill", "prefill-window"])
def test_paged_equals_the_gathered_cache(blocks, q_len, lengths, page_size, max_pages, kw):
    cache = paged_cache(1, lengths, page_size, max_pages)
    q = normal(np.random.default_rng(2), (3, q_len, H, DK), jnp.float32)
    o = check(q, cache, np.array(lengths), **kw)
    assert np.all(np.asarray(o)[0] == 0) or lengths[0] > 0  # an empty sequence outputs 0


def test_paged_with_every_feature(blocks):
    """Dv != Dk, ALiBi, bias, mask, segment ids, soft cap and sinks on a paged cache."""
    lengths = np.array([9, 4, 12])
    cache = paged_cache(3, lengths, 4, 3, dv=8)
    rng = np.random.default_rng(4)
    q = normal(rng, (3, 4, H, DK), jnp.float32)
    check(q, cache, lengths, alibi_slopes=rng.random(H).astype(np.float32),
          bias=np.asarray(normal(rng, (3, 1, 4, 12), jnp.float32)),
          mask=rng.random((1, H, 4, 12)) > 0.2,
          query_segment_ids=np.ones((3, 4), np.int32),
          key_value_segment_ids=rng.integers(0, 2, (3, 12)).astype(np.int32),
          logits_soft_cap=5.0, sinks=np.asarray(normal(rng, (H,), jnp.float32)),
          is_causal=True, causal_alignment="bottom_right")


def test_paged_half_precision():
    lengths = np.array([5, 9, 1])
    cache = paged_cache(5, lengths, 4, 3, dtype=jnp.bfloat16)
    q = normal(np.random.default_rng(6), (3, 2, H, DK), jnp.bfloat16)
    check(q, cache, lengths, is_causal=True, causal_alignment="bottom_right")


def test_paged_under_jit_and_vmap():
    """Traced lengths and table; vmap over queries (shared pages) and over whole caches."""
    lengths = np.array([5, 9, 1])
    k_pages, v_pages, table, k, v = paged_cache(7, lengths, 4, 3)
    qs = normal(np.random.default_rng(8), (2, 3, 1, H, DK), jnp.float32)

    def paged(q, k_pages, v_pages, table, lengths):
        return flash_attention(q, k_pages, v_pages, page_table=table,
                               key_value_seq_lengths=lengths)

    def contiguous(q, k, v):
        return reference_attention(q, k, v, key_value_seq_lengths=lengths)

    want = jax.vmap(contiguous, (0, None, None))(qs, k, v)
    got = jax.jit(jax.vmap(paged, (0, None, None, None, None)))(qs, k_pages, v_pages, table,
                                                                 lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    stack = lambda x: jnp.stack([x, x])  # noqa: E731
    got = jax.vmap(paged)(qs, stack(k_pages), stack(v_pages), stack(table), stack(lengths))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_paged_is_forward_only():
    """jax.grad through a paged call raises, naming page_table; reference_attention gathers
    and differentiates."""
    lengths = np.array([5, 9, 1])
    k_pages, v_pages, table, _, _ = paged_cache(9, lengths, 4, 3)
    q = normal(np.random.default_rng(10), (3, 1, H, DK), jnp.float32)
    with pytest.raises(TypeError, match="page_table .* is forward only"):
        jax.grad(lambda q: flash_attention(q, k_pages, v_pages, page_table=table,
                                           key_value_seq_lengths=lengths).sum())(q)
    clean = jnp.nan_to_num(k_pages)
    dq = jax.grad(lambda q: reference_attention(q, clean, clean, page_table=table,
                                                key_value_seq_lengths=lengths).sum())(q)
    assert np.isfinite(np.asarray(dq)).all()


FUSED_CASES = [  # (q_len, lengths, page_size, max_pages, dtype, keyword arguments)
    # The vector decode (G * q_len <= 8), two splits over 208 keys, pages of 16 < its 32 keys.
    (1, [0, 37, 200], 16, 13, jnp.float32, dict()),
    (2, [33, 0, 95], 32, 3, jnp.float16, dict(is_causal=True, causal_alignment="bottom_right")),
    # The tiled decode (G * q_len = 12): key blocks of 32 over pages of 16 (two pages a block).
    (6, [40, 17, 0], 16, 4, jnp.float32, dict(is_causal=True, causal_alignment="bottom_right")),
    # The tiled forward (prefill): pages of 64 (two blocks a page), and of 16 with a window.
    (20, [130, 64, 3], 64, 3, jnp.bfloat16,
     dict(is_causal=True, causal_alignment="bottom_right")),
    (24, [50, 20, 33], 16, 4, jnp.float32,
     dict(query_seq_lengths=np.array([24, 7, 13]), local_window_size=(9, 2))),
]


@needs_emulator
@pytest.mark.parametrize("q_len,lengths,page_size,max_pages,dtype,kw", FUSED_CASES,
                         ids=["vector-decode-16", "vector-decode-32", "tiled-decode-16",
                              "prefill-64", "prefill-16-window"])
def test_fused_kernels_read_pages(q_len, lengths, page_size, max_pages, dtype, kw):
    cache = paged_cache(13, lengths, page_size, max_pages, dtype=dtype)
    q = normal(np.random.default_rng(14), (3, q_len, H, DK), dtype)
    check(q, cache, np.array(lengths), implementation="emulator", **kw)


@needs_emulator
@pytest.mark.parametrize("q_len", [1, 18], ids=["vector-decode", "prefill"])
def test_fused_paged_with_features(q_len):
    """Bias, mask, segment ids, soft cap and sinks over the logical keys of a paged cache."""
    lengths = np.array([40, 7, 29])
    cache = paged_cache(15, lengths, 16, 3)
    rng = np.random.default_rng(16)
    q = normal(rng, (3, q_len, H, DK), jnp.float32)
    check(q, cache, lengths, implementation="emulator",
          bias=np.asarray(normal(rng, (3, 1, q_len, 48), jnp.float32)),
          mask=rng.random((1, H, q_len, 48)) > 0.2,
          query_segment_ids=np.ones((3, q_len), np.int32),
          key_value_segment_ids=rng.integers(0, 2, (3, 48)).astype(np.int32),
          logits_soft_cap=5.0, sinks=np.asarray(normal(rng, (H,), jnp.float32)),
          is_causal=True, causal_alignment="bottom_right")


def _has_counting():
    if "emulator" not in implementations.available():
        return False
    from jax_flash_metal import _ext
    return _ext.emulator.has_counting_variant()


@pytest.mark.skipif(not _has_counting(), reason="needs the emulator's counting build")
@pytest.mark.host
def test_paged_decode_reads_the_contiguous_caches_bytes():
    """Exact device bytes read by the paged forward's kernels (vector decode, pages in
    shuffled order) are within 1.02x of the same call's on the contiguous cache: K and V are
    read in place, the table entries are the only extra bytes."""
    from jax_flash_metal import profile
    from jax_flash_metal.tools import profile_model
    args = profile.make_parser().parse_args(
        ["--q-len", "1", "--kv-len", "512", "--heads", "4", "--kv-heads", "2",
         "--kv-lengths", "512"])
    problem = profile_model.Problem(args, "float16", 64, False)

    def read(problem):
        return sum(r["device_bytes_read"]
                   for r in profile_model.profile_records(problem, ("forward",), ["M1"]))

    contiguous = read(problem)
    for page_size in (32, 128):
        assert contiguous < read(problem.paged(page_size)) <= 1.02 * contiguous


@needs_emulator
def test_page_size_rule_agrees_with_the_kernels():
    """The Python rule that routes a paged call (dispatch.fused_page_size) is the one the
    kernels' header states and the FFI handler checks (jfm_page_size_supported)."""
    from jax_flash_metal import _ext
    sizes = range(-1, 1100)
    assert ([dispatch.fused_page_size(n) for n in sizes]
            == [_ext.testing.page_size_supported(n) for n in sizes])
    assert dispatch.fused_page_size(16) and not dispatch.fused_page_size(24)


@needs_emulator
def test_fused_implementations_refuse_other_page_sizes(monkeypatch):
    """A page size the kernels do not take (4: not a power of two >= 16): an explicit fused
    implementation raises naming page_table and the size; implementation=None runs xla."""
    lengths = np.array([5, 9, 1])
    cache = paged_cache(11, lengths, 4, 3)
    q = normal(np.random.default_rng(12), (3, 1, H, DK), jnp.float32)
    with pytest.raises(NotImplementedError,
                       match="does not implement page_table with page_size 4"):
        check(q, cache, lengths, implementation="emulator")
    monkeypatch.delenv("JAX_FLASH_METAL_IMPLEMENTATION", raising=False)
    monkeypatch.setattr(dispatch, "_PREFERENCE", ("emulator",))
    check(q, cache, lengths)


@pytest.mark.parametrize("q_len", [1, 64], ids=["decode", "tiled"])
@pytest.mark.parametrize("band", [{}, dict(is_causal=True, local_window_size=(200, 0),
                                           causal_alignment="bottom_right")],
                         ids=["full", "causal-window"])
def test_paged_cache_with_alibi_slopes(implementation, q_len, band):
    """Pages of 256 float16 keys with per-row ALiBi slopes, as a user passes them: the slopes
    reach their own operand slot (not the page table's) on every implementation, for the decode
    and the tiled forward."""
    k = jax.random.normal(jax.random.key(0), (6, 256, 6, 32), jnp.float16)
    table = np.array([[0, 2, 4], [1, 3, 5]], np.int32)
    q = jax.random.normal(jax.random.key(1), (2, q_len, 6, 32), jnp.float16)
    contiguous = k[table].reshape(2, 3 * 256, 6, 32)
    check(q, (k, k, table, contiguous, contiguous), np.array([700, 300]),
          alibi_slopes=np.full((2, 6), 0.1, np.float32), implementation=implementation, **band)
