"""Fused decode (serving): prepare + ONE chunk of the recurrence for t <= 16 tokens per sequence,
the state read from and written back to a row of a state pool, in one launch.

Interface (KdaDecode(inverse, state_dtype, intermediate)):
  __call__(mQ, mK, mV, mG: bf16 [N, t, H, 128], mBeta: bf16 [N, t, H], mALog: f32 [H],
           mDtBias: f32 [H, 128], mStateIndices: i32 [N], mPool: bf16|f32 [P, H, 128, 128],
           mOut: bf16 [N, t, H, 128], [mStates: bf16|f32 [N, t, H, 128, 128] only with
           intermediate=True], scale: Float32, lower_bound: Float32, stream)
  N, t, H, P dynamic; the handler guarantees 1 <= t <= 16 (the kernel clamps to [0, 16] and
  does nothing for t = 0). mPool is updated in place (aliased input -> output by the handler).
Per (n, h), row = state_indices[n]:
  - row outside [0, P): padding slot. No pool access; out rows r < t are +0; with intermediate,
    states[n, 0 .. t-1, h] are +0.
  - otherwise exactly what the prepare kernel + the recurrence (any block_v) compute on the same
    t tokens as one sequence of length t (rows t..15 zero tokens) with initial state
    pool[row, h] (f32 pools rounded to bf16 RN on entry): out rows r < t bitwise, pool[row, h] <-
    the final state (f32: widened exactly). With intermediate, states[n, i, h] (i < t) = the
    state after tokens 0..i, bitwise the final state of a prefill on the first i + 1 tokens;
    states[n, t-1, h] = the new pool row.

Bitwise equality comes from running the same device code: the chunk's workspace record is built
in shared memory by prepare.KdaPrepare's own phase methods (record_inputs, record_normalize,
record_decays, record_inverse_mqk: phases A, B, C of the prepare kernel without its global
stores, with the rows read from [N, t, H, ...] instead of the packed layout), and the chunk step
uses recurrence.py's pieces (u_to_b_operand, out_add, state_tile_update) and its instruction
sequence for P / Oq (mma k-blocks ascending from +0), b (sigmoid_bf16x2_from_logit of the raw
beta bits), the row masks, the out add and the state update. Where recurrence.py takes the
state's B operand as movmatrix.trans of its accumulator-layout registers, this kernel loads it
with ldmatrix from the swizzled shared tile: bitwise the same fragments (recurrence_common.
state_frag_offset; tests/test_kernel_compile_decode.py checks it on the fragment simulator).

Intermediate states (state after tokens 0..i, i < t-1): a prefill on the first i + 1 tokens has
zero tokens in rows i+1..15, so only gt and kr change with i (numerics.md, 3-5): gt_i = ex2(G_i)
(zero rows add +0 to G; ex2(+-0) = 1), kr^(i)_r = bf16(ki_r * bf16(gt_i)) for r <= i and +0
(exactly: bf16(+0 * x)) for r > i. kd, qd, INV and Mqk rows <= i, hence u and U rows <= i, do
not depend on i (each output row of an MMA depends only on its own A row; the stable and Neumann
inverses are row-wise forward in the same sense), and the prefill's U rows > i are +0 (its u
rows > i are masked to +0 and its INV rows > i only meet them). So
  S^(i)[j, k] = bf16(fma(f32(S[j, k]), gt_i[k], (kr^(i)T . U^(i))[k, j]))
with kr^(i) = bf16x2 mul of the ki A fragments by bf16(gt_i) AND a row mask (rows <= i), U^(i)
= U AND the same row mask: the MMA operands are bit-identical to the prefill's (+0 where the
prefill has +0). This relies, as numerics.md section 6 does, on an mma.sync output element
depending only on its own operand row / column, and on zero products (+0 or -0) not changing a
sum (an all-zero sum from a +0 accumulator being +0). gt_i comes from the f32 table
ex2(G_r) that record_decays writes on request: the same ex2.approx instruction on the same
operand as the prefill's gt = ex2(G_15) of the shorter sequence.

CTA shape: one CTA of 128 threads (4 warps) per (n, h), grid (N, H, 1). The prepare phases are
written for 128 threads (a column pair on 8 rows per thread in phase B, warps 0 / 1 for the
inverse / Mqk), and 4 warps x 32 value columns (4 n-tiles, like recurrence_baseline.py) cover the
recurrence step without idle warps. Column-split CTAs would repeat the whole prepare work per
slice; 8 warps would leave half of them idle through prepare and, at <= 85 registers for three
CTAs of 256 threads, not fit the step; so the lever is CTAs per SM, i.e. shared memory.

Shared memory: one region (SMEM_BYTES = 55,424 bytes; + 8 KB for the gt_i table with
intermediate): prepare's record, ki tile, beta and staging area at prepare.RECORD_SMEM (the
piece places them there instead of allocating, record_inputs(smem_base=...)), then the state
tile (bf16 [128, 128], granule kg of row v at kg ^ (v % 8): ldmatrix, ldmatrix.trans,
stmatrix.trans and the 16-byte copies along a row are conflict free) starting right after the
staging area's inverse scratch (prepare.INVERSE_SCRATCH_BYTES). Its first 3.5 KB (rows 0..13)
overlap the staging area's normalised q and k, dead once record_decays has returned, so
those rows (copy steps 0..LATE_STEPS-1, rows 0..15) are written only then. 55.4 KB and <= 128
registers: four CTAs per SM (with the gt_i table three).

Order of work in a CTA (t >= 1):
  1. Prepare A0 (q / k / g rows, beta, A_log, dt_bias), the lane's step operands (v pairs and
     beta logits of rows g, g + 8 for its columns; rows >= t: no access, 0) and the pool row
     state_indices[n] are all issued before anything waits (prepare's loads are plain loads
     that ptxas would sink below a branch on the row, so the row is loaded last, as volatile
     asm). Prepare A (L2 norms; CTA barrier) waits for them.
  2. Padding slot: zeros to out rows r < t (and states[n, :t]); nothing else.
     Otherwise the state copy: bf16: cp.async.cg of 16 bytes (14 per thread, rows 16..127)
     into the tile, plus 16-byte register loads of rows 0..15 (2 per thread); f32: 16-byte
     register loads of rows 64..127 (16 per thread). Coalesced: consecutive threads read
     consecutive 16-byte units of a row; every address is a thread-constant base plus an
     immediate.
  3. Prepare B (gates, cumsum, decays; CTA barrier). Then the registers go to the tile: bf16
     rows 0..15 (st.shared.v4); f32 rows 64..127 (cvt.rn.bf16x2, st.shared.v2) and the loads of
     rows 0..63 are issued.
  4. Prepare C: warp 0 INV, warp 1 Mqk. f32: rows 0..63 stored; bf16: cp.async.wait_group 0.
     CTA barrier: record and state tile complete.
  5. Per warp (its 32 columns, warp-local from here on): P = kd . S^T, Oq = qd . S^T (64 MMAs,
     B operands by ldmatrix from the tile), u, U = INV . u, out = Oq + Mqk . U (rows < t,
     4-byte stores). With intermediate, for i = 0 .. t-2 the state after token i from the
     unchanged tile (16 ldmatrix.trans, 32 MMAs per i), stored from registers (movmatrix.trans:
     four lanes write 16 (bf16) / 32 (f32) contiguous bytes of a row). Then the final state,
     k-tile by k-tile in place (ldmatrix.trans old, W = kr^T . U, fma, stmatrix.trans new),
     bar.warp.sync, and the warp's 32 rows go out with coalesced 16-byte stores (f32: widened)
     to the pool row (and states[n, t-1]).
Index arithmetic of the step: bit operations on the lane id once (Lane), immediates after
(the SASS of the step is ~750 instructions per warp, ~650 of them MMA / ldmatrix / the state
update's widen-fma-pack that the numerics fix).

Checked on an H200 (2026-12-01, a standalone harness linking the AOT objects): out, pool rows
(bf16 and f32) and per-token states bitwise equal to prepare + the column-split recurrence
(per-token states: to prefills of the first i + 1 tokens), padding slots zero and other pool
rows untouched, for both inverses and t = 1, 2, 5, 16: no difference.

Time (H200, measured 2026-12-01 with that harness, median of 20;
bf16 pool, stable, t = 1 unless noted): N x H = 256 x 12: 77 us (floor 47; target 60);
64 x 12: 25 us (target 18); 1024 x 12: 261 us (target 220); 256 x 96: 502 us (target 460);
t = 4: 79 us (target 80); neumann 74 us; f32 pool 119 us (3.4 TB/s, floor 94); intermediate
states, t = 4: 309 us. The same shapes unfused: prepare 38.5 us + serving recurrence (block_v
16) 210 us. Nsight Compute (256 x 12): 4 CTAs (16 warps) per SM, one instruction issued every
2.4 cycles per scheduler, DRAM at ~63 % of peak: issue / latency bound, not bandwidth bound.
Per CTA ~7.8K warp instructions, ~60 % of them the prepare phases (the same code takes 38.5 us
as its own kernel at seven CTAs per SM); warps wait ~10 % of their time at the barrier before
the step for warp 0's inverse. What is left (not done): shorten that critical path (a fifth
warp for the inverse, the other warps' P / Oq during phase C) and fewer prepare instructions
would need a different record build than the prefill's.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, cute
from cutlass.cutlass_dsl import Constexpr
from cutlass.memory import SmemAllocator

from . import ptx
from .compile_utils import compile_for_arch, fake_stream, fake_tensor, symbol
from .prepare import (
    INVERSE_SCRATCH_BYTES,
    INVERSES,
    RECORD_SMEM,
    RECORD_SMEM_BYTES,
    KdaPrepare,
)
from .prepare_common import qk_head_of
from .recurrence import copy_tile_rows_out, out_add, state_tile_update, u_to_b_operand
from .recurrence_common import (
    CHUNK,
    OFF_GT,
    OFF_INV,
    OFF_KD,
    OFF_KR,
    OFF_MQK,
    OFF_QD,
    STATE_DTYPES,
    STATE_ELEM_BYTES,
    D,
    state_copy_unit,
)

NUM_THREADS = 128  # 4 warps: the prepare phases' thread count
NUM_WARPS = NUM_THREADS // 32
N_TILES = 4  # 8-column n-tiles per warp: warp w owns value columns 32 w .. 32 w + 31
WARP_COLS = 8 * N_TILES
STATE_TILE_BYTES = D * D * 2
GT_ROWS_BYTES = CHUNK * D * 4
# Shared memory: the prepare piece's region (prepare.RECORD_SMEM) and the state tile right after
# the inverse scratch of its staging area; the tile's first bytes overlap the staging area's
# tail (normalised q and k: dead once record_decays has returned), so the tile's first
# LATE_STEPS copy steps (8 rows each) go through registers and are stored only then.
TILE_OFFSET = RECORD_SMEM["stage"] + INVERSE_SCRATCH_BYTES
SMEM_BYTES = TILE_OFFSET + STATE_TILE_BYTES
TILE_OVERLAP = RECORD_SMEM_BYTES - TILE_OFFSET  # bytes of the tile inside the staging area
COPY_STEPS = D * D * 2 // 16 // NUM_THREADS  # 16 steps of 8 rows
LATE_STEPS = -(-TILE_OVERLAP // (8 * D * 2))
assert TILE_OFFSET % 128 == 0 and 0 < TILE_OVERLAP <= LATE_STEPS * 8 * D * 2


def state_frag_q(mt, pair):
    """The state fragment instruction (recurrence_common.state_frag_regs, 4 n-tiles) of k-tile mt
    and n-tile pair `pair` (n-tiles 2 pair, 2 pair + 1)."""
    return mt * (N_TILES // 2) + pair


def state_offset(mt, nt, half):
    """Element offset of the pair movmatrix.trans(state[mt, nt, half]) holds, relative to the
    lane's start (row g, k 2t): row + 8 nt, k + 16 mt + 8 half (as
    recurrence.checkpoint_offset)."""
    return 8 * nt * D + 16 * mt + 8 * half


def row_masks(t4):
    """The chunk rows (K index) of the two B-operand registers of a lane with t4 = lane % 4,
    which are also those of its kr^T A-operand pairs: register 0 rows 2 t4, 2 t4 + 1 (low,
    high half), register 1 rows 2 t4 + 8, 2 t4 + 9."""
    return 2 * t4, 2 * t4 + 1, 2 * t4 + 8, 2 * t4 + 9


class DecodeHost:
    """The host entry of the fused decode kernels (KdaDecode here, decode_fp32.KdaDecodeFp32):
    one CTA of `num_threads` per (sequence, value head), grid (N, H, 1), launched with
    `launch_options`; the device code is the subclass's _body (mStates None)."""

    num_threads = NUM_THREADS
    launch_options: dict = {}

    def value_heads(self, mQ: cute.Tensor, mV: cute.Tensor):
        """H: the heads of v, g, beta, the pool and out (q's, unless grouped)."""
        return mV.shape[2] if self.grouped else mQ.shape[2]

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # bf16 [N, t, H, 128]
        mK: cute.Tensor,  # bf16 [N, t, H, 128]
        mV: cute.Tensor,  # bf16 [N, t, H, 128]
        mG: cute.Tensor,  # bf16 [N, t, H, 128]
        mBeta: cute.Tensor,  # bf16 [N, t, H]
        mALog: cute.Tensor,  # f32 [H]
        mDtBias: cute.Tensor,  # f32 [H, 128]
        mStateIndices: cute.Tensor,  # i32 [N]
        mPool: cute.Tensor,  # bf16 | f32 [P, H, 128, 128], updated in place
        mOut: cute.Tensor,  # bf16 [N, t, H, 128]
        scale: Float32,
        lower_bound: Float32,
        stream: cuda.CUstream,
    ):
        self.kernel(
            mQ, mK, mV, mG, mBeta, mALog, mDtBias, mStateIndices, mPool, mOut, scale, lower_bound
        ).launch(
            grid=[mQ.shape[0], self.value_heads(mQ, mV), 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            **self.launch_options,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        mStateIndices: cute.Tensor,
        mPool: cute.Tensor,
        mOut: cute.Tensor,
        scale: Float32,
        lower_bound: Float32,
    ):
        self._body(
            mQ, mK, mV, mG, mBeta, mALog, mDtBias, mStateIndices, mPool, mOut, None, scale,
            lower_bound,
        )


class DecodeStatesHost(DecodeHost):
    """DecodeHost with the per-token states: __call__ also takes mStates [N, t, H, 128, 128]."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # bf16 [N, t, H, 128]
        mK: cute.Tensor,  # bf16 [N, t, H, 128]
        mV: cute.Tensor,  # bf16 [N, t, H, 128]
        mG: cute.Tensor,  # bf16 [N, t, H, 128]
        mBeta: cute.Tensor,  # bf16 [N, t, H]
        mALog: cute.Tensor,  # f32 [H]
        mDtBias: cute.Tensor,  # f32 [H, 128]
        mStateIndices: cute.Tensor,  # i32 [N]
        mPool: cute.Tensor,  # bf16 | f32 [P, H, 128, 128], updated in place
        mOut: cute.Tensor,  # bf16 [N, t, H, 128]
        mStates: cute.Tensor,  # bf16 | f32 [N, t, H, 128, 128]
        scale: Float32,
        lower_bound: Float32,
        stream: cuda.CUstream,
    ):
        self.kernel_states(
            mQ,
            mK,
            mV,
            mG,
            mBeta,
            mALog,
            mDtBias,
            mStateIndices,
            mPool,
            mOut,
            mStates,
            scale,
            lower_bound,
        ).launch(
            grid=[mQ.shape[0], self.value_heads(mQ, mV), 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            **self.launch_options,
        )

    @cute.kernel
    def kernel_states(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        mStateIndices: cute.Tensor,
        mPool: cute.Tensor,
        mOut: cute.Tensor,
        mStates: cute.Tensor,
        scale: Float32,
        lower_bound: Float32,
    ):
        self._body(
            mQ, mK, mV, mG, mBeta, mALog, mDtBias, mStateIndices, mPool, mOut, mStates, scale,
            lower_bound,
        )


def check_state_dtype(state_dtype):
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {tuple(STATE_DTYPES)}, got {state_dtype!r}")


class KdaDecode(DecodeHost):
    """Host entry + device kernel of the fused decode (module docstring). KdaDecode(inverse,
    state_dtype, intermediate=True) constructs KdaDecodeStates, whose __call__ also takes
    mStates."""

    def __new__(cls, inverse: str = "stable", state_dtype: str = "bf16",
                intermediate: bool = False, grouped: bool = False):
        if intermediate and cls is KdaDecode:
            cls = KdaDecodeStates
        return super().__new__(cls)

    def __init__(self, inverse: str = "stable", state_dtype: str = "bf16",
                 intermediate: bool = False, grouped: bool = False):
        if inverse not in INVERSES:
            raise ValueError(f"inverse must be one of {INVERSES}, got {inverse!r}")
        check_state_dtype(state_dtype)
        self.inverse = inverse
        self.state_dtype = state_dtype
        self.intermediate = intermediate
        # grouped value heads: q and k [N, t, Hk, 128], value head h reads query/key head
        # h // (H // Hk); H is then v's head count (a specialisation of its own)
        self.grouped = grouped
        self.state_elem_bytes = STATE_ELEM_BYTES[state_dtype]
        self.prep = KdaPrepare(inverse)  # the record-building phases

    @cute.jit
    def _body(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        mStateIndices: cute.Tensor,
        mPool: cute.Tensor,
        mOut: cute.Tensor,
        mStates,
        scale: Float32,
        lower_bound: Float32,
    ):
        ESZ: Constexpr = self.state_elem_bytes
        F32: Constexpr = self.state_dtype == "f32"
        STATES: Constexpr = self.intermediate
        tid, _, _ = cute.arch.thread_idx()
        n, head, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tid % 32
        t = mQ.shape[1]
        num_heads = self.value_heads(mQ, mV)
        qk_head = None
        if cutlass.const_expr(self.grouped):
            qk_head = qk_head_of(head, num_heads, mQ.shape[2])
        n_valid = cutlass.max(cutlass.min(t, Int32(CHUNK)), Int32(0))

        smem = SmemAllocator()
        # one region: the prepare piece's record / ki / beta / staging, then the state tile,
        # which overlaps the staging area past the inverse scratch (dead after phase B)
        region = smem.allocate_array(Uint8, SMEM_BYTES, byte_alignment=128)
        tile = (region + TILE_OFFSET).toint()
        gt_rows = None
        if cutlass.const_expr(STATES):
            gt_rows = smem.allocate_tensor(
                Float32, cute.make_layout((CHUNK, D), stride=(D, 1)), byte_alignment=16
            )
        # token row r of head `head` of sequence n in [N, t, H, 128]: tok_base + r * row_bytes
        row_bytes = Int64(num_heads) * (D * 2)
        tok_base = (Int64(n) * Int64(t) * Int64(num_heads) + Int64(head)) * (D * 2)
        if n_valid > 0:  # t >= 1 (the handler guarantees it): the token tensors are not empty
            # prepare A0 and the step's token operands: none depends on the pool row, so they are
            # all in flight with its load; prepare A waits for them (by then the row is known)
            rec = self.prep.record_inputs(
                DecodeRows(n, head, mBeta, qk_head), mQ, mK, mG, mALog, mDtBias, head, n_valid,
                tid,
                smem_base=region,
            )
            ln = Lane(lane, warp_idx * WARP_COLS)
            io = lane_token_operands(
                ln, mV, mBeta, mOut, tok_base, row_bytes, n, t, num_heads, head, n_valid
            )
            # the pool row, loaded after the token loads in program order (ptxas places its
            # first use right behind the load, and a warp issues in order)
            row = ptx.ld_global_b32_if(
                mStateIndices.iterator.toint() + Int64(n) * 4, Int32(0), Int32(1)
            )
            self.prep.record_normalize(rec)
            # (method calls on `rec` stay outside the dynamic `if`: the DSL would carry it)
            rec_addr = rec.s_rec.toint()
            s_ki = rec.s_ki.iterator.toint()
            valid_row = (row >= 0) & (row < mPool.shape[0])
            if valid_row:
                pool_head = (
                    mPool.iterator.toint()
                    + (Int64(row) * Int64(num_heads) + Int64(head)) * (D * D * ESZ)
                )
                # 1. the state copy. bf16: cp.async of the rows whose tile bytes do not overlap
                # prepare's staging area, register loads of the others (stored after phase B).
                # f32: the half that does not overlap now, the other after phase B.
                if cutlass.const_expr(F32):
                    half1 = _load_state_f32_half(tid, pool_head, 1)
                else:
                    _copy_state_bf16(tid, tile, pool_head, range(LATE_STEPS, COPY_STEPS))
                    early = _load_state_bf16_steps(tid, pool_head, range(LATE_STEPS))
                # 2. prepare B (ends with a CTA barrier): the staging area's tail is free
                self.prep.record_decays(rec, scale, lower_bound, gt_rows)
                if cutlass.const_expr(F32):
                    _store_state_f32_half(tid, tile, half1, 1)
                    half0 = _load_state_f32_half(tid, pool_head, 0)
                else:
                    _store_state_bf16_steps(tid, tile, early, range(LATE_STEPS))
                # 3. prepare C (warps 0, 1); every thread's part of the tile landed / stored
                # before the barrier that completes the record
                self.prep.record_inverse_mqk(rec, warp_idx, lane)
                if cutlass.const_expr(F32):
                    _store_state_f32_half(tid, tile, half0, 0)
                else:
                    ptx.cp_async_wait(0)
                cute.arch.sync_threads()
                # 4. the chunk step, per warp
                step = _DecodeStep(ln, rec_addr, tile, io, n_valid)
                ub = _p_oq_u_out(step)
                if cutlass.const_expr(STATES):
                    gt_tab = gt_rows.iterator.toint()
                    states_n = mStates.iterator.toint() + (
                        Int64(n) * Int64(t) * Int64(num_heads) + Int64(head)
                    ) * (D * D * ESZ)
                    states_stride = Int64(num_heads) * (D * D * ESZ)  # one token
                    for i in range(n_valid - 1):
                        _intermediate_state(
                            step, ub, i, s_ki, gt_tab, states_n + Int64(i) * states_stride, ESZ
                        )
                    _final_state(
                        step,
                        ub,
                        [pool_head, states_n + Int64(n_valid - 1) * states_stride],
                        ESZ,
                    )
                else:
                    _final_state(step, ub, [pool_head], ESZ)
            if not valid_row:
                # padding slot: no pool access; out rows r < t and the per-token states are +0
                states_n, states_stride = None, None
                if cutlass.const_expr(STATES):
                    states_n = mStates.iterator.toint() + (
                        Int64(n) * Int64(t) * Int64(num_heads) + Int64(head)
                    ) * (D * D * ESZ)
                    states_stride = Int64(num_heads) * (D * D * ESZ)
                zero_padding_slot(tid, NUM_THREADS, mOut.iterator.toint() + tok_base, row_bytes,
                                  n_valid, states_n, states_stride, ESZ)


@cute.jit
def zero_padding_slot(tid: Int32, nthreads: Constexpr, out_head, row_bytes, n_valid: Int32,
                      states_n, states_stride, esz: Constexpr):
    """A padding slot's results: its out rows r < n_valid (at out_head, row_bytes apart) and,
    unless states_n is None, its states [n_valid, 128, 128] (states_stride apart) are +0, in
    16-byte stores by the CTA's nthreads threads."""
    zero = Int32(0)
    for k in cutlass.range_constexpr(CHUNK * D * 2 // 16 // nthreads):
        u = tid + k * nthreads
        r = u // (D * 2 // 16)
        if r < n_valid:
            ptx.st_global_v4(
                out_head + Int64(r) * row_bytes + Int64(u % (D * 2 // 16)) * 16,
                [zero, zero, zero, zero],
            )
    if cutlass.const_expr(states_n is not None):
        for i in range(n_valid):
            for k in cutlass.range_constexpr(D * D * esz // 16 // nthreads):
                ptx.st_global_v4(
                    states_n + Int64(i) * states_stride + Int64(tid + k * nthreads) * 16,
                    [zero, zero, zero, zero],
                )


class KdaDecodeStates(DecodeStatesHost, KdaDecode):
    """KdaDecode(..., intermediate=True): also writes states[n, i] after every token i."""


# ----------------------------------------------------------------------------------------------
# Plain trace-time pieces (no dynamic control flow), also run by the CPU tests on kernel_sim.Simt
# ----------------------------------------------------------------------------------------------
class DecodeRows:
    """Chunk rows of the decode kernel for KdaPrepare.record_inputs: token r of sequence n; q and
    k rows of query/key head `qk_head` (grouped value heads), the value head itself by default."""

    def __init__(self, n, head, mBeta, qk_head=None):
        self.n, self.head, self.mBeta = n, head, mBeta
        self.qk_head = head if qk_head is None else qk_head

    def token(self, r):
        return r

    def row(self, m_x, tok):
        return m_x[self.n, tok, self.head, None]

    def qk_row(self, m_x, tok):
        return m_x[self.n, tok, self.qk_head, None]

    def beta(self, tok):
        return self.mBeta[self.n, tok, self.head]


class _Bag:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _copy_state_bf16(tid, tile, pool_head, steps):
    """Steps `steps` (of COPY_STEPS) of the bf16 state pool[row, h] -> swizzled tile copy: one
    cp.async.cg of 16 bytes per thread and step, one commit group. Step i copies rows 8 i ..
    8 i + 7: unit tid + 128 i (state_copy_unit) is row (tid >> 4) + 8 i, k = 8 (tid & 15), and
    its granule's swizzle (tid & 15) ^ (row & 7) does not depend on i, so every address is a
    thread-constant base plus an immediate."""
    s_base, g_base = _state_bf16_step_addresses(tid, tile, pool_head)
    for i in steps:
        ptx.cp_async_16_if(s_base + 2048 * i, g_base + 2048 * i, Int32(0), Int32(1))
    ptx.cp_async_commit()


def _state_bf16_step_addresses(tid, tile, pool_head):
    """(shared base, global base) of _copy_state_bf16's step 0; step i adds 2048 to both."""
    s_base = tile + (tid >> 4) * (D * 2) + ((tid & 15) ^ ((tid >> 4) & 7)) * 16
    g_base = pool_head + (Int64(tid >> 4) * D + Int64(tid & 15) * 8) * 2
    return s_base, g_base


def _load_state_bf16_steps(tid, pool_head, steps):
    """The 16-byte global loads of _copy_state_bf16's `steps`, into registers."""
    _, g_base = _state_bf16_step_addresses(tid, 0, pool_head)
    return [ptx.ld_global_v4(g_base + 2048 * i) for i in steps]


def _store_state_bf16_steps(tid, tile, vals, steps):
    """Their 16-byte shared stores into the swizzled tile."""
    s_base, _ = _state_bf16_step_addresses(tid, tile, Int64(0))
    for i, w in zip(steps, vals):
        ptx.st_shared_v4(s_base + 2048 * i, w)


def _f32_half_units(tid, which):
    """(row, first k) of the 16 f32 units (4 values) this thread loads for state half `which`
    (units 2048 which .. 2048 which + 2047 of the 4096 in the state): unit tid + 128 (16 which
    + i), i.e. row (tid >> 5) + 4 (16 which + i), k = 4 (tid & 31)."""
    per = D * D * 4 // 16 // NUM_THREADS // 2  # 16
    return [state_copy_unit(tid + (which * per + i) * NUM_THREADS, 4) for i in range(per)]


def _f32_half_addresses(tid, tile, pool_head, which):
    """[(shared address, global address)] of _f32_half_units, as thread-constant bases plus
    immediates: the granule swizzle ((tid & 31) >> 1) ^ (row & 7) with row & 7 = (tid >> 5) ^
    4 (i & 1)."""
    per = D * D * 4 // 16 // NUM_THREADS // 2
    s_x = ((tid & 31) >> 1) ^ (tid >> 5)
    s_base = tile + (tid >> 5) * (D * 2) + (tid & 1) * 8
    g_base = pool_head + (Int64(tid >> 5) * D + Int64(tid & 31) * 4) * 4
    out = []
    for i in range(per):
        u = which * per + i  # row (tid >> 5) + 4 u
        out.append(
            (s_base + 1024 * u + (s_x ^ (4 * (i & 1))) * 16, g_base + 2048 * u)
        )
    return out


def _load_state_f32_half(tid, pool_head, which, tile=0):
    """Issue the 16-byte loads of half `which` of an f32 state (coalesced); returns the
    registers."""
    return [ptx.ld_global_v4(g) for _, g in _f32_half_addresses(tid, tile, pool_head, which)]


def _store_state_f32_half(tid, tile, vals, which):
    """Round half `which` to bf16 (RN) into the swizzled tile: 8-byte shared stores."""
    for (s_addr, _), w in zip(_f32_half_addresses(tid, tile, Int64(0), which), vals):
        ptx.st_shared_v2(
            s_addr,
            [ptx.pack_f32_bits_bf16x2(w[0], w[1]), ptx.pack_f32_bits_bf16x2(w[2], w[3])],
        )


class Lane:
    """This lane's constant index terms (bit operations on the lane id, computed once): the
    m16n8k16 fragment coordinates g = lane >> 2, t4 = lane & 3 (acc_row = g + 8 half, acc_col =
    2 t4), and the row bases and swizzle terms of its ldmatrix / stmatrix addresses. With
    m = lane >> 3 and l8 = lane & 7, the reference maps reduce to
      ldmatrix_a_offset(lane, kb)    = a_row + ((2 kb) ^ a_x) * 16
      ldmatrix_krt_offset(lane, mt)  = krt_row + ((2 mt) ^ krt_x) * 16
      state_frag_offset(lane, q(mt, pair), col_w, 4) = frag_row + 4096 pair + ((2 mt) ^ frag_x) * 16
    (the tests check these identities for every lane)."""

    def __init__(self, lane, col_w):
        m = lane >> 3
        l8 = lane & 7
        self.lane = lane
        self.col_w = col_w
        self.g = lane >> 2
        self.t4 = lane & 3
        self.a_row = (8 * (m & 1) + l8) * 256
        self.a_x = (m >> 1) ^ l8
        self.krt_row = (8 * (m >> 1) + l8) * 256
        self.krt_x = (m & 1) ^ l8
        self.frag_row = (col_w + 8 * (m >> 1) + l8) * 256
        self.frag_x = self.krt_x
        self.small_off = (8 * (m & 1) + l8) * 32 + (m >> 1) * 16  # ldmatrix_small_offset

    def a_off(self, kb):
        return self.a_row + ((2 * kb) ^ self.a_x) * 16

    def krt_off(self, mt):
        return self.krt_row + ((2 * mt) ^ self.krt_x) * 16

    def frag_off(self, mt, pair):
        return self.frag_row + 4096 * pair + ((2 * mt) ^ self.frag_x) * 16


def lane_token_operands(
    ln, mV, mBeta, mOut, tok_base, row_bytes, n, t, num_heads, head, n_valid, n_tiles=N_TILES
):
    """The token operands lane `ln` needs in the chunk step, loaded early: v pairs (rows g,
    g + 8, columns col_w + 8 nt + 2 t4, +1 for its n_tiles n-tiles) and the raw beta logits of
    those rows (rows >= t: not read, 0), the row masks and the out addresses."""
    rows = [ln.g, ln.g + 8]
    row8 = row_bytes * 8
    col_off = Int64(ln.col_w + 2 * ln.t4) * 2
    v_lane = mV.iterator.toint() + tok_base + Int64(ln.g) * row_bytes + col_off
    out_lane = mOut.iterator.toint() + tok_base + Int64(ln.g) * row_bytes + col_off
    v_in = [
        [
            ptx.ld_global_b32_if(v_lane + (row8 if half else 0) + 16 * nt, rows[half], n_valid)
            for half in range(2)
        ]
        for nt in range(n_tiles)
    ]
    beta_row = Int64(num_heads) * 2
    beta_lane = (
        mBeta.iterator.toint()
        + (Int64(n) * Int64(t) * Int64(num_heads) + Int64(head)) * 2
        + Int64(ln.g) * beta_row
    )
    beta_bits = [
        ptx.ld_global_u16_if(beta_lane + (beta_row * 8 if half else 0), rows[half], n_valid)
        for half in range(2)
    ]
    row_mask = [ptx.select_lt(rows[half], n_valid, Int32(-1), Int32(0)) for half in range(2)]
    out_addr = [
        [out_lane + (row8 if half else 0) + 16 * nt for half in range(2)]
        for nt in range(n_tiles)
    ]
    return _Bag(v_in=v_in, beta_bits=beta_bits, row_mask=row_mask, out_addr=out_addr, rows=rows)


class _DecodeStep:
    """Per-warp constants of the chunk step (a plain bag)."""

    def __init__(self, ln, rec_addr, tile, io, n_valid):
        self.ln, self.rec, self.tile = ln, rec_addr, tile
        self.io, self.n_valid = io, n_valid
        self.zero_f = Float32(0.0)


def _p_oq_u_out(step):
    """P = kd . S^T and Oq = qd . S^T (k-blocks ascending from +0; B operands by ldmatrix from
    the state tile), u and U (recurrence.u_to_b_operand), out = Oq + Mqk . U for rows < t.
    Returns U as the B operand per n-tile."""
    ln, zero_f = step.ln, step.zero_f
    p = [[zero_f] * 4 for _ in range(N_TILES)]
    o = [[zero_f] * 4 for _ in range(N_TILES)]
    for kb in range(8):
        a_off = ln.a_off(kb)
        a_kd = ptx.ldmatrix_x4(step.rec + OFF_KD + a_off)
        a_qd = ptx.ldmatrix_x4(step.rec + OFF_QD + a_off)
        for pair in range(N_TILES // 2):
            bb = ptx.ldmatrix_x4(step.tile + ln.frag_off(kb, pair))
            for e in range(2):
                nt = 2 * pair + e
                b = (bb[2 * e], bb[2 * e + 1])
                p[nt] = ptx.mma_bf16_16816(a_kd, b, p[nt])
                o[nt] = ptx.mma_bf16_16816(a_qd, b, o[nt])
    io = step.io
    b_in = [ptx.sigmoid_bf16x2_from_logit(io.beta_bits[half]) for half in range(2)]
    a_inv = ptx.ldmatrix_x4(step.rec + OFF_INV + ln.small_off)
    a_mqk = ptx.ldmatrix_x4(step.rec + OFF_MQK + ln.small_off)
    ub = [
        u_to_b_operand(p[nt], io.v_in[nt], b_in, io.row_mask, a_inv, zero_f)
        for nt in range(N_TILES)
    ]
    for nt in range(N_TILES):
        m4 = ptx.mma_bf16_16816(a_mqk, ub[nt], [zero_f] * 4)
        for half in range(2):
            mq = ptx.pack_bf16x2_i32(m4[2 * half], m4[2 * half + 1])
            oq = ptx.pack_bf16x2_i32(o[nt][2 * half], o[nt][2 * half + 1])
            ptx.st_global_b32_if(
                io.out_addr[nt][half], out_add(oq, mq), io.rows[half], step.n_valid
            )
    return ub


def intermediate_masks(ln, i):
    """(mask of register 0, mask of register 1): chunk rows <= i kept (module docstring)."""
    r0, r1, r8, r9 = row_masks(ln.t4)
    lim = i + 1
    m0 = ptx.select_lt(r0, lim, Int32(0xFFFF), Int32(0)) | ptx.select_lt(
        r1, lim, Int32(-65536), Int32(0)
    )
    m1 = ptx.select_lt(r8, lim, Int32(0xFFFF), Int32(0)) | ptx.select_lt(
        r9, lim, Int32(-65536), Int32(0)
    )
    return m0, m1


def _store_registers(addr, b, esz):
    """One state register pair, given as its movmatrix.trans, to global memory."""
    if esz == 2:
        ptx.st_global_b32_if(addr, b, Int32(0), Int32(1))
    else:
        ptx.st_global_f32x2_of_bf16x2_if(addr, b, Int32(0), Int32(1))


def _intermediate_state(step, ub, i, s_ki, gt_tab, dst, esz):
    """The state after tokens 0..i (i < t - 1) from the unchanged tile, this warp's columns,
    stored from registers to dst (states[n, i, h])."""
    ln, zero_f = step.ln, step.zero_f
    m0, m1 = intermediate_masks(ln, i)
    ubi = [(ub[nt][0] & m0, ub[nt][1] & m1) for nt in range(N_TILES)]
    lane_addr = dst + (Int64(ln.col_w + ln.g) * D + Int64(2 * ln.t4)) * esz
    gt_lane = gt_tab + i * (D * 4) + ln.g * 4
    for mt in range(8):
        a_ki = ptx.ldmatrix_x4_trans(s_ki + ln.krt_off(mt))
        gt_lo = ptx.ld_shared_f32(gt_lane + mt * 64)
        gt_hi = ptx.ld_shared_f32(gt_lane + mt * 64 + 32)
        gb_lo = ptx.pack_bf16x2_i32(gt_lo, gt_lo)
        gb_hi = ptx.pack_bf16x2_i32(gt_hi, gt_hi)
        a_kr = (
            ptx.mul_bf16x2(a_ki[0], gb_lo) & m0,
            ptx.mul_bf16x2(a_ki[1], gb_hi) & m0,
            ptx.mul_bf16x2(a_ki[2], gb_lo) & m1,
            ptx.mul_bf16x2(a_ki[3], gb_hi) & m1,
        )
        for pair in range(N_TILES // 2):
            old = ptx.ldmatrix_x4_trans(step.tile + ln.frag_off(mt, pair))
            for e in range(2):
                nt = 2 * pair + e
                w = ptx.mma_bf16_16816(a_kr, ubi[nt], [zero_f] * 4)
                n_lo, n_hi = state_tile_update(old[2 * e], old[2 * e + 1], gt_lo, gt_hi, w)
                for half, val in ((0, n_lo), (1, n_hi)):
                    _store_registers(
                        lane_addr + state_offset(mt, nt, half) * esz,
                        ptx.movmatrix_trans(val),
                        esz,
                    )


def _final_state(step, ub, dsts, esz):
    """The state after all t tokens, k-tile by k-tile in place in the tile (ldmatrix.trans old,
    W = kr^T . U, fma, stmatrix.trans new: recurrence.py's update with the record's kr and gt),
    then this warp's 32 rows -> every address of dsts (coalesced 16-byte stores)."""
    ln, zero_f = step.ln, step.zero_f
    gt_lane = step.rec + OFF_GT + ln.g * 4
    for mt in range(8):
        a_krt = ptx.ldmatrix_x4_trans(step.rec + OFF_KR + ln.krt_off(mt))
        gt_lo = ptx.ld_shared_f32(gt_lane + mt * 64)
        gt_hi = ptx.ld_shared_f32(gt_lane + mt * 64 + 32)
        for pair in range(N_TILES // 2):
            addr = step.tile + ln.frag_off(mt, pair)
            old = ptx.ldmatrix_x4_trans(addr)
            new = []
            for e in range(2):
                w = ptx.mma_bf16_16816(a_krt, ub[2 * pair + e], [zero_f] * 4)
                new += list(state_tile_update(old[2 * e], old[2 * e + 1], gt_lo, gt_hi, w))
            ptx.stmatrix_x4_trans(addr, new)
    ptx.warp_sync()  # the warp's new rows visible to all its lanes
    copy_tile_rows_out(step.tile, ln.lane, ln.col_w, WARP_COLS, dsts, esz)


# ------------------------------------------------------------------ build side
def decode_args(state_dtype: str = "bf16", intermediate: bool = False, grouped: bool = False):
    """Fake arguments of KdaDecode.__call__ (N, t, H, P dynamic; grouped: q and k on their own
    head count Hk)."""
    n, t, heads, rows = (symbol(s) for s in ("N", "t", "H", "P"))
    qk_heads = symbol("Hk") if grouped else heads
    sdt = STATE_DTYPES[state_dtype]
    args = [
        fake_tensor(BFloat16, (n, t, qk_heads, D), 16),  # q
        fake_tensor(BFloat16, (n, t, qk_heads, D), 16),  # k
        fake_tensor(BFloat16, (n, t, heads, D), 16),  # v
        fake_tensor(BFloat16, (n, t, heads, D), 16),  # g
        fake_tensor(BFloat16, (n, t, heads), 2),  # beta
        fake_tensor(Float32, (heads,), 4),  # A_log
        fake_tensor(Float32, (heads, D), 16),  # dt_bias
        fake_tensor(Int32, (n,), 4),  # state_indices
        fake_tensor(sdt, (rows, heads, D, D), 16),  # pool (updated in place)
        fake_tensor(BFloat16, (n, t, heads, D), 16),  # out
    ]
    if intermediate:
        args.append(fake_tensor(sdt, (n, t, heads, D, D), 16))  # states
    return (*args, Float32(1.0), Float32(-5.0), fake_stream())


def compile_kernel(
    inverse: str = "stable",
    arch: str = "sm_90a",
    *,
    state_dtype: str = "bf16",
    intermediate: bool = False,
    grouped: bool = False,
    dump_dir: str | None = None,
):
    """The fused decode kernel (grouped: for q, k on fewer heads than v) compiled for `arch`
    (compile_utils.compile_for_arch)."""
    return compile_for_arch(
        KdaDecode(inverse, state_dtype, intermediate, grouped),
        decode_args(state_dtype, intermediate, grouped),
        arch,
        dump_dir=dump_dir,
    )
