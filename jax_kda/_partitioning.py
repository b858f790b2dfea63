"""Head partitioning under plain jax.jit: KDA heads are independent, so each device runs its own.

Two mechanisms, chosen by what the inputs' types say at trace time:

- Explicit mesh axes (jax.make_mesh's default, AxisType.Explicit): the head sharding is part of
  the arrays' types, so `explicit_head_mesh` finds it and the call runs under jax.shard_map over
  those mesh axes (jax_kda.sharding does the same with a mesh passed in; this path exports).
- Auto axes (or no sharding in the types): `over_heads` wraps the call in
  jax.experimental.custom_partitioning with a Shardy sharding rule in which the head axis is the
  only factor that may stay sharded; every other dimension is replicated. XLA then runs the call
  on each device's local heads (the local head count is what the launch heuristic sees) with no
  gather of q, k, v, ... and no H-times work. On one device the wrapper inlines the call, so a
  single-device jax.export holds no partitioning custom call; exporting a multi-device program
  needs the shard_map path (kda_prefill_sharded or explicit axes).

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
    """Which axis of each argument and result is the head axis (None: no head axis)."""

    args: tuple[int | None, ...]
    results: tuple[int | None, ...]
    result_ranks: tuple[int, ...]


# kda_prefill's core: q, k, v, g, beta, A_log, dt_bias, state, cu, state_indices, ckpt_offsets ->
# out, final state / pool, checkpoints
PREFILL = Layout(args=(2, 2, 2, 2, 2, 0, 0, 1, None, None, None), results=(2, 1, 1),
                 result_ranks=(4, 4, 4))
# kda_decode's core: q, k, v, g, beta, A_log, dt_bias, state, state_indices -> out, state, states
DECODE = Layout(args=(2, 2, 2, 2, 2, 0, 0, 1, None), results=(2, 1, 2),
                result_ranks=(4, 4, 5))


def _present(values):
    return tuple(i for i, x in enumerate(values) if x is not None)


def _fill(present, size, values):
    full = [None] * size
    for i, x in zip(present, values):
        full[i] = x
    return full


def _head_spec(ndim: int, head_axis: int | None, mesh_axes) -> P:
    spec = [None] * ndim
    if head_axis is not None:
        spec[head_axis] = mesh_axes
    return P(*spec)


def _mesh_axes_size(mesh, mesh_axes) -> int:
    if mesh_axes is None:
        return 1
    names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    return math.prod(mesh.shape[name] for name in names)


def local_problem(problem, devices: int):
    """`problem` on one of `devices` devices that split its heads: H and Hk together, so that
    each device holds whole groups of value heads with their query/key head."""
    return dataclasses.replace(problem, heads=problem.heads // devices,
                               qk_heads=problem.qk_heads // devices)


def check_head_split(fn: str, problem, devices: int, mesh_axes) -> None:
    """A clear error when `devices` (the size of mesh axes `mesh_axes`) does not divide the
    query/key heads Hk (hence not the groups of value heads either)."""
    if problem.qk_heads % devices:
        grouped = (f" (each device must hold whole groups of H // Hk = {problem.group} value "
                   "heads with their query/key head)" if problem.group > 1 else "")
        raise ValueError(
            f"{fn}: mesh axes {mesh_axes!r} split the heads over {devices} devices, which must "
            f"divide q's and k's head count Hk = {problem.qk_heads}{grouped}")


def over_heads(step, layout: Layout, arrays, problem):
    """step(*arrays, problem=problem) on each device's local heads, under jax.experimental.
    custom_partitioning (the `problem` a device sees has its local head count).

    arrays: the call's arguments in layout order (None for absent ones); step returns a tuple in
    layout.results order (None for absent results), shaped as problem.result_shapes().
    """
    present = _present(arrays)
    ranks = tuple(arrays[i].ndim for i in present)
    partitioned = _partitioned(step, layout, problem, present, ranks)
    results = partitioned(*(arrays[i] for i in present))
    return tuple(_fill(_present(problem.result_shapes()), len(layout.results), results))


@functools.lru_cache(maxsize=256)
def _local_body(step, problem, present, count):
    """step on the present arrays alone, jitted: custom_partitioning takes a body without
    closed-over constants, which a jit boundary keeps inside its own jaxpr. Cached, so that
    eager calls of one configuration reuse one compiled program."""
    out_present = _present(problem.result_shapes())

    @functools.partial(jax.jit, inline=True)
    def body(*xs):
        results = step(*_fill(present, count, xs), problem=problem)
        return tuple(results[i] for i in out_present)

    return body


@functools.lru_cache(maxsize=256)
def _partitioned(step, layout: Layout, problem, present, ranks):
    """The custom_partitioning wrapper of step for one configuration (cached, as _local_body)."""
    count = len(layout.args)
    shapes = problem.result_shapes()
    out_present = _present(shapes)
    partitioned = custom_partitioning(_local_body(step, problem, present, count))

    def partition(mesh, arg_shapes, result_shape):
        first = present[0]  # q: its head axis tells the mesh axes
        spec = arg_shapes[0].sharding.spec
        axis = layout.args[first]
        mesh_axes = spec[axis] if axis < len(spec) else None
        devices = _mesh_axes_size(mesh, mesh_axes)
        if problem.qk_heads % devices:
            # not divisible (Hk, hence whole groups of value heads): every device runs every head
            mesh_axes, devices = None, 1
        arg_shardings = tuple(
            NamedSharding(mesh, _head_spec(len(s.shape), layout.args[i], mesh_axes))
            for i, s in zip(present, arg_shapes))
        result_shapes = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
        out_shardings = tuple(
            NamedSharding(mesh, _head_spec(len(s.shape), layout.results[i], mesh_axes))
            for i, s in zip(out_present, result_shapes))
        body = _local_body(step, local_problem(problem, devices), present, count)
        return mesh, body, out_shardings, arg_shardings

    # One factor "h" for the query/key heads; a value-head axis is "(h g)", h major: value head
    # j = h_j * G + g_j reads query/key head h_j = j // G, so splitting h splits every head axis
    # into whole groups. g stays replicated.
    group = problem.group
    factors = []
    replicated = []  # in order of first appearance: Shardy wants the factor indices sorted
    for tag, axes, indices, rank_of in (
            ("i", layout.args, present, dict(zip(present, ranks))),
            ("o", layout.results, out_present, {i: len(shapes[i].shape) for i in out_present})):
        for number, i in enumerate(indices):
            names = []
            for d in range(rank_of[i]):
                if d == axes[i]:
                    grouped = group > 1 and (tag, i) not in _QK_ARGS
                    names.append("(h g)" if grouped else "h")
                    if grouped and "g" not in replicated:
                        replicated.append("g")
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


# (tag, position) of the arguments on the query/key heads: q and k, positions 0 and 1 of both
# layouts
_QK_ARGS = {("i", 0), ("i", 1)}


def explicit_head_mesh(x, head_axis: int):
    """(mesh, mesh axes) when x's type says it is sharded over heads on Explicit mesh axes, else
    None (no sharding in the type, Auto axes, or heads not sharded)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    spec = sharding.spec
    axes = spec[head_axis] if head_axis < len(spec) else None
    if axes is None:
        return None
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    explicit = jax.sharding.AxisType.Explicit
    if not all(mesh._name_to_type[name] == explicit for name in names):
        return None
    return mesh, axes


def shard_over_heads(step, layout: Layout, arrays, problem, mesh, mesh_axes):
    """step(*arrays, problem=problem) under jax.shard_map: every array split on its head axis over
    `mesh_axes`, replicated on everything else; step sees each device's local heads (and the
    problem with the local head count) and no collective runs. Inputs on meshes with Explicit
    axes are resharded to that layout first (a no-op where they already carry it)."""
    present = _present(arrays)
    devices = _mesh_axes_size(mesh, mesh_axes)
    check_head_split(_function_name(problem), problem, devices, mesh_axes)
    specs = [_head_spec(arrays[i].ndim, layout.args[i], mesh_axes) for i in present]
    given = [_placed(arrays[i], mesh, spec) for i, spec in zip(present, specs)]
    result_specs = tuple(_head_spec(rank, axis, mesh_axes)
                         for rank, axis in zip(layout.result_ranks, layout.results))
    local = local_problem(problem, devices)
    run = functools.partial(_on_shard, step, present, len(arrays), local)
    return jax.shard_map(run, mesh=mesh, in_specs=tuple(specs), out_specs=result_specs)(*given)


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
