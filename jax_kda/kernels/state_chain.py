"""The serial chains of the backward pass (jax_kda.reference_backward, steps 2 and 3) as one GPU
kernel: both chunked linear recurrences of a 128 x 128 f32 state side by side in one launch,
column split, state in registers.

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

Arithmetic (f32, .rn.ftz, the order fixed, so results are bitwise run to run; there is one launch
shape, so no launch choice changes them):
  * P[r, v]: each lane's fma chain over its four keys (4 l .. 4 l + 3) from zero; then the sum
    over the 32 lanes of a warp by recursive halving (xor 16, 8, 4, 2, 1: at each step a lane
    keeps half of its partial sums and adds its partner's), which leaves lane l with P of row
    l // 2 for two of the warp's value rows.
  * X[v, k] = fma chain over r = 0 .. R - 1 of Z[r, v] B[r, k], started from X[v, k] * gamma[k].

Task = (8 value rows, chain, head, row n), grid (32, H, N): x < 16 the forward chain's value rows
8 x .., x >= 16 the reverse chain's 8 (x - 16) ..; 64 threads. Both chains in one launch run
side by side on otherwise idle SMs (each alone occupies 16 H N CTAs of 2 warps). Thread (warp w,
lane l) holds the state's value rows v0 + 4 w .. v0 + 4 w + 3 at keys 4 l .. 4 l + 3 in
registers (16 elements). Every shared load of an operand row is one 16-byte load per lane over
the whole 512-byte row, so each loaded element feeds four value rows, and every state store is a
full 512-byte run per warp. Z reaches the lanes through a 256-byte shared buffer per warp
(written by the owner lanes, read back as four value rows per row).

Both chains run the same code: which one a CTA runs (its operands, R, its direction) is chosen
once from blockIdx.x, and the reverse chain's update rows 16 .. 31 are a branch uniform over the
CTA.

Shared memory: a ring of two stages (chunk c is read while chunk c + 1 is copied in with
cp.async), each gamma [128] | A [16, 128] | Y [32, 8 columns of this CTA] | B [32, 128], f32,
26,112 bytes (the forward chain fills 16 of the 32 rows of Y and B); then the two warps' Z
buffers: 52,736 bytes, so four CTAs fit an SM. The reset index of the next chunk is read from
global memory while a chunk runs.

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
BLOCK_V = 8  # value rows per CTA
SLICES = D // BLOCK_V  # CTAs per chain
WARP_ROWS = 4  # value rows per warp (and per thread)
KEYS = 4  # keys per lane: 32 lanes cover the 128 keys
THREADS = 32 * BLOCK_V // WARP_ROWS
STAGES = 2
ROWS_F, ROWS_R = contract.FORWARD_CHAIN_ROWS, contract.REVERSE_CHAIN_ROWS
# a stage: gamma [128] | A [16, 128] | Y [R, 8] | B [R, 128], laid out for the reverse chain's R
A_OFF = D * 4
Y_OFF = A_OFF + CHUNK * D * 4
B_OFF = Y_OFF + ROWS_R * BLOCK_V * 4
STAGE_BYTES = B_OFF + ROWS_R * D * 4
Z_BYTES = CHUNK * WARP_ROWS * 4  # a warp's Z buffer: [16 rows, 4 value rows] f32
SMEM_BYTES = STAGES * STAGE_BYTES + (THREADS // 32) * Z_BYTES


class KdaStateChains:
    """Host entry + device kernel. Layouts (compact row-major, f32 unless said), per chain
    (F: forward, R: reverse): reset int32 [N, C]; init [Ni, H, 128, 128]; A [N, H, C, 16, 128];
    B and Y [N, H, C, R, 128]; results states [N, H, C, 128, 128] and z [N, H, C, 16, 128];
    shared gamma [N, H, C, 128]. N, C, H and each chain's Ni dynamic."""

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
        src = _Sources(mGamma.iterator.toint(), a_base, b_base, y_base + Int64(v0) * 4, rows,
                       tid)
        z_buf = smem + STAGES * STAGE_BYTES + warp * Z_BYTES

        x = cute.make_rmem_tensor(cute.make_layout(WARP_ROWS * KEYS), Float32)  # [value, key]
        for i in cutlass.range_constexpr(WARP_ROWS * KEYS):
            x[i] = Float32(0.0)
        # the byte offset in a [128, 128] state of this thread's 16 bytes of value row j
        elem = [(Int64(v0 + WARP_ROWS * warp + j) * D + Int64(KEYS * lane)) * 4
                for j in range(WARP_ROWS)]
        # and in a [16, 128] z of its two values (row lane // 2, value rows 2 (lane % 2) + t)
        z_elem = (Int64(lane // 2) * D + Int64(v0 + WARP_ROWS * warp + 2 * (lane % 2))) * 4

        first = reverse * (num_chunks - 1)  # the chunk visited first (num_chunks > 0)
        if num_chunks > 0:
            _load_stage(src, first_chunk + Int64(first), smem)
        ptx.cp_async_commit()
        reset_next = ptx.ld_global_b32_if(reset_row + Int64(first) * 4, Int32(0), num_chunks)
        for step in range(num_chunks):
            c = step + reverse * (num_chunks - 1 - 2 * step)  # the chunk visited at `step`
            reset = reset_next
            if step + 1 < num_chunks:
                following = c + 1 - 2 * reverse
                _load_stage(src, first_chunk + Int64(following),
                            smem + ((step + 1) % STAGES) * STAGE_BYTES)
                reset_next = ptx.ld_global_b32_if(reset_row + Int64(following) * 4, Int32(0),
                                                  Int32(1))
            ptx.cp_async_commit()
            if (reset >= 0) & (reset < num_init):
                base = init_base + (Int64(reset) * Int64(num_heads) + Int64(head)) * (D * D * 4)
                for j in cutlass.range_constexpr(WARP_ROWS):
                    w = ptx.ld_global_v4(base + elem[j])
                    for i in cutlass.range_constexpr(KEYS):
                        x[KEYS * j + i] = ptx.u32_as_f32(w[i])
            chunk = first_chunk + Int64(c)
            out = states_base + chunk * (D * D * 4)
            for j in cutlass.range_constexpr(WARP_ROWS):
                ptx.st_global_v4(out + elem[j],
                                 [ptx.f32_as_u32(x[KEYS * j + i]) for i in range(KEYS)])
            ptx.cp_async_wait(STAGES - 1)  # this thread's copies of this chunk are done ...
            ptx.cta_barrier()  # ... and everyone's are visible
            stage = smem + (step % STAGES) * STAGE_BYTES
            acc = cute.make_rmem_tensor(cute.make_layout(WARP_ROWS * KEYS), Float32)
            z = _first_rows(stage, z_buf, x, acc, lane, warp)
            if reverse != 0:
                _extra_rows(stage, acc, lane, warp)
            for i in cutlass.range_constexpr(WARP_ROWS * KEYS):
                x[i] = acc[i]
            z_out = z_base + chunk * (CHUNK * D * 4) + z_elem
            for t in cutlass.range_constexpr(2):
                ptx.st_global_f32(z_out + 4 * t, z[t])
            ptx.cta_barrier()  # the stage is refilled by the next step
        ptx.cp_async_wait(0)


class _Sources:
    """Trace-time bag: where this CTA's chain reads a chunk's operands (global addresses; y at
    this CTA's first column), its rows per chunk R, and the copying thread."""

    def __init__(self, gamma, a, b, y, rows, tid):
        self.gamma, self.a, self.b, self.y = gamma, a, b, y
        self.rows = rows
        self.tid = tid


def _copy_rows(stage, base, max_rows, num_rows, tid):
    """cp.async of num_rows (<= max_rows) whole 512-byte rows from global `base` to shared
    `stage`."""
    for i in range(-(-max_rows * D // 4 // THREADS)):
        g = tid + i * THREADS
        ptx.cp_async_16_if(stage + g * 16, base + Int64(g) * 16, g, num_rows * (D // 4))


def _load_stage(src, chunk, stage):
    """All threads: cp.async (16-byte granules) of chunk `chunk` (a flat (n, h, c) index) into
    the stage at shared address `stage`."""
    R, tid = src.rows, src.tid
    _copy_rows(stage, src.gamma + chunk * (D * 4), 1, Int32(1), tid)
    _copy_rows(stage + A_OFF, src.a + chunk * (CHUNK * D * 4), CHUNK, Int32(CHUNK), tid)
    _copy_rows(stage + B_OFF, src.b + chunk * Int64(R) * (D * 4), ROWS_R, R, tid)
    # Y: rows of this CTA's 8 columns, 2 granules each
    for i in range(-(-ROWS_R * 2 // THREADS)):
        g = tid + i * THREADS
        ptx.cp_async_16_if(stage + Y_OFF + g * 16,
                           src.y + chunk * Int64(R) * (D * 4)
                           + (Int64(g // 2) * D + Int64(g % 2) * 4) * 4, g, R * 2)


def _first_rows(stage, z_buf, x, acc, lane, warp):
    """A chunk step up to the update's first 16 rows (module docstring): P, Z[:16] (returns the
    thread's two values), acc = X Diag(gamma) + Z[:16]^T B[:16]."""
    key_off = lane * (KEYS * 4)
    gamma = ptx.ld_shared_v4_f32(stage + key_off)
    # P = A X^T: partial sums over the lane's keys, index r * 4 + j (row r, value row j) ...
    partial = []
    for r in range(CHUNK):
        a = ptx.ld_shared_v4_f32(stage + A_OFF + r * (D * 4) + key_off)
        for j in range(WARP_ROWS):
            p = Float32(0.0)
            for i in range(KEYS):
                p = ptx.ffma(a[i], x[KEYS * j + i], p)
            partial.append(p)
    # ... summed over the warp's lanes by recursive halving: the lanes with the xor bit set keep
    # the upper half, so lane l ends with indices 2 l and 2 l + 1
    for shift in (16, 8, 4, 2, 1):
        half = len(partial) // 2
        bit = lane & shift
        kept = []
        for t in range(half):
            lo, hi = partial[t], partial[t + half]
            send = ptx.select_lt_f32(bit, Int32(1), hi, lo)
            keep = ptx.select_lt_f32(bit, Int32(1), lo, hi)
            kept.append(ptx.fadd(keep, cute.arch.shuffle_sync_bfly(send, shift)))
        partial = kept
    # Z of row lane // 2, value rows 2 (lane % 2) + t, to the warp's buffer [16 rows, 4 values]
    y_addr = stage + Y_OFF + (lane // 2) * (BLOCK_V * 4) + (WARP_ROWS * warp + 2 * (lane % 2)) * 4
    z = [ptx.fsub(ptx.ld_shared_f32(y_addr + 4 * t), partial[t]) for t in range(2)]
    ptx.st_shared_v2(z_buf + lane * 8, [ptx.f32_as_u32(v) for v in z])
    ptx.warp_sync()
    for j in range(WARP_ROWS):
        for i in range(KEYS):
            acc[KEYS * j + i] = ptx.fmul(x[KEYS * j + i], gamma[i])
    _update_rows(stage, acc, lane, range(CHUNK),
                 lambda r: ptx.ld_shared_v4_f32(z_buf + r * (WARP_ROWS * 4)))
    return z


def _extra_rows(stage, acc, lane, warp):
    """The reverse chain's update rows 16 .. 31 (Z = Y there)."""
    _update_rows(stage, acc, lane, range(CHUNK, ROWS_R),
                 lambda r: ptx.ld_shared_v4_f32(stage + Y_OFF + r * (BLOCK_V * 4) + warp * 16))


def _update_rows(stage, acc, lane, rows, z_row):
    """acc[j, i] += Z[r, j] B[r, i] over `rows` in order (z_row(r): the warp's 4 values of Z)."""
    key_off = lane * (KEYS * 4)
    for r in rows:
        zr = z_row(r)
        b = ptx.ld_shared_v4_f32(stage + B_OFF + r * (D * 4) + key_off)
        for j in range(WARP_ROWS):
            for i in range(KEYS):
                acc[KEYS * j + i] = ptx.ffma(zr[j], b[i], acc[KEYS * j + i])


def chain_args():
    """Fake arguments of KdaStateChains's host __call__ (N, C, H, NiF, NiR dynamic)."""
    n, c, h = symbol("N"), symbol("C"), symbol("H")
    f32 = lambda *shape: fake_tensor(Float32, shape, 16)
    per_chain = lambda rows: (f32(n, h, c, CHUNK, D), f32(n, h, c, rows, D),
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
