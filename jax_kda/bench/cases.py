"""Benchmark cases: which sequence lengths and head counts to time."""

from __future__ import annotations

import dataclasses

# The cases of the team's baseline table (FlashKDA v1 and fla measured on the H200).
BASELINE_HEADS = (96, 48, 24, 12, 6)
BASELINE_VARLEN = (1300, 547, 2048, 963, 271, 3063)


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem shape: packed sequences of the given lengths, H heads, D = 128."""

    seq_lens: tuple[int, ...]
    heads: int
    # "batched": B = len(seq_lens) rows of equal length, no cu_seqlens;
    # "varlen": B = 1, sequences packed along T with cu_seqlens.
    layout: str = "batched"

    def __post_init__(self):
        if not self.seq_lens or any(n < 0 for n in self.seq_lens):
            raise ValueError(f"sequence lengths must be >= 0 and at least one, got {self.seq_lens}")
        if self.heads < 1:
            raise ValueError(f"heads must be >= 1, got {self.heads}")
        if self.layout not in ("batched", "varlen"):
            raise ValueError(f"layout must be 'batched' or 'varlen', got {self.layout!r}")
        if self.layout == "batched" and len(set(self.seq_lens)) != 1:
            raise ValueError(f"a batched case needs equal lengths, got {self.seq_lens}")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def name(self) -> str:
        lens = self.seq_lens
        if self.layout == "batched" and len(lens) == 1:
            shape = f"T{lens[0]}"
        elif self.layout == "batched":
            shape = f"B{len(lens)}xT{lens[0]}"
        elif len(set(lens)) == 1:
            shape = f"varlen{len(lens)}x{lens[0]}"
        else:
            shape = "varlen[" + ",".join(map(str, lens)) + "]"
        return f"{shape}_H{self.heads}"

    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return out

    def as_dict(self) -> dict:
        return {
            "name": self.name, "seq_lens": list(self.seq_lens), "heads": self.heads,
            "layout": self.layout, "num_seqs": self.num_seqs, "tokens": self.tokens,
        }


def baseline_cases() -> list[Case]:
    """The cases of the baseline measurements: T=8192 over a head sweep, varlen mixes, T=32768 and T=2048."""
    cases = [Case((8192,), h) for h in BASELINE_HEADS]
    cases += [
        Case(BASELINE_VARLEN, 96, "varlen"),
        Case((1024,) * 8, 96, "varlen"),
        Case((1024,) * 8, 12, "varlen"),
        Case((32768,), 12),
        Case((2048,), 12),
    ]
    return cases


def tiny_cases() -> list[Case]:
    """Small shapes that run in seconds on a CPU with the reference."""
    return [Case((64,), 2), Case((17, 0, 40), 1, "varlen")]


def baseline_other_cases() -> list[Case]:
    """The baseline cases other than the T = 8192 head sweep (varlen mixes, T = 32768, 2048)."""
    return baseline_cases()[len(BASELINE_HEADS):]


PRESETS = {"baselines": baseline_cases, "baselines-other": baseline_other_cases, "tiny": tiny_cases}


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{what}: expected at least one integer, got {text!r}")
    return values


def build_cases(*, preset, seqlens, heads, num_seqs, layout, varlens) -> list[Case]:
    """Cases from the command line: a preset, and/or seqlen x heads grids and varlen mixes."""
    cases: list[Case] = list(PRESETS[preset]()) if preset else []
    if seqlens:
        for T in seqlens:
            for h in heads:
                if num_seqs == 1:
                    cases.append(Case((T,), h))
                else:
                    cases.append(Case((T,) * num_seqs, h, layout))
    for lens in varlens:
        for h in heads:
            cases.append(Case(tuple(lens), h, "varlen"))
    unique, seen = [], set()
    for case in cases:
        if case not in seen:
            seen.add(case)
            unique.append(case)
    return unique
