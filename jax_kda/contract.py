"""The kernel contract: every fact that the Python runtime, the CuTe DSL kernels, the ahead-of-time
build and the C++ FFI handlers must agree on, written down once.

Standard library only, so that the build can run it as a script (`python contract.py --header
FILE` writes the C++ header `kernel_contract.h` the handlers are compiled against) and the kernels
can import it without JAX. docs/kernel_abi.md explains the operands and layouts these numbers
describe.

Adding a GPU architecture: one entry in ARCHS (CuTe DSL must support it); the handlers and
`jax_kda._ffi` dispatch on the compute capabilities listed there.
"""

from __future__ import annotations

import argparse
import pathlib

# ---- problem geometry -------------------------------------------------------------------------
HEAD_DIM = 128  # K = V = 128 for every head
CHUNK = 16  # tokens per chunk of the chunked recurrence

# ---- the prepare -> recurrence workspace: one record per (head, chunk slot) ---------------------
# Byte offsets inside a record. kd, qd, kr: bf16 [16, 128] in swizzled rows (element (r, c) at
# element offset r * 128 + ((c // 8) ^ (r % 8)) * 8 + c % 8); gt: f32 [128]; INV, Mqk: bf16
# [16, 16] row-major.
KD_OFFSET = 0
QD_OFFSET = 4096
KR_OFFSET = 8192
GT_OFFSET = 12288
INV_OFFSET = 12800
MQK_OFFSET = 13312
RECORD_BYTES = 13824


# The "fp32" numerics mode's record (docs/fp32_mode.md section 3): hi/lo bf16 pairs instead of
# single bf16 tiles; kd has no lo (P = kd . S^T uses only kd's hi). Tiles are swizzled like the
# bf16 record's; gt f32 [128]; INV and Mqk hi/lo bf16 [16, 16] row-major. Every field starts on a
# 512-byte boundary and the hi tiles keep the bf16 record's offsets.
FP32_RECORD = {
    "kd_hi": 0,
    "qd_hi": 4096,
    "kr_hi": 8192,
    "qd_lo": 12288,
    "kr_lo": 16384,
    "gt": 20480,
    "inv_hi": 20992,
    "inv_lo": 21504,
    "mqk_hi": 22016,
    "mqk_lo": 22528,
}
FP32_RECORD_BYTES = 23040

# kda_prefill's `numerics`: the bitwise FlashKDA arithmetic (default) or the float32 mode.
NUMERICS = ("flashkda", "fp32")


def record_bytes(numerics: str) -> int:
    """Bytes of one workspace record in a numerics mode."""
    return {"flashkda": RECORD_BYTES, "fp32": FP32_RECORD_BYTES}[numerics]


def workspace_slots(total_tokens: int, num_seqs: int) -> int:
    """Chunk slots of a workspace: ceil(T_total / 16) + N. Chunk c of sequence n lives in slot
    cu_seqlens[n] // 16 + n + c, so every sequence starts a fresh slot whatever its offset."""
    return -(-total_tokens // CHUNK) + num_seqs


# ---- launch choices and their custom-call attribute encodings -----------------------------------
COLUMN_SPLITS = (16, 32, 64, 128)  # value columns per CTA of the column-split recurrence
# The recurrence's `block_v` attribute value that selects the baseline kernel (one CTA per
# (sequence, head), state in shared memory) instead of a column split.
BASELINE_BLOCK_V = 0
INVERSE_IDS = {"stable": 0, "neumann": 1}  # the prepare's and the decode's `inverse` attribute
STATE_DTYPE_IDS = {"bf16": 0, "f32": 1}  # state pools and checkpoints (chosen by buffer dtype)
MAX_DECODE_TOKENS = CHUNK  # the decode kernel runs one chunk: up to 16 tokens per sequence

# ---- targets and architectures ------------------------------------------------------------------
ABI_VERSION = 9  # bumped whenever docs/kernel_abi.md changes incompatibly
PREPARE_TARGET = "jax_kda_prepare_v1"
RECURRENCE_TARGET = "jax_kda_recurrence_v1"
# The recurrence on a state pool (state_indices, bf16 or f32 rows updated in place), with
# optional checkpoints.
RECURRENCE_POOL_TARGET = "jax_kda_recurrence_pool_v1"
DECODE_TARGET = "jax_kda_decode_v1"  # prepare + one chunk for t <= 16 tokens on a state pool
# The fp32 numerics mode's prepare (23,040-byte records) and column-split recurrence (f32 states).
PREPARE_FP32_TARGET = "jax_kda_prepare_fp32_v1"
RECURRENCE_FP32_TARGET = "jax_kda_recurrence_fp32_v1"
# ... and its recurrence on a state pool: RECURRENCE_POOL_TARGET's operands with fp32 records.
RECURRENCE_FP32_POOL_TARGET = "jax_kda_recurrence_fp32_pool_v1"
# ... and its fused decode: DECODE_TARGET's operands and attributes (inverse "stable")
DECODE_FP32_TARGET = "jax_kda_decode_fp32_v1"
# The backward pass's serial chains, both in one custom call: a chunked f32 state recurrence
# (jax_kda/kernels/state_chain.py) with R rows per chunk, the forward state recompute (chunks first
# to last) and the reverse state-gradient chain (chunks last to first).
STATE_CHAIN_TARGET = "jax_kda_state_chains_v1"
FORWARD_CHAIN_ROWS = 16
REVERSE_CHAIN_ROWS = 32
CUSTOM_CALL_TARGETS = (PREPARE_TARGET, RECURRENCE_TARGET, RECURRENCE_POOL_TARGET, DECODE_TARGET,
                       PREPARE_FP32_TARGET, RECURRENCE_FP32_TARGET, RECURRENCE_FP32_POOL_TARGET,
                       DECODE_FP32_TARGET, STATE_CHAIN_TARGET)
# CuTe DSL target -> (major, minor) compute capability it runs on. The "a" targets are not
# forward compatible: sm_90a runs on 9.0 only, sm_100a on 10.0 only.
ARCHS = {"sm_90a": (9, 0), "sm_100a": (10, 0)}

# ---- compiler options ---------------------------------------------------------------------------
# FlashKDA is built with nvcc --use_fast_math: f32 ops flush subnormals, divisions and square
# roots are approximate. The kernels pin every rounding with explicit PTX, so these options only
# matter where the compiler emits f32 arithmetic on its own.
NVVM_FAST_MATH = "nvvm-options='-ftz=1 -prec-div=0 -prec-sqrt=0 -fma=1'"


def arch_sm(arch: str) -> int:
    """The SM number of a CuTe DSL target: "sm_90a" -> 90."""
    major, minor = ARCHS[arch]
    return 10 * major + minor


def supported_compute_capabilities() -> tuple[str, ...]:
    """The compute capabilities the kernels run on, as JAX spells them ("9.0", "10.0")."""
    return tuple(f"{major}.{minor}" for major, minor in ARCHS.values())


def cpp_header() -> str:
    """The C++ header with the numbers the FFI handlers check and dispatch on."""
    sms = ", ".join(str(arch_sm(a)) for a in ARCHS)
    splits = ", ".join(str(b) for b in COLUMN_SPLITS)
    lines = [
        "// Generated from jax_kda/contract.py (python jax_kda/contract.py --header FILE); "
        "do not edit.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace jax_kda {",
        "",
        f"constexpr int kAbiVersion = {ABI_VERSION};",
        f"constexpr int64_t kHeadDim = {HEAD_DIM};",
        f"constexpr int64_t kChunk = {CHUNK};",
        f"constexpr int64_t kRecordBytes = {RECORD_BYTES};",
        f"constexpr int64_t kFp32RecordBytes = {FP32_RECORD_BYTES};",
        f"constexpr int32_t kBaselineBlockV = {BASELINE_BLOCK_V};",
        f"constexpr int32_t kColumnSplits[] = {{{splits}}};",
        f"constexpr int32_t kInverseStable = {INVERSE_IDS['stable']};",
        f"constexpr int32_t kInverseNeumann = {INVERSE_IDS['neumann']};",
        f"constexpr int32_t kStateBf16 = {STATE_DTYPE_IDS['bf16']};",
        f"constexpr int32_t kStateF32 = {STATE_DTYPE_IDS['f32']};",
        f"constexpr int64_t kMaxDecodeTokens = {MAX_DECODE_TOKENS};",
        f"constexpr int64_t kForwardChainRows = {FORWARD_CHAIN_ROWS};",
        f"constexpr int64_t kReverseChainRows = {REVERSE_CHAIN_ROWS};",
        f"constexpr int kSupportedSms[] = {{{sms}}};  // 10 * major + minor",
        "",
        "}  // namespace jax_kda",
        "",
    ]
    return "\n".join(lines)


def write_cpp_header(path: pathlib.Path) -> None:
    """Writes cpp_header() to `path` unless it already holds exactly that (keeps builds cached)."""
    text = cpp_header()
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the kernel contract as a C++ header.")
    parser.add_argument("--header", type=pathlib.Path, required=True)
    write_cpp_header(parser.parse_args().header)
