"""Shared by the kernel CPU tests: the PTX ISA semantics of the warp-level fragments (ldmatrix,
movmatrix, mma.m16n8k16) written out in numpy independently of the kernel code, the workspace
record builder (docs/kernel_abi.md), and how to find the CUDA binary tools and a dumped cubin.
Imported by test modules after their `pytest.importorskip("cutlass")`."""

import os
import shutil

import numpy as np

from jax_kda.kernels import workspace_layout as wl

LANES = np.arange(32)



def frag_of(x):
    """8x8 matrix -> (32, 2): lane l holds x[l // 4][2(l % 4)], x[l // 4][2(l % 4) + 1]."""
    return np.stack(
        [x[LANES // 4, 2 * (LANES % 4)], x[LANES // 4, 2 * (LANES % 4) + 1]], axis=1
    )


def mat_of(frag):
    x = np.zeros((8, 8))
    x[LANES // 4, 2 * (LANES % 4)] = frag[:, 0]
    x[LANES // 4, 2 * (LANES % 4) + 1] = frag[:, 1]
    return x


def movmatrix_trans(frag):
    return frag_of(mat_of(frag).T)


def ldmatrix_x4(mem, addrs, trans=False):
    """mem: float64 array of 16-bit elements (index = byte address // 2); addrs: (32,) bytes."""
    out = []
    for i in range(4):
        rows = np.stack([mem[a // 2 : a // 2 + 8] for a in addrs[8 * i : 8 * i + 8]])
        out.append(frag_of(rows.T if trans else rows))
    return out


def mma_16816(a, b, c):
    """D = A.B + C with the m16n8k16 register layouts of the PTX ISA."""
    g, t = LANES // 4, LANES % 4
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for e in range(2):
        A[g, 2 * t + e] = a[0][:, e]
        A[g + 8, 2 * t + e] = a[1][:, e]
        A[g, 2 * t + 8 + e] = a[2][:, e]
        A[g + 8, 2 * t + 8 + e] = a[3][:, e]
        B[2 * t + e, g] = b[0][:, e]
        B[2 * t + 8 + e, g] = b[1][:, e]
        C[g, 2 * t + e] = c[e]
        C[g + 8, 2 * t + e] = c[2 + e]
    Dm = A @ B + C
    return [Dm[g, 2 * t], Dm[g, 2 * t + 1], Dm[g + 8, 2 * t], Dm[g + 8, 2 * t + 1]]


def pack(lo, hi):
    return np.stack([lo, hi], axis=1)


def build_record(kd, qd, kr, gt, inv, mqk):
    """The workspace record per docs/kernel_abi.md, as 16-bit element slots + an f32 gt array."""
    mem = np.zeros(wl.RECORD_BYTES // 2)
    r, c = np.meshgrid(np.arange(16), np.arange(128), indexing="ij")
    swz = r * 128 + ((c // 8) ^ (r % 8)) * 8 + c % 8
    for off, tile in ((wl.KD_OFFSET, kd), (wl.QD_OFFSET, qd), (wl.KR_OFFSET, kr)):
        mem[off // 2 + swz] = tile
    mem[wl.INV_OFFSET // 2 : wl.INV_OFFSET // 2 + 256] = inv.reshape(-1)
    mem[wl.MQK_OFFSET // 2 : wl.MQK_OFFSET // 2 + 256] = mqk.reshape(-1)
    return mem, gt.copy()


def cuda_tool(name):
    """A CUDA binary tool: from the nvidia-cuda-* wheels if installed, else PATH."""
    try:
        import nvidia

        for root in nvidia.__path__:
            for sub in ("cu13", "cuda_cuobjdump", "cuda_nvdisasm"):
                path = os.path.join(root, sub, "bin", name)
                if os.path.exists(path):
                    return path
    except ImportError:
        pass
    return shutil.which(name)


def single_cubin(dump_dir):
    cubins = [f for f in os.listdir(dump_dir) if f.endswith(".cubin")]
    assert len(cubins) == 1, cubins
    return os.path.join(dump_dir, cubins[0])


def stmatrix_x4_trans(mem, addrs, regs):
    """Inverse of ldmatrix_x4(trans=True): register i (32, 2) is the fragment of matrix i
    transposed; row r of matrix i goes to addrs[8 i + r]."""
    for i in range(4):
        rows = mat_of(regs[i]).T
        for r, a in enumerate(addrs[8 * i : 8 * i + 8]):
            mem[a // 2 : a // 2 + 8] = rows[r]


def banks(byte_addrs, width):
    """The 4-byte banks touched by accesses of `width` bytes at byte_addrs (a list)."""
    out = []
    for a in np.atleast_1d(byte_addrs):
        out += [((int(a) + w) // 4) % 32 for w in range(0, width, 4)]
    return out


def conflict_free(byte_addrs, width):
    """True if the accesses of one instruction (all lanes) need no more shared-memory wavefronts
    than their bytes require: each group of 128 / width lanes (a wavefront) touches every bank
    at most once."""
    per = max(1, 128 // width)
    addrs = list(np.atleast_1d(byte_addrs))
    for i in range(0, len(addrs), per):
        b = banks(addrs[i : i + per], width)
        if len(b) != len(set(b)):
            return False
    return True


# ------------------------------------------------------------------------------------------
# A SIMT emulator for the kernels' trace-time helpers
# ------------------------------------------------------------------------------------------
def f32_bits_to_bf16(bits):
    """bf16 bits of an f32 given as bits, round to nearest even (finite inputs)."""
    bits = int(bits) & 0xFFFFFFFF
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


class Simt:
    """Runs a plain trace-time helper of a kernel (functions that emit ptx.* calls on DSL
    scalars) once per thread of a CTA, each thread a Python thread, with the ptx wrappers
    replaced by this object's methods. Memory: global = one numpy uint8 array (addresses are
    offsets into it; every access must fall inside a registered array), shared = another.
    Barriers (cta_barrier, warp_sync) and warp collectives (ldmatrix, stmatrix, movmatrix)
    rendezvous the threads of the CTA / warp, so a helper whose lanes read what other lanes
    wrote is emulated with the synchronisation it actually has: a shared-memory store (or a
    stmatrix) stays invisible to every other thread until the next cta_barrier (or, within the
    warp, warp_sync), so a missing barrier reads stale bytes. Registers are Python ints (u32 bit
    patterns). Data movement only: no arithmetic wrappers."""

    PATCHED = (
        "ld_global_v4",
        "st_global_v4",
        "st_global_b32_if",
        "st_global_f32x2_of_bf16x2_if",
        "ld_shared_v4",
        "st_shared_v4",
        "ld_shared_v2",
        "st_shared_v2",
        "ld_shared_b32",
        "st_shared_b32",
        "pack_f32_bits_bf16x2",
        "bf16x2_lo_bits",
        "bf16x2_hi_bits",
        "cta_barrier",
        "warp_sync",
        "ldmatrix_x4",
        "ldmatrix_x4_trans",
        "stmatrix_x4_trans",
        "movmatrix_trans",
        "movmatrix_trans_volatile",
        "cp_async_16_if",
        "cp_async_commit",
        "cp_async_wait",
    )

    def __init__(self, gmem_bytes, smem_bytes, nthreads):
        import threading

        self.threading = threading
        self.gmem = np.zeros(gmem_bytes, np.uint8)
        self.smem = np.zeros(smem_bytes, np.uint8)
        self.arrays = {}
        self.nthreads = nthreads
        self.local = threading.local()
        self.cta_bar = threading.Barrier(nthreads, action=self._flush_all)
        self.warp_bar = [threading.Barrier(32) for _ in range(nthreads // 32)]
        self.sync_bar = [
            threading.Barrier(32, action=lambda w=w: self._flush_warp(w))
            for w in range(nthreads // 32)
        ]
        self.slots = [{} for _ in range(nthreads // 32)]
        # shared-memory writes not yet visible to other threads: per thread, and per warp for
        # stmatrix (nobody's own)
        self.pending = [[] for _ in range(nthreads)]
        self.pending_warp = [[] for _ in range(nthreads // 32)]
        self.global_writes = []  # (addr, nbytes) of every global store
        self.lock = threading.Lock()

    # ---- setup
    def place(self, name, array, at):
        """Copy a numpy array into global memory at byte offset `at`; returns `at`."""
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        self.gmem[at : at + raw.size] = raw
        self.arrays[name] = (at, at + raw.size)
        return at

    def read(self, name, dtype, shape):
        a, b = self.arrays[name]
        return self.gmem[a:b].view(dtype).reshape(shape).copy()

    def patch(self, monkeypatch, module):
        for name in self.PATCHED:
            monkeypatch.setattr(module, name, getattr(self, name))

    def run(self, fn):
        """fn(tid) for every thread; re-raises the first failure."""
        errors = []

        def body(tid):
            self.local.tid = tid
            self.local.ncoll = 0
            try:
                fn(tid)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                self.cta_bar.abort()
                for b in self.warp_bar + self.sync_bar:
                    b.abort()

        threads = [self.threading.Thread(target=body, args=(t,)) for t in range(self.nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._flush_all()  # kernel exit
        real = [e for e in errors if not isinstance(e, self.threading.BrokenBarrierError)]
        if real or errors:
            raise (real or errors)[0]

    def _flush(self, writes):
        for addr, raw in writes:
            self.smem[addr : addr + raw.size] = raw
        writes.clear()

    def _flush_all(self):
        for w in self.pending_warp:
            self._flush(w)
        for p in self.pending:
            self._flush(p)

    def _flush_warp(self, warp):
        self._flush(self.pending_warp[warp])
        for t in range(32 * warp, 32 * warp + 32):
            self._flush(self.pending[t])

    def _smem_read(self, addr, size):
        """Committed shared memory overlaid with this thread's own pending stores."""
        raw = self.smem[addr : addr + size].copy()
        for a, w in self.pending[self.local.tid]:
            lo, hi = max(a, addr), min(a + w.size, addr + size)
            if lo < hi:
                raw[lo - addr : hi - addr] = w[lo - a : hi - a]
        return raw

    def _smem_write(self, addr, words):
        raw = np.array([int(w) & 0xFFFFFFFF for w in words], np.uint32).view(np.uint8)
        self.pending[self.local.tid].append((addr, raw))

    # ---- memory
    def _g(self, addr, size):
        addr = int(addr)
        assert any(a <= addr and addr + size <= b for a, b in self.arrays.values()), (
            f"global access [{addr}, {addr + size}) outside every array"
        )
        assert addr % min(size, 16) == 0, f"misaligned {size}-byte global access at {addr}"
        return addr

    def _s(self, addr, size):
        addr = int(addr)
        assert 0 <= addr and addr + size <= self.smem.size, f"shared access at {addr}"
        assert addr % size == 0, f"misaligned {size}-byte shared access at {addr}"
        return addr

    def _words(self, mem, addr, n):
        return [int(x) for x in mem[addr : addr + 4 * n].view(np.uint32)]

    def _put(self, mem, addr, words):
        mem[addr : addr + 4 * len(words)] = np.array(
            [int(w) & 0xFFFFFFFF for w in words], np.uint32
        ).view(np.uint8)

    def ld_global_v4(self, addr):
        return self._words(self.gmem, self._g(addr, 16), 4)

    def st_global_v4(self, addr, regs):
        a = self._g(addr, 16)
        with self.lock:
            self.global_writes.append((a, 16))
        self._put(self.gmem, a, regs)

    def st_global_b32_if(self, addr, value, idx, limit):
        if int(idx) < int(limit):
            a = self._g(addr, 4)
            with self.lock:
                self.global_writes.append((a, 4))
            self._put(self.gmem, a, [value])

    def st_global_f32x2_of_bf16x2_if(self, addr, value, idx, limit):
        if int(idx) < int(limit):
            a = self._g(addr, 8)
            with self.lock:
                self.global_writes.append((a, 8))
            v = int(value)
            self._put(self.gmem, a, [(v << 16) & 0xFFFFFFFF, v & 0xFFFF0000])

    def _ld_shared(self, addr, n):
        a = self._s(addr, 4 * n)
        return [int(x) for x in self._smem_read(a, 4 * n).view(np.uint32)]

    def ld_shared_v4(self, addr):
        return self._ld_shared(addr, 4)

    def st_shared_v4(self, addr, regs):
        self._smem_write(self._s(addr, 16), regs)

    def ld_shared_v2(self, addr):
        return self._ld_shared(addr, 2)

    def st_shared_v2(self, addr, regs):
        self._smem_write(self._s(addr, 8), regs)

    def ld_shared_b32(self, addr):
        return self._ld_shared(addr, 1)[0]

    def st_shared_b32(self, addr, value):
        self._smem_write(self._s(addr, 4), [value])

    def cp_async_16_if(self, smem_addr, gmem_addr, idx, limit):
        """The copy lands as a shared store of this thread: visible to the others after the
        next barrier (cp_async_wait itself is a no-op here)."""
        if int(idx) < int(limit):
            g = self._g(gmem_addr, 16)
            a = self._s(smem_addr, 16)
            self.pending[self.local.tid].append((a, self.gmem[g : g + 16].copy()))

    def cp_async_commit(self):
        pass

    def cp_async_wait(self, pending):
        pass

    # ---- register-only
    def pack_f32_bits_bf16x2(self, lo_bits, hi_bits):
        return f32_bits_to_bf16(lo_bits) | (f32_bits_to_bf16(hi_bits) << 16)

    def bf16x2_lo_bits(self, w):
        return (int(w) << 16) & 0xFFFFFFFF

    def bf16x2_hi_bits(self, w):
        return int(w) & 0xFFFF0000

    # ---- synchronisation and warp collectives
    def cta_barrier(self):
        self.cta_bar.wait()

    def warp_sync(self):
        self.sync_bar[self.local.tid // 32].wait()

    def _collective(self, compute, arg):
        tid = self.local.tid
        warp, lane = tid // 32, tid % 32
        k = self.local.ncoll
        self.local.ncoll += 1
        slot = self.slots[warp].setdefault(k, {"args": [None] * 32})
        slot["args"][lane] = arg
        self.warp_bar[warp].wait()
        if lane == 0:
            slot["res"] = compute(slot["args"])
        self.warp_bar[warp].wait()
        return slot["res"][lane]

    def _rows(self, addrs):
        """8 x 8 u16 matrices: matrix i's row r from lane 8 i + r's address."""
        mats = []
        for i in range(4):
            rows = []
            for r in range(8):
                a = self._s(int(addrs[8 * i + r]), 16)
                rows.append(self.smem[a : a + 16].view(np.uint16).astype(np.int64))
            mats.append(np.stack(rows))
        return mats

    @staticmethod
    def _frag(x, lane):
        return int(x[lane // 4, 2 * (lane % 4)]) | (int(x[lane // 4, 2 * (lane % 4) + 1]) << 16)

    @staticmethod
    def _unfrag(words):
        x = np.zeros((8, 8), np.int64)
        for lane, w in enumerate(words):
            x[lane // 4, 2 * (lane % 4)] = int(w) & 0xFFFF
            x[lane // 4, 2 * (lane % 4) + 1] = (int(w) >> 16) & 0xFFFF
        return x

    def ldmatrix_x4(self, addr):
        def compute(addrs):
            mats = self._rows(addrs)
            return [[self._frag(m, lane) for m in mats] for lane in range(32)]

        return self._collective(compute, int(addr))

    def ldmatrix_x4_trans(self, addr):
        def compute(addrs):
            mats = [m.T for m in self._rows(addrs)]
            return [[self._frag(m, lane) for m in mats] for lane in range(32)]

        return self._collective(compute, int(addr))

    def stmatrix_x4_trans(self, addr, regs):
        warp = self.local.tid // 32

        def compute(args):
            for i in range(4):
                x = self._unfrag([args[lane][1][i] for lane in range(32)]).T
                for r in range(8):
                    a = self._s(args[8 * i + r][0], 16)
                    raw = x[r].astype(np.uint16).view(np.uint8).copy()
                    self.pending_warp[warp].append((a, raw))
            return [None] * 32

        self._collective(compute, (int(addr), [int(r) for r in regs]))

    def movmatrix_trans(self, x):
        def compute(words):
            m = self._unfrag(words).T
            return [self._frag(m, lane) for lane in range(32)]

        return self._collective(compute, int(x))

    movmatrix_trans_volatile = movmatrix_trans


class Pair:
    """A packed bf16x2 register in value mode: (lo, hi) as float64 (no rounding)."""

    __slots__ = ("hi", "lo")

    def __init__(self, lo, hi):
        self.lo, self.hi = float(lo), float(hi)

    def __and__(self, mask):
        mask = int(mask) & 0xFFFFFFFF
        lo, hi = mask & 0xFFFF, mask >> 16
        assert lo in (0, 0xFFFF) and hi in (0, 0xFFFF), f"partial mask {mask:#x}"
        return Pair(self.lo if lo else 0.0, self.hi if hi else 0.0)

    __rand__ = __and__

    def __repr__(self):
        return f"Pair({self.lo}, {self.hi})"


def _num(x):
    """A Python float of a float / numpy / DSL constant (Float32(0.0).value)."""
    return float(getattr(x, "value", x))


class SimtValues(Simt):
    """Simt with values instead of bits, for the arithmetic of a kernel's trace-time helpers:
    packed bf16x2 registers are Pair(lo, hi), f32 registers floats, and every ptx arithmetic
    wrapper is exact float64 arithmetic (no rounding is simulated: a layout or index slip gives
    O(1) errors). Shared memory: 16-bit slots (smem16[byte // 2]) and f32 words
    (smem32[byte // 4]) as two float64 arrays; global memory: a dict byte address -> value
    (loads of unwritten addresses fail). sigmoid_bf16x2_from_logit takes the logit as a float.
    Shared-memory writes are immediate (the bit-level Simt checks the synchronisation)."""

    PATCHED = Simt.PATCHED + (
        "mma_bf16_16816",
        "pack_bf16x2_i32",
        "sub_bf16x2",
        "mul_bf16x2",
        "add_bf16x2",
        "sigmoid_bf16x2_from_logit",
        "select_lt",
        "ld_shared_f32",
        "ffma",
        "bf16x2_lo_to_f32",
        "bf16x2_hi_to_f32",
        "ld_global_b32_if",
        "ld_global_u16_if",
    )

    def __init__(self, smem_bytes, nthreads):
        super().__init__(16, smem_bytes, nthreads)
        self.smem16 = np.full(smem_bytes // 2, np.nan)
        self.smem32 = np.full(smem_bytes // 4, np.nan)
        self.g = {}

    def _flush_all(self):
        pass

    def _flush_warp(self, warp):
        pass

    # ---- global memory
    def ld_global_b32_if(self, addr, idx, limit):
        if int(idx) < int(limit):
            a = int(addr)
            return Pair(self.g[a], self.g[a + 2])
        return Pair(0.0, 0.0)

    def ld_global_u16_if(self, addr, idx, limit):
        return self.g[int(addr)] if int(idx) < int(limit) else 0.0

    def st_global_b32_if(self, addr, value, idx, limit):
        if int(idx) < int(limit):
            a = int(addr)
            assert a % 4 == 0
            with self.lock:
                self.global_writes.append((a, 4))
            self.g[a], self.g[a + 2] = value.lo, value.hi

    def st_global_f32x2_of_bf16x2_if(self, addr, value, idx, limit):
        if int(idx) < int(limit):
            a = int(addr)
            assert a % 8 == 0
            with self.lock:
                self.global_writes.append((a, 8))
            self.g[a], self.g[a + 4] = value.lo, value.hi

    def st_global_v4(self, addr, regs):
        a = int(addr)
        assert a % 16 == 0
        with self.lock:
            self.global_writes.append((a, 16))
        if isinstance(regs[0], Pair):  # 8 bf16
            for i, p in enumerate(regs):
                self.g[a + 4 * i], self.g[a + 4 * i + 2] = p.lo, p.hi
        else:  # 4 f32 (widened)
            for i, x in enumerate(regs):
                self.g[a + 4 * i] = float(x)

    # ---- shared memory
    def ld_shared_f32(self, addr):
        a = int(addr)
        assert a % 4 == 0
        return float(self.smem32[a // 4])

    def _pairs(self, addr, n):
        a = self._s(addr, 4 * n) // 2
        return [Pair(self.smem16[a + 2 * i], self.smem16[a + 2 * i + 1]) for i in range(n)]

    def ld_shared_v4(self, addr):
        return self._pairs(addr, 4)

    def ld_shared_v2(self, addr):
        return self._pairs(addr, 2)

    def bf16x2_lo_bits(self, w):
        return w.lo

    def bf16x2_hi_bits(self, w):
        return w.hi

    def _vrows(self, addrs):
        mats = []
        for i in range(4):
            mats.append(
                np.stack(
                    [
                        self.smem16[self._s(int(addrs[8 * i + r]), 16) // 2 :][:8]
                        for r in range(8)
                    ]
                )
            )
        return mats

    @staticmethod
    def _vfrag(x, lane):
        return Pair(x[lane // 4, 2 * (lane % 4)], x[lane // 4, 2 * (lane % 4) + 1])

    @staticmethod
    def _vunfrag(pairs):
        x = np.zeros((8, 8))
        for lane, p in enumerate(pairs):
            x[lane // 4, 2 * (lane % 4)] = p.lo
            x[lane // 4, 2 * (lane % 4) + 1] = p.hi
        return x

    def ldmatrix_x4(self, addr):
        def compute(addrs):
            mats = self._vrows(addrs)
            return [[self._vfrag(m, lane) for m in mats] for lane in range(32)]

        return self._collective(compute, int(addr))

    def ldmatrix_x4_trans(self, addr):
        def compute(addrs):
            mats = [m.T for m in self._vrows(addrs)]
            return [[self._vfrag(m, lane) for m in mats] for lane in range(32)]

        return self._collective(compute, int(addr))

    def stmatrix_x4_trans(self, addr, regs):
        def compute(args):
            for i in range(4):
                x = self._vunfrag([args[lane][1][i] for lane in range(32)]).T
                for r in range(8):
                    a = self._s(args[8 * i + r][0], 16) // 2
                    self.smem16[a : a + 8] = x[r]
            return [None] * 32

        self._collective(compute, (int(addr), list(regs)))

    def movmatrix_trans(self, x):
        def compute(pairs):
            m = self._vunfrag(pairs).T
            return [self._vfrag(m, lane) for lane in range(32)]

        return self._collective(compute, x)

    movmatrix_trans_volatile = movmatrix_trans

    def mma_bf16_16816(self, a, b, c):
        def compute(args):
            A = np.zeros((16, 16))
            B = np.zeros((16, 8))
            C = np.zeros((16, 8))
            for lane, (aa, bb, cc) in enumerate(args):
                g, t = lane // 4, lane % 4
                for e, half in ((0, "lo"), (1, "hi")):
                    A[g, 2 * t + e] = getattr(aa[0], half)
                    A[g + 8, 2 * t + e] = getattr(aa[1], half)
                    A[g, 2 * t + 8 + e] = getattr(aa[2], half)
                    A[g + 8, 2 * t + 8 + e] = getattr(aa[3], half)
                    B[2 * t + e, g] = getattr(bb[0], half)
                    B[2 * t + 8 + e, g] = getattr(bb[1], half)
                    C[g, 2 * t + e] = cc[e]
                    C[g + 8, 2 * t + e] = cc[2 + e]
            Dm = A @ B + C
            return [
                [Dm[lane // 4, 2 * (lane % 4)], Dm[lane // 4, 2 * (lane % 4) + 1],
                 Dm[lane // 4 + 8, 2 * (lane % 4)], Dm[lane // 4 + 8, 2 * (lane % 4) + 1]]
                for lane in range(32)
            ]

        return self._collective(compute, (list(a), list(b), [_num(x) for x in c]))

    # ---- register arithmetic (exact)
    def pack_bf16x2_i32(self, lo, hi):
        return Pair(_num(lo), _num(hi))

    def sub_bf16x2(self, a, b):
        return Pair(a.lo - b.lo, a.hi - b.hi)

    def mul_bf16x2(self, a, b):
        return Pair(a.lo * b.lo, a.hi * b.hi)

    def add_bf16x2(self, a, b):
        return Pair(a.lo + b.lo, a.hi + b.hi)

    def sigmoid_bf16x2_from_logit(self, x):
        s = 1.0 / (1.0 + np.exp(-float(x)))
        return Pair(s, s)

    def select_lt(self, idx, limit, a, b):
        return int(a) if int(idx) < int(limit) else int(b)

    def ffma(self, a, b, c):
        return _num(a) * _num(b) + _num(c)

    def bf16x2_lo_to_f32(self, w):
        return w.lo

    def bf16x2_hi_to_f32(self, w):
        return w.hi
