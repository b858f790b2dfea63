"""Device memory of one layer's training step (jax.value_and_grad of kda_prefill's loss, as
benchmarks/training_step.py) from XLA's buffer assignment of the compiled program, and its time.

    python benchmarks/training_memory.py --heads 12,96 --seqlen 8192,32768

Per (T, H): the compiled step's argument, output and temporary bytes (`memory_analysis()`: the
peak of the program's own buffers beyond its inputs and outputs is the temporary size), and the
median time of a jitted chain of steps (jax_kda.bench.timing). The forward keeps its inputs only;
the backward recomputes the states (docs/training.md, "Memory and jax.checkpoint").
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from training_step import LOWER_BOUND, SCALE, make_inputs, write_rows

from jax_kda.bench import timing, training

GIB = 2.0**30


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="12,96")
    p.add_argument("--seqlen", default="8192,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for T in (int(t) for t in args.seqlen.split(",")):
        for H in (int(h) for h in args.heads.split(",")):
            rng = np.random.default_rng(H)
            x = make_inputs(rng, T, H)
            weights = (jnp.asarray(rng.standard_normal((1, T, H, 128)), jnp.float32),
                       jnp.asarray(rng.standard_normal((1, H, 128, 128)), jnp.float32))
            options = {"lower_bound": LOWER_BOUND, "scale": SCALE}
            step = jax.value_and_grad(functools.partial(training.kda_prefill_loss, "flashkda",
                                                        weights, options))
            mem = jax.jit(step).lower(x).compile().memory_analysis()
            t = timing.time_jax(step, (x,), training.feedback, repeats=args.repeats, warmup=1,
                                inner=2, min_chain_ms=20.0)
            row = {"seqlen": T, "heads": H, "temp_gib": mem.temp_size_in_bytes / GIB,
                   "argument_gib": mem.argument_size_in_bytes / GIB,
                   "output_gib": mem.output_size_in_bytes / GIB, "median_us": t.median_us}
            rows.append(row)
            print(f"T={T} H={H}: temp {row['temp_gib']:.2f} GiB, arguments "
                  f"{row['argument_gib']:.2f} GiB, outputs {row['output_gib']:.2f} GiB, "
                  f"{t.median_us:.0f} us per step", flush=True)
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
