"""KDA recurrence (docs/numerics.md, section 5 "Recurrence"), column split, state resident in
registers.

Task = (value-column slice, head, sequence), grid (128 / block_v, H, N); no communication
between CTAs. Every warp owns CW = 8 * NT consecutive value columns and keeps its state slice
S^T[128 (k), CW (v)] in registers for the whole sequence, bf16, in the m16n8k16 accumulator layout
(ptx.py's module docstring writes the fragment layouts out): for k-tile mt (16 k) and n-tile nt
(8 columns), register state[mt, nt, 0] holds S^T[16mt + g][8nt + 2t, 2t+1] and state[mt, nt, 1]
holds S^T[16mt + 8 + g][...]. movmatrix.trans of these two registers is exactly the B operand of
k-block mt of the next chunk's kd . S^T / qd . S^T, so the state never goes through shared memory.

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

The kernel body is assembled from plain trace-time pieces (recurrence_common.cta_setup,
_prologue_loads, _prologue, _chunk_step, u_to_b_operand, out_add, state_tile_update, ...) that
the kernels call in a fixed order, so a variant that reuses them emits the same instructions for
them; the fused decode kernel (decode.py) reuses the chunk-step arithmetic.

Serving variant (KdaRecurrence(block_v, state_dtype, serving=True), class KdaRecurrencePool):
states in a pool, bf16 or f32, updated in place, and checkpoints. Host __call__(mV, mBeta,
mWorkspace, mCuSeqlens, mStateIndices i32 [N], mCheckpointOffsets i32 [N+1], mPool
(bf16|f32) [P, H, 128, 128], mOut, mCheckpoints (bf16|f32) [C, H, 128, 128],
checkpoint_chunks: Int32, stream), grid as above. Per CTA, row = state_indices[seq]:
  - row outside [0, P): a padding slot. No pool or checkpoint access; the sequence's out rows
    of this CTA's columns are written as zeros (one 16-byte store per thread and chunk, no
    workspace read).
  - otherwise the initial state is pool[row, head] and the final state goes back there. The
    CTA's slice (block_v rows of 128 values, contiguous) travels through shared memory both ways
    with coalesced 16-byte global accesses: in, every thread loads its 16-byte units (all loads
    issued first; f32 units are rounded to bf16 RN, cvt.rn.bf16x2.f32, as the prefill's Python
    side rounds an f32 initial state), stores them into a swizzled bf16 tile (granule kg of row v
    at kg ^ (v % 8), recurrence_common.state_smem_offset), one CTA barrier, each warp reads its
    registers with ldmatrix.trans (state_frag_offset: 4 NT x4 loads, conflict free). The tile
    sits at ring stage LOOKAHEAD, which the prologue does not fill, so the state loads overlap
    the landing of chunks 0..LOOKAHEAD-1 (pool_smem_bytes: for block_v 64 / 128 the tile
    reaches past the ring, + 0.4 / 14.4 KB). Out, after the loop (cp.async drained, one CTA
    barrier: the ring is free): each warp writes its registers into its rows of a tile at the
    ring's start with stmatrix.trans, bar.warp.sync, and copies its rows out with 16-byte loads /
    stores (f32: 8-byte loads widened exactly to 16-byte stores). The pool row is read before it
    is written by the same CTA and no other CTA touches those elements (duplicate indices are
    the caller's problem and stay in bounds). The pool row index waits in shared memory (16
    bytes past the tile) instead of a register across the chunk loops.
  - checkpoints: with checkpoint_chunks = n16 > 0 the chunk loop runs in segments of n16 chunks
    (an outer loop; the inner loop's body is _chunk_step, the prefill kernel's); after segment j,
    if chunks remain and row = checkpoint_offsets[seq] + j lies in [0, C), the state (bf16;
    widened for f32) goes to checkpoints[row, head] (_store_checkpoint): one uniform branch,
    issued while the segment's last P(c+1) MMAs are in flight, each state register as its
    movmatrix.trans, so a store of four lanes covers 16 (bf16) / 32 (f32) contiguous bytes of a
    state row. Checkpoint j is bitwise the final state of a prefill on the sequence's first
    (j + 1) * 16 * n16 tokens (same chunks, same instructions).
Out and the final state are bitwise those of the prefill kernel on the same inputs (with the
f32 initial state rounded as above); checked on an H200 (2026-12-01, block_v 16 / 32 / 128 bf16
and 32 / 64 f32 pools, checkpoint_chunks 0 / 1 / 2, sequences of 0..100 tokens, a padding slot,
one checkpoint row past C): out, pool rows and checkpoints equal prefills (checkpoints: of the
truncated sequences) bit for bit, padding out rows zero, untouched rows unchanged. SASS
(sm_90a): the inner chunk loop is 313 / 309 / 463 / 459 instructions at block_v 16 / 32 / 64 /
128 (prefill kernel: 307 / 300 / 466 / 468);
registers 156 / 156 / 204 / 202 (f32 pools: 162 / 160 / 204 / 202; sm_100a: 152 at block_v 16,
234 at block_v 128), no local memory; shared memory pool_smem_bytes + 16: 72.3 / 74.9 / 80.4 /
105.0 KB.
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
    STATE_DTYPES,
    STATE_ELEM_BYTES,
    D,
    acc_col,
    acc_row,
    beta_bits,
    checkpoint_segments,
    cta_setup,
    ldmatrix_a_offset,
    ldmatrix_krt_offset,
    ldmatrix_small_offset,
    recurrence_args,
    recurrence_pool_args,
    state_copy_unit,
    state_frag_count,
    state_frag_offset,
    state_frag_regs,
    state_smem_offset,
    zero_padding_out,
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
    """Index of the packed register holding
    S^T[16mt + acc_row(lane, half)][8nt + acc_col(lane)..+1]."""
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
    """Host entry + device kernel of the column-split chunk recurrence (docs/numerics.md, 5).

    Algorithm: one CTA per (value-column slice, head, sequence), grid (128 / block_v, H, N); the
    CTA walks its sequence's chunks in order, keeping its state slice S^T[128 (k), block_v (v)]
    in registers (bf16, in the m16n8k16 accumulator layout) and running the software pipeline of
    the module docstring; no CTA talks to another, so every slice width gives the same bits.
    Layouts: v, out bf16 [T_total, H, 128]; beta bf16 [T_total, H]; workspace uint8
    [H, S, 13824] (docs/kernel_abi.md: chunk j of sequence n in slot cu[n] // 16 + n + j);
    cu_seqlens int32 [N + 1]; states bf16 [N, H, 128, 128] (state[n, h, v, k]).
    Constraints: block_v in contract.COLUMN_SPLITS (warps and n-tiles per warp: warp_split);
    head dim 128; T_total, H, N, S dynamic, int32-sized; 16-byte aligned buffers; cu_seqlens
    values are clamped (recurrence_common.sequence_bounds).
    KdaRecurrence(block_v, state_dtype, serving=True) constructs the serving variant,
    KdaRecurrencePool, whose host __call__ takes state pools and checkpoints instead."""

    def __new__(cls, block_v: int = 32, state_dtype: str = "bf16", serving: bool = False):
        if serving and cls is KdaRecurrence:
            cls = KdaRecurrencePool
        return super().__new__(cls)

    def __init__(self, block_v: int = 32, state_dtype: str = "bf16", serving: bool = False):
        if state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"state_dtype must be one of {tuple(STATE_DTYPES)}, got {state_dtype!r}")
        if state_dtype != "bf16" and not serving:
            raise ValueError(
                "the prefill variant takes bf16 states; state_dtype='f32' needs serving=True")
        self.block_v = block_v
        self.state_dtype = state_dtype
        self.serving = serving
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
        cta = cta_setup(self, mV, mBeta, mWorkspace, mCuSeqlens, mOut)
        state_off = (Int64(cta.seq) * Int64(cta.num_heads) + Int64(cta.head)) * (D * D)
        s0_base = mState0.iterator.toint() + state_off * 2
        sT_base = mStateT.iterator.toint() + state_off * 2
        ring = (
            SmemAllocator()
            .allocate(STAGES * self.stage_bytes, byte_alignment=128)
            .toint()
        )
        # ---- initial state -> registers, accumulator layout (16-bit loads, once) ----
        state = _state_registers(self)
        _load_state_u16(cta, state, s0_base)
        regs = _loop_registers(self)
        if cta.num_chunks > 0:
            _prologue_loads(cta, ring)
            _prologue(cta, ring, state, regs)
        for c in range(cta.num_chunks):
            _chunk_step(cta, ring, state, regs, c)
        ptx.cp_async_wait(0)  # no copy may still target this CTA's shared memory at exit
        # ---- final state (also for zero-length sequences: the initial state) ----
        _store_state_u16(cta, state, sT_base)


# ----------------------------------------------------------------------------------------------
# The pieces of the kernel body, plain trace-time Python (no dynamic control flow inside: the
# kernels keep the `if num_chunks > 0` and the chunk loop), so that every variant emits the same
# instructions in the same order for the same piece.
# ----------------------------------------------------------------------------------------------
def _state_registers(rec):
    """The state slice S^T[128, 8 * NT] of this warp, bf16 pairs in the accumulator layout."""
    return cute.make_rmem_tensor(cute.make_layout(8 * rec.n_tiles * 2), Int32)


def _load_state_u16(cta, state, s0_base):
    """Initial state -> registers with 16-bit loads (the prefill variant)."""
    NT = cta.n_tiles
    for mt in range(8):
        for nt in range(NT):
            for half in range(2):
                k = mt * 16 + acc_row(cta.lane, half)
                j = cta.col_cta + cta.col_w + nt * 8 + cta.t2
                addr = s0_base + (Int64(j) * D + Int64(k)) * 2  # state[n, h, j, k]
                lo = ptx.ld_global_u16(addr)
                hi = ptx.ld_global_u16(addr + D * 2)  # column j + 1
                state[state_reg(mt, nt, half, NT)] = lo | (hi << 16)


def _store_state_u16(cta, state, sT_base):
    """Final state registers -> global with 16-bit stores (the prefill variant)."""
    NT = cta.n_tiles
    for mt in range(8):
        for nt in range(NT):
            for half in range(2):
                k = mt * 16 + acc_row(cta.lane, half)
                j = cta.col_cta + cta.col_w + nt * 8 + cta.t2
                addr = sT_base + (Int64(j) * D + Int64(k)) * 2
                s = state[state_reg(mt, nt, half, NT)]
                ptx.st_global_u16(addr, s)
                ptx.st_global_u16(addr + D * 2, s >> 16)


class _LoopRegs:
    """Registers carried across the chunk loop's back-edge (rmem tensors)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _loop_registers(rec):
    """P(c) and Oq(c) f32 accumulators, carried from iteration c - 1 (or the prologue). They are
    rounded only where used, after the next barrier: packing them before the loop back-edge would
    make every warp wait for its MMA chain before the barrier. Chunk c's shared-memory operands of
    the serial chain (v, bf16(beta), INV, Mqk, kr^T, gt), read in iteration c - 1 (or the
    prologue), before the barrier that ptxas cannot move loads across, so that none of them is
    waited for after P(c) is known."""
    NT = rec.n_tiles
    p_acc = cute.make_rmem_tensor(cute.make_layout(4 * NT), Float32)
    o_acc = cute.make_rmem_tensor(cute.make_layout(4 * NT), Float32)
    zero_f = Float32(0.0)
    n_ops = _chunk_operand_count(NT)
    ops_in = cute.make_rmem_tensor(cute.make_layout(n_ops), Int32)
    gt_in = cute.make_rmem_tensor(cute.make_layout(16), Float32)
    return _LoopRegs(
        p_acc=p_acc, o_acc=o_acc, zero_f=zero_f, n_ops=n_ops, ops_in=ops_in, gt_in=gt_in
    )


def _prologue_loads(cta, ring):
    """The ring's first LOOKAHEAD stages (chunks 0 .. LOOKAHEAD - 1, clamped to the last)."""
    for s in range(LOOKAHEAD):
        _load_stage(
            cta.src, cutlass.min(Int32(s), cta.last_chunk), ring + s * cta.stage_bytes
        )
        ptx.cp_async_commit()


def _prologue(cta, ring, state, regs):
    """Chunk 0 landed; P(0), Oq(0) from the initial state and chunk 0's operands."""
    NT = cta.n_tiles
    lane = cta.lane
    zero_f = regs.zero_f
    ptx.cp_async_wait(LOOKAHEAD - 1)  # chunk 0 has landed (this thread's copies)
    ptx.cta_barrier()  # ... and everybody's
    p0 = [[zero_f] * 4 for _ in range(NT)]
    o0 = [[zero_f] * 4 for _ in range(NT)]
    for kb in range(8):
        a_off = ldmatrix_a_offset(lane, kb)
        a_kd = ptx.ldmatrix_x4(ring + OFF_KD + a_off)
        a_qd = ptx.ldmatrix_x4(ring + OFF_QD + a_off)
        for nt in range(NT):
            b = (
                ptx.movmatrix_trans(state[state_reg(kb, nt, 0, NT)]),
                ptx.movmatrix_trans(state[state_reg(kb, nt, 1, NT)]),
            )
            p0[nt] = ptx.mma_bf16_16816(a_kd, b, p0[nt])
            o0[nt] = ptx.mma_bf16_16816(a_qd, b, o0[nt])
    for nt in range(NT):
        for i in range(4):
            regs.p_acc[nt * 4 + i] = p0[nt][i]
            regs.o_acc[nt * 4 + i] = o0[nt][i]
    ops0, gt0 = _chunk_operands(cta.src, ring, cta.bos, lane, cta.col_w, NT)
    for i in range(regs.n_ops):
        regs.ops_in[i] = ops0[i]
    for i in range(16):
        regs.gt_in[i] = gt0[i]


# ---- one chunk step, piece by piece (also used by the fused decode kernel, decode.py) ----
def u_to_b_operand(p4, v_in, b_in, row_mask, a_inv, zero_f):
    """One n-tile: u = bf16(bf16(v - bf16(P)) * bf16(b)) & row mask (rows past the end: exactly
    0), U = bf16(INV . u); returns U as the B operand (K = the 16 rows) of the next MMAs.
    p4: the 4 f32 accumulators of P; v_in, b_in, row_mask: per half (packed bf16x2 / masks)."""
    u = []
    for half in range(2):
        p = ptx.pack_bf16x2_i32(p4[2 * half], p4[2 * half + 1])
        uu = ptx.mul_bf16x2(ptx.sub_bf16x2(v_in[half], p), b_in[half])
        u.append(uu & row_mask[half])  # rows past the end: exactly 0
    u_acc = ptx.mma_bf16_16816(
        a_inv,
        (ptx.movmatrix_trans(u[0]), ptx.movmatrix_trans(u[1])),
        [zero_f] * 4,
    )
    big_u0 = ptx.pack_bf16x2_i32(u_acc[0], u_acc[1])
    big_u1 = ptx.pack_bf16x2_i32(u_acc[2], u_acc[3])
    return (ptx.movmatrix_trans(big_u0), ptx.movmatrix_trans(big_u1))


def out_add(oq, mq):
    """out = bf16(Oq + bf16(Mqk . U)) from the packed bf16(Oq) and bf16(Mqk . U) (pack_bf16x2 of
    the accumulator pairs of rows acc_row(lane, half))."""
    return ptx.add_bf16x2(oq, mq)


class _Slice:
    """p[base + i] on demand (an rmem tensor read where it is used, as in a plain index)."""

    def __init__(self, tensor, base):
        self.tensor, self.base = tensor, base

    def __getitem__(self, i):
        return self.tensor[self.base + i]


def state_tile_update(s_lo, s_hi, gt_lo, gt_hi, wt):
    """S[j, k] = bf16(fmaf(f32(S[j, k]), gt[k], W[k, j])) for one accumulator tile: s_lo / s_hi
    the packed state rows (k = acc_row(lane, 0 / 1)), gt of those k, wt = kr^T . U's 4 f32."""
    n_lo = ptx.pack_bf16x2_i32(
        ptx.ffma(ptx.bf16x2_lo_to_f32(s_lo), gt_lo, wt[0]),
        ptx.ffma(ptx.bf16x2_hi_to_f32(s_lo), gt_lo, wt[1]),
    )
    n_hi = ptx.pack_bf16x2_i32(
        ptx.ffma(ptx.bf16x2_lo_to_f32(s_hi), gt_hi, wt[2]),
        ptx.ffma(ptx.bf16x2_hi_to_f32(s_hi), gt_hi, wt[3]),
    )
    return n_lo, n_hi


def _chunk_step(cta, ring, state, regs, c):
    """Iteration c of the chunk loop (module docstring: software pipeline)."""
    NT = cta.n_tiles
    lane = cta.lane
    STAGE_BYTES = cta.stage_bytes
    p_acc, o_acc, zero_f = regs.p_acc, regs.o_acc, regs.zero_f
    n_ops, ops_in, gt_in = regs.n_ops, regs.ops_in, regs.gt_in
    src = cta.src
    # Chunk c+1 visible to all; the stage of chunk c-1 is free (refilled further down).
    ptx.cp_async_wait(LOOKAHEAD - 2)
    ptx.cta_barrier()
    nxt = ring + ((c + 1) % STAGES) * STAGE_BYTES
    row_tok0 = cta.bos + c * CHUNK

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
    for kb in range(KD_AHEAD):
        a_next[kb] = _next_chunk_operands(nxt, lane, kb)

    # u = bf16(bf16(v - P) * bf16(b)) (rows past the end: exactly 0); U = bf16(INV . u).
    ub = []
    for nt in range(NT):
        ub.append(
            u_to_b_operand(
                _Slice(p_acc, nt * 4), v_in[nt], b_in, row_mask, a_inv, zero_f
            )
        )

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
    for mt in range(8):
        if mt + KD_AHEAD < 8:
            a_next[mt + KD_AHEAD] = _next_chunk_operands(nxt, lane, mt + KD_AHEAD)
        a_kd, a_qd = a_next[mt]
        gt_lo, gt_hi = gt[mt]
        for nt in range(NT):
            i0 = state_reg(mt, nt, 0, NT)
            i1 = state_reg(mt, nt, 1, NT)
            n_lo, n_hi = state_tile_update(state[i0], state[i1], gt_lo, gt_hi, w[mt][nt])
            state[i0] = n_lo
            state[i1] = n_hi
            b = (ptx.movmatrix_trans(n_lo), ptx.movmatrix_trans(n_hi))
            p1[nt] = ptx.mma_bf16_16816(a_kd, b, p1[nt])
            o1[nt] = ptx.mma_bf16_16816(a_qd, b, o1[nt])
        if mt == 0:
            # out = bf16(Oq + bf16(Mqk . U)), valid rows only, registers -> global;
            # issued in the shadow of the P(c+1) chain.
            for nt in range(NT):
                for half in range(2):
                    mq = ptx.pack_bf16x2_i32(m_acc[nt][2 * half], m_acc[nt][2 * half + 1])
                    tok = row_tok0 + acc_row(lane, half)
                    addr = cta.out_lane[nt] + Int64(tok) * cta.out_row_bytes
                    oq = ptx.pack_bf16x2_i32(
                        o_acc[nt * 4 + 2 * half], o_acc[nt * 4 + 2 * half + 1]
                    )
                    ptx.st_global_b32_if(addr, out_add(oq, mq), tok, cta.eos)
        if mt == 1:
            # refill the stage freed by the barrier (chunk c - 1's) with chunk
            # c + LOOKAHEAD, also in the shadow of the chain
            _load_stage(
                src,
                cutlass.min(c + LOOKAHEAD, cta.last_chunk),
                ring + ((c + LOOKAHEAD) % STAGES) * STAGE_BYTES,
            )
            ptx.cp_async_commit()
        if mt == 2:
            # chunk c+1's operands (on the last chunk: a duplicate, never used)
            ops1, gt1 = _chunk_operands(src, nxt, row_tok0 + CHUNK, lane, cta.col_w, NT)
            for i in range(n_ops):
                ops_in[i] = ops1[i]
            for i in range(16):
                gt_in[i] = gt1[i]
    for nt in range(NT):
        for i in range(4):
            p_acc[nt * 4 + i] = p1[nt][i]
            o_acc[nt * 4 + i] = o1[nt][i]


class KdaRecurrencePool(KdaRecurrence):
    """The serving variant (KdaRecurrence(block_v, state_dtype, serving=True)): initial and final
    states in a pool indexed per sequence, f32 or bf16 state I/O, checkpoints. The chunk loop is
    the prefill kernel's (_chunk_step), so out, final state and checkpoints are bitwise the
    prefill's (module docstring, "Serving variant")."""

    def __init__(self, block_v: int = 32, state_dtype: str = "bf16", serving: bool = True):
        super().__init__(block_v, state_dtype, True)
        self.state_elem_bytes = STATE_ELEM_BYTES[state_dtype]
        self.smem_bytes = pool_smem_bytes(block_v)

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,  # bf16 [T_total, H, 128]
        mBeta: cute.Tensor,  # bf16 [T_total, H]
        mWorkspace: cute.Tensor,  # uint8 [H, S, 13824]
        mCuSeqlens: cute.Tensor,  # int32 [N + 1]
        mStateIndices: cute.Tensor,  # int32 [N]: pool row of each sequence (else padding)
        mCheckpointOffsets: cute.Tensor,  # int32 [N + 1]: first checkpoint row per sequence
        mPool: cute.Tensor,  # bf16 | f32 [P, H, 128, 128] (row, h, v, k), updated in place
        mOut: cute.Tensor,  # bf16 [T_total, H, 128]
        mCheckpoints: cute.Tensor,  # bf16 | f32 [C, H, 128, 128]
        checkpoint_chunks: Int32,  # checkpoint every this many chunks (<= 0: none)
        stream: cuda.CUstream,
    ):
        num_heads = mV.shape[1]
        num_seqs = mCuSeqlens.shape[0] - 1
        self.kernel_pool(
            mV,
            mBeta,
            mWorkspace,
            mCuSeqlens,
            mStateIndices,
            mCheckpointOffsets,
            mPool,
            mOut,
            mCheckpoints,
            checkpoint_chunks,
        ).launch(
            grid=[D // self.block_v, num_heads, num_seqs],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel_pool(
        self,
        mV: cute.Tensor,
        mBeta: cute.Tensor,
        mWorkspace: cute.Tensor,
        mCuSeqlens: cute.Tensor,
        mStateIndices: cute.Tensor,
        mCheckpointOffsets: cute.Tensor,
        mPool: cute.Tensor,
        mOut: cute.Tensor,
        mCheckpoints: cute.Tensor,
        checkpoint_chunks: Int32,
    ):
        ESZ: Constexpr = self.state_elem_bytes
        cta = cta_setup(self, mV, mBeta, mWorkspace, mCuSeqlens, mOut)
        row = mStateIndices[cta.seq]
        smem = SmemAllocator().allocate(self.smem_bytes + 16, byte_alignment=128).toint()
        valid = (row >= 0) & (row < mPool.shape[0])
        if valid:
            # `row` waits in shared memory for the epilogue (past the ring and the state tile):
            # values kept in registers across the two chunk loops would be spilled by ptxas
            if cta.tid == 0:
                ptx.st_shared_b32(smem + self.smem_bytes, row)
            pool_slice = _pool_slice(mPool, row, cta, ESZ)
            state = _state_registers(self)
            regs = _loop_registers(self)
            if cta.num_chunks > 0:
                _prologue_loads(cta, smem)
            # the ring's stage LOOKAHEAD is not written before iteration 0 (pool_smem_bytes)
            _load_state_pool(
                cta, state, smem + LOOKAHEAD * self.stage_bytes, pool_slice, ESZ
            )
            if cta.num_chunks > 0:
                _prologue(cta, smem, state, regs)
            # Segments of `seg` chunks (the whole sequence without checkpoints); the inner loop's
            # body is the prefill kernel's, the checkpoint after a segment is written between
            # two inner loops (_store_checkpoint).
            seg, num_segs = checkpoint_segments(checkpoint_chunks, cta.num_chunks)
            first_row = mCheckpointOffsets[cta.seq]
            for j in range(num_segs):
                c0 = j * seg
                c1 = cutlass.min(c0 + seg, cta.num_chunks)
                for c in range(c0, c1):
                    _chunk_step(cta, smem, state, regs, c)
                ck_row = first_row + j
                if (c1 < cta.num_chunks) & (ck_row >= 0) & (ck_row < mCheckpoints.shape[0]):
                    _store_checkpoint(cta, state, mCheckpoints.iterator.toint(), ck_row, ESZ)
            ptx.cp_async_wait(0)  # every copy into the ring landed ...
            ptx.cta_barrier()  # ... and every warp is done with it: the ring is free
            row_again = ptx.ld_shared_b32(smem + self.smem_bytes)
            _store_state_pool(
                cta, state, smem, _pool_slice(mPool, row_again, cta, ESZ), ESZ,
                lane=cute.arch.lane_idx(),
            )
        if not valid:  # padding slot: no pool access, no checkpoint; zero out rows
            zero_padding_out(
                mOut.iterator.toint() + (Int64(cta.head) * D + Int64(cta.col_cta)) * 2, cta.tid,
                cta.bos, cta.eos, cta.num_chunks, cta.num_heads, self.block_v)


def pool_smem_bytes(block_v):
    """Shared memory of the serving variant (without its 16-byte stash for the pool row, which
    follows): the ring, and room for the state slice (bf16 tile, BV rows of 256 bytes) at ring
    stage LOOKAHEAD, which the prologue does not fill, so that the initial state can go through
    shared memory while chunks 0 .. LOOKAHEAD - 1 land (block_v 64 and 128: the tile reaches
    past the ring's end)."""
    _, _, stage_bytes = stage_layout(block_v)
    return max(STAGES * stage_bytes, LOOKAHEAD * stage_bytes + block_v * D * 2)


def _pool_slice(mPool, row, cta, esz):
    """Address of this CTA's slice of pool[row, head]: rows col_cta .. col_cta + BV - 1 of the
    (v, k) state, contiguous."""
    slice_off = (Int64(row) * Int64(cta.num_heads) + Int64(cta.head)) * (D * D) + Int64(
        cta.col_cta
    ) * D
    return mPool.iterator.toint() + slice_off * esz


def _load_state_pool(cta, state, tile, pool_slice, esz):
    """Initial state slice (bf16 or f32 rounded to bf16) -> swizzled shared tile -> registers.
    All threads: coalesced 16-byte global loads (all issued first), 16-byte (bf16) or 8-byte (f32
    -> bf16) shared stores; one CTA barrier; each warp reads its registers with ldmatrix.trans."""
    NT = cta.n_tiles
    n = cta.nthreads
    steps = cta.block_v * D * esz // 16 // n
    units = [state_copy_unit(cta.tid + i * n, esz) for i in range(steps)]
    vals = [
        ptx.ld_global_v4(pool_slice + (Int64(v) * D + Int64(k)) * esz) for v, k in units
    ]
    for (v, k), w in zip(units, vals):
        if esz == 2:
            ptx.st_shared_v4(tile + state_smem_offset(v, k), w)
        else:
            ptx.st_shared_v2(
                tile + state_smem_offset(v, k),
                [ptx.pack_f32_bits_bf16x2(w[0], w[1]), ptx.pack_f32_bits_bf16x2(w[2], w[3])],
            )
    ptx.cta_barrier()
    for q in range(state_frag_count(NT)):
        frags = ptx.ldmatrix_x4_trans(tile + state_frag_offset(cta.lane, q, cta.col_w, NT))
        for m, (mt, nt, half) in enumerate(state_frag_regs(q, NT)):
            state[state_reg(mt, nt, half, NT)] = frags[m]


def _store_state_pool(cta, state, tile, pool_slice, esz, lane=None):
    """Final state registers -> the warp's rows of a swizzled shared tile (stmatrix.trans) ->
    global (bf16, or widened to f32) with coalesced 16-byte stores; warp-local, so one
    bar.warp.sync orders the two. `lane`: the lane index to derive addresses from (default
    cta.lane; kernel_pool passes %laneid so that ptxas recomputes them instead of keeping the
    prologue's equal ones alive across the chunk loops)."""
    NT = cta.n_tiles
    lane = cta.lane if lane is None else lane
    col_w = (cta.tid // 32) * (8 * NT) if lane is not cta.lane else cta.col_w
    for q in range(state_frag_count(NT)):
        regs4 = [state[state_reg(mt, nt, half, NT)] for mt, nt, half in state_frag_regs(q, NT)]
        ptx.stmatrix_x4_trans(tile + state_frag_offset(lane, q, col_w, NT), regs4)
    ptx.warp_sync()
    copy_tile_rows_out(tile, lane, col_w, 8 * NT, [pool_slice], esz)


def copy_tile_rows_out(tile, lane, first_row, n_rows, dsts, esz, batch=8):
    """One warp: rows first_row .. first_row + n_rows - 1 (first_row a multiple of 8) of a
    swizzled bf16 state tile -> global memory at each address of `dsts` (where row 0 of the
    tile goes; rows of 128 values, bf16 or widened exactly to f32 for esz 4). Coalesced: lane l
    handles 16-byte global unit l + 32 i of the rows (state_copy_unit); the shared reads are
    16-byte (bf16) or 8-byte (f32) and conflict free; `batch` units are read before they are
    stored. Addresses: one lane-constant base each plus immediates (copy_out_addresses)."""
    steps = n_rows * D * esz // 16 // 32
    s_base, s_x, g_off = copy_out_lane_terms(tile, lane, first_row, esz)
    for b0 in range(0, steps, batch):
        idx = range(b0, min(b0 + batch, steps))
        vals = []
        for i in idx:
            s_addr, _ = copy_out_addresses(s_base, s_x, 0, i, esz)
            if esz == 2:
                vals.append(ptx.ld_shared_v4(s_addr))
            else:
                w = ptx.ld_shared_v2(s_addr)
                vals.append(
                    [
                        ptx.bf16x2_lo_bits(w[0]),
                        ptx.bf16x2_hi_bits(w[0]),
                        ptx.bf16x2_lo_bits(w[1]),
                        ptx.bf16x2_hi_bits(w[1]),
                    ]
                )
        for dst in dsts:
            dst_lane = dst + g_off
            for i, w in zip(idx, vals):
                _, g_addr = copy_out_addresses(s_base, s_x, dst_lane, i, esz)
                ptx.st_global_v4(g_addr, w)


def copy_out_lane_terms(tile, lane, first_row, esz):
    """The lane-constant terms of copy_tile_rows_out's addresses: (shared base, swizzle term,
    global byte offset). Unit lane + 32 i is row first_row + (lane >> 4) + 2 i, k = 8 (lane &
    15) for bf16 (16 units a row) and row first_row + i, k = 4 lane for f32 (32 a row); with
    first_row % 8 == 0 the granule's swizzle (k // 8) ^ (row % 8) is s_x ^ (2 i & 7) resp.
    s_x ^ (i & 7)."""
    if esz == 2:
        row = first_row + (lane >> 4)
        return (
            tile + row * (D * 2),
            (lane & 15) ^ (lane >> 4),
            (Int64(row) * D + Int64(lane & 15) * 8) * 2,
        )
    return (
        tile + first_row * (D * 2) + (lane & 1) * 8,
        lane >> 1,
        (Int64(first_row) * D + Int64(lane) * 4) * 4,
    )


def copy_out_addresses(s_base, s_x, dst_lane, i, esz):
    """(shared address, global address) of step i of copy_tile_rows_out (i a Python int)."""
    if esz == 2:
        return s_base + 512 * i + (s_x ^ ((2 * i) & 7)) * 16, dst_lane + 512 * i
    return s_base + 256 * i + (s_x ^ (i & 7)) * 16, dst_lane + 512 * i


def _store_checkpoint(cta, state, ckpt_base, row, esz):
    """The state registers -> checkpoints[row, head] (this warp's columns).

    kernel_pool runs the chunk loop in segments of checkpoint_chunks chunks; after segment j
    (chunks j n16 .. (j + 1) n16 - 1), if chunks remain and row = checkpoint_offsets[seq] + j is
    in [0, C), it calls this. So the chunk loop's body stays the prefill kernel's, and a
    checkpoint's stores issue, under one uniform branch, while the segment's last P(c+1) MMAs are
    in flight; nothing waits for them. Each state register goes out as its movmatrix.trans (lane
    (g, t) then holds S[8 nt + g][16 mt + 8 half + 2t, +1]): one 4-byte (bf16) or 8-byte (f32)
    store per register, four lanes writing 16 / 32 contiguous bytes of a state row (a full
    32-byte sector per row and instruction for f32; for bf16 the two halves of a sector come from
    the two registers of a tile)."""
    NT = cta.n_tiles
    g = cta.lane // 4
    t = cta.lane % 4
    lane_addr = (
        ckpt_base
        + (Int64(row) * Int64(cta.num_heads) + Int64(cta.head)) * (D * D * esz)
        + (Int64(cta.col_cta + cta.col_w + g) * D + Int64(2 * t)) * esz
    )
    for mt in range(8):
        for nt in range(NT):
            for half in range(2):
                b = ptx.movmatrix_trans_volatile(state[state_reg(mt, nt, half, NT)])
                addr = lane_addr + checkpoint_offset(mt, nt, half) * esz
                if esz == 2:
                    ptx.st_global_b32_if(addr, b, Int32(0), Int32(1))
                else:
                    ptx.st_global_f32x2_of_bf16x2_if(addr, b, Int32(0), Int32(1))


def checkpoint_offset(mt, nt, half):
    """Element offset, relative to this lane's start (row col_w + g, k = 2t), of the pair
    movmatrix.trans(state[mt, nt, half]) holds: row + 8 nt, k + 16 mt + 8 half."""
    return 8 * nt * D + 16 * mt + 8 * half


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
        bits = beta_bits(src, stage, row_tok0, acc_row(lane, half))
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


def compile_kernel(
    block_v: int = 32,
    arch: str = "sm_90a",
    *,
    state_dtype: str = "bf16",
    serving: bool = False,
    dump_dir: str | None = None,
):
    """The column-split recurrence with `block_v` value columns per CTA, compiled for `arch`
    (compile_utils.compile_for_arch): the prefill kernel, with serving=True the serving
    variant with `state_dtype` ("bf16" | "f32") state pools."""
    kernel = KdaRecurrence(block_v, state_dtype, serving)
    args = recurrence_pool_args(state_dtype) if serving else recurrence_args()
    return compile_for_arch(kernel, args, arch, dump_dir=dump_dir)
