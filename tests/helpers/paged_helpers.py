"""A paged KV cache for the tests: pages handed out in shuffled order with NaN and garbage where
attention must not read, the same cache gathered in NumPy, and the comparison of a paged call
with the float64 oracle on the gathered cache."""

import jax.numpy as jnp
import numpy as np

import oracle
import tolerance
from api_helpers import alibi_bias
from jax_flash_metal import flash_attention

H, HKV, DK = 4, 2, 16


def paged_cache(seed, lengths, page_size, max_pages, dv=DK, dtype=jnp.float32):
    """(key pages, value pages, page table, contiguous key, contiguous value).

    Pages are handed out in shuffled order; sequence 1 shares sequence 0's first page (a common
    prompt prefix) when both use one; pages no sequence uses, and the keys of a used page past
    its sequence's length, are NaN; table entries past a sequence's last page are garbage
    (negative or past the pool). The contiguous cache is the gather of the table in NumPy
    (zeros past each last page, which attention never reads)."""
    rng = np.random.default_rng(seed)
    needed = [-(-int(n) // page_size) for n in lengths]
    num_pages = sum(needed) + 3  # 3 pages nobody uses
    order = rng.permutation(num_pages)
    table = rng.choice([-7, num_pages, 10**6], size=(len(lengths), max_pages)).astype(np.int32)
    k_pages = np.full((num_pages, page_size, HKV, DK), np.nan, np.float32)
    v_pages = np.full((num_pages, page_size, HKV, dv), np.nan, np.float32)
    used = iter(order)
    for b, n in enumerate(needed):
        for p in range(n):
            table[b, p] = next(used)
            if b == 1 and p == 0 and needed[0] > 0:
                table[b, p] = table[0, 0]  # shared prefix page
    k_contig = np.zeros((len(lengths), max_pages * page_size, HKV, DK), np.float32)
    v_contig = np.zeros((len(lengths), max_pages * page_size, HKV, dv), np.float32)
    for b, n in enumerate(needed):
        for p in range(n):
            page = table[b, p]
            if np.isnan(k_pages[page]).all():  # first use: fill the page's keys in use
                fill = min(page_size, int(lengths[b]) - p * page_size)
                k_pages[page, :fill] = rng.standard_normal((fill, HKV, DK))
                v_pages[page, :fill] = rng.standard_normal((fill, HKV, dv))
            k_contig[b, p * page_size:(p + 1) * page_size] = k_pages[page]
            v_contig[b, p * page_size:(p + 1) * page_size] = v_pages[page]
    as_dtype = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (as_dtype(k_pages), as_dtype(v_pages), table, as_dtype(k_contig), as_dtype(v_contig))


def check(q, cache, lengths, **kw):
    """flash_attention on the pages equals the oracle on the gathered cache (o and lse)."""
    k_pages, v_pages, table, k, v = cache
    o, lse = flash_attention(q, k_pages, v_pages, page_table=table, key_value_seq_lengths=lengths,
                             return_lse=True, **kw)
    oracle_kw = {n: x for n, x in kw.items() if n not in ("implementation", "alibi_slopes")}
    if "alibi_slopes" in kw:
        term, _ = alibi_bias(kw["alibi_slopes"], q.shape[0], q.shape[1], k.shape[1],
                             key_value_seq_lengths=lengths, **kw)
        oracle_kw["bias"] = term + (0.0 if "bias" not in kw else np.asarray(kw["bias"]))
    want_o, want_lse = oracle.attention(q, k, v, key_value_seq_lengths=lengths, **oracle_kw)
    base = None
    if np.dtype(q.dtype) != np.float32:
        base = tolerance.baseline(q, k, v, jnp.zeros(o.shape, q.dtype),
                                  key_value_seq_lengths=lengths, **oracle_kw)
    tolerance.assert_matches_oracle("o", o, want_o, None if base is None else base["o"])
    tolerance.assert_matches_oracle("lse", lse, want_lse, None if base is None else base["lse"])
    return o
