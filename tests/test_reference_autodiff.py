"""jax.grad through both numerics modes' pure-JAX references where channels never forget: finite,
and close to the float64 oracle's gradients.

Case: jax_kda.bench.gradients' "unit_decay" (A_log = log 16, g ~ N(-3, 1), a quarter of the
channels with dt_bias = -30), where exp(A_log) (g + dt_bias) < -88.7 makes 2^(-x log2 e) overflow
in the fp32 mode's sigmoid: its autodiff gave NaN gate gradients until the sigmoid got its own
derivative. Autodiff treats every rounding as the identity, and its cotangents pass through the
forward's bf16 (flashkda) or hi/lo (fp32) values, so its error is well above the rounding floor
(~1.7e-3). Bounds (relative RMSE vs the oracle, every gradient, T = 64, 2 heads): fp32 <= 1e-2
(measured 1.1e-4 .. 3.8e-3), flashkda <= 3e-2 (2.0e-3 .. 7.1e-3; up to 1.2e-2 at T = 1024).
benchmarks/grad_accuracy.py measures every regime (the flashkda mode's gate gradients reach 0.19
in the strong regime there).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kda import reference, reference_fp32
from jax_kda.bench import gradients

BOUNDS = {"fp32": 1e-2, "flashkda": 3e-2}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp32", "flashkda"])
def test_reference_gradients_finite_and_close_where_channels_never_forget(mode):
    case = gradients.make_case(np.random.default_rng(20), 64, 2, "unit_decay")
    g, A_log, dt_bias = case.primals[3], case.primals[5], case.primals[6]
    x = np.exp(np.asarray(A_log))[:, None] * (np.asarray(g, np.float32) + np.asarray(dt_bias))
    assert np.any(x < -88.8)  # the case reaches the overflow
    want = gradients.exact(case)
    got = gradients.reference_autodiff(mode, case)
    for name, a, w in zip(gradients.GRADIENT_NAMES, got, want):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        error = gradients.rel_rmse(a, w)
        print(f"{mode} {name}: {error:.2e}")
        assert error <= BOUNDS[mode], name


@pytest.mark.parametrize("sigmoid", [reference_fp32.sigmoid_exp2, reference.sigmoid_tanh],
                         ids=["fp32_mode", "flashkda_mode"])
def test_sigmoid_derivatives_are_finite_and_right(sigmoid):
    """Both modes' sigmoids differentiate to sigmoid(x) sigmoid(-x) (f32-accurate; tanh.approx's
    emulation to its ~2^-12 absolute error) over the whole range, x = -1000 included."""
    x = np.concatenate([-np.geomspace(1000, 1e-3, 200), [0.0], np.geomspace(1e-3, 1000, 200)])
    got = np.asarray(jax.vmap(jax.grad(sigmoid))(jnp.asarray(x, jnp.float32)), np.float64)
    tail = np.exp(-np.abs(x.astype(np.float32).astype(np.float64)))
    exact = tail / (1.0 + tail) ** 2  # sigmoid'(x)
    assert np.all(np.isfinite(got))
    tolerance = 1e-5 * exact + 1e-38 if sigmoid is reference_fp32.sigmoid_exp2 else 5e-4
    assert np.all(np.abs(got - exact) <= tolerance)
