"""Locates what the C++ side builds against; run by CMake at configure time.

Prints `KEY=VALUE` lines: the XLA FFI headers of the installed jaxlib (must be 0.11.x, whose FFI
API 0.4 is accepted by jaxlib 0.11 and 0.12; headers from 0.12 are refused by 0.11), and the
CUDA runtime headers and static library of the nvidia-cuda-runtime 13.0 wheel.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys


def _fail(message: str) -> None:
    print(f"jax_kda toolchain: {message}", file=sys.stderr)
    raise SystemExit(1)


def jax_ffi_include_dir() -> str:
    version = importlib.metadata.version("jaxlib")
    if not version.startswith("0.11."):
        _fail("the FFI handlers must be built against jaxlib 0.11.x headers, "
              f"found jaxlib {version}")
    import jax

    return jax.ffi.include_dir()


def cuda_runtime_root() -> pathlib.Path:
    try:
        dist = importlib.metadata.distribution("nvidia-cuda-runtime")
    except importlib.metadata.PackageNotFoundError:
        _fail("nvidia-cuda-runtime (13.0) is not installed in the build environment")
    if not dist.version.startswith("13.0"):
        _fail(f"expected nvidia-cuda-runtime 13.0.*, found {dist.version}")
    for file in dist.files or ():
        if file.name == "libcudart_static.a":
            lib = pathlib.Path(dist.locate_file(file)).resolve()
            return lib.parent.parent
    _fail("nvidia-cuda-runtime has no libcudart_static.a")


def main() -> None:
    root = cuda_runtime_root()
    print(f"JAX_FFI_INCLUDE_DIR={jax_ffi_include_dir()}")
    print(f"CUDA_INCLUDE_DIR={root / 'include'}")
    print(f"CUDART_STATIC={root / 'lib' / 'libcudart_static.a'}")


if __name__ == "__main__":
    main()
