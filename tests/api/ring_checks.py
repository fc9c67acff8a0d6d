"""Worker of tests/api/test_ring_attention.py, run with 8 host devices
(tests/helpers/host_devices.py): flash_attention(..., sequence_axis_name="sp") inside shard_map
(its default checks of varying manual axes on) over a ("data" 2, "sp" 4) mesh (batch over
"data", each sequence in 4 slices over "sp") against the float64 oracle on the whole arrays: O,
LSE, dQ, dK, dV (and dsinks, dalibi_slopes), for each case; with dropout, the oracle given the
whole call's keep mask, and that mask read back bit for bit from the split call.

    python ring_checks.py IMPLEMENTATION [explicit:]CASE[/LAYOUT][@STRATEGY]...

LAYOUT (sequence_layout, default the case's or contiguous) and STRATEGY (sequence_strategy,
default flash_attention's) override the case's. ``explicit:``: the newest JAX's pattern instead,
``jax.make_mesh`` (Explicit axes) under ``jax.set_mesh`` with ``jax.shard_map`` manual over "sp"
only, so the batch stays Explicit over "data" (contiguous layout: the arrays are typed, and
reordering them is the caller's business).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import tolerance
from api_helpers import alibi_bias, make_inputs
from jax_flash_metal import dropout_mask, flash_attention
from jax_flash_metal import ring_attention
from jax_flash_metal.ring_attention import shard_map, stripe, unstripe, unzigzag, zigzag

B, T, H, D = 2, 64, 4, 16
RNG = np.random.default_rng(3)
LENGTHS = jnp.asarray([50, 23], jnp.int32)
SEGMENTS = jnp.asarray(np.sort(RNG.integers(0, 4, (B, T)), axis=1), jnp.int32)
# Each case joins several features, to keep the cases (one compile of 8 devices each) few.
CASES = {
    "full": dict(),
    "window": dict(local_window_size=(9, 3)),
    "causal_window_sinks_cap": dict(is_causal=True, local_window_size=(20, None),
                                    logits_soft_cap=5.0,
                                    sinks=jnp.asarray(RNG.normal(size=(H,)), jnp.float32)),
    "lengths_segments": dict(is_causal=True, query_seq_lengths=LENGTHS,
                             key_value_seq_lengths=LENGTHS[::-1], query_segment_ids=SEGMENTS,
                             key_value_segment_ids=SEGMENTS),
    "bottom_right": dict(is_causal=True, causal_alignment="bottom_right",
                         query_seq_lengths=LENGTHS[::-1], key_value_seq_lengths=LENGTHS),
    "mqa": dict(is_causal=True),
    "value_dim": dict(is_causal=True),
    "striped_window_segments": dict(is_causal=True, local_window_size=(12, 0),
                                    query_segment_ids=SEGMENTS, key_value_segment_ids=SEGMENTS,
                                    query_seq_lengths=LENGTHS, sequence_layout="striped"),
    # Slices of 16 in pieces of 4 (ring_attention.PIECE_LEN): 4 x 4 primitive calls per slice
    # pair, each key piece passed on in place after use.
    "pieces_lengths_segments": dict(is_causal=True, causal_alignment="bottom_right",
                                    query_seq_lengths=LENGTHS[::-1], key_value_seq_lengths=LENGTHS,
                                    query_segment_ids=SEGMENTS, key_value_segment_ids=SEGMENTS),
    "pieces_striped": dict(is_causal=True, sequence_layout="striped"),
    # Per-example slopes with bottom-right alignment and lengths (global distances).
    "alibi": dict(is_causal=True, causal_alignment="bottom_right",
                  query_seq_lengths=LENGTHS[::-1], key_value_seq_lengths=LENGTHS,
                  alibi_slopes=jnp.asarray(RNG.random((B, H)), jnp.float32)),
    # The whole call's keep mask (rate 0.5), the batch whole on every device (a batch split by
    # shard_map is the caller's: each shard's rows count from 0).
    "dropout": dict(dropout_rate=0.5),
    "dropout_causal": dict(is_causal=True, dropout_rate=0.5),
    "pieces_dropout_causal": dict(is_causal=True, dropout_rate=0.5),
    # Pieces of 2: key pieces that start off a multiple of 4 (ring_attention's
    # dropout_key_groups False: one Philox call per key in the xla implementation).
    "pieces2_dropout": dict(dropout_rate=0.5),
}
DROPOUT_KEY = jax.random.key(11)
REORDER = {"striped": (stripe, unstripe), "zigzag": (zigzag, unzigzag)}
SEQUENCE = ("query_segment_ids", "key_value_segment_ids")  # split like the sequence
PIECE_LEN = ring_attention.PIECE_LEN


def check(implementation, spec):
    if spec.startswith("explicit:"):
        mesh = jax.make_mesh((2, 4), ("data", "sp"),
                             axis_types=(jax.sharding.AxisType.Explicit,) * 2)
        with jax.set_mesh(mesh):
            return run(implementation, spec, mesh)
    return run(implementation, spec, None)


def run(implementation, spec, explicit_mesh):
    name, _, strategy = spec.removeprefix("explicit:").partition("@")
    name, _, layout = name.partition("/")
    ring_attention.PIECE_LEN = (2 if name.startswith("pieces2_") else
                                4 if name.startswith("pieces") else PIECE_LEN)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "sp"))
    kw = dict(CASES[name])
    layout = layout or kw.pop("sequence_layout", "contiguous")
    chosen = {"sequence_strategy": strategy} if strategy else {}
    q, k, v, do, g = make_inputs(0, B, T, T, H, 1 if name == "mqa" else 2, D, jnp.float32)
    if name == "value_dim":  # Dv = 2 Dk
        v, do = (jnp.concatenate([x, x[..., ::-1]], axis=-1) for x in (v, do))
    arrays = {n: kw.pop(n) for n in list(kw) if isinstance(kw[n], jax.Array)}
    diff = {n: arrays.pop(n) for n in ("sinks", "alibi_slopes") if n in arrays}
    rate = kw.get("dropout_rate", 0.0)
    if rate:
        kw["dropout_rng"] = DROPOUT_KEY
    batch_axis = None if rate and explicit_mesh is None else "data"
    seq, row = P(batch_axis, "sp"), P(batch_axis, None, "sp")

    def local(q, k, v, diff, arrays):
        return flash_attention(q, k, v, sequence_axis_name="sp", return_lse=True,
                               sequence_layout=layout, implementation=implementation, **diff,
                               **arrays, **chosen, **kw)

    specs = {n: seq if n in SEQUENCE else P(batch_axis) for n in arrays}
    diff_specs = {n: P() if n == "sinks" else P(batch_axis) for n in diff}
    if explicit_mesh is None:
        ring = shard_map(local, mesh, (seq, seq, seq, diff_specs, specs), (seq, row))
    else:  # manual over "sp" only: the specs name "sp", "data" stays in the arrays' types
        def manual(spec):
            return P(*(a if a == "sp" else None for a in spec))

        put = lambda x, s: jax.device_put(x, jax.NamedSharding(explicit_mesh, s))  # noqa: E731
        q, k, v, do = (put(x, seq) for x in (q, k, v, do))
        g = put(g, row)
        diff = {n: put(x, diff_specs[n]) for n, x in diff.items()}
        arrays = {n: put(x, specs[n]) for n, x in arrays.items()}
        ring = jax.shard_map(
            local, in_specs=(manual(seq),) * 3 + (
                {n: manual(s) for n, s in diff_specs.items()},
                {n: manual(s) for n, s in specs.items()}),
            out_specs=(manual(seq), manual(row)), axis_names={"sp"})
    to, back = REORDER.get(layout, (lambda x, n, axis=1: x,) * 2)

    def attention(q, k, v, diff, arrays):
        arrays = {n: to(x, 4) if n in SEQUENCE else x for n, x in arrays.items()}
        o, lse = ring(to(q, 4), to(k, 4), to(v, 4), diff, arrays)
        return back(o, 4), back(lse, 4, axis=2)

    def forward_and_vjp(q, k, v, diff, arrays, do, g):
        (o, lse), vjp = jax.vjp(lambda *a: attention(*a, arrays), q, k, v, diff)
        return (o, lse) + vjp((do, g))

    o, lse, dq, dk, dv, ddiff = jax.jit(forward_and_vjp)(q, k, v, diff, arrays, do, g)
    got = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv, **{"d" + n: x for n, x in ddiff.items()})
    host = {n: np.asarray(x) for n, x in {**arrays, **diff}.items()}
    if "alibi_slopes" in host:  # the oracle takes the ALiBi term as a bias; dslopes from dbias
        term, dist = alibi_bias(host.pop("alibi_slopes"), B, T, T, **host, **kw)
        want = tolerance.assert_all_match_oracle(got, q, k, v, do, g, bias=term, **host, **kw)
        tolerance.assert_matches_oracle("dalibi_slopes", got["dalibi_slopes"],
                                        (want["dbias"] * dist).sum(axis=(2, 3)), kind="dbias")
    elif rate:
        keep = np.asarray(dropout_mask(DROPOUT_KEY, (B, H, T, T), rate))
        oracle_kw = {n: x for n, x in kw.items() if n != "dropout_rng"}
        tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=tuple(got),
                                          dropout_mask=keep, **host, **oracle_kw)
        place = (lambda x: x) if explicit_mesh is None else (lambda x: put(x, seq))
        read_back_mask(attention, place, keep, kw.get("is_causal", False))
    else:
        tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=tuple(got), **host, **kw)
    print(spec, implementation, "ok")


def read_back_mask(attention, place, keep, causal):
    """The split call's keep mask, bit for bit: with q = k = 0 every visible key has the same
    weight, and V = the identity over keys makes O[b, i, h, j] that weight times M[b, h, i, j]
    (zero for an invisible key). ``place`` puts an array where the call expects it."""
    zeros = place(jnp.zeros((B, T, H, T), jnp.float32))  # head dim T, the value's
    eye = place(jnp.broadcast_to(jnp.eye(T, dtype=jnp.float32)[None, :, None], (B, T, H, T)))
    o, _ = jax.jit(lambda q, v: attention(q, q, v, {}, {}))(zeros, eye)
    visible = np.tril(np.ones((T, T), bool)) if causal else np.ones((T, T), bool)
    np.testing.assert_array_equal(np.asarray(o).transpose(0, 2, 1, 3) > 0, keep & visible)


if __name__ == "__main__":
    for case in sys.argv[2:]:
        check(sys.argv[1], case)
