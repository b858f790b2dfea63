"""What the recurrence kernels share: the chunk's sequence bounds, the lane index maps of the
mma.sync fragments, the workspace offsets and the fake arguments they are compiled with.

The index maps are plain integer arithmetic: the kernels evaluate them on DSL Int32 values and the
CPU fragment simulator in tests/kernel_sim.py on numpy ints, so both run the same formulas
(ptx.py writes the fragment layouts out).
"""

import cutlass
from cutlass import BFloat16, Int32, Uint8

from .. import contract
from .compile_utils import fake_stream, fake_tensor, symbol

D, CHUNK, RECORD_BYTES = contract.HEAD_DIM, contract.CHUNK, contract.RECORD_BYTES
OFF_KD, OFF_QD, OFF_KR = contract.KD_OFFSET, contract.QD_OFFSET, contract.KR_OFFSET
OFF_GT, OFF_INV, OFF_MQK = contract.GT_OFFSET, contract.INV_OFFSET, contract.MQK_OFFSET


def sequence_start(cu_seqlens, n, t_total):
    """cu_seqlens[n] clamped into [0, t_total], so that malformed values never index out of
    bounds (docs/kernel_abi.md)."""
    return cutlass.min(cutlass.max(cu_seqlens[n], Int32(0)), t_total)


def sequence_bounds(cu_seqlens, seq, t_total):
    """(bos, eos) of sequence `seq`, both in [0, t_total]; end < start reads as an empty
    sequence."""
    bos = sequence_start(cu_seqlens, seq, t_total)
    eos = cutlass.min(cutlass.max(cu_seqlens[seq + 1], bos), t_total)
    return bos, eos


def ldmatrix_a_offset(lane, kb):
    """Byte offset in a swizzled 16x128 tile of the row this lane addresses for the A operand
    (rows x k) of k-block kb: matrix i = lane // 8 covers rows (i % 2) * 8.., k 16kb + (i // 2) * 8..
    Swizzle (kernel_abi.md): granule c // 8 of row r is stored at granule (c // 8) ^ (r % 8)."""
    row = ((lane // 8) % 2) * 8 + lane % 8
    return row * 256 + ((2 * kb + (lane // 8) // 2) ^ (lane % 8)) * 16


def ldmatrix_krt_offset(lane, mt):
    """Same for kr^T (k x rows) of k-tile mt, read with ldmatrix.trans: matrix i = lane // 8
    covers kr rows (i // 2) * 8.., k 16mt + (i % 2) * 8.. (its transpose is A's 8x8 block i)."""
    row = ((lane // 8) // 2) * 8 + lane % 8
    return row * 256 + ((2 * mt + (lane // 8) % 2) ^ (lane % 8)) * 16


def ldmatrix_small_offset(lane):
    """Byte offset for the A operand of a plain row-major 16x16 bf16 tile (INV, Mqk)."""
    row = ((lane // 8) % 2) * 8 + lane % 8
    return row * 32 + ((lane // 8) // 2) * 16


def acc_row(lane, half):
    """Row (0..15) of accumulator registers c[2*half], c[2*half+1] of this lane."""
    return half * 8 + lane // 4


def acc_col(lane):
    """Column (0..7) of c[0] / c[2]; c[1] / c[3] are the next column."""
    return 2 * (lane % 4)


def recurrence_args():
    """Fake arguments of a recurrence kernel's host __call__ (docs/kernel_abi.md): v, beta,
    workspace, cu_seqlens, initial state, out, final state (T_total, H, N, S dynamic), stream."""
    t_total, heads = symbol("T_total"), symbol("H")
    seqs_plus_1, seqs, slots = symbol("N_plus_1"), symbol("N"), symbol("S")
    return (
        fake_tensor(BFloat16, (t_total, heads, D), 16),  # v
        fake_tensor(BFloat16, (t_total, heads), 2),  # beta
        fake_tensor(Uint8, (heads, slots, RECORD_BYTES), 16),  # workspace
        fake_tensor(Int32, (seqs_plus_1,), 4),  # cu_seqlens
        fake_tensor(BFloat16, (seqs, heads, D, D), 16),  # initial state
        fake_tensor(BFloat16, (t_total, heads, D), 16),  # out
        fake_tensor(BFloat16, (seqs, heads, D, D), 16),  # final state
        fake_stream(),
    )
