"""What output_intermediate_states costs in kda_decode, in both numerics modes, one process.

    python benchmarks/decode_intermediate_states.py [--cases 64,12,4 256,12,4] [--out f.json]

One decode step of N sequences x H heads x t tokens on an f32 state pool (all rows indexed),
with and without the intermediate states, for numerics="flashkda" (the fused decode kernel) and
numerics="fp32" (the fp32 mode's fused decode kernel). Each variant is a jitted chain of
dependent steps (jax_kda.bench.timing: the next step reads this step's pool, and its v depends
on one element of the states, so they are computed); the variants alternate over several
rounds; medians in us and the ratios to the same mode without states are printed.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda
from jax_kda.bench import timing
from jax_kda.bench.jax_variants import zero_times

MODES = ("flashkda", "fp32")


def inputs(rng, N, H, t):
    def arr(*shape, dtype=jnp.bfloat16, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)

    x = {"q": arr(N, t, H, 128), "k": arr(N, t, H, 128), "v": arr(N, t, H, 128),
         "g": arr(N, t, H, 128), "beta": arr(N, t, H),
         "A_log": jnp.asarray(rng.uniform(0, 1, H), jnp.float32),
         "dt_bias": jnp.asarray(rng.uniform(0, 1, (H, 128)), jnp.float32)}
    pool = arr(N, H, 128, 128, dtype=jnp.float32, scale=0.05)
    return x, pool, jnp.asarray(rng.permutation(N), jnp.int32)


def variant(numerics, with_states):
    def fn(x, pool, idx):
        return jax_kda.kda_decode(**x, state=pool, state_indices=idx, backend="kernel",
                                  numerics=numerics, output_intermediate_states=with_states)

    def feedback(args, outs):  # the next step starts from this pool and needs these states
        x, _, idx = args
        dep = zero_times(outs[2] if with_states else outs[0])
        return {**x, "v": (x["v"].astype(jnp.float32) + dep).astype(x["v"].dtype)}, outs[1], idx

    return fn, feedback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["64,12,4", "256,12,4", "256,12,8"],
                        help="N,H,t per case")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for case in args.cases:
        N, H, t = (int(s) for s in case.split(","))
        x, pool, idx = inputs(rng, N, H, t)
        names = [(m, s) for m in MODES for s in (False, True)]
        samples = {name: [] for name in names}
        for _ in range(args.rounds):
            for numerics, with_states in names:
                fn, feedback = variant(numerics, with_states)
                t_us = timing.time_jax(fn, (x, pool, idx), feedback, repeats=10, warmup=2,
                                       inner=4, min_chain_ms=5.0)
                samples[(numerics, with_states)].append(t_us.median_us)
        med = {name: float(np.median(v)) for name, v in samples.items()}
        for numerics in MODES:
            row = {"N": N, "H": H, "t": t, "numerics": numerics,
                   "plain_us": med[(numerics, False)], "states_us": med[(numerics, True)],
                   "ratio": med[(numerics, True)] / med[(numerics, False)],
                   "rounds": {"plain": samples[(numerics, False)],
                              "states": samples[(numerics, True)]}}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("N", "H", "t", "numerics", "plain_us",
                                                   "states_us", "ratio")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "pool": "f32, N rows, all indexed", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
