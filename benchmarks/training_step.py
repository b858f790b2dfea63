"""Forward + backward of one loss through kda_prefill, beside its forward alone and (where
importable) jax-linear-attention's, in one process on the same inputs.

    python benchmarks/training_step.py --heads 96,12,6 --seqlen 8192 --out training.json
    python benchmarks/training_step.py --heads 32 --seqlen 8192 --packed 8   # 8 x 1024 packed

Each variant is one jitted chain of R calls (jax_kda.bench.timing: R grows until a chain takes
>= 5 ms, dispatch amortised), each call's A_log depending on the previous call's results so that
XLA can neither merge nor drop calls. The loss is sum(out * w_out) + sum(final_state * w_state)
with fixed random weights; "train" is jax.value_and_grad of it w.r.t. q, k, v, g, beta, A_log,
dt_bias and the initial state; "forward" is the loss alone; "backward" is jax.grad alone (the loss
value unused, so XLA drops the forward: the backward's own time; both numerics modes share it).
--packed N: N sequences of T / N tokens packed with cu_seqlens (B = 1; jla is left out, it takes
no cu_seqlens). jla's gate and beta sigmoid are computed in JAX inside the differentiated function
(jla takes them applied), so its A_log and dt_bias gradients come from JAX autodiff of that glue.
Strong-decay inputs as the bench's baselines (jax_kda.bench.inputs). Medians of --repeats
samples, microseconds.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import platform

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda.bench import timing, training
from jax_kda.bench.training import feedback

LOWER_BOUND = -5.0
SCALE = 128**-0.5


def write_rows(path, rows) -> None:
    """The measured rows as JSON, with the device, jax version and host they were taken on."""
    meta = {"device": str(jax.devices()[0]), "jax": jax.__version__, "host": platform.node()}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def make_inputs(rng, T, H, N=1):
    bf = lambda *s, scale=1.0: jnp.asarray(scale * rng.standard_normal(s), jnp.bfloat16)
    return {
        "q": bf(1, T, H, 128), "k": bf(1, T, H, 128), "v": bf(1, T, H, 128),
        "g": bf(1, T, H, 128, scale=3.0), "beta": bf(1, T, H),
        "A_log": jnp.asarray(rng.uniform(0, 1, H), jnp.float32),
        "dt_bias": jnp.asarray(rng.uniform(0, 1, (H, 128)), jnp.float32),
        "state": jnp.asarray(0.1 * rng.standard_normal((N, H, 128, 128)), jnp.float32),
    }


def packed_cu_seqlens(T, N):
    """cu_seqlens of N sequences of T / N tokens (None for one)."""
    return None if N == 1 else jnp.arange(N + 1, dtype=jnp.int32) * (T // N)


def _options(cu):
    """kda_prefill's options here (jla's loss reads scale and lower_bound of them)."""
    return {"lower_bound": LOWER_BOUND, "scale": SCALE} | ({} if cu is None else {"cu_seqlens": cu})


def variants(weights, cu):
    found = {}
    for numerics in ("flashkda", "fp32"):
        loss = functools.partial(training.kda_prefill_loss, numerics, weights, _options(cu))
        found[f"forward:{numerics}"] = loss
        found[f"train:{numerics}"] = jax.value_and_grad(loss)
    found["backward"] = jax.grad(functools.partial(training.kda_prefill_loss, "flashkda", weights,
                                                   _options(cu)))
    if cu is not None:
        return found  # jla's kda takes no packed sequences
    try:
        kda = importlib.import_module("jla.ops.mosaic_gpu.kda").kda
    except Exception as err:  # noqa: BLE001 - an absent peer is reported, not fatal
        print(f"jla not importable: {type(err).__name__}: {err}")
    else:
        found["train:jla"] = jax.value_and_grad(functools.partial(training.jla_loss, kda, weights,
                                                                  _options(None)))
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="96,12,6")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--packed", type=int, default=1, help="sequences packed in --seqlen tokens")
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for H in (int(h) for h in args.heads.split(",")):
        rng = np.random.default_rng(H)
        x = make_inputs(rng, args.seqlen, H, args.packed)
        weights = (jnp.asarray(rng.standard_normal((1, args.seqlen, H, 128)), jnp.float32),
                   jnp.asarray(rng.standard_normal((args.packed, H, 128, 128)), jnp.float32))
        for name, fn in variants(weights, packed_cu_seqlens(args.seqlen, args.packed)).items():
            if args.only and name not in args.only.split(","):
                continue
            try:
                t = timing.time_jax(fn, (x,), feedback, repeats=args.repeats, warmup=2,
                                    inner=4, min_chain_ms=5.0)
            except Exception as err:  # noqa: BLE001 - one failing variant does not stop the rest
                print(f"T={args.seqlen} H={H} {name}: FAILED {type(err).__name__}: {err}")
                rows.append({"heads": H, "seqlen": args.seqlen, "variant": name,
                             "error": f"{type(err).__name__}: {err}"})
                continue
            row = {"heads": H, "seqlen": args.seqlen, "packed": args.packed, "variant": name,
                   **t.summary()}
            rows.append(row)
            print(f"T={args.seqlen} H={H} {name}: {t.median_us:.1f} us ({t.method})", flush=True)
    print("\n| heads | " + " | ".join(sorted({r["variant"] for r in rows})) + " |")
    for H in sorted({r["heads"] for r in rows}, reverse=True):
        cells = {r["variant"]: r.get("median_us") for r in rows if r["heads"] == H}
        print(f"| {H} | " + " | ".join("-" if cells.get(v) is None else f"{cells[v]:.0f}"
                                      for v in sorted(cells)) + " |")
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
