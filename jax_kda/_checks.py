"""Trace-time checks of the public functions' arguments.

Everything that shapes and dtypes can tell is checked here, before anything is traced into XLA, so
bad input fails with an error naming the argument instead of a crash or silent garbage. Values
inside cu_seqlens, state_indices and segment_ids are checked only when they are concrete (not under
jit); what the kernels do with malformed values is documented at `check_cu_seqlens_values`,
`check_state_index_values` and `jax_kda.segments.check_document_count`.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import _sequence_parallel, options
from .checkpoints import checkpoint_capacity
from .contract import HEAD_DIM, MAX_DECODE_TOKENS
from .problem import DecodeProblem, Problem
from .segments import check_document_count, check_segment_ids

STATE_DTYPES = (jnp.bfloat16, jnp.float32)


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def _shape_of(fn: str, name: str, x) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{fn}: {name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _expect_dtype(fn: str, name: str, x, allowed) -> None:
    _shape_of(fn, name, x)  # an array at all, before its dtype is read
    allowed = tuple(np.dtype(a) for a in allowed)
    if np.dtype(x.dtype) not in allowed:
        want = " or ".join(_dtype_name(a) for a in allowed)
        raise TypeError(f"{fn}: {name} must have dtype {want}, got {_dtype_name(x.dtype)}")


def _expect_shape(fn: str, name: str, x, expected: tuple[int, ...], meaning: str) -> None:
    got = _shape_of(fn, name, x)
    if got != expected:
        raise ValueError(f"{fn}: {name} must have shape {meaning} = {expected}, got {got}")


def _static_float(fn: str, name: str, value) -> float:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{fn}: {name} must be a static Python number (it is baked into the kernel "
            "launch), got a traced value; pass it as a static argument"
        )
    if isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 0:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{fn}: {name} must be finite, got {value}")
    return value


def _check_scalars(fn: str, scale, lower_bound) -> tuple[float, float]:
    """(scale, lower_bound), checked: scale > 0 (a q scale; 0 or a negative one would silently
    zero or flip every output), lower_bound in [-5, 0)."""
    scale = HEAD_DIM**-0.5 if scale is None else _static_float(fn, "scale", scale)
    if scale <= 0.0:
        raise ValueError(f"{fn}: scale must be positive, got {scale}")
    lower_bound = _static_float(fn, "lower_bound", lower_bound)
    if not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"{fn}: lower_bound must lie in [-5, 0), got {lower_bound}")
    return scale, lower_bound


def _check_bool(fn: str, name: str, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__}")


def _check_token_arrays(fn: str, q, k, v, g, beta, lead: tuple[int, int], axes: str,
                        ) -> tuple[int, int]:
    """q, k bf16 [*lead, Hk, 128] (Hk from q); v, g bf16 [*lead, H, 128] (H from v) and beta
    bf16 [*lead, H], with H a multiple of Hk (grouped value heads). axes names the leading
    axes ("B, T"). Returns (Hk, H)."""
    qk_heads = _shape_of(fn, "q", q)[2]
    for name, x in (("q", q), ("k", k)):
        _expect_dtype(fn, name, x, (jnp.bfloat16,))
        _expect_shape(fn, name, x, (*lead, qk_heads, HEAD_DIM), f"[{axes}, Hk, 128] like q")
    v_shape = _shape_of(fn, "v", v)
    heads = v_shape[2] if len(v_shape) == 4 else qk_heads  # (a wrong rank fails just below)
    for name, x in (("v", v), ("g", g)):
        _expect_dtype(fn, name, x, (jnp.bfloat16,))
        _expect_shape(fn, name, x, (*lead, heads, HEAD_DIM), f"[{axes}, H, 128] like v")
    _expect_dtype(fn, "beta", beta, (jnp.bfloat16,))
    _expect_shape(fn, "beta", beta, (*lead, heads), f"[{axes}, H]")
    if heads < 1 or heads % qk_heads:
        raise ValueError(
            f"{fn}: the value heads H = {heads} (axis 2 of v, g and beta; A_log, dt_bias and the "
            f"states likewise) must be a positive multiple of the query/key heads Hk = "
            f"{qk_heads} (axis 2 of q and k): with grouped value heads, value head j reads "
            f"query/key head j // (H // Hk)")
    return qk_heads, heads


def _check_head_params(fn: str, A_log, dt_bias, heads: int) -> None:
    _expect_dtype(fn, "A_log", A_log, (jnp.float32,))
    _expect_shape(fn, "A_log", A_log, (heads,), "[H]")
    _expect_dtype(fn, "dt_bias", dt_bias, (jnp.float32,))
    _expect_shape(fn, "dt_bias", dt_bias, (heads, HEAD_DIM), "[H, 128]")


def _check_pool(fn: str, name: str, pool, heads: int) -> int:
    """A state pool [P, H, 128, 128] with P >= 1; returns P."""
    shape = _shape_of(fn, name, pool)
    if len(shape) != 4 or shape[1:] != (heads, HEAD_DIM, HEAD_DIM) or shape[0] < 1:
        raise ValueError(
            f"{fn}: with state_indices, {name} is a pool of shape [P, H, 128, 128] = (P, {heads}, "
            f"128, 128) with P >= 1, got {shape}"
        )
    return shape[0]


def _check_state_indices(fn: str, state_indices, num_seqs: int, pool_rows: int) -> None:
    shape = _shape_of(fn, "state_indices", state_indices)
    _expect_dtype(fn, "state_indices", state_indices, (jnp.int32,))
    if shape != (num_seqs,):
        raise ValueError(
            f"{fn}: state_indices must have shape [N] = ({num_seqs},) (one pool row per "
            f"sequence), got {shape}"
        )
    check_state_index_values(fn, state_indices, pool_rows)


def check_prefill(
    q, k, v, g, beta, A_log, dt_bias, *, scale, lower_bound, initial_state, output_final_state,
    cu_seqlens, state_indices, checkpoint_every, numerics, inverse, sequence_parallel,
    recurrence, backend, segment_ids=None, max_segments=None, fn: str = "kda_prefill",
) -> Problem:
    """Validates kda_prefill's arrays and options (jax_kda.options has the option rules);
    returns the derived Problem. With segment_ids it describes the packed call that runs the
    documents (B = 1, T = B * T, N = max_segments; jax_kda.segments)."""
    options.check_numerics(fn, numerics, inverse)
    options.check_backend(fn, backend)
    checkpoint_every = options.check_checkpoint_every(fn, checkpoint_every)
    max_segments = options.check_segment_ids_options(
        fn, segment_ids=segment_ids is not None, max_segments=max_segments,
        cu_seqlens=cu_seqlens is not None, pooled=state_indices is not None,
        checkpoint_every=checkpoint_every,
        states=initial_state is not None or (isinstance(output_final_state, (bool, np.bool_))
                                             and bool(output_final_state)))
    recurrence = options.check_recurrence(fn, recurrence, numerics=numerics,
                                          pooled=state_indices is not None,
                                          checkpoint_every=checkpoint_every)
    segments = options.check_sequence_parallel(fn, sequence_parallel, numerics=numerics,
                                               checkpoint_every=checkpoint_every)
    q_shape = _shape_of(fn, "q", q)
    if len(q_shape) != 4:
        raise ValueError(f"{fn}: q must have rank 4 [B, T, Hk, {HEAD_DIM}], got shape {q_shape}")
    B, T, Hk, D = q_shape
    if D != HEAD_DIM:
        raise ValueError(
            f"{fn}: head dim must be {HEAD_DIM} (the last axis of q, k, v, g), got {D}"
        )
    if min(B, T, Hk) < 1:
        raise ValueError(f"{fn}: q's B, T and Hk (axes 0, 1, 2) must be >= 1, got shape "
                         f"{q_shape}")
    Hk, H = _check_token_arrays(fn, q, k, v, g, beta, (B, T), "B, T")
    _check_head_params(fn, A_log, dt_bias, H)
    scale, lower_bound = _check_scalars(fn, scale, lower_bound)
    _check_bool(fn, "output_final_state", output_final_state)

    states_meaning = "[N, H, 128, 128] (N = number of sequences)"
    if segment_ids is not None:
        check_segment_ids(fn, segment_ids, (B, T))
        N = max_segments  # required with segment_ids (jax_kda.options)
        check_document_count(fn, segment_ids, N)
        B, T, varlen = 1, B * T, True  # the packed call
        states_meaning = "[max_segments, H, 128, 128] (one state per document)"
    elif cu_seqlens is None:
        N, varlen = B, False
    else:
        cu_shape = _shape_of(fn, "cu_seqlens", cu_seqlens)
        _expect_dtype(fn, "cu_seqlens", cu_seqlens, (jnp.int32, jnp.int64))
        if len(cu_shape) != 1 or cu_shape[0] < 2:
            raise ValueError(
                f"{fn}: cu_seqlens must have rank 1 and shape [N+1] with N >= 1, got shape "
                f"{cu_shape}"
            )
        if B != 1:
            raise ValueError(
                f"{fn}: with cu_seqlens the batch size B must be 1 (sequences are packed "
                f"along T), got B = {B}"
            )
        N, varlen = cu_shape[0] - 1, True
        check_cu_seqlens_values(fn, cu_seqlens, T)

    # no initial state: the mode's own state precision
    state_dtype = np.dtype(jnp.float32 if numerics == "fp32" else jnp.bfloat16)
    pool_rows = None
    if state_indices is not None and initial_state is None:
        raise ValueError(
            f"{fn}: state_indices index the rows of a state pool passed as initial_state "
            "[P, H, 128, 128]; initial_state is missing"
        )
    if initial_state is not None:
        _expect_dtype(fn, "initial_state", initial_state, STATE_DTYPES)
        state_dtype = np.dtype(initial_state.dtype)
        if state_indices is None:
            _expect_shape(fn, "initial_state", initial_state, (N, H, HEAD_DIM, HEAD_DIM),
                          states_meaning)
        else:
            pool_rows = _check_pool(fn, "initial_state", initial_state, H)
            _check_state_indices(fn, state_indices, N, pool_rows)
    problem = Problem(B, T, H, N, varlen, state_dtype, scale, lower_bound, pool_rows,
                      checkpoint_every, checkpoint_capacity(B, T, varlen, checkpoint_every),
                      numerics, inverse, recurrence, backend, qk_heads=Hk)
    return _sequence_parallel.with_segments(problem, segments)


def check_decode(
    q, k, v, g, beta, A_log, dt_bias, *, state, state_indices, scale, lower_bound,
    output_intermediate_states, numerics, inverse, backend, fn: str = "kda_decode",
) -> DecodeProblem:
    """Validates kda_decode's arrays and options; returns the derived DecodeProblem."""
    options.check_numerics(fn, numerics, inverse)
    options.check_backend(fn, backend)
    q_shape = _shape_of(fn, "q", q)
    if len(q_shape) != 4:
        raise ValueError(f"{fn}: q must have rank 4 [N, t, Hk, {HEAD_DIM}], got shape {q_shape}")
    N, t, Hk, D = q_shape
    if D != HEAD_DIM:
        raise ValueError(f"{fn}: head dim must be {HEAD_DIM} (the last axis of q), got {D}")
    if not 1 <= t <= MAX_DECODE_TOKENS:
        raise ValueError(
            f"{fn}: t (tokens per sequence, axis 1 of q) must lie in [1, {MAX_DECODE_TOKENS}] "
            f"(one chunk; use kda_prefill for more), got {t}"
        )
    if N < 1 or Hk < 1:
        raise ValueError(f"{fn}: q's N and Hk (axes 0 and 2) must be >= 1, got shape {q_shape}")
    Hk, H = _check_token_arrays(fn, q, k, v, g, beta, (N, t), "N, t")
    _check_head_params(fn, A_log, dt_bias, H)
    scale, lower_bound = _check_scalars(fn, scale, lower_bound)
    _check_bool(fn, "output_intermediate_states", output_intermediate_states)

    if state is None:
        raise ValueError(f"{fn}: state is required (bf16 or f32 [P, H, 128, 128])")
    _expect_dtype(fn, "state", state, STATE_DTYPES)
    shape = _shape_of(fn, "state", state)
    if state_indices is None:
        _expect_shape(fn, "state", state, (N, H, HEAD_DIM, HEAD_DIM),
                      "[N, H, 128, 128] (one state per sequence; pass state_indices for a pool)")
    else:
        _check_pool(fn, "state", state, H)
        _check_state_indices(fn, state_indices, N, shape[0])
    return DecodeProblem(N, t, H, shape[0], state_indices is not None, np.dtype(state.dtype),
                         scale, lower_bound, bool(output_intermediate_states), numerics,
                         inverse, backend, qk_heads=Hk)


def check_cu_seqlens_values(fn: str, cu_seqlens, total_tokens: int) -> None:
    """Checks cu_seqlens' values when they are known now (outside jit).

    Under jit the values are unknown at trace time. Then malformed values (not starting at 0,
    decreasing, or past T) cannot corrupt memory: every backend clamps them into [0, T] and
    treats a decreasing pair as an empty sequence, but the numbers for the affected sequences
    are meaningless.
    """
    if isinstance(cu_seqlens, jax.core.Tracer):
        return
    values = np.asarray(cu_seqlens)
    if values[0] != 0 or values[-1] != total_tokens or np.any(np.diff(values) < 0):
        raise ValueError(
            f"{fn}: cu_seqlens must be non-decreasing, start at 0 and end at T = "
            f"{total_tokens}, got {values.tolist() if values.size <= 16 else values}"
        )


def check_state_index_values(fn: str, state_indices, pool_rows: int) -> None:
    """Checks state_indices' values when they are known now (outside jit).

    A negative index marks a padding slot (no pool row is read or written; its outputs are zero).
    Under jit an index >= P cannot be caught: it is treated as padding too, so nothing outside
    the pool is ever read or written. Two sequences with the same index race for that row.
    """
    if isinstance(state_indices, jax.core.Tracer):
        return
    values = np.asarray(state_indices)
    if np.any(values >= pool_rows):
        raise ValueError(
            f"{fn}: state_indices must be < P = {pool_rows} (the pool's rows; negative = "
            f"padding slot), got {values.tolist() if values.size <= 16 else values}"
        )
    valid = values[values >= 0]
    if valid.size != np.unique(valid).size:
        raise ValueError(
            f"{fn}: state_indices must not repeat a pool row (each sequence owns its row), got "
            f"{values.tolist() if values.size <= 16 else values}"
        )
