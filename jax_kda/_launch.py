"""Launch heuristic for the column-split recurrence: how many value columns each CTA owns."""

from __future__ import annotations

import functools

import jax

from ._checks import BLOCK_V_CHOICES, HEAD_DIM

_DEFAULT_SM_COUNT = 132  # H200; used only when no GPU is visible at trace time


@functools.cache
def gpu_sm_count() -> int:
    """SM count of the first visible CUDA device (all devices of one host are assumed alike)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return _DEFAULT_SM_COUNT
    return getattr(gpus[0], "core_count", None) or _DEFAULT_SM_COUNT


def choose_block_v(*, num_seqs: int, heads: int, sm_count: int | None = None) -> int:
    """Smallest block_v whose grid (N * H * 128 / block_v CTAs) fits in one wave of the SMs.

    Narrower slices put more SMs on each head's serial chain, but past one wave the extra CTAs only
    queue behind each other. When even block_v = 128 overflows a wave, 128 is chosen: it loads each
    chunk's shared inputs once per head instead of once per slice.
    """
    sms = sm_count or gpu_sm_count()
    tasks = num_seqs * heads
    for block_v in BLOCK_V_CHOICES:
        if tasks * (HEAD_DIM // block_v) <= sms:
            return block_v
    return BLOCK_V_CHOICES[-1]
