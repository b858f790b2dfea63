"""benchmarks/fp32_state_step_experiment.py, on CPU: the proposed 32-token state step of the fp32
mode must compute the same recurrence as today's 16-token step (a wrong correction term would
leave its error against the float64 oracle far above the 16-token step's), and must keep its
accuracy."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import make_inputs

from jax_kda import oracle
from jax_kda import reference_fp32 as r32

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")]

import fp32_state_step_experiment as exp


@pytest.mark.parametrize("form", exp.FORMS)
@pytest.mark.parametrize("regime", ["fla", "slow"])
def test_the_32_token_step_is_the_recurrence_at_the_16_token_steps_accuracy(regime, form):
    rng = np.random.default_rng(7)
    a = make_inputs(rng, 1, 128, 2, regime=regime)
    want_out, want_state = oracle.kda_prefill_oracle(
        **{n: np.asarray(x.astype(jnp.float32)) for n, x in a.items()}, lower_bound=exp.LOWER_BOUND)
    out_16, state_16 = jax.jit(lambda a: r32.kda_prefill_reference_fp32(
        **a, scale=exp.SCALE, lower_bound=exp.LOWER_BOUND))(a)
    out_32, state_32 = jax.jit(lambda a: exp.prefill_pairs(**a, form=form))(a)
    assert out_32.shape == out_16.shape and state_32.shape == state_16.shape
    e16, e32 = exp.rel_rmse(out_16, want_out), exp.rel_rmse(out_32, want_out)
    s16, s32 = exp.rel_rmse(state_16, want_state), exp.rel_rmse(state_32, want_state)
    assert e32 <= 1.05 * e16 and e32 < 2.0e-3, (e16, e32)
    assert s32 <= 1.5 * s16 + 1e-6 and s32 < 2.5e-3, (s16, s32)
    # the two steps round differently, but most outputs still agree bit for bit
    same = np.mean(np.asarray(out_32) == np.asarray(out_16))
    assert same > 0.8, same  # measured 0.87 (slow) .. 0.9+ (fla) at T = 128


@pytest.mark.parametrize("form", exp.FORMS)
def test_dropping_the_cross_chunk_correction_is_caught(monkeypatch, form):
    """Without A_ba . U_a (P_b then ignores chunk a's update) the error is far off: the test above
    can fail."""
    rng = np.random.default_rng(8)
    a = make_inputs(rng, 1, 128, 1, regime="slow")
    want_out, _ = oracle.kda_prefill_oracle(
        **{n: np.asarray(x.astype(jnp.float32)) for n, x in a.items()}, lower_bound=exp.LOWER_BOUND)
    real = exp._pair_workspace

    def without_correction(*args):
        ws = real(*args)
        zero = jnp.zeros_like(ws["A_ba"].hi)
        return {**ws, "A_ba": r32.HiLo(zero, zero)}

    monkeypatch.setattr(exp, "_pair_workspace", without_correction)
    out, _ = jax.jit(lambda a: exp.prefill_pairs(**a, form=form))(a)
    assert exp.rel_rmse(out, want_out) > 5e-3
