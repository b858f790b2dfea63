"""kda_prefill and kda_decode on head-sharded arrays over an explicit mesh, with no collectives.

KDA heads are independent: every input except cu_seqlens and state_indices carries the head axis
H, and so do the outputs. `kda_prefill_sharded` runs kda_prefill under `jax.shard_map` with q, k,
v, g, beta, A_log, dt_bias, initial_state (or the state pool), out, the final state and the
checkpoints split on H over one mesh axis, so each device runs the kernels on its own
H / devices heads (the launch heuristic sees the local head count) and nothing crosses devices.
cu_seqlens and state_indices are replicated. Arrays given in another layout are resharded to
this one (on meshes with Explicit axes) or by shard_map itself (Auto axes).

    mesh = jax.make_mesh((4,), ("tp",))
    out, state = jax.jit(functools.partial(
        jax_kda.kda_prefill_sharded, mesh=mesh, head_axis="tp", output_final_state=True))(
        q, k, v, g, beta, A_log, dt_bias)

`mesh=None` takes the context mesh (`with jax.set_mesh(mesh):`). Other mesh axes are left alone:
arrays sharded on them (for example B over a data-parallel axis) are gathered to the head layout,
so shard only H, or wrap your own shard_map around kda_prefill when you shard more axes.

Plain `jax.jit(kda_prefill)` on head-sharded inputs partitions over heads too (jax_kda.
_partitioning); this function is the form that also exports (jax.export) on several devices.
"""

from __future__ import annotations

import functools

import jax

from . import _partitioning
from .api import _local_decode, _local_prefill, kda_decode, kda_prefill


def _mesh_and_heads(fn: str, mesh, head_axis: str, heads):
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                f"{fn}: no mesh: pass mesh=... or call it under `with jax.set_mesh(mesh):`"
            )
    if head_axis not in mesh.axis_names:
        raise ValueError(
            f"{fn}: head_axis {head_axis!r} is not an axis of the mesh (axes {mesh.axis_names})"
        )
    devices = mesh.shape[head_axis]
    if heads is not None and heads % devices:
        raise ValueError(
            f"{fn}: the head count H = {heads} must be a multiple of the size of mesh axis "
            f"{head_axis!r} ({devices})"
        )
    return mesh


def kda_prefill_sharded(
    q, k, v, g, beta, A_log, dt_bias, *, mesh=None, head_axis="tp", initial_state=None,
    cu_seqlens=None, output_final_state=False, state_indices=None, checkpoint_every=None,
    **options,
):
    """kda_prefill with every head-carrying array split on H over mesh axis `head_axis`.

    Args:
      q ... dt_bias, initial_state, cu_seqlens, output_final_state, state_indices,
        checkpoint_every: as kda_prefill.
      mesh: a Mesh or AbstractMesh, or None for the context mesh (jax.set_mesh).
      head_axis: the mesh axis that splits H; H must be a multiple of its size.
      **options: any other kda_prefill keyword (scale, lower_bound, inverse, backend, column_split,
        recurrence).

    Returns:
      as kda_prefill, every result sharded on H over head_axis.
    """
    heads = q.shape[2] if getattr(q, "ndim", 0) == 4 else None
    mesh = _mesh_and_heads("kda_prefill_sharded", mesh, head_axis, heads)
    arrays = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, state_indices, None)
    out, final_state, checkpoints = _partitioning.shard_over_heads(
        functools.partial(_local_prefill,
                          options=dict(options, checkpoint_every=checkpoint_every)),
        _partitioning.PREFILL, arrays, mesh, head_axis)
    final_state = final_state if output_final_state else None
    if checkpoint_every is None:
        return out, final_state
    return out, final_state, checkpoints


def kda_decode_sharded(q, k, v, g, beta, A_log, dt_bias, *, state, mesh=None, head_axis="tp",
                       state_indices=None, **options):
    """kda_decode with every head-carrying array (the state pool included) split on H over mesh
    axis `head_axis`; arguments and results as kda_decode."""
    heads = q.shape[2] if getattr(q, "ndim", 0) == 4 else None
    mesh = _mesh_and_heads("kda_decode_sharded", mesh, head_axis, heads)
    arrays = (q, k, v, g, beta, A_log, dt_bias, state, state_indices)
    out, new_state, states = _partitioning.shard_over_heads(
        functools.partial(_local_decode, options=options), _partitioning.DECODE, arrays, mesh,
        head_axis)
    if options.get("output_intermediate_states"):
        return out, new_state, states
    return out, new_state


__all__ = ["head_specs", "kda_decode", "kda_decode_sharded", "kda_prefill", "kda_prefill_sharded"]


def head_specs(head_axis: str) -> dict:
    """The PartitionSpec of every head-carrying argument/result of kda_prefill."""
    from jax.sharding import PartitionSpec as P

    per_token = P(None, None, head_axis, None)  # [B, T, H, 128]
    state = P(None, head_axis, None, None)  # [N or P, H, 128, 128]
    return {
        "q": per_token, "k": per_token, "v": per_token, "g": per_token,
        "beta": P(None, None, head_axis), "A_log": P(head_axis), "dt_bias": P(head_axis, None),
        "initial_state": state, "cu_seqlens": P(), "state_indices": P(), "out": per_token,
        "final_state": state, "checkpoints": state,
    }
