"""Where the overlapped prefill's time goes, in one process: for each case and column split, the
two separate calls (kda_prefill's default), the overlapped custom call run one kernel after the
other (overlap attribute 0) and side by side with 1, 2, 4 ... prepare CTAs per SM. Medians of
jit chains (jax_kda.bench.timing); ratios are against the two separate calls.

  python benchmarks/overlap_schedule.py --out overlap_schedule.json [--heads 48,24,12,6]
      [--seqlen 8192] [--splits 16,32,64] [--prepare-ctas 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda
from jax_kda import _ffi, contract
from jax_kda._launch import RecurrenceLaunch
from jax_kda.bench import inputs, timing
from jax_kda.bench.cases import Case

REPEATS = 10
# Both ways of running a case take these gates (kda_prefill's defaults, passed to both).
SCALE, LOWER_BOUND = contract.HEAD_DIM ** -0.5, -5.0
# The operands of two_calls' and fused's functions, in order.
OPERANDS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu", "state")


def operands(case: Case) -> tuple:
    """The case's inputs in OPERANDS order, tokens flattened as the kernels see them."""
    x = inputs.to_jax(inputs.make_inputs(case), case)
    flat = {name: x[name].reshape((-1,) + x[name].shape[2:]) for name in ("q", "k", "v", "g", "beta")}
    d = contract.HEAD_DIM
    a = {**flat, "A_log": x["A_log"], "dt_bias": x["dt_bias"],
         "cu": jnp.asarray(case.cu_seqlens(), jnp.int32),
         "state": jnp.zeros((case.num_seqs, case.heads, d, d), jnp.bfloat16)}
    return tuple(a[n] for n in OPERANDS)


def _time(fn, args: tuple) -> float:
    def feedback(args, outs):  # the next call reads this call's output as its q (prepare's
        return (outs[0],) + args[1:]  # input: a v-fed chain would let XLA merge the prepares)

    return timing.time_jax(fn, args, feedback, repeats=REPEATS, warmup=2, inner=4,
                           min_chain_ms=20).median_us


def two_calls(split: int):
    def fn(q, k, v, g, beta, A_log, dt_bias, cu, state):
        out, final = jax_kda.kda_prefill(
            q[None], k[None], v[None], g[None], beta[None], A_log, dt_bias, scale=SCALE,
            lower_bound=LOWER_BOUND, cu_seqlens=cu, initial_state=state, output_final_state=True,
            column_split=split, overlap=False, backend="kernel")
        return out[0], final
    return fn


def fused(split: int, prepare_ctas: int):
    launch = RecurrenceLaunch("column_split", split, overlap=prepare_ctas > 0)

    def fn(q, k, v, g, beta, A_log, dt_bias, cu, state):
        return _ffi.prefill_overlap_call(q, k, v, g, beta, A_log, dt_bias, cu, state,
                                         scale=SCALE, lower_bound=LOWER_BOUND, inverse="stable",
                                         launch=launch, prepare_ctas_per_sm=max(prepare_ctas, 1))
    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", default="48,24,12,6")
    ap.add_argument("--seqlen", default="8192")
    ap.add_argument("--splits", default="16,32,64")
    ap.add_argument("--prepare-ctas", default="1,2,4")
    args = ap.parse_args()
    rows = []
    for t in args.seqlen.split(","):
        for h in args.heads.split(","):
            case = Case((int(t),), int(h))
            a = operands(case)
            for split in (int(s) for s in args.splits.split(",")):
                row = {"case": case.name, "split": split, "two_calls_us": _time(two_calls(split), a)}
                for ctas in [0] + [int(c) for c in args.prepare_ctas.split(",")]:
                    row[f"fused_{ctas}_us"] = _time(fused(split, ctas), a)
                rows.append(row)
                base = row["two_calls_us"]
                print(f"{case.name:>12} bv{split:<3} two calls {base:7.1f} us; fused: " + ", ".join(
                    f"{k[6:-3]} {v:7.1f} ({base / v:.2f}x)" for k, v in row.items()
                    if k.startswith("fused_")), flush=True)
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "repeats": REPEATS, "numpy": np.__version__,
            "fused_k": "overlap attribute k: 0 one kernel after the other, else k prepare CTAs "
                       "per SM side by side"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
