"""Gradient accuracy cases and the gradients measured on them: one definition for
tests/test_reference_backward.py and benchmarks/grad_accuracy.py.

A case is kda_prefill's inputs in one gate regime (jax_kda.bench.regimes, plus "unit_decay"), an
initial state and the cotangents of out and of the final state. The initial state and both
cotangents hold bf16 values, so every method differentiates the same exact function along the same
cotangents: the references' autodiff rounds a cotangent to the dtype of what it flows into (bf16
out, the flashkda mode's bf16 state), which then changes nothing.

Gradients, each as a tuple in GRADIENT_NAMES' order:
* `exact`: float64 autodiff of the token-by-token oracle (jax_kda.oracle_jax);
* `backward`: jax_kda.reference_backward.kda_prefill_vjp's f32 values and its result (primals'
  dtypes);
* `reference_autodiff`: jax.vjp through a numerics mode's reference (rounding straight-through).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import oracle_jax, reference, reference_backward, reference_fp32
from . import regimes

D = 128
SCALE = D**-0.5
LOWER_BOUND = -5.0
GRADIENT_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
# "unit_decay": keep32's never-forgetting quarter with A_log = log 16 and g ~ N(-3, 1), where most
# decays round to exactly 1 in f32 and exp2-based sigmoids overflow.
GRADIENT_REGIMES = ("strong", "fla", "keep32", "slow", "unit_decay")
REFERENCE_MODES = {"flashkda": reference.kda_prefill_reference,
                   "fp32": reference_fp32.kda_prefill_reference_fp32}


class Case(NamedTuple):
    primals: tuple  # q, k, v, g, beta (bf16), A_log, dt_bias, initial_state (f32)
    cu_seqlens: np.ndarray | None
    d_out: jax.Array  # bf16 [B, T, H, 128]
    d_final_state: jax.Array  # f32 [N, H, 128, 128], bf16 values


def _bf16_valued(x):
    return jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)


def make_case(rng, T, H, regime, cu_seqlens=None, law="normal") -> Case:
    """Inputs of one regime, a bf16-valued initial state ~ 0.1 N(0, 1), cotangents ~ N(0, 1)."""
    a = regimes.make_inputs(rng, T, H, "keep32" if regime == "unit_decay" else regime, law)
    if regime == "unit_decay":
        a["A_log"] = jnp.full((H,), np.log(16.0), jnp.float32)
        a["g"] = jnp.asarray(rng.normal(-3.0, 1.0, a["g"].shape), jnp.bfloat16)
    N = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    state = _bf16_valued(0.1 * rng.standard_normal((N, H, D, D)))
    primals = (a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], state)
    cu = None if cu_seqlens is None else np.asarray(cu_seqlens, np.int32)
    return Case(primals, cu, jnp.asarray(rng.standard_normal((1, T, H, D)), jnp.bfloat16),
                _bf16_valued(rng.standard_normal((N, H, D, D))))


def exact(case: Case, with_d_out=True, with_d_final_state=True):
    """float64 numpy gradients of the exact function (some cotangents may be left out: zero)."""
    return oracle_jax.kda_prefill_oracle_vjp(
        *case.primals[:7], scale=SCALE, lower_bound=LOWER_BOUND, initial_state=case.primals[7],
        cu_seqlens=case.cu_seqlens, d_out=case.d_out if with_d_out else None,
        d_final_state=case.d_final_state if with_d_final_state else None)[2]


_JITTED = {}


def clear_cache() -> None:
    """Forget the jitted programs (each is traced once per configuration)."""
    _JITTED.clear()


def backward(case: Case, with_d_out=True, with_d_final_state=True, unroll=1, chains="scan"):
    """kda_prefill_vjp's gradients as (f32 values, the same in the primals' dtypes): the second is
    what kda_prefill_vjp returns (reference_backward.in_primal_dtypes of the first)."""
    key = ("backward", unroll, chains, case.cu_seqlens is None, with_d_out, with_d_final_state)
    if key not in _JITTED:

        def run(primals, cu, d_out, d_final_state):
            grads = reference_backward.kda_prefill_vjp_f32(
                *primals, cu, d_out if with_d_out else None,
                d_final_state if with_d_final_state else None,
                scale=SCALE, lower_bound=LOWER_BOUND, unroll=unroll, chains=chains)
            return tuple(grads), tuple(reference_backward.in_primal_dtypes(grads, primals))

        _JITTED[key] = jax.jit(run)
    return _JITTED[key](case.primals, _cu(case), case.d_out, case.d_final_state)


def reference_autodiff(mode: str, case: Case):
    """jax.vjp through the reference of numerics mode `mode` ("flashkda" or "fp32")."""
    key = ("reference", mode, case.cu_seqlens is None)
    if key not in _JITTED:
        forward = REFERENCE_MODES[mode]

        def run(primals, cu, d_out, d_final_state):
            def prefill(*primals):
                out, final = forward(*primals[:7], scale=SCALE, lower_bound=LOWER_BOUND,
                                     initial_state=primals[7], cu_seqlens=cu)
                return out, final.astype(jnp.float32)

            _, pullback = jax.vjp(prefill, *primals)
            return pullback((d_out, d_final_state))

        _JITTED[key] = jax.jit(run)
    return tuple(_JITTED[key](case.primals, _cu(case), case.d_out, case.d_final_state))


def _cu(case):
    return None if case.cu_seqlens is None else jnp.asarray(case.cu_seqlens)


def rel_rmse(got, want) -> float:
    """rms(got - want) / rms(want) in float64."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    return float(np.sqrt(np.sum((got - want) ** 2) / np.sum(want**2)))


def rounding_error(want, like) -> float:
    """The relative RMSE of rounding the exact gradient `want` to `like`'s dtype alone."""
    return rel_rmse(jnp.asarray(want, jnp.float32).astype(jnp.asarray(like).dtype), want)
