"""Where the backward's time goes: each step of jax_kda.reference_backward timed alone on the GPU,
beside the whole backward, in one process.

    python benchmarks/backward_parts.py --heads 12 --seqlen 8192

Parts (one sequence, strong-decay inputs as benchmarks/training_step.py, a cotangent of out and
of the final state): "factors" (step 1, chunk_factors), "chains" (steps 2 and 3 on the chain
kernel, their operands included), "chain kernel" (the kernel alone, both chains, on operands
computed once), "chunk gradients" (step 4), "whole" (kda_prefill_vjp with chains="kernel", steps
1-5 and the conversions). Each is a jitted chain of
calls with feedback (jax_kda.bench.timing), medians of --repeats samples, microseconds.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from training_step import LOWER_BOUND, SCALE, feedback, make_inputs, write_rows

from jax_kda import _state_chain
from jax_kda import reference_backward as rb
from jax_kda.bench import timing


def parts(x, d_out, d_final):
    B, T = x["q"].shape[:2]
    layout = rb.chunk_layout(B, T, None)
    chunked = lambda a: rb.to_chunks(a, layout)

    def factors(x):
        return rb.chunked_factors(layout, x["q"], x["k"], x["g"], x["beta"], x["A_log"],
                                  x["dt_bias"], scale=SCALE, lower_bound=LOWER_BOUND)

    def chains(x):
        return rb.chains_on_kernel(factors(x), chunked(x["v"]), chunked(d_out), x["state"],
                                   d_final)

    f = jax.jit(factors)(x)
    forward, reverse = jax.block_until_ready(rb.chain_operands(
        f, chunked(x["v"]), chunked(d_out), x["state"], d_final))

    def chain_kernel(x):  # a dependence on x (0 * A_log) so that feedback orders the calls
        return _state_chain.state_chains(f.gt + 0.0 * x["A_log"][0], forward, reverse)

    def chunk_gradients(x):
        f, do = factors(x), chunked(d_out)
        states = jnp.broadcast_to(x["state"][:, :, None], do.shape[:3] + (128, 128))
        return rb.chunk_gradients(f, do, states, do, states, do, scale=SCALE)

    def whole(x):
        return rb.kda_prefill_vjp(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"],
                                  x["dt_bias"], x["state"], None, d_out, d_final, scale=SCALE,
                                  lower_bound=LOWER_BOUND, chains="kernel")

    return {"factors": factors, "chains": chains, "chain kernel": chain_kernel,
            "chunk gradients": chunk_gradients, "whole": whole}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="12")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated part names (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for H in (int(h) for h in args.heads.split(",")):
        rng = np.random.default_rng(H)
        x = make_inputs(rng, args.seqlen, H)
        d_out = jnp.asarray(rng.standard_normal((1, args.seqlen, H, 128)), jnp.bfloat16)
        d_final = jnp.asarray(rng.standard_normal((1, H, 128, 128)), jnp.float32)
        for name, fn in parts(x, d_out, d_final).items():
            if args.only and name not in args.only.split(","):
                continue
            t = timing.time_jax(fn, (x,), feedback, repeats=args.repeats, warmup=1, inner=2,
                                min_chain_ms=5.0)
            rows.append({"heads": H, "seqlen": args.seqlen, "part": name, **t.summary()})
            print(f"T={args.seqlen} H={H} {name}: {t.median_us:.1f} us", flush=True)
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
