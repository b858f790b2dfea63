"""KDA recurrence (SPEC.md "Kernel 2"), column split, state resident in registers.

Task = (value-column slice, head, sequence), grid (128 / block_v, H, N); no communication
between CTAs. Every warp owns CW = 8 * NT consecutive value columns and keeps its state slice
S^T[128 (k), CW (v)] in registers for the whole sequence, bf16, in the m16n8k16 accumulator layout
(mma_utils.py writes the fragment layouts out): for k-tile mt (16 k) and n-tile nt (8 columns),
register state[mt, nt, 0] holds S^T[16mt + g][8nt + 2t, 2t+1] and state[mt, nt, 1] holds
S^T[16mt + 8 + g][...]. movmatrix.trans of these two registers is exactly the B operand of k-block
mt of the next chunk's kd . S^T / qd . S^T, so the state never goes through shared memory.

Warps per CTA x columns per warp (warp_split): block_v 16 -> 2 x 8 (no idle half tiles);
32 -> 4 x 8; 64 -> 4 x 16; 128 -> 8 x 16 (4 x 32 would spill on sm_100a). Each column's
arithmetic (MMA k-block order, every rounding) is the same for every block_v, so out and the
final state are bitwise independent of block_v.

Software pipeline (iteration c of the chunk loop; P(c), Oq(c) were computed by iteration c - 1,
and so were chunk c's shared-memory operands v, beta, INV, Mqk, kr^T, gt, read into registers):
  u(c), U(c) -> W = kr^T . U(c) for all 8 k-tiles (independent MMAs) -> for k-tile mt = 0..7:
  state tile mt of chunk c, movmatrix, MMA k-block mt of P(c+1) and Oq(c+1); out(c), the stage
  refill and the reads of chunk c+1's operands go in the shadow of that chain.
The loop-carried serial chain is P(c) -> u -> INV.u -> U -> W tile 0 -> S tile 0 -> 8 dependent
P MMAs; nothing on it waits for shared memory, and the per-chunk barrier sits off it (warps reach
it while their MMAs are in flight). docs/perf_notes.md has the SASS analysis.

Shared memory: a ring of STAGES stages, each holding the chunk's 13,824-byte workspace record
(byte-exact copy, docs/kernel_abi.md), the chunk's v rows of this CTA's columns and its 16 beta
values. All threads fill it with cp.async, LOOKAHEAD chunks ahead; one CTA barrier per chunk makes
a stage visible and frees the stage being refilled. Outputs go from registers to global memory.
"""

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import Constexpr
from cutlass.memory import SmemAllocator

from .. import contract
from . import ptx
from .compile_utils import compile_for_arch
from .recurrence_common import (
    CHUNK,
    OFF_GT,
    OFF_INV,
    OFF_KD,
    OFF_KR,
    OFF_MQK,
    OFF_QD,
    RECORD_BYTES,
    D,
    acc_col,
    acc_row,
    ldmatrix_a_offset,
    ldmatrix_krt_offset,
    ldmatrix_small_offset,
    recurrence_args,
    sequence_bounds,
)

GRANULES = RECORD_BYTES // 16  # 16-byte cp.async copies per record
STAGES = 5  # smem ring depth
# Iteration c reads stage c+1 only (chunk c's operands were read in iteration c-1) and refills
# the stage of chunk c + LOOKAHEAD (= chunk c-1's, last read in iteration c-2).
LOOKAHEAD = STAGES - 1
# The next chunk's kd / qd A operands are loaded this many k-blocks ahead of their MMAs.
KD_AHEAD = 2


def stage_layout(block_v):
    """(v offset, beta offset, stage bytes) of one ring stage: record | v [16, block_v] bf16 |
    beta: 16 four-byte slots."""
    v_off = RECORD_BYTES
    beta_off = v_off + CHUNK * block_v * 2
    stage_bytes = (beta_off + CHUNK * 4 + 127) // 128 * 128
    return v_off, beta_off, stage_bytes


def v_smem_offset(row, col, block_v):
    """Byte offset of v[row, col] (col relative to the CTA's slice) in a stage's v tile."""
    return (row * block_v + col) * 2


def state_reg(mt, nt, half, n_tiles):
    """Index of the packed register holding S^T[16mt + acc_row(lane, half)][8nt + acc_col(lane)..+1]."""
    return (mt * n_tiles + nt) * 2 + half


def warp_split(block_v):
    """(warps per CTA, 8-column n-tiles per warp) for a slice width.

    16 -> 2 x 1 (no idle half tiles), 32 -> 4 x 1, 64 -> 4 x 2, 128 -> 8 x 2: four n-tiles per
    warp need more than 255 registers on sm_100a (the pipelined loop keeps two chunks' P/Oq
    accumulators next to the 64-register state), so 128 columns use eight warps.
    """
    if block_v not in contract.COLUMN_SPLITS:
        raise ValueError(f"block_v must be one of {contract.COLUMN_SPLITS}, got {block_v}")
    return {16: (2, 1), 32: (4, 1), 64: (4, 2), 128: (8, 2)}[block_v]


class KdaRecurrence:
    def __init__(self, block_v: int = 32):
        self.block_v = block_v
        self.num_warps, self.n_tiles = warp_split(block_v)
        self.num_threads = 32 * self.num_warps
        self.v_off, self.beta_off, self.stage_bytes = stage_layout(block_v)

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,  # bf16 [T_total, H, 128]
        mBeta: cute.Tensor,  # bf16 [T_total, H]
        mWorkspace: cute.Tensor,  # uint8 [H, S, 13824]
        mCuSeqlens: cute.Tensor,  # int32 [N + 1]
        mState0: cute.Tensor,  # bf16 [N, H, 128, 128] (n, h, v, k)
        mOut: cute.Tensor,  # bf16 [T_total, H, 128]
        mStateT: cute.Tensor,  # bf16 [N, H, 128, 128]
        stream: cuda.CUstream,
    ):
        num_heads = mV.shape[1]
        num_seqs = mCuSeqlens.shape[0] - 1
        self.kernel(mV, mBeta, mWorkspace, mCuSeqlens, mState0, mOut, mStateT).launch(
            grid=[D // self.block_v, num_heads, num_seqs],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mV: cute.Tensor,
        mBeta: cute.Tensor,
        mWorkspace: cute.Tensor,
        mCuSeqlens: cute.Tensor,
        mState0: cute.Tensor,
        mOut: cute.Tensor,
        mStateT: cute.Tensor,
    ):
        NT: Constexpr = self.n_tiles
        BV: Constexpr = self.block_v
        V_OFF: Constexpr = self.v_off
        BETA_OFF: Constexpr = self.beta_off
        STAGE_BYTES: Constexpr = self.stage_bytes
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
        src = _Sources(
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
            nthreads=self.num_threads,
            block_v=BV,
            v_off=V_OFF,
            beta_off=BETA_OFF,
        )
        # out[tok, head, col] lives at out_lane[nt] + tok * out_row_bytes (this lane's column
        # of n-tile nt)
        out_row_bytes = Int64(num_heads) * (D * 2)
        out_lane = [
            mOut.iterator.toint()
            + (Int64(head) * D + Int64(col_cta + col_w + nt * 8 + t2)) * 2
            for nt in range(NT)
        ]
        state_off = (Int64(seq) * Int64(num_heads) + Int64(head)) * (D * D)
        s0_base = mState0.iterator.toint() + state_off * 2
        sT_base = mStateT.iterator.toint() + state_off * 2

        ring = (
            SmemAllocator().allocate(STAGES * STAGE_BYTES, byte_alignment=128).toint()
        )

        # ---- initial state -> registers, accumulator layout (16-bit loads, once) ----
        state = cute.make_rmem_tensor(cute.make_layout(8 * NT * 2), Int32)
        for mt in cutlass.range_constexpr(8):
            for nt in cutlass.range_constexpr(NT):
                for half in cutlass.range_constexpr(2):
                    k = mt * 16 + acc_row(lane, half)
                    j = col_cta + col_w + nt * 8 + t2
                    addr = s0_base + (Int64(j) * D + Int64(k)) * 2  # state[n, h, j, k]
                    lo = ptx.ld_global_u16(addr)
                    hi = ptx.ld_global_u16(addr + D * 2)  # column j + 1
                    state[state_reg(mt, nt, half, NT)] = lo | (hi << 16)

        # P(c) and Oq(c) f32 accumulators, carried from iteration c - 1 (or the prologue). They
        # are rounded only where used, after the next barrier: packing them before the loop
        # back-edge would make every warp wait for its MMA chain before the barrier.
        p_acc = cute.make_rmem_tensor(cute.make_layout(4 * NT), Float32)
        o_acc = cute.make_rmem_tensor(cute.make_layout(4 * NT), Float32)
        zero_f = Float32(0.0)
        # Chunk c's shared-memory operands of the serial chain (v, bf16(beta), INV, Mqk, kr^T,
        # gt), read in iteration c - 1 (or the prologue), before the barrier that ptxas cannot
        # move loads across, so that none of them is waited for after P(c) is known.
        n_ops = _chunk_operand_count(NT)
        ops_in = cute.make_rmem_tensor(cute.make_layout(n_ops), Int32)
        gt_in = cute.make_rmem_tensor(cute.make_layout(16), Float32)

        if num_chunks > 0:
            for s in cutlass.range_constexpr(LOOKAHEAD):
                _load_stage(
                    src, cutlass.min(Int32(s), last_chunk), ring + s * STAGE_BYTES
                )
                ptx.cp_async_commit()
            ptx.cp_async_wait(LOOKAHEAD - 1)  # chunk 0 has landed (this thread's copies)
            ptx.cta_barrier()  # ... and everybody's
            p0 = [[zero_f] * 4 for _ in range(NT)]
            o0 = [[zero_f] * 4 for _ in range(NT)]
            for kb in cutlass.range_constexpr(8):
                a_off = ldmatrix_a_offset(lane, kb)
                a_kd = ptx.ldmatrix_x4(ring + OFF_KD + a_off)
                a_qd = ptx.ldmatrix_x4(ring + OFF_QD + a_off)
                for nt in cutlass.range_constexpr(NT):
                    b = (
                        ptx.movmatrix_trans(state[state_reg(kb, nt, 0, NT)]),
                        ptx.movmatrix_trans(state[state_reg(kb, nt, 1, NT)]),
                    )
                    p0[nt] = ptx.mma_bf16_16816(a_kd, b, p0[nt])
                    o0[nt] = ptx.mma_bf16_16816(a_qd, b, o0[nt])
            for nt in cutlass.range_constexpr(NT):
                for i in cutlass.range_constexpr(4):
                    p_acc[nt * 4 + i] = p0[nt][i]
                    o_acc[nt * 4 + i] = o0[nt][i]
            ops0, gt0 = _chunk_operands(src, ring, bos, lane, col_w, NT)
            for i in cutlass.range_constexpr(n_ops):
                ops_in[i] = ops0[i]
            for i in cutlass.range_constexpr(16):
                gt_in[i] = gt0[i]

        for c in range(num_chunks):
            # Chunk c+1 visible to all; the stage of chunk c-1 is free (refilled further down).
            ptx.cp_async_wait(LOOKAHEAD - 2)
            ptx.cta_barrier()
            nxt = ring + ((c + 1) % STAGES) * STAGE_BYTES
            row_tok0 = bos + c * CHUNK

            # A warp issues in order and is alone on its SM sub-partition, so whatever waits in
            # the instruction stream delays everything behind it. Chunk c's shared-memory
            # operands were read in iteration c - 1, before this barrier (ptxas moves no load
            # across it), so the serial chain
            #   P(c) -> u -> INV.u -> U -> kr^T.U -> S tile mt -> P(c+1) k-block mt (mt = 0..7)
            # never waits for shared memory. Only the order of independent instructions differs
            # from the plain version; each column's MMA k-block order and every rounding are the
            # same.
            v_in, b_in, a_inv, a_mqk, a_krt, row_mask = _split_operands(
                [ops_in[i] for i in range(n_ops)], NT
            )
            gt = [[gt_in[2 * mt + half] for half in range(2)] for mt in range(8)]
            # next chunk's kd / qd A operands, KD_AHEAD k-blocks ahead of their MMAs
            a_next = [None] * 8
            for kb in cutlass.range_constexpr(KD_AHEAD):
                a_next[kb] = _next_chunk_operands(nxt, lane, kb)

            # u = bf16(bf16(v - P) * bf16(b)) (rows past the end: exactly 0); U = bf16(INV . u).
            ub = []
            for nt in cutlass.range_constexpr(NT):
                u = []
                for half in cutlass.range_constexpr(2):
                    p = ptx.pack_bf16x2_i32(
                        p_acc[nt * 4 + 2 * half], p_acc[nt * 4 + 2 * half + 1]
                    )
                    uu = ptx.mul_bf16x2(ptx.sub_bf16x2(v_in[nt][half], p), b_in[half])
                    u.append(uu & row_mask[half])  # rows past the end: exactly 0
                u_acc = ptx.mma_bf16_16816(
                    a_inv,
                    (ptx.movmatrix_trans(u[0]), ptx.movmatrix_trans(u[1])),
                    [zero_f] * 4,
                )
                big_u0 = ptx.pack_bf16x2_i32(u_acc[0], u_acc[1])
                big_u1 = ptx.pack_bf16x2_i32(u_acc[2], u_acc[3])
                ub.append((ptx.movmatrix_trans(big_u0), ptx.movmatrix_trans(big_u1)))

            # W = kr^T . U for all eight k-tiles at once: independent MMAs, pipelined.
            w = [
                [ptx.mma_bf16_16816(a_krt[mt], ub[nt], [zero_f] * 4) for nt in range(NT)]
                for mt in range(8)
            ]
            m_acc = [ptx.mma_bf16_16816(a_mqk, ub[nt], [zero_f] * 4) for nt in range(NT)]

            # S[j, k] = bf16(fmaf(f32(S[j, k]), gt[k], W[k, j])), k-tile by k-tile, each tile
            # feeding k-block mt of the next chunk's P and Oq at once. On the last chunk the
            # next-chunk products read a duplicate of the last record and are discarded.
            p1 = [[zero_f] * 4 for _ in range(NT)]
            o1 = [[zero_f] * 4 for _ in range(NT)]
            for mt in cutlass.range_constexpr(8):
                if cutlass.const_expr(mt + KD_AHEAD < 8):
                    a_next[mt + KD_AHEAD] = _next_chunk_operands(
                        nxt, lane, mt + KD_AHEAD
                    )
                a_kd, a_qd = a_next[mt]
                gt_lo, gt_hi = gt[mt]
                for nt in cutlass.range_constexpr(NT):
                    i0 = state_reg(mt, nt, 0, NT)
                    i1 = state_reg(mt, nt, 1, NT)
                    s_lo = state[i0]
                    s_hi = state[i1]
                    wt = w[mt][nt]
                    n_lo = ptx.pack_bf16x2_i32(
                        ptx.ffma(ptx.bf16x2_lo_to_f32(s_lo), gt_lo, wt[0]),
                        ptx.ffma(ptx.bf16x2_hi_to_f32(s_lo), gt_lo, wt[1]),
                    )
                    n_hi = ptx.pack_bf16x2_i32(
                        ptx.ffma(ptx.bf16x2_lo_to_f32(s_hi), gt_hi, wt[2]),
                        ptx.ffma(ptx.bf16x2_hi_to_f32(s_hi), gt_hi, wt[3]),
                    )
                    state[i0] = n_lo
                    state[i1] = n_hi
                    b = (ptx.movmatrix_trans(n_lo), ptx.movmatrix_trans(n_hi))
                    p1[nt] = ptx.mma_bf16_16816(a_kd, b, p1[nt])
                    o1[nt] = ptx.mma_bf16_16816(a_qd, b, o1[nt])
                if cutlass.const_expr(mt == 0):
                    # out = bf16(Oq + bf16(Mqk . U)), valid rows only, registers -> global;
                    # issued in the shadow of the P(c+1) chain.
                    for nt in cutlass.range_constexpr(NT):
                        for half in cutlass.range_constexpr(2):
                            mq = ptx.pack_bf16x2_i32(
                                m_acc[nt][2 * half], m_acc[nt][2 * half + 1]
                            )
                            tok = row_tok0 + acc_row(lane, half)
                            addr = out_lane[nt] + Int64(tok) * out_row_bytes
                            oq = ptx.pack_bf16x2_i32(
                                o_acc[nt * 4 + 2 * half], o_acc[nt * 4 + 2 * half + 1]
                            )
                            ptx.st_global_b32_if(addr, ptx.add_bf16x2(oq, mq), tok, eos)
                if cutlass.const_expr(mt == 1):
                    # refill the stage freed by the barrier (chunk c - 1's) with chunk
                    # c + LOOKAHEAD, also in the shadow of the chain
                    _load_stage(
                        src,
                        cutlass.min(c + LOOKAHEAD, last_chunk),
                        ring + ((c + LOOKAHEAD) % STAGES) * STAGE_BYTES,
                    )
                    ptx.cp_async_commit()
                if cutlass.const_expr(mt == 2):
                    # chunk c+1's operands (on the last chunk: a duplicate, never used)
                    ops1, gt1 = _chunk_operands(
                        src, nxt, row_tok0 + CHUNK, lane, col_w, NT
                    )
                    for i in cutlass.range_constexpr(n_ops):
                        ops_in[i] = ops1[i]
                    for i in cutlass.range_constexpr(16):
                        gt_in[i] = gt1[i]
            for nt in cutlass.range_constexpr(NT):
                for i in cutlass.range_constexpr(4):
                    p_acc[nt * 4 + i] = p1[nt][i]
                    o_acc[nt * 4 + i] = o1[nt][i]

        ptx.cp_async_wait(0)  # no copy may still target this CTA's shared memory at exit

        # ---- final state (also for zero-length sequences: the initial state) ----
        for mt in cutlass.range_constexpr(8):
            for nt in cutlass.range_constexpr(NT):
                for half in cutlass.range_constexpr(2):
                    k = mt * 16 + acc_row(lane, half)
                    j = col_cta + col_w + nt * 8 + t2
                    addr = sT_base + (Int64(j) * D + Int64(k)) * 2
                    s = state[state_reg(mt, nt, half, NT)]
                    ptx.st_global_u16(addr, s)
                    ptx.st_global_u16(addr + D * 2, s >> 16)


class _Sources:
    """Per-CTA constants of the stage loader (a plain bag of trace-time values)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _load_stage(src, chunk, stage):
    """All threads: cp.async of one chunk's record, v rows (this CTA's columns) and beta values
    into the ring stage at shared address `stage`. Nothing past the sequence end is read."""
    rec = src.ws_head + Int64(src.slot0 + chunk) * RECORD_BYTES
    n = src.nthreads
    for i in range((GRANULES + n - 1) // n):
        gi = src.tid + i * n
        ptx.cp_async_16_if(stage + gi * 16, rec + Int64(gi) * 16, gi, Int32(GRANULES))
    row_tok0 = src.bos + chunk * CHUNK
    per_row = src.block_v // 8  # 16-byte granules per v row of the slice
    for i in range((CHUNK * per_row + n - 1) // n):
        gi = src.tid + i * n
        row = gi // per_row
        tok = row_tok0 + row
        gaddr = (
            src.v_col0
            + (
                (Int64(tok) * Int64(src.num_heads) + Int64(src.head)) * D
                + Int64(gi % per_row) * 8
            )
            * 2
        )
        # rows past the sequence end, and threads past the last granule (row >= 16), copy nothing
        limit = cutlass.min(src.eos, row_tok0 + CHUNK)
        ptx.cp_async_16_if(stage + src.v_off + gi * 16, gaddr, tok, limit)
    if n >= CHUNK:
        tok = row_tok0 + src.tid
        elem = tok * src.num_heads + src.head
        elem_addr = src.beta_base + Int64(elem) * 2
        # the aligned word holding the element stays inside the array unless the element is the
        # array's last one and starts a word
        async_ok = ptx.select_lt(
            elem + 1, src.beta_elems, Int32(1), Int32(elem_addr) & 2
        )
        limit = cutlass.min(src.eos, row_tok0 + CHUNK)
        # threads tid >= 16 have tok >= row_tok0 + 16 >= limit: no copy
        ptx.beta_to_shared_if(
            stage + src.beta_off + src.tid * 4, elem_addr, async_ok, tok, limit
        )


def _chunk_operand_count(n_tiles):
    """Int32 registers of _chunk_operands: v (2 per n-tile), b (2), INV (4), Mqk (4), kr^T (32),
    row masks (2)."""
    return 2 * n_tiles + 2 + 4 + 4 + 32 + 2


def _chunk_operands(src, stage, row_tok0, lane, col_w, n_tiles):
    """The chunk-c operands one lane needs from the stage of chunk c (first token row_tok0):
    a flat Int32 list (see _split_operands) and gt of the lane's two rows per k-tile
    ([2 * mt + half], Float32)."""
    ints = []
    for nt in range(n_tiles):
        for half in range(2):
            col = col_w + nt * 8 + acc_col(lane)
            ints.append(
                ptx.ld_shared_b32(
                    stage
                    + src.v_off
                    + v_smem_offset(acc_row(lane, half), col, src.block_v)
                )
            )
    for half in range(2):
        bits = _beta_bits(src, stage, row_tok0, acc_row(lane, half))
        ints.append(ptx.sigmoid_bf16x2_from_logit(bits))
    small_off = ldmatrix_small_offset(lane)
    ints += ptx.ldmatrix_x4(stage + OFF_INV + small_off)
    ints += ptx.ldmatrix_x4(stage + OFF_MQK + small_off)
    for mt in range(8):
        ints += ptx.ldmatrix_x4_trans(stage + OFF_KR + ldmatrix_krt_offset(lane, mt))
    for half in range(2):  # all ones for rows before the sequence end, else 0
        row = row_tok0 + acc_row(lane, half)
        ints.append(ptx.select_lt(row, src.eos, Int32(-1), Int32(0)))
    gt = [
        ptx.ld_shared_f32(stage + OFF_GT + (mt * 16 + acc_row(lane, half)) * 4)
        for mt in range(8)
        for half in range(2)
    ]
    return ints, gt


def _split_operands(ints, n_tiles):
    """(v[nt][half], b[half], INV A operand, Mqk A operand, kr^T A operands [mt],
    row masks [half])."""
    v = [ints[2 * nt : 2 * nt + 2] for nt in range(n_tiles)]
    at = 2 * n_tiles
    b = ints[at : at + 2]
    inv = ints[at + 2 : at + 6]
    mqk = ints[at + 6 : at + 10]
    krt = [ints[at + 10 + 4 * mt : at + 14 + 4 * mt] for mt in range(8)]
    row_mask = ints[at + 42 : at + 44]
    return v, b, inv, mqk, krt, row_mask


def _next_chunk_operands(nxt, lane, kb):
    """(kd, qd) A operands of k-block kb from the next chunk's stage."""
    a_off = ldmatrix_a_offset(lane, kb)
    return ptx.ldmatrix_x4(nxt + OFF_KD + a_off), ptx.ldmatrix_x4(nxt + OFF_QD + a_off)


def _beta_bits(src, stage, row_tok0, r):
    """The raw bf16 beta logit of chunk row r from the stage (low 16 bits of an Int32)."""
    elem = (row_tok0 + r) * src.num_heads + src.head
    byte = Int32(src.beta_base + Int64(elem) * 2) & 2
    return ptx.ld_shared_u16(stage + src.beta_off + r * 4 + byte)


def compile_kernel(block_v: int = 32, arch: str = "sm_90a", *, dump_dir: str | None = None):
    """The column-split recurrence with `block_v` value columns per CTA, compiled for `arch`
    (compile_utils.compile_for_arch)."""
    return compile_for_arch(KdaRecurrence(block_v), recurrence_args(), arch, dump_dir=dump_dir)
