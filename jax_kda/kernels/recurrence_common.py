"""What the recurrence kernels share: the chunk's sequence bounds, the lane index maps of the
mma.sync fragments, the workspace offsets, a column-split CTA's setup (cta_setup: indices,
sequence bounds, the stage loader's sources; beta_bits), the swizzled shared-memory state tile
(state pools: serving recurrence and fused decode) and the fake arguments they are compiled with.

The index maps are plain integer arithmetic: the kernels evaluate them on DSL Int32 values and the
CPU fragment simulator in tests/kernel_sim.py on numpy ints, so both run the same formulas
(ptx.py writes the fragment layouts out).
"""

import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, cute

from .. import contract
from . import ptx
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


def checkpoint_segments(checkpoint_chunks, num_chunks):
    """(chunks per segment, segments) of a pool recurrence's chunk loop (both numerics modes):
    checkpoint_chunks per segment (> 0), else the whole sequence as one; ceil(num_chunks / seg)
    without overflow for a huge checkpoint_chunks."""
    seg = cutlass.max(
        Int32(cutlass.select_(checkpoint_chunks > 0, checkpoint_chunks, num_chunks)), Int32(1)
    )
    num_segs = Int32(cutlass.select_(num_chunks > 0, (num_chunks - 1) // seg + 1, Int32(0)))
    return seg, num_segs


@cute.jit
def zero_padding_out(out_base: Int64, tid: Int32, bos: Int32, eos: Int32, num_chunks: Int32,
                     num_heads: Int32, block_v: cutlass.Constexpr):
    """A padding slot's out rows of a CTA's block_v columns (out_base: its first column of token
    0): zeros, one 16-byte store per thread and chunk (16 rows x block_v / 8 granules <= the
    CTA's threads)."""
    per_row = block_v // 8
    zero = Int32(0)
    r = tid // per_row
    gq = tid % per_row
    for c in range(num_chunks):
        tok = bos + c * CHUNK + r
        if (r < CHUNK) & (tok < eos):
            ptx.st_global_v4(
                out_base + (Int64(tok) * Int64(num_heads) * D + Int64(gq) * 8) * 2,
                [zero, zero, zero, zero],
            )


def ldmatrix_a_offset(lane, kb):
    """Byte offset in a swizzled 16x128 tile of the row this lane addresses for the A operand
    (rows x k) of k-block kb: matrix i = lane // 8 covers rows (i % 2) * 8.., k 16kb +
    (i // 2) * 8..
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


# ---- a column-split CTA's setup (both numerics modes' recurrences) -----------------------------
# Plain trace-time Python, so that both kernels emit the same instructions for it.
class Cta:
    """Per-CTA trace-time values of a column-split recurrence CTA (a plain bag)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def cta_setup(rec, mV, mBeta, mWorkspace, mCuSeqlens, mOut):
    """Thread / block indices, the sequence's bounds and chunk count, the stage loader's sources
    and this lane's out addresses."""
    NT = rec.n_tiles
    BV = rec.block_v
    tid, _, _ = cute.arch.thread_idx()
    slice_idx, head, seq = cute.arch.block_idx()
    warp = tid // 32
    lane = tid % 32
    t2 = acc_col(lane)

    t_total = mV.shape[0]
    num_heads = mV.shape[1]
    num_slots = mWorkspace.shape[1]

    bos, eos = sequence_bounds(mCuSeqlens, seq, t_total)
    num_chunks = (eos - bos + (CHUNK - 1)) // CHUNK
    last_chunk = num_chunks - 1
    slot0 = bos // CHUNK + seq

    col_cta = slice_idx * BV  # first value column of this CTA
    col_w = warp * (8 * NT)  # first column of this warp, relative to col_cta

    # Raw addresses (compact row-major tensors, docs/kernel_abi.md).
    src = StageSources(
        ws_head=mWorkspace.iterator.toint()
        + Int64(head) * Int64(num_slots) * RECORD_BYTES,
        slot0=slot0,
        v_col0=mV.iterator.toint() + Int64(col_cta) * 2,
        beta_base=mBeta.iterator.toint(),
        num_heads=num_heads,
        head=head,
        bos=bos,
        eos=eos,
        beta_elems=t_total * num_heads,
        tid=tid,
        nthreads=rec.num_threads,
        block_v=BV,
        v_off=rec.v_off,
        beta_off=rec.beta_off,
    )
    # out[tok, head, col] lives at out_lane[nt] + tok * out_row_bytes (this lane's column
    # of n-tile nt)
    out_row_bytes = Int64(num_heads) * (D * 2)
    out_lane = [
        mOut.iterator.toint()
        + (Int64(head) * D + Int64(col_cta + col_w + nt * 8 + t2)) * 2
        for nt in range(NT)
    ]
    return Cta(
        n_tiles=NT,
        block_v=BV,
        stage_bytes=rec.stage_bytes,
        nthreads=rec.num_threads,
        tid=tid,
        lane=lane,
        t2=t2,
        head=head,
        seq=seq,
        num_heads=num_heads,
        bos=bos,
        eos=eos,
        num_chunks=num_chunks,
        last_chunk=last_chunk,
        col_cta=col_cta,
        col_w=col_w,
        src=src,
        out_row_bytes=out_row_bytes,
        out_lane=out_lane,
    )


class StageSources:
    """Per-CTA constants of the stage loader (a plain bag of trace-time values)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def beta_bits(src, stage, row_tok0, r):
    """The raw bf16 beta logit of chunk row r from the stage (low 16 bits of an Int32)."""
    elem = (row_tok0 + r) * src.num_heads + src.head
    byte = Int32(src.beta_base + Int64(elem) * 2) & 2
    return ptx.ld_shared_u16(stage + src.beta_off + r * 4 + byte)


# ---- the state tile in shared memory (serving recurrence, fused decode) ------------------------
# Rows v (value columns, relative to the tile's first), 128 bf16 k values each (256 bytes); the
# 16-byte granule kg of row v is stored at granule kg ^ (v % 8) (the same swizzle as the
# workspace tiles and recurrence_baseline.state_smem_offset). A 16-byte access per lane of eight
# consecutive lanes along one row, and an ldmatrix phase (eight consecutive rows, one logical
# granule), each touch all 32 banks once.
STATE_DTYPES = {"bf16": BFloat16, "f32": Float32}
STATE_ELEM_BYTES = {"bf16": 2, "f32": 4}


def state_smem_offset(v, k):
    """Byte offset of S[v, k] in a swizzled bf16 state tile (v relative to the tile)."""
    return v * (D * 2) + ((k // 8) ^ (v % 8)) * 16 + (k % 8) * 2


def state_frag_count(n_tiles):
    """ldmatrix.x4 / stmatrix.x4 instructions per warp for its 16 * n_tiles state registers."""
    return 4 * n_tiles


def state_frag_regs(q, n_tiles):
    """(mt, nt, half) of the four registers of state fragment instruction q (0 ..
    state_frag_count - 1): register m of it holds the accumulator-layout state register
    state[mt, nt, half] (recurrence.state_reg) when read with ldmatrix.trans, its B-operand
    transpose (movmatrix.trans of it) when read with plain ldmatrix.
    n_tiles == 1: q covers k-tiles 2q, 2q + 1 of the warp's single n-tile; n_tiles even: q =
    mt * (n_tiles // 2) + pair covers k-tile mt of n-tiles 2 pair, 2 pair + 1."""
    if n_tiles == 1:
        return [(2 * q + m // 2, 0, m % 2) for m in range(4)]
    mt, pair = divmod(q, n_tiles // 2)
    return [(mt, 2 * pair + m // 2, m % 2) for m in range(4)]


def state_frag_offset(lane, q, col_w, n_tiles):
    """Byte offset in the state tile of the row this lane addresses for state fragment instruction
    q of a warp owning rows col_w .. col_w + 8 n_tiles - 1: matrix m = lane // 8 is the 8x8 block
    S[v0 .. v0+7][k0 .. k0+7] of register m of state_frag_regs(q) (v0 = col_w + 8 nt, k0 = 16 mt +
    8 half), row lane % 8 of it."""
    m = lane // 8
    if n_tiles == 1:
        v = col_w + lane % 8
        k = 32 * q + 8 * m
    else:
        mt, pair = divmod(q, n_tiles // 2)
        v = col_w + 8 * (2 * pair + m // 2) + lane % 8
        k = 16 * mt + 8 * (m % 2)
    return state_smem_offset(v, k)


def state_copy_unit(index, elem_bytes):
    """(row v, first k) of 16-byte global unit `index` of a state slice (rows of 128 values):
    units run along the rows, 128 * elem_bytes / 16 per row (16 bf16: a granule of the tile;
    32 f32: half a granule), so consecutive lanes touch consecutive global bytes."""
    per_row = D * elem_bytes // 16
    return index // per_row, (index % per_row) * (16 // elem_bytes)


def recurrence_args(state_dtype=BFloat16, record_bytes=RECORD_BYTES):
    """Fake arguments of a recurrence kernel's host __call__ (docs/kernel_abi.md): v, beta,
    workspace, cu_seqlens, initial state, out, final state (T_total, H, N, S dynamic), stream.
    The fp32 mode's recurrence takes f32 states and 23,040-byte records (recurrence_fp32_args)."""
    t_total, heads = symbol("T_total"), symbol("H")
    seqs_plus_1, seqs, slots = symbol("N_plus_1"), symbol("N"), symbol("S")
    return (
        fake_tensor(BFloat16, (t_total, heads, D), 16),  # v
        fake_tensor(BFloat16, (t_total, heads), 2),  # beta
        fake_tensor(Uint8, (heads, slots, record_bytes), 16),  # workspace
        fake_tensor(Int32, (seqs_plus_1,), 4),  # cu_seqlens
        fake_tensor(state_dtype, (seqs, heads, D, D), 16),  # initial state
        fake_tensor(BFloat16, (t_total, heads, D), 16),  # out
        fake_tensor(state_dtype, (seqs, heads, D, D), 16),  # final state
        fake_stream(),
    )


def recurrence_pool_args(state_dtype, record_bytes=RECORD_BYTES):
    """Fake arguments of the serving recurrence's host __call__ (KdaRecurrence(serving=True);
    the fp32 mode's KdaRecurrenceFp32Pool with 23,040-byte records): v, beta, workspace,
    cu_seqlens, state_indices, checkpoint_offsets, pool, out, checkpoints, checkpoint_chunks,
    stream (T_total, H, N, S, P, C dynamic)."""
    t_total, heads = symbol("T_total"), symbol("H")
    seqs_plus_1, seqs, slots = symbol("N_plus_1"), symbol("N"), symbol("S")
    rows, ckpts = symbol("P"), symbol("C")
    sdt = STATE_DTYPES[state_dtype]
    return (
        fake_tensor(BFloat16, (t_total, heads, D), 16),  # v
        fake_tensor(BFloat16, (t_total, heads), 2),  # beta
        fake_tensor(Uint8, (heads, slots, record_bytes), 16),  # workspace
        fake_tensor(Int32, (seqs_plus_1,), 4),  # cu_seqlens
        fake_tensor(Int32, (seqs,), 4),  # state_indices
        fake_tensor(Int32, (seqs_plus_1,), 4),  # checkpoint_offsets
        fake_tensor(sdt, (rows, heads, D, D), 16),  # pool (updated in place)
        fake_tensor(BFloat16, (t_total, heads, D), 16),  # out
        fake_tensor(sdt, (ckpts, heads, D, D), 16),  # checkpoints
        Int32(0),  # checkpoint_chunks
        fake_stream(),
    )


# ---- the fp32 numerics mode's record (docs/fp32_mode.md section 3, contract.FP32_RECORD) --------
# kd, qd, kr tiles swizzled like the bf16 record's (ldmatrix_a_offset / ldmatrix_krt_offset apply
# at these bases), INV and Mqk row-major 16x16 (ldmatrix_small_offset), gt f32 [128].
FP32_RECORD_BYTES = contract.FP32_RECORD_BYTES
OFF32_KD_HI = contract.FP32_RECORD["kd_hi"]
OFF32_QD_HI = contract.FP32_RECORD["qd_hi"]
OFF32_KR_HI = contract.FP32_RECORD["kr_hi"]
OFF32_QD_LO = contract.FP32_RECORD["qd_lo"]
OFF32_KR_LO = contract.FP32_RECORD["kr_lo"]
OFF32_GT = contract.FP32_RECORD["gt"]
OFF32_INV_HI = contract.FP32_RECORD["inv_hi"]
OFF32_INV_LO = contract.FP32_RECORD["inv_lo"]
OFF32_MQK_HI = contract.FP32_RECORD["mqk_hi"]
OFF32_MQK_LO = contract.FP32_RECORD["mqk_lo"]


def recurrence_fp32_args():
    """Fake arguments of the fp32-mode recurrence's host __call__: recurrence_args() with f32
    initial / final states and 23,040-byte records (the same dynamic dimensions, in the same
    order)."""
    return recurrence_args(Float32, FP32_RECORD_BYTES)
