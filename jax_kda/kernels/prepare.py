"""The prepare kernel (docs/numerics.md, section 3 "Prepare"), in CuTe DSL.

One CTA of 128 threads per (chunk slot, head). The CTA finds its sequence by a
binary search over cu_seqlens (docs/kernel_abi.md "Chunk slots"), exits when
the slot belongs to no chunk, and otherwise writes one 13,824-byte workspace
record (layout in jax_kda/kernels/workspace_layout.py).

Work split, chosen so that the thread structure is the contract's rounding order and every
shared access moves 128 bytes per wavefront (the kernel is bound by the L1 data pipe, then DRAM):
  A. All global loads are issued first, as cp.async copies into shared memory
     (q and k into the staging area, g into the shared record's kd bytes, free
     until phase B writes kd), so that one memory round trip serves the chunk:
     loads into registers would be scheduled by ptxas next to their first use,
     one round trip after another. Rows past the sequence end re-read the last
     valid row (in bounds) and are zeroed in registers (g's gates in phase B).
     L2 norm: thread t owns the 8-value
     group (t % 16) of rows t // 16 and t // 16 + 8; the 16 lanes of a row
     combine their partial sums with shfl.bfly 8, 4, 2, 1.
  B. Gate, cumsum and decays: thread t owns the column pair 2 (t % 64), +1 on
     rows 8 (t // 64) .. +7 (bf16x2 accesses); each column's running f32 sum
     still adds its 16 gates in row order (the first half hands its partial
     sum to the second through shared memory). kd, qd and kr go straight to
     the global record (qd, kd also to shared memory for phase C).
  C. Warp 0: L = kd.ki^T and the 16x16 inverse; warp 1: Mqk = qd.ki^T
     (mma.sync m16n8k16 through shared memory, k-blocks ascending).
  D. Threads 0-95 store gt, INV and Mqk from the shared record.
About 22 KB of shared memory per CTA (ki takes the shared record's unused kr
bytes, g the kd bytes until phase B, dt_bias and A_log the INV and Mqk bytes until
phase C), so up to 10 CTAs per SM.

Phases A0-A, B and C are the methods record_inputs, record_normalize,
record_decays and record_inverse_mqk (a ChunkRecord carries what one hands the
next); KdaPrepare.kernel calls them in that order around its stores, and the
fused decode kernel (decode.py) calls the same methods, so both build bitwise
the same record. Their options say who keeps what: the prepare kernel passes
record_inputs(kr_to_global=True) and record_decays(g_record=...) (kd, qd, kr
written out in phase B); the decode kernel keeps the whole record in shared
memory, at RECORD_SMEM offsets of its own region (record_inputs(smem_base=...)),
and asks record_decays(gt_rows=...) for ex2(G_r) of every row.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint8, Uint32, cute
from cutlass.cute.nvgpu import warp
from cutlass.memory import SmemAllocator

from .. import contract
from . import workspace_layout as wl
from .compile_utils import compile_for_arch
from .prepare_common import (
    PackedRows,
    WarpMma,
    carve,
    chunk_rows,
    copy_granules,
    locate_chunk,
    prepare_args,
    qk_head_of,
    row_major,
    running_sum_of_half,
    swizzled_byte_offset,
    swizzled_tile_layout,
    tiled_mma_bf16,
)
from .ptx import (
    LOG2E,
    beta_to_shared_if,
    bf16_to_f32,
    bf16x2_hi_to_f32,
    bf16x2_lo_to_f32,
    cp_async_4_if,
    cp_async_16_if,
    cp_async_commit,
    cp_async_wait,
    ex2_approx,
    f16_add,
    f16_mul,
    f16_neg,
    f16_to_f32,
    f32_to_bf16,
    f32_to_f16,
    fadd,
    ffma,
    fmul,
    fneg,
    gate_scale_from_lower_bound,
    ld_shared_b32,
    ld_shared_f32,
    ld_shared_u16,
    mul_bf16x2,
    pack_bf16x2,
    rsqrt_approx,
    select_lt,
    sigmoid,
    st_global_b32,
    st_shared_b32,
    u32_as_f32,
)

D = wl.D
CHUNK = wl.CHUNK
NUM_THREADS = 128
INVERSES = tuple(contract.INVERSE_IDS)
# Byte offsets of the record build's shared memory when the caller places it
# (record_inputs(smem_base=...)): the record, the ki tile, the 16 f32 b values and the staging
# area (normalised q and k until phase B; phase C's inverse scratch, at most
# INVERSE_SCRATCH_BYTES, after it), each 128-byte aligned.
RECORD_SMEM = {"record": 0, "ki": wl.RECORD_BYTES}
RECORD_SMEM["beta"] = RECORD_SMEM["ki"] + CHUNK * D * 2
RECORD_SMEM["stage"] = (RECORD_SMEM["beta"] + CHUNK * 4 + 127) // 128 * 128
RECORD_SMEM_BYTES = RECORD_SMEM["stage"] + 2 * CHUNK * D * 2
# phase C's scratch in the staging area: stable 7, neumann 9 tiles of 16 x 16 16-bit values
INVERSE_SCRATCH_BYTES = 9 * CHUNK * CHUNK * 2


class KdaPrepare:
    """Host entry + device kernel of docs/numerics.md, section 3 "Prepare"."""

    def __init__(self, inverse: str = "stable", grouped: bool = False):
        if inverse not in INVERSES:
            raise ValueError(f"inverse must be one of {INVERSES}, got {inverse!r}")
        self.inverse = inverse
        # grouped value heads: q and k [T_total, Hk, 128], value head h reads query/key head
        # h // (H // Hk) (a specialisation of its own: the plain kernel's code stays as it is)
        self.grouped = grouped

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        mCuSeqlens: cute.Tensor,
        mWorkspace: cute.Tensor,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        num_slots = mWorkspace.shape[1]
        num_heads = mWorkspace.shape[0]
        self.kernel(
            mQ,
            mK,
            mG,
            mBeta,
            mALog,
            mDtBias,
            mCuSeqlens,
            mWorkspace,
            scale,
            lower_bound,
        ).launch(
            grid=(num_slots, num_heads, 1),
            block=(NUM_THREADS, 1, 1),
            stream=stream,
        )

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        mCuSeqlens: cute.Tensor,
        mWorkspace: cute.Tensor,
        scale: Float32,
        lower_bound: Float32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, head, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tid % 32
        active, bos, eos, chunk = locate_chunk(mCuSeqlens, Int32(slot), mQ.shape[0])
        qk_head = None
        if cutlass.const_expr(self.grouped):
            qk_head = qk_head_of(head, mWorkspace.shape[0], mQ.shape[1])
        if active:
            row0, n_valid = chunk_rows(bos, eos, chunk)
            rec = self.record_inputs(
                PackedRows(row0, head, mBeta, qk_head), mQ, mK, mG, mALog, mDtBias, head, n_valid,
                tid,
                kr_to_global=True, async_copy=True,
            )
            self.record_normalize(rec)
            g_rec = mWorkspace[head, slot, None]
            self.record_decays(rec, scale, lower_bound, g_record=g_rec.iterator.toint())

            # ---- C. warp 0: inverse, warp 1: Mqk
            self.record_inverse_mqk(rec, warp_idx, lane)
            cute.arch.sync_threads()

            # ---- D. gt, INV and Mqk (96 granules) -> global; kd, qd, kr went out in phase B
            if tid < 96:
                s_rec_t = cute.make_tensor(rec.s_rec, cute.make_layout(wl.RECORD_BYTES))
                copy_granules(
                    s_rec_t, g_rec, tid, 96, wl.GT_OFFSET // 16, wl.RECORD_BYTES // 16
                )

    # ------------------------------------------------ the chunk record in shared memory
    # Phases A-C minus the global stores, one method per phase (ChunkRecord carries what one
    # phase hands the next). KdaPrepare.kernel and decode.KdaDecode call them in this order; all
    # 128 threads must call each one (they contain CTA barriers).
    @cute.jit
    def record_inputs(
        self,
        rows,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mG: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        head: Int32,
        n_valid: Int32,
        tid: Int32,
        smem_base=None,
        kr_to_global: bool = False,
        async_copy: bool = False,
    ):
        """A0: issue every global load of the chunk (rows past the end re-read the last valid
        row, in bounds, and are zeroed afterwards: no branches) and allocate the record's shared
        memory. `rows`: how a chunk row maps to tensor elements (token(r) for r in 0..15 clamped
        to n_valid - 1, qk_row(m, tok) the 128 values of q / k, row(m, tok) those of g,
        beta(tok) the logit; for
        async_copy also mBeta (compact), beta_index(tok) its element and beta_count()).
        smem_base (optional, a 128-byte aligned Uint8 shared pointer to RECORD_SMEM_BYTES): place
        the record, ki, beta and the staging area at the RECORD_SMEM offsets there instead of
        allocating them (the caller may then overlap the staging area's bytes past
        INVERSE_SCRATCH_BYTES once record_decays has returned).
        kr_to_global: the caller hands record_decays the record's global address (g_record),
        so the shared record's kr bytes hold the ki tile instead.
        async_copy: every input goes to shared memory by cp.async instead of into registers (one
        commit group, which record_normalize waits for; the caller must have no other group in
        flight): q and k into the staging area, g row-major into the shared record's kd bytes,
        beta's word into its s_beta slot, dt_bias's row into the INV bytes, A_log into the Mqk
        bytes."""
        group = tid % 16
        # (half, q/k, values), values contiguous so that each load is one 16-byte vector
        raw = cute.make_rmem_tensor(
            cute.make_layout((2, 2, 8), stride=(16, 8, 1)), BFloat16
        )
        c0 = 2 * (tid % 64)  # phase B's column pair, on rows 8 (tid // 64) .. + 7
        g_pairs = cute.make_rmem_tensor(cute.make_layout((8, 2), stride=(2, 1)), BFloat16)
        if cutlass.const_expr(not async_copy):
            for half in cutlass.range_constexpr(2):
                r = tid // 16 + 8 * half
                tok = rows.token(cutlass.min(r, n_valid - 1))
                for which, m_x in enumerate((mQ, mK)):
                    cute.autovec_copy(
                        cute.local_tile(rows.qk_row(m_x, tok), (8,), (group,)),
                        raw[half, which, None],
                    )
            # raw g straight in phase B's layout (no shared staging): row i of the thread's 8, one
            # 4-byte load of the pair each; rows past the end re-read the last valid row (their
            # gate is zeroed in phase B whatever g holds)
            for i in cutlass.range_constexpr(8):
                tok = rows.token(cutlass.min((tid // 64) * 8 + i, n_valid - 1))
                cute.autovec_copy(
                    cute.local_tile(rows.row(mG, tok), (2,), (tid % 64,)), g_pairs[i, None]
                )
        beta_tok = rows.token(cutlass.min(tid % CHUNK, n_valid - 1))
        beta_raw = beta_half = dt0 = dt1 = a_log = None
        if cutlass.const_expr(not async_copy):
            beta_raw = rows.beta(beta_tok)
            dt0 = mDtBias[head, c0]
            dt1 = mDtBias[head, c0 + 1]
            a_log = mALog[head]

        # ---- shared memory (~22 KB in the prepare kernel: up to 10 CTAs per SM)
        if cutlass.const_expr(smem_base is None):
            smem = SmemAllocator()
            s_rec = smem.allocate_array(Uint8, wl.RECORD_BYTES, byte_alignment=128)
        else:
            s_rec = smem_base
        s_kd = carve(s_rec, wl.KD_OFFSET, BFloat16, swizzled_tile_layout())
        s_qd = carve(s_rec, wl.QD_OFFSET, BFloat16, swizzled_tile_layout())
        s_gt = carve(s_rec, wl.GT_OFFSET, Float32, cute.make_layout(D))
        s_inv = carve(s_rec, wl.INV_OFFSET, BFloat16, row_major(CHUNK, CHUNK))
        s_mqk = carve(s_rec, wl.MQK_OFFSET, BFloat16, row_major(CHUNK, CHUNK))
        if cutlass.const_expr(kr_to_global):
            # kr never enters the shared record (record_decays stores it to global memory), so
            # ki takes its bytes: 4 KB less per CTA
            s_ki = carve(s_rec, wl.KR_OFFSET, BFloat16, swizzled_tile_layout())
        elif cutlass.const_expr(smem_base is None):
            s_ki = smem.allocate_tensor(
                BFloat16, swizzled_tile_layout(), byte_alignment=128
            )
        if cutlass.const_expr(smem_base is None):
            # normalised q and k live until phase B; phase C reuses the bytes
            s_stage = smem.allocate_array(Uint8, 2 * CHUNK * D * 2, byte_alignment=128)
        else:
            if cutlass.const_expr(not kr_to_global):
                s_ki = carve(smem_base, RECORD_SMEM["ki"], BFloat16, swizzled_tile_layout())
            s_stage = smem_base + RECORD_SMEM["stage"]
        s_qn = carve(s_stage, 0, BFloat16, row_major(CHUNK, D))
        s_kn = carve(s_stage, CHUNK * D * 2, BFloat16, row_major(CHUNK, D))
        if cutlass.const_expr(smem_base is None):
            s_beta = smem.allocate_tensor(
                Float32, cute.make_layout(CHUNK), byte_alignment=16
            )
        else:
            s_beta = carve(smem_base, RECORD_SMEM["beta"], Float32, cute.make_layout(CHUNK))
        if cutlass.const_expr(async_copy):
            # thread t: the granules of A's register layout (rows t // 16 and + 8, values
            # 8 (t % 16) ..) of q and k, into the staging tiles where A normalises them in place,
            # and g's granules t and t + 128 (row gi // 16) into the kd bytes
            stage_base = s_stage.toint()
            for half in cutlass.range_constexpr(2):
                r = tid // 16 + 8 * half
                tok = rows.token(cutlass.min(r, n_valid - 1))
                for which, m_x in enumerate((mQ, mK)):
                    src = cute.local_tile(rows.qk_row(m_x, tok), (8,), (group,))
                    cp_async_16_if(stage_base + which * CHUNK * D * 2 + (r * D + group * 8) * 2,
                                   src.iterator.toint(), Int32(0), Int32(1))
            g_tile = s_rec.toint() + wl.KD_OFFSET
            for it in cutlass.range_constexpr(2):
                gi = tid + NUM_THREADS * it
                tok = rows.token(cutlass.min(gi // 16, n_valid - 1))
                src = cute.local_tile(rows.row(mG, tok), (8,), (gi % 16,))
                cp_async_16_if(g_tile + gi * 16, src.iterator.toint(), Int32(0), Int32(1))
            # threads 0-15: the aligned word holding their row's beta into their s_beta slot
            # (synchronously where that word would end past the array: its last element)
            elem, elems = rows.beta_index(beta_tok), rows.beta_count()
            beta_addr = rows.mBeta.iterator.toint() + Int64(elem) * 2
            async_ok = select_lt(elem + 1, elems, Int32(1), Int32(beta_addr) & 2)
            beta_to_shared_if(s_beta.iterator.toint() + tid * 4, beta_addr, async_ok, tid,
                              Int32(CHUNK))
            beta_half = Int32(beta_addr) & 2  # the byte of the slot where it lands
            # dt_bias's row of this head (threads 0-31, 16 bytes each) into the INV bytes and
            # A_log (thread 0) into the Mqk bytes: both free until phase C
            dt_src = cute.local_tile(mDtBias[head, None], (4,), (tid % 32,))
            cp_async_16_if(s_rec.toint() + wl.INV_OFFSET + (tid % 32) * 16,
                           dt_src.iterator.toint(), tid, Int32(32))
            cp_async_4_if(s_rec.toint() + wl.MQK_OFFSET, mALog.iterator.toint() + Int64(head) * 4,
                          tid, Int32(1))
            cp_async_commit()
        return ChunkRecord(
            tid=tid,
            n_valid=n_valid,
            group=group,
            raw=raw,
            g_pairs=g_pairs,
            beta_raw=beta_raw,
            c0=c0,
            dt0=dt0,
            dt1=dt1,
            a_log=a_log,
            s_rec=s_rec,
            s_kd=s_kd,
            s_qd=s_qd,
            s_gt=s_gt,
            s_inv=s_inv,
            s_mqk=s_mqk,
            s_ki=s_ki,
            s_stage=s_stage,
            s_qn=s_qn,
            s_kn=s_kn,
            s_beta=s_beta,
            kr_to_global=kr_to_global,
            async_copy=async_copy,
            beta_half=beta_half,
        )

    @cute.jit
    def record_normalize(self, rec):
        """A: L2 norm of the q and k rows and b = sigmoid(beta), to shared memory."""
        tid = rec.tid
        n_valid = rec.n_valid
        raw = rec.raw
        group = rec.group
        s_qn, s_kn = rec.s_qn, rec.s_kn
        if cutlass.const_expr(rec.async_copy):
            cp_async_wait(0)  # this thread's copies; g (others' too) is read after the barrier
            for half in cutlass.range_constexpr(2):
                r = tid // 16 + 8 * half
                for which, s_x in enumerate((s_qn, s_kn)):
                    cute.autovec_copy(cute.local_tile(s_x[r, None], (8,), (group,)),
                                      raw[half, which, None])
        for half in cutlass.range_constexpr(2):
            r = tid // 16 + 8 * half
            valid = r < n_valid
            self._normalize(raw[half, 0, None], s_qn, r, group, valid)
            self._normalize(raw[half, 1, None], s_kn, r, group, valid)
        beta_raw = rec.beta_raw
        s_beta = rec.s_beta
        if tid < CHUNK:
            if cutlass.const_expr(rec.async_copy):
                bits = ld_shared_u16(s_beta.iterator.toint() + tid * 4 + rec.beta_half)
                b = sigmoid(u32_as_f32(Uint32(bits) << 16))
            else:
                b = sigmoid(bf16_to_f32(beta_raw))
            if tid >= n_valid:
                b = Float32(0.0)
            s_beta[tid] = b
        cute.arch.sync_threads()

    @cute.jit
    def record_decays(
        self, rec, scale: Float32, lower_bound: Float32, gt_rows=None, g_record=None
    ):
        """B: gate, cumsum, decays. Thread t owns the column pair (c, c + 1), c = 2 (t % 64), on
        rows 8h .. 8h + 7, h = t // 64, so that every shared access moves bf16x2 words (one
        wavefront per 128 bytes; one bf16 per thread would take two). Each column's running sum
        still adds its 16 gates in row order from 0: threads h = 0 hand their sum after row 7 to
        threads h = 1 through s_gt, which hand back gt = ex2(total) there (where the record keeps
        it). The bf16 products run as bf16x2 instructions, one rounding per half as mul.rn.bf16.
        gt_rows (optional, f32 [16, 128] in shared memory): also receives ex2(G_r) of every row r,
        i.e. the gt of a chunk that ended at row r (the fused decode kernel's per-token states).
        g_record (optional, Int64 global address of the record): qd, kd and kr are also stored
        there as they are made (qd, kd stay in shared memory for phase C, kr does not go there),
        instead of being staged in the shared record and copied out afterwards."""
        if cutlass.const_expr(rec.kr_to_global != (g_record is not None)):
            raise ValueError("record_decays needs g_record exactly when record_inputs was called "
                             "with kr_to_global=True (ki then occupies the shared kr bytes)")
        n_valid = rec.n_valid
        c0 = rec.c0
        half = rec.tid // 64
        rec_base = rec.s_rec.toint()
        a_log, dt = rec.a_log, (rec.dt0, rec.dt1)
        if cutlass.const_expr(rec.async_copy):  # record_inputs' copies of A_log and dt_bias
            a_log = ld_shared_f32(rec_base + wl.MQK_OFFSET)
            dt = tuple(ld_shared_f32(rec_base + wl.INV_OFFSET + (c0 + j) * 4) for j in range(2))
        a_exp = ex2_approx(fmul(a_log, Float32(LOG2E)))
        gate_scale = gate_scale_from_lower_bound(lower_bound)
        s_gt = rec.s_gt
        qn_base = rec.s_qn.iterator.toint()
        kn_base = rec.s_kn.iterator.toint()
        ki_base = rec.s_ki.iterator.toint()
        # cum[j, i]: column c0 + j, row 8 h + i: first the gate, then the running sum
        cum = cute.make_rmem_tensor(cute.make_layout((2, 8), stride=(8, 1)), Float32)
        g_pairs = rec.g_pairs
        if cutlass.const_expr(rec.async_copy):
            # g's row-major tile in the kd bytes, read here before the barrier that precedes
            # kd's stores
            g_words = cute.recast_tensor(g_pairs, Uint32)
            for i in cutlass.range_constexpr(8):
                g_words[i] = ld_shared_b32(rec_base + wl.KD_OFFSET + ((half * 8 + i) * D + c0) * 2)
        for i in cutlass.range_constexpr(8):
            r = half * 8 + i
            for j in cutlass.range_constexpr(2):
                g_in = bf16_to_f32(g_pairs[i, j])
                x = fmul(a_exp, fadd(g_in, dt[j]))
                gate = fmul(gate_scale, sigmoid(x))
                if r >= n_valid:
                    gate = Float32(0.0)
                cum[j, i] = gate
        if half == 0:
            for j in cutlass.range_constexpr(2):
                s_gt[c0 + j] = running_sum_of_half(cum, j, Float32(0.0))
        cute.arch.sync_threads()
        if half == 1:
            for j in cutlass.range_constexpr(2):
                s_gt[c0 + j] = ex2_approx(running_sum_of_half(cum, j, s_gt[c0 + j]))
        cute.arch.sync_threads()
        gt2 = pack_bf16x2(s_gt[c0], s_gt[c0 + 1])
        scale2 = pack_bf16x2(scale, scale)
        for i in cutlass.range_constexpr(8):
            r = half * 8 + i
            e = cute.make_rmem_tensor((2,), Float32)
            for j in cutlass.range_constexpr(2):
                e[j] = ex2_approx(cum[j, i])
                if cutlass.const_expr(gt_rows is not None):
                    gt_rows[r, c0 + j] = e[j]
            e2 = pack_bf16x2(e[0], e[1])
            ei2 = pack_bf16x2(ex2_approx(fneg(cum[0, i])), ex2_approx(fneg(cum[1, i])))
            qn2 = ld_shared_b32(qn_base + (r * D + c0) * 2)
            kn2 = ld_shared_b32(kn_base + (r * D + c0) * 2)
            qd2 = mul_bf16x2(mul_bf16x2(qn2, e2), scale2)
            kd2 = mul_bf16x2(kn2, e2)
            ki2 = mul_bf16x2(kn2, ei2)
            kr2 = mul_bf16x2(ki2, gt2)
            tile_off = swizzled_byte_offset(r, c0)
            st_shared_b32(rec_base + wl.QD_OFFSET + tile_off, qd2)
            st_shared_b32(rec_base + wl.KD_OFFSET + tile_off, kd2)
            st_shared_b32(ki_base + tile_off, ki2)
            if cutlass.const_expr(g_record is None):
                st_shared_b32(rec_base + wl.KR_OFFSET + tile_off, kr2)
            else:
                st_global_b32(g_record + (wl.QD_OFFSET + tile_off), qd2)
                st_global_b32(g_record + (wl.KD_OFFSET + tile_off), kd2)
                st_global_b32(g_record + (wl.KR_OFFSET + tile_off), kr2)
        cute.arch.sync_threads()

    @cute.jit
    def record_inverse_mqk(self, rec, warp_idx: Int32, lane: Int32):
        """C (without the barrier that ends it): warp 0 the inverse INV, warp 1 Mqk; warps 2 and
        3 are free (the prepare kernel's store the record meanwhile)."""
        s_stage, s_kd, s_ki, s_beta, s_inv = rec.s_stage, rec.s_kd, rec.s_ki, rec.s_beta, rec.s_inv
        s_qd, s_mqk = rec.s_qd, rec.s_mqk
        if warp_idx == 0:
            if cutlass.const_expr(self.inverse == "stable"):
                self._inverse_stable(s_stage, s_kd, s_ki, s_beta, s_inv, lane)
            else:
                self._inverse_neumann(s_stage, s_kd, s_ki, s_beta, s_inv, lane)
        if warp_idx == 1:
            self._mqk(s_qd, s_ki, s_mqk, lane)

    # ------------------------------------------------------------ helpers
    @cute.jit
    def _normalize(
        self,
        frag: cute.Tensor,
        s_out: cute.Tensor,
        r: Int32,
        group: Int32,
        valid: cutlass.Boolean,
    ):
        """Row r, values 8*group..8*group+7 (bf16 frag): bf16(x * rsqrt(sum x^2 + 1e-6)) into
        s_out; an invalid row is a zero row."""
        words = cute.recast_tensor(frag, Uint32)
        if not valid:
            words.fill(0)
        vals = cute.make_rmem_tensor((8,), Float32)
        for i in cutlass.range_constexpr(4):
            vals[2 * i] = bf16x2_lo_to_f32(words[i])
            vals[2 * i + 1] = bf16x2_hi_to_f32(words[i])
        # 16 groups of 8: sequential FMA from 0, then the xor butterfly 8, 4, 2, 1
        sq = Float32(0.0)
        for i in cutlass.range_constexpr(8):
            sq = ffma(vals[i], vals[i], sq)
        for off in cutlass.range_constexpr(4):
            sq = fadd(sq, cute.arch.shuffle_sync_bfly(sq, offset=8 >> off))
        inv = rsqrt_approx(fadd(sq, Float32(1e-6)))
        out = cute.make_rmem_tensor((4,), Uint32)
        for i in cutlass.range_constexpr(4):
            out[i] = pack_bf16x2(fmul(vals[2 * i], inv), fmul(vals[2 * i + 1], inv))
        dst = cute.local_tile(s_out[r, None], (8,), (group,))
        cute.autovec_copy(cute.recast_tensor(out, BFloat16), dst)

    @cute.jit
    def _mqk(
        self, s_qd: cute.Tensor, s_ki: cute.Tensor, s_mqk: cute.Tensor, lane: Int32
    ):
        """Mqk = bf16(qd . ki^T), lower triangle with diagonal."""
        mma = WarpMma(tiled_mma_bf16(), lane)
        coords = mma.coords
        acc = mma.product(s_qd, s_ki)
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = coords[i]
            v = f32_to_bf16(acc[i])
            if r < c:
                v = BFloat16(0.0)
            s_mqk[r, c] = v

    @cute.jit
    def _inverse_stable(self, scratch, s_kd, s_ki, s_beta, s_inv, lane: Int32):
        """INV by two f32 8x8 forward substitutions and one bf16 block step (docs/numerics.md
        section 3, step 6, "stable").

        scratch: >= 3.5 KB of dead shared memory (bytes)."""
        tile = CHUNK * CHUNK * 2
        # L's rows padded to 17 words: the 16 lanes of a row-per-lane access (the substitution's
        # loads and stores, M's build) then hit 16 different banks (unpadded: 4-way conflicts)
        s_l = carve(scratch, 0, Float32, cute.make_layout((CHUNK, CHUNK), stride=(CHUNK + 1, 1)))
        s_p = carve(scratch, 3 * tile, BFloat16, row_major(CHUNK, CHUNK))
        # B operands are stored transposed (B(n, k) = X[k][n] row-major) so that
        # fragment loads stay plain 32-bit smem loads
        s_p_t = carve(scratch, 4 * tile, BFloat16, row_major(CHUNK, CHUNK))
        s_m_t = carve(scratch, 5 * tile, BFloat16, row_major(CHUNK, CHUNK))
        s_n = carve(scratch, 6 * tile, BFloat16, row_major(CHUNK, CHUNK))
        mma = WarpMma(tiled_mma_bf16(), lane)
        coords = mma.coords

        # L = (kd . ki^T) strictly lower, rows scaled by b in f32
        acc = mma.product(s_kd, s_ki)
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = coords[i]
            v = fmul(acc[i], s_beta[r])
            if r <= c:
                v = Float32(0.0)
            s_l[r, c] = v
        cute.arch.sync_warp()

        # forward substitution: lane i < 16 owns row i of its 8x8 diagonal block
        row = lane % CHUNK
        blk = row // 8
        il = row % 8
        inv = cute.make_rmem_tensor((8,), Float32)
        for p in cutlass.range_constexpr(8):
            v = s_l[row, blk * 8 + p]
            if p == il:
                v = Float32(1.0)
            if p > il:
                v = Float32(0.0)
            inv[p] = v
        cute.arch.sync_warp()
        for s in cutlass.range_constexpr(7):
            if (lane < CHUNK) & (il > s):
                rr = fneg(inv[s])
                for p in cutlass.range_constexpr(s):
                    inv[p] = ffma(rr, s_l[blk * 8 + s, blk * 8 + p], inv[p])
                inv[s] = rr
            cute.arch.sync_warp()
            if lane < CHUNK:
                # publish this row (s_l's block entries now hold the inverse so far)
                for p in cutlass.range_constexpr(8):
                    if p < il:
                        s_l[row, blk * 8 + p] = inv[p]
            cute.arch.sync_warp()

        # P = blockdiag(bf16(A^-1), bf16(B^-1)); M = [[0,0],[bf16(L[8:,:8]),0]]
        if lane < CHUNK:
            for c in cutlass.range_constexpr(CHUNK):
                pv = BFloat16(0.0)
                if (c // 8 == blk) & (c % 8 <= il):
                    pv = f32_to_bf16(inv[c % 8])
                s_p[row, c] = pv
                s_p_t[c, row] = pv
        cute.arch.sync_warp()
        # M needs the original L[8:16, 0:8] (not overwritten: only diagonal blocks were)
        if lane < CHUNK:
            for c in cutlass.range_constexpr(CHUNK):
                mv = BFloat16(0.0)
                if cutlass.const_expr(c < 8):
                    mv = f32_to_bf16(s_l[row, c])
                    if row < 8:
                        mv = BFloat16(0.0)
                s_m_t[c, row] = mv
        cute.arch.sync_warp()

        # dc = P.M ; n = bf16(-dc)
        acc2 = mma.product(s_p, s_m_t)
        for i in cutlass.range_constexpr(cute.size(acc2)):
            r, c = coords[i]
            s_n[r, c] = f32_to_bf16(fneg(acc2[i]))
        cute.arch.sync_warp()

        # o = n.P ; INV = P + bf16(o)
        acc3 = mma.product(s_n, s_p_t)
        for i in cutlass.range_constexpr(cute.size(acc3)):
            r, c = coords[i]
            o = bf16_to_f32(f32_to_bf16(acc3[i]))
            s_inv[r, c] = f32_to_bf16(fadd(bf16_to_f32(s_p[r, c]), o))

    @cute.jit
    def _inverse_neumann(self, scratch, s_kd, s_ki, s_beta, s_inv, lane: Int32):
        """INV by FlashKDA v1's f16 Neumann series (docs/numerics.md section 3, step 6,
        "neumann").

        scratch: >= 4.5 KB of dead shared memory (bytes)."""
        tiles = [
            carve(scratch, i * CHUNK * CHUNK * 2, Float16, row_major(CHUNK, CHUNK))
            for i in range(9)
        ]
        # each power of L is kept twice: row-major (A operand) and transposed (B operand)
        s_l1, s_l1_t, s_l2, s_l2_t, s_l4, s_l4_t, s_l8_t, s_i0, s_i1 = tiles
        mma = WarpMma(tiled_mma_bf16(), lane)
        coords = mma.coords

        # L = f16(kd . ki^T) strictly lower, rows times f16(b) in f16; INV = I - L
        acc = mma.product(s_kd, s_ki)
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = coords[i]
            lv = f16_mul(f32_to_f16(acc[i]), f32_to_f16(s_beta[r]))
            if r <= c:
                lv = Float16(0.0)
            s_l1[r, c] = lv
            s_l1_t[c, r] = lv
            iv = f16_neg(lv)
            if r == c:
                iv = Float16(1.0)
            s_i0[r, c] = iv
        cute.arch.sync_warp()

        # f16 MMA with f16 accumulation from zero: h_mma.product(s_a, s_b_t) = s_a . s_b
        h_mma = WarpMma(_tiled_mma_f16(), lane)
        h_coords = h_mma.coords

        def square(s_src, s_src_t, s_dst, s_dst_t):
            a = h_mma.product(s_src, s_src_t)
            for i in cutlass.range_constexpr(cute.size(a)):
                r, c = h_coords[i]
                if cutlass.const_expr(s_dst is not None):
                    s_dst[r, c] = a[i]
                s_dst_t[c, r] = a[i]

        def accumulate(s_inv_in, s_pow_t, s_inv_out):
            # INV + INV.L^k: separate f16 MMA from zero, then an f16 add (FlashKDA's order)
            a = h_mma.product(s_inv_in, s_pow_t)
            for i in cutlass.range_constexpr(cute.size(a)):
                r, c = h_coords[i]
                s_inv_out[r, c] = f16_add(s_inv_in[r, c], a[i])

        square(s_l1, s_l1_t, s_l2, s_l2_t)
        cute.arch.sync_warp()
        accumulate(s_i0, s_l2_t, s_i1)
        square(s_l2, s_l2_t, s_l4, s_l4_t)
        cute.arch.sync_warp()
        accumulate(s_i1, s_l4_t, s_i0)
        square(s_l4, s_l4_t, None, s_l8_t)
        cute.arch.sync_warp()
        a = h_mma.product(s_i0, s_l8_t)
        for i in cutlass.range_constexpr(cute.size(a)):
            r, c = h_coords[i]
            s_inv[r, c] = f32_to_bf16(f16_to_f32(f16_add(s_i0[r, c], a[i])))


class ChunkRecord:
    """What one phase of the record build hands the next (a trace-time bag: rmem tensors,
    shared-memory tensors, scalars)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _tiled_mma_f16():
    """One warp, 16x16 output from two m16n8k16 f16 atoms, f16 accumulate."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(Float16, Float16, (16, 8, 16)),
        (1, 1, 1),
        permutation_mnk=(16, 16, 16),
    )


# ------------------------------------------------------------------ build side
def compile_kernel(inverse: str = "stable", arch: str = "sm_90a", *, grouped: bool = False,
                   dump_dir: str | None = None):
    """The prepare kernel with the given inverse (grouped: for q, k on fewer heads than g),
    compiled for `arch` (compile_utils.compile_for_arch)."""
    return compile_for_arch(KdaPrepare(inverse, grouped), prepare_args(grouped=grouped), arch,
                            dump_dir=dump_dir)
