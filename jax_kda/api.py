"""The public entry points, kda_prefill and kda_decode.

Every call runs the same steps:
  1. check: shapes, dtypes and options (jax_kda._checks, jax_kda.options) -> a Problem
     (jax_kda.problem), the static description of the call;
  2. partition over heads and (batched calls) batch rows, so that each device runs its own
     (jax_kda._partitioning), and
  3. fold vmap: a vmapped axis becomes batch, sequences or heads of one call (jax_kda._batching),
     in the order the mechanism needs: with heads or batch sharded on Explicit mesh axes, shard_map
     (which batches itself) around the folding; otherwise the folding around
     custom_partitioning (which has no batching rule);
  4. dispatch to a backend for the exact shapes: the GPU kernels (jax_kda._kernel_path, which
     resolves the launch) or the pure-JAX reference (jax_kda._reference_path).
backend="reference" is plain JAX after step 1: XLA partitions, vmaps and differentiates it.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from . import _batching, _checks, _ffi, _kernel_path, _partitioning, _reference_path, _vjp, segments
from .problem import Problem


class KernelsUnavailableError(RuntimeError):
    """Raised by backend="kernel" where the GPU kernels cannot run."""


def kda_prefill(
    q, k, v, g, beta, A_log, dt_bias, *,
    scale=None,
    lower_bound=-5.0,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    segment_ids=None,
    max_segments=None,
    state_indices=None,
    checkpoint_every=None,
    numerics="flashkda",
    inverse="stable",
    sequence_parallel="auto",
    recurrence="auto",
    backend="auto",
):
    """Kimi Delta Attention prefill (chunked delta-rule recurrence), forward only.

    Args:
      q, k: bf16 [B, T, Hk, 128]. v, g: bf16 [B, T, H, 128]; g is the raw gate. Hk = H, or
        grouped value heads (GVA): H a multiple of Hk, value head j reads query/key head
        j // (H // Hk) (fla's convention; the kernels read each query/key head in place, and
        the results are bitwise those of the call with q and k repeated to H heads). Every
        other head-carrying argument and result has the H value heads.
      beta: bf16 [B, T, H], logits (sigmoid is applied inside).
      A_log: f32 [H]. dt_bias: f32 [H, 128].
      scale: output scale > 0, default 128 ** -0.5 (static).
      lower_bound: gate lower bound in [-5, 0) (static).
      initial_state: None (zeros) or bf16/f32 [N, H, 128, 128], stored V-major: state[n, h, v, k];
        with state_indices, a state pool [P, H, 128, 128]; with segment_ids, one per document
        [max_segments, H, 128, 128].
      output_final_state: return the final state (dtype of initial_state; if none is given,
        bf16 with numerics="flashkda" and f32 with numerics="fp32"); with state_indices, the
        updated pool; with segment_ids, one per document (max_segments rows).
      cu_seqlens: None, or int32/int64 [N+1] with B == 1: packed variable-length sequences.
      segment_ids: None, or an integer array [B, T] (int32 as JAX attention kernels take it):
        packed documents (jax_kda.segments). Within a row a run of equal ids is one document; a
        change of id starts the next and every row starts a new one. Each document starts from
        a zero state, or from its row of initial_state; documents are numbered in row-major
        order (document 0 is the first of row 0). There is no padding id: a padding run is one
        more document, with whatever outputs the math gives it (mask its loss). Runs as the
        packed call on cu_seqlens_from_segment_ids(segment_ids, max_segments) (computed on
        device), reshaped: bitwise that call's outputs, states and gradients. Not with cu_seqlens,
        state_indices or checkpoint_every (pass cu_seqlens from
        jax_kda.cu_seqlens_from_segment_ids for those).
      max_segments: required with segment_ids: a static int >= 1 bounding the number of
        documents (B * T always holds them). It is the cost knob: the kernels' grids run over
        (document, head) and hold an initial and a final state (32 KiB per head each in bf16)
        and a workspace slot per document; the backward handles ceil(B * T / 16) +
        max_segments chunks, the reference backend max_segments x ceil(B * T / 16). Pass the
        real bound. With initial_state or
        output_final_state the states are [max_segments, H, 128, 128], row d for
        document d; rows past the last document are empty documents: their final state is the
        initial state as an empty packed sequence returns it (rounded to bf16 in the flashkda
        mode; zeros without an initial state). More documents than max_segments raise when
        segment_ids is concrete; under jit they cannot be counted before the call runs, and
        the outputs and final states are NaN (so is a loss of them).
      state_indices: None, or int32 [N]: sequence n starts from row state_indices[n] of the pool
        `initial_state` and its final state is written back to that row (in place when the pool
        is donated); other rows are untouched. A negative index marks a padding slot: no row is
        read or written and the sequence's outputs are zero. Values >= P and repeated rows are
        rejected when the indices are concrete; under jit they cannot be checked: an index >= P
        is treated as padding, and sequences sharing a row race for it (which one's final state
        it holds is undefined; nothing outside the pool is touched).
      checkpoint_every: None, or a positive multiple n of 16: also return each sequence's states
        after n, 2n, ... tokens strictly before its end (jax_kda.checkpoints says where each is).
        Not with sequence_parallel segments.
      numerics: "flashkda" (default): FlashKDA's bf16 arithmetic, bit for bit (bf16 workspace,
        bf16 state rounded after every chunk). "fp32": the same bf16 inputs and outputs with
        everything between them at close to f32 precision (f32 state for the whole sequence,
        hi/lo bf16 pairs on the tensor cores; docs/fp32_mode.md): ~3x less error against an
        exact computation, bitwise equal across column splits and runs, not bitwise FlashKDA's.
        It takes inverse="stable" and the column-split recurrence; an f32 initial state is read
        without rounding, a bf16 one widened.
      inverse: "stable" (default) or "neumann" (FlashKDA v1's; NaN/Inf on near-collinear keys).
      sequence_parallel: (numerics="fp32"; the default mode is always serial) "auto"
        (default): cut long sequences where a time model of the kernels, fitted on the H200,
        predicts it faster (batched input or one packed sequence, few heads: e.g. one head at
        T = 32768 takes 385 instead of 1600 us);
        "off": serial; or a piece count n: the longest sequence the call can hold (T, or the
        packed length with cu_seqlens) is cut into n pieces of whole chunks and every sequence
        into pieces of that length (shorter ones stay whole), run side by side and combined
        exactly (jax_kda._sequence_parallel, docs/fp32_mode.md section 8). As accurate as the
        serial mode, not bitwise equal to it, so "auto" results depend on the call's shapes
        and the GPU's SM count; "off" or a fixed n does not. The reference backend plans alike.
      recurrence: how the chunk recurrence is launched: "auto" (default: the launch heuristic,
        jax_kda._launch: the baseline kernel for plain flashkda-mode prefill of short sequences,
        <= 1024 tokens on average, with more (sequence, head) pairs than SMs, where it was
        measured fastest; else a column split), "baseline" (one CTA per (sequence, head), state in
        shared memory; numerics="flashkda" without pools or checkpoints) or 16, 32, 64, 128 (the
        column split: each head's 128 value columns over 128 / n CTAs of n columns, state in
        registers). Every launch gives bitwise the same results; the reference backend ignores
        it.
      backend: "auto" (GPU kernels on CUDA when built, else the reference, decided per platform
        at lowering), "kernel" (raise if unavailable) or "reference" (pure JAX, differentiable).

    Returns:
      (out bf16 [B, T, H, 128], final_state or None), and the checkpoints [C, H, 128, 128] in the
      state's dtype as a third element when checkpoint_every is given.

    Every option is checked when the call is traced, before a backend is chosen
    (jax_kda.options), so a call raises the same error on every backend.

    JAX transformations: jax.jit and jax.export work (see jax_kda.export for the disabled safety
    checks); under jax.vmap the kernel path folds the vmapped axis into B, N or H and still makes
    one pair of kernel calls (jax_kda._batching). Reverse-mode derivatives (jax.grad, jax.vjp)
    are the gradient of the exact KDA function (jax_kda._vjp, docs/training.md): the forward is
    the call's own, bitwise; with grouped heads dq and dk sum each query/key head's G value
    heads in a fixed pairwise order (deterministic); pools, checkpoints and explicit
    sequence_parallel counts raise KdaInferenceOnlyError; backend="reference" is plain JAX
    autodiff. Donating initial_state (jax.jit(..., donate_argnames="initial_state")) lets the
    final state reuse its buffer. Under jax.jit, inputs sharded over heads are partitioned over
    heads: each device runs its local heads (jax_kda._partitioning); batched inputs (no
    cu_seqlens, segment_ids, state_indices or checkpoint_every) also sharded over B run each
    device's local rows, forward and backward (a training step on a data x head mesh,
    docs/training.md); jax_kda.kda_prefill_sharded does the same with an explicit mesh and
    exports (a head split keeps whole groups of value heads with their query/key head on one
    device: the device count must divide Hk).
    """
    problem = _checks.check_prefill(
        q, k, v, g, beta, A_log, dt_bias, scale=scale, lower_bound=lower_bound,
        initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, state_indices=state_indices, checkpoint_every=checkpoint_every,
        numerics=numerics, inverse=inverse, sequence_parallel=sequence_parallel,
        recurrence=recurrence, backend=backend, segment_ids=segment_ids,
        max_segments=max_segments)
    tokens = (q, k, v, g, beta)
    cu = None if cu_seqlens is None else cu_seqlens.astype("int32")
    if segment_ids is not None:  # the documents as one packed call (jax_kda.segments)
        # one packed row: the batch cannot stay split over devices (heads still can)
        segment_ids = _partitioning.whole_batch(segment_ids)
        tokens = tuple(segments.pack(_partitioning.whole_batch(x)) for x in tokens)
        cu, num_documents = segments.packed_boundaries(segment_ids, problem.num_seqs)
    arrays = (*tokens, A_log, dt_bias, initial_state, cu, state_indices, None)
    out, final_state, checkpoints = run_checked(arrays, problem)
    if segment_ids is not None:
        out, final_state = segments.unpack(out, final_state, num_documents, batch=q.shape[0],
                                           seqlen=q.shape[1], max_segments=problem.num_seqs)
    final_state = final_state if output_final_state else None
    if checkpoint_every is None:
        return out, final_state
    return out, final_state, checkpoints


def kda_decode(
    q, k, v, g, beta, A_log, dt_bias, *,
    state,
    state_indices=None,
    scale=None,
    lower_bound=-5.0,
    output_intermediate_states=False,
    numerics="flashkda",
    inverse="stable",
    backend="auto",
):
    """A KDA decode (or speculative-verify) step: t <= 16 new tokens per sequence, from and to
    a state per sequence or a state pool.

    Bitwise equal to kda_prefill on the same tokens (B = N, T = t) with the same states.

    Args:
      q, k: bf16 [N, t, Hk, 128]; v, g: bf16 [N, t, H, 128], 1 <= t <= 16 (static); Hk = H or
        grouped value heads as in kda_prefill (value head j reads query/key head j // (H // Hk)).
      beta: bf16 [N, t, H] logits. A_log: f32 [H]. dt_bias: f32 [H, 128].
      state: bf16 or f32 [N, H, 128, 128], or with state_indices a pool [P, H, 128, 128].
      state_indices: None or int32 [N]: sequence n reads and writes pool row state_indices[n];
        rows not indexed are untouched; a negative index (or, under jit, one >= P) marks a
        padding slot: no read, no write, zero outputs. Repeated rows are rejected when the
        indices are concrete; under jit the sequences sharing a row race for it.
      scale, lower_bound: as kda_prefill.
      output_intermediate_states: also return the state after each of the t tokens
        ([N, t, H, 128, 128], the state's dtype; entry i is bitwise kda_prefill's final state
        on the first i + 1 tokens), for speculative decoding that accepts a prefix.
      numerics: as kda_prefill; each mode has its own fused decode kernel, bitwise
        kda_prefill of that mode on the same tokens.
      inverse, backend: as kda_prefill.

    Returns:
      (out bf16 [N, t, H, 128], new state or updated pool), plus the intermediate states as a
      third element when asked for. The update is in place when the caller donates `state`
      (jax.jit(..., donate_argnames="state")).
    """
    problem = _checks.check_decode(
        q, k, v, g, beta, A_log, dt_bias, state=state, state_indices=state_indices, scale=scale,
        lower_bound=lower_bound, output_intermediate_states=output_intermediate_states,
        numerics=numerics, inverse=inverse, backend=backend)
    arrays = (q, k, v, g, beta, A_log, dt_bias, state, state_indices)
    out, new_state, states = run_checked(arrays, problem)
    if output_intermediate_states:
        return out, new_state, states
    return out, new_state


def run_checked(arrays, problem, split=None):
    """Steps 2-4 on checked arrays, in layout order (jax_kda._partitioning.PREFILL / DECODE,
    None for absent ones), for a Problem (kda_prefill) or a DecodeProblem (kda_decode).
    Returns kda_prefill's (out, final state or pool, checkpoints or None), the final state in
    problem.state_dtype, or kda_decode's (out, new state or pool, intermediate states or None).
    split: None (the Explicit mesh axes in q's type that split its heads or batch, if any, else
    custom_partitioning) or a jax_kda._partitioning.MeshSplit to run under shard_map."""
    if split is None:
        split = _partitioning.explicit_split(arrays[0], problem)
    layout = _partitioning.PREFILL if isinstance(problem, Problem) else _partitioning.DECODE
    if problem.backend == "reference":
        if split is None:
            return reference_step(*arrays, problem=problem)
        return _partitioning.shard_mapped_call(reference_step, layout, arrays, problem, split)
    if problem.backend == "kernel":
        _require_kernels()
    present = _partitioning.present_positions(arrays)
    return _vjp.with_gradients(_run_kernels, layout, present, split, problem,
                               *(arrays[i] for i in present))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), inline=True)
def _run_kernels(layout, present, split, problem, *given):
    """Steps 2-4 of the kernel backends, jitted (an eager call compiles once per configuration);
    jax_kda._vjp gives them their derivative."""
    arrays = [None] * len(layout.args)
    for i, a in zip(present, given):
        arrays[i] = a
    if split is not None:
        return _partitioning.shard_mapped_call(folded_dispatch, layout, arrays, problem, split)
    return _fold(partitioned_dispatch, problem)(*arrays)


def reference_step(*arrays, problem):
    """The reference backend on arrays of problem's shapes (plain JAX)."""
    if isinstance(problem, Problem):
        return _reference_path.prefill(*arrays, problem=problem)
    return _reference_path.decode(*arrays, problem=problem)


def folded_dispatch(*arrays, problem):
    """Steps 3-4: the vmap folding around the dispatch (on one device's part under shard_map)."""
    return _fold(dispatch, problem)(*arrays)


def partitioned_dispatch(*arrays, problem):
    """Steps 2 and 4: each device's heads and rows under custom_partitioning, then the
    dispatch."""
    layout = _partitioning.PREFILL if isinstance(problem, Problem) else _partitioning.DECODE
    out_present = _partitioning.present_positions(problem.result_shapes())
    return _partitioning.partitioned_call(dispatch, layout, arrays, problem, out_present)


def _fold(step, problem):
    if isinstance(problem, Problem):
        return _batching.with_folding_vmap(step, problem)
    return _batching.with_decode_folding_vmap(step, problem)


def dispatch(*arrays, problem):
    """Step 4: the kernels or the reference, for arrays of exactly problem's shapes."""
    if isinstance(problem, Problem):
        kernel_fn, reference_fn = _kernel_path.prefill, _reference_path.prefill
    else:
        kernel_fn, reference_fn = _kernel_path.decode, _reference_path.decode
    return _by_platform(kernel_fn, reference_fn, problem)(*arrays)


def _by_platform(kernel_fn, reference_fn, problem):
    """backend="kernel": always the kernels; "auto": kernels where lowered for CUDA (and built
    for the visible GPUs), else the reference."""
    kernel_fn = functools.partial(kernel_fn, problem=problem)
    reference_fn = functools.partial(reference_fn, problem=problem)
    if problem.backend == "kernel":
        return kernel_fn
    if not _ffi.kernels_usable_for_auto():
        return reference_fn
    return functools.partial(_platform_dependent, kernel_fn, reference_fn)


def _platform_dependent(kernel_fn, reference_fn, *arrays):
    return lax.platform_dependent(*arrays, cuda=kernel_fn, default=reference_fn)


def _require_kernels() -> None:
    if not _ffi.kernels_available():
        raise KernelsUnavailableError(
            "backend='kernel': the GPU kernels are not available: "
            f"{_ffi.unavailable_reason()}. Use backend='auto' or 'reference'."
        )
    if not _ffi.kernel_gpus():
        raise KernelsUnavailableError(
            "backend='kernel' needs a CUDA GPU with kernels built for it (sm_90, sm_100) "
            f"visible to JAX; found {jax.devices()}. Use backend='auto' or 'reference'."
        )
