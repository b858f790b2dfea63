"""The options of kda_prefill and kda_decode: the values each takes and every rule about which go
together, in one place.

Each public function checks its options here, at trace time and before any backend is chosen, so a
call raises the same error on every backend and whether or not the GPU kernels are installed. The
kernel and reference paths assume what this module checked.
"""

from __future__ import annotations

import numbers

from .contract import CHUNK, COLUMN_SPLITS, INVERSE_IDS, NUMERICS

INVERSES = tuple(INVERSE_IDS)  # "stable" (default) and FlashKDA v1's "neumann"
BACKENDS = ("auto", "kernel", "reference")
# How the chunk recurrence is launched: the launch heuristic's choice, the baseline kernel (one CTA
# per (sequence, head), state in shared memory), or the column split with that many value columns
# per CTA. Every launch gives bitwise the same results.
RECURRENCES = ("auto", "baseline", *COLUMN_SPLITS)
SEQUENCE_PARALLEL_MODES = ("auto", "off")


def _one_of(fn: str, name: str, value, allowed) -> None:
    # bool is an int in Python (recurrence=True is no column count), and 16.0 is no option value
    if (isinstance(value, bool) or not isinstance(value, (str, numbers.Integral))
            or value not in allowed):
        raise ValueError(f"{fn}: {name} must be one of {allowed}, got {value!r}")


def check_numerics(fn: str, numerics, inverse) -> None:
    _one_of(fn, "numerics", numerics, NUMERICS)
    _one_of(fn, "inverse", inverse, INVERSES)
    if numerics == "fp32" and inverse != "stable":
        raise ValueError(
            f"{fn}: inverse={inverse!r} exists in the flashkda numerics only; numerics='fp32' "
            "has one f32 inverse (leave inverse='stable')"
        )


def check_backend(fn: str, backend) -> None:
    _one_of(fn, "backend", backend, BACKENDS)


def check_checkpoint_every(fn: str, checkpoint_every) -> int | None:
    """None, or a positive multiple of the chunk (16 tokens), as an int."""
    if checkpoint_every is None:
        return None
    if (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, numbers.Integral)
            or checkpoint_every <= 0 or checkpoint_every % CHUNK):
        raise ValueError(
            f"{fn}: checkpoint_every must be a positive multiple of {CHUNK} (tokens between "
            f"saved states), got {checkpoint_every!r}"
        )
    return int(checkpoint_every)


def check_sequence_parallel(fn: str, value, *, numerics: str, checkpoint_every) -> int | str:
    """The segments a prefill asks for: 1 (serial), a count n > 1, or "auto" (planned for the
    size the kernels see; serial outside the fp32 mode and with checkpoints)."""
    is_count = (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                and value >= 1)
    if not (is_count or (isinstance(value, str) and value in SEQUENCE_PARALLEL_MODES)):
        raise ValueError(f"{fn}: sequence_parallel must be 'auto', 'off' or a segment "
                         f"count >= 1, got {value!r}")
    if isinstance(value, str):
        return "auto" if value == "auto" and numerics == "fp32" and checkpoint_every is None else 1
    if value > 1 and numerics != "fp32":
        raise ValueError(f"{fn}: sequence_parallel segments need numerics='fp32' (its "
                         "rounding differs from the serial kernels, so the bitwise FlashKDA "
                         "mode has none)")
    if value > 1 and checkpoint_every is not None:
        raise ValueError(f"{fn}: sequence_parallel segments and checkpoint_every exclude "
                         "each other (a checkpoint is the serial recurrence's state, bitwise); "
                         "pass sequence_parallel='off' or 'auto' with checkpoints")
    return int(value)


def check_recurrence(fn: str, recurrence, *, numerics: str, pooled: bool,
                     checkpoint_every) -> int | str:
    """The recurrence launch ("auto", "baseline" or a column split), checked against the call's
    numerics, state pool and checkpoints."""
    _one_of(fn, "recurrence", recurrence, RECURRENCES)
    if recurrence == "baseline" and numerics == "fp32":
        raise ValueError(
            f"{fn}: recurrence='baseline' runs numerics='flashkda' only; numerics='fp32' runs "
            "the column split (recurrence='auto' or a column count)"
        )
    if recurrence == "baseline" and (pooled or checkpoint_every is not None):
        raise ValueError(
            f"{fn}: recurrence='baseline' runs plain prefill only; state pools "
            "(state_indices) and checkpoint_every need the column split (recurrence='auto' or "
            "a column count)"
        )
    return recurrence if isinstance(recurrence, str) else int(recurrence)


def check_max_segments(fn: str, max_segments) -> int:
    """The static bound on segment_ids' documents: an int >= 1."""
    if (isinstance(max_segments, bool) or not isinstance(max_segments, numbers.Integral)
            or max_segments < 1):
        raise ValueError(
            f"{fn}: max_segments must be a static int >= 1 (the most documents segment_ids may "
            f"hold; it fixes the shapes), got {max_segments!r}"
        )
    return int(max_segments)


def check_segment_ids_options(fn: str, *, segment_ids: bool, max_segments, cu_seqlens: bool,
                              pooled: bool, checkpoint_every, states: bool) -> int | None:
    """Which options go with segment_ids (given or not): returns max_segments checked, None when
    not given. states: an initial state is passed or the final state asked for."""
    if not segment_ids:
        if max_segments is not None:
            raise ValueError(f"{fn}: max_segments bounds the documents of segment_ids; it needs "
                             "segment_ids (leave it None without)")
        return None
    if max_segments is None:
        raise ValueError(
            f"{fn}: segment_ids needs max_segments, a static bound on the documents it may hold "
            "(it fixes the shapes: one state, workspace slot and kernel block row per document, "
            "and the backward's memory grows with it); B * T always holds them but costs a "
            "state per token")
    max_segments = check_max_segments(fn, max_segments)
    excluded = {
        "cu_seqlens": (cu_seqlens, "both say where documents start: pass one of them"),
        "state_indices": (pooled, "state pools serve packed sequences: pass cu_seqlens "
                                  "(jax_kda.cu_seqlens_from_segment_ids gives it)"),
        "checkpoint_every": (checkpoint_every is not None,
                             "checkpoints are placed by sequence: pass cu_seqlens "
                             "(jax_kda.cu_seqlens_from_segment_ids gives it)"),
    }
    for name, (given, why) in excluded.items():
        if given:
            raise ValueError(f"{fn}: segment_ids and {name} exclude each other ({why})")
    return max_segments
