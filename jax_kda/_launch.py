"""The recurrence launch: which kernel runs the chunk recurrence, and how it is split.

kda_prefill's `recurrence=` is "auto", "baseline" or a column split (value columns per CTA,
jax_kda.options.RECURRENCES). `resolve` fixes "auto" for the size the kernels see (after vmap
folding and head sharding), once per call, at dispatch; the result travels to the FFI boundary,
where `_ffi` encodes it as the recurrence call's `block_v` attribute.
"""

from __future__ import annotations

import functools
import math

import jax

from .contract import HEAD_DIM

_DEFAULT_SM_COUNT = 132  # H200; used only when no GPU is visible at trace time

# Measured on the H200 (benchmarks/results/h200-heuristic-grid-20261129.json: recurrence alone,
# T = 8192, every block_v for H in 1..128 x N in {1, 2, 4, 8}). One chain alone on its SM takes
# ~240 / 310 / 440 / 750 us at block_v 16 / 32 / 64 / 128; the SMs hold up to three block_v = 16
# CTAs and two of 32 or 64 at once. Two co-resident block_v = 16 CTAs cost little (~310 us), a
# third a lot more (~450 us); two block_v = 32 CTAs ~560 us, two block_v = 64 CTAs ~730 us, so
# once the slices of 32 columns overflow one wave, block_v = 64 wins at every load (it shares each
# chunk's inputs among 64 columns, and two of its CTAs per SM beat one block_v = 128 CTA: 730 vs
# 750 us for the same 128 columns).
_MAX_CTAS_PER_SM_AT_16 = 2
# Short sequences past that: block_v = 16 is kept while block_v = 64 would put a second CTA on
# some SM (more than SMs / 2 tasks) and block_v = 16 needs at most five CTAs on an SM (82 tasks on
# an H200), for sequences of at most _SHORT_MEAN_TOKENS on average. Measured at 72 tasks
# (benchmarks/results/h200-20261202-grid-mix-vs-uniform.json): 6 x 1365 tokens, 16 within 3.5 %
# of 64; the packed mix [1300, 547, 2048, 963, 271, 3063], 16 1.1x ahead of 64 (its short chains
# fill the SMs that finish early). Not for long ones (...-grid-67-82-tasks.json, 8192 tokens:
# 16 is 1.06-1.24x behind at 72 and 80 tasks); lengths between 1365 and 8192 are not measured.
_MAX_CTAS_PER_SM_AT_16_OVER_TWO_AT_64 = 5
_SHORT_MEAN_TOKENS = 2048
# The baseline kernel (benchmarks/results/h200-20261201-grid-baseline-short.json, -8k.json): with
# sequences of <= 1024 tokens on average and more (sequence, head) tasks than SMs it was the
# fastest in every measured cell (192 .. 3072 tasks: 1.05-1.32x ahead of block_v = 64); at 96
# tasks block_v = 64 still won (104 vs 119 us), and wherever sequences were longer (a packed mix
# with one of 3063 tokens, 8192-token sequences) a column split won or tied: the baseline's
# per-chunk step is the slower one, so a long sequence sets its time.
_BASELINE_MAX_MEAN_TOKENS = 1024


def resolve(recurrence, *, num_seqs: int, heads: int, sm_count: int | None = None,
            numerics: str = "flashkda", tokens: int | None = None,
            baseline_allowed: bool = False) -> int | str:
    """The launch of a checked `recurrence` ("auto", "baseline" or a column split): "auto"
    becomes "baseline" or a column split by the heuristic. It may become the baseline kernel only
    where the call allows it (baseline_allowed: a plain flashkda-mode prefill, no pool or
    checkpoints) and `tokens` (all sequences together) is known."""
    if recurrence != "auto":
        return recurrence
    if (baseline_allowed and numerics == "flashkda" and tokens is not None
            and prefers_baseline(num_seqs=num_seqs, heads=heads, tokens=tokens,
                                 sm_count=sm_count)):
        return "baseline"
    return choose_block_v(num_seqs=num_seqs, heads=heads, sm_count=sm_count,
                          numerics=numerics, tokens=tokens)


def name(launch) -> str:
    """How benchmarks and messages spell a launch: "baseline", "bv16", ..., "auto"."""
    return launch if isinstance(launch, str) else f"bv{launch}"


def prefers_baseline(*, num_seqs: int, heads: int, tokens: int,
                     sm_count: int | None = None) -> bool:
    """The baseline kernel wins on the H200 where short sequences (<= 1024 tokens on average)
    give more (sequence, head) tasks than SMs (_BASELINE_MAX_MEAN_TOKENS)."""
    sms = sm_count or gpu_sm_count()
    return (tokens <= _BASELINE_MAX_MEAN_TOKENS * num_seqs and num_seqs * heads > sms)


@functools.cache
def gpu_sm_count() -> int:
    """SM count of the first visible CUDA device (all devices of one host are assumed alike)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return _DEFAULT_SM_COUNT
    return getattr(gpus[0], "core_count", None) or _DEFAULT_SM_COUNT


def ctas_per_sm(*, tasks: int, block_v: int, sm_count: int) -> int:
    """CTAs each SM must run (the busiest SM's share) for `tasks` (sequence, head) pairs."""
    return math.ceil(tasks * (HEAD_DIM // block_v) / sm_count)


def choose_block_v(*, num_seqs: int, heads: int, sm_count: int | None = None,
                   numerics: str = "flashkda", tokens: int | None = None) -> int:
    """The column split the H200 measurement found fastest (within noise) for N * H tasks:

    - 16 while no SM has to run more than two of its CTAs (N * H <= SMs / 4, 33 tasks on an
      H200): the shortest chain per chunk;
    - for sequences of <= 2048 tokens on average (`tokens`: all of them together; unknown =
      long), 16 also where 64 would put two CTAs on some SM and 16 at most five (67-82 tasks on
      an H200): a tie for equal sequences, 16 ahead for packed ones of unequal lengths;
    - else 64: the wider slice does the same work with fewer CTAs per SM.

    32 is never picked: wherever its grid fits one wave (N * H <= SMs / 4 as well), two block_v = 16
    CTAs per SM are as fast (307 vs 308 us); past one wave it loses to 64. 128 (one CTA per head)
    is never the fastest either. Both stay available through kda_prefill(recurrence=32 or 128),
    and recurrence="baseline" runs the FlashKDA-structured kernel.
    """
    sms = sm_count or gpu_sm_count()
    tasks = num_seqs * heads
    if numerics == "fp32":
        return _choose_block_v_fp32(tasks, sms)
    at_16 = ctas_per_sm(tasks=tasks, block_v=16, sm_count=sms)
    if at_16 <= _MAX_CTAS_PER_SM_AT_16:
        return 16
    short = tokens is not None and tokens <= _SHORT_MEAN_TOKENS * num_seqs
    if (short and ctas_per_sm(tasks=tasks, block_v=64, sm_count=sms) >= 2
            and at_16 <= _MAX_CTAS_PER_SM_AT_16_OVER_TWO_AT_64):
        return 16
    return 64


def _choose_block_v_fp32(tasks: int, sms: int) -> int:
    """The fp32 recurrence (benchmarks/results/h200-20261201-fp32-grid-2.json): block_v 16 and 32
    give each 8-column tile to a pair of warps (two CTAs per SM at most), 64 and 128 keep a
    tile's two key halves in one warp. The shortest chain, 16, wins while its CTAs fit two per
    SM; then 64 while one of its CTAs per SM suffices (its eight warps share each chunk's record
    among 64 columns); past that 128, which shares it among the most columns."""
    if ctas_per_sm(tasks=tasks, block_v=16, sm_count=sms) <= 2:
        return 16
    if ctas_per_sm(tasks=tasks, block_v=64, sm_count=sms) <= 1:
        return 64
    return 128
