"""The recurrence launch choice: which kernel runs the chunk recurrence, and how it is split.

`RecurrenceLaunch` is the one typed value that travels from kda_prefill's arguments
(`recurrence=`, `column_split=`) down to the FFI boundary, where `_ffi` encodes it as the custom
call's integer attribute. `requested` turns the public arguments into it (column_split None = let
the heuristic decide); `resolve` fixes the column split for a problem's size, once the size the
kernels see is known (after vmap folding and head sharding).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from .contract import COLUMN_SPLITS, HEAD_DIM

OVERLAP_COLUMN_SPLITS = (16, 32, 64)  # the column splits overlap=True accepts

RECURRENCE_KERNELS = ("auto", "column_split", "baseline")
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


@dataclasses.dataclass(frozen=True)
class RecurrenceLaunch:
    """kernel: "column_split" (each head's 128 value columns over 128 / column_split CTAs, state
    in registers), "baseline" (one CTA per (sequence, head), state in shared memory) or "auto"
    (either, chosen by `resolve`). column_split: value columns per CTA; None until resolved
    (always None for "baseline"). overlap: run prepare and the column-split recurrence as the
    overlapped call (the recurrence running while prepare writes the workspace; always False for
    "baseline")."""

    kernel: str = "auto"
    column_split: int | None = None
    overlap: bool = False

    @property
    def resolved(self) -> bool:
        return self.kernel == "baseline" or self.column_split is not None

    @property
    def name(self) -> str:
        """How benchmarks and messages spell it: "baseline", "bv16", ..., "auto"."""
        if self.kernel == "baseline":
            return "baseline"
        name = "auto" if self.column_split is None else f"bv{self.column_split}"
        return name + "-overlap" if self.overlap else name


def requested(recurrence: str, column_split, overlap=None) -> RecurrenceLaunch:
    """The launch kda_prefill's `recurrence=`, `column_split=` and `overlap=` ask for
    (checked). overlap=None is False: the overlapped call measured slower than the two calls at
    every shape on the H200 (docs/perf_notes.md, "The overlapped prefill measured"), so the
    default stays the two calls."""
    if not isinstance(recurrence, str) or recurrence not in RECURRENCE_KERNELS:
        raise ValueError(
            f"kda_prefill: recurrence must be one of {RECURRENCE_KERNELS}, got {recurrence!r}"
        )
    if column_split is not None and (isinstance(column_split, bool)
                                     or column_split not in COLUMN_SPLITS):
        raise ValueError(
            f"kda_prefill: column_split (value columns per CTA) must be None or one of "
            f"{COLUMN_SPLITS}, got {column_split!r}"
        )
    if recurrence == "baseline" and column_split is not None:
        raise ValueError(
            f"kda_prefill: column_split={column_split!r} applies to recurrence='column_split' "
            "only; recurrence='baseline' runs one CTA per (sequence, head): leave column_split=None"
        )
    if overlap is not None and not isinstance(overlap, bool):
        raise ValueError(f"kda_prefill: overlap must be None, True or False, got {overlap!r}")
    if recurrence == "baseline" and overlap:
        raise ValueError("kda_prefill: overlap=True runs the column-split recurrence; "
                         "recurrence='baseline' has no overlapped launch")
    if overlap and column_split is not None and column_split not in OVERLAP_COLUMN_SPLITS:
        raise ValueError(f"kda_prefill: overlap=True takes column_split in {OVERLAP_COLUMN_SPLITS} "
                         f"or None, got {column_split!r}")
    if recurrence == "auto" and column_split is not None:
        recurrence = "column_split"  # a column split names the column-split kernel
    return RecurrenceLaunch(recurrence, column_split, bool(overlap))


def resolve(launch: RecurrenceLaunch, *, num_seqs: int, heads: int,
            sm_count: int | None = None, numerics: str = "flashkda", tokens: int | None = None,
            baseline_allowed: bool = False) -> RecurrenceLaunch:
    """`launch` with its kernel and column split fixed by the heuristic where the caller left
    them open. "auto" may become the baseline kernel only where the call allows it
    (baseline_allowed: a plain flashkda-mode prefill, no pool or checkpoints) and `tokens` (all
    sequences together) is known; otherwise it is the column split. The overlapped call needs
    the same kind of call (overlap=True elsewhere is an error)."""
    plain_flashkda = baseline_allowed and numerics == "flashkda"
    if launch.overlap and not plain_flashkda:
        raise ValueError("kda_prefill: overlap=True runs plain numerics='flashkda' prefill only "
                         "(no state pools, checkpoints or numerics='fp32')")
    if launch.resolved:
        return launch
    if (launch.kernel == "auto" and plain_flashkda and not launch.overlap
            and tokens is not None and prefers_baseline(num_seqs=num_seqs, heads=heads,
                                                        tokens=tokens, sm_count=sm_count)):
        return RecurrenceLaunch("baseline")
    block_v = choose_block_v(num_seqs=num_seqs, heads=heads, sm_count=sm_count,
                             numerics=numerics, tokens=tokens)
    assert not launch.overlap or block_v in OVERLAP_COLUMN_SPLITS  # flashkda picks 16 or 64
    return RecurrenceLaunch("column_split", block_v, launch.overlap)


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
    is never the fastest either. Both stay available through column_split=, and
    recurrence="baseline" runs the FlashKDA-structured kernel.
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
