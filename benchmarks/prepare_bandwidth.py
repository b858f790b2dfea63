"""How close the prepare kernels stream to the device's copy rate, in one process.

For each case: the prepare custom call alone (both numerics modes) and device copies of the same
byte count (read + written: q, k, g, beta in, the workspace out; see copy_rates), medians
(jax_kda.bench.timing). Reports bytes, TB/s and the fraction of the fastest copy's rate.

  python benchmarks/prepare_bandwidth.py --out prepare_bandwidth.json [--heads 96,48,12]
      [--seqlen 8192] [--mix 1024x8]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda import contract
from jax_kda.bench import inputs, jax_variants, timing
from jax_kda.bench.cases import Case

REPEATS = 10


def prepare_bytes(case: Case, numerics: str) -> int:
    """Bytes the prepare kernel reads (q, k, g, beta: bf16) and writes (one record per chunk)."""
    slots = sum(-(-n // contract.CHUNK) for n in case.seq_lens)  # batched or packed alike
    read = case.tokens * case.heads * (3 * contract.HEAD_DIM + 1) * 2
    return read + case.heads * slots * contract.record_bytes(numerics)


def copy_rates(nbytes: int) -> dict[str, float]:
    """Microseconds of two ways to move nbytes (half read, half written) on the device: an
    elementwise bf16 pass in XLA (a jit chain, a barrier between calls so that XLA does not fuse
    them; XLA elides a plain copy) and, where torch is installed, torch's device-to-device copy_
    (a CUDA graph of calls)."""
    x = jnp.ones((nbytes // 4,), jnp.bfloat16)
    rates = {"xla_elementwise": timing.time_jax(
        lambda a: a + jnp.bfloat16(1), (x,),
        lambda args, out: (jax.lax.optimization_barrier(out),), repeats=REPEATS, warmup=2, inner=4,
        min_chain_ms=20).median_us}
    try:
        import torch
    except ImportError:
        return rates
    if torch.cuda.is_available():
        src = torch.ones(nbytes // 4, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        rates["torch_copy"] = timing.time_torch(lambda: dst.copy_(src), repeats=REPEATS,
                                                warmup=2, inner=16).median_us
        del src, dst
    return rates


def prepare_us(case: Case, x: dict, numerics: str) -> float:
    fn, args, feedback, _ = jax_variants.build(jax_variants.Variant("prepare", numerics=numerics),
                                               case, x, inverse="stable")
    t = timing.time_jax(fn, args, feedback, repeats=REPEATS, warmup=2, inner=4, min_chain_ms=20)
    return t.median_us


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", default="96,48,24,12,6")
    ap.add_argument("--seqlen", default="8192")
    ap.add_argument("--mix", default="1024x8", help="NxM: M packed sequences of N tokens at 96 "
                    "and 12 heads ('' for none)")
    args = ap.parse_args()
    cases = [Case((int(t),), int(h)) for t in args.seqlen.split(",") for h in args.heads.split(",")]
    if args.mix:
        n, m = (int(v) for v in args.mix.split("x"))
        cases += [Case((n,) * m, h, layout="varlen") for h in (96, 12)]
    rows = []
    copy_cache: dict[int, dict[str, float]] = {}
    for case in cases:
        x = inputs.to_jax(inputs.make_inputs(case), case)
        for numerics in contract.NUMERICS:
            nbytes = prepare_bytes(case, numerics)
            if nbytes not in copy_cache:
                copy_cache[nbytes] = copy_rates(nbytes)
            copies = copy_cache[nbytes]
            fastest = min(copies, key=copies.get)
            us = prepare_us(case, x, numerics)
            row = {"case": case.name, "numerics": numerics, "bytes": nbytes, "prepare_us": us,
                   "copy_us": copies, "fastest_copy": fastest,
                   "prepare_tb_s": nbytes / us / 1e6,
                   "copy_tb_s": nbytes / copies[fastest] / 1e6}
            row["fraction_of_copy"] = row["prepare_tb_s"] / row["copy_tb_s"]
            rows.append(row)
            others = ", ".join(f"{k} {nbytes / v / 1e6:.2f}" for k, v in copies.items())
            print(f"{case.name:>16} {numerics:>8}: {nbytes / 1e9:6.3f} GB  prepare {us:8.1f} us "
                  f"({row['prepare_tb_s']:.2f} TB/s) = {100 * row['fraction_of_copy']:5.1f} % of "
                  f"the fastest copy (TB/s: {others})", flush=True)
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "repeats": REPEATS, "numpy": np.__version__}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
