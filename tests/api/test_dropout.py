"""Attention dropout (docs/design.md#dropout): the keep mask ``dropout_mask`` against Philox's
known answers, its construction and statistics, and the kernels' generator
(shaders/flash_attention_dropout.h) word for word against it; ``flash_attention`` with dropout
on every implementation against the float64 oracle given that mask (every feature, three rates,
three dtypes, forward and gradients), the mask read back bit for bit through O and dV on every
implementation and xla schedule, both primitives with rows and keys at global positions (a
slice of a split sequence), finite differences, vmap with batched keys, keys as traced
operands, and the errors.

The non-slow set holds every kind of check once; the exhaustive matrices (each feature alone on
both xla schedules, every rate with every dtype) are ``slow``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import tolerance
from api_helpers import make_inputs, needs_emulator, needs_test_kernels, run, use_xla_schedule
from jax_flash_metal import dropout_mask, flash_attention, reference_attention
from jax_flash_metal.core import dropout, mulhi
from jax_flash_metal.xla import schedule as xla_schedule

B, TQ, TK, H, HKV, D = 2, 9, 11, 4, 2, 16
KEY = jax.random.key(7)

# Random123's known-answer vectors for Philox-4x32-10 (its kat_vectors file): counter words,
# key words, output words.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.fixture
def ext():
    """The compiled extension (emulator, kernel plans); the test skips without it."""
    return pytest.importorskip("jax_flash_metal._ext")


def test_philox_known_answers():
    """dropout.philox4x32 gives Random123's answers."""
    for counter, key, want in KNOWN_ANSWERS:
        got = dropout.philox4x32([np.uint32(c) for c in counter], [np.uint32(k) for k in key])
        assert [int(x) for x in got] == list(want)


@needs_test_kernels
def test_the_kernels_generator(ext):
    """The kernels' jfm_philox4x32, run on the emulator, gives Random123's answers too and
    equals dropout.philox4x32 word for word on random counters and keys (the mask's counters
    (j // 4, i, n, b) among them)."""
    rng = np.random.default_rng(0)
    counters = rng.integers(0, 2 ** 32, (64, 4), dtype=np.uint32)
    keys = rng.integers(0, 2 ** 32, (64, 2), dtype=np.uint32)
    counters[:3] = [c for c, _, _ in KNOWN_ANSWERS]
    keys[:3] = [k for _, k, _ in KNOWN_ANSWERS]
    counters[3:6] = [(0, 5, 3, 1), (2, 0, 0, 0), (7, 1023, 31, 7)]
    words = np.zeros((64, 4), np.uint32)
    ext.emulator.run("emu_philox", {0: counters, 1: keys, 2: words}, (2, 1, 1), (32, 1, 1))
    want = np.stack([np.asarray(w) for w in dropout.philox4x32(list(counters.T), list(keys.T))],
                    axis=1)
    np.testing.assert_array_equal(words, want)
    np.testing.assert_array_equal(words[:3], [w for _, _, w in KNOWN_ANSWERS])


@needs_test_kernels
def test_mulhi_in_the_emulator(ext):
    """MSL's mulhi (the high half of the double-width product) for uint and int, against
    Python's integers."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2 ** 32, 64, dtype=np.uint32)
    y = rng.integers(0, 2 ** 32, 64, dtype=np.uint32)
    x[:4], y[:4] = [0, 0xFFFFFFFF, 0x80000000, 0xD2511F53], [5, 0xFFFFFFFF, 0x80000000, 1]
    high, signed_high = np.zeros(64, np.uint32), np.zeros(64, np.int32)
    ext.emulator.run("emu_mulhi", {0: x, 1: y, 2: high, 3: signed_high}, (1, 1, 1),
                      (64, 1, 1))
    assert [int(h) for h in high] == [(int(a) * int(b)) >> 32 for a, b in zip(x, y)]
    sx, sy = x.view(np.int32), y.view(np.int32)
    assert [int(h) for h in signed_high] == [(int(a) * int(b)) >> 32 for a, b in zip(sx, sy)]


@pytest.mark.parametrize("lowering", ["wide", "portable"])
def test_mulhi_high_and_low(lowering):
    """Both words of Philox's products, lowered through one 64-bit multiply (CPU, CUDA) and
    through 16-bit halves and a 32-bit multiply (other platforms), against Python's integers."""
    rng = np.random.default_rng(2)
    b = rng.integers(0, 2 ** 32, 256, dtype=np.uint32)
    b[:3] = [0, 1, 0xFFFFFFFF]
    for a in (0xD2511F53, 0xCD9E8D57, 0xFFFFFFFF, 1):
        if lowering == "wide":
            got = jax.jit(lambda b, a=a: mulhi.high_and_low(a, b))(b)
        else:
            got = jax.jit(lambda b, a=a: mulhi._portable(b, a=a))(jnp.asarray(b))
        assert [int(h) for h in np.asarray(got[0])] == [(a * int(x)) >> 32 for x in b]
        assert [int(h) for h in np.asarray(got[1])] == [(a * int(x)) % 2 ** 32 for x in b]
    rows = jax.vmap(lambda r: mulhi.high_and_low(0xD2511F53, r))(b.reshape(16, 16))
    assert [int(h) for h in np.asarray(rows[0]).ravel()] == [(0xD2511F53 * int(x)) >> 32
                                                             for x in b]


def test_mask_construction():
    """M[b, n, i, j] = word j % 4 of Philox((j // 4, i, n, b), key) >= floor(rate * 2**32),
    spelled out entry by entry; the legacy uint32 [2] key of the same data gives the same mask;
    a sub-shape's mask is the slice of a larger one."""
    rate, shape = 0.3, (2, 3, 5, 10)
    mask = np.asarray(dropout_mask(KEY, shape, rate))
    words = np.asarray(jax.random.key_data(KEY))
    assert dropout.threshold(rate) == int(rate * 2 ** 32)
    b, n, i, j = (x.astype(np.uint32) for x in np.indices(shape))
    out = np.stack([np.asarray(w) for w in dropout.philox4x32((j // 4, i, n, b), list(words))])
    word = np.take_along_axis(out, (j % 4)[None].astype(np.int64), axis=0)[0]
    np.testing.assert_array_equal(mask, word >= dropout.threshold(rate))
    np.testing.assert_array_equal(np.asarray(dropout_mask(jnp.asarray(words), shape, rate)),
                                  mask)
    larger = np.asarray(dropout_mask(KEY, (3, 4, 8, 17), rate))
    np.testing.assert_array_equal(larger[:2, :3, :5, :10], mask)


def test_keep_rate_within_four_standard_deviations():
    for rate in (0.1, 0.5, 0.9):
        mask = np.asarray(dropout_mask(KEY, (2, 4, 128, 256), rate))
        n, p = mask.size, 1.0 - rate
        assert abs(mask.sum() - n * p) <= 4 * np.sqrt(n * p * (1 - p)), rate


def test_different_keys_and_indices_give_different_masks():
    a = np.asarray(dropout_mask(jax.random.key(0), (2, 2, 16, 16), 0.5))
    b = np.asarray(dropout_mask(jax.random.key(1), (2, 2, 16, 16), 0.5))
    assert (a != b).mean() > 0.4
    assert (a[0] != a[1]).mean() > 0.4 and (a[:, 0] != a[:, 1]).mean() > 0.4
    assert np.asarray(dropout_mask(KEY, (1, 1, 4, 4), 0.0)).all()


def inputs(seed=0, dtype=jnp.float32, **kw):
    shape = dict(batch=B, q_len=TQ, kv_len=TK, heads=H, kv_heads=HKV, head_dim=D)
    shape.update(kw)
    return make_inputs(seed, *shape.values(), dtype)


def check(q, k, v, do, g, rate, rng=KEY, implementation="xla", reference=False, **kw):
    """run() with dropout against the oracle given ``dropout_mask``'s M; with ``reference``
    also reference_attention's O and LSE."""
    got = run(q, k, v, do, g, implementation=implementation, dropout_rate=rate, dropout_rng=rng,
              **kw)
    keep = np.asarray(dropout_mask(rng, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), rate))
    want = tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=tuple(got),
                                             dropout_mask=keep, dropout_rate=rate, **kw)
    if not reference:
        return got, want
    ref = reference_attention(q, k, v, dropout_rate=rate, dropout_rng=rng, return_lse=True, **kw)
    for name, x in zip(("o", "lse"), ref):
        tolerance.assert_matches_oracle(name, x, want[name],
                                        None if q.dtype == jnp.float32 else
                                        tolerance.baseline(q, k, v, do, g, dropout_mask=keep,
                                                           dropout_rate=rate, **kw)[name])
    return got, want


_RNG = np.random.default_rng(3)
FEATURES = {
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(3, 2), causal_alignment="bottom_right"),
    "lengths": dict(query_seq_lengths=np.array([9, 5]), key_value_seq_lengths=np.array([7, 11])),
    "bias": dict(bias=_RNG.standard_normal((1, H, TQ, TK)).astype(np.float32)),
    "mask": dict(mask=_RNG.random((B, 1, TQ, TK)) > 0.3),
    "segment_ids": dict(query_segment_ids=np.repeat([[1, 1, 2]], 3, 1).repeat(B, 0),
                        key_value_segment_ids=np.array([[1] * 5 + [2] * 6] * B)),
    "soft_cap": dict(logits_soft_cap=2.0),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32)),
}
# Every feature in two calls (the non-slow set); each alone is the slow matrix.
COMBINED = {
    "causal+lengths+bias+segment_ids": ("causal", "lengths", "bias", "segment_ids"),
    "window+mask+soft_cap+sinks": ("window", "mask", "soft_cap", "sinks"),
}


@pytest.mark.parametrize("combination", list(COMBINED))
def test_every_feature_against_the_oracle(implementation, combination):
    """Grouped-query heads (4 query heads, 2 KV heads) at rate 0.5 with the features of
    ``combination`` together: O, LSE, dQ, dK, dV (and dbias, dsinks); on xla also
    reference_attention."""
    kw = {}
    for feature in COMBINED[combination]:
        kw.update(FEATURES[feature])
    check(*inputs(1), 0.5, implementation=implementation,
          reference=implementation == "xla", **kw)


BLOCKS = xla_schedule.Schedule(dense_max_len=4, block_q=4, block_k=4)  # 4 rows x 4 keys


def schedules(implementation):
    """The xla implementation's two paths (one dense tile, then blocks) or the fused one's."""
    return [None, BLOCKS] if implementation == "xla" else [None]


@pytest.mark.slow
@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_alone_against_the_oracle(implementation, feature, monkeypatch):
    for schedule in schedules(implementation):
        if schedule is not None:
            use_xla_schedule(monkeypatch, schedule)
        check(*inputs(1), 0.5, implementation=implementation, **FEATURES[feature])
    jax.clear_caches()


DTYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}


@pytest.mark.parametrize("rate,dtype", [(0.1, "f32"), (0.5, "f16"), (0.9, "bf16")])
def test_rates_and_dtypes_against_the_oracle(implementation, rate, dtype):
    """Each rate and each dtype once (causal, grouped-query heads)."""
    check(*inputs(2, DTYPES[dtype]), rate, implementation=implementation, is_causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_rate_with_every_dtype(implementation, rate, dtype):
    check(*inputs(2, DTYPES[dtype]), rate, implementation=implementation, is_causal=True)


# Position maps of the dropout operand ((q_first, q_stride, k_first, k_stride), and the static
# dropout_key_groups that goes with them): unit strides from a multiple of 4 (the keys' groups
# of 4 stay whole; the xla implementation draws them four at a time, or, told nothing, one per
# key), from an even key (each kernel lane's pair of keys still shares a group) and strided from
# odd starts (one Philox call per key).
POSITION_MAPS = {"aligned": ((8, 1, 12, 1), True), "aligned-per-key": ((8, 1, 12, 1), False),
                 "even": ((5, 1, 6, 1), False), "strided": ((3, 2, 5, 3), False)}


@pytest.mark.parametrize("maps", list(POSITION_MAPS))
def test_calls_at_global_positions_against_the_oracle(implementation, maps):
    """Both primitives with the dropout operand mapping their rows and keys to global positions
    (as a slice of a split sequence passes them): O, LSE, dQ, dK and dV against the oracle given
    the whole keep mask restricted to those positions."""
    from jax_flash_metal.core import validation
    from jax_flash_metal.core.options import Options
    from jax_flash_metal.lowering.primitives import bwd_p, fwd_p
    (q_first, q_stride, k_first, k_stride), groups = POSITION_MAPS[maps]
    q, k, v, do, g = inputs(3)
    rate = 0.5
    q, k, v, operands, params = validation.check_inputs(
        q, k, v, None, None, Options(is_causal=True, dropout_rate=rate, dropout_rng=KEY,
                                     implementation=implementation))
    operands = operands._replace(dropout=dropout.at_positions(
        operands.dropout, q_first, q_stride, k_first, k_stride))
    params = params._replace(dropout_key_groups=groups)
    rows, keys = q_first + q_stride * np.arange(TQ), k_first + k_stride * np.arange(TK)
    whole = np.asarray(dropout_mask(KEY, (B, H, rows[-1] + 1, keys[-1] + 1), rate))
    keep = whole[:, :, rows][:, :, :, keys]

    def forward_and_backward(q, k, v, do, g, operands):
        o, lse, row_max, log_sum = fwd_p.bind(q, k, v, *operands.present(), **params._asdict())
        grads = bwd_p.bind(q, k, v, o, lse, row_max, log_sum, do, g, *operands.present(),
                           bias_grad=False, alibi_grad=False, **params._asdict())
        return dict(o=o, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])

    got = jax.jit(forward_and_backward)(q, k, v, do, g, operands)
    tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=tuple(got), is_causal=True,
                                      dropout_mask=keep, dropout_rate=rate)


@needs_emulator
def test_kernel_plans_with_dropout(ext):
    """On the emulator: a decode-shaped call (one query, a long cache) with dropout runs the
    tiled forward (the decode kernels have no dropout; the plan's decode_splits is 0 for it), and
    head dim 160 runs the split dK and dV kernels; both against the oracle."""
    assert ext.decode_splits("f32", 1, 1, 40, 4, 2, 16)[0] > 0
    assert ext.decode_splits("f32", 1, 1, 40, 4, 2, 16, dropout=True) == (0, 0)
    plan = ext.dispatch_plan("fwd", "f32", 1, 1, 40, 4, 2, 16, dropout=True)
    assert [d["kernel"] for s in plan for d in s] == ["flash_attention_fwd_f32_d16"]
    check(*inputs(3, batch=1, q_len=1, kv_len=40), 0.5, implementation="emulator",
          key_value_seq_lengths=np.array([37]))
    assert ext.bwd_stages(160) == ["bwd_dq", "bwd_dk", "bwd_dv"]
    check(*inputs(4, jnp.float16, batch=1, q_len=5, kv_len=7, heads=2, kv_heads=1,
                  head_dim=160), 0.3, implementation="emulator", is_causal=True)


def test_mask_read_back_bit_for_bit(implementation, monkeypatch):
    """O[i, :, j] = P_ij Z_ij with V = the identity over keys, and dV[j, :, i] = P_ij Z_ij with
    dO = the identity over rows: both are non-zero exactly where dropout_mask keeps (every P_ij
    > 0 here): one M for every implementation, both xla schedules, forward and backward."""
    tq, tk, heads = 7, 13, 2
    q, k, _, _, _ = inputs(4, batch=2, q_len=tq, kv_len=tk, heads=heads, kv_heads=heads)
    v = jnp.broadcast_to(jnp.eye(tk, D)[None, :, None], (2, tk, heads, D))
    do = jnp.broadcast_to(jnp.eye(tq, D)[None, :, None], (2, tq, heads, D))
    rate = 0.5
    keep = np.asarray(dropout_mask(KEY, (2, heads, tq, tk), rate))
    for schedule in schedules(implementation):
        if schedule is not None:
            use_xla_schedule(monkeypatch, schedule)
        o, vjp = jax.vjp(lambda v: flash_attention(q, k, v, dropout_rate=rate, dropout_rng=KEY,
                                                   implementation=implementation), v)
        (dv,) = vjp(do)
        np.testing.assert_array_equal(np.asarray(o)[..., :tk].transpose(0, 2, 1, 3) != 0, keep)
        np.testing.assert_array_equal(np.asarray(dv)[..., :tq].transpose(0, 2, 3, 1) != 0, keep)
    jax.clear_caches()


def test_check_grads_with_a_fixed_key(implementation):
    q, k, v, _, _ = inputs(5, batch=1, q_len=5, kv_len=6, heads=2, kv_heads=1)

    def f(q, k, v):
        return flash_attention(q, k, v, is_causal=True, dropout_rate=0.4, dropout_rng=KEY,
                               implementation=implementation)

    check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=5e-3, rtol=5e-3)


def test_vmap_with_batched_keys(implementation):
    """Each mapped element uses its own key, as a call per element does (outputs and
    gradients); a rank-3 call is batch entry 0."""
    q, k, v, do, _ = inputs(6)
    keys = jax.random.split(KEY, 3)

    def loss(q, key):
        return jnp.sum(flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=key,
                                       implementation=implementation) * do)

    got = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0))(q, keys)
    for n, key in enumerate(keys):
        want = jax.value_and_grad(loss)(q, key)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g[n]), np.asarray(w), rtol=1e-6, atol=1e-6)
    one = flash_attention(q[0], k[0], v[0], dropout_rate=0.5, dropout_rng=KEY,
                          implementation=implementation)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(flash_attention(
        q[:1], k[:1], v[:1], dropout_rate=0.5, dropout_rng=KEY,
        implementation=implementation))[0])


def test_keys_are_traced_operands():
    """A new key reaches a jitted call without retracing; a different key, a different O
    (implementation=None: the fused one where available)."""
    q, k, v, _, _ = inputs(7)
    traces = []

    @jax.jit
    def f(key):
        traces.append(1)
        return flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=key)

    a, b = f(jax.random.key(1)), f(jax.random.key(2))
    assert len(traces) == 1 and not np.array_equal(np.asarray(a), np.asarray(b))
    plain = flash_attention(q, k, v)
    np.testing.assert_array_equal(np.asarray(flash_attention(q, k, v, dropout_rate=0.0,
                                                             dropout_rng=KEY)), np.asarray(plain))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_rate=0.1), ValueError, "needs dropout_rng"),
    (dict(dropout_rate=1.0, dropout_rng=KEY), ValueError, "dropout_rate must be in"),
    (dict(dropout_rate=-0.1, dropout_rng=KEY), ValueError, "dropout_rate must be in"),
    (dict(dropout_rate=float("nan"), dropout_rng=KEY), ValueError, "dropout_rate must be in"),
    (dict(dropout_rate="0.1", dropout_rng=KEY), TypeError, "dropout_rate must be a real"),
    (dict(dropout_rate=0.1, dropout_rng=jnp.zeros(2, jnp.int32)), TypeError, "dropout_rng"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.split(KEY)), ValueError, "dropout_rng"),
    (dict(dropout_rate=0.0, dropout_rng=jnp.zeros(3, jnp.uint32)), TypeError, "dropout_rng"),
])
def test_errors_name_the_argument(kwargs, error, match):
    q, k, v, _, _ = inputs(9)
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("maps", ["whole call", "strided keys"])
def test_xla_dropout_branches_nowhere(monkeypatch, maps):
    """The xla implementation's forward+backward with dropout, in tiles, lowers to no
    conditional, for grouped keys and per-key ones alike: a branch in a tile would, on a GPU,
    read its predicate back to the host and store the tile's mask (docs/gpu.md#dropout)."""
    from jax_flash_metal.core import validation
    from jax_flash_metal.core.options import Options
    from jax_flash_metal.lowering.primitives import bwd_p, fwd_p
    use_xla_schedule(monkeypatch, BLOCKS)
    q, k, v, do, g = inputs(6)
    q, k, v, operands, params = validation.check_inputs(
        q, k, v, None, None, Options(dropout_rate=0.5, dropout_rng=KEY, implementation="xla"))
    if maps == "strided keys":
        operands = operands._replace(dropout=dropout.at_positions(operands.dropout, 0, 1, 1, 3))
        params = params._replace(dropout_key_groups=False)

    def forward_and_backward(q, k, v, do, g):
        o, lse, row_max, log_sum = fwd_p.bind(q, k, v, *operands.present(), **params._asdict())
        return bwd_p.bind(q, k, v, o, lse, row_max, log_sum, do, g, *operands.present(),
                          bias_grad=False, alibi_grad=False, **params._asdict())

    text = jax.jit(forward_and_backward).lower(q, k, v, do, g).as_text()
    assert "stablehlo.while" in text  # the tiles' loops
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    jax.clear_caches()
