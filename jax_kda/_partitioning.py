"""Partitioning under plain jax.jit: KDA heads are independent, and so are the rows of a batched
call, so each device runs its own heads of its own batch rows.

Two mechanisms, chosen by what the inputs' types say at trace time:

- Explicit mesh axes (jax.make_mesh's default, AxisType.Explicit): the sharding is part of the
  arrays' types, so `explicit_split` finds it and the call runs under jax.shard_map over those mesh
  axes (jax_kda.sharding does the same with a mesh passed in; this path exports).
- Auto axes (or no sharding in the types): `partitioned_call` wraps the call in
  jax.experimental.custom_partitioning with a Shardy sharding rule in which the head axis and (where
  the call allows it, `splits_batch`) the batch axis are the only factors that may stay sharded;
  every other dimension is replicated. XLA then runs the call on each device's local heads and rows
  (the local sizes are what the launch heuristic sees) with no gather of q, k, v, ... and no
  H-times work. On one device the wrapper inlines the call, so a single-device jax.export holds no
  partitioning custom call; exporting a multi-device program needs the shard_map path
  (kda_prefill_sharded or explicit axes).

The batch axis (axis 0 of q, k, v, g, beta, the per-sequence states and out) splits only a batched
prefill (no cu_seqlens, hence no segment_ids, which run as a packed call; no state pool, no
checkpoints): its rows are its sequences. Elsewhere the batch stays whole on every device (a
batch-sharded input is gathered), as it did before the batch could split; a packed call's batch
is 1 anyway. kda_decode splits heads only.

Grouped value heads (q and k on Hk heads, the rest on H = G Hk) split together: the rule's head
factor is q's and k's head axis and every other head axis is that factor times the replicated
group factor, and shard_map splits every head axis over the same devices, so each device holds
whole groups (value head j with query/key head j // G). The device count must divide Hk.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .problem import Problem


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which axis of each argument and result is the head axis and which the batch axis (None:
    none), and which arguments and results are on the query/key heads (Hk)."""

    args: tuple[int | None, ...]
    results: tuple[int | None, ...]
    result_ranks: tuple[int, ...]
    batch_args: tuple[int | None, ...] | None = None  # None: the call never splits its batch
    batch_results: tuple[int | None, ...] | None = None
    qk_args: tuple[int, ...] = (0, 1)
    qk_results: tuple[int, ...] = ()


# kda_prefill's core: q, k, v, g, beta, A_log, dt_bias, state, cu, state_indices, ckpt_offsets ->
# out, final state / pool, checkpoints
PREFILL = Layout(args=(2, 2, 2, 2, 2, 0, 0, 1, None, None, None), results=(2, 1, 1),
                 result_ranks=(4, 4, 4),
                 batch_args=(0, 0, 0, 0, 0, None, None, 0, None, None, None),
                 batch_results=(0, 0, None))
# kda_decode's core: q, k, v, g, beta, A_log, dt_bias, state, state_indices -> out, state, states
DECODE = Layout(args=(2, 2, 2, 2, 2, 0, 0, 1, None), results=(2, 1, 2),
                result_ranks=(4, 4, 5))
# kda_prefill's backward (jax_kda._vjp): q, k, v, g, beta, A_log, dt_bias, state, cu, d_out,
# d_final_state -> dq, dk, dv, dg, dbeta, dA_log and ddt_bias per batch row ([B, H, 128] each),
# dstate
BACKWARD = Layout(args=(2, 2, 2, 2, 2, 0, 0, 1, None, 2, 1), results=(2, 2, 2, 2, 2, 1, 1, 1),
                  result_ranks=(4, 4, 4, 4, 3, 3, 3, 4),
                  batch_args=(0, 0, 0, 0, 0, None, None, 0, None, 0, 0),
                  batch_results=(0,) * 8, qk_results=(0, 1))


@dataclasses.dataclass(frozen=True)
class MeshSplit:
    """A mesh and the axes of it that split the heads and the batch (None: not split)."""

    mesh: object  # jax.sharding.Mesh or AbstractMesh
    head_axes: str | tuple[str, ...] | None
    batch_axes: str | tuple[str, ...] | None = None


def splits_batch(problem) -> bool:
    """Whether the call's batch rows may run on different devices: a batched prefill (its rows are
    its sequences) without a state pool or checkpoints (whose rows are not the batch's)."""
    return (isinstance(problem, Problem) and not problem.varlen and problem.plain)


def _batch_axes_of(axes, size: int, problem) -> tuple[int | None, ...]:
    """A layout's batch axes (of its args or results), all None where the call keeps its batch
    whole."""
    if axes is None or not splits_batch(problem):
        return (None,) * size
    return axes


def present_positions(values):
    return tuple(i for i, x in enumerate(values) if x is not None)


def _fill(present, size, values):
    full = [None] * size
    for i, x in zip(present, values):
        full[i] = x
    return full


def _spec(ndim: int, head_axis: int | None, head_mesh_axes, batch_axis: int | None = None,
          batch_mesh_axes=None) -> P:
    spec = [None] * ndim
    if head_axis is not None:
        spec[head_axis] = head_mesh_axes
    if batch_axis is not None:
        spec[batch_axis] = batch_mesh_axes
    return P(*spec)


def _mesh_axes_size(mesh, mesh_axes) -> int:
    if mesh_axes is None:
        return 1
    names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    return math.prod(mesh.shape[name] for name in names)


def local_problem(problem, devices: int, batch_devices: int = 1):
    """`problem` on one of the devices that split its heads `devices` ways (H and Hk together, so
    that each device holds whole groups of value heads with their query/key head) and its batch
    rows `batch_devices` ways."""
    local = dataclasses.replace(problem, heads=problem.heads // devices,
                                qk_heads=problem.qk_heads // devices)
    if batch_devices > 1:
        local = dataclasses.replace(local, batch=problem.batch // batch_devices,
                                    num_seqs=problem.num_seqs // batch_devices)
    return local


def check_head_split(fn: str, problem, devices: int, mesh_axes) -> None:
    """A clear error when `devices` (the size of mesh axes `mesh_axes`) does not divide the
    query/key heads Hk (hence not the groups of value heads either)."""
    if problem.qk_heads % devices:
        grouped = (f" (each device must hold whole groups of H // Hk = {problem.group} value "
                   "heads with their query/key head)" if problem.group > 1 else "")
        raise ValueError(
            f"{fn}: mesh axes {mesh_axes!r} split the heads over {devices} devices, which must "
            f"divide q's and k's head count Hk = {problem.qk_heads}{grouped}")


def check_batch_split(fn: str, problem, devices: int, mesh_axes) -> None:
    """A clear error when the batch cannot be split over `devices` (mesh axes `mesh_axes`): a
    call whose rows are not its sequences, or a batch size they do not divide."""
    if devices == 1:
        return
    if not splits_batch(problem):
        raise ValueError(
            f"{fn}: mesh axes {mesh_axes!r} split the batch, which only a batched call without "
            "cu_seqlens, segment_ids, state_indices or checkpoint_every can do (its rows are its "
            "sequences); shard the heads only")
    if problem.batch % devices:
        raise ValueError(
            f"{fn}: mesh axes {mesh_axes!r} split the batch over {devices} devices, which must "
            f"divide the batch size B = {problem.batch}")


def partitioned_call(step, layout: Layout, arrays, problem, out_present):
    """step(*arrays, problem=problem) on each device's local heads and batch rows, under
    jax.experimental.custom_partitioning (the `problem` a device sees has its local sizes).

    arrays: the call's arguments in layout order (None for absent ones); step returns a tuple in
    layout.results order (None for absent results); out_present: the positions of the results it
    returns. Returns the results in layout order."""
    present = present_positions(arrays)
    ranks = tuple(arrays[i].ndim for i in present)
    partitioned = _partitioned(step, layout, problem, present, ranks, out_present)
    results = partitioned(*(arrays[i] for i in present))
    return tuple(_fill(out_present, len(layout.results), results))


@functools.lru_cache(maxsize=256)
def _local_body(step, problem, present, count, out_present):
    """step on the present arrays alone, jitted: custom_partitioning takes a body without
    closed-over constants, which a jit boundary keeps inside its own jaxpr. Cached, so that
    eager calls of one configuration reuse one compiled program."""

    @functools.partial(jax.jit, inline=True)
    def body(*xs):
        results = step(*_fill(present, count, xs), problem=problem)
        return tuple(results[i] for i in out_present)

    return body


def _spec_axes(spec, axis):
    return spec[axis] if axis is not None and axis < len(spec) else None


@functools.lru_cache(maxsize=256)
def _partitioned(step, layout: Layout, problem, present, ranks, out_present):
    """The custom_partitioning wrapper of step for one configuration (cached, as _local_body)."""
    count = len(layout.args)
    batch_args = _batch_axes_of(layout.batch_args, count, problem)
    batch_results = _batch_axes_of(layout.batch_results, len(layout.results), problem)
    partitioned = custom_partitioning(_local_body(step, problem, present, count, out_present))

    def partition(mesh, arg_shapes, result_shape):
        first = present[0]  # q: its head and batch axes tell the mesh axes
        spec = arg_shapes[0].sharding.spec
        head_axes = _spec_axes(spec, layout.args[first])
        batch_axes = _spec_axes(spec, batch_args[first])
        devices = _mesh_axes_size(mesh, head_axes)
        if problem.qk_heads % devices:
            # not divisible (Hk, hence whole groups of value heads): every device runs every head
            head_axes, devices = None, 1
        batch_devices = _mesh_axes_size(mesh, batch_axes)
        if batch_axes is not None and problem.batch % batch_devices:
            batch_axes, batch_devices = None, 1  # every device runs every row
        arg_shardings = tuple(
            NamedSharding(mesh, _spec(len(s.shape), layout.args[i], head_axes, batch_args[i],
                                      batch_axes))
            for i, s in zip(present, arg_shapes))
        result_shapes = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
        out_shardings = tuple(
            NamedSharding(mesh, _spec(len(s.shape), layout.results[i], head_axes,
                                      batch_results[i], batch_axes))
            for i, s in zip(out_present, result_shapes))
        body = _local_body(step, local_problem(problem, devices, batch_devices), present, count,
                           out_present)
        return mesh, body, out_shardings, arg_shardings

    # One factor "h" for the query/key heads; a value-head axis is "(h g)", h major: value head
    # j = h_j * G + g_j reads query/key head h_j = j // G, so splitting h splits every head axis
    # into whole groups. g stays replicated. One factor "b" for the batch rows where they may
    # split.
    group = problem.group
    factors = []
    replicated = []  # in order of first appearance: Shardy wants the factor indices sorted
    for tag, axes, batch_axes, qk, indices, rank_of in (
            ("i", layout.args, batch_args, layout.qk_args, present, dict(zip(present, ranks))),
            ("o", layout.results, batch_results, layout.qk_results, out_present,
             {i: layout.result_ranks[i] for i in out_present})):
        for number, i in enumerate(indices):
            names = []
            for d in range(rank_of[i]):
                if d == axes[i]:
                    grouped = group > 1 and i not in qk
                    names.append("(h g)" if grouped else "h")
                    if grouped and "g" not in replicated:
                        replicated.append("g")
                elif d == batch_axes[i]:
                    names.append("b")
                else:
                    name = f"{tag}{number}d{d}"
                    names.append(name)
                    replicated.append(name)
            factors.append(" ".join(names))
    n_in = len(present)
    rule = ", ".join(factors[:n_in]) + " -> " + ", ".join(factors[n_in:])
    sizes = {"g": group} if group > 1 else {}  # g appears only inside "(h g)"
    partitioned.def_partition(partition, sharding_rule=rule,
                              need_replication_factors=tuple(replicated), **sizes)
    return partitioned


def explicit_split(x, problem) -> MeshSplit | None:
    """The MeshSplit that x's type (q's: heads on axis 2, batch on axis 0) says, where it is
    sharded on Explicit mesh axes over heads or (where the call may split it) batch; else None
    (no sharding in the type, Auto axes, or nothing split)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    spec = sharding.spec

    def explicit_axes(axis):
        axes = _spec_axes(spec, axis)
        if axes is None:
            return None
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        explicit = jax.sharding.AxisType.Explicit
        return axes if all(mesh._name_to_type[name] == explicit for name in names) else None

    head_axes = explicit_axes(2)
    batch_axes = explicit_axes(0) if splits_batch(problem) else None
    if head_axes is None and batch_axes is None:
        return None
    return MeshSplit(mesh, head_axes, batch_axes)


def whole_batch(x):
    """x with its axis 0 whole on every device where x's type splits it on Explicit mesh axes
    (its other axes as they were); x itself otherwise. For calls that pack their rows into one
    (segment_ids): the types must say the batch is whole before the rows are merged."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or _spec_axes(sharding.spec, 0) is None:
        return x
    explicit = jax.sharding.AxisType.Explicit
    if not any(t == explicit for t in mesh._name_to_type.values()):
        return x
    spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
    return _placed(x, mesh, P(None, *spec[1:]))


def shard_mapped_call(step, layout: Layout, arrays, problem, split: MeshSplit):
    """step(*arrays, problem=problem) under jax.shard_map: every array split on its head axis over
    split.head_axes and on its batch axis over split.batch_axes, replicated on everything else;
    step sees each device's local heads and rows (and the problem with the local sizes) and no
    collective runs. Inputs on meshes with Explicit axes are resharded to that layout first (a
    no-op where they already carry it)."""
    mesh, head_axes, batch_axes = split.mesh, split.head_axes, split.batch_axes
    present = present_positions(arrays)
    fn = _function_name(problem)
    devices = _mesh_axes_size(mesh, head_axes)
    check_head_split(fn, problem, devices, head_axes)
    batch_devices = _mesh_axes_size(mesh, batch_axes)
    check_batch_split(fn, problem, batch_devices, batch_axes)
    batch_args = _batch_axes_of(layout.batch_args, len(layout.args), problem)
    batch_results = _batch_axes_of(layout.batch_results, len(layout.results), problem)
    specs = [_spec(arrays[i].ndim, layout.args[i], head_axes, batch_args[i], batch_axes)
             for i in present]
    given = [_placed(arrays[i], mesh, spec) for i, spec in zip(present, specs)]
    result_specs = tuple(_spec(rank, axis, head_axes, batch_axis, batch_axes)
                         for rank, axis, batch_axis in zip(layout.result_ranks, layout.results,
                                                           batch_results))
    local = local_problem(problem, devices, batch_devices)
    run = functools.partial(_on_shard, step, present, len(arrays), local)
    return jax.shard_map(run, mesh=mesh, in_specs=tuple(specs), out_specs=result_specs)(*given)


def gathered_batch(x, split: MeshSplit | None, head_axis: int):
    """x (a result of shard_mapped_call split on its batch axis 0) with the batch whole on every
    device and the heads still split: on Explicit axes the types require it before x's batch
    axis is reduced. A no-op otherwise."""
    if split is None or split.batch_axes is None:
        return x
    spec = _spec(x.ndim, head_axis, split.head_axes)
    return _placed(x, split.mesh, spec)


def _function_name(problem) -> str:
    return "kda_prefill" if isinstance(problem, Problem) else "kda_decode"


def _on_shard(step, present, count, problem, *xs):
    return step(*_fill(present, count, xs), problem=problem)


def _placed(x, mesh, spec):
    """x in the layout `spec` over `mesh`, where the mesh's Explicit axes require it up front."""
    explicit = jax.sharding.AxisType.Explicit
    if not any(t == explicit for t in mesh._name_to_type.values()):
        return x  # Auto axes: shard_map reshards its inputs itself
    if isinstance(mesh, jax.sharding.Mesh) and not isinstance(x, jax.core.Tracer):
        return jax.device_put(x, NamedSharding(mesh, spec))
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))
