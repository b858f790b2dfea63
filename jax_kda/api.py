"""The public entry points, kda_prefill and kda_decode: their signatures, the argument checks and
the backend switch. The kernel path lives in jax_kda._kernel_path, the reference path in
jax_kda._reference_path; both compute the same function (docs/numerics.md)."""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax

from . import (
    _batching,
    _checks,
    _ffi,
    _kernel_path,
    _launch,
    _partitioning,
    _reference_path,
    _sequence_parallel,
)


class KdaInferenceOnlyError(NotImplementedError):
    """Raised when something asks for a derivative of the kernel-backed functions."""


class KernelsUnavailableError(RuntimeError):
    """Raised by backend="kernel" where the GPU kernels cannot run."""


def kda_prefill(
    q, k, v, g, beta, A_log, dt_bias, *,
    scale=None,
    lower_bound=-5.0,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    inverse="stable",
    backend="auto",
    column_split=None,
    recurrence="auto",
    state_indices=None,
    checkpoint_every=None,
    numerics="flashkda",
    sequence_parallel="auto",
    overlap=None,
):
    """Kimi Delta Attention prefill (chunked delta-rule recurrence), forward only.

    Args:
      q, k, v, g: bf16 [B, T, H, 128]; g is the raw gate.
      beta: bf16 [B, T, H], logits (sigmoid is applied inside).
      A_log: f32 [H]. dt_bias: f32 [H, 128].
      scale: output scale > 0, default 128 ** -0.5 (static).
      lower_bound: gate lower bound in [-5, 0) (static).
      initial_state: None (zeros) or bf16/f32 [N, H, 128, 128], stored V-major: state[n, h, v, k];
        with state_indices, a state pool [P, H, 128, 128].
      output_final_state: return the final state (dtype of initial_state; if none is given,
        bf16 with numerics="flashkda" and f32 with numerics="fp32"); with state_indices, the
        updated pool.
      cu_seqlens: None, or int32/int64 [N+1] with B == 1: packed variable-length sequences.
      inverse: "stable" (default) or "neumann" (FlashKDA v1's; NaN/Inf on near-collinear keys).
      backend: "auto" (GPU kernels on CUDA when built, else the reference, decided per platform
        at lowering), "kernel" (raise if unavailable) or "reference" (pure JAX, differentiable).
      column_split: None (launch heuristic) or value columns per CTA in {16, 32, 64, 128}.
      recurrence: which recurrence kernel: "auto" (default: the baseline kernel for plain
        flashkda-mode prefill of short sequences, <= 1024 tokens on average, with more
        (sequence, head) pairs than SMs, where it was measured fastest; else the column split),
        "column_split" (each head's value columns split over 128 / column_split CTAs; implied by
        a column_split value) or "baseline" (one CTA per (sequence, head), state in shared
        memory; column_split must then be None; no pools or checkpoints). All give bitwise the
        same results; the reference backend ignores it.
      state_indices: None, or int32 [N]: sequence n starts from row state_indices[n] of the pool
        `initial_state` and its final state is written back to that row (in place when the pool
        is donated); other rows are untouched. A negative index marks a padding slot: no row is
        read or written and the sequence's outputs are zero. Values >= P cannot be checked under
        jit and are treated as padding.
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
      overlap: None or False (default): prepare and the recurrence as two calls, one after the
        other. True (opt-in; on the H200 slower than the two calls at every measured shape,
        BENCHMARKS.md 2026-12-02; plain numerics="flashkda" prefill, column-split recurrence,
        column_split None, 16, 32 or 64): one call in which the recurrence may start while
        prepare still writes the workspace, waiting for each chunk's record (docs/kernel_abi.md
        "Overlapped prefill"); side by side only where the recurrence's CTAs are fewer than the
        GPU's SMs, else one after the other. Same bits either way, and no deadlock however the
        GPU schedules the two (prepare never waits for the recurrence).

    Returns:
      (out bf16 [B, T, H, 128], final_state or None), and the checkpoints [C, H, 128, 128] in the
      state's dtype as a third element when checkpoint_every is given.

    JAX transformations: jax.jit and jax.export work (see jax_kda.export for the disabled safety
    checks); under jax.vmap the kernel path folds the vmapped axis into B, N or H and still makes
    one pair of kernel calls (jax_kda._batching); derivatives raise KdaInferenceOnlyError except
    with backend="reference". Donating initial_state (jax.jit(..., donate_argnames=
    "initial_state")) lets the final state reuse its buffer. Under jax.jit, inputs sharded over
    heads are partitioned over heads: each device runs its local heads (jax_kda._partitioning);
    jax_kda.kda_prefill_sharded does the same with an explicit mesh and exports.
    """
    _checks.check_options("kda_prefill", inverse, backend, numerics)
    launch = _launch.requested(recurrence, column_split, overlap)
    problem = _checks.check_prefill(
        q, k, v, g, beta, A_log, dt_bias, scale=scale, lower_bound=lower_bound,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        state_indices=state_indices, checkpoint_every=checkpoint_every, numerics=numerics,
    )
    problem = _sequence_parallel.with_segments(problem, _sequence_parallel.check(
        sequence_parallel, numerics=numerics, checkpoint_every=checkpoint_every))
    if launch.kernel == "baseline" and numerics == "fp32":
        raise ValueError(
            "kda_prefill: recurrence='baseline' runs numerics='flashkda' only; numerics='fp32' "
            "runs the column-split recurrence (recurrence='column_split')"
        )
    if launch.kernel == "baseline" and (state_indices is not None or checkpoint_every is not None):
        raise ValueError(
            "kda_prefill: recurrence='baseline' runs plain prefill only; state pools "
            "(state_indices) and checkpoint_every need recurrence='column_split'"
        )
    cu32 = None if cu_seqlens is None else cu_seqlens.astype("int32")
    arrays = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu32, state_indices)
    explicit = _partitioning.explicit_head_mesh(q, head_axis=2)
    if explicit is not None:  # heads sharded in the types: run the local heads under shard_map
        options = {"scale": problem.scale, "lower_bound": problem.lower_bound,
                   "inverse": inverse, "backend": backend, "column_split": column_split,
                   "recurrence": recurrence, "checkpoint_every": checkpoint_every,
                   "numerics": numerics, "sequence_parallel": sequence_parallel,
                   "overlap": overlap}
        out, final_state, checkpoints = _partitioning.shard_over_heads(
            functools.partial(_local_prefill, options=options), _partitioning.PREFILL,
            (*arrays, None), *explicit)
    else:
        run = _prefill_backend(problem, inverse, launch, backend)
        out, final_state, checkpoints = _call(run, arrays, differentiable=backend == "reference")
    final_state = final_state.astype(problem.state_dtype) if output_final_state else None
    if checkpoint_every is None:
        return out, final_state
    return out, final_state, checkpoints


def kda_decode(
    q, k, v, g, beta, A_log, dt_bias, *,
    state,
    state_indices=None,
    scale=None,
    lower_bound=-5.0,
    inverse="stable",
    backend="auto",
    output_intermediate_states=False,
    numerics="flashkda",
):
    """A KDA decode (or speculative-verify) step: t <= 16 new tokens per sequence, from and to
    a state per sequence or a state pool.

    Bitwise equal to kda_prefill on the same tokens (B = N, T = t) with the same states.

    Args:
      q, k, v, g: bf16 [N, t, H, 128], 1 <= t <= 16 (static). beta: bf16 [N, t, H] logits.
      A_log: f32 [H]. dt_bias: f32 [H, 128].
      state: bf16 or f32 [N, H, 128, 128], or with state_indices a pool [P, H, 128, 128].
      state_indices: None or int32 [N]: sequence n reads and writes pool row state_indices[n];
        rows not indexed are untouched; a negative index (or, under jit, one >= P) marks a
        padding slot: no read, no write, zero outputs.
      scale, lower_bound, inverse, backend: as kda_prefill.
      output_intermediate_states: also return the state after each of the t tokens
        ([N, t, H, 128, 128], the state's dtype; entry i is bitwise kda_prefill's final state
        on the first i + 1 tokens), for speculative decoding that accepts a prefix. With
        numerics="fp32" the kernels run every prefix as a sequence of its own in one packed
        prefill (t (t + 1) / 2 tokens per sequence instead of t).
      numerics: as kda_prefill; "fp32" runs kda_prefill's fp32 kernels on the t tokens (there
        is no fused fp32 decode kernel) and is bitwise kda_prefill(numerics="fp32") on them.

    Returns:
      (out bf16 [N, t, H, 128], new state or updated pool), plus the intermediate states as a
      third element when asked for. The update is in place when the caller donates `state`
      (jax.jit(..., donate_argnames="state")).
    """
    _checks.check_options("kda_decode", inverse, backend, numerics)
    problem = _checks.check_decode(
        q, k, v, g, beta, A_log, dt_bias, state=state, state_indices=state_indices, scale=scale,
        lower_bound=lower_bound, output_intermediate_states=output_intermediate_states,
        numerics=numerics,
    )
    arrays = (q, k, v, g, beta, A_log, dt_bias, state, state_indices)
    explicit = _partitioning.explicit_head_mesh(q, head_axis=2)
    if explicit is not None:  # heads sharded in the types: run the local heads under shard_map
        options = {"scale": problem.scale, "lower_bound": problem.lower_bound,
                   "inverse": inverse, "backend": backend,
                   "output_intermediate_states": output_intermediate_states,
                   "numerics": numerics}
        out, new_state, states = _partitioning.shard_over_heads(
            functools.partial(_local_decode, options=options), _partitioning.DECODE, arrays,
            *explicit)
    else:
        run = _decode_backend(problem, inverse, backend)
        out, new_state, states = _call(run, arrays, differentiable=backend == "reference")
    if output_intermediate_states:
        return out, new_state, states
    return out, new_state


def _local_prefill(q, k, v, g, beta, A_log, dt_bias, state, cu, state_indices, ckpt_offsets, *,
                   options):
    """kda_prefill on one device's heads (inside shard_map), results in layout order."""
    out, final_state, *checkpoints = kda_prefill(
        q, k, v, g, beta, A_log, dt_bias, initial_state=state, cu_seqlens=cu,
        state_indices=state_indices, output_final_state=True, **options)
    return out, final_state, (checkpoints[0] if checkpoints else None)


def _local_decode(q, k, v, g, beta, A_log, dt_bias, state, state_indices, *, options):
    """kda_decode on one device's heads (inside shard_map), results in layout order."""
    out, new_state, *states = kda_decode(q, k, v, g, beta, A_log, dt_bias, state=state,
                                         state_indices=state_indices, **options)
    return out, new_state, (states[0] if states else None)


def _prefill_backend(problem, inverse, launch, backend):
    """fn(q, k, v, g, beta, A_log, dt_bias, state, cu, state_indices) -> (out, final_state,
    checkpoints or None) on the chosen backend. The kernel backends fold vmapped axes into one
    call and partition over heads; the reference is plain JAX (XLA partitions and vmaps it)."""
    if backend == "reference":
        return functools.partial(_reference_path.prefill, problem=problem, inverse=inverse)
    for_problem = _on_local_heads(
        functools.partial(_kernel_path.prefill,
                          options=_kernel_path.PrefillOptions(inverse, launch)),
        functools.partial(_reference_path.prefill, inverse=inverse),
        _partitioning.PREFILL, backend)
    folded = _batching.with_folding_vmap(for_problem, problem)
    return lambda *arrays: folded(*arrays, None)  # checkpoint offsets: computed from cu


def _decode_backend(problem, inverse, backend):
    """fn(q, k, v, g, beta, A_log, dt_bias, state, state_indices) -> (out, state, states or
    None) on the chosen backend, folded and partitioned as _prefill_backend."""
    if backend == "reference":
        return functools.partial(_reference_path.decode, problem=problem, inverse=inverse)
    for_problem = _on_local_heads(
        functools.partial(_kernel_path.decode, inverse=inverse),
        functools.partial(_reference_path.decode, inverse=inverse),
        _partitioning.DECODE, backend)
    return _batching.with_decode_folding_vmap(for_problem, problem)


def _on_local_heads(kernel_fn, reference_fn, layout, backend):
    """for_problem(*arrays, problem): the call on each device's heads (jax_kda._partitioning),
    the kernels or the reference by platform; both functions take problem= for the local
    head count."""

    def for_problem(*arrays, problem):
        def call_for_heads(heads):
            local = dataclasses.replace(problem, heads=heads)
            return _by_platform(functools.partial(kernel_fn, problem=local),
                                functools.partial(reference_fn, problem=local), backend)

        return _partitioning.over_heads(call_for_heads, layout, problem.heads, arrays)

    return for_problem


def _by_platform(kernel_fn, reference_fn, backend):
    """backend="kernel": always the kernels; "auto": kernels where lowered for CUDA (and built
    for the visible GPUs), else the reference."""
    if backend == "kernel":
        _require_kernels()
        return kernel_fn
    if not _ffi.kernels_available() or not _kernels_fit_visible_gpus():
        return reference_fn

    def auto(*arrays):
        return lax.platform_dependent(*arrays, cuda=kernel_fn, default=reference_fn)

    return auto


def _kernels_fit_visible_gpus() -> bool:
    """False when CUDA GPUs are visible but none has kernels built for it (e.g. an A100): "auto"
    then runs the reference there. With no GPU visible (lowering for CUDA on a CPU host, for
    export), the kernels are kept for the CUDA platform."""
    return not _ffi.visible_gpus() or bool(_ffi.kernel_gpus())


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


def _call(fn, arrays, *, differentiable: bool):
    """fn(*arrays); unless differentiable (the reference backend), any derivative of it fails
    with a clear message."""
    if differentiable:
        return fn(*arrays)
    present = [i for i, a in enumerate(arrays) if a is not None]

    def call(*given):
        full = list(arrays)
        for i, a in zip(present, given):
            full[i] = a
        return fn(*full)

    guarded = jax.custom_jvp(call)

    @guarded.defjvp
    def _no_derivative(primals, tangents):
        raise KdaInferenceOnlyError(
            "jax_kda is inference-only with backend='kernel' or 'auto': the GPU kernels have "
            "no backward pass. For derivatives call it with backend='reference', the pure-JAX "
            "implementation, which JAX differentiates by autodiff."
        )

    return guarded(*(arrays[i] for i in present))
