"""Every notebook runs top to bottom on CPU (nbclient), and none is committed with outputs."""

from __future__ import annotations

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _execute(path: pathlib.Path, monkeypatch, **env) -> nbformat.NotebookNode:
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # CI is CPU-only; the notebooks pick the reference
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    return nb


def _outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells
               for out in cell.get("outputs", []))


def test_the_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "column_split.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    stale = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not stale, f"{path.name}: cells {stale} hold outputs; strip them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_runs_top_to_bottom_on_cpu(path, monkeypatch, tmp_path):
    empty = tmp_path / "no_results"
    empty.mkdir()
    nb = _execute(path, monkeypatch, JAX_KDA_BENCH_RESULTS=str(empty))
    text = _outputs_text(nb)
    assert "Traceback" not in text
    if path.name == "column_split.ipynb":
        assert "No GPU benchmark results found" in text  # says so instead of failing


def _synthetic_gpu_results(folder: pathlib.Path) -> None:
    """A results file shaped like a GPU run of the bench command (made-up numbers, test only)."""
    from jax_kda.bench import report

    heads = [6, 12, 24]
    cases = [{"name": f"T8192_H{h}", "seq_lens": [8192], "heads": h, "layout": "batched",
              "num_seqs": 1, "tokens": 8192} for h in heads]
    variants = ["recurrence:bv=128", "recurrence:bv=auto", "total:bv=128", "total:bv=auto", "fla"]
    results = []
    for c in cases:
        for i, v in enumerate(variants):
            results.append({"case": c["name"], "variant": v, "kind": v.split(":")[0],
                            "status": "ok", "median_us": 100.0 + 10 * i + c["heads"],
                            "seq_lens": c["seq_lens"], "layout": "batched", "heads": c["heads"]})
    meta = {"platform": "gpu", "device_kind": "synthetic GPU", "sm_count": 132,
            "date_utc": "2000-01-01T00:00:00+00:00", "jax": "x", "repeats": 20,
            "variants": variants}
    report.write_json(folder / "synthetic.json", meta, cases, results)


def test_column_split_plots_committed_results(monkeypatch, tmp_path):
    """The plotting cells work on a results file of the bench command's format."""
    _synthetic_gpu_results(tmp_path)
    nb = _execute(ROOT / "notebooks" / "column_split.ipynb", monkeypatch,
                  JAX_KDA_BENCH_RESULTS=str(tmp_path))
    text = _outputs_text(nb)
    assert "synthetic.json: synthetic GPU" in text
    assert "T8192_H24" in text  # the table of every case
    assert _images(nb) >= 2  # the SM-occupancy figure and the measured-results figure
