"""How every kernel is compiled ahead of time: fake tensors for `cute.compile` and the options.

Each kernel module exposes `compile_kernel(variant, arch, *, dump_dir=None)` built on
`compile_for_arch`, so the AOT build (jax_kda/_aot/build.py) and the tests compile every kernel
the same way: for a NAMED architecture (CuTe DSL silently targets sm_100a otherwise) with the
fast-math NVVM options of the numerics contract.
"""

from __future__ import annotations

from cutlass import cute
from cutlass.base_dsl.compiler import DumpDir, ExtraCompilerOpts
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from ..contract import ARCHS, NVVM_FAST_MATH


def symbol(name: str):
    """A dynamic 32-bit dimension (T_total, H, N, ...): the kernels take int32 sizes."""
    return cute.sym_int32(symbol=name)


def fake_tensor(dtype, shape, align: int):
    """A compact row-major global tensor of `shape` (ints or symbols), `align`-byte aligned."""
    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)


def fake_stream():
    return make_fake_stream()


def check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {tuple(ARCHS)}, got {arch!r}")


def compile_for_arch(kernel, args, arch: str, *, dump_dir: str | None = None):
    """cute.compile(kernel, *args) for `arch` with the contract's compiler options. With
    dump_dir, the PTX and cubin are kept (files in dump_dir, `__ptx__` / `__cubin__` on the
    result)."""
    check_arch(arch)
    opts = [cute.GPUArch(arch), ExtraCompilerOpts(NVVM_FAST_MATH)]
    if dump_dir is not None:
        opts += [DumpDir(dump_dir), cute.KeepPTX(), cute.KeepCUBIN()]
    return cute.compile[tuple(opts)](kernel, *args)
