"""Where kda_prefill(..., checkpoint_every=n) puts each sequence's intermediate states.

Sequence s of length L_s gets one checkpoint after every n tokens strictly before its end: the
states after tokens n, 2n, ..., i.e. (L_s - 1) // n of them. They are packed one sequence after
the other along the first axis of the checkpoint array, so sequence s's j-th checkpoint
(0 <= j < count_s) is row `checkpoint_offsets(cu_seqlens, n)[s] + j`:

    offsets = jax_kda.checkpoint_offsets(cu_seqlens, 64)
    out, state, ckpts = jax_kda.kda_prefill(..., cu_seqlens=cu_seqlens, checkpoint_every=64,
                                           output_final_state=True)
    state_after_128_tokens_of_seq_2 = ckpts[offsets[2] + 1]   # j = 1: tokens 0..127

Checkpoint j of sequence s is bitwise the final state of kda_prefill on that sequence's first
(j + 1) * n tokens (n is a multiple of 16, so the chunk boundaries agree). The array has
`capacity` rows: exactly the total for batched input (B sequences of T tokens: B * ((T - 1) // n)),
and T // n (an upper bound of the total) for packed sequences, whose lengths are not known at
trace time; rows past the total, and rows of padding sequences of a state pool, are zero.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def checkpoint_capacity(batch: int, seqlen: int, varlen: bool, checkpoint_every) -> int:
    """Rows of the packed checkpoint array: exact for batched input (B sequences of T tokens), an
    upper bound for packed sequences (sum over s of (len_s - 1) // n <= T // n)."""
    if checkpoint_every is None:
        return 0
    if varlen:
        return seqlen // checkpoint_every
    return batch * (max(seqlen - 1, 0) // checkpoint_every)


def checkpoint_counts(lengths, checkpoint_every: int):
    """(L - 1) // n per sequence, 0 for empty sequences (numpy or JAX arrays)."""
    xp = jnp if not isinstance(lengths, np.ndarray) else np
    lengths = xp.maximum(xp.asarray(lengths), 0)
    return xp.where(lengths > 0, (lengths - 1) // checkpoint_every, 0)


def checkpoint_offsets(cu_seqlens, checkpoint_every: int, total_tokens=None):
    """int32 [N + 1]: sequence s's checkpoints are rows offsets[s] .. offsets[s + 1] - 1.

    cu_seqlens as given to kda_prefill (numpy or JAX, int32 or int64); its values are clamped
    into [0, total_tokens] (default cu_seqlens[-1]) as the kernels clamp them. For batched input
    use `cu_seqlens = arange(B + 1) * T`.
    """
    if checkpoint_every <= 0 or checkpoint_every % 16:
        raise ValueError(
            f"checkpoint_every must be a positive multiple of 16, got {checkpoint_every}")
    xp = jnp if not isinstance(cu_seqlens, np.ndarray) else np
    cu = xp.asarray(cu_seqlens).astype(xp.int32)
    total = cu[-1] if total_tokens is None else total_tokens
    bounds = xp.clip(cu, 0, total)
    lengths = xp.maximum(bounds[1:] - bounds[:-1], 0)
    counts = checkpoint_counts(lengths, checkpoint_every).astype(xp.int32)
    return xp.concatenate([xp.zeros((1,), xp.int32), xp.cumsum(counts).astype(xp.int32)])
