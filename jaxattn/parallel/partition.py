"""Partition rules: a kernel call on arrays sharded along batch and heads runs shard-local.

A Pallas call is one opaque custom call to XLA's partitioner: left alone, a jitted call on
sharded inputs gathers them and returns a replicated output. `run_sharded` wraps a
kernel-calling function with the roles of its operands' axes (`Roles`), so that each device
runs the function on its own shard with no communication and the outputs come back
sharded like the inputs. Both sharding modes of jax are served:

- explicit axes (`jax.make_mesh`'s default, shardings in the types): the shardings are
  read at trace time and the call becomes a `jax.shard_map`;
- auto axes (shardings known only to the partitioner): a
  `jax.experimental.custom_partitioning` rule (as jax's cuDNN attention has) receives the
  operands' shardings at compile time and returns the shard-local function.

Axis roles:

- `BATCH`: sequences; split freely.
- `HEADS`: query heads. The mesh axes of the batch and head axes are read from the first
  operand that has the role (q).
- `KV_HEADS`: kv heads. Split over the head axes when the head-shard count n divides the
  kv heads, so that each device holds the kv heads of its query-head groups. When it does
  not (fewer kv heads than devices, the tensor-parallel case of vLLM and TensorRT-LLM) the
  kv operands are replicated along the head axes and each device slices the kv head its
  query heads read; their gradients (`sums` outputs with this role) are summed over the
  head axes. An op that writes replicated kv heads (a cache) runs with heads whole
  instead: duplicate the cache's kv heads (`jaxattn.parallel.duplicate_kv_heads`). Needs
  Hq % n == 0 and n a multiple of Hkv's groups (`(Hq // Hkv) % (Hq // n) == 0`), else
  the head role is left unsplit (with a warning).
- `SEQUENCE`: the tokens of a dense batch (q's and k's). Split only for an op that gives a
  `sequence_fn` (attention with the options ring attention takes): the shard-local
  function is then the ring over the sequence's mesh axes (`jaxattn.parallel.ring`),
  passing K/V blocks with `ppermute`. Otherwise, and when the axis does not divide, XLA
  gathers the sequence (with a warning).
- `None`: the whole axis on every device (head_dim, pages, ...).

An axis of size 1 is broadcast (a bias shared by every head): never split; an output
marked `sums` is summed (`psum`) over the mesh axes of the roles it lacks (the gradient of
a bias broadcast over heads, of the ALiBi slopes over the batch, ...).

With one device, inside a `shard_map` (manual axes) or with nothing sharded the function
is called as is.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    SdyShardingRule,
    custom_partitioning,
    custom_partitioning_p,
)
from jax.interpreters import batching
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["BATCH", "HEADS", "KV_HEADS", "SEQUENCE", "Out", "Roles", "like", "run_sharded"]

BATCH = "batch"
HEADS = "heads"
KV_HEADS = "kv_heads"
SEQUENCE = "sequence"
Roles = tuple  # one role (or None) per axis of an operand or output


@dataclasses.dataclass(frozen=True)
class Out:
    """An output: the roles of its axes, and whether shards hold partial sums of it."""

    roles: Roles
    sums: bool = False


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Which mesh axes split the batch and the heads, for one call."""

    batch: str | tuple[str, ...] | None
    heads: str | tuple[str, ...] | None
    head_shards: int  # n: devices along the head axes
    kv_split: bool  # kv heads split over the head axes (else replicated, sliced)
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    sequence: str | tuple[str, ...] | None = None  # a ring over these axes
    mesh_axes: tuple[str, ...] = ()  # the mesh's axis names in order (the ring's shifts)

    def axis(self, role, size: int):
        if size == 1:
            return None
        if role == BATCH:
            return self.batch
        if role == SEQUENCE:
            return self.sequence
        if role == HEADS or (role == KV_HEADS and self.kv_split):
            return self.heads
        return None

    def spec(self, roles: Roles, shape) -> P:
        return P(*(self.axis(r, n) for r, n in zip(roles, shape, strict=True)))

    def sum_axes(self, roles: Roles, shape) -> tuple[str, ...]:
        """Mesh axes over which shards of an output hold partial sums."""
        present = {a for a in _flat(self.spec(roles, shape))}
        every = _flat(P(self.batch, self.heads, self.sequence))
        return tuple(a for a in every if a not in present)


def run_sharded(
    fn: Callable,
    args: Sequence[jax.Array | None],
    roles: Sequence[Roles],
    outs: Sequence[Out],
    *,
    name: str,
    sequence_fn: Callable | None = None,
):
    """`fn(*args)`, shard-local when args are sharded along BATCH / HEADS / KV_HEADS axes.

    Args:
      fn: takes `args` (None entries included) and returns a tuple of arrays, one per
        entry of `outs` (None entries allowed where the output is absent).
      args: the operands; None entries are passed through.
      roles: per operand, the role of each axis (`BATCH`, `HEADS`, `KV_HEADS` or None).
      outs: per output, its roles and whether it is a partial sum (`Out`).
      name: the op's name, for messages.
      sequence_fn: None, or `sequence_fn(axes, mesh_axes)` -> a function like `fn` run on
        shards of a sequence split over the mesh axes `axes` (a ring; see `SEQUENCE`) of a
        mesh whose axis names are `mesh_axes` in order.
    """
    present = [i for i, a in enumerate(args) if a is not None]
    arrays = [args[i] for i in present]
    arr_roles = [tuple(roles[i]) for i in present]
    for a, r in zip(arrays, arr_roles, strict=True):
        if a.ndim != len(r):
            raise AssertionError(f"{name}: roles {r} for an operand of shape {a.shape}")

    def call(*arrays):
        full = [None] * len(args)
        for i, a in zip(present, arrays, strict=True):
            full[i] = a
        return tuple(fn(*full))

    mode = _mode(arrays)
    if mode is None:
        return call(*arrays)
    # Shapes alone (no shardings: the kernels trace on unsharded types).
    out_avals = jax.eval_shape(call, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays))
    live = tuple(i for i, o in enumerate(out_avals) if o is not None)

    def live_only(f):
        def g(*xs):
            full = [None] * len(args)
            for i, a in zip(present, xs, strict=True):
                full[i] = a
            results = tuple(f(*full))
            return tuple(results[i] for i in live)

        return g

    op = _Op(
        fn=live_only(fn),
        roles=tuple(arr_roles),
        outs=tuple(outs[i] for i in live),
        out_avals=tuple(out_avals[i] for i in live),
        name=name,
        sequence_fn=None if sequence_fn is None else lambda *on: live_only(sequence_fn(*on)),
    )
    explicit = mode == "explicit"
    results = _explicit_call(op, arrays) if explicit else _auto_call(*arrays, op=op)
    full = [None] * len(outs)
    for i, r in zip(live, results, strict=True):
        full[i] = r
    return tuple(full)


@dataclasses.dataclass(frozen=True, eq=False)
class _Op:
    """A call to partition: `fn(*arrays)` -> a tuple of arrays, with the roles of its
    operands' and outputs' axes (hashed by identity: a primitive's parameter)."""

    fn: Callable
    roles: tuple[Roles, ...]
    outs: tuple[Out, ...]
    out_avals: tuple[jax.ShapeDtypeStruct, ...]
    name: str
    sequence_fn: Callable | None = None

    def plan(self, arrays, specs, mesh) -> _Plan:
        ring = self.sequence_fn is not None
        plan = _make_plan(self.name, arrays, self.roles, specs, mesh, ring)
        copies = any(KV_HEADS in o.roles and not o.sums for o in self.outs)
        if copies and plan.heads is not None and not plan.kv_split:
            # A kv output that is not a sum (a written cache) cannot be rebuilt from the
            # shards that slice a replicated kv head without moving it whole.
            _warn(
                self.name,
                f"{plan.num_kv_heads} kv heads do not split over {plan.heads} and this op "
                "writes them: heads left whole (jaxattn.parallel.duplicate_kv_heads gives "
                "a cache whose kv heads split)",
            )
            plan = dataclasses.replace(plan, heads=None, head_shards=1, kv_split=True)
        return plan

    def in_specs(self, plan: _Plan, arrays) -> tuple[P, ...]:
        return tuple(plan.spec(r, a.shape) for a, r in zip(arrays, self.roles, strict=True))

    def out_specs(self, plan: _Plan) -> tuple[P, ...]:
        return tuple(
            plan.spec(o.roles, a.shape) for o, a in zip(self.outs, self.out_avals, strict=True)
        )

    def local(self, plan: _Plan) -> Callable:
        """The shard-local function: kv heads sliced, partial sums summed."""

        fn = self.fn if plan.sequence is None else self.sequence_fn(plan.sequence, plan.mesh_axes)

        def local(*shards):
            shards = [_kv_slice(plan, x, r) for x, r in zip(shards, self.roles, strict=True)]
            results = fn(*shards)
            return tuple(
                _finish(plan, y, o, a.shape)
                for y, o, a in zip(results, self.outs, self.out_avals, strict=True)
            )

        return local


def _explicit_call(op: _Op, arrays):
    """Shardings in the types: a shard_map planned from them at trace time, on the mesh of
    the operands placed on one (an operand never placed, e.g. a fresh q beside a sharded
    cache, has none: it is resharded onto it)."""
    mesh = next(
        (m for m in (jax.typeof(a).sharding.mesh for a in arrays) if not m.empty),
        jax.sharding.get_abstract_mesh(),
    )
    plan = op.plan(arrays, [jax.typeof(a).sharding.spec for a in arrays], mesh)
    specs = op.in_specs(plan, arrays)
    arrays = [
        jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs, strict=True)
    ]
    return jax.shard_map(
        op.local(plan), mesh=mesh, in_specs=specs, out_specs=op.out_specs(plan), check_vma=False
    )(*arrays)


def _auto_call(*arrays, op: _Op):
    """Shardings known to the partitioner: a custom_partitioning planned at compile time.

    custom_partitioning takes no function with constants (a kernel's tile table, a RoPE
    frequency vector): the function is traced once here and its constants become leading
    operands, replicated; the shard-local function retraces on the shards."""
    closed = jax.make_jaxpr(op.fn)(*arrays)
    consts = [jnp.asarray(c) for c in closed.consts]
    num_consts = len(consts)

    def whole(*xs):
        return tuple(jax.core.eval_jaxpr(closed.jaxpr, xs[:num_consts], *xs[num_consts:]))

    f = custom_partitioning(whole)

    def shardings(mesh, arg_shapes):
        shapes = arg_shapes[num_consts:]
        plan = op.plan(shapes, [a.sharding.spec for a in shapes], mesh)
        ins = tuple(NamedSharding(mesh, P()) for _ in range(num_consts))
        ins += tuple(NamedSharding(mesh, s) for s in op.in_specs(plan, shapes))
        outs = tuple(NamedSharding(mesh, s) for s in op.out_specs(plan))
        return plan, ins, outs

    def partition(mesh, arg_shapes, result_shape):
        plan, ins, outs = shardings(mesh, arg_shapes)
        local = op.local(plan)
        return mesh, lambda *xs: local(*xs[num_consts:]), outs, ins

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[2]

    partition.jaxattn_op = op  # for the batching rule
    rule = _rule(op, arrays, consts)
    f.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return tuple(f(*consts, *arrays))


# custom_partitioning has no batching rule; ours batches the calls made here (marked by
# their partition callback): the vmapped function is partitioned the same way, the
# vmapped axis whole on every device. Other custom_partitioning calls fail as before.
# (A primitive of our own with this rule, lowered to the custom_partitioning, loses the
# device assignment in jax 0.10's cached lowering.)
def _batched(arrays, dims, *, partition, **params):
    op = getattr(partition, "jaxattn_op", None)
    if op is None:
        raise NotImplementedError("Batching rule for 'custom_partitioning' not implemented")
    arrays = arrays[len(arrays) - len(op.roles) :]  # the traced function's constants first
    dims = dims[len(dims) - len(op.roles) :]
    in_axes = tuple(dims)  # None: not batched
    roles = tuple(
        r if d is None else r[:d] + (None,) + r[d:] for r, d in zip(op.roles, in_axes, strict=True)
    )
    size = next(a.shape[d] for a, d in zip(arrays, in_axes, strict=True) if d is not None)
    batched = _Op(
        fn=jax.vmap(op.fn, in_axes=in_axes),
        roles=roles,
        outs=tuple(Out((None, *o.roles), o.sums) for o in op.outs),
        out_avals=tuple(jax.ShapeDtypeStruct((size, *a.shape), a.dtype) for a in op.out_avals),
        name=op.name,
    )
    return list(_auto_call(*arrays, op=batched)), [0] * len(op.outs)


batching.primitive_batchers[custom_partitioning_p] = _batched


def like(y: jax.Array | None, x: jax.Array | None) -> jax.Array | None:
    """`y` with `x`'s sharding where shardings are types (explicit axes): a gradient must
    have its primal's type (the gradient of replicated ALiBi slopes comes out split by
    head). Elsewhere `y` as is."""
    if y is None or x is None:
        return y
    want = jax.typeof(x).sharding
    if jax.typeof(y).sharding.spec == want.spec or not _explicit(want):
        return y
    return jax.sharding.reshard(y, want)


def _explicit(sharding) -> bool:
    types = getattr(sharding.mesh, "axis_types", ())
    return any(t == AxisType.Explicit for t in types)


def _mode(arrays) -> str | None:
    """ "explicit" (shardings in the types), "auto" (the partitioner's), or None (run as is)."""
    if jax.device_count() == 1:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and any(t == AxisType.Manual for t in mesh.axis_types):
        return None  # inside a shard_map: the arrays are shards already
    for a in arrays:
        sharding = jax.typeof(a).sharding
        if any(s is not None for s in sharding.spec) and _explicit(sharding):
            return "explicit"
    return "auto"


def _flat(spec: P) -> list[str]:
    names = []
    for entry in spec:
        if entry is None:
            continue
        names.extend(entry if isinstance(entry, tuple) else (entry,))
    return names


def _axis_size(mesh, axes) -> int:
    if axes is None:
        return 1
    axes = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def _role_axes(arrays, arr_roles, specs, role):
    """The mesh axes of `role` in the first operand where that axis is split."""
    for a, r, s in zip(arrays, arr_roles, specs, strict=True):
        s = tuple(s) + (None,) * (a.ndim - len(s))
        for dim, (rr, entry) in enumerate(zip(r, s, strict=True)):
            if rr == role and a.shape[dim] > 1 and entry is not None:
                return entry
    return None


def _role_size(arrays, arr_roles, role) -> int:
    for a, r in zip(arrays, arr_roles, strict=True):
        for dim, rr in enumerate(r):
            if rr == role and a.shape[dim] > 1:
                return a.shape[dim]
    return 1


def _axis_names(axes) -> set:
    """The mesh axis names of a spec entry (None, a name, or a tuple of names)."""
    return set() if axes is None else set(axes if isinstance(axes, tuple) else (axes,))


def _make_plan(name, arrays, arr_roles, specs, mesh, ring: bool = False) -> _Plan:
    """Each role takes the mesh axes of the first operand that splits it: batch, then the
    sequence, then heads (q's, else the kv operands'). A role whose axes another role
    already took (operands split differently over one axis) is left whole, with a
    warning: two roles over one axis would be one spec naming it twice."""
    batch = _role_axes(arrays, arr_roles, specs, BATCH)
    sequence = _role_axes(arrays, arr_roles, specs, SEQUENCE)
    if _axis_names(sequence) & _axis_names(batch):
        _warn(name, f"the sequence is split over {sequence}, which splits the batch too")
        sequence = None
    if sequence is not None and not ring:
        _warn(name, f"the sequence is split over {sequence} and these options have no ring")
        sequence = None
    num_tokens = _role_size(arrays, arr_roles, SEQUENCE)
    if sequence is not None and num_tokens % _axis_size(mesh, sequence):
        _warn(name, f"{num_tokens} tokens do not split over {sequence}")
        sequence = None
    heads = _role_axes(arrays, arr_roles, specs, HEADS)
    if heads is None:  # only the kv operands split by head (q replicated): follow them
        heads = _role_axes(arrays, arr_roles, specs, KV_HEADS)
    if _axis_names(heads) & (_axis_names(batch) | _axis_names(sequence)):
        _warn(name, f"the heads are split over {heads}, which splits the batch or sequence")
        heads = None
    num_batch = _role_size(arrays, arr_roles, BATCH)
    num_heads = _role_size(arrays, arr_roles, HEADS)
    num_kv = _role_size(arrays, arr_roles, KV_HEADS)
    if not any(r == HEADS for rr in arr_roles for r in rr):
        num_heads = num_kv  # an op with kv heads alone (cache writes)
    if batch is not None and num_batch % _axis_size(mesh, batch):
        _warn(name, f"batch {num_batch} does not split over {batch}: batch left whole")
        batch = None
    n = _axis_size(mesh, heads)
    kv_split = True
    if heads is not None:
        group = num_heads // max(num_kv, 1)
        if num_heads % n:
            _warn(name, f"{num_heads} heads do not split over {heads} ({n}): heads left whole")
            heads, n = None, 1
        elif num_kv % n:
            kv_split = False  # fewer kv heads than shards: replicate them, slice locally
            if group % (num_heads // n):
                _warn(name, f"{num_kv} kv heads of {num_heads} do not split over {n} shards")
                heads, n, kv_split = None, 1, True
    return _Plan(batch, heads, n, kv_split, num_heads, num_kv, sequence, tuple(mesh.axis_names))


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _warn(name: str, why: str) -> None:
    _warn_once(f"jaxattn.{name}: {why}; XLA gathers that axis")


def _kv_slice(plan: _Plan, x, roles: Roles):
    """A replicated kv operand -> the kv heads this device's query heads read."""
    if plan.kv_split or plan.heads is None or KV_HEADS not in roles:
        return x
    dim = roles.index(KV_HEADS)
    if x.shape[dim] == 1:
        return x
    per_shard = plan.num_heads // plan.head_shards  # query heads here
    group = plan.num_heads // plan.num_kv_heads
    start = jax.lax.axis_index(plan.heads) * per_shard // group
    return jax.lax.dynamic_slice_in_dim(x, start, 1, axis=dim)


def _finish(plan: _Plan, y, out: Out, full_shape):
    """A local result -> its shard: a replicated kv output placed at its kv head (zeros
    elsewhere), then partial sums psum'd (in float32) over the axes the output is not
    split on: the shards of a kv head's query heads each hold a share of its gradient."""
    if not plan.kv_split and plan.heads is not None and KV_HEADS in out.roles:
        dim = out.roles.index(KV_HEADS)
        if full_shape[dim] != y.shape[dim]:
            per_shard = plan.num_heads // plan.head_shards
            group = plan.num_heads // plan.num_kv_heads
            start = jax.lax.axis_index(plan.heads) * per_shard // group
            zeros = jnp.zeros(y.shape[:dim] + (full_shape[dim],) + y.shape[dim + 1 :], y.dtype)
            y = jax.lax.dynamic_update_slice_in_dim(zeros, y, start, axis=dim)
    if out.sums:
        axes = plan.sum_axes(out.roles, full_shape)
        if axes:
            wide = jnp.float32 if jnp.issubdtype(y.dtype, jnp.floating) else y.dtype
            y = jax.lax.psum(y.astype(wide), axes).astype(y.dtype)
    return y


def _rule(op: _Op, arrays, consts=()) -> SdyShardingRule:
    """The Shardy rule: one factor per role (batch, heads, kv heads), others each their own."""
    counter = iter(range(10**6))

    def mapping(shape, roles):
        factors = []
        for n, r in zip(shape, roles, strict=True):
            if r is None or n == 1:
                factors.append(f"x{next(counter)}")
            else:
                # Tokens: one factor per length (cross attention's Tq and Tk differ).
                name = {BATCH: "b", HEADS: "h", KV_HEADS: "g", SEQUENCE: f"s{n}_"}[r]
                factors.append(name)
        return ArrayMapping(*factors)

    operands = tuple(mapping(c.shape, (None,) * c.ndim) for c in consts)
    operands += tuple(mapping(a.shape, r) for a, r in zip(arrays, op.roles, strict=True))
    results = tuple(mapping(a.shape, o.roles) for a, o in zip(op.out_avals, op.outs, strict=True))
    return SdyShardingRule(operands, results)
