"""kda_prefill on head-sharded arrays (tensor parallelism) with no collectives.

KDA heads are independent: every input except cu_seqlens carries the head axis H, and so do both
outputs. `kda_prefill_sharded` runs kda_prefill under `jax.shard_map` with all of q, k, v, g, beta,
A_log, dt_bias, initial_state, out and final_state split on H over one mesh axis, so each device
runs the kernels on its own H / devices heads (the launch heuristic sees the local head count and
picks its column split for it) and nothing crosses devices. cu_seqlens is replicated.

    mesh = jax.make_mesh((4,), ("tp",))
    out, state = jax.jit(functools.partial(
        jax_kda.kda_prefill_sharded, mesh=mesh, head_axis="tp", output_final_state=True))(
        q, k, v, g, beta, A_log, dt_bias)

`mesh=None` takes the context mesh (`with jax.set_mesh(mesh):`), which also covers explicit-sharding
meshes (AxisType.Explicit). Other mesh axes are left alone: inputs sharded on them (for example B
over a data-parallel axis) are gathered to the head layout, so shard only H, or wrap your own
shard_map around kda_prefill when you shard more axes.

Without this helper, plain `jax.jit(kda_prefill)` on head-sharded inputs still gives correct
results, but the kernel path is an opaque custom call that XLA cannot partition: XLA all-gathers
every input to every device, each device computes all H heads, and the outputs are sliced back to
the input sharding. Correct, H/devices times the work and the gather traffic. The pure-JAX
reference (CPU) is partitioned by XLA like any JAX code.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .api import kda_prefill


def head_specs(head_axis: str) -> dict[str, P]:
    """The PartitionSpec of every head-carrying argument/result of kda_prefill."""
    per_token = P(None, None, head_axis, None)  # [B, T, H, 128]
    state = P(None, head_axis, None, None)  # [N, H, 128, 128]
    return {
        "q": per_token, "k": per_token, "v": per_token, "g": per_token,
        "beta": P(None, None, head_axis), "A_log": P(head_axis), "dt_bias": P(head_axis, None),
        "initial_state": state, "cu_seqlens": P(), "out": per_token, "final_state": state,
    }


def kda_prefill_sharded(
    q, k, v, g, beta, A_log, dt_bias, *, mesh=None, head_axis="tp", initial_state=None,
    cu_seqlens=None, output_final_state=False, **options,
):
    """kda_prefill with every head-carrying array split on H over mesh axis `head_axis`.

    Args:
      q ... dt_bias, initial_state, cu_seqlens, output_final_state: as kda_prefill.
      mesh: a Mesh or AbstractMesh, or None for the context mesh (jax.set_mesh).
      head_axis: the mesh axis that splits H; H must be a multiple of its size.
      **options: any other kda_prefill keyword (scale, lower_bound, inverse, backend, column_split,
        recurrence).

    Returns:
      (out, final_state or None) as kda_prefill, sharded on H over head_axis.
    """
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                "kda_prefill_sharded: no mesh: pass mesh=... or call it under `with jax.set_mesh(mesh):`"
            )
    if head_axis not in mesh.axis_names:
        raise ValueError(
            f"kda_prefill_sharded: head_axis {head_axis!r} is not an axis of the mesh "
            f"(axes {mesh.axis_names})"
        )
    devices = mesh.shape[head_axis]
    heads = q.shape[2] if getattr(q, "ndim", 0) == 4 else None
    if heads is not None and heads % devices:
        raise ValueError(
            f"kda_prefill_sharded: the head count H = {heads} must be a multiple of the size of "
            f"mesh axis {head_axis!r} ({devices})"
        )

    specs = head_specs(head_axis)
    given = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
             "initial_state": initial_state, "cu_seqlens": cu_seqlens}
    names = [name for name, x in given.items() if x is not None]  # None is no array to shard

    def local(*arrays):
        out, final_state = kda_prefill(
            **dict(zip(names, arrays)), output_final_state=output_final_state, **options
        )
        return (out, final_state) if output_final_state else out

    arrays = [given[name] for name in names]
    if isinstance(mesh, jax.sharding.Mesh):
        # Explicit-axes meshes (jax.make_mesh's default) make shard_map insist that inputs already
        # carry the head layout: put them there (a no-op for inputs that are head-sharded already).
        arrays = [jax.device_put(x, NamedSharding(mesh, specs[name])) for name, x in zip(names, arrays)]
    out_specs = (specs["out"], specs["final_state"]) if output_final_state else specs["out"]
    result = jax.shard_map(
        local, mesh=mesh, in_specs=tuple(specs[name] for name in names), out_specs=out_specs,
        axis_names={head_axis},
    )(*arrays)
    return result if output_final_state else (result, None)
