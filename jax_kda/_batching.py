"""vmap of the kernel path: fold the vmapped axis into an axis the kernels already loop over.

The custom calls have no batching rule of their own; without one JAX would fall back to calling
them once per vmapped element. Instead `with_folding_vmap` gives the kernel path a
`jax.custom_batching.custom_vmap` rule that makes ONE kernel call for the whole vmapped batch:

- fixed-length inputs [B, T, H, 128] vmapped n times: one call with batch n*B (a free reshape);
- varlen inputs (B = 1, cu_seqlens [N+1]): the n token streams are concatenated along T and
  cu_seqlens is offset per element, one call with n*N sequences (cu_seqlens may itself be vmapped);
- A_log or dt_bias vmapped (per-element head parameters): the elements become extra heads, one call
  with n*H heads (needs a transpose of the inputs, so it is used only when the parameters differ);
- A_log/dt_bias AND cu_seqlens both vmapped: no single call fits; the elements run one after the
  other with lax.map (still the kernels, not JAX's per-primitive fallback).

The folded call goes through the same wrapper again, so nested vmaps fold too. The launch heuristic
(column split) is evaluated for the folded shape unless the caller fixed it; the recurrence kernel
chosen (recurrence="baseline": block_v = 0) is kept for the folded call. Folding into N assumes
the contract cu_seqlens[N] = T of each element (checked eagerly, unknowable under jit); with
malformed values the last sequence of an element absorbs its trailing tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ._checks import Problem

# Argument order of every function wrapped here (state and cu_seqlens may be None).
ARG_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "cu")


def with_folding_vmap(core, problem: Problem):
    """Wraps core(q, k, v, g, beta, A_log, dt_bias, state, cu, *, problem) -> (out, final_state)
    (state [N, H, 128, 128] bf16 or None, cu int32 [N+1] or None) with the folding vmap rule."""

    @jax.custom_batching.custom_vmap
    def call(q, k, v, g, beta, A_log, dt_bias, state, cu):
        return core(q, k, v, g, beta, A_log, dt_bias, state, cu, problem=problem)

    @call.def_vmap
    def _rule(axis_size, in_batched, *args):
        return _fold(core, problem, axis_size, in_batched, args), (True, True)

    return call


def _fold(core, problem: Problem, n: int, in_batched, args):
    named = dict(zip(ARG_NAMES, args))
    batched = dict(zip(ARG_NAMES, (bool(b) for b in in_batched)))

    def lead(name):  # every present argument gets the vmapped axis in front
        x = named[name]
        if x is None or batched[name]:
            return x
        return jnp.broadcast_to(x, (n,) + x.shape)

    if batched["A_log"] or batched["dt_bias"]:
        if problem.varlen and batched["cu"]:
            return _one_after_another(core, problem, n, named, batched)
        return _fold_into_heads(core, problem, n, dict(named, **{a: lead(a) for a in ARG_NAMES[:8]}))
    # Head parameters are shared by all elements: keep them as they are, stack everything else.
    x = dict(named, **{a: lead(a) for a in ARG_NAMES if a not in ("A_log", "dt_bias")})
    if problem.varlen:
        return _fold_into_sequences(core, problem, n, x)
    return _fold_into_batch(core, problem, n, x)


def _fold_into_batch(core, problem, n, x):
    B, N = problem.batch, problem.num_seqs
    merge = lambda a: a.reshape((n * a.shape[1],) + a.shape[2:])
    folded = dataclasses.replace(problem, batch=n * B, num_seqs=n * N)
    out, state = with_folding_vmap(core, folded)(
        *(merge(x[a]) for a in ARG_NAMES[:5]), x["A_log"], x["dt_bias"],
        None if x["state"] is None else merge(x["state"]), None,
    )
    return out.reshape((n, B) + out.shape[1:]), state.reshape((n, N) + state.shape[1:])


def _fold_into_sequences(core, problem, n, x):
    T, N = problem.seqlen, problem.num_seqs
    # [n, 1, T, ...] -> [1, n*T, ...]: element i owns tokens [i*T, (i+1)*T).
    merge = lambda a: a.reshape((1, n * T) + a.shape[3:])
    starts = x["cu"][:, :-1] + (jnp.arange(n, dtype=x["cu"].dtype) * T)[:, None]
    cu = jnp.concatenate([starts.reshape(-1), jnp.full((1,), n * T, x["cu"].dtype)])
    state = None if x["state"] is None else x["state"].reshape((n * N,) + x["state"].shape[2:])
    folded = dataclasses.replace(problem, seqlen=n * T, num_seqs=n * N)
    out, final = with_folding_vmap(core, folded)(
        *(merge(x[a]) for a in ARG_NAMES[:5]), x["A_log"], x["dt_bias"], state, cu,
    )
    return out.reshape((n, 1, T) + out.shape[2:]), final.reshape((n, N) + final.shape[1:])


def _fold_into_heads(core, problem, n, x):
    H = problem.heads

    def to_heads(a, head_axis):  # [n, ..., H, ...] -> [..., n*H, ...]; head_axis: H's index unvmapped
        a = jnp.moveaxis(a, 0, head_axis)  # [..., n, H, ...]: element i owns heads [i*H, (i+1)*H)
        return a.reshape(a.shape[:head_axis] + (n * H,) + a.shape[head_axis + 2 :])

    def from_heads(a, head_axis):
        a = a.reshape(a.shape[:head_axis] + (n, H) + a.shape[head_axis + 1 :])
        return jnp.moveaxis(a, head_axis, 0)

    folded = dataclasses.replace(problem, heads=n * H)
    out, final = with_folding_vmap(core, folded)(
        *(to_heads(x[a], 2) for a in ("q", "k", "v", "g", "beta")),
        to_heads(x["A_log"], 0), to_heads(x["dt_bias"], 0),
        None if x["state"] is None else to_heads(x["state"], 1), x["cu"],
    )
    return from_heads(out, 2), from_heads(final, 1)


def _one_after_another(core, problem, n, named, batched):
    call = with_folding_vmap(core, problem)
    mapped = [a for a in ARG_NAMES if named[a] is not None and batched[a]]

    def one(xs):
        given = dict(named, **dict(zip(mapped, xs)))
        return call(*(given[a] for a in ARG_NAMES))

    return lax.map(one, [named[a] for a in mapped])
