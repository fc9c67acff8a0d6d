"""Sharding rules for the fused implementations: how the FFI call partitions under ``jit``.

XLA cannot look inside a custom call, so without a rule GSPMD/Shardy replicate its operands and
every device computes the whole batch. Here both lowerings of both primitives
(lowering/primitives.py) go through ``jax.experimental.custom_partitioning`` around a shard
primitive that emits the FFI call or the xla implementation, the way JAX's own cuDNN attention pairs
its primitives with custom partitioning:

- batch and head axes stay sharded as the query has them, so each device runs the kernels on its
  shard with no collective. Query heads and their KV heads are split together (a shard of query
  heads reads exactly the matching shard of KV heads when the head shard count divides
  num_kv_heads; with one KV head, K/V are replicated over the head shards); any other head
  split, or a batch or head count the shards do not divide evenly, is gathered on that axis.
- sequence and head_dim axes are always gathered: rows and keys carry global positions (causal,
  windows, lengths), so a shard must see whole sequences (the partitioner all-gathers K/V; for
  a sequence split without the gather, use ``sequence_axis_name`` in ``shard_map``).
- optional operands follow: lengths and segment ids the batch axis, a bias or mask each of its
  full (non-broadcast) batch and head axes, sinks the head axis, ALiBi slopes the batch and
  head axes, a page table the batch axis (its pages, shared by the batch, are split only over
  KV heads), the dropout operand the batch and head axes (each row carries its own b and n, so
  a shard's mask is the slice of the whole). A bias gradient is summed over
  the shards of the axes its bias broadcasts over (``lax.psum``); the sinks gradient is plain
  ``jax.numpy`` (attention.py), which the partitioner reduces itself.

Both partitioners: ``sharding_rule`` (Shardy, where JAX has it) states the same factors;
``infer_sharding_from_operands`` and ``partition`` (GSPMD, and Shardy's final partitioning)
pick the shardings above. Inside a fully manual ``shard_map`` or on one device the call is
lowered as is.

Sharding in types (Explicit mesh axes, ``jax.set_mesh``): ``result_shardings`` gives the
primitives' abstract evaluation the same batch/head shardings, so results are typed as the
partitioner lays them out; ``like_primal`` gives each gradient its primal's type back. The
per-device bodies are traced with no mesh set (``_without_mesh``) and on plain avals.
"""

from __future__ import annotations

import contextlib
import functools
import math
from functools import partial

import jax
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor, SdyShardingRule,
                                                  custom_partitioning)
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from ..core._jax_private import ShapedArray
from ..core.contract import operand_roles

# The layout of each main operand (contract.MAIN_OPERANDS): "q" [B, Tq, H, Dk],
# "kv" [B, Tkv, HKV, Dk], "row" [B, H, Tq]; "q_v" and "kv_v" the same with the value head dim
# Dv, "pages" / "pages_v" [num_pages, page_size, HKV, Dk or Dv] (k and v of a paged call).
_MAIN_LAYOUT = {"q": "q", "k": "kv", "v": "kv_v", "o": "q_v", "lse": "row", "row_max": "row",
                "log_sum": "row", "do": "q_v", "g_lse": "row"}
_PAGED_LAYOUT = {"k": "pages", "v": "pages_v"}

# The axes of every operand role, one letter per axis: b batch, H query heads, k KV heads (the
# only axes ever sharded); t query rows, s keys, d and e the key and value head dims, p pages,
# z page size (always whole); u an axis of its own (a page table's pages, the dropout operand's
# words). Both partitioners read this table: GSPMD's PartitionSpecs (_Layout.spec) and Shardy's
# factors (_sharding_rule).
_ROLE_AXES = {"q": "btHd", "q_v": "btHe", "kv": "bskd", "kv_v": "bske", "pages": "pzkd",
              "pages_v": "pzke", "row": "bHt", "page_table": "bu", "alibi_slopes": "bH",
              "q_lengths": "b", "kv_lengths": "b", "q_segment_ids": "bt", "kv_segment_ids": "bs",
              "bias": "bHts", "mask": "bHts", "sinks": "H", "dropout": "bHu"}
# Roles whose size-1 axes broadcast: such an axis is never sharded and is a factor of its own.
_BROADCAST = ("bias", "mask")


def _axis_letters(role, shape):
    """The letters of ``role``'s axes, "u" for a broadcast (size-1) axis of a bias or mask."""
    axes = _ROLE_AXES[role]
    if role in _BROADCAST:
        return "".join(a if n > 1 else "u" for a, n in zip(axes, shape))
    return axes


@functools.lru_cache(maxsize=None)
def _shard_primitive(prim, body, fused):
    """A primitive with ``prim``'s abstract evaluation that lowers to ``body``: the xla
    implementation (a jax.numpy function, any platform) or, with ``fused``, the fused
    implementation's lowering rule (the FFI call, cpu). The custom-partitioned function binds
    it, so its traced form holds no constants (which custom_partitioning refuses) whatever
    ``body`` computes at trace time."""
    shard = Primitive(f"{prim.name}_{'ffi' if fused else 'xla'}")
    shard.multiple_results = True
    shard.def_abstract_eval(lambda *args, **params: prim.abstract_eval(*args, **params)[0])
    if fused:
        mlir.register_lowering(shard, body, platform="cpu")
        return shard

    def lower_body(ctx, *args, **params):
        # The body computes one device's part: traced on plain arrays, without the varying
        # manual axes (shard_map) or Explicit shardings of the avals.
        plain = lambda avals: [ShapedArray(a.shape, a.dtype) for a in avals]  # noqa: E731
        ctx = ctx.replace(avals_in=plain(ctx.avals_in), avals_out=plain(ctx.avals_out))
        with _without_mesh():
            return mlir.lower_fun(partial(body, **params), multiple_results=True)(ctx, *args)

    mlir.register_lowering(shard, lower_body)
    return shard


def _roles(direction, params):
    paged = _PAGED_LAYOUT if params.get("has_page_table") else {}
    return [paged.get(r, _MAIN_LAYOUT.get(r, r)) for r in operand_roles(direction, params)]


def _axes(entry):
    """The mesh axis names of one PartitionSpec entry, as a tuple."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _shards(mesh, entry):
    return math.prod(mesh.shape[a] for a in _axes(entry))


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


class _Layout:
    """The batch and head shardings of one call, from the query's sharding (see the module
    docstring for which splits are kept)."""

    def __init__(self, mesh, q_sharding, q_shape, kv_heads):
        batch, _, heads, _ = q_shape
        spec = (tuple(q_sharding.spec) + (None,) * 4)[:4] if isinstance(
            q_sharding, NamedSharding) else (None,) * 4
        b, h = _axes(spec[0]), _axes(spec[2])
        if batch % _shards(mesh, b):
            b = ()
        n_h = _shards(mesh, h)
        if heads % n_h or (kv_heads % n_h and kv_heads != 1):
            h = ()
        self.mesh, self.batch, self.heads = mesh, b, h
        self.kv_heads = h if kv_heads % _shards(mesh, h) == 0 else ()

    def spec(self, role, shape):
        sharded = {"b": self.batch, "H": self.heads, "k": self.kv_heads}
        return P(*(_entry(sharded.get(a, ())) for a in _axis_letters(role, shape)))

    def sharding(self, role, shape):
        return NamedSharding(self.mesh, self.spec(role, shape))

    def reduced_axes(self, role, shape):
        """Mesh axes over which a gradient of this role and shape is a partial sum on each
        shard: dK and dV (sums over each KV head's query heads) where K/V are replicated over
        the head shards, a bias gradient over the shards of the axes the bias broadcasts."""
        if role in ("kv", "kv_v"):
            return () if self.kv_heads else self.heads
        if role == "bias":
            return ((self.batch if shape[0] == 1 else ())
                    + (self.heads if shape[1] == 1 else ()))
        return ()


def _result_roles(direction, params):
    if direction == "fwd":
        return ["q_v", "row", "row", "row"]
    return (["q", "kv", "kv_v"] + (["bias"] if params.get("bias_grad") else [])
            + (["alibi_slopes"] if params.get("alibi_grad") else []))


def _explicit_axes(mesh):
    """The Explicit axis names of an abstract value's mesh (none on JAX without them)."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None or getattr(mesh, "empty", True):
        return frozenset()
    return frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                     if t == axis_type.Explicit)


def _explicit_layout(sharding, q_shape, kv_heads):
    """The _Layout of a query typed with ``sharding``, over its Explicit mesh axes only (the
    others are Auto, which the partitioner lays out, or Manual), or None without any."""
    if not isinstance(sharding, NamedSharding):
        return None
    explicit = _explicit_axes(sharding.mesh)
    if not explicit:
        return None
    spec = [tuple(a for a in _axes(e) if a in explicit) for e in tuple(sharding.spec)]
    return _Layout(sharding.mesh, NamedSharding(sharding.mesh, P(*map(_entry, spec))), q_shape,
                   kv_heads)


def result_shardings(direction, params, in_avals, out_shapes):
    """Sharding in types: the NamedShardings (on the abstract mesh) of the results of shapes
    ``out_shapes`` of a primitive whose query and key avals are ``in_avals[:2]`` (the batch and
    head splits above, of the query's Explicit mesh axes: those a call keeps unsharded are
    replicated, so sequence and head_dim axes are gathered), or None per result where the query
    has no sharding in its type (JAX without it; Auto axes; inside a fully manual shard_map:
    replicated)."""
    q, k = in_avals[0], in_avals[1]
    sharding = getattr(q, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return [None] * len(out_shapes)
    layout = _explicit_layout(sharding, q.shape, k.shape[2]) or _Layout(
        sharding.mesh, NamedSharding(sharding.mesh, P()), q.shape, k.shape[2])
    return [layout.sharding(r, shape)
            for r, shape in zip(_result_roles(direction, params), out_shapes)]


def on_explicit_shards(f, args, roles, out_roles):
    """``f(*args)`` (results of ``out_roles``), run per shard of the Explicit mesh axes of the
    query's type (``args[0]``): inside ``jax.shard_map`` over those axes, each operand
    resharded to its role's batch/head spec (``_Layout``; None operands pass as None). Code that
    is written per device (context parallelism, whose own arrays carry no sharding) then runs
    inside a ``shard_map`` that leaves other axes Explicit; f(*args) itself where there are
    none."""
    q = args[0]
    sharding = getattr(jax.typeof(q), "sharding", None) if hasattr(jax, "typeof") else None
    layout = _explicit_layout(sharding, q.shape, args[1].shape[2])
    if layout is None:
        return f(*args)
    present = [i for i, x in enumerate(args) if x is not None]
    specs = [layout.spec(roles[i], args[i].shape) for i in present]

    def per_shard(*xs):
        full = [None] * len(args)
        for i, x in zip(present, xs):
            full[i] = x
        return f(*full)

    xs = [like_spec(args[i], s) for i, s in zip(present, specs)]
    return jax.shard_map(per_shard, in_specs=tuple(specs),
                         out_specs=tuple(layout.spec(r, None) for r in out_roles),
                         axis_names=set(_explicit_axes(sharding.mesh)))(*xs)


def like_spec(x, spec):
    """``x`` resharded to ``spec`` where its type's spec differs."""
    have = getattr(jax.typeof(x), "sharding", None)
    if isinstance(have, NamedSharding) and _padded(have.spec, x.ndim) == _padded(spec, x.ndim):
        return x
    return jax.sharding.reshard(x, spec)


def _padded(spec, ndim):
    return tuple(_entry(_axes(e)) for e in tuple(spec)) + (None,) * (ndim - len(spec))


def like_primal(grad, primal):
    """``grad`` resharded to the Explicit sharding in ``primal``'s type where the two differ:
    a gradient's type must be its primal's, and ``result_shardings`` replicates the sequence and
    head_dim axes (and uneven splits) a caller may have sharded."""
    if grad is None or not hasattr(jax, "typeof"):
        return grad
    want = getattr(jax.typeof(primal), "sharding", None)
    if not isinstance(want, NamedSharding) or not _explicit_axes(want.mesh):
        return grad
    return like_spec(grad, P(*_padded(want.spec, grad.ndim)))


def _layout(mesh, arg_shapes):
    q, k = arg_shapes[0], arg_shapes[1]
    return _Layout(mesh, q.sharding, q.shape, k.shape[2])


def _without_mesh():
    """A context with no abstract mesh, for tracing the per-device body of ``partition``: the
    Explicit axes of a caller's ``jax.set_mesh`` would otherwise type its arrays and add
    sharding constraints that reach the partitioned per-device program as custom calls no
    backend implements."""
    use = getattr(jax.sharding, "use_abstract_mesh", None)
    return contextlib.nullcontext() if use is None else use(jax.sharding.AbstractMesh((), ()))


def _make_partitioned(prim, direction, params, in_avals, body, fused):
    bind = _shard_primitive(prim, body, fused).bind
    roles = _roles(direction, params)
    out_roles = _result_roles(direction, params)

    @custom_partitioning
    def call(*args):
        return tuple(bind(*args, **params))

    def out_shardings(layout, result_shape):
        return tuple(layout.sharding(r, s.shape) for r, s in zip(out_roles, result_shape))

    def infer(mesh, arg_shapes, result_shape):
        return out_shardings(_layout(mesh, arg_shapes), result_shape)

    def partition(mesh, arg_shapes, result_shape):
        layout = _layout(mesh, arg_shapes)
        arg_shardings = tuple(layout.sharding(r, s.shape) for r, s in zip(roles, arg_shapes))
        summed = ([()] * len(out_roles) if direction == "fwd" else
                  [layout.reduced_axes(r, s.shape) for r, s in zip(out_roles, result_shape)])

        def lower(*args):
            with _without_mesh():
                outs = bind(*args, **params)
                return tuple(jax.lax.psum(x, axes) if axes else x
                             for x, axes in zip(outs, summed))

        return mesh, lower, out_shardings(layout, result_shape), arg_shardings

    call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                       sharding_rule=_sharding_rule(roles, out_roles, in_avals))
    return call


def _sharding_rule(roles, out_roles, in_avals):
    """The Shardy rule: factors b (batch), k and g (KV heads and query heads per KV head; a
    query head axis is the compound (k, g), or one of them where the other is 1), t (query
    rows), s (keys), d and e (the key and value head dims), p and z (pages, page size); a
    size-1 (broadcast) axis of a bias or mask, and the page table's pages, get a factor of
    their own."""
    q, k = in_avals[0], in_avals[1]
    group = q.shape[2] // k.shape[2]
    # Shardy allows no size-1 factor inside a compound one.
    heads, sizes = "k", {}
    if group > 1:
        heads, sizes = ("g", {}) if k.shape[2] == 1 else (CompoundFactor("k", "g"), {"g": group})
    fresh = iter(f"u{n}" for n in range(64))
    factors = {"H": heads}

    def mapping(role, shape):
        return ArrayMapping(*(next(fresh) if a == "u" else factors.get(a, a)
                              for a in _axis_letters(role, shape)))

    bias_shape = next((a.shape for r, a in zip(roles, in_avals) if r == "bias"), None)
    operands = tuple(mapping(r, a.shape) for r, a in zip(roles, in_avals))
    results = tuple(mapping(r, bias_shape if r == "bias" else q.shape) for r in out_roles)
    return SdyShardingRule(operands, results, **sizes)


@functools.lru_cache(maxsize=None)
def _partitioned(prim, direction, params_items, in_avals, body, fused):
    return _make_partitioned(prim, direction, dict(params_items), in_avals, body, fused)


def lower(prim, direction, ctx, args, params, body, fused=False):
    """Lower primitive ``prim`` of ``direction`` ("fwd" or "bwd") with static ``params`` as
    ``body(*args, **params)`` (the xla implementation) or, with ``fused``, as the lowering rule
    ``body(ctx, *args, **params)`` of the fused implementation (its FFI call), wrapped in the
    custom partitioning above. ``body`` must be hashable and the same object for the same
    lowering (a cache key)."""
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_in)
    call = _partitioned(prim, direction, tuple(sorted(params.items())), avals, body, fused)
    return mlir.lower_fun(lambda *xs: call(*xs), multiple_results=True)(ctx, *args)
