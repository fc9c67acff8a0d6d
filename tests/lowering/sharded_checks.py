"""Worker of tests/lowering/test_sharding.py, run with 8 host devices
(tests/helpers/host_devices.py): flash_attention under jit with operands sharded over a 4x2 mesh
("data", "model").

    python sharded_checks.py IMPLEMENTATION --shardy|--gspmd|--explicit CASE...

For each case, jax.vjp of jit(flash_attention) with return_lse, cotangents dO and g_lse: O, LSE
and every gradient must match the float64 oracle (tolerance.py), keep the batch / head sharding
of their inputs, and (batch and head splits) compile to no all-gather or all-to-all.
``--explicit``: the mesh's axes are Explicit (``jax.make_mesh``'s default on the newest JAX) and
everything runs inside ``jax.set_mesh`` (Shardy); the gradients' shardings are then their
inputs' exactly (sharding in types). The case "unsharded" passes every array unsharded.
"""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tolerance
from api_helpers import alibi_bias, make_inputs, normal
from jax_flash_metal import dropout_mask, flash_attention

B, T, H, D = 8, 32, 4, 16
DV = 8  # the value head dim of the "value_dim_alibi" case
RATE = 0.25  # the "dropout" case's rate


def collectives(hlo):
    """The gathering collectives (all-gather, all-to-all) of arrays shaped like q, k, v, o or dO
    (rank 4, head_dim last) in compiled HLO text, as their result types."""
    return re.findall(r"= (f32\[\d+,\d+,\d+,(?:%d|%d)\])\S* (?:all-gather|all-to-all)(?:-start)?\("
                      % (D, DV), hlo)


def case(name):
    """(kv_heads, q/k/v spec, features dict, feature specs, whether gathers are expected)."""
    heads = P("data", None, "model", None)
    rng = np.random.default_rng(1)
    if name in ("causal", "gqa", "mqa"):
        return {"causal": H, "gqa": 2, "mqa": 1}[name], heads, {}, {}, False
    if name == "features":
        lengths = jnp.asarray([32, 30, 17, 32, 5, 32, 31, 1], jnp.int32)
        segments = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)
        feats = dict(bias=jnp.asarray(rng.normal(size=(1, H, T, T)), jnp.float32),
                     mask=jnp.asarray(rng.random((B, 1, T, T)) > 0.2),
                     query_seq_lengths=lengths, key_value_seq_lengths=lengths[::-1],
                     query_segment_ids=segments, key_value_segment_ids=segments,
                     sinks=jnp.asarray(rng.normal(size=(H,)), jnp.float32))
        specs = dict(bias=P(None, "model"), mask=P("data"), query_seq_lengths=P("data"),
                     key_value_seq_lengths=P("data"), query_segment_ids=P("data"),
                     key_value_segment_ids=P("data"), sinks=P("model"))
        return 2, heads, feats, specs, False
    if name == "bias_heads":  # a bias broadcast over the heads: dbias summed over "model"
        feats = dict(bias=jnp.asarray(rng.normal(size=(B, 1, T, T)), jnp.float32))
        return H, heads, feats, dict(bias=P("data")), False
    if name == "sequence":  # the sequence axis split: gathered, still exact
        return H, P("data", "model", None, None), {}, {}, True
    if name == "dropout":  # the key replicated; each shard's mask is the slice of the whole
        return 2, heads, dict(dropout_rng=jax.random.key(5)), dict(dropout_rng=P()), False
    if name == "unsharded":  # under jax.set_mesh, nothing sharded: replicated, no collective
        return 2, P(None, None, None, None), {}, {}, False
    if name == "value_dim_alibi":  # Dv != Dk and per-example ALiBi slopes (xla only)
        slopes = jnp.asarray(rng.random((B, H)), jnp.float32)
        return 2, heads, dict(alibi_slopes=slopes), dict(alibi_slopes=P("data", "model")), False
    raise ValueError(name)


def check(implementation, name, explicit):
    if explicit:
        explicit_axes = (jax.sharding.AxisType.Explicit,) * 2
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=explicit_axes)
        with jax.set_mesh(mesh):
            return run(implementation, name, mesh, explicit)
    # Mesh's axes are Auto on every JAX (jax.make_mesh's are Explicit on the newest).
    return run(implementation, name, Mesh(np.array(jax.devices()).reshape(4, 2),
                                          ("data", "model")), explicit)


def run(implementation, name, mesh, explicit):
    kv_heads, spec, feats, feat_specs, gathers = case(name)
    q, k, v, do, g = make_inputs(0, B, T, T, H, kv_heads, D, jnp.float32)
    if "alibi_slopes" in feats:
        rng = np.random.default_rng(2)
        v, do = normal(rng, (B, T, kv_heads, DV), jnp.float32), normal(rng, (B, T, H, DV),
                                                                       jnp.float32)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    diff = {n: put(feats.pop(n), feat_specs[n]) for n in ("bias", "sinks", "alibi_slopes")
            if n in feats}
    static = {n: put(x, feat_specs[n]) for n, x in feats.items()}

    def f(q, k, v, diff, static):
        return flash_attention(q, k, v, diff.get("bias"), static.get("mask"),
                               sinks=diff.get("sinks"), alibi_slopes=diff.get("alibi_slopes"),
                               is_causal=True, return_lse=True,
                               implementation=implementation,
                               dropout_rate=RATE if "dropout_rng" in static else 0.0,
                               **{n: x for n, x in static.items() if n != "mask"})

    def forward_and_vjp(q, k, v, do, g, diff, static):
        (o, lse), vjp = jax.vjp(lambda *a: f(*a, static), q, k, v, diff)
        return (o, lse) + vjp((do, g))

    kv_spec = P(*spec[:2], None if kv_heads == 1 else spec[2], *spec[3:])
    # In Explicit mode dO has the output's type: the query's sharding, sequence axis gathered.
    out_spec = P(spec[0], None, *spec[2:]) if explicit else spec
    args = ([put(q, spec), put(k, kv_spec), put(v, kv_spec), put(do, out_spec)]
            + [put(g, P(*spec[:1], *spec[2:3]))])
    compiled = jax.jit(forward_and_vjp).lower(*args, diff, static).compile()
    found = collectives(compiled.as_text())
    assert bool(found) == gathers, f"gathering collectives {found} (expected some: {gathers})"
    o, lse, dq, dk, dv, ddiff = compiled(*args, diff, static)
    if explicit:  # sharding in types: each gradient's is its input's, the output's the query's
        # (its sequence axis gathered)
        def padded(s, n):
            return tuple(s) + (None,) * (n - len(s))

        pairs = [(dq, args[0]), (dk, args[1]), (dv, args[2]), (o, args[3])] + [
            (ddiff[n], diff[n]) for n in diff]
        for got_x, want_x in pairs:
            assert padded(got_x.sharding.spec, got_x.ndim) == padded(
                want_x.sharding.spec, got_x.ndim), (got_x.sharding, want_x.sharding)
    elif not gathers and name != "unsharded":
        for x in (o, dq, dk, dv):
            assert x.sharding.spec[0] == "data", (x.shape, x.sharding)
        assert o.sharding.spec[2] == "model" and dq.sharding.spec[2] == "model", o.sharding
    got = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv, **{"d" + n: x for n, x in ddiff.items()})
    host = {n: np.asarray(x) for n, x in {**diff, **static}.items() if n != "dropout_rng"}
    if "dropout_rng" in static:  # the oracle takes the keep mask
        host.update(dropout_mask=np.asarray(dropout_mask(feats["dropout_rng"], (B, H, T, T),
                                                         RATE)), dropout_rate=RATE)
    if "alibi_slopes" in host:  # the oracle takes the ALiBi term as a bias; dslopes from dbias
        term, dist = alibi_bias(host.pop("alibi_slopes"), B, T, T)
        want = tolerance.assert_all_match_oracle(got, q, k, v, do, g, bias=term, is_causal=True)
        tolerance.assert_matches_oracle("dalibi_slopes", got["dalibi_slopes"],
                                        (want["dbias"] * dist).sum(axis=(2, 3)), kind="dbias")
    else:
        tolerance.assert_all_match_oracle(got, q, k, v, do, g, names=tuple(got), is_causal=True,
                                          **host)
    print(name, implementation, "ok", found)


def main(implementation, partitioner, *names):
    jax.config.update("jax_use_shardy_partitioner", partitioner != "--gspmd")
    for name in names:
        check(implementation, name, partitioner == "--explicit")


if __name__ == "__main__":
    main(*sys.argv[1:])
