"""The backward's chain kernel on the GPU (marker gpu).

1. The kernel (jax_kda._state_chain.state_chains, both chains) against its plain-JAX model
   (tests/state_chain_model.py, XLA's summation order): states and z within relative RMSE 2e-6
   over 37 chunks with resets (the bit-equal fraction printed); the state entering a reset chunk
   is init's bits; run to run bitwise; vmap folds into one launch whose elements equal their own
   calls bitwise.
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
from state_chain_model import state_chains_model
from test_reference_backward import CU, NAMES, H, T, assert_matches_exact

import jax_kda
from jax_kda import _state_chain, contract
from jax_kda._ffi import ChainOperands
from jax_kda.bench import gradients

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_gpus")]

MODEL_BOUND = 2e-6
SCANS_BOUND = 2e-5  # as tests/test_state_chain_operands.py: reassociation only


def chain_operands(rng, N, Hh, C, Ni):
    """(gamma, forward, reverse) of stable chains: gamma in [0.5, 1], small A and B (the update's
    spectral radius stays below 1), Y ~ N(0, 1); both chains with the resets of `resets`."""
    f = lambda *s, scale=1.0: jnp.asarray(scale * rng.standard_normal(s), jnp.float32)
    reset = resets(N, C, Ni)
    chain = lambda rows: ChainOperands(reset, f(N, Ni, Hh, 128, 128), f(N, Hh, C, 16, 128,
                                                                         scale=0.02),
                                       f(N, Hh, C, rows, 128, scale=0.02), f(N, Hh, C, rows, 128))
    return (jnp.asarray(rng.uniform(0.5, 1.0, (N, Hh, C, 128)), jnp.float32),
            chain(contract.FORWARD_CHAIN_ROWS), chain(contract.REVERSE_CHAIN_ROWS))


def resets(N, C, Ni):
    """Row 0: init 0 at the first and the last chunk, init 1 at chunk C // 3, an out-of-range index
    at C // 2 (ignored); row 1: starts from zeros (no reset), init 1 at chunk 5. Whichever way the
    chain runs."""
    reset = np.full((N, C), -1, np.int32)
    reset[0, [0, C // 3, C // 2, C - 1]] = [0, 1, Ni, 0]
    reset[1, 5] = 1
    return jnp.asarray(reset)


def test_chain_kernel_matches_its_model(rng):
    N, Hh, C, Ni = 2, 3, 37, 2
    args = chain_operands(rng, N, Hh, C, Ni)
    run = jax.jit(_state_chain.state_chains)
    got = jax.tree.map(np.asarray, run(*args))
    again = jax.tree.map(np.asarray, run(*args))
    jax.tree.map(np.testing.assert_array_equal, got, again)
    want = jax.tree.map(np.asarray, jax.jit(state_chains_model)(*args))
    chains = (("forward", args[1], 0, slice(1, 5)),
              ("reverse", args[2], C - 1, slice(C - 5, C - 1)))
    for (name, ops, first, following), got_chain, want_chain in zip(chains, got, want):
        for what, a, b in zip(("states", "z"), got_chain, want_chain):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.all(np.isfinite(a))
            error = np.sqrt(np.sum((a - b) ** 2) / np.sum(b**2))
            print(f"{name} {what}: rel RMSE {error:.1e}, bit-equal {np.mean(a == b):.3f}")
            assert error <= MODEL_BOUND, (name, what)
        states, init = got_chain[0], np.asarray(ops.init)
        np.testing.assert_array_equal(states[0, :, 0], init[0, 0])
        np.testing.assert_array_equal(states[0, :, C // 3], init[0, 1])
        np.testing.assert_array_equal(states[0, :, C - 1], init[0, 0])
        np.testing.assert_array_equal(states[1, :, 5], init[1, 1])
        # row 1 enters the chain's first chunk with zeros, and the next four with a nonzero state
        assert not np.any(states[1, :, first])
        assert np.all(np.any(states[1, :, following], axis=(-1, -2)))
        # the out-of-range index read nothing: no row of init is entering chunk C // 2
        assert all(np.any(states[0, :, C // 2] != init[0, i]) for i in range(Ni))


def test_chain_kernel_vmap_is_one_launch(rng):
    n, N, Hh, C, Ni = 3, 2, 2, 9, 2
    parts = [chain_operands(rng, N, Hh, C, Ni) for _ in range(n)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
    run = jax.jit(jax.vmap(_state_chain.state_chains))
    text = run.lower(*stacked).as_text()
    assert text.count("custom_call @jax_kda_state_chains_v1(") == 1
    got = run(*stacked)
    for i, xs in enumerate(parts):
        want = jax.jit(_state_chain.state_chains)(*xs)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b)),
                     got, want)


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
