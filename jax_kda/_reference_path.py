"""The pure-JAX path of kda_prefill and kda_decode: jax_kda.reference on gathered pool rows, with
the kernels' conventions for pools (padding slots read and write nothing, their outputs are
zero) and checkpoints; grouped value heads by repeating q and k to the value heads
(jax_kda.head_groups). Runs anywhere and is differentiable."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _sequence_parallel, _state_pool, head_groups, reference, reference_fp32
from .checkpoints import checkpoint_offsets
from .problem import DecodeProblem, Problem


# Jitted so that eager calls compile once per shape instead of dispatching op by op (seconds per
# call on CPU); inside an outer jit it is simply inlined.
@functools.partial(jax.jit, static_argnames=("problem",))
def prefill(q, k, v, g, beta, A_log, dt_bias, state, cu, state_indices, ckpt_offsets=None, *,
            problem: Problem):
    """(out, final state or updated pool, checkpoints or None), as the kernel path returns."""
    q, k = (head_groups.repeat_qk(x, problem.group) for x in (q, k))
    pooled = state_indices is not None
    state0 = _state_pool.gather(state, state_indices) if pooled else state
    if problem.numerics == "fp32":
        out, final, *ckpts = _prefill_fp32(q, k, v, g, beta, A_log, dt_bias, state0, cu,
                                           ckpt_offsets, problem=problem)
    else:
        out, final, *ckpts = reference.kda_prefill_reference(
            q, k, v, g, beta, A_log, dt_bias, scale=problem.scale,
            lower_bound=problem.lower_bound, initial_state=state0, cu_seqlens=cu,
            inverse=problem.inverse, checkpoint_every=problem.checkpoint_every,
            checkpoint_offsets=ckpt_offsets,
            checkpoint_rows=problem.checkpoint_capacity if problem.checkpoint_every else None,
        )
    ckpts = ckpts[0].astype(problem.state_dtype) if ckpts else None
    if not pooled:
        return out, final.astype(problem.state_dtype), ckpts
    padding = ~_state_pool.valid_rows(state_indices, problem.pool_rows)
    out = jnp.where(_state_pool.padding_tokens(problem, cu, padding)[..., None, None], 0,
                    out).astype(out.dtype)
    if ckpts is not None:
        ckpts = jnp.where(_padding_checkpoints(problem, cu, padding, ckpt_offsets)[
            :, None, None, None], 0, ckpts).astype(ckpts.dtype)
    return out, _state_pool.scatter(state, state_indices, final), ckpts


def _prefill_fp32(q, k, v, g, beta, A_log, dt_bias, state0, cu, ckpt_offsets, *,
                  problem: Problem):
    """The fp32 reference, serial or cut into pieces as the kernel path cuts them (the same
    plan for "auto", with the visible GPU's SM count or the H200's): (out, final state), plus
    the checkpoints with checkpoint_every (always serial)."""
    run = functools.partial(reference_fp32.kda_prefill_reference_fp32, scale=problem.scale,
                            lower_bound=problem.lower_bound, inverse=problem.inverse)
    length = _sequence_parallel.resolved_length(problem)
    if problem.checkpoint_every is not None:
        return run(q, k, v, g, beta, A_log, dt_bias, initial_state=state0, cu_seqlens=cu,
                   checkpoint_every=problem.checkpoint_every, checkpoint_offsets=ckpt_offsets,
                   checkpoint_rows=problem.checkpoint_capacity)
    if length is None:
        return run(q, k, v, g, beta, A_log, dt_bias, initial_state=state0, cu_seqlens=cu)
    B, T = problem.batch, problem.seqlen
    packed = lambda x: x.reshape((1, B * T) + x.shape[2:])
    q1, k1, g1, beta1 = (packed(x) for x in (q, k, g, beta))

    def recurrence(_, values, piece_cu, states):  # the reference has no separate workspace
        return run(q1, k1, values, g1, beta1, A_log, dt_bias, initial_state=states,
                   cu_seqlens=piece_cu)

    out, final = _sequence_parallel.prefill(lambda piece_cu: None, recurrence, packed(v), state0,
                                            cu, problem=problem, length=length)
    return out.reshape(v.shape), final


def _padding_checkpoints(problem: Problem, cu, padding, offsets=None):
    """bool [capacity]: checkpoint rows that belong to a padding sequence."""
    if cu is None:
        cu = jnp.arange(problem.batch + 1, dtype=jnp.int32) * problem.seqlen
    if offsets is None:
        offsets = checkpoint_offsets(cu, problem.checkpoint_every, problem.batch * problem.seqlen)
    row = jnp.arange(problem.checkpoint_capacity)
    owner = jnp.searchsorted(offsets, row, side="right") - 1
    inside = (owner >= 0) & (owner < problem.num_seqs)
    return inside & padding[jnp.clip(owner, 0, problem.num_seqs - 1)]


@functools.partial(jax.jit, static_argnames=("problem",))
def decode(q, k, v, g, beta, A_log, dt_bias, state, state_indices, *, problem: DecodeProblem):
    """(out, new state or updated pool, intermediate states or None): the prefill reference on
    the t tokens (B = N, T = t), and on each prefix of them for the intermediate states."""
    q, k = (head_groups.repeat_qk(x, problem.group) for x in (q, k))
    pooled = state_indices is not None
    state0 = _state_pool.gather(state, state_indices) if pooled else state
    prefill_reference = (reference_fp32.kda_prefill_reference_fp32 if problem.numerics == "fp32"
                         else reference.kda_prefill_reference)
    run = functools.partial(prefill_reference, scale=problem.scale,
                            lower_bound=problem.lower_bound, initial_state=state0,
                            inverse=problem.inverse)
    out, final = run(q, k, v, g, beta, A_log, dt_bias)
    states = None
    if problem.intermediate_states:
        prefixes = [run(*(x[:, :i] for x in (q, k, v, g, beta)), A_log, dt_bias)[1]
                    for i in range(1, problem.tokens + 1)]
        states = jnp.stack(prefixes, axis=1).astype(problem.state_dtype)  # [N, t, H, 128, 128]
    if not pooled:
        return out, final.astype(problem.state_dtype), states
    valid = _state_pool.valid_rows(state_indices, problem.pool_rows)
    out = jnp.where(valid[:, None, None, None], out, 0).astype(out.dtype)
    if states is not None:
        states = jnp.where(valid.reshape(-1, 1, 1, 1, 1), states, 0).astype(states.dtype)
    return out, _state_pool.scatter(state, state_indices, final), states
