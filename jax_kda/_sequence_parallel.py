"""Sequence parallelism for the fp32 numerics mode: long sequences cut into segments whose
recurrences run side by side, exactly (no truncation, no decay-dependent warm-up).

The chunk recurrence is affine in the state: over a segment p, S_end = S_start @ M_p + E_p
(V-major states, S[v, k]), where E_p is the end state from a zero start and M_p the end state
from the identity with all values v = 0 (the update's linear part). Every sequence is cut into
pieces of `segment_length` tokens (a multiple of 16 from the sequence's start, so every chunk is
the serial run's chunk; sequences no longer than that stay whole), and the pieces are run as
packed sequences over ONE workspace (the prepare step is token-parallel and does not depend on
the state):

  1. recurrence from the true initial state (first piece of each sequence) or zero (the others)
     with the real values -> E_p (and the first pieces' true end states);
  2. recurrence from identity states with zero values -> M_p;
  3. the combine: a segmented associative scan of the affine maps (M_p, E_p) over each
     sequence's pieces in f32 (depth log2 of the piece count), giving every piece's true
     starting state;
  4. recurrence once more from the true starting states -> outputs and final states.

Step 4 re-runs the pieces instead of correcting step 1's outputs with the linear response
(O = O_zero + L S_p): the kernels round their outputs to bf16, and a correction added to rounded
outputs would round twice; re-run, every output is rounded once, as in the serial mode. The only
difference from the serial fp32 mode is the f32 arithmetic of the combine, an exact-math
rearrangement (docs/fp32_mode.md, section 8).

`prefill` is backend-neutral: the kernel path passes the prepare kernel and the recurrence
kernel, the reference path the fp32 reference.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from . import _launch
from ._manual_axes import vary_like
from .contract import CHUNK, HEAD_DIM


def segment_length(longest: int, segments: int) -> int:
    """Tokens per segment when the longest sequence a call can hold (`longest` tokens) is cut
    into `segments`: a multiple of 16, so that segments hold whole chunks."""
    chunks = -(-longest // CHUNK)
    return max(1, -(-chunks // segments)) * CHUNK


def piece_capacity(*, num_seqs: int, total_tokens: int, varlen: bool, length: int) -> int:
    """Static number of pieces: N * ceil(T / length) for batched input; for packed input each
    sequence gives max(1, ceil(len / length)) <= 1 + floor(len / length) pieces, so
    N + floor(T_total / length) bound them (unused pieces are empty)."""
    if not varlen:
        return num_seqs * -(-(total_tokens // num_seqs) // length)
    return num_seqs + total_tokens // length


def pieces(cu, *, capacity: int, length: int):
    """The pieces of packed sequences cu [N + 1] (values may be traced): (piece_cu int32
    [capacity + 1], owner int32 [capacity]: the sequence of each piece, first bool [capacity]:
    a sequence's first piece, last int32 [N]: each sequence's last piece). Piece j of sequence n
    covers [cu[n] + j * length, min(cu[n] + (j + 1) * length, cu[n + 1])); an empty sequence has
    one empty piece; unused pieces are empty, at the end."""
    N = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    counts = jnp.maximum(1, -(-lens // length))
    ends = jnp.cumsum(counts)  # one past each sequence's last piece
    p = jnp.arange(capacity, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(ends, p, side="right"), N - 1).astype(jnp.int32)
    rank = p - (ends - counts)[owner]
    used = p < ends[-1]
    starts = jnp.where(used, cu[owner] + rank * length, cu[-1])
    piece_cu = jnp.concatenate([starts, cu[-1:]]).astype(jnp.int32)
    return piece_cu, owner, used & (rank == 0), (ends - 1).astype(jnp.int32)


def prefill(prepare, recurrence, v, state, cu, *, problem, length: int):
    """(out, final states f32 [N, H, 128, 128]) of the fp32 mode for `problem`
    (jax_kda.problem.Problem) with long sequences cut into pieces of `length` tokens.

    prepare(piece_cu) -> workspace (any value) for the pieces as packed sequences;
    recurrence(workspace, v, piece_cu, states f32 [P, H, 128, 128]) -> (out, end states f32
    [P, H, 128, 128]), P = piece_capacity. v: the values in the caller's layout (only zeroed
    here); state: None (zeros) or [N, H, 128, 128] (an f32 one is read as it is, bf16 widened);
    cu: None (batched input) or int32 [N + 1]."""
    N, H = problem.num_seqs, problem.heads
    if cu is None:
        cu = jnp.arange(N + 1, dtype=jnp.int32) * problem.seqlen
    capacity = piece_capacity(num_seqs=N, total_tokens=problem.batch * problem.seqlen,
                              varlen=problem.varlen, length=length)
    piece_cu, owner, first, last = pieces(cu.astype(jnp.int32), capacity=capacity,
                                          length=length)
    state0 = (jnp.zeros((N, H, HEAD_DIM, HEAD_DIM), jnp.float32) if state is None
              else state.astype(jnp.float32))
    state0 = vary_like(state0, v)  # under shard_map: states made here vary like the inputs
    as_state = lambda mask: mask[:, None, None, None]
    workspace = prepare(piece_cu)
    starts = jnp.where(as_state(first), state0[owner], jnp.zeros((), jnp.float32))
    _, zero_start_ends = recurrence(workspace, v, piece_cu, starts)
    identity = vary_like(jnp.broadcast_to(jnp.eye(HEAD_DIM, dtype=jnp.float32),
                                          (capacity, H, HEAD_DIM, HEAD_DIM)), v)
    _, transports = recurrence(workspace, jnp.zeros_like(v), piece_cu, identity)
    true_ends = combine(first, transports, zero_start_ends)
    previous = jnp.concatenate([true_ends[:1], true_ends[:-1]])
    starts = jnp.where(as_state(first), state0[owner], previous)
    out, ends = recurrence(workspace, v, piece_cu, starts)
    return out, ends[last]


COMBINES = ("associative", "serial")


def combine(first, transports, zero_start_ends, *, method: str = "associative",
            precision=lax.Precision.HIGHEST):
    """Every piece's true end state: a segmented inclusive scan of the affine maps
    S -> S @ M_p + E_p, restarted at each sequence's first piece (whose E already is its true
    end state, run from the sequence's initial state); f32 products (`precision`).
    "associative": ~2P compositions (M_a @ M_b, E_a @ M_b + E_b) in 2 log2(P) dependent levels;
    "serial": P dependent products S @ M_p + E_p, one piece after another."""
    def matmul(a, b):
        return jnp.einsum("...vj,...jk->...vk", a, b, precision=precision)

    if method == "serial":
        ends, state = [], zero_start_ends[0]
        for p in range(first.shape[0]):
            if p:
                state = jnp.where(first[p], zero_start_ends[p],
                                  matmul(state, transports[p]) + zero_start_ends[p])
            ends.append(state)
        return jnp.stack(ends)

    def compose(a, b):  # a's pieces, then b's
        reset_a, m_a, e_a = a
        reset_b, m_b, e_b = b
        keep = reset_b[..., None, None, None]
        return (reset_a | reset_b, jnp.where(keep, m_b, matmul(m_a, m_b)),
                jnp.where(keep, e_b, matmul(e_a, m_b) + e_b))

    return lax.associative_scan(compose, (first, transports, zero_start_ends))[2]


def longest(problem) -> int:
    """The longest sequence a call can hold: T for batched input, the packed length with
    cu_seqlens."""
    return problem.batch * problem.seqlen if problem.varlen else problem.seqlen


def _cut_length(problem, segments: int) -> int | None:
    """Tokens per piece when the longest sequence `problem` can hold is cut into `segments`;
    None where that leaves it whole (serial)."""
    length = segment_length(longest(problem), segments)
    return length if segments > 1 and length < longest(problem) else None


def with_segments(problem, segments):
    """`problem` (jax_kda.problem.Problem) with its sequence parallelism: segments = 1 (serial),
    a count n (the longest possible sequence cut into n pieces) or "auto" (planned by the kernel
    path for the size it sees)."""
    if segments == "auto":
        return dataclasses.replace(problem, plan_segments=True)
    length = _cut_length(problem, segments)
    return problem if length is None else dataclasses.replace(problem, segment_length=length)


def resolved_length(problem, *, sm_count: int | None = None) -> int | None:
    """Tokens per piece (None: serial): the explicit choice, or the plan for "auto"."""
    if problem.segment_length is not None or not problem.plan_segments:
        return problem.segment_length
    return _cut_length(problem, planned_segments(
        num_seqs=problem.num_seqs, heads=problem.heads, longest=longest(problem),
        varlen=problem.varlen, sm_count=sm_count))


# "auto": a time model of the fp32 kernels fitted on the H200 (BENCHMARKS.md "Sequence
# parallelism"). Per 16-token chunk the block_v = 16 recurrence takes 0.89 us while each SM runs
# one of its CTAs and 1.29 us at two (benchmarks/results/h200-20261201-fp32-grid-2.json: 457 and
# 662 us for 512 chunks); a cut into n pieces runs three passes of ceil(chunks / n) chunks plus the
# combine and its launches, ~35 us + 2.3 us per (piece, head) state (fitted to the
# sequence-parallel measurements, h200-20261201-sp-*.json; the plan is within 5 % of the fastest
# measured count there).
_CHUNK_US = {1: 0.89, 2: 1.29}  # CTAs of block_v = 16 per SM -> us per chunk
_COMBINE_US = 35.0
_COMBINE_US_PER_STATE = 2.3


def _predicted_us(*, chunks: int, tasks: int, segments: int, sms: int) -> float | None:
    """The model's recurrence + combine time; None past two block_v = 16 CTAs per SM."""
    per_chunk = _CHUNK_US.get(_launch.ctas_per_sm(tasks=tasks * segments, block_v=16,
                                                  sm_count=sms))
    if per_chunk is None:
        return None
    if segments == 1:
        return chunks * per_chunk
    return (3 * -(-chunks // segments) * per_chunk + _COMBINE_US
            + _COMBINE_US_PER_STATE * segments * tasks)


def planned_segments(*, num_seqs: int, heads: int, longest: int, varlen: bool,
                     sm_count: int | None = None) -> int:
    """"auto": the power-of-two piece count the time model predicts fastest, 1 (serial) included.
    Packed input of several sequences stays serial: its longest sequence is known only at run
    time, and every sequence runs in all three passes, cut or not."""
    if varlen and num_seqs > 1:
        return 1
    sms = sm_count or _launch.gpu_sm_count()
    chunks = -(-longest // CHUNK)
    best, best_us = 1, _predicted_us(chunks=chunks, tasks=num_seqs * heads, segments=1, sms=sms)
    segments = 2
    while segments <= chunks and best_us is not None:
        us = _predicted_us(chunks=chunks, tasks=num_seqs * heads, segments=segments, sms=sms)
        if us is None:
            break
        if us < best_us:
            best, best_us = segments, us
        segments *= 2
    return best


