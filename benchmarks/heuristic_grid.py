"""The launch-heuristic measurement: the recurrence alone, every block_v, heads x sequences.

T tokens per sequence (default 8192), N equal sequences packed (varlen layout, as the kernels see
every call). Inputs are drawn on the GPU with jax.random (host-side numpy would spend minutes on the
largest cases); the workspace comes from the prepare kernel once per (N, H). Each block_v is timed
as a jit chain of dependent calls (state fed forward), medians of --repeats samples, all in this
one process. Writes one JSON with every row plus what jax_kda._launch.choose_block_v picks.

  python benchmarks/heuristic_grid.py --out grid.json [--seqs 1,2,4,8] [--heads 1,2,...]
  python benchmarks/heuristic_grid.py --markdown grid.json   # the BENCHMARKS.md table (no GPU)
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from jax_kda import _launch
from jax_kda.bench import cases, jax_variants, timing

BLOCK_VS = (16, 32, 64, 128)
# The FlashKDA-structured kernel, timed alongside (--with-baseline) so a later heuristic can pick
# it.
BASELINE = jax_variants.BASELINE
HEADS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def device_inputs(key, num_seqs, seqlen, heads, total=None):
    """kda_prefill-layout inputs (B = 1, packed: num_seqs sequences of seqlen tokens, or `total`
    tokens in all), bf16 activations, realistic scales."""
    ks = jax.random.split(key, 8)
    T, D = total or num_seqs * seqlen, 128

    def unit(k_):  # L2-normalised rows, as a model's q/k
        x = jax.random.normal(k_, (1, T, heads, D), jnp.float32)
        return (x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True))).astype(jnp.bfloat16)

    return {
        "q": unit(ks[0]), "k": unit(ks[1]),
        "v": jax.random.normal(ks[2], (1, T, heads, D), jnp.bfloat16),
        "g": jax.random.normal(ks[3], (1, T, heads, D), jnp.bfloat16),
        "beta": jax.random.normal(ks[4], (1, T, heads), jnp.bfloat16),
        "A_log": jax.random.uniform(ks[5], (heads,), jnp.float32),
        "dt_bias": jax.random.uniform(ks[6], (heads, D), jnp.float32),
        "state": (0.05 * jax.random.normal(ks[7], (num_seqs, heads, D, D), jnp.float32)
                  ).astype(jnp.bfloat16),
    }


def markdown_table(path):
    """One row per (sequence lengths, H): median us per block_v, the fastest, and what
    choose_block_v picks now (with its time relative to the fastest)."""
    with open(path) as f:
        data = json.load(f)
    cells = {}
    for row in data["rows"]:
        lens = tuple(row.get("seq_lens") or [data["seqlen"]] * row["num_seqs"])
        cells.setdefault((lens, row["heads"]), {})[row["block_v"]] = row["median_us"]
    kinds = [bv for bv in (*BLOCK_VS, BASELINE) if any(bv in t for t in cells.values())]
    lines = ["| N | tokens each | H | " + " | ".join(f"bv={bv}" for bv in kinds)
             + " | fastest | heuristic (vs fastest) |",
             "|---|---|---|" + "---|" * (len(kinds) + 2)]
    for (lens, h), times in sorted(cells.items(), key=lambda c: (len(c[0][0]), c[0])):
        best = min(times, key=times.get)
        pick = _launch.choose_block_v(num_seqs=len(lens), heads=h, sm_count=data["sm_count"],
                                      numerics=data["rows"][0].get("numerics", "flashkda"),
                                      tokens=sum(lens))
        each = str(lens[0]) if len(set(lens)) == 1 else ", ".join(map(str, lens))
        lines.append(f"| {len(lens)} | {each} | {h} | "
                     + " | ".join(f"{times[bv]:.0f}" if bv in times else "" for bv in kinds)
                     + f" | {best} | {pick} ({times[pick] / times[best]:.2f}x) |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", metavar="GRID_JSON",
                   help="print the table of a measured grid and exit")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--seqs", default="1,2,4,8")
    p.add_argument("--mix", action="append", default=[], metavar="L1,L2,...",
                   help="also a packed mix of these sequence lengths (repeatable)")
    p.add_argument("--heads", default=",".join(map(str, HEADS)))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-chain-ms", type=float, default=3.0)
    p.add_argument("--out", default="heuristic_grid.json")
    p.add_argument("--with-baseline", action="store_true", help="also time recurrence=\"baseline\"")
    p.add_argument("--numerics", default="flashkda", choices=("flashkda", "fp32"),
                   help="the numerics mode whose recurrence is timed (fp32: no baseline kernel)")
    args = p.parse_args()
    if args.markdown:
        print(markdown_table(args.markdown))
        return

    ok, why = jax_variants.kernels_status()
    if not ok:
        raise SystemExit(why)
    device = jax.devices()[0]
    sms = _launch.gpu_sm_count()
    rows, started = [], time.time()
    lengths = [(args.seqlen,) * int(n) for n in args.seqs.split(",") if n]
    lengths += [cases.parse_int_list(mix, "--mix") for mix in args.mix]
    for seq_lens in lengths:
        num_seqs = len(seq_lens)
        for heads in map(int, args.heads.split(",")):
            case = cases.Case(tuple(seq_lens), heads, layout="varlen")
            x = device_inputs(jax.random.key(num_seqs * 1000 + heads), num_seqs, args.seqlen, heads,
                              total=sum(seq_lens))
            x["cu_seqlens"] = jnp.asarray(case.cu_seqlens(), jnp.int32)
            auto = _launch.choose_block_v(num_seqs=num_seqs, heads=heads, sm_count=sms,
                                          numerics=args.numerics, tokens=sum(seq_lens))
            for block_v in BLOCK_VS + ((BASELINE,) if args.with_baseline else ()):
                variant = jax_variants.Variant("recurrence", block_v, numerics=args.numerics)
                fn, fn_args, feedback, _ = jax_variants.build(variant, case, x, inverse="stable")
                t = timing.time_jax(fn, fn_args, feedback, repeats=args.repeats, warmup=2, inner=2,
                                    min_chain_ms=args.min_chain_ms)
                rows.append({"num_seqs": num_seqs, "heads": heads, "block_v": block_v,
                             "seq_lens": list(seq_lens),
                             "numerics": args.numerics,
                             "median_us": t.median_us, "summary": t.summary(), "auto": auto})
                del fn_args
            mine = [r for r in rows if r["seq_lens"] == list(seq_lens) and r["heads"] == heads]
            best = min(mine, key=lambda r: r["median_us"])
            cells = "  ".join(f"bv{r['block_v']}={r['median_us']:8.1f}" for r in mine)
            print(f"N={num_seqs} T={sum(seq_lens)} H={heads:3d}  {cells}  "
                  f"best bv{best['block_v']}  auto bv{auto}  [{time.time() - started:5.0f} s]",
                  flush=True)
            del x
            with open(args.out, "w") as f:  # after every (N, H): a timeout keeps what was measured
                json.dump({"device": str(device), "sm_count": sms, "seqlen": args.seqlen,
                           "jax": jax.__version__,
                           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
