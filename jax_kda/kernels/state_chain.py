"""The serial chains of the backward pass (jax_kda.reference_backward, steps 2 and 3) as one GPU
kernel: a chunked linear recurrence of a 128 x 128 f32 state, column split, state in registers.

Per chain (row n, head h) and chunk c = 0, 1, .., C - 1 in order, with X [128 (v), 128 (k)]:

    X = init[reset[n, c], h]        if 0 <= reset[n, c] < Ni   (X = 0 before chunk 0)
    states[n, h, c] = X             the state entering chunk c
    P = A_c X^T                     A_c [16, 128 (k)]        -> P [16, 128 (v)]
    Z = Y_c - [P; 0]                Y_c [R, 128 (v)]         (rows 16 .. R - 1 of Y_c as they are)
    X = X Diag(gamma_c) + Z^T B_c   gamma_c [128 (k)], B_c [R, 128 (k)]

R = 16 is the forward state recompute (A = W Diag(b) kd, Y = W Diag(b) v, B = kr, gamma = gt);
R = 32 the reverse state-gradient chain run over the chunks backwards (A = Diag(b) W^T kr,
Y = [-Diag(b) W^T Mqk^T dout; dout], B = [kd; qd]). jax_kda._backward_chains builds the operands.

Arithmetic (f32, .rn.ftz, the order fixed, so results are bitwise run to run; there is one launch
shape, so no launch choice changes them):
  * P[r, v]: each lane's fma chain over its eight keys (4 kq .. 4 kq + 3, then 64 + 4 kq ..
    64 + 4 kq + 3), from zero; then a butterfly over the 16 lanes that share the value row
    (xor 1, 2, 4, 8). f32 addition is commutative, so every lane of the butterfly ends with the
    same bits.
  * X[v, k] = fma chain over r = 0 .. R - 1 of Z[r, v] B[r, k], started from X[v, k] * gamma[k].

Task = (8 value rows, head, row n), grid (16, H, N), 128 threads. Thread (warp w, lane l):
kq = l % 16, value row v0 + 2 w + l // 16, its eight keys above; it keeps those 8 state elements
in registers. The key split makes every 16-byte shared load of a stage row conflict-free (the
eight lanes of a phase read 128 contiguous bytes; both halves of a warp read the same addresses)
and every state store a full 256-byte run per half-warp. One value row per thread halves the
serial instructions per chunk against two (16 rows per CTA, the first version: 1,464 SASS
instructions in the R = 32 kernel against 928); with the operand products around them the two
chains took 3.9 -> 3.3 ms at T = 8192, 12 heads (BENCHMARKS.md, "Training").

Shared memory: two stages (chunk c is read while chunk c + 1 is copied in with cp.async), each
gamma [128] | A [16, 128] | B [R, 128] | Y [R, 8 columns of this CTA], f32: 17,408 bytes at
R = 16, 26,112 at R = 32. The reset index of chunk c + 1 is read from global memory while chunk c
runs.

No bounds to trust: the grid covers [N, H] exactly from the tensors' shapes, chunk loops run to C,
and a reset index outside [0, Ni) reads nothing.
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
BLOCK_V = 8  # value rows per CTA: one per half-warp
THREADS = 128
ROWS = contract.STATE_CHAIN_ROWS  # R: the forward chain, the reverse chain


def stage_layout(rows: int):
    """Byte offsets of (A, B, Y) in a stage and the stage's size (gamma at 0)."""
    a_off = D * 4
    b_off = a_off + CHUNK * D * 4
    y_off = b_off + rows * D * 4
    return a_off, b_off, y_off, y_off + rows * BLOCK_V * 4


def thread_keys(kq):
    """The eight keys of key group kq (0 .. 15), in the order of the fma chains."""
    return [4 * kq + i for i in range(4)] + [64 + 4 * kq + i for i in range(4)]


class KdaStateChain:
    """Host entry + device kernel. Layouts (compact row-major, f32 unless said): reset int32
    [N, C]; init [Ni, H, 128, 128]; gamma [N, H, C, 128]; A [N, H, C, 16, 128]; B and Y
    [N, H, C, R, 128]; states (result) [N, H, C, 128, 128]. N, C, Ni, H dynamic."""

    def __init__(self, rows: int):
        if rows not in ROWS:
            raise ValueError(f"rows must be one of {ROWS}, got {rows}")
        self.rows = rows
        self.a_off, self.b_off, self.y_off, self.stage_bytes = stage_layout(rows)

    @cute.jit
    def __call__(self, mReset: cute.Tensor, mInit: cute.Tensor, mGamma: cute.Tensor,
                 mA: cute.Tensor, mB: cute.Tensor, mY: cute.Tensor, mStates: cute.Tensor,
                 stream: cuda.CUstream):
        self.kernel(mReset, mInit, mGamma, mA, mB, mY, mStates).launch(
            grid=[D // BLOCK_V, mGamma.shape[1], mGamma.shape[0]],
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mReset: cute.Tensor, mInit: cute.Tensor, mGamma: cute.Tensor,
               mA: cute.Tensor, mB: cute.Tensor, mY: cute.Tensor, mStates: cute.Tensor):
        R = self.rows
        smem = SmemAllocator().allocate(2 * self.stage_bytes, byte_alignment=128).toint()
        tid, _, _ = cute.arch.thread_idx()
        slice_idx, head, row = cute.arch.block_idx()
        lane = tid % 32
        kq = lane % 16
        vg = 2 * (tid // 32) + lane // 16  # this thread's value row, v0 + vg
        v0 = slice_idx * BLOCK_V
        num_heads = mGamma.shape[1]
        num_chunks = mGamma.shape[2]
        num_init = mInit.shape[0]
        chain = Int64(row) * Int64(num_heads) + Int64(head)  # (n, h)
        first_chunk = chain * Int64(num_chunks)
        src = _Sources(self, mGamma, mA, mB, mY, tid, v0)

        x = cute.make_rmem_tensor(cute.make_layout(8), Float32)  # X[v0 + vg, key i]
        for i in cutlass.range_constexpr(8):
            x[i] = Float32(0.0)
        p = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
        # this thread's element i of a [128, 128] state, as a byte offset
        elem = [(Int64(v0 + vg) * D + Int64(key)) * 4 for key in thread_keys(kq)]

        if num_chunks > 0:
            _load_stage(src, first_chunk, smem)
        ptx.cp_async_commit()
        reset_next = Int32(-1)
        if num_chunks > 0:
            reset_next = mReset[row, 0]
        for c in range(num_chunks):
            reset = reset_next
            stage = smem + (c % 2) * self.stage_bytes
            if c + 1 < num_chunks:
                refill = smem + ((c + 1) % 2) * self.stage_bytes
                _load_stage(src, first_chunk + Int64(c + 1), refill)
                reset_next = mReset[row, c + 1]
            ptx.cp_async_commit()
            if (reset >= 0) & (reset < num_init):
                base = mInit.iterator.toint() + (Int64(reset) * Int64(num_heads) + Int64(head)) * (
                    D * D * 4)
                for h4 in cutlass.range_constexpr(2):
                    w = ptx.ld_global_v4(base + elem[4 * h4])
                    for i in cutlass.range_constexpr(4):
                        x[4 * h4 + i] = ptx.u32_as_f32(w[i])
            out = mStates.iterator.toint() + (first_chunk + Int64(c)) * (D * D * 4)
            for h4 in cutlass.range_constexpr(2):
                ptx.st_global_v4(out + elem[4 * h4],
                                 [ptx.f32_as_u32(x[4 * h4 + i]) for i in range(4)])
            ptx.cp_async_wait(1)  # this thread's copies of chunk c are done ...
            ptx.cta_barrier()  # ... and everyone's are visible
            _chunk_step(self, stage, x, p, kq, vg, R)
            ptx.cta_barrier()  # stage c % 2 is refilled by the next iteration
        ptx.cp_async_wait(0)


class _Sources:
    """Trace-time bag: where a chunk's operands come from and how this thread copies them."""

    def __init__(self, rec, mGamma, mA, mB, mY, tid, v0):
        self.rows = rec.rows
        self.a_off, self.b_off, self.y_off = rec.a_off, rec.b_off, rec.y_off
        self.gamma = mGamma.iterator.toint()
        self.a = mA.iterator.toint()
        self.b = mB.iterator.toint()
        self.y = mY.iterator.toint() + Int64(v0) * 4
        self.tid = tid


def _load_stage(src, chunk, stage):
    """All threads: cp.async (16-byte granules) of chunk `chunk` (a flat (n, h, c) index) into
    the stage at shared address `stage`."""
    R = src.rows
    tid = src.tid
    ptx.cp_async_16_if(stage + tid * 16, src.gamma + chunk * (D * 4) + Int64(tid) * 16,
                       tid, Int32(D // 4))
    for i in range(CHUNK * D // 4 // THREADS):
        g = tid + i * THREADS
        ptx.cp_async_16_if(stage + src.a_off + g * 16, src.a + chunk * (CHUNK * D * 4)
                           + Int64(g) * 16, Int32(0), Int32(1))
    for i in range(R * D // 4 // THREADS):
        g = tid + i * THREADS
        ptx.cp_async_16_if(stage + src.b_off + g * 16, src.b + chunk * (R * D * 4)
                           + Int64(g) * 16, Int32(0), Int32(1))
    # Y: rows of this CTA's 8 columns, 2 granules each
    r = tid // 2
    ptx.cp_async_16_if(stage + src.y_off + tid * 16,
                       src.y + chunk * (R * D * 4) + (Int64(r) * D + Int64(tid % 2) * 4) * 4,
                       tid, Int32(R * 2))


def _row_segment(addr):
    """Eight f32 of a 128-float shared row at `addr` (the row's base) for the thread's keys:
    floats 4 kq .. 4 kq + 3 and 64 + 4 kq .. (the caller folds kq into addr)."""
    return list(ptx.ld_shared_v4_f32(addr)) + list(ptx.ld_shared_v4_f32(addr + 256))


def _chunk_step(rec, stage, x, p, kq, vg, R):
    """One chunk of the recurrence on the thread's 16 state elements (module docstring)."""
    key_off = kq * 16
    gamma = _row_segment(stage + key_off)
    # P = A X^T: per lane over its keys, then over the 16 key groups
    for r in range(CHUNK):
        a = _row_segment(stage + rec.a_off + r * (D * 4) + key_off)
        acc = Float32(0.0)
        for i in range(8):
            acc = ptx.ffma(a[i], x[i], acc)
        p[r] = acc
    for shift in (1, 2, 4, 8):
        for r in range(CHUNK):
            p[r] = ptx.fadd(p[r], cute.arch.shuffle_sync_bfly(p[r], shift))
    # X = X Diag(gamma) + Z^T B
    acc = [ptx.fmul(x[i], gamma[i]) for i in range(8)]
    for r in range(R):
        y = ptx.ld_shared_f32(stage + rec.y_off + r * (BLOCK_V * 4) + vg * 4)
        z = ptx.fsub(y, p[r]) if r < CHUNK else y
        b = _row_segment(stage + rec.b_off + r * (D * 4) + key_off)
        for i in range(8):
            acc[i] = ptx.ffma(z, b[i], acc[i])
    for i in range(8):
        x[i] = acc[i]


def chain_args(rows: int):
    """Fake arguments of KdaStateChain's host __call__ (N, C, Ni, H dynamic)."""
    n, c, ni, h = symbol("N"), symbol("C"), symbol("Ni"), symbol("H")
    return (
        fake_tensor(Int32, (n, c), 4),  # reset
        fake_tensor(Float32, (ni, h, D, D), 16),  # init
        fake_tensor(Float32, (n, h, c, D), 16),  # gamma
        fake_tensor(Float32, (n, h, c, CHUNK, D), 16),  # A
        fake_tensor(Float32, (n, h, c, rows, D), 16),  # B
        fake_tensor(Float32, (n, h, c, rows, D), 16),  # Y
        fake_tensor(Float32, (n, h, c, D, D), 16),  # states (result)
        fake_stream(),
    )


def compile_kernel(rows: int = 16, arch: str = "sm_90a", *, dump_dir: str | None = None):
    """The state chain with R = `rows` (16: forward, 32: reverse), compiled for `arch`."""
    return compile_for_arch(KdaStateChain(rows), chain_args(rows), arch, dump_dir=dump_dir)
