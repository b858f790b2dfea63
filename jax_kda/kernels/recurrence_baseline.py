"""KDA recurrence (docs/numerics.md, section 5 "Recurrence"), baseline: FlashKDA v1's structure,
state in SHARED memory.

This is the reference point the column-split kernel (recurrence.py) is measured and bit-compared
against. Out and final state are meant to be bitwise identical to recurrence.py for every
block_v: every value column goes through the same instructions in the same order (see
"Numerics" below).

Grid (1, H, N): one CTA per (head, sequence), all 128 value columns. 192 threads, 6 warps:
  warps 0..3  MMA warps: warp w owns value columns 32w .. 32w+31 (4 n-tiles of 8 columns);
  warp 4      producer: fills a STAGES-deep shared-memory ring with bulk async copies (TMA-style
              1-D `cp.async.bulk`), runs up to STAGES chunks ahead of the MMA warps;
  warp 5      output store warp: writes each chunk's out tile from a double-buffered shared
              staging tile to global memory with 1-D bulk copies shared -> global.

Shared memory (bytes; everything 128-byte aligned where it starts):
  [0, 128)                mbarriers: full[STAGES], empty[STAGES], out_full[2], out_empty[2]
  STATE_OFF, 32 KiB       the state S (bf16), row v (value column) = 256 bytes of 128 k values,
                          16-byte granule kg of row v stored at granule kg ^ (v % 8)
                          (state_smem_offset). Loaded once from the initial state, written to
                          the final state at the end (also when the sequence is empty).
  OUT_OFF, 2 x 4352       out staging tiles, 16 rows x 128 bf16, row pitch ROW_PITCH = 272
  RING_OFF, STAGES x STAGE_BYTES  the input ring; one stage =
                          [0, 13824) the chunk's workspace record, byte-exact (kernel_abi.md)
                          [V_OFF, +16 x 272) the chunk's v rows, 256 bytes each, pitch 272
                          [BETA_OFF, +32) the 16 raw bf16 beta logits (2 bytes per row)
The 272-byte pitch (256 + 16) keeps every row 16-byte aligned for the bulk copies and makes the
accumulator-layout accesses (8 rows x 4 words per instruction) hit 32 distinct banks.

State fragments (ptx.py's module docstring has the m16n8k16 layouts). With S stored v-major,
the 8x8 block S[v0..v0+7][k0..k0+7] read by `ldmatrix` (no .trans) is the 8x8 fragment of
(B[k0.., v0..])^T, i.e. exactly b[0] / b[1] of the B operand S^T of kd . S^T; read by
`ldmatrix.trans` it is the packed accumulator pair (S^T[k0+g][v0+2t], S^T[k0+g][v0+2t+1]) =
recurrence.py's register state[mt, nt, half]. One address map (state_ldsm_offset: matrix
m = lane // 8 -> n-tile nt0 + m // 2, k half m % 2) serves ldmatrix (B operands of k-block kb
for n-tiles nt0, nt0+1), ldmatrix.trans (old state, accumulator layout, k-tile kb) and
stmatrix.trans (new state). The swizzle makes each 8-lane phase (8 consecutive v rows, one
logical granule) conflict-free.

Numerics (per chunk, per value column; identical instructions to recurrence.py):
  P = kd . S^T, Oq = qd . S^T: mma m16n8k16, k-blocks 0..7 ascending, from f32 zero;
  u = (sub.rn.bf16x2(v, pack(P)) mul.rn.bf16x2 sigmoid_bf16x2_from_logit(beta)) & row_mask;
  U = pack(INV . movmatrix(u)); out = add.rn.bf16x2(pack(Oq), pack(Mqk . U));
  W = kr^T . U; S = pack(fma.rn.ftz(bf16->f32(S), gt, W)).
The only differences from recurrence.py are where operands travel (shared memory instead of
registers, ldmatrix instead of movmatrix for the state's B operand, out through a staging tile):
no arithmetic instruction, operand value or accumulation order differs. Malformed cu_seqlens are
clamped by recurrence.sequence_bounds, as in recurrence.py; chunk c of sequence n lives in slot
cu[n] // 16 + n + c.

beta: beta[tok, h] is strided by H elements, so it has no contiguous per-chunk run for a bulk
copy (and a 2-byte element is below the 16-byte bulk granularity). The producer lanes r < 16
read it with plain 16-bit loads (rows past the end: no load, 0 stored) and st.shared it into the
stage; each producer lane then arrives on the stage's full barrier (release), so the MMA warps'
acquire-wait covers these generic-proxy stores as well as the bulk copies' bytes. This keeps the
MMA warps' chain free of global-memory latency (the producer runs STAGES chunks ahead).

mbarrier protocol (hand check). All barriers are initialised by thread 0, then
fence.mbarrier_init.release.cluster and one CTA barrier (all 192 threads) before first use.
  full[s]   count 32 (every producer lane arrives once per fill), tx = RECORD_BYTES + 256 * n_valid
  empty[s]  count 128 (every MMA thread arrives once per chunk, after its last read of stage s)
  out_full[b]  count 128 (every MMA thread, after its staging stores + fence.proxy.async)
  out_empty[b] count 32 (every store-warp lane, after cp.async.bulk.wait_group.read 0)
Chunk c uses stage s = c % STAGES in round n = c // STAGES, and out buffer b = c % 2 in round
m = c // 2. A waiter for "round n filled" waits on parity n & 1; a waiter for "slot free for
round n" waits on parity (n & 1) ^ 1, which returns at once for n = 0 on a fresh barrier (phase 0
is in progress, so the "preceding" phase of parity 1 counts as complete) and afterwards waits for
the consumers' release of round n - 1. Each barrier completes exactly one phase per round, and no
waiter can be two phases behind (a producer cannot refill stage s for round n + 1 before the MMA
warps released round n, and they cannot release round n before it was filled), so parity is
unambiguous.
  Producer, chunk c: wait empty[s] parity ((n & 1) ^ 1); lane 0: mbarrier.expect_tx(full[s],
  RECORD_BYTES + 256 * n_valid) where n_valid = min(eos - tok0, 16) >= 1 is exactly the number
  of v rows copied (the last, partial chunk copies only its valid rows and expects only their
  bytes); bar.warp.sync (so the expected count is set before any copy can complete: tx never
  goes negative); lane 0 bulk-copies the record, lanes r < n_valid bulk-copy v row r (both with
  complete_tx on full[s]); lanes r < 16 store beta row r; every lane arrives on full[s]. The
  phase completes once all 32 arrivals and all expected bytes have landed.
  MMA warps, chunk c: wait full[s] parity (n & 1); read the stage; before writing out buffer b
  wait out_empty[b] parity ((m & 1) ^ 1); st.shared the out tile; fence.proxy.async.shared::cta
  (generic writes -> async-proxy reads of the bulk store); arrive out_full[b]; finish the state
  update (it still reads kr and gt from the stage); arrive empty[s]; bar.warp.sync (state rows
  written by stmatrix are visible to the whole warp before the next chunk's ldmatrix).
  Store warp, chunk c: wait out_full[b] parity (m & 1); lanes r < n_valid bulk-copy out row r
  (256 bytes) to out[tok0 + r, h]; commit + wait_group.read 0 (staging read done); every lane
  arrives on out_empty[b]. After the loop: cp.async.bulk.wait_group 0 (writes complete).
  Producer tail: after its last fill it waits for the release of the last min(STAGES,
  num_chunks) chunks, so no bulk copy into this CTA is pending when the producer exits.
No deadlock: every role runs the same num_chunks iterations with the same (s, n, b, m); for
num_chunks == 0 no role waits on anything (the MMA warps copy the initial state through shared
memory to the final state; the tail waits only for chunks c - STAGES >= 0, none). A sequence
shorter than the ring (num_chunks < STAGES) only uses the first num_chunks stages, each in round
0, whose empty waits return at once. The producer blocks only on empty[s] (released by the MMA
warps for round n - 1, which needed only full[s] round n - 1, already produced); the MMA warps
block on full[s] (produced unconditionally) and out_empty[b] (released by the store warp, which
needs only out_full[b] of the previous round, already arrived); the store warp blocks only on
out_full[b]. Each dependency points to an earlier chunk, so the wait graph is acyclic.
"""

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.memory import SmemAllocator

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

NUM_MMA_WARPS = 4
N_TILES = 4  # 8-column n-tiles per MMA warp
WARP_COLS = 8 * N_TILES
PRODUCER_WARP = 4
STORE_WARP = 5
NUM_THREADS = 32 * 6
# input ring depth (96.5 KiB of shared memory in all: two CTAs fit on one SM)
STAGES = 3
OUT_BUFS = 2
ROW_PITCH = 272  # v rows and out rows in shared memory: 256 bytes + 16 of padding
ROW_BYTES = D * 2  # one token row of v / out for one head, in global memory
STATE_ROW_BYTES = D * 2  # one state row (value column v, 128 k values)
V_OFF = RECORD_BYTES
BETA_OFF = V_OFF + CHUNK * ROW_PITCH
STAGE_BYTES = (BETA_OFF + CHUNK * 2 + 127) // 128 * 128
OUT_TILE_BYTES = CHUNK * ROW_PITCH
STATE_BYTES = D * STATE_ROW_BYTES
BAR_BYTES = 128
STATE_OFF = BAR_BYTES
OUT_OFF = STATE_OFF + STATE_BYTES
RING_OFF = OUT_OFF + OUT_BUFS * OUT_TILE_BYTES
SMEM_BYTES = RING_OFF + STAGES * STAGE_BYTES
# mbarrier arrival counts (one arrival per thread of the arriving role)
FULL_COUNT = 32  # producer warp
EMPTY_COUNT = 32 * NUM_MMA_WARPS  # MMA threads
OUT_FULL_COUNT = 32 * NUM_MMA_WARPS  # MMA threads
OUT_EMPTY_COUNT = 32  # store warp
# mbarrier slots (8 bytes each) in the barrier region
BAR_FULL, BAR_EMPTY = 0, STAGES
BAR_OUT_FULL, BAR_OUT_EMPTY = 2 * STAGES, 2 * STAGES + OUT_BUFS
assert (BAR_OUT_EMPTY + OUT_BUFS) * 8 <= BAR_BYTES
assert RING_OFF % 128 == 0 and STAGE_BYTES % 128 == 0


# ---- index maps (plain integer arithmetic: used by the kernel on DSL Int32 values and by the
# CPU fragment simulator in tests/ on numpy ints) ----
def ring_slot(c, depth):
    """(slot, parity) of chunk c in a ring of `depth` buffers: the "filled" wait of round
    c // depth is on parity (c // depth) & 1, the "free" wait on that parity ^ 1."""
    return c % depth, (c // depth) & 1


def state_smem_offset(v, k):
    """Byte offset of S[v, k] (value column v, key index k) in the shared state."""
    return v * STATE_ROW_BYTES + ((k // 8) ^ (v % 8)) * 16 + (k % 8) * 2


def state_ldsm_offset(lane, kb, col0):
    """Row address this lane gives to ldmatrix(.trans) / stmatrix.trans for the state block of
    k-block kb (k 16kb..16kb+15) and n-tiles (col0, col0 + 8) (col0 a multiple of 16): matrix
    m = lane // 8 is S[col0 + 8 (m // 2) .. +7][16kb + 8 (m % 2) .. +7], row lane % 8 of it.
    Registers: ldmatrix -> (b[0], b[1]) of n-tile col0, then of col0 + 8; ldmatrix.trans ->
    (state half 0, half 1) of n-tile col0, then of col0 + 8."""
    m = lane // 8
    v = col0 + 8 * (m // 2) + lane % 8
    return state_smem_offset(v, 16 * kb + 8 * (m % 2))


def row_offset(row, col):
    """Byte offset of element (row, col) of a [16, 128] bf16 tile stored with ROW_PITCH (the
    stage's v rows and the out staging tiles)."""
    return row * ROW_PITCH + col * 2


def state_copy_granule(lane, i, col_w):
    """(state row v, 16-byte granule index) lane `lane` copies in step i (0..15) of the warp's
    initial/final state copy: the warp's 32 rows x 16 granules, 32 consecutive granules (two
    rows) per step, so global accesses are coalesced."""
    gi = lane + 32 * i
    return col_w + gi // 16, gi % 16


class KdaRecurrenceBaseline:
    """Baseline recurrence; called exactly like recurrence.KdaRecurrence."""

    def __init__(self):
        self.num_threads = NUM_THREADS

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
            grid=[1, num_heads, num_seqs],
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
        tid, _, _ = cute.arch.thread_idx()
        _, head, seq = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32

        t_total = mV.shape[0]
        num_heads = mV.shape[1]
        num_slots = mWorkspace.shape[1]

        bos, eos = sequence_bounds(mCuSeqlens, seq, t_total)
        num_chunks = (eos - bos + (CHUNK - 1)) // CHUNK
        slot0 = bos // CHUNK + seq

        smem = SmemAllocator().allocate(SMEM_BYTES, byte_alignment=128).toint()
        bars = smem
        state_s = smem + STATE_OFF
        out_s = smem + OUT_OFF
        ring = smem + RING_OFF

        if tid == 0:
            for s in cutlass.range_constexpr(STAGES):
                ptx.mbar_init(bars + (BAR_FULL + s) * 8, Int32(FULL_COUNT))
                ptx.mbar_init(bars + (BAR_EMPTY + s) * 8, Int32(EMPTY_COUNT))
            for b in cutlass.range_constexpr(OUT_BUFS):
                ptx.mbar_init(bars + (BAR_OUT_FULL + b) * 8, Int32(OUT_FULL_COUNT))
                ptx.mbar_init(bars + (BAR_OUT_EMPTY + b) * 8, Int32(OUT_EMPTY_COUNT))
            ptx.fence_mbarrier_init()
        ptx.cta_barrier()

        # token row tok of head `head` in v / out: base + tok * row_stride
        row_stride = Int64(num_heads) * ROW_BYTES
        v_head = mV.iterator.toint() + Int64(head) * ROW_BYTES
        out_head = mOut.iterator.toint() + Int64(head) * ROW_BYTES

        if warp < NUM_MMA_WARPS:
            state_off = (Int64(seq) * Int64(num_heads) + Int64(head)) * (D * D)
            s0_base = mState0.iterator.toint() + state_off * 2
            sT_base = mStateT.iterator.toint() + state_off * 2
            _mma_warp(
                warp * WARP_COLS,
                lane,
                bos,
                eos,
                num_chunks,
                bars,
                state_s,
                out_s,
                ring,
                s0_base,
                sT_base,
            )
        if warp == PRODUCER_WARP:
            ws_head = (
                mWorkspace.iterator.toint()
                + Int64(head) * Int64(num_slots) * RECORD_BYTES
            )
            beta_head = mBeta.iterator.toint() + Int64(head) * 2
            for c in range(num_chunks):
                s, par = ring_slot(c, STAGES)
                full = bars + (BAR_FULL + s) * 8
                stage = ring + s * STAGE_BYTES
                ptx.mbar_wait(bars + (BAR_EMPTY + s) * 8, par ^ 1)
                tok0 = bos + c * CHUNK
                n_valid = cutlass.min(eos - tok0, Int32(CHUNK))
                ptx.mbar_expect_tx_if(
                    full, RECORD_BYTES + n_valid * ROW_BYTES, lane, Int32(1)
                )
                ptx.warp_sync()  # expected bytes registered before any copy can complete
                rec = ws_head + Int64(slot0 + c) * RECORD_BYTES
                ptx.bulk_g2s_if(stage, rec, Int32(RECORD_BYTES), full, lane, Int32(1))
                tok = tok0 + lane
                ptx.bulk_g2s_if(
                    stage + V_OFF + lane * ROW_PITCH,
                    v_head + Int64(tok) * row_stride,
                    Int32(ROW_BYTES),
                    full,
                    lane,
                    n_valid,
                )
                bits = ptx.ld_global_u16_if(
                    beta_head + Int64(tok) * Int64(num_heads) * 2, lane, n_valid
                )
                if lane < CHUNK:
                    ptx.st_shared_u16(stage + BETA_OFF + lane * 2, bits)
                ptx.mbar_arrive(full)
            # tail: wait until the MMA warps released the last min(STAGES, num_chunks) chunks
            for i in cutlass.range_constexpr(STAGES):
                c = num_chunks + i
                if c >= STAGES:
                    s, par = ring_slot(c, STAGES)
                    ptx.mbar_wait(bars + (BAR_EMPTY + s) * 8, par ^ 1)
        if warp == STORE_WARP:
            for c in range(num_chunks):
                b, par = ring_slot(c, OUT_BUFS)
                ptx.mbar_wait(bars + (BAR_OUT_FULL + b) * 8, par)
                tok0 = bos + c * CHUNK
                n_valid = cutlass.min(eos - tok0, Int32(CHUNK))
                ptx.bulk_s2g_row_if(
                    out_head + Int64(tok0 + lane) * row_stride,
                    out_s + b * OUT_TILE_BYTES + lane * ROW_PITCH,
                    Int32(ROW_BYTES),
                    lane,
                    n_valid,
                )
                ptx.mbar_arrive(bars + (BAR_OUT_EMPTY + b) * 8)
            ptx.bulk_wait_all()


@cute.jit
def _mma_warp(
    col_w, lane, bos, eos, num_chunks, bars, state_s, out_s, ring, s0_base, sT_base
):
    """One MMA warp: value columns col_w .. col_w + 31, the state rows of these columns."""
    NT = N_TILES
    zero_f = Float32(0.0)

    # ---- initial state -> shared memory (this warp's 32 rows), swizzled ----
    for i in cutlass.range_constexpr(16):
        v, kg = state_copy_granule(lane, i, col_w)
        vals = ptx.ld_global_v4(s0_base + (Int64(v) * D + Int64(kg * 8)) * 2)
        ptx.st_shared_v4(state_s + state_smem_offset(v, kg * 8), vals)
    ptx.warp_sync()

    for c in range(num_chunks):
        s, par = ring_slot(c, STAGES)
        stage = ring + s * STAGE_BYTES
        ptx.mbar_wait(bars + (BAR_FULL + s) * 8, par)
        tok0 = bos + c * CHUNK

        # P = kd . S^T, Oq = qd . S^T, k-blocks ascending; B operands from the shared state
        p_acc = [[zero_f] * 4 for _ in range(NT)]
        o_acc = [[zero_f] * 4 for _ in range(NT)]
        for kb in cutlass.range_constexpr(8):
            a_off = ldmatrix_a_offset(lane, kb)
            a_kd = ptx.ldmatrix_x4(stage + OFF_KD + a_off)
            a_qd = ptx.ldmatrix_x4(stage + OFF_QD + a_off)
            for pair in cutlass.range_constexpr(NT // 2):
                bb = ptx.ldmatrix_x4(
                    state_s + state_ldsm_offset(lane, kb, col_w + 16 * pair)
                )
                for e in cutlass.range_constexpr(2):
                    nt = 2 * pair + e
                    b = (bb[2 * e], bb[2 * e + 1])
                    p_acc[nt] = ptx.mma_bf16_16816(a_kd, b, p_acc[nt])
                    o_acc[nt] = ptx.mma_bf16_16816(a_qd, b, o_acc[nt])

        # chunk operands from the stage
        b_in = [
            ptx.sigmoid_bf16x2_from_logit(
                ptx.ld_shared_u16(stage + BETA_OFF + acc_row(lane, half) * 2)
            )
            for half in range(2)
        ]
        row_mask = [
            ptx.select_lt(tok0 + acc_row(lane, half), eos, Int32(-1), Int32(0))
            for half in range(2)
        ]
        small_off = ldmatrix_small_offset(lane)
        a_inv = ptx.ldmatrix_x4(stage + OFF_INV + small_off)
        a_mqk = ptx.ldmatrix_x4(stage + OFF_MQK + small_off)

        # u = bf16(bf16(v - P) * bf16(b)) (rows past the end: exactly 0); U = bf16(INV . u)
        ub = []
        for nt in cutlass.range_constexpr(NT):
            col = col_w + nt * 8 + acc_col(lane)
            u = []
            for half in cutlass.range_constexpr(2):
                v_in = ptx.ld_shared_b32(
                    stage + V_OFF + row_offset(acc_row(lane, half), col)
                )
                p = ptx.pack_bf16x2_i32(p_acc[nt][2 * half], p_acc[nt][2 * half + 1])
                uu = ptx.mul_bf16x2(ptx.sub_bf16x2(v_in, p), b_in[half])
                u.append(uu & row_mask[half])
            u_acc = ptx.mma_bf16_16816(
                a_inv,
                (ptx.movmatrix_trans(u[0]), ptx.movmatrix_trans(u[1])),
                [zero_f] * 4,
            )
            big_u0 = ptx.pack_bf16x2_i32(u_acc[0], u_acc[1])
            big_u1 = ptx.pack_bf16x2_i32(u_acc[2], u_acc[3])
            ub.append((ptx.movmatrix_trans(big_u0), ptx.movmatrix_trans(big_u1)))

        # out = bf16(Oq + bf16(Mqk . U)) -> staging tile b (all 16 rows; the store warp writes
        # only the valid ones)
        ob, out_par = ring_slot(c, OUT_BUFS)
        out_tile = out_s + ob * OUT_TILE_BYTES
        m_acc = [ptx.mma_bf16_16816(a_mqk, ub[nt], [zero_f] * 4) for nt in range(NT)]
        ptx.mbar_wait(bars + (BAR_OUT_EMPTY + ob) * 8, out_par ^ 1)
        for nt in cutlass.range_constexpr(NT):
            col = col_w + nt * 8 + acc_col(lane)
            for half in cutlass.range_constexpr(2):
                mq = ptx.pack_bf16x2_i32(m_acc[nt][2 * half], m_acc[nt][2 * half + 1])
                oq = ptx.pack_bf16x2_i32(o_acc[nt][2 * half], o_acc[nt][2 * half + 1])
                ptx.st_shared_b32(
                    out_tile + row_offset(acc_row(lane, half), col),
                    ptx.add_bf16x2(oq, mq),
                )
        ptx.fence_proxy_async_shared()
        ptx.mbar_arrive(bars + (BAR_OUT_FULL + ob) * 8)

        # S[j, k] = bf16(fmaf(f32(S[j, k]), gt[k], (kr^T . U)[k, j])), k-tile by k-tile: the old
        # state comes in (ldmatrix.trans) and goes out (stmatrix.trans) in the accumulator
        # layout, i.e. as recurrence.py's state registers.
        for mt in cutlass.range_constexpr(8):
            a_krt = ptx.ldmatrix_x4_trans(stage + OFF_KR + ldmatrix_krt_offset(lane, mt))
            gt_lo = ptx.ld_shared_f32(stage + OFF_GT + (mt * 16 + acc_row(lane, 0)) * 4)
            gt_hi = ptx.ld_shared_f32(stage + OFF_GT + (mt * 16 + acc_row(lane, 1)) * 4)
            for pair in cutlass.range_constexpr(NT // 2):
                addr = state_s + state_ldsm_offset(lane, mt, col_w + 16 * pair)
                old = ptx.ldmatrix_x4_trans(addr)
                new = []
                for e in cutlass.range_constexpr(2):
                    wt = ptx.mma_bf16_16816(a_krt, ub[2 * pair + e], [zero_f] * 4)
                    s_lo = old[2 * e]
                    s_hi = old[2 * e + 1]
                    new.append(
                        ptx.pack_bf16x2_i32(
                            ptx.ffma(ptx.bf16x2_lo_to_f32(s_lo), gt_lo, wt[0]),
                            ptx.ffma(ptx.bf16x2_hi_to_f32(s_lo), gt_lo, wt[1]),
                        )
                    )
                    new.append(
                        ptx.pack_bf16x2_i32(
                            ptx.ffma(ptx.bf16x2_lo_to_f32(s_hi), gt_hi, wt[2]),
                            ptx.ffma(ptx.bf16x2_hi_to_f32(s_hi), gt_hi, wt[3]),
                        )
                    )
                ptx.stmatrix_x4_trans(addr, new)
        ptx.mbar_arrive(bars + (BAR_EMPTY + s) * 8)  # stage s fully read
        ptx.warp_sync()  # new state rows visible to every lane of the warp

    # ---- final state (also for zero-length sequences: the initial state) ----
    for i in cutlass.range_constexpr(16):
        v, kg = state_copy_granule(lane, i, col_w)
        vals = ptx.ld_shared_v4(state_s + state_smem_offset(v, kg * 8))
        ptx.st_global_v4(sT_base + (Int64(v) * D + Int64(kg * 8)) * 2, vals)


def compile_kernel(arch: str = "sm_90a", *, dump_dir: str | None = None):
    """The baseline recurrence compiled for `arch` (compile_utils.compile_for_arch)."""
    return compile_for_arch(KdaRecurrenceBaseline(), recurrence_args(), arch, dump_dir=dump_dir)
