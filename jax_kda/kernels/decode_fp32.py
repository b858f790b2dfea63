"""Fused decode of the fp32 numerics mode (serving): the fp32 prepare and ONE chunk step of the fp32
recurrence for t <= 16 tokens per sequence, the state read from and written back to a row of a
state pool, in one launch.

Interface (KdaDecodeFp32(state_dtype, intermediate, grouped)): the operands of decode.KdaDecode,
  __call__(mQ, mK, mV, mG: bf16 [N, t, H, 128], mBeta: bf16 [N, t, H], mALog: f32 [H],
           mDtBias: f32 [H, 128], mStateIndices: i32 [N], mPool: bf16|f32 [P, H, 128, 128],
           mOut: bf16 [N, t, H, 128], [mStates: bf16|f32 [N, t, H, 128, 128] only with
           intermediate=True], scale: Float32, lower_bound: Float32, stream)
  N, t, H, P dynamic; the handler guarantees 1 <= t <= 16 (the kernel clamps to [0, 16] and does
  nothing for t = 0). mPool is updated in place (aliased input -> output by the handler).
Per (n, h), row = state_indices[n]:
  - row outside [0, P): padding slot. No pool access; out rows r < t are +0; with intermediate,
    states[n, 0 .. t-1, h] are +0.
  - otherwise exactly what prepare_fp32 + recurrence_fp32's pool kernel (any block_v) compute on
    the same t tokens as one sequence of length t (rows t..15 zero tokens) with initial state
    pool[row, h] (a bf16 pool widened exactly): out rows r < t bitwise, pool[row, h] <- the final
    state (f32 as computed; a bf16 pool rounded to nearest even). With intermediate,
    states[n, i, h] (i < t) = the final state of those kernels on the first i + 1 tokens;
    states[n, t-1] = the new pool row.

Bitwise equality comes from running the same device code. The record is built by
prepare_fp32.KdaPrepareFp32's own phases (build_record with fused=True: the same instructions,
its stores aimed at shared memory, its CTA barriers a named barrier of warps 0-3), and the step is
recurrence_fp32's chunk arithmetic piece by piece: P and Oq as two key halves of four k-blocks,
each term its own chain from zero (p_oq_step, half_sums, add_halves: the k_split=1 warp layout of
that kernel, whose bits every layout shares), u_operands and big_u_operands (its
u_to_b_operands in two, so that intermediate states can mask split(u)), three_term_product for
Mqk.U and W, out_pair, state_tile_update. Where recurrence_fp32 keeps the state in registers in the
accumulator layout, this kernel reads the same elements from a shared-memory copy of the pool row
(read_state_tile) each time it needs them: the values are the same bits, and the state costs
no registers.

CTA shape: 256 threads (8 warps) per (n, h), grid (N, H, 1). Warp w owns value columns 16 w ..
16 w + 15 (two n-tiles) for the whole step, all eight k-tiles of them (the in-warp key halves of
recurrence_fp32's k_split=1 layout). Warps 0-3 build the record (the fp32 prepare's phases are
written for 128 threads); meanwhile warps 4-7 copy the pool row into shared memory with cp.async
(coalesced 16-byte copies, one commit group). One CTA barrier then makes record and state
visible, and all eight warps run the step.

Shared memory (smem_layout): the state tile (f32 [128 v, 128 k], 64 KB, 16-byte granule kg of row
v at kg ^ (v % 8); bf16 pools: bf16 [128, 128], 32 KB, the same swizzle on 8-value granules, the
tile of decode.py), the 23,040-byte record, then the prepare's operand area
(prepare_fp32.SMEM_BYTES). A lane's fragment reads of one register index touch eight
granules in distinct bank groups: conflict free. 113,856 bytes (f32) / 81,088 (bf16): two CTAs
per SM, the launch asks for registers to match (<= 128 a thread).

Per warp after the barrier (valid row):
  1. P and Oq: per k-block the A fragments kd_hi, qd_hi, qd_lo (ldmatrix from the record), per
     n-tile the state tile from shared memory, split to S_hi / S_lo B operands (movmatrix.trans),
     five MMAs; key half 0 summed into P_0, Oq_0 after k-block 3.
  2. u, U (INV . u, three terms), out = bf16(Oq + Mqk . U) for rows < t (4-byte stores).
  3. Per k-tile: W = kr^T . U (three terms), S = fma(S, gt, W) on the tile re-read from shared
     memory, stored to the pool row from registers (f32: eight lanes write 32 contiguous bytes).
The pool row is read completely before the barrier and written only after it, by this CTA only.

Intermediate states. A prefill on the first i + 1 tokens has zero tokens in rows i+1..15. Its
record differs from the t-token one in more than gt and kr (as in the bf16 mode, decode.py):
the prepare decays L's and Mqk's operands relative to row 7's cumulative gate, which a prefix
shorter than 8 tokens does not share, so INV differs too. So after the step above, for each
i < t - 1 warps 0-3 rebuild the record in place for n_valid = i + 1 (the same phases: bitwise
that prefill's record), one CTA barrier before (everyone is done with the old record) and one
after. What the step computed on rows <= i is that prefill's: kd, qd and b do not depend on the
length (the gate's running sums G_r, r <= i, add the same values in the same order), so P's and
u's rows <= i are the same bits (an MMA's output row depends only on its own A row), and that
prefill's u rows > i are masked to +0. So state i = fma(S, gt', kr'^T . U') with gt', kr', INV'
of the rebuilt record and U' = INV' . (split(u) with rows > i zeroed: prefix_rows), stored to
states[n, i] (t - 1 more prepares per CTA; no P, Oq or out again).

Compiled (ptxas of nvidia-cutlass-dsl 4.8.1, sm_90a): 128 registers, no local memory; SASS per
warp: the prepare phases ~2,200 instructions (warps 0-3), the step ~840 static, ~1,330 executed
(the k-tile loop body ~70, 6 HMMA); per CTA ~19K warp instructions, 2.4x the bf16-mode decode's
~7.8K. Predicted from the issue rate the bf16-mode decode reached (one instruction per 2.4
cycles per scheduler): ~600 us at 1024 x 12, against a 375 us floor for the f32 state's read +
write at 4.3 TB/s. Measured (H200): 518 us in Nsight Compute, 554 us per step in a jitted chain,
the same on a bf16 pool (552 us): instruction issue and latency bound it, not bandwidth (DRAM
64 % busy, 16 warps per SM, no eligible warp 57 % of cycles); the prepare phases run on half the
warps and are ~45 % of the instructions.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, Uint8, cute
from cutlass.cutlass_dsl import Constexpr
from cutlass.memory import SmemAllocator

from . import ptx
from .compile_utils import compile_for_arch
from .decode import (
    DecodeHost,
    DecodeRows,
    DecodeStatesHost,
    Lane,
    check_state_dtype,
    decode_args,
    intermediate_masks,
    lane_token_operands,
    zero_padding_slot,
)
from .prepare_common import qk_head_of
from .prepare_fp32 import NUM_THREADS as PREPARE_THREADS
from .prepare_fp32 import SMEM_BYTES as PREPARE_SMEM_BYTES
from .prepare_fp32 import KdaPrepareFp32
from .recurrence_common import (
    CHUNK,
    FP32_RECORD_BYTES,
    OFF32_INV_HI,
    OFF32_INV_LO,
    STATE_ELEM_BYTES,
    D,
    ldmatrix_small_offset,
)
from .recurrence_fp32 import (
    add_halves,
    big_u_operands,
    gt_rows,
    half_sums,
    krt_operands,
    mqk_operands,
    out_pair,
    p_oq_operands,
    p_oq_step,
    split_to_b_operands,
    state_tile_update,
    sum_terms,
    three_term_product,
    u_operands,
)

NUM_THREADS = 256
NUM_WARPS = NUM_THREADS // 32
N_TILES = 2  # 8-column n-tiles per warp: warp w owns value columns 16 w .. 16 w + 15
WARP_COLS = 8 * N_TILES
HALF_TILES = 4  # k-blocks per key half of P and Oq
COPY_THREADS = NUM_THREADS - PREPARE_THREADS  # warps 4-7 copy the pool row
CTAS_PER_SM = 2
assert NUM_WARPS * WARP_COLS == D


def smem_layout(state_dtype):
    """(record offset, prepare area offset, total bytes) of a CTA's shared memory; the state tile
    starts at 0."""
    record = D * D * STATE_ELEM_BYTES[state_dtype]
    prepare = record + FP32_RECORD_BYTES
    assert record % 128 == 0 and prepare % 128 == 0
    return record, prepare, prepare + PREPARE_SMEM_BYTES


def state_tile_offset(v, k, esz):
    """Byte offset of state element (value row v, key k) in the swizzled tile: 16-byte granule
    kg = k // (16 / esz) of row v at granule kg ^ (v % 8)."""
    shift = 2 if esz == 4 else 3  # log2 of the values per granule
    return v * (D * esz) + (((k >> shift) ^ (v & 7)) << 4) + (k & ((1 << shift) - 1)) * esz


def copy_units(tid, esz):
    """[(shared offset, global offset)] of the 16-byte units copy thread tid (0 .. COPY_THREADS -
    1) moves: unit tid + COPY_THREADS i (row v = r0 + rows i, granule kg, r0 and kg from tid),
    consecutive threads on consecutive global bytes. v % 8 = (r0 + rows i) % 8 repeats with i
    every 8 / rows units, so the offsets are one or two thread bases plus immediates."""
    per_row = D * esz // 16  # units per state row: 32 (f32), 16 (bf16)
    rows = COPY_THREADS // per_row  # rows per step: 4, 8
    units = D * per_row // COPY_THREADS
    row_bytes = D * esz
    r0 = tid >> (per_row.bit_length() - 1)
    kg = tid & (per_row - 1)
    bases = [r0 * row_bytes + ((kg ^ ((r0 + rows * j) & 7)) << 4) for j in range(8 // rows)]
    return [(bases[i % len(bases)] + i * rows * row_bytes, tid * 16 + i * COPY_THREADS * 16)
            for i in range(units)]


class KdaDecodeFp32(DecodeHost):
    """Host entry + device kernel of the fp32 mode's fused decode (module docstring).
    KdaDecodeFp32(state_dtype, intermediate=True) constructs KdaDecodeFp32States, whose __call__
    also takes mStates."""

    num_threads = NUM_THREADS
    # registers for CTAS_PER_SM CTAs; the carveout hint asks for the largest shared-memory
    # configuration (given here, the DSL would otherwise ask a GPU)
    launch_options = {"min_blocks_per_mp": CTAS_PER_SM, "preferred_smem_carveout": 100}

    def __new__(cls, state_dtype: str = "f32", intermediate: bool = False,
                grouped: bool = False):
        if intermediate and cls is KdaDecodeFp32:
            cls = KdaDecodeFp32States
        return super().__new__(cls)

    def __init__(self, state_dtype: str = "f32", intermediate: bool = False,
                 grouped: bool = False):
        check_state_dtype(state_dtype)
        self.state_dtype = state_dtype
        self.intermediate = intermediate
        self.grouped = grouped  # q and k on fewer heads (decode.KdaDecode)
        self.esz = STATE_ELEM_BYTES[state_dtype]
        self.record_offset, self.prepare_offset, self.smem_bytes = smem_layout(state_dtype)
        self.prep = KdaPrepareFp32(grouped, fused=True)

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
        ESZ: Constexpr = self.esz
        STATES: Constexpr = self.intermediate
        PREPARE_WARPS: Constexpr = PREPARE_THREADS // 32
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
        region = SmemAllocator().allocate_array(Uint8, self.smem_bytes, byte_alignment=128)
        tile = region.toint()
        rec = tile + self.record_offset
        row_bytes = Int64(num_heads) * (D * 2)
        tok_base = (Int64(n) * Int64(t) * Int64(num_heads) + Int64(head)) * (D * 2)
        # states[n, i, h] of [N, t, H, 128, 128]: states_n + i * states_stride
        states_n = None
        states_stride = Int64(num_heads) * (D * D * ESZ)
        if cutlass.const_expr(STATES):
            states_n = mStates.iterator.toint() + (
                Int64(n) * Int64(t) * Int64(num_heads) + Int64(head)) * (D * D * ESZ)
        rows = DecodeRows(n, head, mBeta, qk_head)
        record = lambda: cute.make_tensor(  # noqa: E731 - build_record makes it where it wants it
            region + self.record_offset, cute.make_layout(FP32_RECORD_BYTES))
        if n_valid > 0:  # t >= 1 (the handler guarantees it): the token tensors are not empty
            # the step's token operands and the pool row first: nothing here waits for them
            ln = Lane(lane, warp_idx * WARP_COLS)
            io = lane_token_operands(
                ln, mV, mBeta, mOut, tok_base, row_bytes, n, t, num_heads, head, n_valid,
                N_TILES,
            )
            row = ptx.ld_global_b32_if(
                mStateIndices.iterator.toint() + Int64(n) * 4, Int32(0), Int32(1)
            )
            valid_row = (row >= 0) & (row < mPool.shape[0])
            pool_head = (
                mPool.iterator.toint()
                + (Int64(row) * Int64(num_heads) + Int64(head)) * (D * D * ESZ)
            )
            if warp_idx < PREPARE_WARPS:
                self.prep.build_record(rows, mQ, mK, mG, mALog, mDtBias, head, n_valid, record,
                                       region + self.prepare_offset, scale, lower_bound, tid,
                                       warp_idx, lane)
            if warp_idx >= PREPARE_WARPS:
                if valid_row:
                    copy_state(tid - PREPARE_THREADS, tile, pool_head, ESZ)
                ptx.cp_async_wait(0)
            cute.arch.sync_threads()  # the record and the state tile are complete
            if valid_row:
                step = DecodeStepFp32(ln, rec, tile, io, n_valid, ESZ)
                u_ops, oq = p_oq_u(step)
                ub = big_u(step, u_ops)
                store_out(step, ub, oq)
                final = [pool_head]
                if cutlass.const_expr(STATES):
                    final.append(states_n + Int64(n_valid - 1) * states_stride)
                for mt in cutlass.range(8, unroll=1):
                    update_state(step, ub, mt, final)
                if cutlass.const_expr(STATES):
                    # state i < t - 1: the final state of a prefill on tokens 0..i, with that
                    # prefill's own record (rebuilt in place), u's rows > i masked (the step's
                    # other values on rows <= i are the prefill's: module docstring)
                    for i in range(n_valid - 1):
                        cute.arch.sync_threads()  # every warp is done with the record
                        if warp_idx < PREPARE_WARPS:
                            self.prep.build_record(rows, mQ, mK, mG, mALog, mDtBias, head, i + 1,
                                                   record, region + self.prepare_offset, scale,
                                                   lower_bound, tid, warp_idx, lane)
                        cute.arch.sync_threads()
                        ub_i = big_u(step, prefix_rows(step, u_ops, i))
                        dst = [states_n + Int64(i) * states_stride]
                        for mt in cutlass.range(8, unroll=1):
                            update_state(step, ub_i, mt, dst)
            if not valid_row:
                # padding slot: no pool access; out rows r < t and the per-token states are +0
                zero_padding_slot(tid, NUM_THREADS, mOut.iterator.toint() + tok_base, row_bytes,
                                  n_valid, states_n, states_stride, ESZ)


class KdaDecodeFp32States(DecodeStatesHost, KdaDecodeFp32):
    """KdaDecodeFp32(..., intermediate=True): also writes states[n, i] after every token i."""


# ----------------------------------------------------------------------------------------------
# Plain trace-time pieces (no dynamic control flow), also run by the CPU tests on kernel_sim
# ----------------------------------------------------------------------------------------------
def copy_state(copy_tid, tile, pool_head, esz):
    """The pool row -> the swizzled tile: cp.async.cg of 16 bytes per unit (copy_units), one
    commit group."""
    for s_off, g_off in copy_units(copy_tid, esz):
        ptx.cp_async_16_if(tile + s_off, pool_head + g_off, Int32(0), Int32(1))
    ptx.cp_async_commit()


class DecodeStepFp32:
    """Per-warp constants of the chunk step (a plain bag), with the lane's addresses of the state
    tile at shared address `tile` (StateTile)."""

    def __init__(self, ln, rec, tile, io, n_valid, esz):
        self.ln, self.rec = ln, rec
        self.io, self.n_valid, self.esz = io, n_valid, esz
        self.zero_f = Float32(0.0)
        self.state = StateTile(ln, tile, esz)


class StateTile:
    """The lane's addresses of its state elements: register i of recurrence_fp32's accumulator
    tile (k-tile mt, n-tile nt) is element (v, k) = (col_w + 8 nt + 2 t4 + e, 16 mt + g + 8 h),
    e = i % 2, h = i // 2. In the swizzled tile (state_tile_offset) v % 8 = 2 t4 + e is a lane
    constant, so the granule (k // per) ^ (v % 8) is a compile-time part of mt and h XORed into
    a lane base: f32 (4 keys a granule): 8 (mt >> 1) + ((4 (mt & 1) + 2 h) ^ y_e), y_e = (g >> 2)
    ^ (2 t4 + e); bf16 (8 keys): 8 (mt >> 2) + ((2 (mt & 3) + h) ^ (2 t4 + e)). The row bases
    are 128-byte aligned, so a base carrying y_e's bits 4..6 takes the compile-time part by one
    XOR; n-tile and mt's high bits are immediates. In the pool row [v, k] the lane's elements
    are the lane's offset plus immediates."""

    def __init__(self, ln, tile, esz):
        self.esz = esz
        self.smem = []  # [e]
        for e in range(2):
            x = 2 * ln.t4 + e  # v % 8
            row = tile + (ln.col_w + x) * (D * esz)
            if esz == 4:
                self.smem.append(row + ((((ln.g >> 2) ^ x) << 4) | ((ln.g & 3) * 4)))
            else:
                self.smem.append(row + ((x << 4) | (ln.g * 2)))
        # element (col_w + 2 t4, g) of a [128 v, 128 k] state in global memory
        self.lane_offset = (Int64(ln.col_w + 2 * ln.t4) * D + Int64(ln.g)) * esz

    def shared_address(self, mt, nt, i):
        h, e = i // 2, i % 2
        if self.esz == 4:
            granule, high = 2 * (mt & 1) + h, (mt >> 1) * 128
        else:
            granule, high = 2 * (mt & 3) + h, (mt >> 2) * 128
        step = 2 if self.esz == 4 else 1  # f32: the compile-time part is 2 (2 (mt & 1) + h)
        return (self.smem[e] ^ ((step * granule) << 4)) + (nt * 8 * D * self.esz + high)

    def pool_offset(self, mt, nt, i):
        """Bytes from the lane's element (lane_offset) of register i's element."""
        return ((nt * 8 + i % 2) * D + 16 * mt + 8 * (i // 2)) * self.esz


def read_state_tile(step, mt, nt, again=False):
    """The f32 accumulator tile (k-tile mt, n-tile nt) of recurrence_fp32's state registers,
    read from the shared tile (bf16 tiles widened exactly). again: a re-read, as volatile loads
    (ptxas would otherwise keep the first read's values live in between)."""
    st = step.state
    out = []
    for i in range(4):
        addr = st.shared_address(mt, nt, i)
        if step.esz == 4:
            load = ptx.ld_shared_f32_volatile if again else ptx.ld_shared_f32
            out.append(load(addr))
        else:
            load = ptx.ld_shared_u16_volatile if again else ptx.ld_shared_u16
            out.append(ptx.bf16x2_lo_to_f32(load(addr)))
    return out


def p_oq_u(step):
    """P = kd . S^T and Oq = qd . S^T as recurrence_fp32 computes them (two key halves of four
    k-blocks, five term chains each from zero) and u = (v - P) b, split with the rows >= t
    zeroed (recurrence_fp32.u_operands). Returns ((u_hi, u_lo) B operands per n-tile, Oq per
    n-tile)."""
    ln, zero_f = step.ln, step.zero_f
    zero4 = [zero_f] * 4
    p, oq = [], []
    for nt in range(N_TILES):  # one n-tile at a time: 28 accumulators live, not 56
        chains = [zero4] * 5
        part = None
        for kb in range(8):
            if kb == HALF_TILES:  # key half 0 complete: P_0, Oq_0
                part = half_sums(chains)
                chains = [zero4] * 5
            b_hi, b_lo = split_to_b_operands(read_state_tile(step, kb, nt))
            chains = p_oq_step(p_oq_operands(step.rec, ln.lane, kb), b_hi, b_lo, chains)
        p.append(add_halves(part[0], sum_terms(chains[0], chains[1])))
        oq.append(add_halves(part[1], sum_terms(*chains[2:])))
    io = step.io
    b_in = [ptx.sigmoid_exp2(ptx.bf16x2_lo_to_f32(io.beta_bits[half])) for half in range(2)]
    return [u_operands(p[nt], io.v_in[nt], b_in, io.row_mask) for nt in range(N_TILES)], oq


def big_u(step, u_ops):
    """U = INV . u (recurrence_fp32.big_u_operands, INV from the record) per n-tile: (U_hi, U_lo)
    B operands."""
    small_off = ldmatrix_small_offset(step.ln.lane)
    a_inv = (ptx.ldmatrix_x4(step.rec + OFF32_INV_HI + small_off),
             ptx.ldmatrix_x4(step.rec + OFF32_INV_LO + small_off))
    return [big_u_operands(a_inv, ops, step.zero_f) for ops in u_ops]


def prefix_rows(step, u_ops, i):
    """split(u)'s B operands with the chunk rows > i zeroed: what a prefill on tokens 0..i has
    (its rows past the end are masked to 0, rows <= i are these: module docstring)."""
    m0, m1 = intermediate_masks(step.ln, i)
    return [((u_hi[0] & m0, u_hi[1] & m1), (u_lo[0] & m0, u_lo[1] & m1))
            for u_hi, u_lo in u_ops]


def store_out(step, ub, oq):
    """out = bf16(Oq + Mqk . U) for the rows < t (4-byte stores)."""
    a_mqk = mqk_operands(step.rec, step.ln.lane)
    io = step.io
    for nt in range(N_TILES):
        m_acc = three_term_product(a_mqk[0], a_mqk[1], ub[nt][0], ub[nt][1], step.zero_f)
        for half in range(2):
            ptx.st_global_b32_if(io.out_addr[nt][half], out_pair(oq[nt], m_acc, half),
                                 io.rows[half], step.n_valid)


def update_state(step, ub, mt, bases):
    """k-tile mt: W = kr^T . U, S = fma(S, gt, W) (recurrence_fp32.state_tile_update; kr, gt from
    the record) on the tile's values, stored to every [128 v, 128 k] state at `bases` (f32 as
    computed, bf16 rounded to nearest even) from registers: for one register index, eight lanes
    cover 8 consecutive keys of a row. The kernel runs the k-tiles as a loop that is not
    unrolled: unrolled, ptxas starts the W products of later tiles early and spills at 128
    registers."""
    ln, st = step.ln, step.state
    a_krt = krt_operands(step.rec, ln.lane, mt)
    gt2 = gt_rows(step.rec, ln.lane, mt)
    for nt in range(N_TILES):
        w = three_term_product(a_krt[0], a_krt[1], ub[nt][0], ub[nt][1], step.zero_f)
        s4 = state_tile_update(read_state_tile(step, mt, nt, again=True), gt2, w)
        for base in bases:
            for i in range(4):
                addr = base + st.lane_offset + st.pool_offset(mt, nt, i)
                if step.esz == 4:
                    ptx.st_global_f32(addr, s4[i])
                else:
                    ptx.st_global_u16(addr, ptx.pack_bf16x2(s4[i], Float32(0.0)))


# ------------------------------------------------------------------ build side
def compile_kernel(arch: str = "sm_90a", *, state_dtype: str = "f32", intermediate: bool = False,
                   grouped: bool = False, dump_dir: str | None = None):
    """The fp32 mode's fused decode kernel for a `state_dtype` pool (intermediate: also the state
    after every token; grouped: q, k on fewer heads than v) compiled for `arch`
    (compile_utils.compile_for_arch)."""
    return compile_for_arch(
        KdaDecodeFp32(state_dtype, intermediate, grouped),
        decode_args(state_dtype, intermediate, grouped),
        arch,
        dump_dir=dump_dir,
    )

