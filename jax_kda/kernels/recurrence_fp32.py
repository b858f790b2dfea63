"""KDA recurrence in the fp32 numerics mode (docs/fp32_mode.md, section 1 "Recurrence"): column
split, f32 state resident in registers, every product of f32 matrices as bf16 MMAs on hi + lo
pairs.

Task = (value-column slice, head, sequence), grid (128 / block_v, H, N), no communication between
CTAs: the structure of the bf16 mode's column-split kernel (recurrence.py), with an f32 state and
the workspace record of docs/fp32_mode.md section 3 (23,040 bytes: kd_hi; qd, kr, INV, Mqk as
hi/lo bf16 pairs; gt f32).

Warp layout (warp_layout: warps per CTA, n-tiles of 8 columns per warp, k-split).
  * k-split (block_v 16 -> 4 warps, 32 -> 8): a pair of warps per n-tile. Warp w is pair
    w // 2 (columns 8 (w // 2) ..) and key half h = w % 2: it holds the state k-tiles 4h .. 4h + 3
    of its n-tile (16 f32 registers) and computes key half h of P and Oq on them (20 MMAs); the
    pair exchanges the halves through shared memory (below). Both warps then compute the same u
    and U (identical instructions on identical values, so identical bits; 3 MMAs), Mqk.U (3), W
    for their own 4 k-tiles only (12) and update their own state tiles; each writes the out rows
    of its accumulator half h (the lane's row g if h = 0, g + 8 if h = 1). 38 MMAs per warp and
    chunk instead of 70, and the dependent P chain on the serial path is 4 MMAs instead of 8.
  * in-warp halves (64 -> 8 warps x 1 n-tile, 128 -> 8 x 2: a k-split would need 16 / 32 warps and
    twice the register file): one warp holds all eight k-tiles of its n-tile(s) (32 f32 registers
    each) and runs each P / Oq term as two chains, k-blocks 0-3 and 4-7, each from zero.
  KdaRecurrenceFp32(block_v, n_tiles=2) (16 / 32 / 64 columns on 1 / 2 / 4 warps) and k_split=1
  (16 / 32 columns on 2 / 4 warps, one n-tile each: the previous layout) are benchmark knobs with
  the same bits.

State. A warp keeps S^T[16 k_tiles (k), 8 NT (v)] of its keys kbase .. and columns in registers,
f32, in the m16n8k16 accumulator layout: for local k-tile mt and n-tile nt,
state[state_index(mt, nt, i)] holds S^T[16 (kbase + mt) + acc_row(lane, i // 2)][8 nt +
acc_col(lane) + i % 2]. split() of a tile's two row pairs gives packed bf16x2 hi and lo words in
the same layout; movmatrix.trans of them is the B operand (S_hi / S_lo) of k-block kbase + mt of
kd . S^T and qd . S^T, so the state never goes through shared memory (as in recurrence.py).

Per chunk and n-tile (docs/fp32_mode.md section 1, recurrence steps 1-6; mma_product's term
order: hh + hl, or hh + (hl + lh), each term its own MMA chain started from zero, k-blocks
ascending):
  1. (S_hi, S_lo) = split(S), k-tile by k-tile, as the tile is updated (step 6 of the previous
     chunk) or loaded (prologue).
  2. per key half h (k-blocks 4h .. 4h + 3): P_h = kd_hi.S_hi^T + kd_hi.S_lo^T (two chains of 4
     MMAs), Oq_h = qd_hi.S_hi^T + (qd_hi.S_lo^T + qd_lo.S_hi^T) (three chains of 4);
     P = P_0 + P_1, Oq = Oq_0 + Oq_1 (add_halves; f32 addition is commutative bit for bit, so
     either warp of a pair may add its own half first).
  3. u = (f32(v) - P) * b, b = sigmoid(f32(beta logit)) in f32 (ptx.sigmoid_exp2); split(u); the
     packed words of rows past the sequence end are masked to 0, so u = 0 exactly there.
  4. U = INV_hi.u_hi + (INV_hi.u_lo + INV_lo.u_hi); split(U).
  5. out = bf16(Oq + (Mqk_hi.U_hi + (Mqk_hi.U_lo + Mqk_lo.U_hi))): one f32 add, one rounding;
     rows past the end not written (registers -> global, 4-byte stores).
  6. per k-tile mt: W = kr_hi^T.U_hi + (kr_hi^T.U_lo + kr_lo^T.U_hi);
     S = fmaf(S, gt[k], W) (f32 .ftz), then step 1 of the next chunk for that tile.
Every column runs exactly this sequence whatever the warp layout, so out and the final state are
bitwise independent of block_v.

Software pipeline (iteration c of the chunk loop; P(c) and Oq(c), i.e. their chains, were
computed by iteration c - 1, which also read chunk c's serial-chain operands v, b, the row masks,
INV hi/lo, kr^T of the warp's first k-tile hi/lo and its gt into registers, before this
iteration's barrier):
  P(c) [k-split: STS of the own half -> pair barrier -> LDS of the partner's] -> u -> INV.u -> U
  -> W tile 0 -> S tile 0 -> split -> k-block 0 of P(c+1), Oq(c+1);
  W tile mt + 1 is issued while tile mt is folded into the state, so each W tile's terms are
  summed and folded as soon as they complete; state tile mt then feeds k-block mt of the next
  chunk's five chains (in-warp halves: tile 4 starts the second chain set from zero; the first
  set is summed into P_0, Oq_0 after tile 4's MMAs were issued, not while its last MMAs are in
  flight). The loop-carried serial chain is P(c) -> u -> U -> W tile 0 -> S tile 0 -> 4 (k-split)
  or 8 dependent P MMAs. The CTA barrier (chunk c + 1's stage visible) is reached while the
  last P MMAs are in flight; the P exchange is the first shared access after it, so no other
  shared access queues in front of it. Off the chain, in its shadow: the Oq exchange (own half
  stored after U; pair barrier bar_o and the partner's half read at k-tile 0), Mqk.U and the out
  stores (k-tile 0), the stage refill (k-tile 1), the reads of chunk c+1's chain operands
  (k-tile 2), kr^T / gt of the later tiles (two tiles ahead of their W MMAs, from chunk c's
  stage) and kd / qd of chunk c+1 (AHEAD: KD_AHEAD k-blocks ahead).

Shared memory: a ring of STAGES stages, each the chunk's 23,040-byte record (byte-exact copy),
its v rows of this CTA's columns (bf16 [16, block_v]) and its 16 beta logits (one 4-byte slot
each), 128-byte rounded (stage_layout: 23,680 bytes at block_v 16, 27,264 at 128). All threads
fill it with cp.async, LOOKAHEAD chunks ahead; one CTA barrier per chunk makes the next stage
visible and frees the one being refilled. Iteration c reads stages c (Mqk, kr^T, gt) and c + 1
(chunk c+1's operands); it refills stage c - 1 (STAGES = LOOKAHEAD + 1), whose last reader was
iteration c - 1, which every warp has left at iteration c's barrier. Behind the ring (k-split
only) the pairs' exchange area, XCHG_PAIR_BYTES per pair: P halves [2][32 lanes][16 B] and Oq
halves the same, one 16-byte slot per lane and half (conflict-free st/ld.shared.v4). A slot is
rewritten only after its reader is past it: P(c)'s slots are written after CTA barrier c, which
the partner reaches after reading P(c - 1); Oq(c)'s after the pair's P barrier of chunk c, which
the partner reaches after reading Oq(c - 1). Named barrier ids: 1 + pair (P), 1 + pairs + pair
(Oq), 64 threads; id 0 is the CTA barrier.

Registers (per thread, NT n-tiles, KT = 8 / k_split k-tiles): the state 4 KT NT; the carried
P(c)/Oq(c) chains of the last key half 20 NT (+ P_0, Oq_0: 8 NT with in-warp halves); the carried
chain operands 2 NT + 22; the next chunk's chains 20 NT while the current Oq lives; A fragments in
flight (kd_hi, qd_hi, qd_lo: 12 per k-block; kr^T hi/lo: 8 per tile); W accumulators (12 NT per
tile). The initial state is read and the final state written as f32 bits with 4-byte accesses
(every 32-byte sector fully used), once per CTA: a zero-length sequence writes its initial state
back unchanged.

Compiled (ptxas of nvidia-cutlass-dsl 4.8.1, no GPU run yet): registers 224 / 208 / 198 / 255
at block_v 16 / 32 / 64 / 128 on sm_90a (sm_100a: 222 / 208 / 198 / 255), no local memory;
shared memory (ring + exchange) 98,816 / 104,960 / 100,864 / 109,056 bytes. SASS (sm_90a) of the
chunk loop per warp: 416 / 413 / 577 / 989 instructions. k-split warp: 38 HMMA, 24 MOVM, 100
FADD, 18 FFMA, 26 F2FP, 24 LDSM, ~15 LDS, 2 STS.128 + 2 LDS.128 (exchange), 3 BAR, LDGSTS 14 / 8
per thread; in-warp halves, per n-tile: 70 HMMA, 40 MOVM, 160 FADD, 34 FFMA, 42 F2FP; per warp
44 LDSM, ~23 LDS, LDGSTS 8.

The kernel body is assembled from plain trace-time pieces (_prologue, _chunk_step,
u_to_b_operands, three_term_product, state_tile_update, ...), like recurrence.py's.

Serving variant (KdaRecurrenceFp32Pool, custom call jax_kda_recurrence_fp32_pool_v1): the same
chunk loop on a state pool indexed per sequence (bf16 or f32 rows, updated in place), run in
segments with a checkpoint store between them; the operands of recurrence.py's KdaRecurrencePool
with this mode's records (class docstring; docs/kernel_abi.md). Registers 209 / 212 / 190 / 255
at block_v 16 / 32 / 64 / 128 on sm_90a, no local memory.
"""

import types

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.memory import SmemAllocator

from .. import contract
from . import ptx
from .compile_utils import compile_for_arch
from .recurrence_common import (
    CHUNK,
    FP32_RECORD_BYTES,
    OFF32_GT,
    OFF32_INV_HI,
    OFF32_INV_LO,
    OFF32_KD_HI,
    OFF32_KR_HI,
    OFF32_KR_LO,
    OFF32_MQK_HI,
    OFF32_MQK_LO,
    OFF32_QD_HI,
    OFF32_QD_LO,
    D,
    acc_col,
    acc_row,
    beta_bits,
    checkpoint_segments,
    cta_setup,
    ldmatrix_a_offset,
    ldmatrix_krt_offset,
    ldmatrix_small_offset,
    recurrence_fp32_args,
    recurrence_pool_args,
    zero_padding_out,
)

GRANULES = FP32_RECORD_BYTES // 16  # 16-byte cp.async copies per record
STAGES = 4  # smem ring depth (4 x 23.7 KB at block_v 16: two CTAs per SM)
LOOKAHEAD = STAGES - 1  # iteration c refills the stage of chunk c - 1 with chunk c + LOOKAHEAD
# n-tiles per warp -> (KD_AHEAD, KR_AHEAD): the next chunk's kd / qd A fragments are read KD_AHEAD
# k-blocks ahead of their MMAs, kr^T / gt of k-tile mt KR_AHEAD tiles ahead of W tile mt's. Two
# n-tiles issue twice the MMAs per fragment, so one k-block ahead covers the load there (and
# keeps ptxas below 255 registers at every two-n-tile split: two ahead spills at 32 columns).
AHEAD = {1: (2, 2), 2: (1, 2)}
HALF_TILES = 4  # k-tiles (16 keys each) per key half: P and Oq contract over two halves of 64 keys
XCHG_PAIR_BYTES = 2048  # a warp pair's exchange area: P partials [2][32 lanes][16 B], Oq same


def stage_layout(block_v):
    """(v offset, beta offset, stage bytes) of one ring stage: record | v [16, block_v] bf16 |
    beta: 16 four-byte slots."""
    v_off = FP32_RECORD_BYTES
    beta_off = v_off + CHUNK * block_v * 2
    stage_bytes = (beta_off + CHUNK * 4 + 127) // 128 * 128
    return v_off, beta_off, stage_bytes


def xchg_bytes(block_v, n_tiles=None, k_split=None):
    """The warp pairs' exchange area behind the ring (k-split layouts only)."""
    warps, _, ks = warp_layout(block_v, n_tiles, k_split)
    return (warps // 2) * XCHG_PAIR_BYTES if ks == 2 else 0


def smem_bytes(block_v, n_tiles=None, k_split=None):
    """Shared memory of one CTA: the ring, then the exchange area."""
    return STAGES * stage_layout(block_v)[2] + xchg_bytes(block_v, n_tiles, k_split)


def v_smem_offset(row, col, block_v):
    """Byte offset of v[row, col] (col relative to the CTA's slice) in a stage's v tile."""
    return (row * block_v + col) * 2


# default (n-tiles per warp, k-split) per slice width
DEFAULT_LAYOUT = {16: (1, 2), 32: (1, 2), 64: (1, 1), 128: (2, 1)}
N_TILE_CHOICES = (1, 2)  # 4 n-tiles per warp (128 state registers) do not fit in 255


def warp_layout(block_v, n_tiles=None, k_split=None):
    """(warps per CTA, 8-column n-tiles per warp, k-split) for a slice width.

    k_split 2: a pair of warps per n-tile, warp (pair, h) holding the state k-tiles 4h .. 4h + 3
    (keys 64h ..) of its n-tile(s) and computing key half h of P and Oq (16 / 32 columns: 4 / 8
    warps). k_split 1: one warp holds all eight k-tiles and computes both halves as two
    accumulator sets (64: 8 warps x 1 n-tile; 128: 8 x 2: eight warps of ~255 registers fill the
    register file). `n_tiles` / `k_split` override the default (benchmark knobs: every layout
    gives the same bits); at most eight warps; k_split 2 only with one n-tile per warp."""
    if block_v not in contract.COLUMN_SPLITS:
        raise ValueError(f"block_v must be one of {contract.COLUMN_SPLITS}, got {block_v}")
    d_nt, d_ks = DEFAULT_LAYOUT[block_v]
    if n_tiles is None and k_split is None:
        n_tiles, k_split = d_nt, d_ks
    elif k_split is None:
        k_split = 2 if n_tiles == 1 and block_v // 8 * 2 <= 8 else 1
    elif n_tiles is None:
        n_tiles = 1 if k_split == 2 else max(1, block_v // 64)
    ok = n_tiles in N_TILE_CHOICES and k_split in (1, 2) and not (k_split == 2 and n_tiles != 1)
    warps = block_v // (8 * n_tiles) * k_split if ok else 0
    if not 1 <= warps <= 8 or warps * 8 * n_tiles != block_v * k_split:
        raise ValueError(
            f"no warp layout of {block_v} columns with {n_tiles} n-tiles per warp, k-split"
            f" {k_split}"
        )
    return warps, n_tiles, k_split


def warp_split(block_v, n_tiles=None):
    """(warps per CTA, n-tiles per warp) of the default layout (warp_layout)."""
    warps, nt, _ = warp_layout(block_v, n_tiles)
    return warps, nt


def state_index(mt, nt, i, n_tiles):
    """Index of the f32 register holding S^T[16 (kbase + mt) + acc_row(lane, i // 2)][8 nt +
    acc_col(lane) + i % 2] (accumulator register i of the warp's local k-tile mt, n-tile nt)."""
    return (mt * n_tiles + nt) * 4 + i


class KdaRecurrenceFp32:
    """Host entry + device kernel of the fp32-mode column-split chunk recurrence.

    Algorithm: the module docstring. Layouts: v, out bf16 [T_total, H, 128]; beta bf16
    [T_total, H] (logits); workspace uint8 [H, S, 23040] (chunk j of sequence n in slot
    cu[n] // 16 + n + j); cu_seqlens int32 [N + 1]; states f32 [N, H, 128, 128] (state[n, h, v,
    k]). Constraints: block_v in contract.COLUMN_SPLITS (warp_layout); head dim 128; T_total, H,
    N, S dynamic, int32-sized; 16-byte aligned buffers; cu_seqlens values clamped
    (recurrence_common.sequence_bounds)."""

    def __init__(self, block_v: int = 32, n_tiles: int | None = None, k_split: int | None = None):
        self.block_v = block_v
        self.num_warps, self.n_tiles, self.k_split = warp_layout(block_v, n_tiles, k_split)
        self.k_tiles = 8 // self.k_split
        self.num_threads = 32 * self.num_warps
        self.v_off, self.beta_off, self.stage_bytes = stage_layout(block_v)
        self.xchg_bytes = xchg_bytes(block_v, self.n_tiles, self.k_split)

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,  # bf16 [T_total, H, 128]
        mBeta: cute.Tensor,  # bf16 [T_total, H]
        mWorkspace: cute.Tensor,  # uint8 [H, S, 23040]
        mCuSeqlens: cute.Tensor,  # int32 [N + 1]
        mState0: cute.Tensor,  # f32 [N, H, 128, 128] (n, h, v, k)
        mOut: cute.Tensor,  # bf16 [T_total, H, 128]
        mStateT: cute.Tensor,  # f32 [N, H, 128, 128]
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
        ring = (
            SmemAllocator()
            .allocate(STAGES * self.stage_bytes + self.xchg_bytes, byte_alignment=128)
            .toint()
        )
        cta = _cta_setup_fp32(self, mV, mBeta, mWorkspace, mCuSeqlens, mOut, ring)
        state_off = (Int64(cta.seq) * Int64(cta.num_heads) + Int64(cta.head)) * (D * D)
        s0_base = mState0.iterator.toint() + state_off * 4
        sT_base = mStateT.iterator.toint() + state_off * 4
        state = _state_registers(self)
        _load_state(cta, state, s0_base)
        regs = _loop_registers(self)
        if cta.num_chunks > 0:
            _prologue_loads(cta, ring)
            _prologue(cta, ring, state, regs)
        for c in range(cta.num_chunks):
            _chunk_step(cta, ring, state, regs, c)
        ptx.cp_async_wait(0)  # no copy may still target this CTA's shared memory at exit
        # final state (also for zero-length sequences: the initial state, bit for bit)
        _store_state(cta, state, sT_base)


class KdaRecurrenceFp32Pool(KdaRecurrenceFp32):
    """The serving variant: initial and final states in a pool indexed per sequence (bf16 or f32,
    updated in place), and checkpoints; the operands of the bf16 mode's KdaRecurrencePool
    (recurrence.py) with 23,040-byte records. The chunk loop is the prefill kernel's
    (_chunk_step), so out, the final state and every checkpoint are bitwise the prefill's.

    Per CTA, row = state_indices[seq]:
      - row outside [0, P): a padding slot. No pool, checkpoint or workspace access; the
        sequence's out rows of this CTA's columns are written as zeros.
      - otherwise the initial state is pool[row, head] (f32 as it is, bf16 widened exactly)
        and the final state goes back there (f32, or rounded to bf16 RN: what kda_prefill's
        fp32 path returns for a bf16 state). Every element is read and written by the lane that
        holds it (_state_address: eight lanes cover 32 contiguous bytes of a state row for f32),
        read before the loop and written after it, by this CTA only.
      - checkpoints: with checkpoint_chunks = n16 > 0 the chunk loop runs in segments of n16
        chunks; after segment j, if chunks remain and ck = checkpoint_offsets[seq] + j lies in
        [0, C), the state registers (then the state after chunk (j + 1) n16 - 1: iteration c
        leaves S(c + 1) in them) go to checkpoints[ck, head] in the pool's dtype. Checkpoint j is
        bitwise the final state of a prefill on the first (j + 1) * 16 * n16 tokens."""

    def __init__(self, block_v: int = 32, state_dtype: str = "f32",
                 n_tiles: int | None = None, k_split: int | None = None):
        super().__init__(block_v, n_tiles, k_split)
        self.state_elem_bytes = {"bf16": 2, "f32": 4}[state_dtype]
        assert self.num_threads >= CHUNK * block_v // 8, "a padding slot's zeros: one store each"

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,  # bf16 [T_total, H, 128]
        mBeta: cute.Tensor,  # bf16 [T_total, H]
        mWorkspace: cute.Tensor,  # uint8 [H, S, 23040]
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
            mV, mBeta, mWorkspace, mCuSeqlens, mStateIndices, mCheckpointOffsets, mPool, mOut,
            mCheckpoints, checkpoint_chunks,
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
        esz = self.state_elem_bytes
        ring_bytes = STAGES * self.stage_bytes + self.xchg_bytes
        # + 16: the pool row and the first checkpoint row wait in shared memory across the
        # chunk loops (registers kept there would cost the loop two, or be spilled); the chunk
        # loop's CTA barriers make tid 0's stores visible before they are read
        ring = SmemAllocator().allocate(ring_bytes + 16, byte_alignment=128).toint()
        cta = _cta_setup_fp32(self, mV, mBeta, mWorkspace, mCuSeqlens, mOut, ring)
        row = mStateIndices[cta.seq]
        valid = (row >= 0) & (row < mPool.shape[0])
        if valid:
            if cta.tid == 0:
                ptx.st_shared_b32(ring + ring_bytes, row)
                ptx.st_shared_b32(ring + ring_bytes + 4, mCheckpointOffsets[cta.seq])
            state = _state_registers(self)
            _load_state(cta, state, _head_state(mPool, row, cta, esz), esz)
            regs = _loop_registers(self)
            if cta.num_chunks > 0:
                _prologue_loads(cta, ring)
                _prologue(cta, ring, state, regs)
            seg, num_segs = checkpoint_segments(checkpoint_chunks, cta.num_chunks)
            for j in range(num_segs):
                c0 = j * seg
                c1 = cutlass.min(c0 + seg, cta.num_chunks)
                for c in range(c0, c1):
                    _chunk_step(cta, ring, state, regs, c)
                ck = ptx.ld_shared_b32(ring + ring_bytes + 4) + j  # the first checkpoint row
                if (c1 < cta.num_chunks) & (ck >= 0) & (ck < mCheckpoints.shape[0]):
                    _store_state(cta, state, _head_state(mCheckpoints, ck, cta, esz), esz,
                                 _fresh_lane_terms(cta))
            ptx.cp_async_wait(0)  # no copy may still target this CTA's shared memory at exit
            ptx.cta_barrier()  # tid 0's stash is visible (also when the loop ran no chunk)
            row_again = ptx.ld_shared_b32(ring + ring_bytes)
            _store_state(cta, state, _head_state(mPool, row_again, cta, esz), esz,
                         _fresh_lane_terms(cta))
        if not valid:  # padding slot: no pool, checkpoint or workspace access; zero out rows
            zero_padding_out(
                mOut.iterator.toint() + (Int64(cta.head) * D + Int64(cta.col_cta)) * 2, cta.tid,
                cta.bos, cta.eos, cta.num_chunks, cta.num_heads, self.block_v)


def _head_state(mStates, row, cta, esz):
    """Address of mStates[row, head] ([rows, H, 128, 128], esz-byte elements)."""
    return mStates.iterator.toint() + (Int64(row) * Int64(cta.num_heads) + Int64(cta.head)) * (
        D * D * esz
    )


# ----------------------------------------------------------------------------------------------
# Setup, state I/O, the stage loader
# ----------------------------------------------------------------------------------------------
def _cta_setup_fp32(rec, mV, mBeta, mWorkspace, mCuSeqlens, mOut, ring):
    """recurrence_common.cta_setup (indices, sequence bounds, the loader's sources) with the
    workspace base of this head for 23,040-byte records, and this warp's role (warp_role)."""
    cta = cta_setup(rec, mV, mBeta, mWorkspace, mCuSeqlens, mOut)
    cta.src.ws_head = (
        mWorkspace.iterator.toint()
        + Int64(cta.head) * Int64(mWorkspace.shape[1]) * FP32_RECORD_BYTES
    )
    out_head = mOut.iterator.toint() + Int64(cta.head) * (D * 2)
    warp_role(cta, rec.num_warps, rec.k_split, cta.tid // 32, out_head,
              ring + STAGES * rec.stage_bytes)
    return cta


def warp_role(cta, num_warps, k_split, warp, out_head, xchg):
    """This warp's columns, key half and exchange slots, set on `cta` (plain integer arithmetic:
    DSL values in the kernel, Python ints in the CPU emulator).

    Warp w is n-tile group pair = w // k_split, key half h = w % k_split: columns col_w = 8 NT
    pair ..; k-tiles kbase .. kbase + k_tiles - 1 (kbase = 4h); its swizzled kd / qd / kr tiles'
    k-blocks are read at the stage address + kshift (ldmatrix_*_offset(lane, 4 + j) = 128 +
    ldmatrix_*_offset(lane, j)), gt at + gshift. k_split 2: its P / Oq partials go to the pair's
    exchange slots (x_*_mine; the partner's: x_*_other), the pair's named barriers bar_p, bar_o
    (64 threads, ids 1 .. 8; 0 is the CTA barrier), and it writes the out rows of accumulator
    half h only (out_limit)."""
    NT = cta.n_tiles
    pair = warp // k_split
    cta.k_split = k_split
    cta.k_tiles = 8 // k_split
    cta.col_w = pair * (8 * NT)
    cta.out_lane = [out_head + (cta.col_cta + cta.col_w + nt * 8 + cta.t2) * 2 for nt in range(NT)]
    if k_split == 1:
        cta.kbase, cta.kshift, cta.gshift = 0, 0, 0
        cta.out_limit = [cta.eos, cta.eos]
        return cta
    h = warp % 2
    cta.kbase = h * HALF_TILES
    cta.kshift = h * (HALF_TILES * 32)
    cta.gshift = h * (HALF_TILES * 64)
    x = xchg + pair * XCHG_PAIR_BYTES + cta.lane * 16
    cta.x_p_mine, cta.x_p_other = x + h * 512, x + (1 - h) * 512
    cta.x_o_mine, cta.x_o_other = x + 1024 + h * 512, x + 1024 + (1 - h) * 512
    cta.bar_p = 1 + pair
    cta.bar_o = 1 + num_warps // 2 + pair
    cta.out_limit = [cta.eos * (1 - h), cta.eos * h]  # tok < 0 never holds: no store
    return cta


def _state_registers(rec):
    """This warp's state slice S^T[16 k_tiles, 8 NT], f32 in the accumulator layout
    (state_index)."""
    return cute.make_rmem_tensor(cute.make_layout(4 * rec.k_tiles * rec.n_tiles), Float32)


def _state_address(cta, base, mt, nt, i, esz=4):
    """Global address of the state element register (mt, nt, i) of this lane holds:
    state[n, h, j, k] with j its value column, k its key row (local k-tile mt); esz bytes per
    element (4: f32, 2: bf16 pools)."""
    k = cta.kbase * 16 + mt * 16 + acc_row(cta.lane, i // 2)
    j = cta.col_cta + cta.col_w + nt * 8 + cta.t2 + i % 2
    return base + (Int64(j) * D + Int64(k)) * esz


def _load_state(cta, state, base, esz=4):
    """This lane's state registers from [.., 128 v, 128 k] at `base` (an initial state or a pool
    row): f32 bits as they are (esz 4: the eight lanes of one t read 32 contiguous bytes of a
    state row), or bf16 widened exactly (esz 2: the bits shifted up, as the prefill's Python
    side widens a bf16 state)."""
    NT = cta.n_tiles
    for mt in range(cta.k_tiles):
        for nt in range(NT):
            for i in range(4):
                addr = _state_address(cta, base, mt, nt, i, esz)
                state[state_index(mt, nt, i, NT)] = (
                    ptx.ld_global_f32(addr) if esz == 4
                    else ptx.bf16x2_lo_to_f32(ptx.ld_global_u16(addr))
                )


def _store_state(cta, state, base, esz=4, lane_terms=None):
    """The state registers -> [.., 128 v, 128 k] at `base`: f32 as computed (esz 4) or rounded
    to bf16 (esz 2, round to nearest even, as the prefill's Python side rounds an f32 final
    state to a bf16 one). lane_terms: where _state_address takes the lane's address terms from
    (default `cta`; the pool kernel passes _fresh_lane_terms(cta))."""
    NT = cta.n_tiles
    terms = cta if lane_terms is None else lane_terms
    for mt in range(cta.k_tiles):
        for nt in range(NT):
            for i in range(4):
                addr = _state_address(terms, base, mt, nt, i, esz)
                x = state[state_index(mt, nt, i, NT)]
                if esz == 4:
                    ptx.st_global_f32(addr, x)
                else:
                    ptx.st_global_u16(addr, ptx.pack_bf16x2(x, Float32(0.0)))


def _fresh_lane_terms(cta):
    """The terms _state_address reads (lane, t2, kbase, col_cta, col_w), recomputed from the
    special registers with warp_role's arithmetic: stores after the chunk loops that use them
    make ptxas recompute the terms there instead of keeping the prologue's equal ones alive
    across the loops (which spilled at block_v 128)."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    slice_idx, _, _ = cute.arch.block_idx()
    pair = warp // cta.k_split
    return types.SimpleNamespace(
        lane=lane, t2=acc_col(lane), kbase=(warp % 2) * HALF_TILES if cta.k_split == 2 else 0,
        col_cta=slice_idx * cta.block_v, col_w=pair * (8 * cta.n_tiles))


def _load_stage(src, chunk, stage):
    """All threads: cp.async of one chunk's 23,040-byte record, its v rows (this CTA's columns)
    and beta logits into the ring stage at shared address `stage`. Nothing past the sequence end
    is read (recurrence._load_stage's v / beta copy, for this record size)."""
    rec = src.ws_head + Int64(src.slot0 + chunk) * FP32_RECORD_BYTES
    n = src.nthreads
    for i in range((GRANULES + n - 1) // n):
        gi = src.tid + i * n
        ptx.cp_async_16_if(stage + gi * 16, rec + Int64(gi) * 16, gi, Int32(GRANULES))
    row_tok0 = src.bos + chunk * CHUNK
    limit = cutlass.min(src.eos, row_tok0 + CHUNK)
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
        ptx.cp_async_16_if(stage + src.v_off + gi * 16, gaddr, tok, limit)
    tok = row_tok0 + src.tid  # nthreads >= 64 > CHUNK: threads tid >= 16 copy nothing
    elem = tok * src.num_heads + src.head
    elem_addr = src.beta_base + Int64(elem) * 2
    # the aligned word holding the element stays inside the array unless the element is the
    # array's last one and starts a word
    async_ok = ptx.select_lt(elem + 1, src.beta_elems, Int32(1), Int32(elem_addr) & 2)
    ptx.beta_to_shared_if(stage + src.beta_off + src.tid * 4, elem_addr, async_ok, tok, limit)


def _prologue_loads(cta, ring):
    """The ring's first LOOKAHEAD stages (chunks 0 .. LOOKAHEAD - 1, clamped to the last)."""
    for s in range(LOOKAHEAD):
        _load_stage(cta.src, cutlass.min(Int32(s), cta.last_chunk), ring + s * cta.stage_bytes)
        ptx.cp_async_commit()


# ----------------------------------------------------------------------------------------------
# Operands from a stage
# ----------------------------------------------------------------------------------------------
def _chain_int_count(n_tiles):
    """Int32 registers of _chain_operands: v (2 per n-tile), row masks (2), INV hi / lo (8),
    kr^T of the warp's first k-tile hi / lo (8)."""
    return 2 * n_tiles + 2 + 8 + 8


CHAIN_FLOATS = 4  # b (2 rows of the lane), gt of the warp's first k-tile (2 rows)


def _chain_operands(cta, stage, row_tok0):
    """The serial chain's operands of the chunk in `stage` (first token row_tok0) for one lane:
    (a flat Int32 list, see _split_chain_operands; [b per half, gt of local k-tile 0 per half])."""
    src, lane = cta.src, cta.lane
    ints = []
    for nt in range(cta.n_tiles):
        for half in range(2):
            col = cta.col_w + nt * 8 + acc_col(lane)
            ints.append(
                ptx.ld_shared_b32(
                    stage + src.v_off + v_smem_offset(acc_row(lane, half), col, src.block_v)
                )
            )
    for half in range(2):  # all ones for rows before the sequence end, else 0
        row = row_tok0 + acc_row(lane, half)
        ints.append(ptx.select_lt(row, src.eos, Int32(-1), Int32(0)))
    small_off = ldmatrix_small_offset(lane)
    ints += ptx.ldmatrix_x4(stage + OFF32_INV_HI + small_off)
    ints += ptx.ldmatrix_x4(stage + OFF32_INV_LO + small_off)
    kr_hi, kr_lo = krt_operands(stage + cta.kshift, lane, 0)
    ints += kr_hi + kr_lo
    floats = [
        ptx.sigmoid_exp2(ptx.bf16x2_lo_to_f32(beta_bits(src, stage, row_tok0, acc_row(lane, half))))
        for half in range(2)
    ]
    floats += gt_rows(stage + cta.gshift, lane, 0)
    return ints, floats


def _split_chain_operands(ints, n_tiles):
    """(v[nt][half], row masks [half], (INV_hi, INV_lo), (kr^T_hi, kr^T_lo) of local k-tile 0)."""
    v = [ints[2 * nt : 2 * nt + 2] for nt in range(n_tiles)]
    at = 2 * n_tiles
    row_mask = ints[at : at + 2]
    inv = (ints[at + 2 : at + 6], ints[at + 6 : at + 10])
    kr0 = (ints[at + 10 : at + 14], ints[at + 14 : at + 18])
    return v, row_mask, inv, kr0


def krt_operands(stage, lane, mt):
    """(kr_hi^T, kr_lo^T) A fragments of k-tile mt (ldmatrix.trans of the swizzled kr tiles)."""
    off = ldmatrix_krt_offset(lane, mt)
    return (
        ptx.ldmatrix_x4_trans(stage + OFF32_KR_HI + off),
        ptx.ldmatrix_x4_trans(stage + OFF32_KR_LO + off),
    )


def gt_rows(stage, lane, mt):
    """gt[k] of this lane's two accumulator rows of k-tile mt."""
    return [
        ptx.ld_shared_f32(stage + OFF32_GT + (mt * 16 + acc_row(lane, half)) * 4)
        for half in range(2)
    ]


def mqk_operands(stage, lane):
    """(Mqk_hi, Mqk_lo) A fragments."""
    off = ldmatrix_small_offset(lane)
    return ptx.ldmatrix_x4(stage + OFF32_MQK_HI + off), ptx.ldmatrix_x4(stage + OFF32_MQK_LO + off)


def p_oq_operands(stage, lane, kb):
    """(kd_hi, qd_hi, qd_lo) A fragments of k-block kb."""
    off = ldmatrix_a_offset(lane, kb)
    return (
        ptx.ldmatrix_x4(stage + OFF32_KD_HI + off),
        ptx.ldmatrix_x4(stage + OFF32_QD_HI + off),
        ptx.ldmatrix_x4(stage + OFF32_QD_LO + off),
    )


# ----------------------------------------------------------------------------------------------
# The arithmetic, piece by piece (docs/fp32_mode.md section 1)
# ----------------------------------------------------------------------------------------------
def sum_terms(hh, hl, lh=None):
    """mma_product's sum of a product's term chains, per accumulator register: hh + hl, or
    hh + (hl + lh) (small terms first)."""
    if lh is None:
        return [ptx.fadd(a, b) for a, b in zip(hh, hl)]
    return [ptx.fadd(a, ptx.fadd(b, c)) for a, b, c in zip(hh, hl, lh)]


def add_halves(x0, x1):
    """P = P_0 + P_1, Oq = Oq_0 + Oq_1 per accumulator register (f32 addition is commutative,
    bitwise: either warp of a pair may add its own half first)."""
    return [ptx.fadd(a, b) for a, b in zip(x0, x1)]


def split_to_b_operands(c4, row_mask=None):
    """An f32 accumulator tile (4 registers, K = its 16 rows) -> the B operands (hi, lo) of
    split(tile): each row pair is split into packed hi / lo words, movmatrix.trans of the top and
    bottom halves' words is the B operand. row_mask: per half, ANDed into both words (rows past
    the sequence end: exactly 0)."""
    words = [ptx.split_hi_lo_bf16x2(c4[2 * half], c4[2 * half + 1]) for half in range(2)]
    if row_mask is not None:
        words = [(hi & row_mask[half], lo & row_mask[half]) for half, (hi, lo) in enumerate(words)]
    b_hi = (ptx.movmatrix_trans(words[0][0]), ptx.movmatrix_trans(words[1][0]))
    b_lo = (ptx.movmatrix_trans(words[0][1]), ptx.movmatrix_trans(words[1][1]))
    return b_hi, b_lo


def three_term_product(a_hi, a_lo, b_hi, b_lo, zero_f):
    """a . b with terms hh, hl, lh (three independent one-MMA chains from zero), summed
    hh + (hl + lh)."""
    zero4 = [zero_f] * 4
    hh = ptx.mma_bf16_16816(a_hi, b_hi, zero4)
    hl = ptx.mma_bf16_16816(a_hi, b_lo, zero4)
    lh = ptx.mma_bf16_16816(a_lo, b_hi, zero4)
    return sum_terms(hh, hl, lh)


def u_values(p4, v_in, b_in):
    """u = (f32(v) - P) * b for one n-tile's accumulator tile: p4 = P (4 f32), v_in[half] the
    packed bf16 v of the lane's row pair, b_in[half] f32 sigmoid(beta) of that row."""
    u = []
    for half in range(2):
        v_pair = (ptx.bf16x2_lo_to_f32(v_in[half]), ptx.bf16x2_hi_to_f32(v_in[half]))
        for e in range(2):
            u.append(ptx.fmul(ptx.fsub(v_pair[e], p4[2 * half + e]), b_in[half]))
    return u


def u_to_b_operands(p4, v_in, b_in, row_mask, a_inv, zero_f):
    """Steps 3 and 4 for one n-tile: u from P (summed over both key halves), split(u) (masked
    rows 0), U = INV . u (three terms), split(U) -> (U_hi, U_lo) as B operands (K = the chunk's
    16 rows)."""
    return big_u_operands(a_inv, u_operands(p4, v_in, b_in, row_mask), zero_f)


def u_operands(p4, v_in, b_in, row_mask):
    """Step 3 for one n-tile: split(u) as (u_hi, u_lo) B operands, rows past the end 0."""
    return split_to_b_operands(u_values(p4, v_in, b_in), row_mask)


def big_u_operands(a_inv, u_ops, zero_f):
    """Step 4 for one n-tile: U = INV . u (three terms) from split(u) (u_operands), split(U) ->
    (U_hi, U_lo) as B operands."""
    u_hi, u_lo = u_ops
    return split_to_b_operands(three_term_product(a_inv[0], a_inv[1], u_hi, u_lo, zero_f))


def state_tile_update(s4, gt2, w4):
    """S[j, k] = fmaf(S[j, k], gt[k], W[k, j]) for one accumulator tile (f32 .ftz); gt2 per
    half (the lane's two k rows)."""
    return [ptx.ffma(s4[i], gt2[i // 2], w4[i]) for i in range(4)]


def p_oq_step(a_ops, b_hi, b_lo, chains):
    """One k-block of P's two chains (kd_hi.S_hi, kd_hi.S_lo) and Oq's three (qd_hi.S_hi,
    qd_hi.S_lo, qd_lo.S_hi): chains = [p_hh, p_hl, o_hh, o_hl, o_lh], 4 f32 each."""
    a_kd, a_qd_hi, a_qd_lo = a_ops
    p_hh, p_hl, o_hh, o_hl, o_lh = chains
    return [
        ptx.mma_bf16_16816(a_kd, b_hi, p_hh),
        ptx.mma_bf16_16816(a_kd, b_lo, p_hl),
        ptx.mma_bf16_16816(a_qd_hi, b_hi, o_hh),
        ptx.mma_bf16_16816(a_qd_hi, b_lo, o_hl),
        ptx.mma_bf16_16816(a_qd_lo, b_hi, o_lh),
    ]


def half_sums(chains):
    """(P_h, Oq_h) of one key half's five chains: hh + hl, hh + (hl + lh)."""
    return sum_terms(chains[0], chains[1]), sum_terms(chains[2], chains[3], chains[4])


def out_pair(oq4, m4, half):
    """bf16x2 out of the lane's row pair `half`: bf16(Oq + Mqk.U) (Oq summed over the halves)."""
    return ptx.pack_bf16x2_i32(
        ptx.fadd(oq4[2 * half], m4[2 * half]), ptx.fadd(oq4[2 * half + 1], m4[2 * half + 1])
    )


# ----------------------------------------------------------------------------------------------
# Loop-carried registers, the prologue, one chunk step
# ----------------------------------------------------------------------------------------------
class _LoopRegs:
    """Registers carried across the chunk loop's back-edge (rmem tensors)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


CHAINS = 5  # P: hh, hl; Oq: hh, hl, lh


def _loop_registers(rec):
    """P(c) / Oq(c): the last key half's five unsummed chains (20 f32 per n-tile: summing them
    before the back-edge would make every warp wait for its MMAs before the barrier) and, with
    both halves in one warp (k_split 1), half 0's sums P_0, Oq_0 (8 per n-tile); chunk c's serial
    chain operands, read in iteration c - 1 before the barrier (ptxas moves no load across it)."""
    NT = rec.n_tiles
    n_ints = _chain_int_count(NT)
    return _LoopRegs(
        acc=cute.make_rmem_tensor(cute.make_layout(4 * CHAINS * NT), Float32),
        part=(cute.make_rmem_tensor(cute.make_layout(8 * NT), Float32)
              if rec.k_split == 1 else None),
        ints=cute.make_rmem_tensor(cute.make_layout(n_ints), Int32),
        floats=cute.make_rmem_tensor(cute.make_layout(CHAIN_FLOATS), Float32),
        n_ints=n_ints,
        zero_f=Float32(0.0),
    )


def _chains_of(regs, nt):
    """The five carried chains of n-tile nt, each a list of 4 f32."""
    base = nt * 4 * CHAINS
    return [[regs.acc[base + 4 * ch + i] for i in range(4)] for ch in range(CHAINS)]


def _store_chains(regs, nt, chains):
    base = nt * 4 * CHAINS
    for ch in range(CHAINS):
        for i in range(4):
            regs.acc[base + 4 * ch + i] = chains[ch][i]


def _part_of(regs, nt):
    """(P_0, Oq_0) of n-tile nt (k_split 1)."""
    base = 8 * nt
    return [regs.part[base + i] for i in range(4)], [regs.part[base + 4 + i] for i in range(4)]


def _store_part(regs, nt, p0, o0):
    for i in range(4):
        regs.part[8 * nt + i] = p0[i]
        regs.part[8 * nt + 4 + i] = o0[i]


def _store_chain_operands(regs, ints, floats):
    for i in range(regs.n_ints):
        regs.ints[i] = ints[i]
    for i in range(CHAIN_FLOATS):
        regs.floats[i] = floats[i]


def _state_tile(state, mt, nt, n_tiles):
    return [state[state_index(mt, nt, i, n_tiles)] for i in range(4)]


def _set_state_tile(state, mt, nt, n_tiles, s4):
    for i in range(4):
        state[state_index(mt, nt, i, n_tiles)] = s4[i]


def _zero_chains(regs, n_tiles):
    return [[[regs.zero_f] * 4 for _ in range(CHAINS)] for _ in range(n_tiles)]


# With both key halves in one warp, half 0's chains (local k-blocks 0..3) are summed into P_0, Oq_0
# after k-block SUM_HALF0_AT's MMAs were issued (not right after k-block 3's: the sums would wait
# for those MMAs and hold up the in-order issue).
SUM_HALF0_AT = HALF_TILES


def _prologue(cta, ring, state, regs):
    """Chunk 0 landed; P(0), Oq(0) from the initial state, chunk 0's chain operands."""
    NT, KT = cta.n_tiles, cta.k_tiles
    lane = cta.lane
    ptx.cp_async_wait(LOOKAHEAD - 1)  # chunk 0 has landed (this thread's copies)
    ptx.cta_barrier()  # ... and everybody's
    chains = _zero_chains(regs, NT)
    for kb in range(KT):
        if kb == HALF_TILES:  # k_split 1: key half 0 complete
            for nt in range(NT):
                _store_part(regs, nt, *half_sums(chains[nt]))
            chains = _zero_chains(regs, NT)
        a_ops = p_oq_operands(ring + cta.kshift, lane, kb)
        for nt in range(NT):
            b_hi, b_lo = split_to_b_operands(_state_tile(state, kb, nt, NT))
            chains[nt] = p_oq_step(a_ops, b_hi, b_lo, chains[nt])
    for nt in range(NT):
        _store_chains(regs, nt, chains[nt])
    ints, floats = _chain_operands(cta, ring, cta.bos)
    _store_chain_operands(regs, ints, floats)


def _p_of_chunk(cta, carried, part):
    """P(c) = P_0 + P_1 per n-tile. k_split 2: this warp's key half goes to its exchange slot,
    the pair meets at its named barrier bar_p, the partner's half is read back (the serial
    chain's only shared-memory round trip, first in the iteration's memory order)."""
    p_last = [sum_terms(carried[nt][0], carried[nt][1]) for nt in range(cta.n_tiles)]
    if cta.k_split == 1:
        return [add_halves(part[nt][0], p_last[nt]) for nt in range(cta.n_tiles)]
    ptx.st_shared_v4_f32(cta.x_p_mine, p_last[0])
    ptx.named_barrier_sync(cta.bar_p, 64)
    return [add_halves(p_last[0], ptx.ld_shared_v4_f32(cta.x_p_other))]


def _chunk_step(cta, ring, state, regs, c):
    """Iteration c of the chunk loop (module docstring: software pipeline)."""
    NT, KT = cta.n_tiles, cta.k_tiles
    KD_AHEAD, KR_AHEAD = AHEAD[NT]
    lane = cta.lane
    zero_f = regs.zero_f
    src = cta.src
    # Chunk c+1 visible to all; the stage of chunk c-1 is free (refilled further down).
    ptx.cp_async_wait(LOOKAHEAD - 2)
    ptx.cta_barrier()
    carried = [_chains_of(regs, nt) for nt in range(NT)]
    part = [_part_of(regs, nt) for nt in range(NT)] if cta.k_split == 1 else None
    # The serial chain: P(c) = P_0 + P_1 (the pair's exchange before any other shared access of
    # this iteration), then u, U (steps 3, 4) below.
    p = _p_of_chunk(cta, carried, part)
    cur = ring + (c % STAGES) * cta.stage_bytes
    nxt = ring + ((c + 1) % STAGES) * cta.stage_bytes
    cur_k, nxt_k, cur_g = cur + cta.kshift, nxt + cta.kshift, cur + cta.gshift
    row_tok0 = cta.bos + c * CHUNK

    v_in, row_mask, a_inv, a_kr0 = _split_chain_operands(
        [regs.ints[i] for i in range(regs.n_ints)], NT
    )
    b_in = [regs.floats[0], regs.floats[1]]
    a_kr = [None] * KT
    gt = [None] * KT
    a_kr[0] = a_kr0
    gt[0] = [regs.floats[2], regs.floats[3]]
    for mt in range(1, 1 + KR_AHEAD):
        a_kr[mt] = krt_operands(cur_k, lane, mt)
        gt[mt] = gt_rows(cur_g, lane, mt)
    a_next = [None] * KT
    for kb in range(KD_AHEAD):
        a_next[kb] = p_oq_operands(nxt_k, lane, kb)

    ub = [u_to_b_operands(p[nt], v_in[nt], b_in, row_mask, a_inv, zero_f) for nt in range(NT)]
    # This warp's key half of Oq(c) (its chains completed long ago) to the exchange slot.
    oq_last = [sum_terms(*carried[nt][2:]) for nt in range(NT)]
    if cta.k_split == 2:
        ptx.st_shared_v4_f32(cta.x_o_mine, oq_last[0])
    # W tile 0 (on the chain), then Mqk . U (off it).
    w = [None] * KT
    w[0] = [three_term_product(a_kr[0][0], a_kr[0][1], ub[nt][0], ub[nt][1], zero_f)
            for nt in range(NT)]
    a_mqk = mqk_operands(cur, lane)
    m_acc = [three_term_product(a_mqk[0], a_mqk[1], ub[nt][0], ub[nt][1], zero_f)
             for nt in range(NT)]

    # State tile by tile: W tile mt + 1 issued while tile mt is folded in; each updated tile is
    # split and feeds k-block mt of the next chunk's five chains. On the last chunk the
    # next-chunk products read a duplicate of the last record and are discarded.
    chains = _zero_chains(regs, NT)
    done = [None] * NT  # k_split 1: half 0's chains of the next chunk, summed at SUM_HALF0_AT
    for mt in range(KT):
        if mt + KD_AHEAD < KT:
            a_next[mt + KD_AHEAD] = p_oq_operands(nxt_k, lane, mt + KD_AHEAD)
        if mt + 1 + KR_AHEAD < KT:
            a_kr[mt + 1 + KR_AHEAD] = krt_operands(cur_k, lane, mt + 1 + KR_AHEAD)
            gt[mt + 1 + KR_AHEAD] = gt_rows(cur_g, lane, mt + 1 + KR_AHEAD)
        if mt + 1 < KT:
            w[mt + 1] = [
                three_term_product(a_kr[mt + 1][0], a_kr[mt + 1][1], ub[nt][0], ub[nt][1], zero_f)
                for nt in range(NT)
            ]
        if mt == HALF_TILES and KT > HALF_TILES:  # key half 1 starts from zero
            done = chains
            chains = _zero_chains(regs, NT)
        for nt in range(NT):
            s4 = state_tile_update(_state_tile(state, mt, nt, NT), gt[mt], w[mt][nt])
            _set_state_tile(state, mt, nt, NT, s4)
            b_hi, b_lo = split_to_b_operands(s4)
            chains[nt] = p_oq_step(a_next[mt], b_hi, b_lo, chains[nt])
        if mt == SUM_HALF0_AT and KT > HALF_TILES:
            for nt in range(NT):
                _store_part(regs, nt, *half_sums(done[nt]))
        if mt == 0:
            # out = bf16(Oq + Mqk . U), Oq = Oq_0 + Oq_1; valid rows only, registers -> global
            # (step 5). k_split 2: the pair's Oq halves meet here; each warp writes the rows of
            # its accumulator half (out_limit).
            if cta.k_split == 2:
                ptx.named_barrier_sync(cta.bar_o, 64)
                oq = [add_halves(oq_last[0], ptx.ld_shared_v4_f32(cta.x_o_other))]
            else:
                oq = [add_halves(part[nt][1], oq_last[nt]) for nt in range(NT)]
            for nt in range(NT):
                for half in range(2):
                    tok = row_tok0 + acc_row(lane, half)
                    addr = cta.out_lane[nt] + Int64(tok) * cta.out_row_bytes
                    value = out_pair(oq[nt], m_acc[nt], half)
                    ptx.st_global_b32_if(addr, value, tok, cta.out_limit[half])
        if mt == 1:
            # refill the stage freed by the barrier (chunk c - 1's) with chunk c + LOOKAHEAD
            _load_stage(
                src,
                cutlass.min(c + LOOKAHEAD, cta.last_chunk),
                ring + ((c + LOOKAHEAD) % STAGES) * cta.stage_bytes,
            )
            ptx.cp_async_commit()
        if mt == 2:
            # chunk c+1's serial-chain operands (on the last chunk: a duplicate, never used)
            ints, floats = _chain_operands(cta, nxt, row_tok0 + CHUNK)
            _store_chain_operands(regs, ints, floats)
    for nt in range(NT):
        _store_chains(regs, nt, chains[nt])


def compile_kernel(
    block_v: int = 32,
    arch: str = "sm_90a",
    *,
    state_dtype: str | None = None,
    serving: bool = False,
    n_tiles: int | None = None,
    k_split: int | None = None,
    dump_dir: str | None = None,
):
    """The fp32-mode column-split recurrence with `block_v` value columns per CTA, compiled for
    `arch` (compile_utils.compile_for_arch); `n_tiles` per warp and `k_split`: warp_layout. With
    serving=True the state-pool variant (KdaRecurrenceFp32Pool) for a `state_dtype` pool."""
    if serving:
        return compile_for_arch(
            KdaRecurrenceFp32Pool(block_v, state_dtype, n_tiles, k_split),
            recurrence_pool_args(state_dtype, FP32_RECORD_BYTES), arch, dump_dir=dump_dir)
    return compile_for_arch(KdaRecurrenceFp32(block_v, n_tiles, k_split), recurrence_fp32_args(),
                            arch, dump_dir=dump_dir)
