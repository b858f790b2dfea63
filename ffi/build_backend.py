"""PEP 517 build backend: scikit-build-core, plus the kernel toolchain as build requirements.

The toolchain (CuTe DSL, jaxlib 0.11.2 for its FFI headers, the CUDA 13.0 runtime headers and
static library) is only requested when the kernels are built, so `JAX_KDA_BUILD_KERNELS=0 pip
install .` makes a reference-only package without downloading any of it. None of these are
runtime dependencies: importing jax_kda never needs CuTe DSL.
"""

from __future__ import annotations

import os

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # build_wheel, build_sdist, build_editable, ...

KERNEL_BUILD_REQUIRES = [
    "nvidia-cutlass-dsl==4.8.1",
    "jax==0.11.2",
    "jaxlib==0.11.2",  # FFI API 0.4 headers: accepted by jaxlib 0.11 and 0.12 (0.12's are not by 0.11)
    "nvidia-cuda-runtime==13.0.*",  # cuda_runtime.h + libcudart_static.a
    "nvidia-cuda-crt==13.0.*",  # crt/host_config.h, included by cuda_runtime.h
    "nvidia-cuda-cccl==13.0.*",  # nv/target, included by cuda_fp16.h in the exported headers
]


def kernels_enabled() -> bool:
    return os.environ.get("JAX_KDA_BUILD_KERNELS", "1") != "0"


def _with_kernel_requires(requires: list[str]) -> list[str]:
    return [*requires, *KERNEL_BUILD_REQUIRES] if kernels_enabled() else list(requires)


def get_requires_for_build_wheel(config_settings=None):
    return _with_kernel_requires(_scikit_build.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None):
    return _with_kernel_requires(_scikit_build.get_requires_for_build_editable(config_settings))
