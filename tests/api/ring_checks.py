"""Worker of tests/api/test_ring_attention.py, run with 8 host devices
(tests/helpers/host_devices.py): flash_attention(..., sequence_axis_name="sp") inside shard_map over
a ("data" 2, "sp" 4) mesh (batch over "data", each sequence in 4 contiguous slices over "sp")
against the float64 oracle on the whole arrays: O, LSE, dQ, dK, dV (and dsinks), for each case.

    python ring_checks.py IMPLEMENTATION CASE...
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import tolerance
from api_helpers import make_inputs
from jax_flash_metal import flash_attention
from jax_flash_metal import ring_attention
from jax_flash_metal.ring_attention import shard_map, stripe, unstripe

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
}
SEQUENCE = ("query_segment_ids", "key_value_segment_ids")  # split like the sequence
PIECE_LEN = ring_attention.PIECE_LEN


def check(implementation, name):
    ring_attention.PIECE_LEN = 4 if name.startswith("pieces") else PIECE_LEN
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "sp"))
    kw = dict(CASES[name])
    q, k, v, do, g = make_inputs(0, B, T, T, H, 1 if name == "mqa" else 2, D, jnp.float32)
    if name == "value_dim":  # Dv = 2 Dk
        v, do = (jnp.concatenate([x, x[..., ::-1]], axis=-1) for x in (v, do))
    arrays = {n: kw.pop(n) for n in list(kw) if isinstance(kw[n], jax.Array)}
    sinks = arrays.pop("sinks", None)
    seq, row = P("data", "sp"), P("data", None, "sp")

    def local(q, k, v, sinks, arrays):
        return flash_attention(q, k, v, sinks=sinks, sequence_axis_name="sp", return_lse=True,
                               implementation=implementation, **arrays, **kw)

    specs = {n: seq if n in SEQUENCE else P("data") for n in arrays}
    ring = shard_map(local, mesh, (seq, seq, seq, P(), specs), (seq, row))

    def attention(q, k, v, sinks, arrays):
        if kw.get("sequence_layout") != "striped":
            return ring(q, k, v, sinks, arrays)
        arrays = {n: stripe(x, 4) if n in SEQUENCE else x for n, x in arrays.items()}
        o, lse = ring(stripe(q, 4), stripe(k, 4), stripe(v, 4), sinks, arrays)
        return unstripe(o, 4), unstripe(lse, 4, axis=2)

    def forward_and_vjp(q, k, v, sinks, arrays, do, g):
        (o, lse), vjp = jax.vjp(lambda *a: attention(*a, arrays), q, k, v, sinks)
        return (o, lse) + vjp((do, g))

    o, lse, dq, dk, dv, dsinks = jax.jit(forward_and_vjp)(q, k, v, sinks, arrays, do, g)
    got = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
    if sinks is not None:
        got["dsinks"], arrays["sinks"] = dsinks, sinks
    kw.pop("sequence_layout", None)
    tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=tuple(got),
                                      **{n: np.asarray(x) for n, x in arrays.items()}, **kw)
    print(name, implementation, "ok")


if __name__ == "__main__":
    for case in sys.argv[2:]:
        check(sys.argv[1], case)
