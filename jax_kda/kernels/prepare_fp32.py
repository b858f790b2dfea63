"""The prepare kernel of the "fp32" numerics mode (docs/fp32_mode.md, section 1 "Prepare"), in CuTe
DSL.

Same grid, operands and chunk bookkeeping as the bf16 mode's prepare (prepare.py): one CTA of 128
threads per (chunk slot, head); the CTA finds its sequence by a binary search over cu_seqlens,
exits when the slot belongs to no chunk, treats rows past the sequence end as zero tokens, and
writes one 23,040-byte record (contract.FP32_RECORD; docs/fp32_mode.md section 3). The record
is not staged as a whole: each field goes to global memory as soon as it is final (below), byte for
byte what the record layout asks (swizzled rows included).
Nothing between the bf16 inputs and the record's hi/lo pairs is rounded to bf16.

Work split (step numbers are those of docs/fp32_mode.md, section 1):
  A. Every global load is issued first: 16-byte vectors, rows past the sequence end re-read the
     last valid row (in bounds) and are zeroed in registers. Thread t owns the 8-value group
     t % 16 of rows t // 16 and t // 16 + 8. Step 1's sum of squares: 8 sequential FMAs from 0,
     then shfl.bfly 8, 4, 2, 1 among the 16 lanes of a row; rsqrt(sum + 1e-6) of every q and k row
     goes to shared memory next to the raw bf16 q, k, g rows. Threads 0-15: step 4,
     b = sigmoid(beta) (0 on rows past the end, whose L row is zero anyway).
     Both sigmoids (gate and beta) are ptx.sigmoid_exp2 = rcp(1 + ex2(-x log2 e)).
  B. Thread t owns the column pair (c0, c0 + 1), c0 = 2 (t % 64), on rows 8h .. 8h + 7,
     h = t // 64 (prepare.py's phase B split): step 2 (gate and its sequential f32 running sum
     G_r; threads h = 0 hand G_7 to h = 1 through shared memory, which hand back gt); the raw q, k
     pairs go to registers (one bf16x2 word a row), then a barrier, then per row step 1's
     products q * inv, k * inv (f32), step 3's decays and decayed operands, each with the
     reference's association, split two values at a time (one cvt.rn.bf16x2 per hi and lo
     word). The record's fields kd_hi, qd hi/lo, kr hi/lo and gt are stored straight to global
     memory as they are formed (a warp's 64 columns of a row are 128 contiguous bytes of the
     swizzled row: one line), so these 20,992 bytes stream out while phase B computes and phase
     C runs; the six operand tiles (kL, qL, kiL hi/lo) go to shared memory over the raw rows.
  C. Step 5: warp 0 forms L = strict(kL . kiL^T) * b_r, warp 1 Mqk = causal(qL . kiL^T); each
     product is three chains of mma.sync m16n8k16 (hh = a_hi.b_hi, hl = a_hi.b_lo,
     lh = a_lo.b_hi; each from zero, k-blocks ascending) summed hh + (hl + lh) in f32. Warp 0
     stages L on its dead kl_hi tile, runs step 6, the forward substitution over the whole 16x16
     (lane i holds row i of `inv` in registers, the pivot row s arrives by shuffles from lane s),
     adds the unit diagonal (adding 0.0 elsewhere turns the -0 entries of the substitution into
     +0, as the reference's `inv + I` does), splits INV and stores it from registers (lanes 0-15
     the hi rows, lanes 16-31 the lo rows, 16-byte stores); warp 1 splits Mqk onto its dead ql_hi
     tile and copies it out in 16-byte granules. Warps 2-3 are done after phase B; there is no
     barrier after phase C.

Splits (docs/fp32_mode.md, `reference_fp32.split_hi_lo`): hi = cvt.rn.bf16(x); lo =
cvt.rn.bf16(x - f32(hi)) with sub.rn.ftz (bit for bit x + (-f32(hi)) with add.rn.ftz, one
instruction fewer): the difference is exact, a subnormal one becomes a zero of its sign (the
reference's `_ftz`). All f32 arithmetic is the pinned .ftz form of ptx.py.
(INV's pairs are rounded by cvt.rn.bf16x2.f32, the same rounding two at a time.)

Fused use (fused=True, decode_fp32.py): build_record runs the same phases as warps 0-3 of a
larger CTA, the record's stores aimed at shared memory and the CTA barriers replaced by the
named barrier PREPARE_BARRIER of those 128 threads; the shared memory is the caller's.

Shared memory (SMEM_PLAN): the six operand tiles (24,576 bytes; the raw q, k, g rows of phases
A-B on the first three, L and the Mqk staging on kl_hi and ql_hi in phase C), the row norms, b
and phase B's G_7 / gt hand-over: 25,280 bytes per CTA; the launch asks for 7 CTAs per SM, i.e.
72 registers or fewer per thread (phase B's column pairs keep 16 running sums, 16 raw q / k words
and three constants per column of the pair, which spill at 64), 28 warps per SM.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32, cute
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
    bf16_to_f32,
    bf16x2_hi_to_f32,
    bf16x2_lo_to_f32,
    ex2_approx,
    f32_to_bf16,
    fadd,
    ffma,
    fmul,
    fneg,
    fsub,
    gate_scale_from_lower_bound,
    ld_shared_b32,
    named_barrier_sync,
    pack_bf16x2,
    pack_bf16x2_i32,
    rsqrt_approx,
    sigmoid_exp2,
    split_hi_lo_bf16x2,
    st_global_b32,
    st_global_v4,
    st_shared_b32,
    st_shared_v4,
)

D = wl.D
CHUNK = wl.CHUNK
NUM_THREADS = 128
RECORD = contract.FP32_RECORD
RECORD_BYTES = contract.FP32_RECORD_BYTES
REF_ROW = 7  # L and Mqk's operands are decayed relative to this row's cumulative gate
# phase B's first row half ends at REF_ROW, so the sum it hands on is the G_7 those decays need
assert REF_ROW == CHUNK // 2 - 1
TILE_BYTES = CHUNK * D * 2
L_ROW_STRIDE = CHUNK + 1  # floats per row of L in shared memory
# The operand tiles of step 5, in shared memory after the record. The raw q, k, g rows of phases
# A-B occupy the bytes of the first three (RAW_ROWS) until phase B has read them.
OPERANDS = ("kl_hi", "kl_lo", "ql_hi", "ql_lo", "kil_hi", "kil_lo")
RAW_ROWS = ("q", "k", "g")
MQK_TILE_BYTES = CHUNK * CHUNK * 2
INV_TILE_BYTES = CHUNK * CHUNK * 2
MQK_GRANULES = 2 * MQK_TILE_BYTES // 16  # mqk_hi and mqk_lo: 64 granules, 2 per lane of warp 1
# Phases of the kernel, in order; a CTA barrier ends A and B_WRITE, two end B_READ (the raw rows
# read and G_7 handed on, then gt handed back: g_half lives across both). C runs on warps 0
# (L, INV) and 1 (Mqk) independently: C_PRODUCT is a warp's MMA chains, C_AFTER what the same warp
# does after a __syncwarp that follows its product.
PHASES = ("A", "B_READ", "B_WRITE", "C_PRODUCT", "C_AFTER")
# The shared-memory plan: name -> (byte offset, bytes, first phase, last phase, warps or None for
# all). Two entries may share bytes only if their phases are disjoint and, where the later one
# starts inside C, both belong to that one warp (tests/test_kernel_compile_prepare_fp32.py).
SMEM_PLAN = {
    **{
        f"raw_{name}": (i * TILE_BYTES, TILE_BYTES, "A", "B_READ", None)
        for i, name in enumerate(RAW_ROWS)
    },
    "kl_hi": (0 * TILE_BYTES, TILE_BYTES, "B_WRITE", "C_PRODUCT", (0,)),
    "kl_lo": (1 * TILE_BYTES, TILE_BYTES, "B_WRITE", "C_PRODUCT", (0,)),
    "ql_hi": (2 * TILE_BYTES, TILE_BYTES, "B_WRITE", "C_PRODUCT", (1,)),
    "ql_lo": (3 * TILE_BYTES, TILE_BYTES, "B_WRITE", "C_PRODUCT", (1,)),
    "kil_hi": (4 * TILE_BYTES, TILE_BYTES, "B_WRITE", "C_PRODUCT", (0, 1)),
    "kil_lo": (5 * TILE_BYTES, TILE_BYTES, "B_WRITE", "C_PRODUCT", (0, 1)),
    "l": (0 * TILE_BYTES, CHUNK * L_ROW_STRIDE * 4, "C_AFTER", "C_AFTER", (0,)),
    "mqk_stage": (2 * TILE_BYTES, 2 * MQK_TILE_BYTES, "C_AFTER", "C_AFTER", (1,)),
    "rnorm": (len(OPERANDS) * TILE_BYTES, 2 * CHUNK * 4, "A", "B_WRITE", None),
    "b": (len(OPERANDS) * TILE_BYTES + 2 * CHUNK * 4, CHUNK * 4, "A", "C_AFTER", None),
    # phase B's hand-over per column: G_7 from the row-half-0 threads, then gt back from half 1
    "g_half": (len(OPERANDS) * TILE_BYTES + 3 * CHUNK * 4, D * 4, "B_READ", "B_WRITE", None),
}
# Dynamic shared memory per CTA: the allocations of KdaPrepareFp32._shared_memory (operand tiles,
# row norms, b; each 16-byte aligned, so they end where SMEM_PLAN's last entry ends).
SMEM_BYTES = max(off + size for off, size, *_ in SMEM_PLAN.values())
PREPARE_BARRIER = 1  # fused: the named barrier id of the phases' 128 threads
CTAS_PER_SM = 7  # 7 x (25,280 + 1 KB reserved) <= 228 KB, 7 x 128 x 72 registers


class KdaPrepareFp32:
    """Host entry + device kernel of docs/fp32_mode.md, section 1 "Prepare". grouped: q and k
    [T_total, Hk, 128] for grouped value heads (value head h reads query/key head
    h // (H // Hk)), a specialisation of its own."""

    def __init__(self, grouped: bool = False, fused: bool = False):
        self.grouped = grouped
        # fused: the phases run as warps 0-3 of a larger CTA (decode_fp32.py), which gives the
        # shared memory, and the record goes to shared memory; their CTA barriers become the
        # named barrier PREPARE_BARRIER of those 128 threads
        self.fused = fused

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
            # registers for CTAS_PER_SM CTAs (<= 64 a thread); the carveout hint asks for the
            # largest shared-memory configuration (given here, the DSL would otherwise ask a GPU)
            min_blocks_per_mp=CTAS_PER_SM,
            preferred_smem_carveout=100,
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
        row0, n_valid = chunk_rows(bos, eos, chunk)
        qk_head = None
        if cutlass.const_expr(self.grouped):
            qk_head = qk_head_of(head, mWorkspace.shape[0], mQ.shape[1])
        if active:
            self.build_record(PackedRows(row0, head, mBeta, qk_head), mQ, mK, mG, mALog,
                              mDtBias, head, n_valid, lambda: mWorkspace[head, slot, None], None,
                              scale, lower_bound, tid, warp_idx, lane)

    @cute.jit
    def build_record(
        self, rows, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mALog: cute.Tensor,
        mDtBias: cute.Tensor, head: Int32, n_valid: Int32, record, smem_base,
        scale: Float32, lower_bound: Float32, tid: Int32, warp_idx: Int32, lane: Int32,
    ):
        """Phases A-C for the chunk rows `rows` (n_valid of them valid) of value head `head`,
        run by threads 0-127: the record to record() (a byte tensor of 23,040 bytes, made after
        the loads are issued; global memory, or shared with fused=True), the operand tiles at
        smem_base (fused; else allocated here). On return only warps 0 and 1 may still be
        storing their phase C fields (no barrier after phase C)."""
        # ---- A0. every global load first
        raw = self._load_rows(rows, mQ, mK, mG, n_valid, tid)
        beta_raw = rows.beta(rows.token(cutlass.min(tid % CHUNK, n_valid - 1)))
        pair = 2 * (tid % 64)  # phase B's column pair
        dt = (mDtBias[head, pair], mDtBias[head, pair + 1])
        a_log = mALog[head]
        sm = self._shared_memory(smem_base)
        g_rec = record()
        gm = record_views(g_rec)

        # ---- A. row norms, raw rows and b to shared memory
        self._stage_rows(raw, sm, n_valid, tid)
        s_b = sm.b
        if tid < CHUNK:
            b = sigmoid_exp2(bf16_to_f32(beta_raw))
            if tid >= n_valid:
                b = Float32(0.0)
            s_b[tid] = b
        self._barrier()

        # ---- B. thread = column pair on half the rows: gates, decays, splits; the record's
        # kd_hi .. gt straight to the record, the operand tiles to shared memory
        self._column_pairs(sm, g_rec, gm, tid // 64, pair, a_log, dt[0], dt[1], n_valid,
                           scale, lower_bound)
        self._barrier()

        # ---- C. warp 0: L and INV, warp 1: Mqk (each stores its own fields); warps 2-3 done
        if warp_idx == 0:
            self._inverse(sm, g_rec, lane)
        if warp_idx == 1:
            self._mqk(sm, gm, lane)

    def _barrier(self):
        """The CTA barrier of the phases (fused: the named barrier of threads 0-127)."""
        if self.fused:
            named_barrier_sync(Int32(PREPARE_BARRIER), NUM_THREADS)
        else:
            cute.arch.sync_threads()

    def _record_store(self, addr, words):
        """1 or 4 words to the record at byte address `addr` (global, or shared if fused)."""
        if self.fused:
            if len(words) == 1:
                st_shared_b32(addr, words[0])
            else:
                st_shared_v4(addr, words)
        elif len(words) == 1:
            st_global_b32(addr, words[0])
        else:
            st_global_v4(addr, words)

    # ------------------------------------------------------------ phases
    @cute.jit
    def _load_rows(self, rows, mQ, mK, mG, n_valid: Int32, tid: Int32):
        """bf16 registers (half, q/k/g, 8 values) of rows tid // 16 + 8 * half, values
        8 * (tid % 16)..+7: one 16-byte load each. Rows past the end re-read the last valid row
        (no branch around the loads); _stage_rows zeroes them."""
        group = tid % 16
        raw = cute.make_rmem_tensor(
            cute.make_layout((2, 3, 8), stride=(24, 8, 1)), BFloat16
        )
        for half in cutlass.range_constexpr(2):
            r = tid // 16 + 8 * half
            tok = rows.token(cutlass.min(r, n_valid - 1))
            for which, m_x in enumerate((mQ, mK, mG)):
                row = rows.qk_row(m_x, tok) if which < 2 else rows.row(m_x, tok)
                cute.autovec_copy(
                    cute.local_tile(row, (8,), (group,)),
                    raw[half, which, None],
                )
        return raw

    def _shared_memory(self, base=None):
        """The CTA's shared memory (trace time, SMEM_PLAN): the operand tiles (raw rows aliased on
        the first three during phases A-B; L on kl_hi and the Mqk staging on ql_hi in phase C),
        the row norms and b; allocated here, or carved from `base` (a 128-byte aligned pointer
        to SMEM_BYTES bytes)."""
        smem = SmemAllocator()
        if base is None:
            s_ops = smem.allocate_array(Uint8, len(OPERANDS) * TILE_BYTES, byte_alignment=128)
        else:
            s_ops = base
        sm = _Smem(ops=s_ops)
        for i, name in enumerate(OPERANDS):
            setattr(sm, name, carve(s_ops, i * TILE_BYTES, BFloat16, swizzled_tile_layout()))
        sm.raw = [
            carve(s_ops, i * TILE_BYTES, BFloat16, row_major(CHUNK, D))
            for i in range(len(RAW_ROWS))
        ]
        # rows padded to 17 floats: lane i reading row i hits bank (17 i + p) % 32, no conflict
        sm.l = cute.make_tensor(
            cute.recast_ptr(s_ops + SMEM_PLAN["l"][0], dtype=Float32),
            cute.make_layout((CHUNK, CHUNK), stride=(L_ROW_STRIDE, 1)),
        )
        # Mqk hi/lo staged row-major, laid out as in the record (mqk_lo right after mqk_hi)
        sm.mqk_stage = s_ops + SMEM_PLAN["mqk_stage"][0]
        sm.mqk_stage_bytes = cute.make_tensor(sm.mqk_stage, cute.make_layout(2 * MQK_TILE_BYTES))
        sm.mqk_hi = carve(sm.mqk_stage, 0, BFloat16, row_major(CHUNK, CHUNK))
        sm.mqk_lo = carve(sm.mqk_stage, MQK_TILE_BYTES, BFloat16, row_major(CHUNK, CHUNK))
        # 1 / |x| of each row: [0, r] for q, [1, r] for k
        rnorm_layout = cute.make_layout((2, CHUNK), stride=(CHUNK, 1))
        if base is None:
            sm.rnorm = smem.allocate_tensor(Float32, rnorm_layout, byte_alignment=16)
            sm.b = smem.allocate_tensor(Float32, cute.make_layout(CHUNK), byte_alignment=16)
            sm.g_half = smem.allocate_tensor(Float32, cute.make_layout(D), byte_alignment=16)
        else:
            sm.rnorm = carve(base, SMEM_PLAN["rnorm"][0], Float32, rnorm_layout)
            sm.b = carve(base, SMEM_PLAN["b"][0], Float32, cute.make_layout(CHUNK))
            sm.g_half = carve(base, SMEM_PLAN["g_half"][0], Float32, cute.make_layout(D))
        return sm

    @cute.jit
    def _stage_rows(self, raw: cute.Tensor, sm, n_valid: Int32, tid: Int32):
        """A: zero the rows past the end, store the raw q, k, g rows (16-byte vectors) and the
        inverse L2 norm of every q and k row (step 1)."""
        group = tid % 16
        s_rnorm = sm.rnorm
        for half in cutlass.range_constexpr(2):
            r = tid // 16 + 8 * half
            for which in cutlass.range_constexpr(len(RAW_ROWS)):
                frag = raw[half, which, None]
                if r >= n_valid:
                    cute.recast_tensor(frag, Uint32).fill(0)
                cute.autovec_copy(frag, cute.local_tile(sm.raw[which][r, None], (8,), (group,)))
            for which in cutlass.range_constexpr(2):
                inv_norm = _inverse_norm(raw[half, which, None])
                if group == 0:
                    s_rnorm[which, r] = inv_norm

    @cute.jit
    def _column_pairs(
        self, sm, g_rec: cute.Tensor, gm, half: Int32, c0: Int32, a_log: Float32, dt0: Float32,
        dt1: Float32, n_valid: Int32, scale: Float32, lower_bound: Float32,
    ):
        """B: thread t owns the column pair (c0, c0 + 1), c0 = 2 (t % 64), on rows 8h .. 8h + 7,
        h = half = t // 64, so that its shared and global accesses are bf16x2 words (a warp moves
        128 contiguous bytes of a row, one wavefront; half the instructions of one column per
        thread) and each split rounds two values with one cvt. Per element: G_r (step 2), q and k
        normalised in f32 (step 1), the decays and decayed operands (step 3), split into the
        record (global memory) and the operand tiles (shared memory). Each column's running sum
        adds its 16 gates in row order from 0: threads h = 0 hand G_7 to threads h = 1 through
        sm.g_half, which hand back gt = ex2(G_15) there (G_7: the rows are split at REF_ROW)."""
        ops = sm.ops.toint()  # the raw rows (row-major) on the first three tiles
        rec = g_rec.iterator.toint()
        dts = (dt0, dt1)
        # step 2, prepare.py's gate: f32, 0 past the end; cum[j, i]: column c0 + j, row 8h + i
        a_exp = ex2_approx(fmul(a_log, Float32(LOG2E)))
        gate_scale = gate_scale_from_lower_bound(lower_bound)
        cum = cute.make_rmem_tensor(cute.make_layout((2, 8), stride=(8, 1)), Float32)
        # the raw q, k pairs of the thread's rows (one bf16x2 word per row and tensor); q * inv
        # and k * inv are formed below
        qk = cute.make_rmem_tensor(cute.make_layout((2, 8), stride=(8, 1)), Uint32)
        for i in cutlass.range_constexpr(8):
            r = half * 8 + i
            row_off = (r * D + c0) * 2
            g2 = ld_shared_b32(ops + 2 * TILE_BYTES + row_off)
            for j in cutlass.range_constexpr(2):
                g_in = bf16x2_lo_to_f32(g2) if j == 0 else bf16x2_hi_to_f32(g2)
                gate = fmul(gate_scale, sigmoid_exp2(fmul(a_exp, fadd(g_in, dts[j]))))
                if r >= n_valid:
                    gate = Float32(0.0)
                cum[j, i] = gate
            for which in cutlass.range_constexpr(2):
                qk[which, i] = Uint32(ld_shared_b32(ops + which * TILE_BYTES + row_off))
        g7 = cute.make_rmem_tensor((2,), Float32)  # G_7 of the two columns
        gt = cute.make_rmem_tensor((2,), Float32)
        g_half, g_gt, s_rnorm = sm.g_half, gm.gt, sm.rnorm
        if half == 0:
            for j in cutlass.range_constexpr(2):
                g7[j] = running_sum_of_half(cum, j, Float32(0.0))
                g_half[c0 + j] = g7[j]
        # every raw row is in registers (the operand tiles may now overwrite them); G_7 handed on
        self._barrier()
        if half == 1:
            for j in cutlass.range_constexpr(2):
                g7[j] = g_half[c0 + j]
                gt[j] = ex2_approx(running_sum_of_half(cum, j, g7[j]))
                g_half[c0 + j] = gt[j]
                g_gt[c0 + j] = gt[j]
        self._barrier()
        if half == 0:
            for j in cutlass.range_constexpr(2):
                gt[j] = g_half[c0 + j]
        up = (ex2_approx(fneg(g7[0])), ex2_approx(fneg(g7[1])))  # 2^-G_7
        down = (ex2_approx(g7[0]), ex2_approx(g7[1]))  # 2^G_7
        for i in cutlass.range_constexpr(8):
            r = half * 8 + i
            rq = s_rnorm[0, r]
            rk = s_rnorm[1, r]
            qn = (fmul(bf16x2_lo_to_f32(qk[0, i]), rq), fmul(bf16x2_hi_to_f32(qk[0, i]), rq))
            kn = (fmul(bf16x2_lo_to_f32(qk[1, i]), rk), fmul(bf16x2_hi_to_f32(qk[1, i]), rk))
            e = (ex2_approx(cum[0, i]), ex2_approx(cum[1, i]))
            ei = (ex2_approx(fneg(cum[0, i])), ex2_approx(fneg(cum[1, i])))
            # the recurrence's operands
            kd_hi = pack_bf16x2(fmul(kn[0], e[0]), fmul(kn[1], e[1]))
            qd = split_hi_lo_bf16x2(fmul(fmul(qn[0], e[0]), scale), fmul(fmul(qn[1], e[1]), scale))
            kr = split_hi_lo_bf16x2(fmul(kn[0], fmul(ei[0], gt[0])),
                                    fmul(kn[1], fmul(ei[1], gt[1])))
            # step 5's operands, decayed relative to row 7
            rel = (fmul(e[0], up[0]), fmul(e[1], up[1]))
            kl = split_hi_lo_bf16x2(fmul(kn[0], rel[0]), fmul(kn[1], rel[1]))
            ql = split_hi_lo_bf16x2(fmul(fmul(qn[0], rel[0]), scale),
                                    fmul(fmul(qn[1], rel[1]), scale))
            kil = split_hi_lo_bf16x2(fmul(kn[0], fmul(ei[0], down[0])),
                                     fmul(kn[1], fmul(ei[1], down[1])))
            off = swizzled_byte_offset(r, c0)
            for name, word in (("kd_hi", kd_hi), ("qd_hi", qd[0]), ("qd_lo", qd[1]),
                               ("kr_hi", kr[0]), ("kr_lo", kr[1])):
                self._record_store(rec + (RECORD[name] + off), [word])
            for name, word in (("kl_hi", kl[0]), ("kl_lo", kl[1]), ("ql_hi", ql[0]),
                               ("ql_lo", ql[1]), ("kil_hi", kil[0]), ("kil_lo", kil[1])):
                st_shared_b32(ops + (SMEM_PLAN[name][0] + off), word)

    @cute.jit
    def _mqk(self, sm, gm, lane: Int32):
        """C, warp 1: Mqk = causal(qL . kiL^T) (diagonal kept), split, staged on the dead ql_hi
        tile and stored (2 granules per lane, mqk_hi then mqk_lo)."""
        mma = WarpMma(tiled_mma_bf16(), lane)
        coords = mma.coords
        acc = _three_term_product(mma, sm.ql_hi, sm.ql_lo, sm.kil_hi, sm.kil_lo)
        # every lane's reads of ql_hi are done before any lane overwrites it
        cute.arch.sync_warp()
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = coords[i]
            v = acc[i]
            if r < c:
                v = Float32(0.0)
            _store_split(sm.mqk_hi, sm.mqk_lo, r, c, v)
        cute.arch.sync_warp()
        copy_granules(sm.mqk_stage_bytes, gm.mqk_bytes, lane, 32, 0, MQK_GRANULES)

    @cute.jit
    def _inverse(self, sm, g_rec: cute.Tensor, lane: Int32):
        """C, warp 0: L = strict(kL . kiL^T) * b_r (step 5, staged on the dead kl_hi tile),
        INV = (I + L)^-1 (step 6), split and stored from registers: lane i < 16 writes row i of
        inv_hi, lane i + 16 row i of inv_lo (32 bytes each, two 16-byte stores)."""
        mma = WarpMma(tiled_mma_bf16(), lane)
        coords = mma.coords
        acc = _three_term_product(mma, sm.kl_hi, sm.kl_lo, sm.kil_hi, sm.kil_lo)
        # every lane's reads of kl_hi are done before any lane overwrites it
        cute.arch.sync_warp()
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = coords[i]
            v = fmul(acc[i], sm.b[r])
            if r <= c:
                v = Float32(0.0)
            sm.l[r, c] = v
        cute.arch.sync_warp()

        # reference.forward_substitution_inverse on n = 16: lane i (and i + 16) holds row i
        row = lane % CHUNK
        inv = cute.make_rmem_tensor((CHUNK,), Float32)
        for p in cutlass.range_constexpr(CHUNK):
            inv[p] = sm.l[row, p]
        for s in cutlass.range_constexpr(CHUNK - 1):
            neg = fneg(inv[s])
            for p in cutlass.range_constexpr(s):
                # row s is final since step s - 1 (only rows below s change at step s)
                pivot = cute.arch.shuffle_sync(inv[p], s)
                updated = ffma(neg, pivot, inv[p])
                if row > s:
                    inv[p] = updated
            if row > s:
                inv[s] = neg
        # hi words on lanes 0-15, lo words on lanes 16-31; pack_bf16x2 rounds as f32_to_bf16
        words = cute.make_rmem_tensor((CHUNK // 2,), Int32)
        for w in cutlass.range_constexpr(CHUNK // 2):
            pair = []
            for j in cutlass.range_constexpr(2):
                c = 2 * w + j
                unit = Float32(0.0)
                if row == c:
                    unit = Float32(1.0)
                x = fadd(inv[c], unit)
                lo = fsub(x, bf16_to_f32(f32_to_bf16(x)))
                if lane >= CHUNK:
                    x = lo
                pair.append(x)
            words[w] = pack_bf16x2_i32(pair[0], pair[1])
        if cutlass.const_expr(self.fused):  # a 32-bit shared address
            addr = (g_rec.iterator.toint() + RECORD["inv_hi"] + (lane // CHUNK) * INV_TILE_BYTES
                    + row * (CHUNK * 2))
        else:
            addr = (
                g_rec.iterator.toint()
                + RECORD["inv_hi"]
                + Int64(lane // CHUNK) * INV_TILE_BYTES
                + Int64(row) * (CHUNK * 2)
            )
        self._record_store(addr, [words[0], words[1], words[2], words[3]])
        self._record_store(addr + 16, [words[4], words[5], words[6], words[7]])


# ------------------------------------------------------------------ helpers
def record_views(g_rec: cute.Tensor):
    """gt and the Mqk bytes of the CTA's 23,040-byte record `g_rec` (global memory, or shared
    with fused=True) as tensors (phase B stores the swizzled tiles by address)."""
    base = g_rec.iterator
    gm = _Smem()
    gm.gt = carve(base, RECORD["gt"], Float32, cute.make_layout(D))
    gm.mqk_bytes = cute.make_tensor(base + RECORD["mqk_hi"], cute.make_layout(2 * MQK_TILE_BYTES))
    return gm


class _Smem:
    """The CTA's shared-memory tensors (a trace-time bag)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


@cute.jit
def _inverse_norm(frag: cute.Tensor) -> Float32:
    """Step 1 on 8 bf16 values of a row: sequential FMAs from 0, xor butterfly 8, 4, 2, 1 over
    the row's 16 lanes, rsqrt.approx(sum + 1e-6). Every lane of the row gets the same value."""
    words = cute.recast_tensor(frag, Uint32)
    sq = Float32(0.0)
    for i in cutlass.range_constexpr(4):
        lo = bf16x2_lo_to_f32(words[i])
        hi = bf16x2_hi_to_f32(words[i])
        sq = ffma(lo, lo, sq)
        sq = ffma(hi, hi, sq)
    for off in cutlass.range_constexpr(4):
        sq = fadd(sq, cute.arch.shuffle_sync_bfly(sq, offset=8 >> off))
    return rsqrt_approx(fadd(sq, Float32(1e-6)))


@cute.jit
def _store_split(s_hi: cute.Tensor, s_lo: cute.Tensor, r, c, x: Float32):
    """split(x): hi = bf16(x), lo = bf16(x - f32(hi)) (exact difference, .ftz: a subnormal
    difference is a zero of its sign), stored at (r, c) of two bf16 tiles."""
    hi = f32_to_bf16(x)
    s_hi[r, c] = hi
    s_lo[r, c] = f32_to_bf16(fsub(x, bf16_to_f32(hi)))


@cute.jit
def _three_term_product(mma, s_a_hi, s_a_lo, s_b_hi, s_b_lo):
    """A.B^T with terms hh, hl, lh (docs/fp32_mode.md): three independent f32 MMA chains, each
    from zero with k-blocks ascending, summed hh + (hl + lh); A, B (16, 128) hi/lo tiles."""
    hh = mma.product(s_a_hi, s_b_hi)
    hl = mma.product(s_a_hi, s_b_lo)
    lh = mma.product(s_a_lo, s_b_hi)
    for i in cutlass.range_constexpr(cute.size(hh)):
        hh[i] = fadd(hh[i], fadd(hl[i], lh[i]))
    return hh


# ------------------------------------------------------------------ build side
def compile_kernel(arch: str = "sm_90a", *, grouped: bool = False, dump_dir: str | None = None):
    """The fp32-mode prepare kernel (grouped: for q, k on fewer heads than g) compiled for `arch`
    (compile_utils.compile_for_arch)."""
    return compile_for_arch(KdaPrepareFp32(grouped), prepare_args(RECORD_BYTES, grouped), arch,
                            dump_dir=dump_dir)
