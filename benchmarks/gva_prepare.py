"""The prepare kernels with grouped value heads (GVA) against the same call on q and k repeated.

For each case (H value heads, Hk query/key heads, one sequence of T tokens) and numerics mode,
three programs on the same inputs, timed in one process as jax_kda.bench.timing times them (a
jitted chain of dependent calls, the samplers interleaved):
  grouped      the prepare custom call on q, k [T, Hk, 128] (the grouped specialisation reads
               each query/key head in place);
  repeated     the same call on q and k repeated to [T, H, 128] beforehand (the plain
               specialisation; the repeat is not timed);
  repeat+call  jnp.repeat of q and k inside the timed program, then the plain call (what a
               caller without grouped heads would run).
Prints a markdown table of medians (and the grouped call's speedup) and writes JSON with --out.

  python benchmarks/gva_prepare.py --out gva_prepare.json [--cases 96:48,32:16] [--seqlen 8192]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda import _kernel_path, contract
from jax_kda.bench import timing
from jax_kda.problem import Problem

REPEATS = 15
VARIANTS = ("grouped", "repeated", "repeat+call")


def make_inputs(rng, T: int, H: int, Hk: int) -> dict:
    """bf16 q, k [1, T, Hk, 128] (L2-normalised, as a model's), g [1, T, H, 128], beta [1, T, H];
    f32 A_log [H], dt_bias [H, 128] in [0, 1) (jax_kda.bench.inputs' laws)."""
    D = contract.HEAD_DIM

    def unit(shape):
        x = rng.standard_normal(shape, dtype=np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
    return {"q": bf16(unit((1, T, Hk, D))), "k": bf16(unit((1, T, Hk, D))),
            "g": bf16(rng.standard_normal((1, T, H, D), dtype=np.float32)),
            "beta": bf16(rng.standard_normal((1, T, H), dtype=np.float32)),
            "A_log": jnp.asarray(rng.uniform(0, 1, H), jnp.float32),
            "dt_bias": jnp.asarray(rng.uniform(0, 1, (H, D)), jnp.float32),
            "cu": jnp.asarray([0, T], jnp.int32)}


def _feedback(args, workspace):
    """The next call's A_log depends on this call's workspace (no CSE, no DCE of the chain)."""
    q, k, g, beta, A_log, dt_bias, cu = args
    return q, k, g, beta, A_log + 0.0 * workspace.reshape(-1)[0].astype(jnp.float32), dt_bias, cu


def programs(x: dict, T: int, H: int, Hk: int, numerics: str):
    """{variant: (fn, args)}: fn(q, k, g, beta, A_log, dt_bias, cu) -> the workspace."""
    G = H // Hk

    def problem(qk_heads):
        return Problem(batch=1, seqlen=T, heads=H, num_seqs=1, varlen=True,
                       state_dtype=np.dtype(np.float32), scale=contract.HEAD_DIM**-0.5,
                       lower_bound=-5.0, numerics=numerics, qk_heads=qk_heads)

    def prepare(qk_heads):
        def fn(q, k, g, beta, A_log, dt_bias, cu):
            return _kernel_path.prepare_workspace(q, k, g, beta, A_log, dt_bias, cu,
                                                  problem=problem(qk_heads))
        return fn

    def repeat_then_prepare(q, k, g, beta, A_log, dt_bias, cu):
        return prepare(H)(jnp.repeat(q, G, axis=2), jnp.repeat(k, G, axis=2), g, beta, A_log,
                          dt_bias, cu)

    args = (x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["cu"])
    repeated = (jnp.repeat(x["q"], G, axis=2), jnp.repeat(x["k"], G, axis=2), *args[2:])
    return {"grouped": (prepare(Hk), args), "repeated": (prepare(H), repeated),
            "repeat+call": (repeat_then_prepare, args)}


def check_equal(progs: dict) -> bool:
    """Whether every variant writes the same workspace bits (they must)."""
    results = [np.asarray(jax.jit(fn)(*args)) for fn, args in progs.values()]
    return all(np.array_equal(results[0], r) for r in results[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="96:48,32:16", help="H:Hk pairs")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for pair in args.cases.split(","):
        H, Hk = (int(v) for v in pair.split(":"))
        x = make_inputs(rng, args.seqlen, H, Hk)
        for numerics in contract.NUMERICS:
            progs = programs(x, args.seqlen, H, Hk, numerics)
            equal = check_equal(progs)
            samplers = [timing.jax_sampler(fn, fn_args, _feedback, warmup=2, inner=4,
                                           min_chain_ms=20) for fn, fn_args in progs.values()]
            timings = dict(zip(progs, timing.interleave(samplers, args.repeats)))
            row = {"H": H, "Hk": Hk, "T": args.seqlen, "numerics": numerics,
                   "bitwise_equal": equal,
                   **{f"{v}_us": timings[v].median_us for v in VARIANTS},
                   "timings": {v: timings[v].summary() for v in VARIANTS}}
            rows.append(row)
            print(f"H={H} Hk={Hk} T={args.seqlen} {numerics}: " + ", ".join(
                f"{v} {row[f'{v}_us']:.1f} us" for v in VARIANTS) + f"; equal bits: {equal}",
                flush=True)
    print()
    print("| H | Hk | T | numerics | grouped (us) | repeated (us) | repeat + call (us) "
          "| repeated / grouped | repeat + call / grouped | same bits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g = r["grouped_us"]
        print(f"| {r['H']} | {r['Hk']} | {r['T']} | {r['numerics']} | {g:.1f} | "
              f"{r['repeated_us']:.1f} | {r['repeat+call_us']:.1f} | "
              f"{r['repeated_us'] / g:.2f}x | {r['repeat+call_us'] / g:.2f}x | "
              f"{'yes' if r['bitwise_equal'] else 'NO'} |")
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "repeats": args.repeats,
            "method": "jax_kda.bench.timing: jit chains of dependent calls, interleaved"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
