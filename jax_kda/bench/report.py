"""What a benchmark run leaves behind: a table on stdout, JSON, CSV and a PNG plot."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

SCHEMA = "jax_kda.bench/1"
CSV_FIELDS = (
    "case", "variant", "kind", "numerics", "block_v", "block_v_used", "heads", "num_seqs", "tokens",
    "layout", "seq_lens", "status", "median_us", "min_us", "p20_us", "p80_us", "mean_us", "repeats",
    "inner", "ratio_vs_baseline", "timer", "error",
    # decode cases
    "state_dtype", "tokens_per_seq", "pool_rows", "floor_us", "achieved_tb_s",
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


def format_table(cases: list[dict], variants: list[str], results: list[dict], baseline,
                 split_header: bool = False) -> str:
    """Cases as rows, variants as columns: median us per call (speedup vs the baseline).

    split_header: write each "kind:bv=N" variant name over two header lines ("kind", "bv=N"),
    which keeps the columns narrow when there are many variants."""
    by_key = {(r["case"], r["variant"]): r for r in results}
    if split_header:
        parts = [v.split(":", 1) if ":" in v else [v, ""] for v in variants]
        headers = [["case"] + [p[0] for p in parts], [""] + [p[1] for p in parts]]
    else:
        headers = [["case"] + variants]
    rows = [[c["name"]] + [_cell(by_key.get((c["name"], v))) for v in variants] for c in cases]
    widths = [max(len(row[i]) for row in headers + rows) for i in range(len(variants) + 1)]

    def line(cells):
        return "  ".join(cell.rjust(w) if i else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(h) for h in headers] + [line(["-" * w for w in widths])] + [line(r) for r in rows]
    note = "median us per call"
    if baseline:
        note += f"; (Nx) = {baseline} time / this time, > 1 is faster"
    out.append(note)
    problems = [r for r in results if r["status"] != "ok"]
    for reason in sorted({r.get("error") or r["status"] for r in problems}):
        names = sorted({r["variant"] for r in problems
                        if (r.get("error") or r["status"]) == reason})
        out.append(f"not timed ({', '.join(names)}): {reason}")
    return "\n".join(out)


def points_per_axes(fig) -> list[int]:
    """How many data points each axes of a matplotlib figure shows: the finite points of its
    lines, its bars (rectangles of non-zero size) and the points of its collections (scatter).
    Reference lines (axhline, axvline) and text do not count."""
    counts = []
    for ax in fig.axes:
        n = 0
        for ln in ax.get_lines():
            if ln.get_transform().contains_branch(ax.transData):
                n += sum(1 for x, y in zip(ln.get_xdata(), ln.get_ydata())
                         if _finite(x) and _finite(y))
        for patch in ax.patches:
            w, h = getattr(patch, "get_width", None), getattr(patch, "get_height", None)
            if w is not None and h is not None and _finite(w()) and _finite(h()) and w() and h():
                n += 1
        for coll in ax.collections:
            n += len(coll.get_offsets())
        counts.append(n)
    return counts


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def make_figure(cases: list[dict], variants: list[str], results: list[dict],
                baseline: str | None, title: str):
    """The figure of a run, or None when nothing was measured.

    One case: a horizontal bar per variant (median time, annotated with the speedup vs the
    baseline). Several cases: grouped bars of the median time per case (log scale) and, when
    some variant other than the baseline has a speedup, grouped bars of the speedups. Only
    variants and cases with a measurement get a bar, so no panel is empty."""
    import matplotlib.pyplot as plt

    by_key = {(r["case"], r["variant"]): r for r in results if r["status"] == "ok"
              and _finite(r.get("median_us")) and r["median_us"] > 0}
    names = [c["name"] for c in cases if any((c["name"], v) in by_key for v in variants)]
    shown = [v for v in variants if any((n, v) in by_key for n in names)]
    if not shown:
        return None
    colors = {v: f"C{i % 10}" for i, v in enumerate(shown)}

    def speedup(name, v):  # baseline median / this median, None where either is missing
        b = by_key.get((name, baseline))
        if not b or (name, v) not in by_key:
            return None
        return b["median_us"] / by_key[(name, v)]["median_us"]

    if len(names) == 1:
        name = names[0]
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(shown)))
        medians = [by_key[(name, v)]["median_us"] for v in shown]
        ys = range(len(shown))
        ax.barh(ys, medians, color=[colors[v] for v in shown])
        for y, v, us in zip(ys, shown, medians):
            ratio = speedup(name, v)
            note = f" {us:.1f} us"
            if v == baseline:
                note += " (baseline)"
            elif ratio is not None:
                note += f" ({ratio:.2f}x vs baseline)"
            ax.text(us, y, note, va="center", fontsize=8)
        ax.set_yticks(list(ys))
        ax.set_yticklabels(shown, fontsize=8)
        ax.invert_yaxis()  # the first variant on top
        ax.set_xlim(0, max(medians) * 1.45)  # room for the notes
        ax.set_xlabel("median time per call (us)")
        ax.set_title(f"{title}\n{name}" + (f"; speedup vs {baseline}, > 1 is faster"
                                            if baseline in shown else ""), fontsize=10)
        fig.tight_layout()
        return fig

    ratios = {v: [speedup(n, v) for n in names] for v in shown if v != baseline}
    ratios = {v: rs for v, rs in ratios.items() if any(r is not None for r in rs)}
    panels = [("median_us", shown)] + ([("ratio", list(ratios))] if ratios else [])
    bars = len(names) * len(shown)
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, sharex=True,
                             figsize=(min(16.0, max(7.0, 0.3 * bars + 4)), 1.5 + 3.2 * len(panels)))
    for ax, (key, vs) in zip(axes[:, 0], panels):
        width = 0.8 / len(vs)
        for i, v in enumerate(vs):
            values = ([by_key[(n, v)]["median_us"] if (n, v) in by_key else None for n in names]
                      if key == "median_us" else ratios[v])
            offset = (i - (len(vs) - 1) / 2) * width
            xs = [j + offset for j, y in enumerate(values) if y is not None]
            ys = [y for y in values if y is not None]
            if key == "median_us":
                ax.bar(xs, ys, width=width, label=v, color=colors[v])
            else:  # from 1 up (faster) or down (slower)
                ax.bar(xs, [y - 1.0 for y in ys], bottom=1.0, width=width, label=v,
                       color=colors[v])
        ax.set_yscale("log")  # times over orders of magnitude; speedups < 1 and > 1 alike
        _plain_log_ticks(ax)
        ax.grid(axis="y", which="major", linewidth=0.4, alpha=0.5)
        if key == "median_us":
            ax.set_ylabel("median time per call (us)")
            ax.set_title(title, fontsize=10)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_ylabel(f"speedup vs {baseline}\n(> 1: faster)", fontsize=9)
    ax = axes[-1, 0]
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    return fig


def _plain_log_ticks(ax) -> None:
    """Log-scale y tick labels as plain numbers (300, 0.9), minor ones too within a decade."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda y, _: f"{y:g}")
    lo, hi = ax.get_ylim()
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain if hi < 10 * lo else NullFormatter())


def write_plot(path: Path, cases: list[dict], variants: list[str], results: list[dict],
               baseline: str | None, title: str) -> str | None:
    """Writes make_figure's figure as a PNG. Returns None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"matplotlib is not importable ({err}); no plot written"
    fig = make_figure(cases, variants, results, baseline, title)
    if fig is None:
        return "no variant was measured; no plot written"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
