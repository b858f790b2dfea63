"""The benchmark command on CPU with the reference at tiny shapes: outputs are well formed and
hold exactly the requested cases; kernel variants that cannot run here are recorded as skipped."""

from __future__ import annotations

import csv
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jax_kda.bench import cases, report, timing

REQUESTED = {"T40_H2", "T21_H2", "varlen[17,0,23]_H2"}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "jax_kda.bench", "--seqlen", "40,21", "--heads", "2",
           "--varlen", "17,0,23", "--variants", "reference,prepare", "--repeats", "3",
           "--warmup", "1", "--inner", "1", "--out", str(out), "--tag", "tiny"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    # a second, batched-vs-packed sweep in the same folder proves --num-seqs works too
    cmd2 = [sys.executable, "-m", "jax_kda.bench", "--seqlen", "24", "--num-seqs", "2",
            "--heads", "1", "--variants", "reference", "--repeats", "2", "--warmup", "0",
            "--out", str(out), "--tag", "multi", "--no-plot", "--no-progress"]
    done2 = subprocess.run(cmd2, capture_output=True, text=True, timeout=600, check=False)
    return out, done, done2


def test_command_succeeds_and_prints_a_table(bench_run):
    _, done, done2 = bench_run
    assert done.returncode == 0, done.stdout + done.stderr
    assert done2.returncode == 0, done2.stdout + done2.stderr
    for name in REQUESTED:
        assert name in done.stdout
    assert "median us per call" in done.stdout
    assert "wrote" in done.stdout and "tiny.png" in done.stdout
    assert "6/6" in done.stderr  # the progress bar (tqdm's or the simple one) reached the end


def test_json_holds_every_requested_case_and_variant(bench_run):
    out, _, _ = bench_run
    data = json.loads((out / "tiny.json").read_text())
    assert data["schema"] == report.SCHEMA
    assert data["meta"]["platform"] == "cpu"
    assert {c["name"] for c in data["cases"]} == REQUESTED
    got = {(r["case"], r["variant"]): r for r in data["results"]}
    assert set(got) == {(c, v) for c in REQUESTED for v in ("reference", "prepare")}
    for (case, variant), r in got.items():
        if variant == "reference":
            assert r["status"] == "ok", r
            assert len(r["samples_us"]) == 3 and r["inner"] == 1
            assert 0 < r["min_us"] <= r["median_us"] <= r["max_us"]
            assert r["ratio_vs_baseline"] == pytest.approx(1.0)  # reference is the baseline here
        else:  # no GPU kernels on a CPU: skipped, with the reason
            assert r["status"] == "skipped" and r["error"]
            assert r["ratio_vs_baseline"] is None
    varlen = got[("varlen[17,0,23]_H2", "reference")]
    assert varlen["seq_lens"] == [17, 0, 23] and varlen["layout"] == "varlen"
    assert varlen["tokens"] == 40 and varlen["num_seqs"] == 3 and varlen["heads"] == 2


def test_csv_matches_json(bench_run):
    out, _, _ = bench_run
    rows = list(csv.DictReader((out / "tiny.csv").open()))
    data = json.loads((out / "tiny.json").read_text())
    assert len(rows) == len(data["results"])
    by_key = {(r["case"], r["variant"]): r for r in data["results"]}
    for row in rows:
        r = by_key[(row["case"], row["variant"])]
        assert row["status"] == r["status"]
        if r["status"] == "ok":
            assert float(row["median_us"]) == pytest.approx(r["median_us"])
        else:
            assert row["median_us"] == ""


def test_png_is_a_real_image(bench_run):
    out, _, _ = bench_run
    png = (out / "tiny.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    assert not (out / "multi.png").exists()  # --no-plot


def test_num_seqs_makes_packed_cases(bench_run):
    out, _, _ = bench_run
    data = json.loads((out / "multi.json").read_text())
    assert [c["name"] for c in data["cases"]] == ["varlen2x24_H1"]
    assert all(r["status"] == "ok" and r["seq_lens"] == [24, 24] for r in data["results"])


def test_bad_arguments_fail_with_a_message():
    done = subprocess.run([sys.executable, "-m", "jax_kda.bench", "--variants", "nonsense",
                           "--dry-run"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0 and "unknown" in done.stderr
    done = subprocess.run([sys.executable, "-m", "jax_kda.bench", "--block-v", "48",
                           "--variants", "recurrence", "--dry-run"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0 and "block_v" in done.stderr


def test_baseline_kernel_variants_are_parsed_and_labelled():
    done = subprocess.run([sys.executable, "-m", "jax_kda.bench", "--variants", "recurrence,total",
                           "--block-v", "16,32,baseline", "--total-block-v", "baseline,auto",
                           "--seqlen", "16", "--heads", "1", "--dry-run"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("variants: recurrence:bv=16, recurrence:bv=32, recurrence:bv=baseline, "
            "total:bv=baseline, total:bv=auto") in done.stdout
    done = subprocess.run([sys.executable, "-m", "jax_kda.bench", "--total-block-v", "basline",
                           "--variants", "total", "--dry-run"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0 and "baseline, got basline" in done.stderr


def test_baseline_preset_is_the_baselines_table():
    names = [c.name for c in cases.baseline_cases()]
    assert names == ["T8192_H96", "T8192_H48", "T8192_H24", "T8192_H12", "T8192_H6",
                     "varlen[1300,547,2048,963,271,3063]_H96", "varlen8x1024_H96",
                     "varlen8x1024_H12", "T32768_H12", "T2048_H12"]


def test_ratios_are_baseline_over_variant():
    rows = [{"case": "a", "variant": "x", "status": "ok", "median_us": 100.0},
            {"case": "a", "variant": "y", "status": "ok", "median_us": 25.0},
            {"case": "b", "variant": "y", "status": "ok", "median_us": 5.0}]
    report.add_ratios(rows, "x")
    assert [r["ratio_vs_baseline"] for r in rows] == [1.0, 4.0, None]


def test_chain_runs_every_call():
    """R chained calls of the same op must all survive XLA (no CSE, no DCE), and the feedback
    that links them must leave the inputs' values unchanged."""
    def feedback(args, out):
        return (args[0] + 0.0 * out.reshape(-1)[0],)

    hlo = timing.chain_jax(jnp.sin, 5, feedback).lower(jnp.ones(8)).compile().as_text()
    assert hlo.count(" sine(") == 5, hlo
    out = timing.chain_jax(lambda x: x + 1.0, 3, feedback)(jnp.zeros(2))
    assert jax.numpy.array_equal(out, jnp.ones(2))


def test_markdown_tables_hold_the_measured_medians(bench_run):
    from jax_kda.bench import markdown

    out, _, _ = bench_run
    data = json.loads((out / "tiny.json").read_text())
    text = markdown.tables(data)
    for r in data["results"]:
        if r["status"] == "ok":
            row = next(line for line in text.splitlines() if line.startswith(f"| {r['case']} |"))
            assert markdown._cell(r, False) in row
    assert "prepare" not in text.splitlines()[2]  # never-timed variants get no column


@pytest.mark.parametrize("kind,block_v,prepares,recurrences", [
    ("prepare", None, 3, 0), ("recurrence", 32, 0, 3), ("recurrence", "auto", 0, 3),
    ("total", 128, 3, 3), ("total", "auto", 3, 3), ("recurrence", "baseline", 0, 3),
    ("total", "baseline", 3, 3)])
def test_kernel_variants_lower_to_one_custom_call_per_chained_call(
        monkeypatch, kind, block_v, prepares, recurrences):
    """What the GPU timing will compile: R chained calls, each with its custom calls, for CUDA."""
    from jax_kda import api
    from jax_kda.bench import inputs, jax_variants

    monkeypatch.setattr(jax_variants, "kernels_status", lambda: (True, ""))
    monkeypatch.setattr(api, "_require_kernels", lambda: None)  # no GPU here; lowering only

    def abstract_workspace(prepare, args):
        return jax.ShapeDtypeStruct(jax.eval_shape(prepare, *args).shape, jnp.uint8)

    monkeypatch.setattr(jax_variants, "compute_workspace", abstract_workspace)
    case = cases.Case((40, 0, 17), 3, "varlen")
    x = inputs.to_jax(inputs.make_inputs(case))
    fn, args, feedback, info = jax_variants.build(jax_variants.Variant(kind, block_v), case, x,
                                                  inverse="stable")
    if block_v == "auto":
        assert info["block_v_used"] in (16, 32, 64, 128)
    text = (timing.chain_jax(fn, 3, feedback).trace(*args)
            .lower(lowering_platforms=("cuda",)).as_text())
    assert text.count("@jax_kda_prepare_v1") == prepares
    assert text.count("@jax_kda_recurrence_v1") == recurrences
    attrs = re.findall(r"block_v = (\d+) : i32", text)
    if block_v == "baseline":  # the baseline kernel: attribute value 0, labelled "baseline"
        assert info["block_v_used"] == "baseline" and attrs == ["0"] * 3
    elif recurrences:
        assert attrs == [str(info["block_v_used"])] * 3


# --- where results go ---------------------------------------------------------------------------

def _bench_env(**env):
    """This environment without XDG_CACHE_HOME and HOME, plus env."""
    out = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "HOME")}
    out["JAX_PLATFORMS"] = "cpu"
    return out | {k: str(v) for k, v in env.items()}


def test_default_output_folder_is_the_user_cache(monkeypatch, tmp_path):
    from jax_kda.bench import cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli.default_out_dir() == tmp_path / "xdg" / "jax_kda" / "bench"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored (XDG spec)
    assert cli.default_out_dir() == tmp_path / "home" / ".cache" / "jax_kda" / "bench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cli.default_out_dir() == tmp_path / "home" / ".cache" / "jax_kda" / "bench"
    assert not cli.default_out_dir().is_relative_to(pathlib.Path.cwd())


def test_a_run_without_out_writes_nothing_into_the_current_folder(tmp_path):
    """Run from a source checkout, the command must not leave result files in it."""
    cwd, cache = tmp_path / "checkout", tmp_path / "cache"
    cwd.mkdir()
    cmd = [sys.executable, "-m", "jax_kda.bench", "--seqlen", "16", "--heads", "1",
           "--variants", "reference", "--repeats", "1", "--warmup", "0", "--tag", "t",
           "--no-progress"]
    done = subprocess.run(cmd, cwd=cwd, env=_bench_env(XDG_CACHE_HOME=cache, HOME=tmp_path / "home"),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(cwd.iterdir()) == []
    folder = cache / "jax_kda" / "bench"
    assert {p.name for p in folder.iterdir()} == {"t.json", "t.csv", "t.png"}
    assert f"results go to {folder}" in done.stdout
    assert str(folder / "t.json") in done.stdout.split("wrote ")[-1]
    # without XDG_CACHE_HOME: ~/.cache/jax_kda/bench; --out still wins
    done = subprocess.run(cmd + ["--dry-run"], cwd=cwd, env=_bench_env(HOME=tmp_path / "h"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert f"results would go to {tmp_path / 'h' / '.cache' / 'jax_kda' / 'bench'}" in done.stdout
    done = subprocess.run(cmd + ["--dry-run", "--out", "here"], cwd=cwd,
                          env=_bench_env(HOME=tmp_path / "h"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert f"results would go to {cwd / 'here'}" in done.stdout


# --- the plot ------------------------------------------------------------------------------------

def _rows(cases, medians):
    """Results rows: medians[case][variant] = us, or None for a variant that was skipped."""
    rows = []
    for c in cases:
        for v, us in medians[c].items():
            rows.append({"case": c, "variant": v, "status": "ok" if us else "skipped",
                         "median_us": us, "error": None if us else "no GPU"})
    return rows


def _plot(tmp_path, monkeypatch, cases, variants, rows, baseline):
    """write_plot's figure, as points per axes (and the figure), and check the PNG."""
    import matplotlib.figure

    shown = []
    save = matplotlib.figure.Figure.savefig

    def recording_savefig(fig, *args, **kwargs):
        shown.append((report.points_per_axes(fig), fig))
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_savefig)
    report.add_ratios(rows, baseline)
    path = tmp_path / "plot.png"
    assert report.write_plot(path, [{"name": c} for c in cases], variants, rows, baseline,
                             "test") is None
    assert path.read_bytes().startswith(b"\x89PNG")
    (points, fig), = shown
    assert points and all(n > 0 for n in points), points  # no empty panel
    return points, fig


VARIANTS = ["prepare", "recurrence:bv=baseline", "recurrence:bv=auto", "total:bv=baseline",
            "total:bv=auto", "fla"]


def test_plot_of_one_case_is_one_bar_per_variant_with_the_speedup(tmp_path, monkeypatch):
    medians = {"T8192_H6": {"prepare": 42.0, "recurrence:bv=baseline": 880.0,
                            "recurrence:bv=auto": 230.0, "total:bv=baseline": 916.0,
                            "total:bv=auto": 279.0, "fla": None}}  # fla skipped
    points, fig = _plot(tmp_path, monkeypatch, ["T8192_H6"], VARIANTS,
                        _rows(["T8192_H6"], medians), "total:bv=baseline")
    assert points == [5]  # one panel, a bar per measured variant
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == VARIANTS[:5]
    notes = [t.get_text() for t in ax.texts]
    assert any("(baseline)" in n for n in notes)
    assert any(f"({916.0 / 279.0:.2f}x vs baseline)" in n for n in notes), notes


def test_plot_of_one_case_without_the_baseline(tmp_path, monkeypatch):
    medians = {"T64_H2": {"reference": 1000.0, "prepare": None}}
    points, _ = _plot(tmp_path, monkeypatch, ["T64_H2"], ["reference", "prepare"],
                        _rows(["T64_H2"], medians), "prepare")
    assert points == [1]


@pytest.mark.parametrize("baseline_everywhere", [True, False])
def test_plot_of_several_cases_has_times_and_speedups(tmp_path, monkeypatch, baseline_everywhere):
    cases_ = ["T8192_H96", "T8192_H24", "T8192_H6", "varlen8x1024_H12"]
    medians = {c: {"prepare": 40.0 + i, "recurrence:bv=baseline": 880.0 - i,
                   "recurrence:bv=auto": 200.0 + 100 * i, "total:bv=baseline": 900.0,
                   "total:bv=auto": 300.0 + i, "fla": None} for i, c in enumerate(cases_)}
    if not baseline_everywhere:
        del medians["T8192_H6"]["total:bv=baseline"]
    points, _ = _plot(tmp_path, monkeypatch, cases_, VARIANTS, _rows(cases_, medians),
                        "total:bv=baseline")
    n_bars = 5 * 4 - (0 if baseline_everywhere else 1)
    n_ratios = 4 * (4 if baseline_everywhere else 3)  # every variant but the baseline
    assert points == [n_bars, n_ratios]


def test_plot_of_several_cases_of_the_baseline_alone(tmp_path, monkeypatch):
    medians = {"a": {"reference": 5.0}, "b": {"reference": 7.0}}
    points, _ = _plot(tmp_path, monkeypatch, ["a", "b"], ["reference"], _rows(["a", "b"], medians),
                      "reference")
    assert points == [2]  # times only: a speedup panel would show nothing but the baseline's 1s


def test_plot_of_nothing_measured_is_skipped_with_a_reason(tmp_path):
    rows = _rows(["a"], {"a": {"prepare": None}})
    why = report.write_plot(tmp_path / "x.png", [{"name": "a"}], ["prepare"], rows, None, "t")
    assert why and not (tmp_path / "x.png").exists()
