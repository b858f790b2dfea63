"""State pools: one state per request slot, read and written by row (state_indices).

Sequence n reads row state_indices[n] and its new state goes back to that row; a negative index,
or one >= P (which cannot be checked under jit), marks a padding slot: nothing is read or written
and its outputs are zero. The kernels do this in place; these helpers give the reference backend
(and anything else that works on gathered rows) the same semantics.
"""

from __future__ import annotations

import jax.numpy as jnp


def valid_rows(state_indices, pool_rows: int):
    """bool [N]: which sequences own a pool row (0 <= index < P)."""
    return (state_indices >= 0) & (state_indices < pool_rows)


def gather(pool, state_indices):
    """[N, ...] rows of the pool, zeros for padding slots."""
    valid = valid_rows(state_indices, pool.shape[0])
    rows = pool[jnp.clip(state_indices, 0, pool.shape[0] - 1)]
    return jnp.where(valid.reshape((-1,) + (1,) * (rows.ndim - 1)), rows, jnp.zeros((), pool.dtype))


def scatter(pool, state_indices, rows):
    """The pool with row state_indices[n] replaced by rows[n] for every non-padding n."""
    valid = valid_rows(state_indices, pool.shape[0])
    target = jnp.where(valid, state_indices, pool.shape[0])  # out of range: dropped
    return pool.at[target].set(rows.astype(pool.dtype), mode="drop")


def fold_indices(state_indices, pool_rows: int):
    """[n, N] indices of n pools of P rows each -> [n * N] indices into the pools stacked as one
    [n * P] pool (element i's rows start at i * P); padding stays padding."""
    n = state_indices.shape[0]
    shifted = state_indices + (jnp.arange(n, dtype=state_indices.dtype) * pool_rows)[:, None]
    return jnp.where(valid_rows(state_indices, pool_rows), shifted, -1).reshape(-1)


def identity_indices(num_seqs: int):
    """Sequence n owns row n (a per-sequence state passed as a pool of N rows)."""
    return jnp.arange(num_seqs, dtype=jnp.int32)


def padding_tokens(problem, cu, padding):
    """bool [B, T]: the tokens of a prefill `problem` (jax_kda.problem.Problem) that belong to a
    padding sequence (padding: bool [N]); cu: None (batched) or int32 [N + 1]."""
    if cu is None:
        return jnp.broadcast_to(padding[:, None], (problem.batch, problem.seqlen))
    bounds = jnp.clip(cu, 0, problem.seqlen)
    token = jnp.arange(problem.seqlen)
    owner = jnp.searchsorted(bounds, token, side="right") - 1  # the sequence holding each token
    inside = (owner >= 0) & (owner < problem.num_seqs)
    return (inside & padding[jnp.clip(owner, 0, problem.num_seqs - 1)])[None]
