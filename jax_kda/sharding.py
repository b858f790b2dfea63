"""kda_prefill and kda_decode on head-sharded arrays over an explicit mesh, with no collectives.

KDA heads are independent: every input except cu_seqlens and state_indices carries the head axis
H (q and k: Hk, with grouped value heads), and so do the outputs. `kda_prefill_sharded` runs
kda_prefill under `jax.shard_map` with q, k, v, g, beta, A_log, dt_bias, initial_state (or the
state pool), out, the final state and the checkpoints split on H over one mesh axis, so each
device runs the kernels on its own H / devices heads (the launch heuristic sees the local head
count; with grouped heads each device holds whole groups, Hk / devices query/key heads) and
nothing crosses devices.
cu_seqlens and state_indices are replicated. Arrays given in another layout are resharded to
this one (on meshes with Explicit axes) or by shard_map itself (Auto axes).

    mesh = jax.make_mesh((4,), ("tp",))
    out, state = jax.jit(functools.partial(
        jax_kda.kda_prefill_sharded, mesh=mesh, head_axis="tp", output_final_state=True))(
        q, k, v, g, beta, A_log, dt_bias)

The arguments are checked as kda_prefill / kda_decode check them, on the global shapes and, where
concrete, the values of cu_seqlens and state_indices. `mesh=None` takes the context mesh
(`with jax.set_mesh(mesh):`). Other mesh axes are left alone:
arrays sharded on them (for example B over a data-parallel axis) are gathered to the head layout,
so shard only H, or wrap your own shard_map around kda_prefill when you shard more axes.

Plain `jax.jit(kda_prefill)` on head-sharded inputs partitions over heads too (jax_kda.
_partitioning); this function is the form that also exports (jax.export) on several devices.
"""

from __future__ import annotations

import jax

from . import _checks, api


def _head_mesh(fn: str, mesh, head_axis: str, problem):
    """(mesh, head_axis), checked: the mesh (or the context mesh) has the axis and its size
    divides the head counts (Hk, hence H = G Hk: each device holds whole groups)."""
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
    if problem.qk_heads % devices:
        what = (f"H = {problem.heads}" if problem.group == 1 else
                f"Hk = {problem.qk_heads} of q and k (each device holds whole groups of "
                f"H // Hk = {problem.group} value heads with their query/key head)")
        raise ValueError(
            f"{fn}: the head count {what} must be a multiple of the size of mesh axis "
            f"{head_axis!r} ({devices})"
        )
    return mesh, head_axis


def kda_prefill_sharded(
    q, k, v, g, beta, A_log, dt_bias, *, mesh=None, head_axis="tp", scale=None,
    lower_bound=-5.0, initial_state=None, output_final_state=False, cu_seqlens=None,
    state_indices=None, checkpoint_every=None, numerics="flashkda", inverse="stable",
    sequence_parallel="auto", recurrence="auto", backend="auto",
):
    """kda_prefill with every head-carrying array split on H over mesh axis `head_axis`.

    Args:
      q ... backend: as kda_prefill, checked as kda_prefill checks them (on the global shapes).
      mesh: a Mesh or AbstractMesh, or None for the context mesh (jax.set_mesh).
      head_axis: the mesh axis that splits H (and q's and k's Hk with it: each device holds whole
        groups of H // Hk value heads with their query/key head); Hk must be a multiple of its
        size.

    Returns:
      as kda_prefill, every result sharded on H over head_axis.
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
        arrays, problem, mesh=_head_mesh(fn, mesh, head_axis, problem))
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
        arrays, problem, mesh=_head_mesh(fn, mesh, head_axis, problem))
    if output_intermediate_states:
        return out, new_state, states
    return out, new_state


__all__ = ["head_specs", "kda_decode_sharded", "kda_prefill_sharded"]


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
