"""vmap of the kernel path: fold the vmapped axis into an axis the kernels already loop over.

The custom calls have no batching rule of their own; without one JAX would fall back to calling
them once per vmapped element. Instead `with_folding_vmap` gives the kernel path a
`jax.custom_batching.custom_vmap` rule that makes ONE kernel call for the whole vmapped batch:

- fixed-length inputs [B, T, H, 128] vmapped n times: one call with batch n*B (a free reshape);
- varlen inputs (B = 1, cu_seqlens [N+1]): the n token streams are concatenated along T and
  cu_seqlens is offset per element, one call with n*N sequences (cu_seqlens may itself be vmapped);
- A_log or dt_bias vmapped (per-element head parameters): the elements become extra heads, one call
  with n*H heads and n*Hk query/key heads, element i's heads after element i-1's on both, so that
  its value heads still read its own query/key heads with grouped heads (needs a transpose of the
  inputs, so it is used only when the parameters differ);
- A_log/dt_bias vmapped together with cu_seqlens or state_indices: no single call fits; the
  elements run one after the other with lax.map (still the kernels, not JAX's fallback).

State pools (state_indices) fold with them: the n pools are stacked into one of n*P rows and each
element's indices are shifted to its own rows. Checkpoints keep each element's packing: element i's
rows are [i*C, (i+1)*C) of the folded array (C = one element's capacity).

The folded call goes through the same wrapper again, so nested vmaps fold too. The launch heuristic
(column split) is evaluated for the folded shape unless the caller fixed it. Folding into N assumes
the contract cu_seqlens[N] = T of each element (checked eagerly, unknowable under jit); with
malformed values the last sequence of an element absorbs its trailing tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from . import _state_pool
from .checkpoints import checkpoint_offsets
from .problem import Problem

# Argument order of every function wrapped here (everything from `state` on may be None).
ARG_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "cu", "state_indices",
             "ckpt_offsets")
_TOKEN_ARGS = ARG_NAMES[:5]
_HEAD_PARAMS = ("A_log", "dt_bias")


def with_folding_vmap(core, problem: Problem):
    """Wraps core(*arrays in ARG_NAMES order, problem) -> (out, final_state, checkpoints) with the
    folding vmap rule. checkpoints may be None (no checkpoint_every)."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return core(*args, problem=problem)

    @call.def_vmap
    def _rule(axis_size, in_batched, *args):
        result = _fold(core, problem, axis_size, in_batched, args)
        return result, tuple(None if x is None else True for x in result)

    return call


def _fold(core, problem: Problem, n: int, in_batched, args):
    named = dict(zip(ARG_NAMES, args))
    batched = dict(zip(ARG_NAMES, (bool(b) for b in in_batched)))

    def lead(name):  # the vmapped axis in front of every present argument
        x = named[name]
        if x is None or batched[name]:
            return x
        return jnp.broadcast_to(x, (n,) + x.shape)

    if batched["A_log"] or batched["dt_bias"]:
        if batched["cu"] or batched["state_indices"] or batched["ckpt_offsets"]:
            return _one_after_another(core, problem, n, named, batched)
        return _fold_into_heads(core, problem, n, {a: lead(a) for a in ARG_NAMES})
    # Head parameters shared by all elements stay as they are; everything else gets stacked.
    x = dict(named, **{a: lead(a) for a in ARG_NAMES if a not in _HEAD_PARAMS})
    x.update(_fold_states(problem, n, x))
    if problem.varlen:
        return _fold_into_sequences(core, problem, n, x)
    return _fold_into_batch(core, problem, n, x)


def _fold_states(problem: Problem, n: int, x: dict) -> dict:
    """The stacked [n, N or P, ...] states as one pool, with the indices shifted to match."""
    state = x["state"]
    folded = {"state": None if state is None else state.reshape((-1,) + state.shape[2:])}
    if x["state_indices"] is not None:
        folded["state_indices"] = _state_pool.fold_indices(x["state_indices"], problem.pool_rows)
    return folded


def _folded_problem(problem: Problem, n: int, **changes) -> Problem:
    rows = None if problem.pool_rows is None else n * problem.pool_rows
    return dataclasses.replace(problem, pool_rows=rows,
                               checkpoint_capacity=n * problem.checkpoint_capacity, **changes)


def _unfold(n, out_lead, final, ckpts):
    return (out_lead,
            final.reshape((n, -1) + final.shape[1:]),
            None if ckpts is None else ckpts.reshape((n, -1) + ckpts.shape[1:]))


def _fold_into_batch(core, problem, n, x):
    B, N = problem.batch, problem.num_seqs
    merge = lambda a: a.reshape((n * a.shape[1],) + a.shape[2:])
    folded = _folded_problem(problem, n, batch=n * B, num_seqs=n * N)
    out, state, ckpts = with_folding_vmap(core, folded)(
        *(merge(x[a]) for a in _TOKEN_ARGS), x["A_log"], x["dt_bias"], x["state"], None,
        x["state_indices"], None,
    )
    return _unfold(n, out.reshape((n, B) + out.shape[1:]), state, ckpts)


def _fold_into_sequences(core, problem, n, x):
    T, N = problem.seqlen, problem.num_seqs
    # [n, 1, T, ...] -> [1, n*T, ...]: element i owns tokens [i*T, (i+1)*T).
    merge = lambda a: a.reshape((1, n * T) + a.shape[3:])
    shift = (jnp.arange(n, dtype=x["cu"].dtype) * T)[:, None]
    cu = jnp.concatenate([(x["cu"][:, :-1] + shift).reshape(-1),
                          jnp.full((1,), n * T, x["cu"].dtype)])
    offsets = None
    if problem.checkpoint_every is not None:  # element i's checkpoints start at row i * C
        per_element = x["ckpt_offsets"]
        if per_element is None:
            per_element = jax.vmap(lambda c: checkpoint_offsets(c, problem.checkpoint_every, T))(
                x["cu"])
        starts = per_element[:, :-1] + (jnp.arange(n, dtype=jnp.int32)
                                        * problem.checkpoint_capacity)[:, None]
        offsets = jnp.concatenate([starts.reshape(-1), per_element[-1:, -1]
                                   + (n - 1) * problem.checkpoint_capacity])
    folded = _folded_problem(problem, n, seqlen=n * T, num_seqs=n * N)
    out, final, ckpts = with_folding_vmap(core, folded)(
        *(merge(x[a]) for a in _TOKEN_ARGS), x["A_log"], x["dt_bias"], x["state"], cu,
        x["state_indices"], offsets,
    )
    return _unfold(n, out.reshape((n, 1, T) + out.shape[2:]), final, ckpts)


def _fold_into_heads(core, problem, n, x):
    H = problem.heads

    # [n, ..., H, ...] -> [..., n*H, ...]; head_axis: H's index unvmapped
    def to_heads(a, head_axis):
        if a is None:
            return None
        # [..., n, H or Hk, ...]: element i owns heads [i*H, (i+1)*H) (q, k: [i*Hk, (i+1)*Hk)),
        # so its value head i*H + j reads query/key head (i*H + j) // G = i*Hk + j // G
        a = jnp.moveaxis(a, 0, head_axis)
        heads = a.shape[head_axis + 1]
        return a.reshape(a.shape[:head_axis] + (n * heads,) + a.shape[head_axis + 2 :])

    def from_heads(a, head_axis):
        if a is None:
            return None
        a = a.reshape(a.shape[:head_axis] + (n, H) + a.shape[head_axis + 1 :])
        return jnp.moveaxis(a, head_axis, 0)

    shared = lambda name: None if x[name] is None else x[name][0]  # not vmapped (checked above)
    folded = dataclasses.replace(problem, heads=n * H, qk_heads=n * problem.qk_heads)
    out, final, ckpts = with_folding_vmap(core, folded)(
        *(to_heads(x[a], 2) for a in _TOKEN_ARGS),
        to_heads(x["A_log"], 0), to_heads(x["dt_bias"], 0), to_heads(x["state"], 1),
        shared("cu"), shared("state_indices"), shared("ckpt_offsets"),
    )
    return from_heads(out, 2), from_heads(final, 1), from_heads(ckpts, 1)


def _one_after_another(core, problem, n, named, batched):
    call = with_folding_vmap(core, problem)
    mapped = [a for a in ARG_NAMES if named[a] is not None and batched[a]]

    def one(xs):
        given = dict(named, **dict(zip(mapped, xs)))
        return call(*(given[a] for a in ARG_NAMES))

    return lax.map(one, [named[a] for a in mapped])


# kda_decode: q, k, v, g, beta, A_log, dt_bias, state, state_indices -> out, state, states
DECODE_ARG_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "state_indices")


def with_decode_folding_vmap(core, problem):
    """Wraps core(*arrays in DECODE_ARG_NAMES order, problem) -> (out, state, states or None)
    with a vmap rule that folds the vmapped axis into N (the n pools stacked into one, indices
    shifted); vmapped head parameters run the elements one after another."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return core(*args, problem=problem)

    @call.def_vmap
    def _rule(n, in_batched, *args):
        x = dict(zip(DECODE_ARG_NAMES, args))
        batched = dict(zip(DECODE_ARG_NAMES, (bool(b) for b in in_batched)))
        if batched["A_log"] or batched["dt_bias"]:
            mapped = [a for a in DECODE_ARG_NAMES if x[a] is not None and batched[a]]

            def one(xs):
                given = dict(x, **dict(zip(mapped, xs)))
                return call(*(given[a] for a in DECODE_ARG_NAMES))

            result = lax.map(one, [x[a] for a in mapped])
        else:
            lead = {a: v if v is None or batched[a] or a in _HEAD_PARAMS
                    else jnp.broadcast_to(v, (n,) + v.shape) for a, v in x.items()}
            merge = lambda a: a.reshape((-1,) + a.shape[2:])
            idx = lead["state_indices"]
            folded = dataclasses.replace(problem, num_seqs=n * problem.num_seqs,
                                         pool_rows=n * problem.pool_rows)
            out, state, states = with_decode_folding_vmap(core, folded)(
                *(merge(lead[a]) for a in _TOKEN_ARGS), x["A_log"], x["dt_bias"],
                merge(lead["state"]),
                None if idx is None else _state_pool.fold_indices(idx, problem.pool_rows))
            unfold = lambda a: None if a is None else a.reshape((n, -1) + a.shape[1:])
            result = (unfold(out), unfold(state), unfold(states))
        return result, tuple(None if r is None else True for r in result)

    return call
