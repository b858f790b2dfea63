"""What precision the backward's serial chains need: the gradients' accuracy against the float64
oracle when both chains' matrix products (P = A X^T and Z^T B of every chunk step, the state X
among the operands: jax_kda/kernels/state_chain.py) are computed from operands split into
lower-precision parts, as tensor cores would take them, the rest of the backward unchanged.

  f32       every product in f32 (the chain kernel's arithmetic, FMA)
  tf32x3    a = hi + lo, both TF32 (10 mantissa bits, round to nearest): hi hi + hi lo + lo hi
  bf16x3    the same with bf16 parts (7 mantissa bits)
  bf16      each operand rounded to bf16 once, one product (f32 accumulation)
  bf16x2s   the chain's own operand (the state X in P, Z in the update) split into two bf16
            parts, the precomputed one (A, B) rounded to bf16 once: two products
  bf16x2o   the other way round: the precomputed operand split, the chain's own rounded once

Each split part's products are exact in f32 and summed in f32 (a tensor core's accumulation
rounds differently in the last bits). The chains run as tests/state_chain_model.py's model, with
the operands reference_backward builds for the chain kernel. Relative RMSE of every gradient's
f32 value against the oracle, per gate regime (jax_kda.bench.gradients), on the CPU:

  python benchmarks/chain_product_precision.py [--T 1024] [--heads 4] [--regimes ...] [--out x.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import numpy as np

from jax_kda import _state_chain
from jax_kda.bench import gradients

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from state_chain_model import f32_product, state_chains_model  # noqa: E402

MANTISSA_BITS = {"tf32": 10, "bf16": 7}


def _round(x, fmt):
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=MANTISSA_BITS[fmt])


# which operand of the model's two products is the chain's own (the state X in P = A X^T, Z in
# Z^T B): tests/state_chain_model.py's specs
CHAIN_OPERAND = {"hrk,hvk->hrv": 1, "hrv,hrk->hvk": 0}


def split_product(spec, a, b, *, fmt, terms, split=None):
    """a b from parts of fmt: terms 3 (hi hi + (hi lo + lo hi)), 1 (hi hi) or 2 (hi hi + the
    lo part of the operand `split` names, "chain" or "other", times the other's hi)."""
    a_hi, b_hi = _round(a, fmt), _round(b, fmt)
    if terms == 1:
        return f32_product(spec, a_hi, b_hi)
    a_lo, b_lo = _round(a - a_hi, fmt), _round(b - b_hi, fmt)
    if terms == 2:
        split_a = (CHAIN_OPERAND[spec] == 0) == (split == "chain")
        small = f32_product(spec, a_lo, b_hi) if split_a else f32_product(spec, a_hi, b_lo)
        return small + f32_product(spec, a_hi, b_hi)
    small = f32_product(spec, a_hi, b_lo) + f32_product(spec, a_lo, b_hi)
    return small + f32_product(spec, a_hi, b_hi)


PRODUCTS = {
    "f32": f32_product,
    "tf32x3": functools.partial(split_product, fmt="tf32", terms=3),
    "bf16x3": functools.partial(split_product, fmt="bf16", terms=3),
    "bf16": functools.partial(split_product, fmt="bf16", terms=1),
    "bf16x2s": functools.partial(split_product, fmt="bf16", terms=2, split="chain"),
    "bf16x2o": functools.partial(split_product, fmt="bf16", terms=2, split="other"),
}


def measure(case, want):
    """{product: relative RMSE of every f32 gradient against want}, the chains run as the model
    with that product (the kernel's chains put back afterwards)."""
    kernel_chains, errors = _state_chain.state_chains, {}
    try:
        for name, product in PRODUCTS.items():
            _state_chain.state_chains = functools.partial(state_chains_model, product=product)
            gradients.clear_cache()
            got = gradients.backward(case, chains="kernel")[0]
            errors[name] = [gradients.rel_rmse(g, w) for g, w in zip(got, want)]
    finally:
        _state_chain.state_chains = kernel_chains
        gradients.clear_cache()  # no later caller may get a program compiled with the model
    return errors


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--regimes", default=",".join(gradients.GRADIENT_REGIMES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows = []
    print("| regime | products | " + " | ".join(gradients.GRADIENT_NAMES) + " |")
    print("|---|---|" + "---|" * len(gradients.GRADIENT_NAMES))
    for regime in args.regimes.split(","):
        case = gradients.make_case(rng, args.T, args.heads, regime)
        for name, errors in measure(case, gradients.exact(case)).items():
            rows.append({"regime": regime, "products": name, "T": args.T, "heads": args.heads,
                         "rel_rmse": errors})
            print(f"| {regime} | {name} | " + " | ".join(f"{e:.2e}" for e in errors) + " |",
                  flush=True)
    if args.out:
        meta = {"jax": jax.__version__, "device": str(jax.devices()[0])}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
