"""kda_prefill and kda_decode on arrays split over an explicit mesh, with no collectives.

KDA heads are independent: every input except cu_seqlens and state_indices carries the head axis
H (q and k: Hk, with grouped value heads), and so do the outputs. `kda_prefill_sharded` runs
kda_prefill under `jax.shard_map` with q, k, v, g, beta, A_log, dt_bias, initial_state (or the
state pool), out, the final state and the checkpoints split on H over one mesh axis, so each
device runs the kernels on its own H / devices heads (the launch heuristic sees the local head
count; with grouped heads each device holds whole groups, Hk / devices query/key heads) and
nothing crosses devices.
The rows of a batched call are independent sequences too: with `batch_axis` the batch axis B of
q, k, v, g, beta, initial_state, out and the final state is split over those mesh axes as well
(data parallelism; each device runs its rows of its heads). Packed calls (cu_seqlens, B = 1),
state pools and checkpoints do not split B: batch_axis raises for them.
cu_seqlens and state_indices are replicated. Arrays given in another layout are resharded to
this one (on meshes with Explicit axes) or by shard_map itself (Auto axes).

    mesh = jax.make_mesh((2, 4), ("data", "tp"))
    out, state = jax.jit(functools.partial(
        jax_kda.kda_prefill_sharded, mesh=mesh, head_axis="tp", batch_axis="data",
        output_final_state=True))(q, k, v, g, beta, A_log, dt_bias)

The arguments are checked as kda_prefill / kda_decode check them, on the global shapes and, where
concrete, the values of cu_seqlens and state_indices. `mesh=None` takes the context mesh
(`with jax.set_mesh(mesh):`). Other mesh axes are left alone: arrays sharded on them (for example
B over a data-parallel axis not named in batch_axis) are gathered to the layout above.

The gradient (jax.grad of a loss of the outputs) is computed under the same split: each device
differentiates its heads and rows; only the sums of A_log's and dt_bias's gradients over the batch
rows cross the batch axes, after the per-device work (jax_kda._vjp).

Plain `jax.jit(kda_prefill)` on sharded inputs partitions the same way (jax_kda._partitioning);
this function is the form that also exports (jax.export) on several devices.
"""

from __future__ import annotations

import math

import jax

from . import _checks, _partitioning, api


def _split(fn: str, mesh, head_axis, problem, batch_axis=None):
    """The MeshSplit, checked: the mesh (or the context mesh) has the axes, the head axis's size
    divides the head counts (Hk, hence H = G Hk: each device holds whole groups) and the batch
    axes' size the batch of a call that can split it."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                f"{fn}: no mesh: pass mesh=... or call it under `with jax.set_mesh(mesh):`"
            )
    if head_axis is None and batch_axis is None:
        raise ValueError(f"{fn}: head_axis and batch_axis are both None: nothing to split")
    if head_axis is not None and head_axis not in mesh.axis_names:
        raise ValueError(
            f"{fn}: head_axis {head_axis!r} is not an axis of the mesh (axes {mesh.axis_names})"
        )
    batch_names = () if batch_axis is None else (
        (batch_axis,) if isinstance(batch_axis, str) else tuple(batch_axis))
    for name in batch_names:
        if name not in mesh.axis_names or name == head_axis:
            raise ValueError(
                f"{fn}: batch_axis {batch_axis!r} must name axes of the mesh (axes "
                f"{mesh.axis_names}) other than head_axis {head_axis!r}")
    devices = 1 if head_axis is None else mesh.shape[head_axis]
    if problem.qk_heads % devices:
        what = (f"H = {problem.heads}" if problem.group == 1 else
                f"Hk = {problem.qk_heads} of q and k (each device holds whole groups of "
                f"H // Hk = {problem.group} value heads with their query/key head)")
        raise ValueError(
            f"{fn}: the head count {what} must be a multiple of the size of mesh axis "
            f"{head_axis!r} ({devices})"
        )
    if batch_names:
        _partitioning.check_batch_split(
            fn, problem, math.prod(mesh.shape[name] for name in batch_names), batch_axis)
    return _partitioning.MeshSplit(mesh, head_axis, batch_axis)


def kda_prefill_sharded(
    q, k, v, g, beta, A_log, dt_bias, *, mesh=None, head_axis="tp", batch_axis=None, scale=None,
    lower_bound=-5.0, initial_state=None, output_final_state=False, cu_seqlens=None,
    state_indices=None, checkpoint_every=None, numerics="flashkda", inverse="stable",
    sequence_parallel="auto", recurrence="auto", backend="auto",
):
    """kda_prefill with every head-carrying array split on H over mesh axis `head_axis` and, with
    `batch_axis`, every batch-carrying one on B over those mesh axes.

    Args:
      q ... backend: as kda_prefill, checked as kda_prefill checks them (on the global shapes).
      mesh: a Mesh or AbstractMesh, or None for the context mesh (jax.set_mesh).
      head_axis: the mesh axis that splits H (and q's and k's Hk with it: each device holds whole
        groups of H // Hk value heads with their query/key head); Hk must be a multiple of its
        size. None: the heads are not split (then batch_axis must be given).
      batch_axis: None (default), or a mesh axis name or tuple of names other than head_axis that
        split the batch: axis 0 of q, k, v, g, beta, initial_state, out and the final state, so
        each device runs its own rows (sequences) of its own heads. Only for batched calls
        (no cu_seqlens, state_indices or checkpoint_every: ValueError), with B a multiple of the
        axes' size.

    Returns:
      as kda_prefill, every result sharded on H over head_axis (and on B over batch_axis).
      Differentiable as kda_prefill, the backward split the same way.
    """
    fn = "kda_prefill_sharded"
    problem = _checks.check_prefill(
        q, k, v, g, beta, A_log, dt_bias, scale=scale, lower_bound=lower_bound,
        initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, state_indices=state_indices, checkpoint_every=checkpoint_every,
        numerics=numerics, inverse=inverse, sequence_parallel=sequence_parallel,
        recurrence=recurrence, backend=backend, fn=fn)
    cu = None if cu_seqlens is None else cu_seqlens.astype("int32")
    arrays = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu, state_indices, None)
    out, final_state, checkpoints = api.run_checked(
        arrays, problem, split=_split(fn, mesh, head_axis, problem, batch_axis))
    final_state = final_state if output_final_state else None
    if checkpoint_every is None:
        return out, final_state
    return out, final_state, checkpoints


def kda_decode_sharded(
    q, k, v, g, beta, A_log, dt_bias, *, state, mesh=None, head_axis="tp", state_indices=None,
    scale=None, lower_bound=-5.0, output_intermediate_states=False, numerics="flashkda",
    inverse="stable", backend="auto",
):
    """kda_decode with every head-carrying array (the state pool included) split on H over mesh
    axis `head_axis`; arguments (checked as kda_decode checks them) and results as kda_decode."""
    fn = "kda_decode_sharded"
    problem = _checks.check_decode(
        q, k, v, g, beta, A_log, dt_bias, state=state, state_indices=state_indices, scale=scale,
        lower_bound=lower_bound, output_intermediate_states=output_intermediate_states,
        numerics=numerics, inverse=inverse, backend=backend, fn=fn)
    arrays = (q, k, v, g, beta, A_log, dt_bias, state, state_indices)
    out, new_state, states = api.run_checked(
        arrays, problem, split=_split(fn, mesh, head_axis, problem))
    if output_intermediate_states:
        return out, new_state, states
    return out, new_state


__all__ = ["head_specs", "kda_decode_sharded", "kda_prefill_sharded"]


def head_specs(head_axis: str | None, batch_axis=None) -> dict:
    """The PartitionSpec of every head-carrying argument/result of kda_prefill, split on H over
    `head_axis` and, with `batch_axis` (batched calls only), on B over those mesh axes."""
    from jax.sharding import PartitionSpec as P

    per_token = P(batch_axis, None, head_axis, None)  # [B, T, H, 128]
    state = P(batch_axis, head_axis, None, None)  # [N, H, 128, 128]
    return {
        "q": per_token, "k": per_token, "v": per_token, "g": per_token,
        "beta": P(batch_axis, None, head_axis), "A_log": P(head_axis),
        "dt_bias": P(head_axis, None), "initial_state": state, "cu_seqlens": P(),
        "state_indices": P(), "out": per_token, "final_state": state,
        "checkpoints": P(None, head_axis, None, None),
    }
