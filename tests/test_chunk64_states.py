"""benchmarks/chunk64_states.py, on CPU: the 64-token steps of the forward state chain compute the
16-token chain's states (a wrong cross-sub-chunk term or decay would leave them far from the
exact ones), at the 16-token steps' accuracy, with never-forgetting channels and strong decay."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

from jax_kda.bench import gradients

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")]

import chunk64_states as c64  # noqa: E402


@pytest.mark.parametrize("regime", ["strong", "unit_decay"])
def test_64_token_steps_keep_the_16_token_accuracy(regime):
    T = 128 + 64  # three steps of 64 tokens
    case = gradients.make_case(np.random.default_rng(2), T, 1, regime)
    f, v = c64.chunk_factors(case, T)
    errors = c64.state_errors(f, v, case.primals[7], c64.PRODUCTS["f32"],
                              c64.exact_states(case, T))
    print(f"{regime}: 16-token steps {errors[0]:.2e}, 64-token steps {errors[1]:.2e}")
    assert errors[1] <= max(2 * errors[0], 1e-6)
