"""The pure-JAX chunkwise reference (jax_kda.reference) against the float64 oracle and itself.

Error figures (relative RMSE = rms(ref - oracle) / rms(oracle)) measured when this was written:
* q, k, v ~ U(0, 1) (FlashKDA's own test inputs), the contract's gate/bias sweep, T = 100, initial
  state: outputs <= 0.0045, final states <= 0.0061 (both inverses); lengths 1..256: outputs
  <= 0.004. The tolerance 0.005 holds here and is asserted.
* q, k, v ~ N(0, 1): outputs 0.0054 .. 0.0074, final states <= 0.0066. This is the error of the
  contract's own chain of about ten bf16 roundings (each ~0.0017 rms relative), not of the chunk
  algebra: with every rounding switched off the reference matches the oracle to ~1e-6
  (test_chunk_algebra_without_rounding). Asserted bound: 0.01.
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kda_testing import BIAS_LAWS, GATE_LAWS, assert_bits, make_inputs, random_states

from jax_kda import oracle, reference

D = 128
SCALE = D**-0.5
LOWER_BOUND = -5.0
OUT_TOL_FLASHKDA_INPUTS = 0.005  # FlashKDA tolerance, with FlashKDA's input distribution
OUT_TOL_NORMAL_INPUTS = 0.01
STATE_TOL = 0.01
WIDE = ("U(-8,8)", "N(0,8)")  # gate and bias laws: saturated and unsaturated channels

_JITTED = {}


def run_reference(args, initial_state=None, cu_seqlens=None, inverse="stable"):
    """Jitted reference (one compiled function per variant and presence of state / cu_seqlens)."""
    key = (inverse, initial_state is None, cu_seqlens is None)
    if key not in _JITTED:
        def fn(args, initial_state, cu_seqlens):
            return reference.kda_prefill_reference(
                **args, scale=SCALE, lower_bound=LOWER_BOUND, initial_state=initial_state,
                cu_seqlens=cu_seqlens, inverse=inverse)
        _JITTED[key] = jax.jit(fn)
    return _JITTED[key](args, initial_state, cu_seqlens)


def run_oracle(args, initial_state=None, cu_seqlens=None):
    return oracle.kda_prefill_oracle(
        **args, scale=SCALE, lower_bound=LOWER_BOUND, initial_state=initial_state,
        cu_seqlens=None if cu_seqlens is None else np.asarray(cu_seqlens))


def f64(x):
    return np.asarray(np.asarray(x).astype(np.float32), np.float64)


def rel_rmse(got, want):
    got, want = f64(got), np.asarray(want, np.float64)
    return float(np.sqrt(np.sum((got - want) ** 2) / np.sum(want**2)))


# ------------------------------------------------------------------------- emulated GPU operations


def _round_to_f32(exact: Fraction) -> np.float32:
    """Correctly rounded (nearest, ties to even) f32 of an exact rational."""
    guess = np.float32(float(exact))
    candidates = [guess, np.nextafter(guess, np.float32(np.inf)),
                  np.nextafter(guess, np.float32(-np.inf))]

    def key(c):
        return (abs(Fraction(float(c)) - exact), int(np.array(c).view(np.uint32)) & 1)

    return min(candidates, key=key)


def test_fma_f32_is_correctly_rounded():
    rng = np.random.default_rng(1)
    n = 3000
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    c = (rng.standard_normal(n) * 2.0 ** rng.integers(-40, 40, n)).astype(np.float32)
    # Hard cases: c cancels the rounded product; products halfway between two floats.
    c[:500] = -(a[:500] * b[:500])
    tie = np.float32(1 + 2.0**-12)
    a[500:600], b[500:600] = tie, tie
    c[500:550] = np.float32(2.0**-60) * np.sign(rng.standard_normal(50)).astype(np.float32)
    c[550:600] = 0.0
    got = np.asarray(jax.jit(reference.fma_f32)(a, b, c))
    want = np.array([_round_to_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     for x, y, z in zip(a, b, c)], np.float32)
    unfused = (a * b) + c  # numpy: two roundings; differs from fmaf on many of these inputs
    assert np.sum(unfused != want) > 100
    np.testing.assert_array_equal(got, want)


def test_ex2_ftz():
    ints = np.arange(-140, 128).astype(np.float32)
    got = np.asarray(jax.jit(reference.ex2_ftz)(ints))
    want = np.where(ints < -126, 0.0, np.exp2(ints.astype(np.float64))).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # exact powers of two, flushed below 2^-126
    x = np.random.default_rng(2).uniform(-120, 120, 20000).astype(np.float32)
    got = np.asarray(jax.jit(reference.ex2_ftz)(x), np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 2.0**-22


def test_sigmoid_tanh_form():
    x = np.linspace(-30, 30, 2001).astype(np.float32)
    got = np.asarray(jax.jit(reference.sigmoid_tanh)(x), np.float64)
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-x.astype(np.float64))), rtol=0, atol=3e-7)


def test_bf16_subnormals_survive_scaled_rounding():
    """kd/qd in the bf16 subnormal range are rounded like a GPU would, not flushed like XLA on
    CPU."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(5000) * 2.0 ** rng.integers(-136, -118, 5000)).astype(np.float64)
    want = x.astype(ml_dtypes.bfloat16)  # numpy/ml_dtypes keeps subnormals
    scaled = jnp.asarray(x * 2.0**64, jnp.float32)
    got = jax.jit(lambda s: reference._unscale_to_bf16(reference._round_bf16_scaled(s)))(scaled)
    assert np.sum(np.asarray(want, np.float32) != 0) > 3500
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))


def test_l2_normalize_matches_float64():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((64, D)) * 3, jnp.bfloat16)
    got = f64(jax.jit(reference.l2_normalize_bf16)(x))
    xf = f64(x)
    want = xf / np.sqrt(np.sum(xf**2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-30)


# ------------------------------------------------------------------------- prepare vs float64 math


def _exact_chunk_math(q, k, g, beta, A_log, dt_bias, valid):
    """Float64 formulas for one set of chunks [C, 16, ...] of one head."""
    qn = f64(q) / np.sqrt(np.sum(f64(q) ** 2, -1, keepdims=True) + 1e-6)
    kn = f64(k) / np.sqrt(np.sum(f64(k) ** 2, -1, keepdims=True) + 1e-6)
    x = np.exp(float(A_log)) * (f64(g) + f64(dt_bias))
    gate = np.where(valid[..., None], LOWER_BOUND * np.log2(np.e) / (1 + np.exp(-x)), 0.0)
    G = np.cumsum(gate, axis=-2)
    qn, kn = qn * valid[..., None], kn * valid[..., None]
    b = 1 / (1 + np.exp(-f64(beta)))
    decay = np.exp2(G[..., :, None, :] - G[..., None, :, :])  # [C, r, c, d]: 2^(G_r - G_c)
    qk = np.einsum("...rd,...cd,...rcd->...rc", qn, kn, decay)
    kk = np.einsum("...rd,...cd,...rcd->...rc", kn, kn, decay)
    lower = np.tril(np.ones((16, 16)), -1)
    return {
        "G": G, "qn": qn, "kn": kn, "gt": np.exp2(G[..., -1, :]),
        "kd": kn * np.exp2(G), "qd": qn * np.exp2(G) * SCALE,
        "kr": kn * np.exp2(G[..., -1:, :] - G),
        "mqk": SCALE * qk * np.tril(np.ones((16, 16))),
        "abs_mqk_terms": SCALE * np.einsum("...rd,...cd,...rcd->...rc", np.abs(qn), np.abs(kn),
                                           decay),
        "L": b[..., :, None] * kk * lower,
    }


@pytest.mark.parametrize("inverse", ["stable", "neumann"])
def test_prepare_matches_float64_formulas(inverse):
    rng = np.random.default_rng(5)
    C = 4
    common = rng.standard_normal(D)
    # Correlated keys make L large (entries ~0.5), so a wrong inverse formula cannot hide.
    k = jnp.asarray(0.6 * common + 0.5 * rng.standard_normal((C, 16, D)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((C, 16, D)), jnp.bfloat16)
    g = jnp.asarray(rng.uniform(-14, -4, (C, 16, D)), jnp.bfloat16)  # mild decay: L stays large
    beta = jnp.asarray(rng.standard_normal((C, 16)), jnp.bfloat16)
    A_log, dt_bias = np.float32(-1.0), rng.uniform(-2, 2, D).astype(np.float32)
    valid = np.ones((C, 16), bool)
    valid[-1, 11:] = False  # last chunk ends after row 10

    ws = jax.jit(lambda *a: reference.prepare_reference(
        *a, scale=SCALE, lower_bound=LOWER_BOUND, inverse=inverse, valid=jnp.asarray(valid)))(
        q, k, g, beta, A_log, dt_bias)
    want = _exact_chunk_math(q, k, g, beta, A_log, dt_bias, valid)

    np.testing.assert_allclose(f64(ws.gt), want["gt"], rtol=1e-4)
    for name in ("kd", "qd", "kr"):
        np.testing.assert_allclose(f64(getattr(ws, name)), want[name], rtol=2e-2, atol=1e-30,
                                   err_msg=name)
    assert not np.any(f64(ws.kd)[-1, 11:]) and not np.any(f64(ws.kr)[-1, 11:])
    mqk_err = np.abs(f64(ws.mqk) - want["mqk"])
    assert np.all(mqk_err <= 3e-2 * want["abs_mqk_terms"] + 1e-30)
    assert not np.any(np.triu(f64(ws.mqk), 1))

    inv = f64(ws.inv)
    assert not np.any(np.triu(inv, 1))
    np.testing.assert_array_equal(np.diagonal(inv, axis1=-2, axis2=-1), 1.0)
    eye = np.eye(16)
    lmat = want["L"]
    assert np.abs(lmat).max() > 0.3  # the check below is only meaningful with a sizeable L
    residual = np.abs(inv @ (eye + lmat) - eye).max()
    assert residual < 0.03, residual
    # A plausible wrong formula (beta on the columns instead of the rows) misses by far more.
    b = 1 / (1 + np.exp(-f64(beta)))
    wrong_lmat = lmat / b[..., :, None] * b[..., None, :]
    assert np.abs(inv @ (eye + wrong_lmat) - eye).max() > 10 * residual


# --------------------------------------------------------------------------- against the oracle


def test_chunk_algebra_without_rounding():
    """With every bf16/f16 rounding off, the chunk form equals the token recurrence (f32
    accuracy)."""
    rng = np.random.default_rng(6)
    cu = jnp.asarray([0, 0, 1, 30, 74], jnp.int32)
    args = make_inputs(rng, 1, 74, 2, regime=("N(0,8)", "U(-8,8)"))
    state = random_states(rng, 4, 2, jnp.bfloat16)
    want_out, want_final = run_oracle(args, state, cu)
    with reference._rounding_disabled():
        for inverse in ("stable", "neumann"):
            out, final = jax.jit(lambda a, s, c, inverse=inverse: reference.kda_prefill_reference(
                **a, scale=SCALE, lower_bound=LOWER_BOUND, initial_state=s, cu_seqlens=c,
                inverse=inverse))(args, state, cu)
            assert out.dtype == jnp.float32
            assert rel_rmse(out, want_out) < 1e-5 and rel_rmse(final, want_final) < 1e-5


SWEEP_CASES = [(g, "0") for g in GATE_LAWS] + [("0", dt) for dt in BIAS_LAWS if dt != "0"] + [
    ("U(-8,8)", "N(0,8)"), ("N(0,8)", "+-8"), ("8", "+-4"), ("-8", "U(-8,8)")]


@pytest.mark.parametrize("law,tol", [("uniform", OUT_TOL_FLASHKDA_INPUTS),
                                     ("normal", OUT_TOL_NORMAL_INPUTS)])
@pytest.mark.parametrize("inverse", ["stable", "neumann"])
def test_gate_bias_sweep_against_oracle(law, tol, inverse):
    rng = np.random.default_rng(7)
    worst = []
    for g, dt in SWEEP_CASES:
        args = make_inputs(rng, 1, 100, 2, regime=(g, dt), law=law)
        state = random_states(rng, 1, 2, jnp.bfloat16)
        out, final = run_reference(args, state, inverse=inverse)
        want_out, want_final = run_oracle(args, state)
        worst.append((rel_rmse(out, want_out), rel_rmse(final, want_final), g, dt))
    print(f"{law} {inverse}: max out {max(w[0] for w in worst):.5f}, "
          f"max state {max(w[1] for w in worst):.5f}")
    for out_err, state_err, g, dt in worst:
        assert out_err <= tol, (g, dt, out_err)
        assert state_err <= STATE_TOL, (g, dt, state_err)


LENGTHS = [1, 15, 16, 17, 100, 256]


@pytest.mark.parametrize("inverse,with_state",
                         [("stable", True), ("stable", False), ("neumann", True)])
def test_lengths_against_oracle(inverse, with_state):
    """Sequences of every interesting length (packed into one call), each checked on its own."""
    rng = np.random.default_rng(8)
    cu_list = np.concatenate([[0], np.cumsum(LENGTHS)]).tolist()
    args = make_inputs(rng, 1, cu_list[-1], 4, regime=("N(0,8)", "U(-8,8)"), law="uniform")
    state = random_states(rng, len(LENGTHS), 4, jnp.bfloat16) if with_state else None
    cu = jnp.asarray(cu_list, jnp.int32)
    out, final = run_reference(args, state, cu, inverse=inverse)
    want_out, want_final = run_oracle(args, state, cu)
    for n, T in enumerate(LENGTHS):
        lo, hi = cu_list[n], cu_list[n + 1]
        out_err = rel_rmse(out[:, lo:hi], want_out[:, lo:hi])
        state_err = rel_rmse(final[n], want_final[n])
        print(f"T={T} {inverse} state={with_state}: out {out_err:.5f} state {state_err:.5f}")
        assert out_err <= OUT_TOL_FLASHKDA_INPUTS and state_err <= STATE_TOL, T


VARLEN_CU = [0, 0, 1, 17, 17, 50, 83, 100]  # empty, length 1, 16, empty, 33, 33, 17


@pytest.mark.parametrize("inverse", ["stable", "neumann"])
def test_varlen_against_oracle_and_single_sequences(inverse):
    """Packed sequences: close to the oracle, and bitwise what each sequence gives alone (stable:
    every sequence; neumann: the first two, to bound compile time)."""
    rng = np.random.default_rng(9)
    N = len(VARLEN_CU) - 1
    args = make_inputs(rng, 1, VARLEN_CU[-1], 2, regime=WIDE, law="uniform")
    state = random_states(rng, N, 2, jnp.bfloat16)
    cu = jnp.asarray(VARLEN_CU, jnp.int32)
    out, final = run_reference(args, state, cu, inverse=inverse)
    want_out, want_final = run_oracle(args, state, cu)
    assert rel_rmse(out, want_out) <= OUT_TOL_FLASHKDA_INPUTS
    assert rel_rmse(final, want_final) <= STATE_TOL

    for n in range(N if inverse == "stable" else 2):
        lo, hi = VARLEN_CU[n], VARLEN_CU[n + 1]
        alone = {name: (a[:, lo:hi] if a.ndim >= 3 else a) for name, a in args.items()}
        seq_out, seq_final = run_reference(alone, state[n:n + 1], inverse=inverse)
        assert_bits(out[:, lo:hi], seq_out)
        assert_bits(final[n], seq_final[0])
        if hi == lo:  # zero-length sequence: final state = initial state
            assert_bits(final[n], state[n])


def test_batched_equals_packed():
    rng = np.random.default_rng(10)
    B, T = 3, 15  # T < 16: one partial chunk per sequence
    args = make_inputs(rng, B, T, 2, regime=WIDE, law="uniform")
    state = random_states(rng, B, 2, jnp.bfloat16)
    out, final = run_reference(args, state)
    want_out, want_final = run_oracle(args, state)
    assert rel_rmse(out, want_out) <= OUT_TOL_FLASHKDA_INPUTS
    assert rel_rmse(final, want_final) <= STATE_TOL
    flat = {n: (a.reshape((1, B * T) + a.shape[2:]) if a.ndim >= 3 else a) for n, a in args.items()}
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    packed_out, packed_final = run_reference(flat, state, cu)
    assert_bits(out.reshape(packed_out.shape), packed_out)
    assert_bits(final, packed_final)


def test_neumann_and_stable_agree_on_random_keys():
    rng = np.random.default_rng(11)
    args = make_inputs(rng, 1, 100, 2, regime=WIDE)
    state = random_states(rng, 1, 2, jnp.bfloat16)
    stable, _ = run_reference(args, state, inverse="stable")
    neumann, _ = run_reference(args, state, inverse="neumann")
    assert rel_rmse(neumann, f64(stable)) < 0.005


def test_collinear_keys_stable_accurate_neumann_not():
    """16 identical keys, no decay, b ~ 1: stable stays accurate; Neumann's f16 series breaks down.

    Observed in this emulation: Neumann finite but ~100% wrong (FlashKDA reports NaN/Inf on the
    GPU).
    """
    rng = np.random.default_rng(12)
    T, H = 32, 8
    args = make_inputs(rng, 1, T, H, regime="collinear")  # one key per head, b ~ 1, no decay
    assert np.all(np.asarray(args["k"]) == np.asarray(args["k"])[:, :1])
    want_out, _ = run_oracle(args)
    stable_out, stable_final = run_reference(args, inverse="stable")
    assert np.all(np.isfinite(f64(stable_out))) and np.all(np.isfinite(f64(stable_final)))
    assert rel_rmse(stable_out, want_out) < 0.02
    neumann_out, _ = run_reference(args, inverse="neumann")
    neumann_err = rel_rmse(np.nan_to_num(f64(neumann_out), nan=1e6, posinf=1e6, neginf=-1e6),
                           want_out)
    print(f"collinear keys: stable {rel_rmse(stable_out, want_out):.4f}, neumann {neumann_err:.4f}")
    assert neumann_err > 0.3, neumann_err


@pytest.mark.parametrize("cu", [[0, 30, 10, 40], [0, 25, 60, 90], [-5, 3, 3, 1000],
                                [40, 0, 40, 40]])
def test_malformed_cu_seqlens_run_and_stay_finite(cu):
    rng = np.random.default_rng(13)
    args = make_inputs(rng, 1, 40, 2, regime=WIDE)
    state = random_states(rng, 3, 2, jnp.bfloat16)
    out, final = run_reference(args, state, jnp.asarray(cu, jnp.int32))
    assert out.shape == (1, 40, 2, D) and final.shape == (3, 2, D, D)
    assert np.all(np.isfinite(f64(out))) and np.all(np.isfinite(f64(final)))


def test_no_initial_state_means_zeros():
    rng = np.random.default_rng(14)
    args = make_inputs(rng, 2, 20, 2, regime=WIDE)
    zeros = jnp.zeros((2, 2, D, D), jnp.bfloat16)
    out_a, final_a = run_reference(args, None)
    out_b, final_b = run_reference(args, zeros)
    assert_bits(out_a, out_b)
    assert_bits(final_a, final_b)


def test_gradients_flow():
    rng = np.random.default_rng(15)
    args = make_inputs(rng, 1, 20, 1, regime=WIDE)
    state = random_states(rng, 1, 1, jnp.bfloat16)

    def loss(v, q):
        out, final = reference.kda_prefill_reference(
            **{**args, "v": v, "q": q}, scale=SCALE, lower_bound=LOWER_BOUND, initial_state=state)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(final.astype(jnp.float32))

    dv, dq = jax.jit(jax.grad(loss, argnums=(0, 1)))(args["v"], args["q"])
    assert np.all(np.isfinite(f64(dv))) and np.any(f64(dv)) and np.any(f64(dq))


@pytest.mark.slow
def test_oracle_long_sequence_is_fast_and_matches():
    import time
    rng = np.random.default_rng(16)
    args = make_inputs(rng, 1, 1024, 4, regime=WIDE, law="uniform")
    state = random_states(rng, 1, 4, jnp.bfloat16)
    start = time.perf_counter()
    want_out, want_final = run_oracle(args, state)
    assert time.perf_counter() - start < 30
    out, final = run_reference(args, state)
    assert rel_rmse(out, want_out) <= OUT_TOL_FLASHKDA_INPUTS
    assert rel_rmse(final, want_final) <= STATE_TOL
