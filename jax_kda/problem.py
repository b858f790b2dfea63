"""The static description of one kda_prefill or kda_decode call (shapes, dtypes and checked
options), shared by every step of the call path: partitioning over heads and vmap folding
rewrite it for the arrays they hand on, and the backends read it.

Heads: `heads` (H) is the head count of v, g, beta, A_log, dt_bias, the states and the outputs;
`qk_heads` (Hk) that of q and k, H itself or a divisor of it (grouped value heads: value head j
reads query/key head j // (H // Hk), fla's convention). Whatever splits or stacks heads rewrites
both together.

Both types are frozen and hashable, so they key compiled programs and travel as static
arguments.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .contract import HEAD_DIM
from .head_groups import group_size


class _HeadGroups:
    """What both problem types derive from heads and qk_heads (grouped value heads)."""

    def __post_init__(self):
        # qk_heads None -> heads; otherwise a divisor of heads (the checks guarantee it)
        if self.qk_heads is None:
            object.__setattr__(self, "qk_heads", self.heads)
        if self.qk_heads < 1 or self.heads % self.qk_heads:
            raise ValueError(f"heads = {self.heads} must be a multiple of qk_heads = "
                             f"{self.qk_heads}")

    @property
    def group(self) -> int:
        """G = H // Hk, the value heads per query/key head (1: not grouped)."""
        return group_size(self.qk_heads, self.heads)


@dataclasses.dataclass(frozen=True)
class Problem(_HeadGroups):
    """One kda_prefill call."""

    batch: int  # B
    seqlen: int  # T
    heads: int  # H
    num_seqs: int  # N (= B without cu_seqlens)
    varlen: bool
    state_dtype: np.dtype  # dtype of the returned final state
    scale: float
    lower_bound: float
    pool_rows: int | None = None  # P when the initial state is a pool indexed by state_indices
    checkpoint_every: int | None = None  # tokens between intermediate states, None = none
    checkpoint_capacity: int = 0  # rows of the packed checkpoint array (jax_kda.checkpoints)
    numerics: str = "flashkda"  # jax_kda.options: NUMERICS
    inverse: str = "stable"  # INVERSES
    recurrence: int | str = "auto"  # RECURRENCES, as the caller asked (resolved at dispatch)
    backend: str = "auto"  # BACKENDS
    # sequence parallelism (jax_kda._sequence_parallel, fp32 mode): tokens per piece of a cut
    # sequence, or plan_segments: the kernel path plans it for the size it sees
    segment_length: int | None = None
    plan_segments: bool = False
    qk_heads: int | None = None  # Hk; None: H (no grouping)

    @property
    def plain(self) -> bool:
        """No state pool and no checkpoints."""
        return self.pool_rows is None and self.checkpoint_every is None

    def result_shapes(self):
        """(out, final state or pool, checkpoints or None) as ShapeDtypeStructs."""
        state_rows = self.num_seqs if self.pool_rows is None else self.pool_rows
        state = (state_rows, self.heads, HEAD_DIM, HEAD_DIM)
        checkpoints = None
        if self.checkpoint_every is not None:
            checkpoints = jax.ShapeDtypeStruct(
                (self.checkpoint_capacity, self.heads, HEAD_DIM, HEAD_DIM), self.state_dtype)
        return (jax.ShapeDtypeStruct((self.batch, self.seqlen, self.heads, HEAD_DIM),
                                     jnp.bfloat16),
                jax.ShapeDtypeStruct(state, self.state_dtype), checkpoints)


@dataclasses.dataclass(frozen=True)
class DecodeProblem(_HeadGroups):
    """One kda_decode call."""

    num_seqs: int  # N
    tokens: int  # t, tokens per sequence (1..16)
    heads: int  # H
    pool_rows: int  # P
    indexed: bool  # state_indices given
    state_dtype: np.dtype
    scale: float
    lower_bound: float
    intermediate_states: bool
    numerics: str = "flashkda"
    inverse: str = "stable"
    backend: str = "auto"
    qk_heads: int | None = None  # Hk; None: H (no grouping)

    def result_shapes(self):
        """(out, new state or pool, intermediate states or None) as ShapeDtypeStructs."""
        per_token = (self.num_seqs, self.tokens, self.heads)
        states = None
        if self.intermediate_states:
            states = jax.ShapeDtypeStruct(per_token + (HEAD_DIM, HEAD_DIM), self.state_dtype)
        return (jax.ShapeDtypeStruct(per_token + (HEAD_DIM,), jnp.bfloat16),
                jax.ShapeDtypeStruct((self.pool_rows, self.heads, HEAD_DIM, HEAD_DIM),
                                     self.state_dtype), states)
