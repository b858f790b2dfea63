"""Shared fixtures."""

import pytest

from jax_kda import _ffi


@pytest.fixture
def kernel_gpus():
    """The CUDA devices the built kernels run on; skips the test where there are none."""
    gpus = _ffi.kernel_gpus()
    if not gpus:
        pytest.skip(f"needs a CUDA GPU with the built kernels ({_ffi.unavailable_reason() or 'no such GPU'})")
    return gpus
