"""Derivatives: the kernel path is inference-only (clear error naming the alternative); the
reference path (backend="reference") is differentiable by JAX autodiff and its gradients are
right."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda import api, oracle

B, T, H = 1, 20, 2
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state")
ALTERNATIVE = r"backend='reference'"


def bf16_values(x):
    """x rounded to bf16 but kept in f32: a point where the bf16 inputs are exactly x."""
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def make_point(seed=0):
    """f32 values of every input (the bf16 ones bf16-representable) and a direction for each."""
    rng = np.random.default_rng(seed)
    token = (B, T, H, 128)
    shapes = {"q": token, "k": token, "v": token, "g": token, "beta": (B, T, H), "A_log": (H,),
              "dt_bias": (H, 128), "state": (B, H, 128, 128)}
    x = {n: bf16_values(rng.standard_normal(s)) for n, s in shapes.items()}
    x["A_log"] = rng.uniform(-1.0, 0.5, H).astype(np.float32)
    x["state"] = bf16_values(0.1 * rng.standard_normal(shapes["state"]))
    direction = {n: bf16_values(rng.standard_normal(s)) for n, s in shapes.items()}
    weights = (rng.standard_normal(shapes["q"]), rng.standard_normal(shapes["state"]))
    return x, direction, weights


def prefill(x, backend, lower_bound=-5.0):
    bf = lambda a: jnp.asarray(a).astype(jnp.bfloat16)
    return jax_kda.kda_prefill(
        bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["g"]), bf(x["beta"]), jnp.asarray(x["A_log"]),
        jnp.asarray(x["dt_bias"]), initial_state=jnp.asarray(x["state"], jnp.float32),
        output_final_state=True, backend=backend, lower_bound=lower_bound,
    )


def loss(x, weights, backend="reference", lower_bound=-5.0):
    out, state = prefill(x, backend, lower_bound)
    return jnp.sum(out.astype(jnp.float32) * weights[0]) + jnp.sum(state * weights[1])


# ------------------------------------------------------------------------------ inference only


@pytest.fixture(params=["auto", "kernel"])
def inference_backend(request, monkeypatch):
    """auto (reference on this CPU, still guarded) and kernel (availability check skipped: the
    derivative fails while tracing, before anything would run on a GPU)."""
    if request.param == "kernel":
        monkeypatch.setattr(api, "_require_kernels", lambda: None)
    return request.param


def assert_inference_only(excinfo):
    assert isinstance(excinfo.value, NotImplementedError)
    message = str(excinfo.value)
    assert "inference-only" in message and ALTERNATIVE in message, message


def test_grad_raises_inference_only(inference_backend):
    x, _, weights = make_point()
    with pytest.raises(jax_kda.KdaInferenceOnlyError) as excinfo:
        jax.grad(partial(loss, weights=weights, backend=inference_backend))(x)
    assert_inference_only(excinfo)


def test_grad_under_jit_and_of_one_parameter_raises(inference_backend):
    x, _, weights = make_point()

    def of_A_log(A_log):
        return loss(dict(x, A_log=A_log), weights, inference_backend)

    with pytest.raises(jax_kda.KdaInferenceOnlyError) as excinfo:
        jax.jit(jax.grad(of_A_log))(x["A_log"])
    assert_inference_only(excinfo)


@pytest.mark.parametrize("transform", ["jvp", "linearize", "vjp", "jacfwd"])
def test_other_derivatives_raise(inference_backend, transform):
    x, direction, _ = make_point()
    f = lambda state: prefill(dict(x, state=state), inference_backend)[1]
    state, tangent = jnp.asarray(x["state"]), jnp.asarray(direction["state"])
    derivative = {  # under jit: the error comes while tracing, nothing runs
        "jvp": lambda s, t: jax.jvp(f, (s,), (t,)),
        "linearize": lambda s, t: jax.linearize(f, s)[1](t),
        "vjp": lambda s, t: jax.vjp(f, s)[1](t),
        "jacfwd": lambda s, t: jax.jacfwd(lambda s: jnp.sum(f(s)))(s),
    }[transform]
    with pytest.raises(jax_kda.KdaInferenceOnlyError) as excinfo:
        jax.jit(derivative)(state, tangent)
    assert_inference_only(excinfo)


def test_grad_of_other_parameters_passes_through():
    """A model that differentiates something else (kda_prefill's inputs do not depend on it)
    works."""
    x, _, _ = make_point()

    def model(w):
        out, _ = prefill(x, "auto")
        return jnp.sum(out.astype(jnp.float32)) * 0.0 + w * w

    assert float(jax.jit(jax.grad(model))(3.0)) == 6.0


# ------------------------------------------------------------- gradients of the reference path


def test_reference_gradients_match_finite_differences_of_the_exact_function():
    """jax.grad through backend="reference" vs central finite differences in float64.

    Finite differences of the reference itself measure nothing useful: it rounds to bf16 at every
    step (docs/numerics.md), so it is piecewise constant at the scale of small steps and noisy at
    large ones.
    Autodiff treats each rounding as the identity, so its gradient is the derivative of the exact
    KDA function evaluated with bf16-rounded intermediates. The test therefore compares it with
    central differences of the float64 oracle (the exact function; smooth, so eps = 1e-2 has a
    negligible truncation error) at a point where the bf16 inputs are exact, along a random
    direction for each input separately and for all together, to 3 %.

    lower_bound = -1 (not the default -5): with strong decay the chunk form's gate derivative is a
    sum of large terms that cancel (2^G_r and 2^-G_r factors computed separately, each to bf16),
    so the g and dt_bias gradients are dominated by bf16 noise (errors of ~1 % of the sum of
    absolute contributions). That is a property of differentiating a bf16 computation, not a bug;
    at -1 every directional derivative matches to ~2 %.
    """
    lower_bound = -1.0
    x, direction, weights = make_point(seed=1)
    grads = jax.jit(jax.grad(partial(loss, weights=weights, lower_bound=lower_bound)))(x)

    def exact_loss(point):
        out, state = oracle.kda_prefill_oracle(
            point["q"], point["k"], point["v"], point["g"], point["beta"], point["A_log"],
            point["dt_bias"], initial_state=point["state"], lower_bound=lower_bound,
        )
        return float(np.sum(out * weights[0]) + np.sum(state * weights[1]))

    def shifted(step, names):  # x moved by step along the direction of the named inputs
        return {n: (x[n].astype(np.float64) + step * direction[n] if n in names else x[n])
                for n in NAMES}

    eps = 1e-2
    for names in [(n,) for n in NAMES] + [NAMES]:
        up, down = exact_loss(shifted(eps, names)), exact_loss(shifted(-eps, names))
        finite_difference = (up - down) / (2 * eps)
        autodiff = sum(float(np.sum(np.asarray(grads[n], np.float64) * direction[n]))
                       for n in names)
        assert abs(finite_difference) > 0.1, (names, finite_difference)  # a real signal
        assert autodiff == pytest.approx(finite_difference, rel=0.03), names
