"""The GPU kernel path of kda_prefill and kda_decode: the kernels' flat layout, the defaults the
custom calls need (cu_seqlens for batched input, a zero state, identity pool indices), the launch
resolved (once) for the size the kernels see, and the custom calls themselves (jax_kda._ffi).

`prefill` and `decode` take arrays of exactly their problem's shapes: jax_kda.api runs them after
the head partitioning (jax_kda._partitioning) and the vmap folding (jax_kda._batching). With
grouped value heads q and k reach the custom calls as they are, on problem.qk_heads heads: the
prepare and decode kernels read query/key head j // G for value head j themselves.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from . import _ffi, _launch, _sequence_parallel, _state_pool
from ._manual_axes import vary_like
from .checkpoints import checkpoint_offsets
from .contract import HEAD_DIM
from .problem import DecodeProblem, Problem


def prepare_workspace(q, k, g, beta, A_log, dt_bias, cu, *, problem: Problem):
    """The prepare kernel of problem.numerics on [B, T, ...] inputs (q, k on Hk heads, g, beta,
    A_log, dt_bias on H): the workspace [H, slots, record bytes]."""
    return _ffi.prepare_call(
        _flat(q), _flat(k), _flat(g), _flat(beta), A_log, dt_bias, cu,
        scale=problem.scale, lower_bound=problem.lower_bound, inverse=problem.inverse,
        numerics=problem.numerics,
    )


def plain_recurrence(v, beta, workspace, cu, state, *, problem: Problem, launch):
    """The recurrence kernel of plain prefill (no pool, no checkpoints): it takes and returns a
    bf16 state; an f32 one is rounded on entry and the result widened, which is what the
    numerics do anyway. Returns (out [B, T, H, 128], final state in problem.state_dtype)."""
    # the kernel's state dtype: bf16 (flashkda), f32 (fp32: a bf16 state is widened exactly)
    state = _kernel_state(state, problem,
                          jnp.float32 if problem.numerics == "fp32" else jnp.bfloat16)
    out, final = _ffi.recurrence_call(_flat(v), _flat(beta), workspace, cu, state,
                                      launch=launch, numerics=problem.numerics)
    return out.reshape(v.shape), final.astype(problem.state_dtype)


def _kernel_state(state, problem: Problem, dtype):
    """The per-sequence initial state [N, H, 128, 128] a prefill kernel takes, in `dtype`:
    zeros for None, else `state` converted."""
    if state is None:
        return jnp.zeros((problem.num_seqs, problem.heads, HEAD_DIM, HEAD_DIM), dtype)
    return state.astype(dtype)


def _flat(x):
    """[B, T, ...] -> [B*T, ...]: the kernels see every call as packed sequences."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def prefill(q, k, v, g, beta, A_log, dt_bias, state, cu, state_indices, ckpt_offsets, *,
            problem: Problem):
    """(out [B, T, H, 128], final state, checkpoints or None) from the kernels, for arrays of
    exactly `problem`'s shapes (vmap folding and head partitioning happen around this).

    state: None (zeros), the per-sequence initial state [N, H, 128, 128], or with state_indices a
    pool [P, H, 128, 128] (the result is then the updated pool); bf16 or f32. cu: None (batched)
    or int32 [N+1]. ckpt_offsets: None (computed from cu) or int32 [N+1]."""
    B, T, H, N = problem.batch, problem.seqlen, problem.heads, problem.num_seqs
    if cu is None:
        cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    cu = cu.astype(jnp.int32)
    length = _sequence_parallel.resolved_length(problem)  # None unless fp32 cuts the sequences
    if length is not None:
        return _fp32_on_rows(
            functools.partial(_segmented, q, k, v, g, beta, A_log, dt_bias, cu, problem=problem,
                              length=length),
            v, cu, state, state_indices, problem=problem)
    launch = _launch.resolve(problem.recurrence, num_seqs=N, heads=H, numerics=problem.numerics,
                             tokens=B * T, baseline_allowed=problem.plain)
    workspace = prepare_workspace(q, k, g, beta, A_log, dt_bias, cu, problem=problem)
    if problem.plain:
        out, final = plain_recurrence(v, beta, workspace, cu, state, problem=problem,
                                      launch=launch)
        return vary_like(out, v), vary_like(final, v), None

    pool = state
    if pool is None:
        pool = jnp.zeros((N, H, HEAD_DIM, HEAD_DIM), problem.state_dtype)
    if state_indices is None:
        state_indices = _state_pool.identity_indices(N)
    if problem.checkpoint_every is None:
        ckpt_offsets = jnp.zeros((N + 1,), jnp.int32)
    elif ckpt_offsets is None:
        ckpt_offsets = checkpoint_offsets(cu, problem.checkpoint_every, B * T)
    # Rows no sequence writes (padding slots, the slack of packed input) stay zero.
    ckpts = jnp.zeros((problem.checkpoint_capacity, H, HEAD_DIM, HEAD_DIM), pool.dtype)
    out, pool, ckpts = _ffi.recurrence_pool_call(
        _flat(v), _flat(beta), workspace, cu, state_indices, ckpt_offsets, pool, ckpts,
        launch=launch, checkpoint_every=problem.checkpoint_every, numerics=problem.numerics,
    )
    ckpts = None if problem.checkpoint_every is None else vary_like(ckpts, v)
    return vary_like(out.reshape(v.shape), v), vary_like(pool, v), ckpts


def _fp32_on_rows(run, v, cu, state, state_indices, *, problem: Problem):
    """run(initial states [N, ...]) -> (out, final states) in the fp32 mode's sequence-parallel
    path, on a state pool or per-sequence states. A pool's rows are gathered and scattered back
    (XLA updates a donated pool in place); padding slots read zeros, write nothing and get zero
    outputs, as the pool kernels do."""
    if problem.pool_rows is None:
        out, final = run(state)
        return vary_like(out, v), vary_like(final, v), None
    out, final = run(_state_pool.gather(state, state_indices))
    padding = ~_state_pool.valid_rows(state_indices, problem.pool_rows)
    padded = _state_pool.padding_tokens(problem, cu if problem.varlen else None, padding)
    out = jnp.where(padded[..., None, None], jnp.zeros((), out.dtype), out)
    return (vary_like(out, v), vary_like(_state_pool.scatter(state, state_indices, final), v),
            None)


def _segmented(q, k, v, g, beta, A_log, dt_bias, cu, state, *, problem: Problem, length: int):
    """(out, final state) of the fp32 mode with long sequences cut into pieces of `length`
    tokens (jax_kda._sequence_parallel): one prepare kernel, three recurrence kernels."""
    capacity = _sequence_parallel.piece_capacity(
        num_seqs=problem.num_seqs, total_tokens=problem.batch * problem.seqlen,
        varlen=problem.varlen, length=length)
    # the pieces are the kernels' sequences: every pass launches for that many
    launch = _launch.resolve(problem.recurrence, num_seqs=capacity, heads=problem.heads,
                             numerics="fp32")

    def prepare(piece_cu):
        return prepare_workspace(q, k, g, beta, A_log, dt_bias, piece_cu, problem=problem)

    def recurrence(workspace, values, piece_cu, states):
        return _ffi.recurrence_call(_flat(values), _flat(beta), workspace, piece_cu, states,
                                    launch=launch, numerics="fp32")

    out, final = _sequence_parallel.prefill(prepare, recurrence, v, state, cu, problem=problem,
                                            length=length)
    return out.reshape(v.shape), final.astype(problem.state_dtype)


def decode(q, k, v, g, beta, A_log, dt_bias, state, state_indices, *, problem: DecodeProblem):
    """(out [N, t, H, 128], updated state or pool, intermediate states [N, t, H, 128, 128] or
    None) from the fused decode kernel of problem.numerics, for arrays of exactly `problem`'s
    shapes."""
    if state_indices is None:
        state_indices = _state_pool.identity_indices(problem.num_seqs)
    out, pool, states = _ffi.decode_call(
        q, k, v, g, beta, A_log, dt_bias, state_indices, state, scale=problem.scale,
        lower_bound=problem.lower_bound, inverse=problem.inverse,
        intermediate_states=problem.intermediate_states, numerics=problem.numerics,
    )
    states = vary_like(states, v) if problem.intermediate_states else None
    return vary_like(out, v), vary_like(pool, v), states
