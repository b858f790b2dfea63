"""The public entry point: kda_prefill."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _batching, _checks, _launch, reference
from ._manual_axes import vary_like


class KdaInferenceOnlyError(NotImplementedError):
    """Raised when something asks for a derivative of the kernel-backed prefill."""


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
    recurrence="column_split",
):
    """Kimi Delta Attention prefill (chunked delta-rule recurrence), forward only.

    Args:
      q, k, v, g: bf16 [B, T, H, 128]; g is the raw gate.
      beta: bf16 [B, T, H], logits (sigmoid is applied inside).
      A_log: f32 [H]. dt_bias: f32 [H, 128].
      scale: output scale, default 128 ** -0.5 (static).
      lower_bound: gate lower bound in [-5, 0) (static).
      initial_state: None (zeros) or bf16/f32 [N, H, 128, 128], stored V-major: state[n, h, v, k].
      output_final_state: return the final state (dtype of initial_state, bf16 if none given).
      cu_seqlens: None, or int32/int64 [N+1] with B == 1: packed variable-length sequences.
      inverse: "stable" (default) or "neumann" (FlashKDA v1's; NaN/Inf on near-collinear keys).
      backend: "auto" (GPU kernels on CUDA when built, else the reference, decided per platform
        at lowering), "kernel" (raise if unavailable) or "reference" (pure JAX, differentiable).
      column_split: None (launch heuristic) or value columns per CTA in {16, 32, 64, 128}.
      recurrence: which recurrence kernel: "column_split" (default; each head's value columns
        split over 128 / column_split CTAs) or "baseline" (one CTA per (sequence, head), state in
        shared memory; column_split must then be None). Both give bitwise the same results; the
        reference backend ignores it.

    Returns:
      (out bf16 [B, T, H, 128], final_state or None).

    JAX transformations: jax.jit and jax.export work (see jax_kda.export for the disabled safety
    checks); under jax.vmap the kernel path folds the vmapped axis into B, N or H and still makes
    one pair of kernel calls (jax_kda._batching); derivatives raise KdaInferenceOnlyError except
    with backend="reference". Donating initial_state (jax.jit(..., donate_argnames=
    "initial_state")) lets the final state reuse its buffer. For head-sharded (tensor-parallel)
    arrays use jax_kda.kda_prefill_sharded, which runs the kernels on each device's local heads.
    """
    _checks.check_options(inverse, backend, column_split, recurrence)
    problem = _checks.check_inputs(
        q, k, v, g, beta, A_log, dt_bias, scale=scale, lower_bound=lower_bound,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )
    state_bf16 = None if initial_state is None else initial_state.astype(jnp.bfloat16)
    cu32 = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    arrays = (q, k, v, g, beta, A_log, dt_bias, state_bf16, cu32)

    reference_fn = functools.partial(_reference_prefill, problem=problem, inverse=inverse)
    if backend == "reference":
        out, final_state = reference_fn(*arrays)
    else:
        if backend == "kernel":
            _require_kernels()
        # The folding vmap rule turns a vmapped call into one kernel launch (see _batching).
        kernel_fn = _batching.with_folding_vmap(
            functools.partial(_kernel_prefill, inverse=inverse,
                              block_v=_checks.recurrence_block_v(recurrence, column_split)),
            problem,
        )
        out, final_state = _inference_only(
            _pick_by_platform(kernel_fn, reference_fn, backend), *arrays
        )

    if not output_final_state:
        return out, None
    return out, final_state.astype(problem.state_dtype)


# Jitted so that eager calls compile once per shape instead of dispatching op by op (seconds per
# call on CPU); inside an outer jit it is simply inlined.
@functools.partial(jax.jit, static_argnames=("problem", "inverse"))
def _reference_prefill(q, k, v, g, beta, A_log, dt_bias, state, cu, *, problem, inverse):
    return reference.kda_prefill_reference(
        q, k, v, g, beta, A_log, dt_bias, scale=problem.scale, lower_bound=problem.lower_bound,
        initial_state=state, cu_seqlens=cu, inverse=inverse,
    )


def _kernel_prefill(q, k, v, g, beta, A_log, dt_bias, state, cu, *, problem, inverse, block_v):
    """block_v: the recurrence custom call's attribute (column split, or BASELINE_BLOCK_V for the
    baseline kernel); None = the launch heuristic picks a column split for this problem."""
    from . import _ffi

    B, T, H = problem.batch, problem.seqlen, problem.heads
    tokens = B * T

    def flat(x):  # [B, T, ...] -> [B*T, ...]: the kernels see every call as packed sequences
        return x.reshape((tokens,) + x.shape[2:])

    if cu is None:
        cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    if state is None:
        state = jnp.zeros((problem.num_seqs, H, 128, 128), jnp.bfloat16)
    if block_v is None:
        block_v = _launch.choose_block_v(num_seqs=problem.num_seqs, heads=H)
    workspace = _ffi.prepare_call(
        flat(q), flat(k), flat(g), flat(beta), A_log, dt_bias, cu,
        scale=problem.scale, lower_bound=problem.lower_bound, inverse=inverse,
    )
    out, final_state = _ffi.recurrence_call(flat(v), flat(beta), workspace, cu, state, block_v=block_v)
    return vary_like(out.reshape(q.shape), v), vary_like(final_state, v)


def _pick_by_platform(kernel_fn, reference_fn, backend):
    """backend="kernel": always the kernels; "auto": kernels where lowered for CUDA, else reference."""
    if backend == "kernel":
        return kernel_fn
    from . import _ffi

    if not _ffi.kernels_available() or not _kernels_fit_visible_gpus():
        return reference_fn

    def auto(*arrays):
        return lax.platform_dependent(*arrays, cuda=kernel_fn, default=reference_fn)

    return auto


def _kernels_fit_visible_gpus() -> bool:
    """False when CUDA GPUs are visible but none has kernels built for it (e.g. an A100): "auto"
    then runs the reference there. With no GPU visible (lowering for CUDA on a CPU host, for
    export), the kernels are kept for the CUDA platform."""
    from . import _ffi

    return not _ffi.visible_gpus() or bool(_ffi.kernel_gpus())


def _require_kernels() -> None:
    from . import _ffi

    if not _ffi.kernels_available():
        raise KernelsUnavailableError(
            "kda_prefill(backend='kernel'): the GPU kernels are not available: "
            f"{_ffi.unavailable_reason()}. Use backend='auto' or 'reference'."
        )
    if not _ffi.kernel_gpus():
        raise KernelsUnavailableError(
            "kda_prefill(backend='kernel') needs a CUDA GPU with kernels built for it (sm_90, "
            f"sm_100) visible to JAX; found {jax.devices()}. Use backend='auto' or 'reference'."
        )


def _inference_only(fn, *arrays):
    """Runs fn(*arrays) and makes any derivative of it fail with a clear message."""
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
            "kda_prefill is inference-only with backend='kernel' or 'auto': the GPU kernels have "
            "no backward pass. For derivatives call kda_prefill(..., backend='reference'), the "
            "pure-JAX implementation, which JAX differentiates by autodiff."
        )

    return guarded(*(arrays[i] for i in present))
