"""The backward's chains as the chain kernel runs them (reference_backward, chains="kernel"),
with the kernel replaced by its plain-JAX model (tests/state_chain_model.py): the operands that
reference_backward builds for the kernel give the scans' gradients (chains="scan") to f32
rounding, and the float64 oracle's as test_reference_backward demands. The kernel itself against
the model: tests/test_gpu_backward.py."""

import numpy as np
import pytest
from state_chain_model import state_chains_model
from test_reference_backward import CU, NAMES, H, T, assert_matches_exact

from jax_kda import _state_chain, reference_backward
from jax_kda.bench import gradients

# The two ways differ by reassociation only ((v - kd S^T)^T (b W^T kr) against (W b (v - kd S^T))^T
# kr, one chain step for dS_0): relative RMSE of the f32 gradients between them
BETWEEN_BOUND = 2e-5


@pytest.fixture
def modelled_kernel(monkeypatch):
    monkeypatch.setattr(_state_chain, "state_chains", state_chains_model)
    yield
    gradients.clear_cache()  # no later test may get a program compiled with the model


@pytest.mark.parametrize("cu_seqlens", [None, CU], ids=["batched", "packed"])
@pytest.mark.parametrize("regime", ["fla", "unit_decay"])
def test_kernel_operands_give_the_scans_gradients(modelled_kernel, regime, cu_seqlens):
    case = gradients.make_case(np.random.default_rng(12), T, H, regime, cu_seqlens=cu_seqlens)
    scans = gradients.backward(case, chains="scan")[0]
    kernel = gradients.backward(case, chains="kernel")[0]
    for name, a, b in zip(NAMES, kernel, scans):
        error = gradients.rel_rmse(a, b)
        print(f"{name}: {error:.1e}")
        assert np.all(np.isfinite(np.asarray(a))), name
        assert error <= BETWEEN_BOUND, name
    assert_matches_exact(case, gradients.exact(case), chains="kernel")


def test_chains_option_is_checked():
    case = gradients.make_case(np.random.default_rng(13), 32, 1, "fla")
    with pytest.raises(KeyError):
        gradients.backward(case, chains="threads")
    assert reference_backward.CHAINS == ("scan", "kernel", "auto")
