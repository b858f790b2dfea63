"""Shared fixtures."""

import pathlib
import sys

import pytest

# Test modules import the helpers beside them (kernel_sim.py) also under --import-mode=importlib,
# which the GPU round trip uses and which does not put this folder on sys.path.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

from jax_kda import _ffi


@pytest.fixture
def kernel_gpus():
    """The CUDA devices the built kernels run on; skips the test where there are none."""
    gpus = _ffi.kernel_gpus()
    if not gpus:
        pytest.skip(f"needs a CUDA GPU with the built kernels ({_ffi.unavailable_reason() or 'no such GPU'})")
    return gpus
