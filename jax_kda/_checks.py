"""Trace-time checks of kda_prefill's arguments.

Everything that shapes and dtypes can tell is checked here, before anything is traced into XLA, so
bad input fails with an error naming the argument instead of a crash or silent garbage. The values
inside cu_seqlens are checked only when they are concrete (not under jit); see `check_cu_seqlens_values`.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

HEAD_DIM = 128
CHUNK = 16
INVERSE_VARIANTS = ("stable", "neumann")
BACKENDS = ("auto", "kernel", "reference")
BLOCK_V_CHOICES = (16, 32, 64, 128)  # column split: value columns per CTA
# The recurrence custom call's block_v attribute value that selects the baseline kernel (one CTA per
# (sequence, head), state in shared memory) instead of a column split (docs/kernel_abi.md).
BASELINE_BLOCK_V = 0
RECURRENCE_BLOCK_V_VALUES = (*BLOCK_V_CHOICES, BASELINE_BLOCK_V)  # every valid attribute value
RECURRENCES = ("column_split", "baseline")  # kda_prefill(recurrence=...)
STATE_DTYPES = (jnp.bfloat16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static description of one kda_prefill call, derived from validated arguments."""

    batch: int  # B
    seqlen: int  # T
    heads: int  # H
    num_seqs: int  # N (= B without cu_seqlens)
    varlen: bool
    state_dtype: np.dtype  # dtype of the returned final state
    scale: float
    lower_bound: float


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def _shape_of(name: str, x) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"kda_prefill: {name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _expect_dtype(name: str, x, allowed) -> None:
    allowed = tuple(np.dtype(a) for a in allowed)
    if np.dtype(x.dtype) not in allowed:
        want = " or ".join(_dtype_name(a) for a in allowed)
        raise TypeError(f"kda_prefill: {name} must have dtype {want}, got {_dtype_name(x.dtype)}")


def _expect_shape(name: str, x, expected: tuple[int, ...], meaning: str) -> None:
    got = _shape_of(name, x)
    if got != expected:
        raise ValueError(
            f"kda_prefill: {name} must have shape {meaning} = {expected}, got {got}"
        )


def _static_float(name: str, value) -> float:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"kda_prefill: {name} must be a static Python number (it is baked into the kernel "
            "launch), got a traced value; pass it as a static argument"
        )
    if isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 0:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"kda_prefill: {name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"kda_prefill: {name} must be finite, got {value}")
    return value


def check_options(inverse: str, backend: str, block_v, recurrence: str = "column_split") -> None:
    if inverse not in INVERSE_VARIANTS:
        raise ValueError(f"kda_prefill: inverse must be one of {INVERSE_VARIANTS}, got {inverse!r}")
    if backend not in BACKENDS:
        raise ValueError(f"kda_prefill: backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(recurrence, str) or recurrence not in RECURRENCES:
        raise ValueError(f"kda_prefill: recurrence must be one of {RECURRENCES}, got {recurrence!r}")
    if block_v is not None and block_v not in BLOCK_V_CHOICES:
        raise ValueError(
            f"kda_prefill: column_split (value columns per CTA) must be None or one of "
            f"{BLOCK_V_CHOICES}, got {block_v!r}"
        )
    if recurrence == "baseline" and block_v is not None:
        raise ValueError(
            f"kda_prefill: column_split={block_v!r} applies to recurrence='column_split' only; "
            "recurrence='baseline' runs one CTA per (sequence, head): leave column_split=None"
        )


def recurrence_block_v(recurrence: str, column_split) -> int | None:
    """The recurrence custom call's block_v for checked options: BASELINE_BLOCK_V for the baseline
    kernel, else the column split (None = the launch heuristic decides)."""
    return BASELINE_BLOCK_V if recurrence == "baseline" else column_split


def check_inputs(
    q, k, v, g, beta, A_log, dt_bias, *, scale, lower_bound, initial_state, output_final_state,
    cu_seqlens,
) -> Problem:
    """Validates shapes, dtypes and static options; returns the derived Problem."""
    q_shape = _shape_of("q", q)
    if len(q_shape) != 4:
        raise ValueError(f"kda_prefill: q must have rank 4 [B, T, H, {HEAD_DIM}], got shape {q_shape}")
    B, T, H, D = q_shape
    if D != HEAD_DIM:
        raise ValueError(
            f"kda_prefill: head dim must be {HEAD_DIM} (the last axis of q, k, v, g), got {D}"
        )
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        _expect_dtype(name, x, (jnp.bfloat16,))
        _expect_shape(name, x, (B, T, H, HEAD_DIM), "[B, T, H, 128] like q")
    _expect_dtype("beta", beta, (jnp.bfloat16,))
    _expect_shape("beta", beta, (B, T, H), "[B, T, H]")
    _expect_dtype("A_log", A_log, (jnp.float32,))
    _expect_shape("A_log", A_log, (H,), "[H]")
    _expect_dtype("dt_bias", dt_bias, (jnp.float32,))
    _expect_shape("dt_bias", dt_bias, (H, HEAD_DIM), "[H, 128]")

    scale = HEAD_DIM**-0.5 if scale is None else _static_float("scale", scale)
    lower_bound = _static_float("lower_bound", lower_bound)
    if not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"kda_prefill: lower_bound must lie in [-5, 0), got {lower_bound}")
    if not isinstance(output_final_state, (bool, np.bool_)):
        raise TypeError(
            f"kda_prefill: output_final_state must be a bool, got {type(output_final_state).__name__}"
        )

    if cu_seqlens is None:
        N, varlen = B, False
    else:
        cu_shape = _shape_of("cu_seqlens", cu_seqlens)
        _expect_dtype("cu_seqlens", cu_seqlens, (jnp.int32, jnp.int64))
        if len(cu_shape) != 1 or cu_shape[0] < 2:
            raise ValueError(
                f"kda_prefill: cu_seqlens must have rank 1 and shape [N+1] with N >= 1, got shape {cu_shape}"
            )
        if B != 1:
            raise ValueError(
                f"kda_prefill: with cu_seqlens the batch size B must be 1 (sequences are packed along "
                f"T), got B = {B}"
            )
        N, varlen = cu_shape[0] - 1, True
        check_cu_seqlens_values(cu_seqlens, T)

    state_dtype = np.dtype(jnp.bfloat16)
    if initial_state is not None:
        _expect_dtype("initial_state", initial_state, STATE_DTYPES)
        _expect_shape(
            "initial_state", initial_state, (N, H, HEAD_DIM, HEAD_DIM),
            "[N, H, 128, 128] (N = number of sequences)",
        )
        state_dtype = np.dtype(initial_state.dtype)
    return Problem(B, T, H, N, varlen, state_dtype, scale, lower_bound)


def check_cu_seqlens_values(cu_seqlens, total_tokens: int) -> None:
    """Checks cu_seqlens' values when they are known now (outside jit).

    Under jit the values are unknown at trace time. Then malformed values (not starting at 0,
    decreasing, or past T) cannot corrupt memory: every backend clamps them into [0, T] and treats a
    decreasing pair as an empty sequence, but the numbers for the affected sequences are meaningless.
    """
    if isinstance(cu_seqlens, jax.core.Tracer):
        return
    values = np.asarray(cu_seqlens)
    if values[0] != 0 or values[-1] != total_tokens or np.any(np.diff(values) < 0):
        raise ValueError(
            "kda_prefill: cu_seqlens must be non-decreasing, start at 0 and end at T = "
            f"{total_tokens}, got {values.tolist() if values.size <= 16 else values}"
        )
