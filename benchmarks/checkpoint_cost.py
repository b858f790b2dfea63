"""What checkpoint_every costs: kda_prefill with and without intermediate states, one process.

    python benchmarks/checkpoint_cost.py [--seqlen 8192] [--heads 12] [--every 64] [--out f.json]

Times both through jax_kda.bench.timing (a jitted chain of dependent calls, the final state fed
forward), alternating the two variants over several rounds, and prints the medians and the ratio.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda
from jax_kda.bench import timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--every", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    T, H = args.seqlen, args.heads
    rng = np.random.default_rng(0)

    def arr(*shape, dtype=jnp.bfloat16):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)

    x = {"q": arr(1, T, H, 128), "k": arr(1, T, H, 128), "v": arr(1, T, H, 128),
         "g": arr(1, T, H, 128), "beta": arr(1, T, H),
         "A_log": jnp.asarray(rng.uniform(0, 1, H), jnp.float32),
         "dt_bias": jnp.asarray(rng.uniform(0, 1, (H, 128)), jnp.float32)}
    state = arr(1, H, 128, 128) * 0.05

    def variant(every):
        def fn(x, state):
            out, final, *ckpts = jax_kda.kda_prefill(
                **x, initial_state=state, output_final_state=True, checkpoint_every=every,
                backend="kernel")
            return out, final, *ckpts

        def feedback(args, outs):  # next call starts from this one's final state
            return args[0], outs[1]

        return fn, feedback

    medians = {"plain": [], f"checkpoint_every={args.every}": []}
    for _ in range(args.rounds):
        for name, every in (("plain", None), (f"checkpoint_every={args.every}", args.every)):
            fn, feedback = variant(every)
            t = timing.time_jax(fn, (x, state), feedback, repeats=10, warmup=2, inner=4,
                                min_chain_ms=5.0)
            medians[name].append(t.median_us)
    result = {name: float(np.median(v)) for name, v in medians.items()}
    result["ratio"] = result[f"checkpoint_every={args.every}"] / result["plain"]
    result.update(seqlen=T, heads=H, every=args.every, device=jax.devices()[0].device_kind,
                  rounds=medians)
    print(json.dumps({k: result[k] for k in ("plain", f"checkpoint_every={args.every}", "ratio")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
