"""The backward's chain kernel on the GPU (marker gpu).

1. The kernel (jax_kda._state_chain.state_chain, both row counts) against its plain-JAX model
   (tests/state_chain_model.py, XLA's summation order): relative RMSE <= 2e-6 over 37 chunks with
   resets (the bit-equal fraction printed); the state entering a reset chunk is init's bits; run to
   run bitwise; vmap folds into one launch whose elements equal their own calls bitwise.
2. The custom VJP of kda_prefill on backend "kernel" runs the chain kernel (chains="kernel") and
   gives the float64 oracle's gradients as tests/test_reference_backward.py demands of the scans:
   five gate regimes, batched and packed with empty sequences; bitwise run to run; within f32
   rounding of the scans' gradients (chains="scan") on the same GPU.
3. A long sequence (T = 32768, one head, never-forgetting channels): every gradient finite and
   at the bf16 rounding floor (f32 ones <= 1e-4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from state_chain_model import state_chain_model
from test_reference_backward import CU, NAMES, H, T, assert_matches_exact

import jax_kda
from jax_kda import _state_chain, contract
from jax_kda.bench import gradients

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_gpus")]

MODEL_BOUND = 2e-6
SCANS_BOUND = 2e-5  # as tests/test_state_chain_operands.py: reassociation only


def chain_operands(rng, N, Hh, C, rows, Ni):
    """Operands of a stable chain: gamma in [0.5, 1], small A and B (the update's spectral radius
    stays below 1), Y ~ N(0, 1)."""
    f = lambda *s, scale=1.0: jnp.asarray(scale * rng.standard_normal(s), jnp.float32)
    return (f(N, Ni, Hh, 128, 128),
            jnp.asarray(rng.uniform(0.5, 1.0, (N, Hh, C, 128)), jnp.float32),
            f(N, Hh, C, 16, 128, scale=0.02), f(N, Hh, C, rows, 128, scale=0.02),
            f(N, Hh, C, rows, 128))


def resets(N, C, Ni):
    """Row 0: init 0 at the first and the last chunk, init 1 at chunk C // 3, an out-of-range index
    at C // 2 (ignored); row 1: starts from zeros (no reset), init 1 at chunk 5. Whichever way the
    chain runs."""
    reset = np.full((N, C), -1, np.int32)
    reset[0, [0, C // 3, C // 2, C - 1]] = [0, 1, Ni, 0]
    reset[1, 5] = 1
    return jnp.asarray(reset)


@pytest.mark.parametrize("rows", [16, 32])
def test_chain_kernel_matches_its_model(rows, rng):
    N, Hh, C, Ni = 2, 3, 37, 2
    init, gamma, A, B, Y = chain_operands(rng, N, Hh, C, rows, Ni)
    reset = resets(N, C, Ni)
    run = jax.jit(_state_chain.state_chain)
    got = run(reset, init, gamma, A, B, Y)
    again = run(reset, init, gamma, A, B, Y)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))
    want = jax.jit(state_chain_model)(reset, init, gamma, A, B, Y)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got))
    error = np.sqrt(np.sum((got - want) ** 2) / np.sum(want**2))
    print(f"rows {rows}: rel RMSE {error:.1e}, bit-equal {np.mean(got == want):.3f}")
    assert error <= MODEL_BOUND
    init = np.asarray(init)
    np.testing.assert_array_equal(got[0, :, 0], init[0, 0])
    np.testing.assert_array_equal(got[0, :, C // 3], init[0, 1])
    np.testing.assert_array_equal(got[0, :, C - 1], init[0, 0])
    np.testing.assert_array_equal(got[1, :, 5], init[1, 1])
    # row 1 enters the chain's first chunk with zeros, and the next four with a nonzero state
    if rows == contract.STATE_CHAIN_REVERSE_ROWS:
        first, following = C - 1, slice(C - 5, C - 1)
    else:
        first, following = 0, slice(1, 5)
    assert not np.any(got[1, :, first]) and np.all(np.any(got[1, :, following], axis=(-1, -2)))
    # the out-of-range index read nothing: no row of init is entering chunk C // 2
    assert all(np.any(got[0, :, C // 2] != init[0, i]) for i in range(Ni))


def test_chain_kernel_vmap_is_one_launch(rng):
    n, N, Hh, C, Ni = 3, 2, 2, 9, 2
    parts = [chain_operands(rng, N, Hh, C, 32, Ni) for _ in range(n)]
    stacked = [jnp.stack(xs) for xs in zip(*parts)]
    reset = resets(N, C, Ni)
    run = jax.jit(jax.vmap(_state_chain.state_chain, in_axes=(None, 0, 0, 0, 0, 0)))
    text = run.lower(reset, *stacked).as_text()
    assert text.count("custom_call @jax_kda_state_chain_v2(") == 1
    got = run(reset, *stacked)
    for i, xs in enumerate(parts):
        np.testing.assert_array_equal(np.asarray(got[i]),
                                      np.asarray(jax.jit(_state_chain.state_chain)(reset, *xs)))


@pytest.mark.parametrize("cu_seqlens", [None, CU], ids=["batched", "packed"])
@pytest.mark.parametrize("regime", gradients.GRADIENT_REGIMES)
def test_kernel_chains_match_the_oracle(regime, cu_seqlens):
    case = gradients.make_case(np.random.default_rng(20), T, H, regime, cu_seqlens=cu_seqlens)
    assert_matches_exact(case, gradients.exact(case), chains="kernel")
    kernel = gradients.backward(case, chains="kernel")[0]
    scans = gradients.backward(case, chains="scan")[0]
    for name, a, b in zip(NAMES, kernel, scans):
        assert gradients.rel_rmse(a, b) <= SCANS_BOUND, name


def _loss_gradients(case, backend="kernel"):
    cu = None if case.cu_seqlens is None else jnp.asarray(case.cu_seqlens)

    def loss(*primals):
        q, k, v, g, beta, A_log, dt_bias, state = primals
        out, final = jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state=state,
                                         cu_seqlens=cu, output_final_state=True, backend=backend,
                                         scale=gradients.SCALE, lower_bound=gradients.LOWER_BOUND)
        return (jnp.sum(out.astype(jnp.float32) * case.d_out.astype(jnp.float32))
                + jnp.sum(final * case.d_final_state))

    return jax.jit(jax.grad(loss, argnums=tuple(range(8))))(*case.primals)


def test_custom_vjp_runs_the_chain_kernel_bitwise(rng):
    case = gradients.make_case(rng, 300, 3, "keep32", cu_seqlens=[0, 7, 7, 150, 300])
    first, second = _loss_gradients(case), _loss_gradients(case)
    for name, a, b in zip(NAMES, first, second):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)
    want = gradients.exact(case)
    for name, x, got, w in zip(NAMES, case.primals, first, want):
        error = gradients.rel_rmse(got, w)
        bound = 1.02 * gradients.rounding_error(w, x) if x.dtype == jnp.bfloat16 else 3e-5
        assert error <= bound, (name, error, bound)


def test_long_sequence_gradients():
    case = gradients.make_case(np.random.default_rng(21), 32768, 1, "keep32")
    got = _loss_gradients(case)
    want = gradients.exact(case)
    for name, x, g, w in zip(NAMES, case.primals, got, want):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        error = gradients.rel_rmse(g, w)
        print(f"T=32768 {name}: {error:.2e} (rounding {gradients.rounding_error(w, x):.2e})")
        bound = 1.05 * gradients.rounding_error(w, x) if x.dtype == jnp.bfloat16 else 1e-4
        assert error <= bound, (name, error, bound)
