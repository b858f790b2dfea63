"""The serial chains of the backward pass (jax_kda.reference_backward, steps 2 and 3) as one GPU
kernel: both chunked linear recurrences of a 128 x 128 f32 state side by side in one launch,
column split, state in registers, every product on tensor cores as three TF32 MMAs ("3xTF32").

Per chain (row n, head h), with X [128 (v), 128 (k)] and chunks c in the chain's order:

    X = init[reset[n, c], h]        if 0 <= reset[n, c] < Ni   (X = 0 before the first chunk)
    states[n, h, c] = X             the state entering chunk c
    P = A_c X^T                     A_c [16, 128 (k)]        -> P [16, 128 (v)]
    Z = Y_c - [P; 0]                Y_c [R, 128 (v)]         (rows 16 .. R - 1 of Y_c as they are)
    z[n, h, c] = Z[:16]
    X = X Diag(gamma_c) + Z^T B_c   gamma_c [128 (k)], B_c [R, 128 (k)]

The forward chain (R = 16, c = 0, 1, .., C - 1) is the state recompute: A = kd, Y = v,
B = Diag(b) W^T kr, gamma = gt, so Z is the residual v - kd S^T. The reverse chain (R = 32,
c = C - 1, .., 0) is the state gradient's: A = W^T kr, Y = [-W^T Mqk^T dout; dout],
B = [Diag(b) kd; qd], gamma = gt, so Z[:16] is -du. jax_kda.reference_backward builds the
operands. The two chains share gamma; each has its own reset, init, A, B, Y and results.

Arithmetic. Every product of two f32 matrices is split(a) x split(b) on
`mma.sync.m16n8k8.tf32` (ptx.split_tf32: a = hi + lo, hi and lo tf32, exact to 2^-22 relative),
as the three MMAs lo.hi, hi.lo, hi.hi into one f32 accumulator in that order (lo.lo, below
2^-22 of the product, is dropped). Per warp (16 value rows of one chain's state):
  * P^T [16 (v), 16 (r)] = X A^T: per r-tile of 8, four accumulators from zero, quarter q
    taking the key tiles 4 q .. 4 q + 3 in order (three MMAs each); P = (q0 + q1) + (q2 + q3).
  * Z^T = Y^T - P^T (one f32 subtraction), then X = X * gamma[k] (one f32 multiply) and the
    update's MMAs accumulate onto it: r-tiles of 8 rows ascending, each key tile's three MMAs.
The same instructions run for every value row and chunk, and there is one launch shape, so the
results are bitwise equal run to run. Against an f32 FMA evaluation they differ by the
accumulators' order and the dropped lo.lo term: a few f32 ulps per product
(tests/test_gpu_backward.py bounds the states' and z's relative RMSE).

Layout. Task = (16 WARPS value rows, chain, head, row n), grid (2 SLICES, H, N): x < SLICES the
forward chain's value rows BLOCK_V x .., the others the reverse chain's; WARPS warps, warp w
owning the value rows v0 + 16 w .. + 15. The state lives in the warp's registers as the
m16n8 accumulator of X [16 (v), 8 (k)] per key tile kt (64 f32 per lane): lane (g, t) holds
X[g, 8 kt + 2t], X[g, 8 kt + 2t + 1], X[g + 8, 8 kt + 2t], X[g + 8, 8 kt + 2t + 1]. An
accumulator tile is an MMA's A operand for a K of 8 whose logical columns t and t + 4 are the
physical columns 2t and 2t + 1, so X feeds P = A X^T (K = the keys) and Z^T feeds the update
(K = the rows r) straight from registers, and the B operands (A's rows, B's rows) are read from
shared memory in the same column order. No state goes through shared memory.

Shared memory: a ring of two stages (chunk c is read while chunk c + 1 is copied in by bulk
copies completing on the stage's mbarrier), each gamma [128] | A [16, 128] | B [32, 128] | Y [32,
BLOCK_V] (rows padded so that every fragment load is free of bank conflicts), f32, 30,720 bytes
(the forward chain fills 16 of the 32 rows of B and Y): 61,456 bytes with the mbarriers, so three
CTAs fit an SM. The reset index of the next chunk is read from global memory while a chunk runs.

No bounds to trust: the grid covers [N, H] exactly from the tensors' shapes, chunk loops run over
[0, C), and a reset index outside [0, Ni) reads nothing.
"""

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.memory import SmemAllocator

from .. import contract
from . import ptx
from .compile_utils import compile_for_arch, fake_stream, fake_tensor, symbol

D = contract.HEAD_DIM
CHUNK = contract.CHUNK
TILE_V = 16  # value rows per warp: the MMA's M
WARPS = 2
BLOCK_V = WARPS * TILE_V  # value rows per CTA
SLICES = D // BLOCK_V  # CTAs per chain
THREADS = 32 * WARPS
KEY_TILES = D // 8  # the state's n-tiles, P's k-steps
QUARTERS = 4  # P's accumulators per r-tile
STAGES = 2
ROWS_F, ROWS_R = contract.FORWARD_CHAIN_ROWS, contract.REVERSE_CHAIN_ROWS
# a stage: gamma [128] | A [16 rows, 256 words] | B [R / 2 row pairs, 512 words] | Y [R, BLOCK_V],
# laid out for the reverse chain's R (A and B as split tf32 pairs, docs/kernel_abi.md). Row
# pitches: A's 16-byte loads (rows g, two per quarter-warp) land 64 bytes apart mod 128, B's
# (row pairs t, keys g) 32 bytes apart per row pair, Y's 4-byte loads (rows 2t, columns g) 8
# banks apart.
A_PITCH = 2 * D * 4 + 64
B_PITCH = 4 * D * 4 + 32
Y_PITCH = (BLOCK_V + 4) * 4
A_OFF = D * 4
B_OFF = A_OFF + CHUNK * A_PITCH
Y_OFF = B_OFF + ROWS_R // 2 * B_PITCH
STAGE_BYTES = Y_OFF + ROWS_R * Y_PITCH
BAR_OFF = STAGES * STAGE_BYTES
SMEM_BYTES = BAR_OFF + STAGES * 8


class KdaStateChains:
    """Host entry + device kernel. Layouts (compact row-major, f32 unless said), per chain
    (F: forward, R: reverse): reset int32 [N, C]; init [Ni, H, 128, 128]; A [N, H, C, 16, 256]
    and B [N, H, C, R, 256] as split tf32 pairs (docs/kernel_abi.md, custom call 7); Y
    [N, H, C, R, 128]; results states [N, H, C, 128, 128] and z [N, H, C, 16, 128]; shared gamma
    [N, H, C, 128]. N, C, H and each chain's Ni dynamic."""

    @cute.jit
    def __call__(self, mResetF: cute.Tensor, mInitF: cute.Tensor, mResetR: cute.Tensor,
                 mInitR: cute.Tensor, mGamma: cute.Tensor, mAF: cute.Tensor, mBF: cute.Tensor,
                 mYF: cute.Tensor, mAR: cute.Tensor, mBR: cute.Tensor, mYR: cute.Tensor,
                 mStatesF: cute.Tensor, mZF: cute.Tensor, mStatesR: cute.Tensor,
                 mZR: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mResetF, mInitF, mResetR, mInitR, mGamma, mAF, mBF, mYF, mAR, mBR, mYR,
                    mStatesF, mZF, mStatesR, mZR).launch(
            grid=[2 * SLICES, mGamma.shape[1], mGamma.shape[0]],
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mResetF: cute.Tensor, mInitF: cute.Tensor, mResetR: cute.Tensor,
               mInitR: cute.Tensor, mGamma: cute.Tensor, mAF: cute.Tensor, mBF: cute.Tensor,
               mYF: cute.Tensor, mAR: cute.Tensor, mBR: cute.Tensor, mYR: cute.Tensor,
               mStatesF: cute.Tensor, mZF: cute.Tensor, mStatesR: cute.Tensor,
               mZR: cute.Tensor):
        smem = SmemAllocator().allocate(SMEM_BYTES, byte_alignment=128).toint()
        tid, _, _ = cute.arch.thread_idx()
        x_idx, head, row = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32
        num_heads = mGamma.shape[1]
        num_chunks = mGamma.shape[2]
        # the chain this CTA runs (uniform over the CTA): the forward one ...
        reverse = Int32(0)
        rows = Int32(ROWS_F)
        slice_idx = x_idx
        reset_base = mResetF.iterator.toint()
        init_base = mInitF.iterator.toint()
        num_init = mInitF.shape[0]
        a_base = mAF.iterator.toint()
        b_base = mBF.iterator.toint()
        y_base = mYF.iterator.toint()
        states_base = mStatesF.iterator.toint()
        z_base = mZF.iterator.toint()
        if x_idx >= SLICES:  # ... or the reverse one
            reverse = Int32(1)
            rows = Int32(ROWS_R)
            slice_idx = x_idx - SLICES
            reset_base = mResetR.iterator.toint()
            init_base = mInitR.iterator.toint()
            num_init = mInitR.shape[0]
            a_base = mAR.iterator.toint()
            b_base = mBR.iterator.toint()
            y_base = mYR.iterator.toint()
            states_base = mStatesR.iterator.toint()
            z_base = mZR.iterator.toint()
        v0 = slice_idx * BLOCK_V
        first_chunk = (Int64(row) * Int64(num_heads) + Int64(head)) * Int64(num_chunks)  # (n, h)
        reset_row = reset_base + Int64(row) * Int64(num_chunks) * 4
        operands = (mGamma.iterator.toint(), a_base, b_base, y_base + Int64(v0) * 4)
        bars = smem + BAR_OFF
        if tid == 0:
            for s in cutlass.range_constexpr(STAGES):
                ptx.mbar_init(bars + s * 8, Int32(1))
            ptx.fence_mbarrier_init()
        ptx.cta_barrier()

        g = lane // 4
        t = lane % 4
        vw = v0 + TILE_V * warp  # the warp's first value row
        x = cute.make_rmem_tensor(cute.make_layout(KEY_TILES * 4), Float32)  # accumulator tiles
        for i in cutlass.range_constexpr(KEY_TILES * 4):
            x[i] = Float32(0.0)
        # the byte offset in a [128, 128] state of this lane's 8 bytes in key tile 0, value row
        # g (h = 0) or g + 8 (h = 1); key tile kt is 32 bytes further each
        elem = [(Int64(vw + g + 8 * h) * D + Int64(2 * t)) * 4 for h in range(2)]
        # and in a [16, 128] z of accumulator element i of r-tile 0 (row 2t + i % 2, value row
        # g + 8 (i // 2)); r-tile nr is 8 rows further
        z_elem = [(Int64(2 * t + i % 2) * D + Int64(vw + g + 8 * (i // 2))) * 4 for i in range(4)]

        first = reverse * (num_chunks - 1)  # the chunk visited first (num_chunks > 0)
        if num_chunks > 0:
            _load_stage(tid, rows, first_chunk + Int64(first), smem, bars, *operands)
        reset_next = ptx.ld_global_b32_if(reset_row + Int64(first) * 4, Int32(0), num_chunks)
        for step in range(num_chunks):
            c = step + reverse * (num_chunks - 1 - 2 * step)  # the chunk visited at `step`
            reset = reset_next
            if step + 1 < num_chunks:
                following = c + 1 - 2 * reverse
                nxt = (step + 1) % STAGES
                _load_stage(tid, rows, first_chunk + Int64(following),
                            smem + nxt * STAGE_BYTES, bars + nxt * 8, *operands)
                reset_next = ptx.ld_global_b32_if(reset_row + Int64(following) * 4, Int32(0),
                                                  Int32(1))
            if (reset >= 0) & (reset < num_init):
                base = init_base + (Int64(reset) * Int64(num_heads) + Int64(head)) * (D * D * 4)
                for kt in cutlass.range_constexpr(KEY_TILES):
                    for h in cutlass.range_constexpr(2):
                        w = ptx.ld_global_v2(base + elem[h] + kt * 32)
                        for i in cutlass.range_constexpr(2):
                            x[4 * kt + 2 * h + i] = ptx.u32_as_f32(w[i])
            chunk = first_chunk + Int64(c)
            out = states_base + chunk * (D * D * 4)
            for kt in cutlass.range_constexpr(KEY_TILES):
                for h in cutlass.range_constexpr(2):
                    ptx.st_global_v2_f32(out + elem[h] + kt * 32,
                                         [x[4 * kt + 2 * h], x[4 * kt + 2 * h + 1]])
            cur = step % STAGES
            ptx.mbar_wait(bars + cur * 8, (step // STAGES) % 2)  # chunk c's stage has landed
            stage = smem + cur * STAGE_BYTES
            z = _residual(stage, x, g, t, warp)
            z_out = z_base + chunk * (CHUNK * D * 4)
            for nr in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(4):
                    ptx.st_global_f32(z_out + z_elem[i] + nr * (8 * D * 4), z[4 * nr + i])
            _scale_by_gamma(stage, x, t)
            for rt in cutlass.range_constexpr(2):
                _update(stage, x, [z[4 * rt + i] for i in range(4)], rt, g, t)
            if reverse != 0:
                _extra_rows(stage, x, g, t, warp)
            ptx.cta_barrier()  # the stage is refilled by the next step


@cute.jit
def _load_stage(tid: Int32, rows: Int32, chunk: Int64, stage: Int32, bar: Int32, gamma: Int64,
                a: Int64, b: Int64, y: Int64):
    """Bulk copies of chunk `chunk` (a flat (n, h, c) index) of the chain's operands at global
    gamma, a, b, y (y at this CTA's first column; `rows` = R) into the stage at shared address
    `stage`, completing on mbarrier `bar`: copy j = gamma (j = 0), A's rows (1 .. 16), B's row
    pairs (then R / 2), Y's rows of this CTA's columns (then R); thread i issues copies i and
    i + THREADS. Thread 0 announces the bytes and arrives (one arrival per phase)."""
    if tid == 0:
        ptx.mbar_expect_tx_if(bar, Int32(D * 4 + CHUNK * 2 * D * 4)
                              + rows * (2 * D * 4 + BLOCK_V * 4), Int32(0), Int32(1))
        ptx.mbar_arrive(bar)
    pairs = rows // 2
    count = 1 + CHUNK + pairs + rows
    for k in cutlass.range_constexpr(-(-(1 + CHUNK + ROWS_R // 2 + ROWS_R) // THREADS)):
        j = tid + k * THREADS
        dst = stage
        src = gamma + chunk * (D * 4)
        nbytes = Int32(D * 4)
        if j >= 1:
            dst = stage + A_OFF + (j - 1) * A_PITCH
            src = a + (chunk * CHUNK + Int64(j - 1)) * (2 * D * 4)
            nbytes = Int32(2 * D * 4)
        if j >= 1 + CHUNK:
            dst = stage + B_OFF + (j - 1 - CHUNK) * B_PITCH
            src = b + (chunk * Int64(pairs) + Int64(j - 1 - CHUNK)) * (4 * D * 4)
            nbytes = Int32(4 * D * 4)
        if j >= 1 + CHUNK + pairs:
            dst = stage + Y_OFF + (j - 1 - CHUNK - pairs) * Y_PITCH
            src = y + (chunk * Int64(rows) + Int64(j - 1 - CHUNK - pairs)) * (D * 4)
            nbytes = Int32(BLOCK_V * 4)
        ptx.bulk_g2s_if(dst, src, nbytes, bar, j, count)


def _extra_rows(stage, x, g, t, warp):
    """The reverse chain's update rows 16 .. 31 (Z = Y there)."""
    for rt in range(CHUNK // 8, ROWS_R // 8):
        _update(stage, x, _y_tile(stage, rt, g, t, warp), rt, g, t)


def _split4(values):
    """split() of an MMA A operand's four f32: (hi words, lo words)."""
    parts = [ptx.split_tf32(v) for v in values]
    return [p[0] for p in parts], [p[1] for p in parts]


def _mma3_each(products, accumulators):
    """accumulators[i] + lo.hi + hi.lo + hi.hi of products[i] = (a_hi, a_lo, b_hi, b_lo), the
    three MMAs of each in this order, emitted term by term across the products: consecutive
    MMAs are independent (ptxas keeps the order, and a dependent MMA waits for its predecessor's
    whole latency)."""
    terms = ((1, 2), (0, 3), (0, 2))  # (A part, B part) of lo.hi, hi.lo, hi.hi
    for a_part, b_part in terms:
        accumulators = [ptx.mma_tf32_1688(p[a_part], p[b_part], acc)
                        for p, acc in zip(products, accumulators)]
    return accumulators


def _as_a_operand(tile):
    """An m16n8 accumulator tile (c0..c3) as an A operand with K columns (2t, 2t + 1) -> (t, t + 4)."""
    return [tile[0], tile[2], tile[1], tile[3]]


def _y_tile(stage, rt, g, t, warp):
    """Y^T of the warp's 16 value rows and r-tile rt as an accumulator tile (element i: row
    8 rt + 2t + i % 2, value row g + 8 (i // 2))."""
    base = stage + Y_OFF + (warp * TILE_V + g) * 4
    return [ptx.ld_shared_f32(base + (8 * rt + 2 * t + i % 2) * Y_PITCH + 8 * (i // 2) * 4)
            for i in range(4)]


def _residual(stage, x, g, t, warp):
    """P^T = X A^T and Z^T = Y^T - P^T for r-tiles 0, 1 (module docstring): 8 f32, r-tile nr's
    accumulator tile at 4 nr .. 4 nr + 3."""
    zero = [Float32(0.0)] * 4
    acc = [zero] * (2 * QUARTERS)  # index 2 q + nr
    for i in range(KEY_TILES // QUARTERS):  # key tile 4 q + i of every quarter q at once
        products = []
        for q in range(QUARTERS):
            kt = (KEY_TILES // QUARTERS) * q + i
            a_hi, a_lo = _split4(_as_a_operand([x[4 * kt + e] for e in range(4)]))
            for nr in range(2):  # A's row 8 nr + g, keys 8 kt + 2t, + 1: hi, hi, lo, lo
                w = ptx.ld_shared_v4(stage + A_OFF + (8 * nr + g) * A_PITCH + (4 * kt + t) * 16)
                products.append((a_hi, a_lo, w[:2], w[2:]))
        acc = _mma3_each(products, acc)
    z = []
    for nr in range(2):
        y = _y_tile(stage, nr, g, t, warp)
        for i in range(4):
            p = ptx.fadd(ptx.fadd(acc[nr][i], acc[2 + nr][i]),
                         ptx.fadd(acc[4 + nr][i], acc[6 + nr][i]))
            z.append(ptx.fsub(y[i], p))
    return z


def _scale_by_gamma(stage, x, t):
    """X = X Diag(gamma): key tile kt's lane columns 8 kt + 2t, + 1."""
    for kt in range(KEY_TILES):
        w = ptx.ld_shared_v2(stage + (8 * kt + 2 * t) * 4)
        for i in range(4):
            x[4 * kt + i] = ptx.fmul(x[4 * kt + i], ptx.u32_as_f32(w[i % 2]))


def _update(stage, x, z_tile, rt, g, t):
    """X += Z^T B over the rows of r-tile rt (Z^T's accumulator tile `z_tile`), every key tile."""
    a_hi, a_lo = _split4(_as_a_operand(z_tile))
    pair = stage + B_OFF + (4 * rt + t) * B_PITCH + g * 16  # B's rows 8 rt + 2t, + 1
    for half in range(2):  # key tiles 8 half .. 8 half + 7
        tiles = range(KEY_TILES // 2 * half, KEY_TILES // 2 * (half + 1))
        products = []
        for kt in tiles:  # key 8 kt + g: hi, hi, lo, lo
            w = ptx.ld_shared_v4(pair + kt * 8 * 16)
            products.append((a_hi, a_lo, w[:2], w[2:]))
        acc = _mma3_each(products, [[x[4 * kt + i] for i in range(4)] for kt in tiles])
        for kt, tile in zip(tiles, acc):
            for i in range(4):
                x[4 * kt + i] = tile[i]


def chain_args():
    """Fake arguments of KdaStateChains's host __call__ (N, C, H, NiF, NiR dynamic)."""
    n, c, h = symbol("N"), symbol("C"), symbol("H")
    f32 = lambda *shape: fake_tensor(Float32, shape, 16)
    per_chain = lambda rows: (f32(n, h, c, CHUNK, 2 * D), f32(n, h, c, rows, 2 * D),
                              f32(n, h, c, rows, D))
    return (
        fake_tensor(Int32, (n, c), 4), f32(symbol("NiF"), h, D, D),  # reset, init: forward
        fake_tensor(Int32, (n, c), 4), f32(symbol("NiR"), h, D, D),  # reset, init: reverse
        f32(n, h, c, D),  # gamma
        *per_chain(ROWS_F), *per_chain(ROWS_R),  # A, B, Y
        f32(n, h, c, D, D), f32(n, h, c, CHUNK, D),  # states, z: forward (results)
        f32(n, h, c, D, D), f32(n, h, c, CHUNK, D),  # states, z: reverse (results)
        fake_stream(),
    )


def compile_kernel(arch: str = "sm_90a", *, dump_dir: str | None = None):
    """Both chains' kernel, compiled for `arch`."""
    return compile_for_arch(KdaStateChains(), chain_args(), arch, dump_dir=dump_dir)
