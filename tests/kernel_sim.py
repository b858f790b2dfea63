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
