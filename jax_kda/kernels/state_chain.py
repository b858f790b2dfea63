"""The serial chains of the backward pass (jax_kda.reference_backward, steps 2 and 3) as one GPU
kernel: a chunked linear recurrence of a 128 x 128 f32 state, column split, state in registers.

Per chain (row n, head h) and chunk c in the chain's order (R = 16: c = 0, 1, .., C - 1; R = 32,
contract.STATE_CHAIN_REVERSE_ROWS: c = C - 1, .., 0), with X [128 (v), 128 (k)]:

    X = init[reset[n, c], h]        if 0 <= reset[n, c] < Ni   (X = 0 before the first chunk)
    states[n, h, c] = X             the state entering chunk c
    P = A_c X^T                     A_c [16, 128 (k)]        -> P [16, 128 (v)]
    Z = Y_c - [P; 0]                Y_c [R, 128 (v)]         (rows 16 .. R - 1 of Y_c as they are)
    X = X Diag(gamma_c) + Z^T B_c   gamma_c [128 (k)], B_c [R, 128 (k)]

R = 16 is the forward state recompute (A = W Diag(b) kd, Y = W Diag(b) v, B = kr, gamma = gt);
R = 32 the reverse state-gradient chain, which runs over the chunks backwards (A = Diag(b) W^T kr,
Y = [-Diag(b) W^T Mqk^T dout; dout], B = [kd; qd]). jax_kda.reference_backward builds the
operands.

Arithmetic (f32, .rn.ftz, the order fixed, so results are bitwise run to run; there is one launch
shape, so no launch choice changes them):
  * P[r, v]: each lane's fma chain over its four keys (4 l .. 4 l + 3) from zero; then the sum
    over the 32 lanes of a warp by recursive halving (xor 16, 8, 4, 2, 1: at each step a lane
    keeps half of its partial sums and adds its partner's), which leaves lane l with P of row
    l // 2 for two of the warp's value rows.
  * X[v, k] = fma chain over r = 0 .. R - 1 of Z[r, v] B[r, k], started from X[v, k] * gamma[k].

Task = (8 value rows, head, row n), grid (16, H, N), 64 threads. Thread (warp w, lane l) holds the
state's value rows v0 + 4 w .. v0 + 4 w + 3 at keys 4 l .. 4 l + 3 in registers (16 elements).
Every shared load of an operand row is one 16-byte load per lane over the whole 512-byte row, so
each loaded element feeds four value rows (against one in a half-warp-per-row split, which read
every operand row twice per warp and was bound by shared-memory bandwidth), and every state
store a full 512-byte run per warp. Z reaches the lanes through a 256-byte shared buffer per warp
(written by the owner lanes, read back as four value rows per row).

Shared memory: a ring of four stages (chunk c is read while the next three are copied in with
cp.async, which hides the operands' memory latency behind three chunk steps), each
gamma [128] | A [16, 128] | B [R, 128] | Y [R, 8 columns of this CTA], f32: 17,408 bytes at
R = 16, 26,112 at R = 32; then the two warps' Z buffers. The reset index of the next chunk is
read from global memory while a chunk runs.

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
WARP_ROWS = 4  # value rows per warp (and per thread)
KEYS = 4  # keys per lane: 32 lanes cover the 128 keys
THREADS = 32 * BLOCK_V // WARP_ROWS
STAGES = 4
ROWS = contract.STATE_CHAIN_ROWS  # R: the forward chain, the reverse chain
Z_BYTES = CHUNK * WARP_ROWS * 4  # a warp's Z buffer: [16 rows, 4 value rows] f32


def stage_layout(rows: int):
    """Byte offsets of (A, B, Y) in a stage and the stage's size (gamma at 0)."""
    a_off = D * 4
    b_off = a_off + CHUNK * D * 4
    y_off = b_off + rows * D * 4
    return a_off, b_off, y_off, y_off + rows * BLOCK_V * 4


class KdaStateChain:
    """Host entry + device kernel. Layouts (compact row-major, f32 unless said): reset int32
    [N, C]; init [Ni, H, 128, 128]; gamma [N, H, C, 128]; A [N, H, C, 16, 128]; B and Y
    [N, H, C, R, 128]; states (result) [N, H, C, 128, 128]. N, C, Ni, H dynamic."""

    def __init__(self, rows: int):
        if rows not in ROWS:
            raise ValueError(f"rows must be one of {ROWS}, got {rows}")
        self.rows = rows
        self.reverse = rows == contract.STATE_CHAIN_REVERSE_ROWS
        self.a_off, self.b_off, self.y_off, self.stage_bytes = stage_layout(rows)
        self.z_off = STAGES * self.stage_bytes

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
        smem = SmemAllocator().allocate(self.z_off + (THREADS // 32) * Z_BYTES,
                                        byte_alignment=128).toint()
        tid, _, _ = cute.arch.thread_idx()
        slice_idx, head, row = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32
        v0 = slice_idx * BLOCK_V
        num_heads = mGamma.shape[1]
        num_chunks = mGamma.shape[2]
        num_init = mInit.shape[0]
        chain = Int64(row) * Int64(num_heads) + Int64(head)  # (n, h)
        first_chunk = chain * Int64(num_chunks)
        src = _Sources(self, mGamma, mA, mB, mY, tid, v0)
        z_buf = smem + self.z_off + warp * Z_BYTES

        x = cute.make_rmem_tensor(cute.make_layout(WARP_ROWS * KEYS), Float32)  # [value row, key]
        for i in cutlass.range_constexpr(WARP_ROWS * KEYS):
            x[i] = Float32(0.0)
        # the byte offset in a [128, 128] state of this thread's 16 bytes of value row j
        elem = [(Int64(v0 + WARP_ROWS * warp + j) * D + Int64(KEYS * lane)) * 4
                for j in range(WARP_ROWS)]

        for s in cutlass.range_constexpr(STAGES - 1):  # the ring's first chunks
            if s < num_chunks:
                _load_stage(src, first_chunk + Int64(self._order(s, num_chunks)),
                            smem + s * self.stage_bytes)
            ptx.cp_async_commit()
        reset_next = Int32(-1)
        if num_chunks > 0:
            reset_next = mReset[row, self._order(0, num_chunks)]
        for step in range(num_chunks):
            c = self._order(step, num_chunks)
            reset = reset_next
            ahead = step + STAGES - 1
            if ahead < num_chunks:
                _load_stage(src, first_chunk + Int64(self._order(ahead, num_chunks)),
                            smem + (ahead % STAGES) * self.stage_bytes)
            ptx.cp_async_commit()
            if step + 1 < num_chunks:
                reset_next = mReset[row, self._order(step + 1, num_chunks)]
            if (reset >= 0) & (reset < num_init):
                base = mInit.iterator.toint() + (Int64(reset) * Int64(num_heads) + Int64(head)) * (
                    D * D * 4)
                for j in cutlass.range_constexpr(WARP_ROWS):
                    w = ptx.ld_global_v4(base + elem[j])
                    for i in cutlass.range_constexpr(KEYS):
                        x[KEYS * j + i] = ptx.u32_as_f32(w[i])
            out = mStates.iterator.toint() + (first_chunk + Int64(c)) * (D * D * 4)
            for j in cutlass.range_constexpr(WARP_ROWS):
                ptx.st_global_v4(out + elem[j],
                                 [ptx.f32_as_u32(x[KEYS * j + i]) for i in range(KEYS)])
            ptx.cp_async_wait(STAGES - 1)  # this thread's copies of this chunk are done ...
            ptx.cta_barrier()  # ... and everyone's are visible
            _chunk_step(self, smem + (step % STAGES) * self.stage_bytes, z_buf, x, lane, warp)
            ptx.cta_barrier()  # the stage is refilled by a later step
        ptx.cp_async_wait(0)

    def _order(self, step, num_chunks):
        """The chunk the chain visits at `step`."""
        return num_chunks - 1 - step if self.reverse else step


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


def _copy_rows(stage, base, num_rows, tid):
    """cp.async of num_rows whole 512-byte rows from global `base` to shared `stage`."""
    granules = num_rows * D // 4
    for i in range(-(-granules // THREADS)):
        g = tid + i * THREADS
        ptx.cp_async_16_if(stage + g * 16, base + Int64(g) * 16, g, Int32(granules))


def _load_stage(src, chunk, stage):
    """All threads: cp.async (16-byte granules) of chunk `chunk` (a flat (n, h, c) index) into
    the stage at shared address `stage`."""
    R = src.rows
    tid = src.tid
    _copy_rows(stage, src.gamma + chunk * (D * 4), 1, tid)
    _copy_rows(stage + src.a_off, src.a + chunk * (CHUNK * D * 4), CHUNK, tid)
    _copy_rows(stage + src.b_off, src.b + chunk * (R * D * 4), R, tid)
    # Y: rows of this CTA's 8 columns, 2 granules each
    for i in range(-(-R * 2 // THREADS)):
        g = tid + i * THREADS
        ptx.cp_async_16_if(stage + src.y_off + g * 16,
                           src.y + chunk * (R * D * 4) + (Int64(g // 2) * D + Int64(g % 2) * 4) * 4,
                           g, Int32(R * 2))


def _chunk_step(rec, stage, z_buf, x, lane, warp):
    """One chunk of the recurrence on the thread's 16 state elements (module docstring)."""
    key_off = lane * (KEYS * 4)
    gamma = ptx.ld_shared_v4_f32(stage + key_off)
    # P = A X^T: partial sums over the lane's keys, index r * 4 + j (row r, value row j) ...
    partial = []
    for r in range(CHUNK):
        a = ptx.ld_shared_v4_f32(stage + rec.a_off + r * (D * 4) + key_off)
        for j in range(WARP_ROWS):
            acc = Float32(0.0)
            for i in range(KEYS):
                acc = ptx.ffma(a[i], x[KEYS * j + i], acc)
            partial.append(acc)
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
    y_addr = stage + rec.y_off + (lane // 2) * (BLOCK_V * 4) + (WARP_ROWS * warp
                                                              + 2 * (lane % 2)) * 4
    z = [ptx.fsub(ptx.ld_shared_f32(y_addr + 4 * t), partial[t]) for t in range(2)]
    ptx.st_shared_v2(z_buf + lane * 8, [ptx.f32_as_u32(v) for v in z])
    ptx.warp_sync()
    # X = X Diag(gamma) + Z^T B
    acc = [ptx.fmul(x[KEYS * j + i], gamma[i]) for j in range(WARP_ROWS) for i in range(KEYS)]
    for r in range(rec.rows):
        if r < CHUNK:
            zr = ptx.ld_shared_v4_f32(z_buf + r * (WARP_ROWS * 4))
        else:
            zr = ptx.ld_shared_v4_f32(stage + rec.y_off + r * (BLOCK_V * 4) + warp * 16)
        b = ptx.ld_shared_v4_f32(stage + rec.b_off + r * (D * 4) + key_off)
        for j in range(WARP_ROWS):
            for i in range(KEYS):
                acc[KEYS * j + i] = ptx.ffma(zr[j], b[i], acc[KEYS * j + i])
    for i in range(WARP_ROWS * KEYS):
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
