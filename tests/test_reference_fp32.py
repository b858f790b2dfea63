"""The fp32 numerics mode's pure-JAX reference (jax_kda.reference_fp32) against the float64 oracle.

Bounds (docs/fp32_mode.md): relative RMSE vs the oracle <= 3.0e-3 on outputs and <= 2.5e-3 on the
f32 final state in every gate regime. Measured when this was written (T = 1024, 2 heads, bf16
initial state): outputs 1.65e-3 .. 1.83e-3 (the bf16 rounding of exact outputs alone gives
~1.66e-3), final states <= 8.4e-4, while the bf16 mode gives 3.6e-3 .. 1.1e-2 and 4.5e-3 .. 1.5e-2
on the same inputs (the largest with near-collinear keys).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kda_testing import assert_bits, make_inputs, random_states

from jax_kda import oracle, reference, reference_fp32

D = 128
SCALE = D**-0.5
LOWER_BOUND = -5.0
OUT_BOUND = 3.0e-3
STATE_BOUND = 2.5e-3


_JITTED = {}


def run(mode, args, state=None, cu=None):
    key = (mode, state is None, cu is None)
    if key not in _JITTED:
        fn = (reference_fp32.kda_prefill_reference_fp32 if mode == "fp32"
              else reference.kda_prefill_reference)
        _JITTED[key] = jax.jit(lambda a, s, c: fn(**a, scale=SCALE, lower_bound=LOWER_BOUND,
                                                  initial_state=s, cu_seqlens=c))
    return _JITTED[key](args, state, cu)


def run_oracle(args, state=None, cu=None):
    return oracle.kda_prefill_oracle(**args, scale=SCALE, lower_bound=LOWER_BOUND,
                                     initial_state=state,
                                     cu_seqlens=None if cu is None else np.asarray(cu))


def f64(x):
    return np.asarray(np.asarray(x).astype(np.float32), np.float64)


def rel_rmse(got, want):
    got, want = f64(got), np.asarray(want, np.float64)
    assert np.sqrt(np.mean(want**2)) > 1e-3  # a meaningful reference, not zeros
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


# --------------------------------------------------------------------------- building blocks


def test_split_hi_lo_is_the_bf16_pair():
    rng = np.random.default_rng(20)
    x = (rng.standard_normal(20000) * 2.0 ** rng.integers(-120, 100, 20000)).astype(np.float32)
    hi, lo = jax.jit(reference_fp32.split_hi_lo)(x)
    hi32, lo32 = f64(hi), f64(lo)
    want_hi = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(hi).view(np.uint16), want_hi.view(np.uint16))
    rest = x.astype(np.float64) - hi32  # exact in f32; lo is its bf16 rounding, or 0 if subnormal
    want_lo = np.where(np.abs(rest) < 2.0**-126, 0.0,
                       rest.astype(np.float32).astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(lo32, f64(want_lo))
    normal = np.abs(x) > 2.0**-100
    assert np.all(np.abs(x - hi32 - lo32)[normal] <= 2.0**-16 * np.abs(x)[normal])
    assert np.mean(lo32 != 0) > 0.95


def _exact_chunk(q, k, g, beta, A_log, dt_bias):
    """Float64 kd, qd, kr, gt, L, Mqk of one head's chunks [C, 16, ...] (all rows valid)."""
    qn = f64(q) / np.sqrt(np.sum(f64(q) ** 2, -1, keepdims=True) + 1e-6)
    kn = f64(k) / np.sqrt(np.sum(f64(k) ** 2, -1, keepdims=True) + 1e-6)
    x = np.exp(float(A_log)) * (f64(g) + f64(dt_bias))
    G = np.cumsum(LOWER_BOUND * np.log2(np.e) / (1 + np.exp(-x)), axis=-2)
    decay = np.exp2(G[..., :, None, :] - G[..., None, :, :])  # [C, r, c, d]
    b = 1 / (1 + np.exp(-f64(beta)))
    lower, lower_with_diagonal = np.tril(np.ones((16, 16)), -1), np.tril(np.ones((16, 16)))
    lmat = b[..., :, None] * np.einsum("...rd,...cd,...rcd->...rc", kn, kn, decay) * lower
    return {"kd": kn * np.exp2(G), "qd": qn * np.exp2(G) * SCALE,
            "kr": kn * np.exp2(G[..., -1:, :] - G), "gt": np.exp2(G[..., -1, :]), "L": lmat,
            "mqk": SCALE * np.einsum("...rd,...cd,...rcd->...rc", qn, kn, decay)
            * lower_with_diagonal,
            "G15": G[..., -1, :]}


def test_prepare_matches_float64_to_f32_level():
    """kd/qd/kr/gt/INV/Mqk of the workspace (hi + lo) are f32-accurate, strong decay included."""
    rng = np.random.default_rng(21)
    C = 4
    common = rng.standard_normal(D)
    k = jnp.asarray(0.6 * common + 0.5 * rng.standard_normal((C, 16, D)), jnp.bfloat16)  # large L
    q = jnp.asarray(rng.standard_normal((C, 16, D)), jnp.bfloat16)
    g = rng.uniform(-14, -4, (C, 16, D))
    g[-1] = 20.0  # last chunk: every gate at its lower bound, 2^G_15 ~ 2^-115
    g = jnp.asarray(g, jnp.bfloat16)
    beta = jnp.asarray(rng.standard_normal((C, 16)), jnp.bfloat16)
    A_log, dt_bias = np.float32(-1.0), rng.uniform(-2, 2, D).astype(np.float32)
    ws = jax.jit(lambda *a: reference_fp32.prepare_reference_fp32(
        *a, scale=SCALE, lower_bound=LOWER_BOUND))(q, k, g, beta, A_log, dt_bias)
    want = _exact_chunk(q, k, g, beta, A_log, dt_bias)
    assert want["G15"][-1].max() < -110

    def value(pair):
        return f64(pair.hi) + (0.0 if pair.lo is None else f64(pair.lo))

    # The record holds lo only where a product uses it: everywhere but kd
    # (P = kd_hi . (S_hi + S_lo)).
    assert ws.kd.lo is None
    assert all(x.lo is not None for x in (ws.qd, ws.kr, ws.mqk, ws.inv))
    for name in ("kd", "qd", "kr"):  # hi + lo carries 16 bits; tiny decayed values may be flushed
        pair = getattr(ws, name)
        rtol = 2.0**-8 if pair.lo is None else 2.0**-14
        err = np.abs(value(pair) - want[name])
        assert np.all(err <= rtol * np.abs(want[name]) + 2.0**-118), name
    # G is an f32 running sum: near G = -115 its last bits are 2^-17, i.e. ~1e-5 relative in 2^G
    np.testing.assert_allclose(f64(ws.gt), want["gt"], rtol=1e-4)
    mqk_err = np.abs(value(ws.mqk) - want["mqk"])
    assert np.max(mqk_err) < 1e-5 and not np.any(np.triu(value(ws.mqk), 1))
    diag = np.diagonal(want["mqk"][-1])  # decay 2^0: must survive the strongly decayed chunk
    assert np.abs(diag).max() > 1e-3
    np.testing.assert_allclose(np.diagonal(value(ws.mqk)[-1]), diag, rtol=1e-4, atol=1e-6)

    eye = np.eye(16)
    assert np.abs(want["L"]).max() > 0.3  # a sizeable L, or the residual says nothing
    residual = np.abs(value(ws.inv) @ (eye + want["L"]) - eye).max()
    assert residual < 1e-4, residual  # the bf16 mode's INV: ~1e-2


# --------------------------------------------------------------------------- against the oracle


CASES = [("keep32", "normal"), ("slow", "normal"), ("strong", "uniform"), ("fla", "normal"),
         ("collinear", "normal")]


@pytest.mark.parametrize("regime,law", CASES)
def test_bounds_against_oracle_and_better_than_bf16(regime, law):
    rng = np.random.default_rng(22 + CASES.index((regime, law)))
    args = make_inputs(rng, 1, 1024, 2, regime=regime, law=law)
    state0 = random_states(rng, 1, 2, jnp.bfloat16)
    want_out, want_state = run_oracle(args, state0)
    out, state = run("fp32", args, state0)
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    out_err, state_err = rel_rmse(out, want_out), rel_rmse(state, want_state)
    bf16_out, bf16_state = run("bf16", args, state0)
    bf16_out_err, bf16_state_err = rel_rmse(bf16_out, want_out), rel_rmse(bf16_state, want_state)
    print(f"{regime}/{law}: fp32 out {out_err:.2e} state {state_err:.2e}; "
          f"bf16 out {bf16_out_err:.2e} state {bf16_state_err:.2e}")
    assert out_err <= OUT_BOUND and state_err <= STATE_BOUND
    assert out_err < 0.7 * bf16_out_err and state_err < 0.4 * bf16_state_err


PACKED_CU = [0, 0, 77, 77, 154]  # empty, 77 tokens, empty, 77 tokens (one shape for "alone")


def test_packed_equals_each_sequence_alone_and_empty_keeps_f32_state():
    rng = np.random.default_rng(30)
    N, H = len(PACKED_CU) - 1, 2
    args = make_inputs(rng, 1, PACKED_CU[-1], H, regime="keep32")
    state = random_states(rng, N, H)  # f32 values that are not bf16 numbers
    cu = jnp.asarray(PACKED_CU, jnp.int32)
    out, final = run("fp32", args, state, cu)
    want_out, want_final = run_oracle(args, state, cu)
    assert rel_rmse(out, want_out) <= OUT_BOUND and rel_rmse(final, want_final) <= STATE_BOUND
    for n in range(N):
        lo, hi = PACKED_CU[n], PACKED_CU[n + 1]
        if hi == lo:  # zero-length sequence: the f32 initial state comes back unrounded
            assert_bits(final[n], state[n])
            continue
        alone = {name: (a[:, lo:hi] if a.ndim >= 3 else a) for name, a in args.items()}
        seq_out, seq_final = run("fp32", alone, state[n:n + 1])
        assert_bits(out[:, lo:hi], seq_out)
        assert_bits(final[n], seq_final[0])


def test_only_the_stable_inverse_exists():
    rng = np.random.default_rng(32)
    args = make_inputs(rng, 1, 16, 1, regime="fla")
    with pytest.raises(ValueError, match="inverse"):
        reference_fp32.kda_prefill_reference_fp32(**args, scale=SCALE, lower_bound=LOWER_BOUND,
                                                  inverse="neumann")


def _chained_dot(spec, a, b):
    """reference._dot with the contraction done as 16-wide k-blocks added in ascending order (the
    order of a kernel's MMA chain) instead of XLA's."""
    (sa, sb), out = spec.split("->")[0].split(","), spec.split("->")[1]
    letter = next(c for c in sa if c in sb and c not in out and c != ".")
    axis_a, axis_b = sa.index(letter) - len(sa), sb.index(letter) - len(sb)
    total = None
    for start in range(0, a.shape[axis_a], 16):
        block = jnp.arange(start, min(start + 16, a.shape[axis_a]))
        part = _PLAIN_DOT(spec, jnp.take(a, block, axis=axis_a), jnp.take(b, block, axis=axis_b))
        total = part if total is None else total + part
    return total


_PLAIN_DOT = reference._dot


def test_summation_order_moves_results_only_at_f32_level(monkeypatch):
    """A kernel sums each MMA chain in its own order; the design keeps that a last-bit effect.

    (With P = kd_hi . S_hi alone, the final state moves by ~7e-4 here: a last-bit change of S
    flips bf16(S), which P alone sees.)
    """
    rng = np.random.default_rng(33)
    args = make_inputs(rng, 1, 1024, 2, regime="slow")
    out, state = run("fp32", args)
    monkeypatch.setattr(reference, "_dot", _chained_dot)
    alt_out, alt_state = jax.jit(lambda a: reference_fp32.kda_prefill_reference_fp32(
        **a, scale=SCALE, lower_bound=LOWER_BOUND))(args)
    assert not np.array_equal(np.asarray(alt_state), np.asarray(state))  # the order did change
    assert rel_rmse(alt_state, state) < 5e-5
    assert np.mean(np.asarray(alt_out) == np.asarray(out)) > 0.98
