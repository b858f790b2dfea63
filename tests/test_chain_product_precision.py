"""benchmarks/chain_product_precision.py, on CPU: its emulated tensor-core products must carry
the error their parts allow (so that its accuracy table measures what it says), and a chain run
with them must order the methods as their precisions do."""

from __future__ import annotations

import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kda.bench import gradients

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")]

import chain_product_precision as cpp

# relative error of a 128-term product of random operands, against float64: about 2^-m for one
# product of m-bit parts (and for two: one operand stays rounded), 2^-2m for three (the lo lo
# term left out), f32 rounding below
BOUNDS = {"f32": (0, 1e-6), "tf32x3": (0, 1e-6), "bf16x3": (1e-6, 3e-5), "bf16": (5e-4, 1e-2),
          "bf16x2s": (5e-4, 1e-2), "bf16x2o": (5e-4, 1e-2)}


@pytest.mark.parametrize("name", list(cpp.PRODUCTS))
def test_split_products_carry_their_parts_error(name):
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((2, 16, 128)).astype(np.float32) for _ in range(2))
    spec = "hrk,hvk->hrv"  # the model's P = A X^T
    want = np.einsum(spec, a.astype(np.float64), b.astype(np.float64))
    error = gradients.rel_rmse(cpp.PRODUCTS[name](spec, jnp.asarray(a), jnp.asarray(b)), want)
    low, high = BOUNDS[name]
    print(f"{name}: {error:.2e}")
    assert low <= error <= high


def test_the_chain_errors_follow_the_products_precision():
    """In a small case, with never-forgetting channels: one bf16 product per f32 product gives
    A_log's gradient a far larger error than three, and three more than f32 (the kernel's chain
    is restored afterwards)."""
    from jax_kda import _state_chain

    kernel_chains = _state_chain.state_chains
    case = gradients.make_case(np.random.default_rng(5), 128, 1, "unit_decay")
    errors = cpp.measure(case, gradients.exact(case))
    assert _state_chain.state_chains is kernel_chains
    a_log = {name: e[gradients.GRADIENT_NAMES.index("A_log")] for name, e in errors.items()}
    print(a_log)
    assert a_log["bf16"] > 30 * a_log["bf16x3"]
    assert a_log["f32"] < 1e-5 and a_log["tf32x3"] < 1e-5


@pytest.mark.parametrize("split", ["chain", "other"])
def test_two_part_products_split_the_operand_they_name(split):
    """In P = A X^T the chain's operand is X (the second), in Z^T B it is Z (the first): the
    operand split into two parts contributes its low part, the other one is rounded once."""
    rng = np.random.default_rng(4)
    a, b = (jnp.asarray(rng.standard_normal((2, 16, 128)), jnp.float32) for _ in range(2))
    bf = lambda x: cpp._round(x, "bf16")
    for spec, chain_first in (("hrk,hvk->hrv", False), ("hrv,hrk->hvk", True)):
        a_exact = (split == "chain") == chain_first  # the first operand is the split one
        want = cpp.f32_product(spec, a if a_exact else bf(a), bf(b) if a_exact else b)
        got = cpp.PRODUCTS["bf16x2s" if split == "chain" else "bf16x2o"](spec, a, b)
        # the split operand's two bf16 parts carry it to 2^-16: far closer than the bf16 error
        error = gradients.rel_rmse(got, np.asarray(want, np.float64))
        assert error < 3e-5, (spec, error)
