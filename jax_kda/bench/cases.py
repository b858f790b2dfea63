"""Benchmark cases: which sequence lengths and head counts to time (prefill), and which decode
steps (N sequences x H heads, t new tokens each, states in a pool)."""

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

    kind = "prefill"  # a class constant: DecodeCase's is "decode"

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


STATE_DTYPES = {"bf16": "bfloat16", "f32": "float32"}  # short name -> numpy / JAX dtype name


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode step: N sequences x H heads, t new tokens each (kda_decode's [N, t, H, 128]),
    their states rows of a pool of P >= N rows (bf16 or f32), picked by state_indices.

    The step reads and writes N states of H x 128 x 128 elements: state_bytes, whose time at the
    copy rate is the floor of any decode step on the case."""

    num_seqs: int
    heads: int
    tokens_per_seq: int = 1
    state_dtype: str = "bf16"  # a key of STATE_DTYPES
    pool_rows: int = 0  # P; 0 means P = N

    layout = "decode"
    kind = "decode"

    def __post_init__(self):
        if self.num_seqs < 1 or self.heads < 1:
            raise ValueError(f"a decode case needs N >= 1 sequences and H >= 1 heads, got "
                             f"N={self.num_seqs}, H={self.heads}")
        if not 1 <= self.tokens_per_seq <= 16:
            raise ValueError(f"a decode step takes 1 <= t <= 16 tokens per sequence, got "
                             f"{self.tokens_per_seq}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state dtype must be one of {sorted(STATE_DTYPES)}, got "
                             f"{self.state_dtype!r}")
        if self.pool_rows == 0:
            object.__setattr__(self, "pool_rows", self.num_seqs)
        if self.pool_rows < self.num_seqs:
            raise ValueError(f"the pool needs P >= N = {self.num_seqs} rows, got {self.pool_rows}")

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return (self.tokens_per_seq,) * self.num_seqs

    @property
    def tokens(self) -> int:
        return self.num_seqs * self.tokens_per_seq

    @property
    def state_itemsize(self) -> int:
        return {"bf16": 2, "f32": 4}[self.state_dtype]

    @property
    def state_bytes(self) -> int:
        """Bytes of state a step must move: N states of H x 128 x 128, read once, written once."""
        return 2 * self.num_seqs * self.heads * 128 * 128 * self.state_itemsize

    @property
    def name(self) -> str:
        pool = "" if self.pool_rows == self.num_seqs else f"_P{self.pool_rows}"
        return (f"decode{self.num_seqs}x{self.heads}_t{self.tokens_per_seq}_{self.state_dtype}"
                f"{pool}")

    def as_dict(self) -> dict:
        return {
            "name": self.name, "case_kind": "decode", "seq_lens": list(self.seq_lens),
            "heads": self.heads, "layout": self.layout, "num_seqs": self.num_seqs,
            "tokens": self.tokens, "tokens_per_seq": self.tokens_per_seq,
            "pool_rows": self.pool_rows, "state_dtype": self.state_dtype,
            "state_bytes": self.state_bytes,
        }


# The decode table: (N, H, t), each with a bf16 and an f32 pool of P = N rows.
DECODE_SHAPES = ((64, 12, 1), (256, 12, 1), (1024, 12, 1), (256, 96, 1), (256, 12, 4))


def decode_cases() -> list[DecodeCase]:
    """Decode steps of a serving batch: 64 to 1024 sequences at 12 heads (a TP8 shard of
    Kimi-K3), 256 at 96 heads, and 4 tokens per step (speculative verify), bf16 and f32 pools."""
    return [DecodeCase(n, h, t, dtype) for n, h, t in DECODE_SHAPES for dtype in ("bf16", "f32")]


def decode_tiny_cases() -> list[DecodeCase]:
    """Decode steps that run in seconds on a CPU with the reference (one pool larger than N)."""
    return [DecodeCase(3, 2, 1, "bf16", pool_rows=5), DecodeCase(2, 1, 3, "f32")]


def baseline_cases() -> list[Case]:
    """The cases of the baseline measurements: T=8192 over a head sweep, varlen mixes, T=32768
    and T=2048."""
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


def throughput_cases() -> list[Case]:
    """A full GPU, where time is set by throughput: T = 8192 at 96, 48 and 6 heads, and 8
    packed sequences of 1024 tokens at 96 and 12 heads."""
    return [Case((8192,), h) for h in (96, 48, 6)] + [
        Case((1024,) * 8, h, "varlen") for h in (96, 12)]


LONG_CONTEXT_SEQLENS = (8192, 32768, 65536, 131072)
LONG_CONTEXT_HEADS = (1, 4, 8, 12)


def long_context_cases() -> list[Case]:
    """One long sequence at few heads (T = 8K .. 128K, heads 1 .. 12): where the serial chain per
    head leaves the GPU idle and sequence parallelism (--sequence-parallel) is meant to help."""
    return [Case((t,), h) for t in LONG_CONTEXT_SEQLENS for h in LONG_CONTEXT_HEADS]


def training_cases() -> list[Case]:
    """The training table: T = 8192 over the head sweep, and 8 packed sequences of 1024 tokens at
    32 heads."""
    return [Case((8192,), h) for h in BASELINE_HEADS] + [Case((1024,) * 8, 32, "varlen")]


PRESETS = {"baselines": baseline_cases, "baselines-other": baseline_other_cases, "tiny": tiny_cases,
           "decode": decode_cases, "decode-tiny": decode_tiny_cases,
           "long-context": long_context_cases, "throughput": throughput_cases,
           "training": training_cases}


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{what}: expected at least one integer, got {text!r}")
    return values


def parse_decode(text: str) -> tuple[int, int, int]:
    """--decode N,H,t (t defaults to 1): N sequences x H heads, t tokens each."""
    values = parse_int_list(text, "--decode")
    if len(values) == 2:
        values += (1,)
    if len(values) != 3:
        raise ValueError(f"--decode: expected N,H or N,H,t, got {text!r}")
    return values


def parse_state_dtypes(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [v for v in values if v not in STATE_DTYPES]
    if bad or not values:
        raise ValueError(f"--state-dtype: expected a comma-separated subset of "
                         f"{','.join(STATE_DTYPES)}, got {text!r}")
    return values


def build_cases(*, preset, seqlens, heads, num_seqs, layout, varlens, decodes=(),
                state_dtypes=("bf16", "f32"), pool_extra=0) -> list:
    """Cases from the command line: a preset, and/or seqlen x heads grids and varlen mixes, and
    decode steps (N, H, t) for each state dtype with a pool of N + pool_extra rows."""
    cases: list = list(PRESETS[preset]()) if preset else []
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
    if pool_extra < 0:
        raise ValueError(f"--pool-extra must be >= 0, got {pool_extra}")
    for n, h, t in decodes:
        for dtype in state_dtypes:
            cases.append(DecodeCase(n, h, t, dtype, pool_rows=n + pool_extra))
    unique, seen = [], set()
    for case in cases:
        if case not in seen:
            seen.add(case)
            unique.append(case)
    return unique
