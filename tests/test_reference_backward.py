"""The chunkwise f32 backward (jax_kda.reference_backward) against the float64 oracle's autodiff.

Bounds, per gradient (relative RMSE vs the oracle, T = 200 (a partial last chunk), 2 heads):
* the f32 values before the final rounding: <= 3e-5. Measured when this was written: 3e-8 .. 4.2e-6
  (the largest for dt_bias and A_log in the strong regime: sums over every token of terms that
  cancel); f32 arithmetic through a 13-chunk chain, far below any bf16 rounding.
* the returned gradients: bf16 ones (q, k, v, g, beta) within 2 % of the error of rounding the exact
  gradient to bf16 alone and <= 2.5e-3 (measured: equal to that rounding error to 4 digits, which is
  0.8e-3 .. 2.0e-3 here); f32 ones (A_log, dt_bias, the initial state) as the f32 values above.
Regimes: jax_kda.bench.gradients (strong, fla, keep32: a quarter of the channels never forget,
slow, unit_decay: keep32 with A_log = log 16 and g ~ N(-3, 1), most decays 1 in f32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kda import reference_backward
from jax_kda.bench import gradients

T, H = 200, 2
F32_BOUND = 3e-5
BF16_BOUND = 2.5e-3
ROUNDING_MARGIN = 1.02
CU = [0, 0, 37, 37, 100, 101, 180]  # empty sequences, length 1; tokens 180..199 in none
NAMES = gradients.GRADIENT_NAMES
TOKEN_GRADIENTS = range(5)  # dq, dk, dv, dg, dbeta: [B, T, H, ...]


def assert_matches_exact(case, want, **variant):
    got32, got = gradients.backward(case, **variant)
    for name, g32, g, w, x in zip(NAMES, got32, got, want, case.primals):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        if not np.any(w):  # the exact gradient is 0 (q without d_out): so is this one
            assert not np.any(np.asarray(g32)), name
            continue
        f32_error, error = gradients.rel_rmse(g32, w), gradients.rel_rmse(g, w)
        rounding = gradients.rounding_error(w, x)
        print(f"{name}: f32 {f32_error:.2e}, returned {error:.2e} (rounding alone {rounding:.2e})")
        assert f32_error <= F32_BOUND, name
        if x.dtype == jnp.bfloat16:
            assert error <= min(ROUNDING_MARGIN * rounding, BF16_BOUND), name
        else:
            assert error <= F32_BOUND, name


@pytest.mark.parametrize("regime", gradients.GRADIENT_REGIMES)
def test_gradients_match_the_oracle(regime):
    case = gradients.make_case(np.random.default_rng(10), T, H, regime)
    assert_matches_exact(case, gradients.exact(case))


def test_packed_sequences_with_empty_ones():
    case = gradients.make_case(np.random.default_rng(11), T, H, "keep32", cu_seqlens=CU)
    want = gradients.exact(case)
    assert_matches_exact(case, want)
    got = gradients.backward(case)[1]
    for i in TOKEN_GRADIENTS:  # tokens covered by no sequence: exact zeros
        assert np.all(np.asarray(got[i][0, CU[-1]:]) == 0), NAMES[i]
    # an empty sequence passes its final state's cotangent on unchanged
    np.testing.assert_array_equal(np.asarray(got[7])[[0, 2]],
                                  np.asarray(case.d_final_state)[[0, 2]])


@pytest.mark.parametrize("with_d_out, with_d_final_state", [
    pytest.param(True, False, marks=pytest.mark.slow), (False, True)],
    ids=["d_out_only", "d_final_state_only"])
def test_one_cotangent(with_d_out, with_d_final_state):
    case = gradients.make_case(np.random.default_rng(12), T, H, "fla")
    variant = {"with_d_out": with_d_out, "with_d_final_state": with_d_final_state}
    assert_matches_exact(case, gradients.exact(case, **variant), **variant)
    if not with_d_out:  # q enters only the output: its gradient is exactly 0
        assert not np.any(np.asarray(gradients.backward(case, **variant)[1][0]))


def test_bitwise_deterministic_run_to_run():
    case = gradients.make_case(np.random.default_rng(13), T, H, "keep32")
    for name, a, b in zip(NAMES, gradients.backward(case)[0], gradients.backward(case)[0]):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32),
                                      err_msg=name)


@pytest.mark.slow
def test_bitwise_deterministic_across_compilations():
    case = gradients.make_case(np.random.default_rng(13), T, H, "keep32")
    fresh = jax.jit(lambda *a: reference_backward.kda_prefill_vjp_f32(
        *a, scale=gradients.SCALE, lower_bound=gradients.LOWER_BOUND))(
        *case.primals, None, case.d_out, case.d_final_state)
    for name, a, b in zip(NAMES, gradients.backward(case)[0], fresh):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32),
                                      err_msg=name)


@pytest.mark.slow
def test_unroll_changes_nothing_but_rounding():
    case = gradients.make_case(np.random.default_rng(14), T, H, "fla")
    rolled, unrolled = gradients.backward(case)[0], gradients.backward(case, unroll=2)[0]
    for name, a, b in zip(NAMES, rolled, unrolled):
        assert gradients.rel_rmse(b, np.asarray(a, np.float64)) <= 1e-6, name


def test_dtypes_and_no_initial_state():
    """Gradients come in the primals' dtypes (a bf16 initial state gets a bf16 one); without an
    initial state there is no gradient for it; T = 0 gives zeros and passes d_final_state on."""
    case = gradients.make_case(np.random.default_rng(15), 20, 1, "fla")
    q, k, v, g, beta, A_log, dt_bias, state = case.primals
    vjp = jax.jit(reference_backward.kda_prefill_vjp, static_argnames=("scale", "lower_bound"))
    got = vjp(q, k, v, g, beta, A_log, dt_bias, state.astype(jnp.bfloat16), None, case.d_out,
              case.d_final_state)
    assert [x.dtype for x in got] == [jnp.bfloat16] * 5 + [jnp.float32] * 2 + [jnp.bfloat16]
    got = vjp(q, k, v, g, beta, A_log, dt_bias, None, None, case.d_out, None)
    assert got.dinitial_state is None and np.any(np.asarray(got.dq) != 0)
    empty = lambda x: x[:, :0]
    got = vjp(*map(empty, (q, k, v, g, beta)), A_log, dt_bias, state, None, None,
              case.d_final_state)
    assert all(np.all(np.asarray(x) == 0) for x in got[:7])
    np.testing.assert_array_equal(np.asarray(got.dinitial_state), np.asarray(case.d_final_state))


def _packed_vjp_temp_bytes(num_seqs, T=512, H=1):
    """Scratch memory XLA plans for the packed backward of num_seqs equal sequences in T tokens."""
    case = gradients.make_case(np.random.default_rng(16), T, H, "fla",
                               cu_seqlens=np.linspace(0, T, num_seqs + 1).astype(np.int32))
    run = jax.jit(lambda primals, cu, d_out, d_final: reference_backward.kda_prefill_vjp_f32(
        *primals, cu, d_out, d_final, scale=gradients.SCALE, lower_bound=gradients.LOWER_BOUND))
    compiled = run.lower(case.primals, jnp.asarray(case.cu_seqlens), case.d_out,
                         case.d_final_state).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_packed_memory_does_not_grow_with_sequences_times_tokens():
    """32 documents in 512 tokens take about what 2 do: the chunk slots grow as T / 16 + N (64
    slots against 34), not as N ceil(T / 16) (1024 chunks against 64)."""
    few, many = _packed_vjp_temp_bytes(2), _packed_vjp_temp_bytes(32)
    print(f"temp bytes: N = 2 {few}, N = 32 {many} ({many / few:.2f} x)")
    assert many <= 2.5 * few


def test_packed_sequences_match_each_sequence_alone():
    """Many packed sequences (empty ones, lengths 1, 15, 16, 17, 33, starts inside a chunk, spare
    slots between them, tokens in none at the end) give each sequence's gradients of the batched
    call on it alone (B = 1), up to the order of XLA's reductions: measured on CPU, dq, dk, dv,
    dbeta and the initial state's gradient bitwise, dg within 1.3e-7 relative RMSE (its dgt sums
    over V are reduced in a shape-dependent order), A_log and dt_bias (sums over every token, in
    another order) within 1.3e-6. An empty sequence passes its final state's cotangent on
    bitwise."""
    lengths = [0, 1, 16, 15, 17, 0, 33, 5, 0]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)  # tokens 87..95 in none
    case = gradients.make_case(np.random.default_rng(17), 96, H, "keep32", cu_seqlens=cu)
    vjp = jax.jit(lambda primals, cu, d_out, d_final: reference_backward.kda_prefill_vjp_f32(
        *primals, cu, d_out, d_final, scale=gradients.SCALE, lower_bound=gradients.LOWER_BOUND))
    packed = vjp(case.primals, jnp.asarray(cu), case.d_out, case.d_final_state)
    sums = [np.zeros_like(np.asarray(packed[i])) for i in (5, 6)]
    for n, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        if start == end:  # no slot: the final state's cotangent passes on unchanged
            np.testing.assert_array_equal(np.asarray(packed.dinitial_state[n]),
                                          np.asarray(case.d_final_state[n]))
            continue
        tokens = lambda x: x[:, start:end]
        alone = vjp((*map(tokens, case.primals[:5]), *case.primals[5:7],
                     case.primals[7][n:n + 1]), None, tokens(case.d_out),
                    case.d_final_state[n:n + 1])
        pairs = [(packed[i][:, start:end], alone[i]) for i in TOKEN_GRADIENTS]
        for name, (got, want) in zip(NAMES[:5] + NAMES[7:], pairs + [
                (packed.dinitial_state[n], alone.dinitial_state[0])]):
            assert gradients.rel_rmse(got, np.asarray(want, np.float64)) <= 1e-6, (n, name)
        for total, part in zip(sums, (alone.dA_log, alone.ddt_bias)):
            total += np.asarray(part)
    for i in TOKEN_GRADIENTS:
        assert np.all(np.asarray(packed[i][:, cu[-1]:]) == 0), NAMES[i]
    for total, got, name in zip(sums, (packed.dA_log, packed.ddt_bias), NAMES[5:7]):
        assert gradients.rel_rmse(got, total.astype(np.float64)) <= 1e-5, name


def _primitive_readers(jaxpr, var):
    """The primitive equations that read `var`, looking through nested jaxprs (pjit, ...)."""
    found = []
    for eqn in jaxpr.eqns:
        if var not in eqn.invars:
            continue
        inner = eqn.params.get("jaxpr")
        if inner is None:
            found.append(eqn)
            continue
        inner = getattr(inner, "jaxpr", inner)
        for position, operand in enumerate(eqn.invars):
            if operand is var:
                found += _primitive_readers(inner, inner.invars[position])
    return found


def test_each_saved_state_feeds_one_matrix_product():
    """Step 4 reads the saved states S_c through one product, [dout; -dp] S_c, and through the
    dgt contraction with dS_{c+1}: no second product over them (on the GPU each is a pass over
    64 KiB per chunk and head, and XLA's dot merger concatenated the states with U^T to merge
    dout S_c with dout U^T when dqd and dkd were separate products)."""
    rng = np.random.default_rng(5)
    N, C = 1, 3
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    rows = lambda: f32(N, H, C, 16, 128)
    f = reference_backward.chunk_factors(
        rows(), rows(), rows(), f32(N, H, C, 16), f32(H), f32(H, 128),
        jnp.ones((N, H, C, 16), bool), scale=128**-0.5, lower_bound=-5.0)
    states, dS_after = f32(N, H, C, 128, 128), f32(N, H, C, 128, 128)

    def step4(states, dS_after):
        return reference_backward.chunk_gradients(f, rows(), states, rows(), dS_after, rows(),
                                                  scale=128**-0.5)

    jaxpr = jax.make_jaxpr(step4)(states, dS_after).jaxpr
    readers = _primitive_readers(jaxpr, jaxpr.invars[0])
    assert {e.primitive.name for e in readers} == {"dot_general"}, readers
    # one product with 32 rows per chunk ([dout; -dp] S_c) and the dgt contraction
    assert len(readers) == 2, [e.outvars[0].aval.shape for e in readers]
    assert any(e.outvars[0].aval.shape[-2:] == (32, 128) for e in readers)
