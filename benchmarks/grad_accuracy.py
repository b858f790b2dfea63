"""Accuracy of kda_prefill's gradients against the float64 oracle (jax_kda.oracle_jax's autodiff):
relative RMSE of every gradient, per gate regime, for

  backward         jax_kda.reference_backward.kda_prefill_vjp (gradients in the primals' dtypes)
  backward f32     the same before that rounding (the algorithm's own error)
  autodiff <mode>  jax.vjp through the pure-JAX reference of numerics mode <mode>
  rounding         the exact gradient rounded to its dtype (bf16 for q, k, v, g, beta; f32 else):
                   the floor of any method that returns that dtype

Cases: jax_kda.bench.gradients (bf16-valued initial state and cotangents, both cotangents
~ N(0, 1)).
Runs on the CPU; T = 1024 and 4 heads take a few minutes.

  python benchmarks/grad_accuracy.py [--T 1024] [--heads 4] [--regimes strong,fla,...]
                                     [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from jax_kda.bench import gradients

COLUMNS = gradients.GRADIENT_NAMES


def measure(rng, T, heads, regime):
    case = gradients.make_case(rng, T, heads, regime)
    want = gradients.exact(case)
    rows = {"rounding": [gradients.rounding_error(w, x) for w, x in zip(want, case.primals)]}
    f32, returned = gradients.backward(case)
    methods = {"backward": returned, "backward f32": f32,
               "autodiff flashkda": gradients.reference_autodiff("flashkda", case),
               "autodiff fp32": gradients.reference_autodiff("fp32", case)}
    for name, got in methods.items():
        rows[name] = [gradients.rel_rmse(g, w) if np.all(np.isfinite(np.asarray(g, np.float32)))
                      else float("nan") for g, w in zip(got, want)]
    return rows


def table(results):
    lines = ["| regime | method | " + " | ".join(COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for regime, rows in results.items():
        for method, values in rows.items():
            cells = " | ".join(f"{v:.2e}" for v in values)
            lines.append(f"| {regime} | {method} | {cells} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--regimes", default=",".join(gradients.GRADIENT_REGIMES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the results as JSON")
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    results = {}
    for regime in args.regimes.split(","):
        started = time.time()
        results[regime] = measure(rng, args.T, args.heads, regime)
        print(f"{regime}: {time.time() - started:.0f} s", flush=True)
    print(f"\nRelative RMSE vs the float64 oracle, T = {args.T}, {args.heads} heads "
          f"(NaN: the method's gradient has non-finite values)\n")
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"T": args.T, "heads": args.heads, "device": str(jax.devices()[0]),
                       "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                       "columns": COLUMNS, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
