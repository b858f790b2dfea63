"""The float64 JAX oracle (jax_kda.oracle_jax) against the numpy oracle: its forward equals it to
float64 rounding, and its autodiff gradients equal central finite differences of the numpy oracle
(eps = 1e-6 in float64: truncation ~1e-12, cancellation ~1e-10 relative; the difference is
asserted below 1e-9 of |grad| |direction|), including channels that never forget, where a naive
sigmoid derivative is NaN."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kda import oracle, oracle_jax
from jax_kda.bench import regimes

D = 128
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
CU = np.array([0, 0, 5, 5, 21])  # empty sequences, and tokens 21..23 covered by none


def inputs(seed, T, H, regime, N=1):
    """float64 numpy inputs (the bf16 ones bf16 values) and an f32-valued initial state."""
    rng = np.random.default_rng(seed)
    a = {n: np.asarray(x.astype(jnp.float32), np.float64)
         for n, x in regimes.make_inputs(rng, T, H, regime).items()}
    state = 0.1 * rng.standard_normal((N, H, D, D))
    a["initial_state"] = state.astype(np.float32).astype(np.float64)
    return a, rng


def never_forgetting(a, rng):
    """A_log = log 16 and g ~ N(-3, 1) (decays that round to 1 in f32), a quarter of the key
    channels with dt_bias = -30 (exp(A_log) (g + dt_bias) ~ -530: sigmoid ~ 1e-230)."""
    a = dict(a)
    a["A_log"] = np.full_like(a["A_log"], np.log(16.0))
    a["g"] = np.asarray(jnp.asarray(rng.normal(-3.0, 1.0, a["g"].shape), jnp.bfloat16)
                        .astype(jnp.float32), np.float64)
    a["dt_bias"] = np.where(np.arange(D) % 4 == 0, -30.0, a["dt_bias"])
    return a


def relative_error(got, want):
    return float(np.linalg.norm(np.ravel(got - want)) / np.linalg.norm(np.ravel(want)))


@pytest.mark.parametrize("cu", [None, CU], ids=["batched", "packed"])
def test_forward_equals_the_numpy_oracle(cu):
    a, _ = inputs(0, 24, 2, "keep32", N=1 if cu is None else len(CU) - 1)
    want_out, want_state = oracle.kda_prefill_oracle(**a, cu_seqlens=cu)
    out, state = map(np.asarray, oracle_jax.kda_prefill_oracle_jax(**a, cu_seqlens=cu))
    assert out.dtype == state.dtype == np.float64
    assert relative_error(out, want_out) < 1e-12
    assert relative_error(state, want_state) < 1e-12
    if cu is not None:
        assert np.all(out[0, CU[-1]:] == 0.0)
        np.testing.assert_array_equal(state[[0, 2]], a["initial_state"][[0, 2]])  # empty


@pytest.mark.parametrize("regime", ["fla", "never_forgetting"])
def test_gradients_equal_finite_differences_of_the_numpy_oracle(regime):
    T, H = 24, 2
    a, rng = inputs(1, T, H, "fla", N=len(CU) - 1)
    if regime == "never_forgetting":
        a = never_forgetting(a, rng)
    d_out = rng.standard_normal((1, T, H, D))
    d_state = rng.standard_normal(a["initial_state"].shape)
    _, _, grads = oracle_jax.kda_prefill_oracle_vjp(**a, cu_seqlens=CU, d_out=d_out,
                                                    d_final_state=d_state)
    grads = dict(zip(NAMES, grads))
    for n, grad in grads.items():
        assert grad.dtype == np.float64 and np.all(np.isfinite(grad)), n
    np.testing.assert_array_equal(grads["q"][0, CU[-1]:], 0.0)  # covered by no sequence
    np.testing.assert_array_equal(grads["initial_state"][[0, 2]], d_state[[0, 2]])  # empty

    def loss(point):
        out, state = oracle.kda_prefill_oracle(**point, cu_seqlens=CU)
        return np.sum(out * d_out) + np.sum(state * d_state)

    eps = 1e-6
    directions = {n: rng.standard_normal(a[n].shape) for n in NAMES}

    def shifted(step, names):  # a moved by step along the directions of the named inputs
        return {n: a[n] + step * directions[n] if n in names else a[n] for n in NAMES}

    for names in [(n,) for n in NAMES] + [NAMES]:
        finite_difference = (loss(shifted(eps, names)) - loss(shifted(-eps, names))) / (2 * eps)
        autodiff = sum(float(np.sum(grads[n] * directions[n])) for n in names)
        # relative to the largest value the directional derivative could take, |grad| |direction|
        bound = np.sqrt(sum(np.sum(grads[n] ** 2) * np.sum(directions[n] ** 2) for n in names))
        assert bound > 1.0, names  # a real signal
        rounding = 4e-16 * abs(loss(a)) / eps  # float64 cancellation in the difference
        assert abs(autodiff - finite_difference) < 1e-9 * bound + rounding, (
            names, autodiff, finite_difference)


def test_never_forgetting_channels_have_finite_tiny_gate_gradients():
    """The derivative of the gate w.r.t. g is sigmoid' ~ 1e-230 there: finite and (nearly) zero."""
    a, rng = inputs(2, 16, 1, "fla")
    a = never_forgetting(a, rng)
    _, _, grads = oracle_jax.kda_prefill_oracle_vjp(
        **a, d_out=rng.standard_normal((1, 16, 1, D)),
        d_final_state=rng.standard_normal(a["initial_state"].shape))
    dg, ddt = grads[3], grads[6]
    keep = np.arange(D) % 4 == 0
    assert np.all(np.isfinite(dg)) and np.all(np.isfinite(ddt))
    assert np.max(np.abs(dg[..., keep])) < 1e-150 and np.max(np.abs(dg[..., ~keep])) > 1e-3
