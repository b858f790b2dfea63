"""backend="auto": one jitted function, the kernels where it is lowered for CUDA, the reference
elsewhere (lax.platform_dependent), so the same model runs on CPU and GPU."""

import re
from functools import partial

import jax
import numpy as np
import pytest
from kda_testing import assert_bits, make_inputs

import jax_kda
from jax_kda import _ffi

B, T, H = 1, 21, 2
TARGETS = ["jax_kda_prepare_v1", "jax_kda_recurrence_v1"]


def make_args(seed=0, t=T, h=H):
    """kda_prefill's positional arrays."""
    return tuple(make_inputs(np.random.default_rng(seed), B, t, h).values())


def kda(*args, backend):
    return jax_kda.kda_prefill(*args, output_final_state=True, backend=backend)


@pytest.fixture(params=["built", "not built"])
def kernels_built(request, monkeypatch):
    """Both states of the FFI library: "built" pretends it is (lowering a custom call needs no
    library; on this CPU nothing may run it), "not built" pretends it is missing."""
    monkeypatch.setattr(_ffi, "kernels_available", lambda: request.param == "built")
    return request.param == "built"


def kda_targets(text):
    return sorted(re.findall(r"custom_call @(jax_kda_\w+)\(", text))


def test_auto_under_jit_on_cpu_runs_the_reference(kernels_built):
    args = make_args()
    compiled = jax.jit(partial(kda, backend="auto")).lower(*args).compile()
    # nothing of the kernel path reached the CPU executable
    assert "jax_kda_" not in compiled.as_text()
    assert_bits(compiled(*args), jax.jit(partial(kda, backend="reference"))(*args))


def test_same_function_lowers_per_platform(kernels_built):
    args = make_args(seed=1)
    traced = jax.jit(partial(kda, backend="auto")).trace(*args)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    both = traced.lower(lowering_platforms=("cuda", "cpu")).as_text()
    assert kda_targets(cpu) == []
    if kernels_built:
        assert kda_targets(cuda) == TARGETS
        assert kda_targets(both) == TARGETS  # one pair, used only when the platform is CUDA
    else:  # without the library "auto" is the reference everywhere
        assert kda_targets(cuda) == kda_targets(both) == []


def test_kernel_backend_refuses_on_cpu():
    args = make_args(seed=2)
    with pytest.raises(jax_kda.KernelsUnavailableError, match=r"backend='auto' or 'reference'"):
        kda(*args, backend="kernel")


@pytest.mark.gpu
def test_gpu_auto_runs_the_kernels(kernel_gpus):
    gpus = kernel_gpus
    args = jax.device_put(make_args(seed=3, t=300, h=6), gpus[0])
    auto = jax.jit(partial(kda, backend="auto"))
    assert kda_targets(auto.lower(*args).as_text()) == TARGETS
    compiled = auto.lower(*args).compile().as_text()
    assert "jax_kda_prepare_v1" in compiled and "jax_kda_recurrence_v1" in compiled
    assert_bits(auto(*args), jax.jit(partial(kda, backend="kernel"))(*args))
