"""What the two prepare kernels share (prepare.py, the flashkda mode; prepare_fp32.py, the fp32
mode): the chunk a workspace slot holds, the rows of the packed inputs, the shared-memory tile
layouts, the one-warp 16x16 MMA of phase C, phase B's running gate sum, the granule copy and the
fake arguments both are compiled with.

Trace-time helpers: each emits the same instructions wherever it is called, so a kernel that
moves to one of them keeps its cubin.
"""

from __future__ import annotations

import cutlass
from cutlass import BFloat16, Float32, Int32, Uint8, cute
from cutlass.cute.nvgpu import warp

from . import workspace_layout as wl
from .compile_utils import fake_stream, fake_tensor, symbol
from .ptx import fadd
from .recurrence_common import sequence_start

D = wl.D
CHUNK = wl.CHUNK


# ------------------------------------------------------------------ the chunk of a slot
@cute.jit
def locate_chunk(mCuSeqlens: cute.Tensor, slot: Int32, t_total: Int32):
    """(active, bos, eos, chunk) of a workspace slot (docs/kernel_abi.md "Chunk slots"): the
    sequence [bos, eos) by a binary search on the slot starts cu[n] // 16 + n, then the chunk
    within it; `active` is False for a slot that holds no chunk (chunk_rows gives its rows)."""
    num_seqs = mCuSeqlens.shape[0] - 1
    lo = Int32(0)
    hi = Int32(num_seqs)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if sequence_start(mCuSeqlens, mid, t_total) // CHUNK + mid <= slot:
            lo = mid
        else:
            hi = mid
    seq = lo
    bos = sequence_start(mCuSeqlens, seq, t_total)
    # min(): with N = 0 (cu_seqlens of length 1) never read past the array
    eos = cutlass.max(sequence_start(mCuSeqlens, cutlass.min(seq + 1, num_seqs), t_total), bos)
    chunk = slot - (bos // CHUNK + seq)
    num_chunks = (eos - bos + CHUNK - 1) // CHUNK
    active = (num_seqs > 0) & (chunk >= 0) & (chunk < num_chunks)
    return active, bos, eos, chunk


def chunk_rows(bos, eos, chunk):
    """(row0, n_valid) of an active chunk (locate_chunk): its first token and its rows inside
    the sequence, 1..16. Apart from locate_chunk so that a kernel may form them inside its
    `if active` (the flashkda prepare) or before it (the fp32 one)."""
    row0 = bos + chunk * CHUNK
    return row0, cutlass.min(eos - row0, CHUNK)


def qk_head_of(head, heads, qk_heads):
    """The query/key head that value head `head` reads with grouped value heads (H = G Hk, G =
    H // Hk value heads per query/key head): head // G, fla's convention."""
    return head // (heads // qk_heads)


class PackedRows:
    """Chunk rows of a prepare kernel: token row0 + r of the packed [T_total, H, ...] inputs; q
    and k rows of query/key head `qk_head` (grouped value heads: q, k [T_total, Hk, 128]), the
    value head itself by default."""

    def __init__(self, row0, head, mBeta, qk_head=None):
        self.row0, self.head, self.mBeta = row0, head, mBeta
        self.qk_head = head if qk_head is None else qk_head

    def token(self, r):
        return self.row0 + r

    def row(self, m_x, tok):
        return m_x[tok, self.head, None]

    def qk_row(self, m_x, tok):
        return m_x[tok, self.qk_head, None]

    def beta(self, tok):
        return self.mBeta[tok, self.head]

    # beta's element index and count (the kernel ABI's compact [T_total, H])
    def beta_index(self, tok):
        return tok * self.mBeta.shape[1] + self.head

    def beta_count(self):
        return self.mBeta.shape[0] * self.mBeta.shape[1]


# ------------------------------------------------------------------ shared-memory tiles
def swizzled_tile_layout():
    """(16, 128) bf16 tile, element (r, c) at r*128 + ((c//8) ^ (r%8))*8 + c%8."""
    return cute.make_composed_layout(
        cute.make_swizzle(3, 3, 4), 0, cute.make_layout((CHUNK, D), stride=(D, 1))
    )


def swizzled_byte_offset(r, c):
    """Byte offset of element (r, c) in swizzled_tile_layout() (c even: (c, c + 1) is one word)."""
    return (r * D + (((c // 8) ^ (r % 8)) * 8) + c % 8) * 2


def row_major(rows, cols):
    return cute.make_layout((rows, cols), stride=(cols, 1))


def carve(base, byte_offset, dtype, layout):
    """Tensor of `dtype` with `layout` at `byte_offset` of a shared-memory byte array."""
    return cute.make_tensor(cute.recast_ptr(base + byte_offset, dtype=dtype), layout)


@cute.jit
def copy_granules(
    src: cute.Tensor, dst: cute.Tensor, first: Int32, stride: int, begin: int, end: int
):
    """Copy 16-byte granules begin..end-1 of a byte tensor: granule begin + first + i * stride
    at step i."""
    for it in cutlass.range_constexpr((end - begin + stride - 1) // stride):
        v = begin + first + it * stride
        if cutlass.const_expr(begin + (it + 1) * stride <= end):
            cute.autovec_copy(
                cute.local_tile(src, (16,), (v,)), cute.local_tile(dst, (16,), (v,))
            )
        else:
            if v < end:
                cute.autovec_copy(
                    cute.local_tile(src, (16,), (v,)), cute.local_tile(dst, (16,), (v,))
                )


# ------------------------------------------------------------------ phase B and C pieces
@cute.jit
def running_sum_of_half(cum: cute.Tensor, j: int, start: Float32) -> Float32:
    """Phase B's half of column j's cumulative gate: cum[j, i] (the gates of the thread's 8 rows)
    becomes start + cum[j, 0] + ... + cum[j, i], f32 additions in row order; returns the last
    (G_7 for the first half from start 0, G_15 for the second from G_7)."""
    total = start
    for i in cutlass.range_constexpr(8):
        total = fadd(total, cum[j, i])
        cum[j, i] = total
    return total


def tiled_mma_bf16():
    """One warp, 16x16 output from two m16n8k16 bf16 atoms, f32 accumulate."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)),
        (1, 1, 1),
        permutation_mnk=(16, 16, 16),
    )


@cute.jit
def _mma_16x16(tiled_mma, thr_mma, acc, s_a: cute.Tensor, s_b: cute.Tensor):
    """acc += A.B^T for A (16, K), B (16, K) in shared memory, k-blocks ascending."""
    t_a = thr_mma.partition_A(s_a)
    t_b = thr_mma.partition_B(s_b)
    r_a = tiled_mma.make_fragment_A(t_a)
    r_b = tiled_mma.make_fragment_B(t_b)
    cute.autovec_copy(t_a, r_a)
    cute.autovec_copy(t_b, r_b)
    for kb in cutlass.range_constexpr(cute.size(r_a, mode=[2])):
        cute.gemm(tiled_mma, acc, r_a[None, None, kb], r_b[None, None, kb], acc)


class WarpMma:
    """A one-warp 16x16 tiled MMA as seen by one lane (a trace-time helper): its slice of the
    MMA and `coords`, the (row, col) of each of its accumulator elements."""

    def __init__(self, tiled_mma, lane):
        self.tiled_mma = tiled_mma
        self.thr = tiled_mma.get_slice(lane)
        self.coords = self.thr.partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))

    def product(self, s_a, s_b):
        """A.B^T into a fresh zeroed accumulator, for A (16, K), B (16, K) in shared memory."""
        acc = self.tiled_mma.make_fragment_C(self.coords.shape)
        acc.fill(0.0)
        _mma_16x16(self.tiled_mma, self.thr, acc, s_a, s_b)
        return acc


# ------------------------------------------------------------------ build side
def prepare_args(record_bytes: int = wl.RECORD_BYTES, grouped: bool = False):
    """Fake arguments of a prepare kernel's host __call__ (docs/kernel_abi.md; T_total, H, N, S
    dynamic): tensors, the two scalars as Float32 placeholders, a fake stream. The fp32 mode's
    prepare writes 23,040-byte records (record_bytes). grouped: q and k have their own head
    count Hk (grouped value heads, H a multiple of Hk)."""
    t_total, heads, n_plus_1, slots = (symbol(s) for s in ("T_total", "H", "N_plus_1", "S"))
    qk_heads = symbol("Hk") if grouped else heads
    return (
        fake_tensor(BFloat16, (t_total, qk_heads, D), 16),  # q
        fake_tensor(BFloat16, (t_total, qk_heads, D), 16),  # k
        fake_tensor(BFloat16, (t_total, heads, D), 16),  # g
        fake_tensor(BFloat16, (t_total, heads), 2),  # beta
        fake_tensor(Float32, (heads,), 4),  # A_log
        fake_tensor(Float32, (heads, D), 16),  # dt_bias
        fake_tensor(Int32, (n_plus_1,), 4),  # cu_seqlens
        fake_tensor(Uint8, (heads, slots, record_bytes), 16),  # workspace
        Float32(1.0),  # scale
        Float32(-5.0),  # lower_bound
        fake_stream(),
    )
