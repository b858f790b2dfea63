"""Sequence parallelism for the fp32 numerics mode: a long sequence cut into segments whose
recurrences run side by side, exactly (no truncation, no decay-dependent warm-up).

The chunk recurrence is affine in the state: over a segment p, S_end = S_start @ M_p + E_p
(V-major states, S[v, k]), where E_p is the end state from a zero start and M_p the end state
from the identity with all values v = 0 (the update's linear part). Three calls of the ordinary
fp32 prefill on the segments, treated as packed sequences (segment boundaries are multiples of
16 tokens from each sequence's start, so every chunk is the serial run's chunk):

  1. from zero states with the real values        -> E_p;
  2. from identity states with zero values        -> M_p;
  3. a short serial combine per sequence and head, S_{p+1} = S_p @ M_p + E_p in f32, then the
     prefill once more from the true starting states S_p -> outputs and final states.

Step 3 re-runs the segments instead of correcting step 1's outputs with the linear response
(O = O_zero + L S_p): the kernels round their outputs to bf16, and a correction added to rounded
outputs would round twice; re-run, every output is rounded once, as in the serial mode. The only
difference from the serial fp32 mode is the f32 arithmetic of the combine (the starting states
come from M and E instead of the chain), an exact-math rearrangement.

Supported: batched input (cu_seqlens None) with or without initial states. The segment count is
static; "auto" keeps the serial mode (the crossover has not been measured yet).
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
from jax import lax

from .contract import CHUNK, HEAD_DIM

MODES = ("auto", "off")


def check(value, *, numerics: str, cu_seqlens, state_indices, checkpoint_every) -> int:
    """The number of segments a kda_prefill call asks for (1 = serial), checked."""
    if isinstance(value, str):
        if value not in MODES:
            raise ValueError(f"kda_prefill: sequence_parallel must be 'auto', 'off' or a segment "
                             f"count >= 1, got {value!r}")
        return 1  # "auto": serial until the crossover is measured
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"kda_prefill: sequence_parallel must be 'auto', 'off' or a segment "
                         f"count >= 1, got {value!r}")
    if value > 1:
        if numerics != "fp32":
            raise ValueError("kda_prefill: sequence_parallel segments need numerics='fp32' (its "
                             "rounding differs from the serial kernels, so the bitwise FlashKDA "
                             "mode has none)")
        if cu_seqlens is not None or state_indices is not None or checkpoint_every is not None:
            raise ValueError("kda_prefill: sequence_parallel segments take batched input without "
                             "cu_seqlens, state_indices or checkpoint_every")
    return int(value)


def segment_length(seqlen: int, segments: int) -> int:
    """Tokens per segment: a multiple of 16, so that segments hold whole chunks."""
    chunks = -(-seqlen // CHUNK)
    return -(-chunks // segments) * CHUNK


def prefill(run, q, k, v, g, beta, A_log, dt_bias, initial_state, *, segments: int):
    """(out [B, T, H, 128] bf16, final state f32 [B, H, 128, 128]) of the fp32 mode with each
    sequence cut into `segments` pieces. run(q, k, v, g, beta, A_log, dt_bias, cu_seqlens,
    initial_state) is the serial fp32 prefill on packed [1, T_total, ...] inputs, returning
    (out, f32 final states of every packed sequence)."""
    B, T, H, D = q.shape
    length = segment_length(T, segments)
    per_seq = -(-T // length)  # segments actually used
    bounds = jnp.minimum(jnp.arange(per_seq + 1, dtype=jnp.int32) * length, T)
    cu = (jnp.arange(B, dtype=jnp.int32)[:, None] * T + bounds[None, :-1]).reshape(-1)
    cu = jnp.concatenate([cu, jnp.full((1,), B * T, jnp.int32)])

    def packed(x):
        return x.reshape((1, B * T) + x.shape[2:])

    tokens = [packed(x) for x in (q, k, v, g, beta)]
    pieces = B * per_seq
    zeros = jnp.zeros((pieces, H, D, D), jnp.float32)
    identity = jnp.broadcast_to(jnp.eye(D, dtype=jnp.float32), (pieces, H, D, D))
    _, zero_start_ends = run(*tokens, A_log, dt_bias, cu, zeros)
    q_, k_, _, g_, beta_ = tokens
    _, transports = run(q_, k_, jnp.zeros_like(tokens[2]), g_, beta_, A_log, dt_bias, cu,
                        identity)
    starts = _segment_starts(initial_state, transports.reshape(B, per_seq, H, D, D),
                             zero_start_ends.reshape(B, per_seq, H, D, D))
    out, ends = run(*tokens, A_log, dt_bias, cu, starts.reshape(pieces, H, D, D))
    return out.reshape(B, T, H, D), ends.reshape(B, per_seq, H, D, D)[:, -1]


def _segment_starts(initial_state, transports, zero_start_ends):
    """S_p for every segment p: S_0 = the initial state, S_{p+1} = S_p @ M_p + E_p (f32),
    serial over p per (sequence, head); [B, P, H, 128, 128]."""
    def step(state, me):
        m, e = me
        nxt = jnp.einsum("bhvj,bhjk->bhvk", state, m, precision=lax.Precision.HIGHEST) + e
        return nxt, state

    _, starts = lax.scan(step, initial_state.astype(jnp.float32),
                         (jnp.moveaxis(transports, 1, 0), jnp.moveaxis(zero_start_ends, 1, 0)))
    return jnp.moveaxis(starts, 0, 1)


def zero_state(q):
    """The zero initial state of batched fp32-mode input q [B, T, H, 128]."""
    B, _, H, _ = q.shape
    return jnp.zeros((B, H, HEAD_DIM, HEAD_DIM), jnp.float32)

