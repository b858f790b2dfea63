"""Derivatives of kda_prefill.

- backend "auto" / "kernel": jax.grad / jax.vjp / jax.value_and_grad run the custom VJP of
  jax_kda._vjp: the forward is the call as without differentiation, the backward
  jax_kda.reference_backward's gradient of the exact function (checked here against the float64
  oracle's autodiff, and bitwise against a direct call of the backward); calls without a
  derivative (pools, checkpoints, explicit segments, kda_decode) raise KdaInferenceOnlyError.
- backend "reference": plain JAX autodiff through the reference, checked against finite
  differences of the exact function.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda import _vjp, api, oracle, reference_backward
from jax_kda.bench import gradients

B, T, H = 1, 20, 2
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state")


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


def prefill(x, backend, lower_bound=-5.0, **options):
    bf = lambda a: jnp.asarray(a).astype(jnp.bfloat16)
    return jax_kda.kda_prefill(
        bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["g"]), bf(x["beta"]), jnp.asarray(x["A_log"]),
        jnp.asarray(x["dt_bias"]), initial_state=jnp.asarray(x["state"], jnp.float32),
        output_final_state=True, backend=backend, lower_bound=lower_bound, **options,
    )


def loss(x, weights, backend="reference", lower_bound=-5.0, **options):
    out, state = prefill(x, backend, lower_bound, **options)[:2]
    return jnp.sum(out.astype(jnp.float32) * weights[0]) + jnp.sum(state * weights[1])


# ------------------------------------------------------------- the kernel backends' custom VJP


@pytest.mark.parametrize("numerics", ["flashkda", "fp32"])
def test_auto_backend_gradient_is_the_backward_of_the_exact_function(numerics):
    """On this CPU "auto" runs the reference forward and the custom backward: its gradients are
    kda_prefill_vjp's on the same inputs and cotangents, bitwise, in the primals' dtypes, and the
    forward is the call's own."""
    x, _, weights = make_point(seed=2)
    value, grads = jax.jit(jax.value_and_grad(partial(loss, weights=weights, backend="auto",
                                                      numerics=numerics)))(x)
    assert float(value) == float(jax.jit(partial(loss, weights=weights, backend="auto",
                                                 numerics=numerics))(x))
    bf = lambda a: jnp.asarray(a).astype(jnp.bfloat16)
    d_out = jnp.asarray(weights[0], jnp.float32).astype(jnp.bfloat16)
    want = jax.jit(partial(reference_backward.kda_prefill_vjp, scale=None, lower_bound=-5.0))(
        bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["g"]), bf(x["beta"]), jnp.asarray(x["A_log"]),
        jnp.asarray(x["dt_bias"]), jnp.asarray(x["state"], jnp.float32), None, d_out,
        jnp.asarray(weights[1], jnp.float32))
    for name, w in zip(NAMES, want):
        # grads of the bf16 primals come back through the f32 -> bf16 casts of `prefill`
        got = np.asarray(grads[name], np.float32)
        np.testing.assert_array_equal(got, np.asarray(w.astype(jnp.float32)), err_msg=name)


def test_auto_backend_gradient_of_a_loss_of_the_output():
    """A cotangent computed from the output itself (a model's loss), several sequences of several
    chunks: it compiles on CPU, where XLA once folded the reference forward into the backward's
    products and built one with its batch axes in the wrong order (an HLO verifier error), and
    it is kda_prefill_vjp's gradient of that cotangent, bitwise."""
    rng = np.random.default_rng(6)
    n, t = 2, 64  # chunks per sequence (4) != sequences != heads: a mixed-up axis order shows
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    q, k, v, g, beta = *(bf(n, t, H, 128) for _ in range(4)), bf(n, t, H)
    A_log = jnp.asarray(rng.uniform(-1.0, 0.5, H), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal((H, 128)), jnp.float32)
    prefill = lambda q: jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, backend="auto")[0]
    dq = jax.jit(jax.grad(lambda q: 0.5 * jnp.sum(prefill(q).astype(jnp.float32) ** 2)))(q)
    d_out = jax.jit(prefill)(q)  # the cotangent of 0.5 |out|^2 is out
    want = jax.jit(partial(reference_backward.kda_prefill_vjp, scale=None, lower_bound=-5.0))(
        q, k, v, g, beta, A_log, dt_bias, None, None, d_out, None)
    np.testing.assert_array_equal(np.asarray(dq, np.float32), np.asarray(want.dq, np.float32))


@pytest.mark.parametrize("regime", ["fla", "keep32"])
def test_auto_backend_gradients_match_the_float64_oracle(regime):
    """jax.vjp of kda_prefill (backend "auto", packed sequences with an empty one) against the
    float64 oracle's autodiff: each gradient at the bf16 rounding floor (within 2 %) or, for the
    f32 ones, <= 3e-5 relative RMSE."""
    case = gradients.make_case(np.random.default_rng(4), 80, 2, regime, cu_seqlens=[0, 30, 30, 80])
    q, k, v, g, beta, A_log, dt_bias, state = case.primals
    cu = jnp.asarray(case.cu_seqlens)

    def f(q, k, v, g, beta, A_log, dt_bias, state):
        return jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state=state,
                                   cu_seqlens=cu, output_final_state=True, numerics="fp32")

    _, vjp = jax.vjp(f, *case.primals)
    got = vjp((case.d_out, case.d_final_state))
    want = gradients.exact(case)
    for name, x, gx, w in zip(gradients.GRADIENT_NAMES, case.primals, got, want):
        assert gx.dtype == x.dtype and gx.shape == x.shape, name
        error = gradients.rel_rmse(gx, w)
        if x.dtype == jnp.bfloat16:
            assert error <= 1.02 * gradients.rounding_error(w, x), (name, error)
        else:
            assert error <= 3e-5, (name, error)
    # tokens 30..79 belong to the third sequence; the empty second one passes its state gradient
    np.testing.assert_array_equal(np.asarray(got[7][1]), np.asarray(case.d_final_state[1]))


@pytest.mark.parametrize("options, why", [
    ({"state_indices": "pool"}, "state pools"),
    ({"checkpoint_every": 16}, "checkpoint_every"),
    ({"numerics": "fp32", "sequence_parallel": 2}, "sequence_parallel"),
])
def test_calls_without_a_derivative_say_so(options, why):
    x, _, weights = make_point()
    if options.get("state_indices") == "pool":
        options = {"state_indices": jnp.zeros((B,), jnp.int32)}
    with pytest.raises(jax_kda.KdaInferenceOnlyError, match=why):
        jax.grad(partial(loss, weights=weights, backend="auto", **options))(x)


def test_decode_has_no_derivative():
    x, _, _ = make_point()
    bf = lambda a: jnp.asarray(a[:, :1]).astype(jnp.bfloat16)
    state = jnp.asarray(x["state"])

    def f(state):
        out, new = jax_kda.kda_decode(bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["g"]),
                                      bf(x["beta"]), jnp.asarray(x["A_log"]),
                                      jnp.asarray(x["dt_bias"]), state=state)
        return jnp.sum(new)

    with pytest.raises(jax_kda.KdaInferenceOnlyError, match="kda_decode is inference-only"):
        jax.grad(f)(state)


def test_forward_mode_is_refused():
    x, direction, _ = make_point()
    f = lambda state: prefill(dict(x, state=state), "auto")[1]
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(f, (jnp.asarray(x["state"]),), (jnp.asarray(direction["state"]),))


def test_kernel_backend_gradient_lowers_to_the_forward_kernels(monkeypatch):
    """backend="kernel": value_and_grad lowered for CUDA holds the forward's two custom calls once
    (the residuals are the inputs) and a backward whose two serial chains are one launch of the
    chain kernel (the state recompute and the reverse chain), the rest XLA; jax.grad alone, whose
    loss value nobody uses, needs no forward at all."""
    monkeypatch.setattr(api, "_require_kernels", lambda: None)  # lowering needs no GPU
    x, _, weights = make_point()
    f = partial(loss, weights=weights, backend="kernel")
    for transform, calls in ((jax.value_and_grad, 1), (jax.grad, 0)):
        text = jax.jit(transform(f)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @jax_kda_prepare_v1(") == calls, transform
        assert text.count("custom_call @jax_kda_recurrence_v1(") == calls, transform
        assert text.count("custom_call @jax_kda_state_chains_v1(") == 1, transform


def test_checkpoint_policies_keep_or_drop_the_named_inputs(monkeypatch):
    """The custom VJP's residuals are the inputs, named "kda_prefill_inputs": under
    jax.checkpoint a policy that saves the name keeps q (here sin of the layer's input, no
    function of v) from the forward pass; one that drops it recomputes q (the sin) in the
    backward. Traced for the kernel backend (no GPU needed)."""
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    x, _, _ = make_point(seed=3)
    x = {n: jnp.asarray(a, jnp.bfloat16 if n in ("q", "k", "v", "g", "beta") else jnp.float32)
         for n, a in x.items()}

    def layer(v, q_source):
        q = jnp.sin(q_source.astype(jnp.float32)).astype(jnp.bfloat16)
        out, _ = jax_kda.kda_prefill(q, x["k"], v, x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                     backend="kernel")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    policies = jax.checkpoint_policies
    for policy, kept in ((policies.save_only_these_names(_vjp.INPUTS_NAME), True),
                         (policies.save_any_names_but_these(_vjp.INPUTS_NAME), False),
                         (policies.nothing_saveable, False)):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(jax.checkpoint(layer, policy=policy)))(
            x["v"], x["q"]).jaxpr
        (remat,) = [e for e in jaxpr.eqns if e.primitive.name in ("remat2", "checkpoint")]
        recomputed = str(remat.params["jaxpr"])
        assert (" sin " in recomputed) != kept, policy


def test_vmap_of_grad():
    x, _, weights = make_point(seed=5)
    stacked = {n: np.stack([v, v[::-1] if v.ndim and n != "A_log" else v]) for n, v in x.items()}
    grads = jax.jit(jax.vmap(jax.grad(partial(loss, weights=weights, backend="auto"))))(stacked)
    one = jax.jit(jax.grad(partial(loss, weights=weights, backend="auto")))
    for i in range(2):
        want = one({n: v[i] for n, v in stacked.items()})
        for n in NAMES:
            np.testing.assert_allclose(np.asarray(grads[n][i], np.float32),
                                       np.asarray(want[n], np.float32), rtol=2e-2, atol=1e-5)


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
    large ones. Autodiff treats each rounding as the identity, so its gradient is the derivative
    of the exact KDA function evaluated with bf16-rounded intermediates. The test therefore
    compares it with central differences of the float64 oracle (the exact function; smooth, so
    eps = 1e-2 has a negligible truncation error) at a point where the bf16 inputs are exact,
    along a random direction for each input separately and for all together, to 3 %.

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
        finite_difference = (
            exact_loss(shifted(eps, names)) - exact_loss(shifted(-eps, names))) / (2 * eps)
        autodiff = sum(float(np.sum(np.asarray(grads[n], np.float64) * direction[n]))
                       for n in names)
        assert abs(finite_difference) > 0.1, (names, finite_difference)  # a real signal
        assert autodiff == pytest.approx(finite_difference, rel=0.03), names
