"""The derivative of kda_prefill on the kernel backends ("auto", "kernel"): a custom VJP around
the call's steps 2-4 (jax_kda.api).

Forward: the kernels (or, under "auto" off CUDA, the reference) exactly as without
differentiation, bitwise the same results; the residuals are the call's inputs. Backward: the
gradient of the exact KDA function (no rounding of either numerics mode is differentiated), in f32,
by jax_kda.reference_backward's chunkwise algorithm: it recomputes every chunk's state from the
inputs and runs the reverse chain of the state gradient, both on the GPU chain kernel
(jax_kda/kernels/state_chain.py) wherever the forward runs the kernels, and the chunk-parallel
gradients as XLA.
Both numerics modes get this gradient; with numerics="flashkda" the forward stays bitwise
FlashKDA's. With grouped value heads the backward returns dq and dk on the Hk query/key heads:
each is the sum of its G value heads' parts, in a fixed pairwise order (deterministic).
docs/training.md says what is differentiated and how accurate it is.

The backward is partitioned as the forward is (jax_kda._partitioning: shard_map on Explicit mesh
axes, custom_partitioning otherwise): each device differentiates its own heads and, for a batched
call split on B, its own rows, with no collective; only the sums of dA_log and ddt_bias over the
batch rows run after it (`partitioned_backward`). Under vmap custom_partitioning has no batching
rule, so there the backward is plain JAX, partitioned by XLA.

The residuals (the inputs, nothing else: the backward recomputes every state) carry the name
INPUTS_NAME ("kda_prefill_inputs", jax.ad_checkpoint.checkpoint_name) for jax.checkpoint
policies; docs/training.md, "Memory".

Reverse mode only (jax.grad, jax.vjp, jax.value_and_grad); forward mode (jvp, jacfwd) is refused
by JAX for a custom VJP. Not differentiable, with KdaInferenceOnlyError when something asks for a
derivative: kda_decode, state pools (state_indices), checkpoint_every and explicit
sequence_parallel segment counts.
"""

from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name

from . import _ffi, _partitioning, reference_backward
from .problem import Problem

INPUTS_NAME = "kda_prefill_inputs"  # the residuals: the call's inputs q, k, ... cu_seqlens


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
def with_gradients(run, layout, present, split, problem, *given):
    """run(layout, present, split, problem, *given): steps 2-4 of a kernel-backend call on the
    present arrays (their positions in layout order), differentiable as the module docstring
    says."""
    return run(layout, present, split, problem, *given)


def _forward(run, layout, present, split, problem, *given):
    why = why_not_differentiable(problem)
    if why is not None:
        raise KdaInferenceOnlyError(f"jax_kda: no derivative: {why}.")
    # Named so that a jax.checkpoint policy around a layer keeps (save_only_these_names) or
    # drops (save_any_names_but_these) them; the forward reads the named values, so a backward
    # that recomputes the outputs starts from the saved inputs where a policy keeps them.
    given = tuple(checkpoint_name(x, INPUTS_NAME) for x in given)
    return run(layout, present, split, problem, *given), given


def _backward(run, layout, present, split, problem, given, cotangents):
    # A cotangent computed from the output (a loss of it) would let XLA fold the forward into the
    # backward's products; on CPU (the reference forward) its simplifier then built a batched dot
    # with its batch axes in the wrong order, failing the HLO verifier (tests/test_grad.py).
    cotangents = jax.lax.optimization_barrier(cotangents)
    arrays = dict(zip(present, given))
    d_out, d_final_state, _ = cotangents
    args = (*(arrays.get(i) for i in range(9)), d_out, d_final_state)  # _partitioning.BACKWARD
    grads = partitioned_backward(args, problem, split)
    by_position = dict(enumerate(grads))  # positions 0-7: q ... dt_bias, initial state
    return tuple(by_position.get(i) if i < 8 else None for i in present)


def _chains(problem) -> str:
    """Where the backward's serial chains run: the GPU chain kernel wherever the forward runs
    the kernels (reference_backward.CHAINS)."""
    if problem.backend == "kernel":
        return "kernel"
    return "auto" if _ffi.kernels_usable_for_auto() else "scan"


with_gradients.defvjp(_forward, _backward)


def partitioned_backward(args, problem, split):
    """The gradients (q ... dt_bias, initial state or None) from the backward's arguments in
    _partitioning.BACKWARD order, partitioned as the forward is: under shard_map with `split`, else
    custom_partitioning. Each device computes the gradients of its heads and batch rows with no
    collective; dA_log and ddt_bias come out of that as sums over each batch row
    ([B, H, 128]), and their sum over the rows (reference_backward.head_parameter_gradients, the
    order the unsharded backward uses) runs after it: where the batch is split over devices that
    is where the rows' partial sums cross devices (a data-parallel gradient reduction of
    B x H x 128 f32 values)."""
    layout = _partitioning.BACKWARD
    if split is not None:
        results = _partitioning.shard_mapped_call(backward_step, layout, args, problem, split)
    else:
        out_present = tuple(i for i in range(8) if i < 7 or args[7] is not None)
        results = _partitioned_without_vmap(args, problem, out_present)
    dq, dk, dv, dg, dbeta, dA_log_rows, ddt_bias_rows, dstate = results
    dA_log_rows, ddt_bias_rows = (_partitioning.gathered_batch(x, split, head_axis=1)
                                  for x in (dA_log_rows, ddt_bias_rows))
    dA_log, ddt_bias = reference_backward.head_parameter_gradients(dA_log_rows, ddt_bias_rows)
    A_log, dt_bias = args[5], args[6]
    return (dq, dk, dv, dg, dbeta, dA_log.astype(A_log.dtype), ddt_bias.astype(dt_bias.dtype),
            dstate)


def _partitioned_without_vmap(args, problem, out_present):
    """custom_partitioning of backward_step; under vmap (custom_partitioning has no batching
    rule) the vmapped backward_step itself, partitioned by XLA as plain JAX."""

    @jax.custom_batching.custom_vmap
    def call(*xs):
        return _partitioning.partitioned_call(backward_step, _partitioning.BACKWARD, xs, problem,
                                              out_present)

    @call.def_vmap
    def _rule(axis_size, in_batched, *xs):
        in_axes = tuple(0 if batched else None for batched in in_batched)
        results = jax.vmap(functools.partial(backward_step, problem=problem), in_axes=in_axes,
                           axis_size=axis_size)(*xs)
        return results, tuple(None if x is None else True for x in results)

    return call(*args)


def backward_step(q, k, v, g, beta, A_log, dt_bias, state, cu, d_out, d_final_state, *, problem):
    """kda_prefill's gradients on one device's heads and rows (or all of them): dq ... dbeta and
    the initial state's in their primals' dtypes, dA_log and ddt_bias as f32 sums over each batch
    row, [B, H, 128]."""
    grads = reference_backward.kda_prefill_vjp_f32(
        q, k, v, g, beta, A_log, dt_bias, state, cu, d_out, d_final_state, scale=problem.scale,
        lower_bound=problem.lower_bound, chains=_chains(problem), per_batch_row=True)
    rounded = reference_backward.in_primal_dtypes(
        grads._replace(dA_log=None, ddt_bias=None), (q, k, v, g, beta, None, None, state))
    return (*rounded[:5], grads.dA_log, grads.ddt_bias, rounded[7])
