"""What a benchmark run leaves behind: a table on stdout, JSON, CSV and a PNG plot."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

SCHEMA = "jax_kda.bench/1"
CSV_FIELDS = (
    "case", "variant", "kind", "block_v", "block_v_used", "heads", "num_seqs", "tokens", "layout",
    "seq_lens", "status", "median_us", "min_us", "p20_us", "p80_us", "mean_us", "repeats", "inner",
    "ratio_vs_baseline", "timer", "error",
)


def add_ratios(results: list[dict], baseline: str | None) -> None:
    """ratio_vs_baseline = baseline median / variant median in the same case (> 1: faster)."""
    base = {r["case"]: r["median_us"] for r in results
            if r["variant"] == baseline and r["status"] == "ok"}
    for r in results:
        b = base.get(r["case"])
        ok = r["status"] == "ok" and b is not None and r["median_us"] > 0
        r["ratio_vs_baseline"] = b / r["median_us"] if ok else None


def write_json(path: Path, meta: dict, cases: list[dict], results: list[dict]) -> None:
    path.write_text(json.dumps({"schema": SCHEMA, "meta": meta, "cases": cases,
                                "results": results}, indent=1) + "\n")


def write_csv(path: Path, results: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in results:
            row = dict(r)
            row["seq_lens"] = " ".join(map(str, r.get("seq_lens", [])))
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] != "ok":
        return r["status"]
    text = f"{r['median_us']:.1f}"
    if r.get("ratio_vs_baseline") is not None:
        text += f" ({r['ratio_vs_baseline']:.2f}x)"
    return text


def format_table(cases: list[dict], variants: list[str], results: list[dict], baseline) -> str:
    """Cases as rows, variants as columns: median us per call (speedup vs the baseline)."""
    by_key = {(r["case"], r["variant"]): r for r in results}
    header = ["case"] + variants
    rows = [[c["name"]] + [_cell(by_key.get((c["name"], v))) for v in variants] for c in cases]
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]

    def line(cells):
        return "  ".join(cell.rjust(w) if i else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths)))

    out = [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
    note = "median us per call"
    if baseline:
        note += f"; (Nx) = {baseline} time / this time, > 1 is faster"
    out.append(note)
    problems = [r for r in results if r["status"] != "ok"]
    for reason in sorted({r.get("error") or r["status"] for r in problems}):
        names = sorted({r["variant"] for r in problems if (r.get("error") or r["status"]) == reason})
        out.append(f"not timed ({', '.join(names)}): {reason}")
    return "\n".join(out)


def write_plot(path: Path, cases: list[dict], variants: list[str], results: list[dict],
               baseline: str | None, title: str) -> str | None:
    """Grouped bars: median time per case and variant (log scale), and speedup vs the baseline.
    Returns None when written, else why not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"matplotlib is not importable ({err}); no plot written"
    by_key = {(r["case"], r["variant"]): r for r in results if r["status"] == "ok"}
    shown = [v for v in variants if any((c["name"], v) in by_key for c in cases)]
    names = [c["name"] for c in cases]
    has_ratio = baseline is not None and any(
        r.get("ratio_vs_baseline") is not None for r in by_key.values())
    fig, axes = plt.subplots(2 if has_ratio else 1, 1, squeeze=False,
                             figsize=(max(6.0, 1.1 * len(names) * max(1, len(shown)) ** 0.5 + 3), 7 if has_ratio else 4))
    width = 0.8 / max(len(shown), 1)
    for panel, key in enumerate(["median_us", "ratio_vs_baseline"][: 2 if has_ratio else 1]):
        ax = axes[panel][0]
        for i, v in enumerate(shown):
            xs, ys = [], []
            for j, name in enumerate(names):
                r = by_key.get((name, v))
                if r is not None and r.get(key) is not None and math.isfinite(r[key]):
                    xs.append(j + (i - (len(shown) - 1) / 2) * width)
                    ys.append(r[key])
            ax.bar(xs, ys, width=width, label=v)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        if key == "median_us":
            ax.set_ylabel("median time per call (us)")
            ax.set_yscale("log")
            ax.set_title(title)
            ax.legend(fontsize=7, ncol=min(4, max(len(shown), 1)))
        else:
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_ylabel(f"speedup vs {baseline}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
