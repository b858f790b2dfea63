"""Reading results files of the bench command back, e.g. for notebooks/column_split.ipynb.

A folder such as benchmarks/results/ holds several runs, each its own JSON file, and runs differ
in what they timed: which cases, which variants (`recurrence:bv=128` in one, `bv=baseline` in
another), sometimes cut short. `load_runs` reads every results file of the bench command in a
folder (other JSON files there are skipped), and `merge` makes one table of them: for every
(case, variant) the newest successful measurement, labelled with the file it came from.
"""

from __future__ import annotations

import json
from pathlib import Path

from .report import SCHEMA

KIND_ORDER = ("prepare", "recurrence", "total", "reference")


def load_runs(folder, platform: str | None = "gpu") -> list[dict]:
    """Every results file of the bench command in folder (measured on platform, unless None),
    oldest first. Each is the file's JSON with its path added under "path"."""
    runs = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if not (isinstance(data, dict) and data.get("schema") == SCHEMA
                and isinstance(data.get("meta"), dict) and isinstance(data.get("results"), list)):
            continue
        if platform is not None and data["meta"].get("platform") != platform:
            continue
        runs.append(data | {"path": path})
    runs.sort(key=lambda run: (run["meta"].get("date_utc") or "", run["path"].name))
    return runs


def describe(run: dict) -> str:
    """One line about a run: file, device, date, what it timed."""
    meta = run["meta"]
    ok = [r for r in run["results"] if r.get("status") == "ok"]
    variants = list(dict.fromkeys(r["variant"] for r in ok))
    return (f"{run['path'].name}: {meta.get('device_kind')}, {meta.get('sm_count')} SMs, "
            f"{meta.get('date_utc')}, jax {meta.get('jax')}, {meta.get('repeats')} repetitions; "
            f"{len({r['case'] for r in ok})} cases x {len(variants)} variants")


def variant_order(variants) -> list[str]:
    """prepare, recurrence:bv=16 ... 128, baseline, auto, total:..., reference, then the rest
    (fla, flashkda) in the order given."""
    variants = list(dict.fromkeys(variants))

    def key(v: str):
        kind, _, bv = v.partition(":bv=")
        rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
        bv_rank = (int(bv) if bv.isdigit() else {"baseline": 10_000, "auto": 10_001}.get(bv, -1))
        return (rank, variants.index(v) if rank == len(KIND_ORDER) else 0, bv_rank, v)

    return sorted(variants, key=key)


def merge(runs: list[dict]) -> dict:
    """One results dict (like a results file) from several runs of one device kind: the newest
    run's device, and for every (case, variant) the newest successful measurement (else the
    newest row), each with "source" = its file name. Ratios of the files (each vs its own
    baseline) are dropped. Runs on another device kind than the newest run's are left out and
    listed in meta["left_out"]."""
    if not runs:
        raise ValueError("no runs to merge")
    runs = sorted(runs, key=lambda run: run["meta"].get("date_utc") or "")
    device = runs[-1]["meta"].get("device_kind")
    used = [run for run in runs if run["meta"].get("device_kind") == device]
    cells: dict[tuple[str, str], dict] = {}
    cases: dict[str, dict] = {}
    for run in used:  # oldest first: a newer row replaces an older one
        for c in run.get("cases") or []:
            cases.setdefault(c["name"], c)
        for r in run["results"]:
            key = (r["case"], r["variant"])
            old = cells.get(key)
            if old is None or r.get("status") == "ok" or old.get("status") != "ok":
                row = {k: v for k, v in r.items() if k != "ratio_vs_baseline"}
                cells[key] = row | {"source": run["path"].name}
            if r["case"] not in cases:  # a run cut short may list fewer cases than it timed
                cases[r["case"]] = {k: r[k] for k in ("seq_lens", "heads", "layout", "num_seqs",
                                                      "tokens") if k in r} | {"name": r["case"]}
    # cases of one shape group together (heads descending), groups in order of first appearance
    groups = list(dict.fromkeys(_shape(c) for c in cases.values()))
    ordered = sorted(cases.values(), key=lambda c: (groups.index(_shape(c)), -c.get("heads", 0)))
    meta = dict(runs[-1]["meta"]) | {
        "variants": variant_order(r["variant"] for r in cells.values()),
        "baseline": None,
        "sources": [run["path"].name for run in used],
        "left_out": [run["path"].name for run in runs if run not in used],
    }
    return {"schema": SCHEMA, "meta": meta, "cases": ordered, "results": list(cells.values())}


def _shape(case: dict) -> tuple:
    return (tuple(case.get("seq_lens", ())), case.get("layout"))


def sweep(data: dict, variant: str, shape: tuple) -> tuple[list[int], list[float]]:
    """(heads, median us) of one variant over the cases of one shape (seq_lens, layout)."""
    rows = [r for r in data["results"] if r["variant"] == variant and r.get("status") == "ok"
            and (tuple(r.get("seq_lens", ())), r.get("layout")) == shape]
    rows.sort(key=lambda r: r["heads"])
    return [r["heads"] for r in rows], [r["median_us"] for r in rows]


def widest_sweep(data: dict) -> tuple | None:
    """The shape (seq_lens, layout) measured at the most head counts, ties to the first listed
    (None when nothing was measured)."""
    heads: dict[tuple, set] = {}
    for c in data["cases"]:
        heads.setdefault(_shape(c), set())
    for r in data["results"]:
        if r.get("status") == "ok":
            heads.setdefault((tuple(r.get("seq_lens", ())), r.get("layout")), set()).add(r["heads"])
    shapes = [s for s in heads if heads[s]]
    return max(shapes, key=lambda s: len(heads[s])) if shapes else None


def per_head_baseline(variants, kind: str) -> str | None:
    """The one-CTA-per-head variant of kind ("recurrence" or "total") among variants: the baseline
    kernel (bv=baseline) when timed, else the column-split kernel at block_v 128, else None."""
    for bv in ("baseline", "128"):
        if f"{kind}:bv={bv}" in variants:
            return f"{kind}:bv={bv}"
    return None


def provenance(data: dict, runs: list[dict]) -> list[str]:
    """Two lines per run merged into data: describe(run), then what the merge took from it."""
    lines = []
    for run in runs:
        name = run["path"].name
        rows = [r for r in data["results"] if r.get("source") == name]
        cases = [c["name"] for c in data["cases"] if any(r["case"] == c["name"] for r in rows)]
        lines.append(describe(run))
        if name in data["meta"].get("left_out", []):
            lines.append("    left out: measured on another device kind")
        elif rows:
            lines.append(f"    used: {len(rows)} measurements ({', '.join(cases)})")
        else:
            lines.append("    used: nothing (newer runs measured all of its cases and variants)")
    return lines
