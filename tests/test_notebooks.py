"""Every notebook runs top to bottom on CPU (nbclient), and none is committed with outputs."""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


# Run before the notebook's own cells: every plt.show() records, for each open figure, how many
# data points each of its axes shows (jax_kda.bench.report.points_per_axes), and the last cell
# prints the record as one JSON line after FIGURE_POINTS_MARK.
FIGURE_POINTS_MARK = "points per axes of every figure shown:"
_RECORD_FIGURES = """
import matplotlib.pyplot as _plt
from jax_kda.bench.report import points_per_axes as _points_per_axes
_figure_points, _plt_show = [], _plt.show
def _recording_show(*args, **kwargs):
    _figure_points.extend(_points_per_axes(_plt.figure(n)) for n in _plt.get_fignums())
    return _plt_show(*args, **kwargs)
_plt.show = _recording_show
"""
_PRINT_FIGURES = f"import json as _json; print({FIGURE_POINTS_MARK!r}, _json.dumps(_figure_points))"


def _execute(path: pathlib.Path, monkeypatch, **env) -> nbformat.NotebookNode:
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # CI is CPU-only; the notebooks pick the reference
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    nb = nbformat.read(path, as_version=4)
    nb.cells = ([nbformat.v4.new_code_cell(_RECORD_FIGURES)] + nb.cells
                + [nbformat.v4.new_code_cell(_PRINT_FIGURES)])
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    return nb


def _figure_points(nb) -> list[list[int]]:
    """Per figure the notebook showed, the data points of each axes; checks that no figure was
    displayed without going through plt.show (which would escape the record)."""
    line = next(ln for ln in _outputs_text(nb).splitlines() if ln.startswith(FIGURE_POINTS_MARK))
    figures = json.loads(line[len(FIGURE_POINTS_MARK):])
    assert len(figures) == _images(nb), (figures, _images(nb))
    return figures


def _assert_every_axes_has_data(nb) -> list[list[int]]:
    figures = _figure_points(nb)
    empty = [(i, j) for i, axes in enumerate(figures) for j, n in enumerate(axes) if n == 0]
    assert not empty, f"(figure, axes) without data: {empty}; points per axes: {figures}"
    return figures


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
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "column_split.ipynb",
                                           "serving.ipynb", "training.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    stale = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not stale, f"{path.name}: cells {stale} hold outputs; strip them before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_runs_top_to_bottom_on_cpu(path, monkeypatch, tmp_path):
    empty = tmp_path / "no_results"
    empty.mkdir()
    # JAX_KDA_NOTEBOOK_SHORT: training.ipynb's short run (the full one takes minutes on a CPU)
    nb = _execute(path, monkeypatch, JAX_KDA_BENCH_RESULTS=str(empty), JAX_KDA_NOTEBOOK_SHORT="1")
    text = _outputs_text(nb)
    assert "Traceback" not in text
    figures = _assert_every_axes_has_data(nb)
    if path.name == "column_split.ipynb":
        assert "No GPU benchmark results found" in text  # says so instead of failing
        assert len(figures) == 1  # the SM-occupancy figure only
    if path.name == "serving.ipynb":
        _assert_serving_held(text)
    if path.name == "training.ipynb":
        _assert_training_held(text, figures)


def _assert_serving_held(text: str) -> None:
    """What serving.ipynb proves: (a) a checkpoint found by checkpoint_offsets is bitwise a
    shorter prefill's state, in every layer; (b) the greedy decode loop ran on the pool, updated
    in place, free slots untouched; (c) token-by-token decode reached the prefill's states."""
    assert "backend='auto' runs: the pure-JAX reference" in text  # CPU
    assert "offsets: [0, 2, 3, 6]" in text  # (40-1)//16, (23-1)//16, (57-1)//16 checkpoints
    assert "per layer: [True, True]" in text and "checkpoint == prefill: True" in text
    decoded = re.findall(r"request (\d) \(slot (\d)\): \.\.\.\[[\d, ]+\] -> \[([\d, ]+)\]", text)
    assert [(r, s) for r, s, _ in decoded] == [("0", "3"), ("1", "0"), ("2", "4")], decoded
    assert all(len(tokens.split(",")) == 8 for _, _, tokens in decoded)
    assert "pool updated in place: True" in text and "free slots untouched: True" in text
    errors = re.search(r"relative RMSE of the final states, per layer: ([-+.e\d, ]+) \(bound "
                       r"1e-02\)", text)
    assert errors, text
    assert all(0 < float(e) <= 1e-2 for e in errors.group(1).split(","))
    assert "token by token == prefill within the bound: True" in text


def _assert_training_held(text: str, figures: list[list[int]]) -> None:
    """What training.ipynb's short run shows on a CPU: one run, backend='auto' on the reference,
    whose loss curve and accuracy curve have a point per step, and whose loss falls. The first
    loss is about log(128) = 4.85 (the unembedding starts small); telling values from keys alone
    brings it to log(64) = 4.16 (the recall itself needs more steps than the short run takes)."""
    assert "trains with backend='auto' only, which runs the pure-JAX reference here" in text
    assert "run: short" in text
    steps = int(re.search(r"(\d+) batches of \d+ sequences of T = \d+ tokens", text).group(1))
    assert 10 <= steps <= 100, steps
    assert figures == [[steps, steps]], figures  # loss and accuracy per step, one run each
    losses = re.search(r"training loss, mean of the first 5 steps: ([-+.\deinfa]+); of the last "
                       r"5 steps: ([-+.\deinfa]+)", text)
    assert losses, text
    first, last = float(losses.group(1)), float(losses.group(2))
    assert 4.5 < first < 5.2, (first, last)  # about log(128): the model starts uninformed
    assert last < first - 0.3, (first, last)  # nan fails both
    accuracy = re.search(r"recall accuracy on 256 fresh sequences: ([.\d]+)", text)
    assert accuracy and 0.0 <= float(accuracy.group(1)) <= 1.0, text


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
    _, measured = _assert_every_axes_has_data(nb)  # the SM-occupancy figure, the measured one
    # recurrence alone, both kernels vs others, the speedup of bv=auto over bv=128 (no
    # bv=baseline in this file), each over the 3 head counts
    assert measured == [6, 9, 6], measured


def _table_header(text: str) -> tuple[list[str], list[str]]:
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if re.match(r"case\s+prepare\s", ln))
    return lines[i].split(), lines[i + 1].split()


def test_column_split_reads_the_committed_h200_results(monkeypatch):
    """The notebook as a reader runs it, on the committed results files: runs that name the
    per-head baseline bv=baseline or bv=128 and hold different cases and variants merge into one
    figure whose every panel has data, and a table of every case whose columns stay apart."""
    from jax_kda.bench.results import load_runs, merge

    runs = load_runs(ROOT / "benchmarks" / "results")
    if not runs:
        pytest.skip("no committed GPU results files of the bench command")
    nb = _execute(ROOT / "notebooks" / "column_split.ipynb", monkeypatch,
                  JAX_KDA_BENCH_RESULTS=None)
    text = _outputs_text(nb)
    assert "No GPU benchmark results found" not in text
    figures = _assert_every_axes_has_data(nb)
    assert len(figures) == 2 and len(figures[1]) == 3, figures  # 3 panels of the measurements
    assert min(figures[1]) >= 2, figures  # a sweep over heads, not one point per panel

    data = merge(runs)
    for case in data["cases"]:
        assert case["name"] in text
    kinds, bvs = _table_header(text)
    variants = data["meta"]["variants"]
    assert kinds == ["case"] + [v.split(":")[0] for v in variants], kinds
    assert bvs == [v.split(":", 1)[1] for v in variants if ":" in v], bvs
