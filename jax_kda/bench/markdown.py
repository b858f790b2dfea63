"""Markdown tables from a results file of the bench command, for BENCHMARKS.md and the README.

    python -m jax_kda.bench.markdown benchmarks/results/<run>.json

Prints one table per group of cases: a heads sweep (cases differing only in heads) as one table
with heads as rows, the remaining cases as one table with cases as rows; columns are the variants
that were timed, cells the median time in microseconds (and, for the non-baseline variants, the
speedup vs the run's baseline).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def _cell(r: dict | None, with_ratio: bool) -> str:
    if r is None or r.get("status") != "ok":
        return "-" if r is None else r.get("status", "-")
    text = f"{r['median_us']:.0f}" if r["median_us"] >= 100 else f"{r['median_us']:.1f}"
    ratio = r.get("ratio_vs_baseline")
    if with_ratio and ratio is not None:
        text += f" ({ratio:.2f}x)"
    return text


def tables(data: dict) -> str:
    meta, cases, results = data["meta"], data["cases"], data["results"]
    variants = [v for v in meta["variants"] if any(r["variant"] == v and r["status"] == "ok"
                                                   for r in results)]
    by_key = {(r["case"], r["variant"]): r for r in results}
    baseline = meta.get("baseline")
    groups: dict[tuple, list[dict]] = {}
    for c in cases:
        groups.setdefault((tuple(c["seq_lens"]), c["layout"]), []).append(c)
    sweeps = {k: v for k, v in groups.items() if len(v) > 1}
    rest = [c for k, v in groups.items() if k not in sweeps for c in v]

    def table(first: str, rows: list[tuple[str, dict]]) -> list[str]:
        lines = [f"| {first} | " + " | ".join(variants) + " |",
                 "|---" * (len(variants) + 1) + "|"]
        for label, c in rows:
            cells = [_cell(by_key.get((c["name"], v)), v != baseline) for v in variants]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        return lines

    out = [f"{meta['device_kind']} ({meta.get('sm_count')} SMs), {meta['date_utc'][:10]}, jax "
           f"{meta.get('jax')}, inverse={meta.get('inverse')}: median us per call over "
           f"{meta.get('repeats')} repetitions" +
           (f"; (Nx) = speedup vs {baseline}" if baseline else "") + ".", ""]
    for (lens, layout), cs in sweeps.items():
        what = f"T = {lens[0]}" if len(lens) == 1 else f"{layout} {list(lens)}"
        out.append(f"{what}, heads sweep:")
        out.append("")
        out += table("heads", [(str(c["heads"]), c) for c in sorted(cs, key=lambda c: -c["heads"])])
        out.append("")
    if rest:
        out += table("case", [(c["name"], c) for c in rest])
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_kda.bench.markdown", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=pathlib.Path,
                   help="a JSON file written by python -m jax_kda.bench")
    args = p.parse_args(argv)
    sys.stdout.write(tables(json.loads(args.results.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
