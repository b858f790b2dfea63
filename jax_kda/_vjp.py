"""The derivative of kda_prefill on the kernel backends ("auto", "kernel"): a custom VJP around
the call's steps 2-4 (jax_kda.api).

Forward: the kernels (or, under "auto" off CUDA, the reference) exactly as without
differentiation, bitwise the same results; the residuals are the call's inputs (and, with
save_states_every, the saved states: below). Backward: the
gradient of the exact KDA function (no rounding of either numerics mode is differentiated), in f32,
by jax_kda.reference_backward's chunkwise algorithm run as XLA: it recomputes every chunk's state
from the inputs, runs the reverse chain of the state gradient and the chunk-parallel gradients.
Both numerics modes get this gradient; with numerics="flashkda" the forward stays bitwise
FlashKDA's. With grouped value heads the backward returns dq and dk on the Hk query/key heads:
each is the sum of its G value heads' parts, in a fixed pairwise order (deterministic).
docs/training.md says what is differentiated and how accurate it is.

save_states_every = n: the forward also keeps each sequence's f32 state after every n tokens,
the checkpoints (jax_kda.checkpoints' layout) of an fp32-mode forward with checkpoint_every = n
and an f32 initial state, and the backward's state recompute starts afresh at each n-token segment
(reference_backward, step 2). With numerics="fp32" and a call that runs serially whatever size the
kernel path sees (`_sequence_parallel.always_serial`) that forward is the call itself: the
checkpointing recurrence gives the plain one's outputs and final state bitwise. Otherwise (the
flashkda mode; fp32 with sequence_parallel="auto", which may cut long sequences) the call runs as
without it and a second, serial fp32 forward with checkpoints gives the states.

Named residuals (jax.ad_checkpoint.checkpoint_name): INPUTS_NAME on the inputs, STATES_NAME on the
saved states, so that a jax.checkpoint policy around a layer (save_only_these_names,
save_any_names_but_these, ...) keeps or drops them; a dropped residual is recomputed in the
backward (the saved states by re-running their forward). docs/training.md says what each costs.

Reverse mode only (jax.grad, jax.vjp, jax.value_and_grad); forward mode (jvp, jacfwd) is refused
by JAX for a custom VJP. Not differentiable, with KdaInferenceOnlyError when something asks for a
derivative: kda_decode, state pools (state_indices), checkpoint_every and explicit
sequence_parallel segment counts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from . import _sequence_parallel, reference_backward
from .checkpoints import checkpoint_capacity
from .problem import Problem

INPUTS_NAME = "kda_prefill_inputs"  # the residual inputs q, k, v, g, beta, A_log, ... cu_seqlens
STATES_NAME = "kda_prefill_states"  # the saved states of save_states_every
_STATE = 7  # the initial state's position in the layout order (jax_kda._partitioning.PREFILL)


class KdaInferenceOnlyError(NotImplementedError):
    """Raised when something asks for a derivative of a call that has none (kda_decode, state
    pools, checkpoints, explicit sequence-parallel segments)."""


def why_not_differentiable(problem) -> str | None:
    """Why a call has no derivative (None: it has one)."""
    if not isinstance(problem, Problem):
        return "kda_decode is inference-only (a serving step); differentiate kda_prefill"
    if problem.pool_rows is not None:
        return ("state pools (state_indices) are inference-only: pass per-sequence initial "
                "states to differentiate")
    if problem.checkpoint_every is not None:
        return "checkpoint_every is inference-only: leave it None to differentiate"
    if problem.segment_length is not None:
        return ("explicit sequence_parallel segment counts are inference-only: use "
                "sequence_parallel='auto' or 'off' to differentiate")
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def with_gradients(run, layout, present, mesh, problem, *given):
    """run(layout, present, mesh, problem, *given): steps 2-4 of a kernel-backend call on the
    present arrays (their positions in layout order), differentiable as the module docstring
    says."""
    return run(layout, present, mesh, _the_call(problem), *given)


def _the_call(problem: Problem) -> Problem:
    """The call without its residual policy (the same program as without save_states_every)."""
    return dataclasses.replace(problem, save_states_every=None)


def states_problem(problem: Problem) -> Problem:
    """The forward that gives the saved states: problem in the fp32 mode, serial, with
    checkpoint_every = save_states_every and an f32 state (the call's own launch where it names
    a column split, which the fp32 mode's bits do not depend on)."""
    every = problem.save_states_every
    return dataclasses.replace(
        problem, numerics="fp32", inverse="stable", state_dtype=np.dtype(np.float32),
        checkpoint_every=every,
        checkpoint_capacity=checkpoint_capacity(problem.batch, problem.seqlen, problem.varlen,
                                                every),
        recurrence=problem.recurrence if isinstance(problem.recurrence, int) else "auto",
        segment_length=None, plan_segments=False, save_states_every=None)


def one_forward(problem: Problem) -> bool:
    """Whether the states' forward is the call itself (module docstring)."""
    return problem.numerics == "fp32" and _sequence_parallel.always_serial(problem)


def _forward(run, layout, present, mesh, problem, *given):
    why = why_not_differentiable(problem)
    if why is not None:
        raise KdaInferenceOnlyError(f"jax_kda: no derivative: {why}.")
    # the forward reads the named inputs too: a backward that recomputes the outputs (a loss's
    # cotangent may need them) then starts from the saved inputs where a policy keeps them
    given = tuple(checkpoint_name(x, INPUTS_NAME) for x in given)
    if problem.save_states_every is None:
        return run(layout, present, mesh, problem, *given), (given, None)
    # the states' forward reads the initial state in f32 (a bf16 one widened, as the fp32 mode
    # does anyway)
    widened = tuple(x.astype(jnp.float32) if i == _STATE else x for i, x in zip(present, given))
    if one_forward(problem):
        out, final, states = run(layout, present, mesh, states_problem(problem), *widened)
        outputs = (out, final.astype(problem.state_dtype), None)
    else:
        outputs = run(layout, present, mesh, _the_call(problem), *given)
        states = run(layout, present, mesh, states_problem(problem), *widened)[2]
    return outputs, (given, checkpoint_name(states, STATES_NAME))


def _backward(run, layout, present, mesh, problem, residuals, cotangents):
    # A cotangent computed from the output (a loss of it) would let XLA fold the forward into the
    # backward's products; on CPU (the reference forward) its simplifier then built a batched dot
    # with its batch axes in the wrong order, failing the HLO verifier (tests/test_grad.py).
    cotangents = jax.lax.optimization_barrier(cotangents)
    given, saved_states = residuals
    arrays = dict(zip(present, given))
    q, k, v, g, beta, A_log, dt_bias, state, cu = (arrays.get(i) for i in range(9))
    d_out, d_final_state, _ = cotangents
    grads = reference_backward.kda_prefill_vjp(
        q, k, v, g, beta, A_log, dt_bias, state, cu, d_out, d_final_state,
        scale=problem.scale, lower_bound=problem.lower_bound, saved_states=saved_states,
        save_states_every=problem.save_states_every)
    by_position = dict(enumerate(grads))  # positions 0-7: q ... dt_bias, initial state
    return tuple(by_position.get(i) if i < 8 else None for i in present)


with_gradients.defvjp(_forward, _backward)
