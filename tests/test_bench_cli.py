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


def _lowered_chain(monkeypatch, kind, block_v, numerics="flashkda"):
    """(StableHLO text for CUDA of 3 chained calls of a kernel variant on a small packed case,
    the variant's info): what the GPU timing compiles, lowered here without a GPU."""
    from jax_kda import api
    from jax_kda.bench import inputs, jax_variants

    monkeypatch.setattr(jax_variants, "kernels_status", lambda: (True, ""))
    monkeypatch.setattr(api, "_require_kernels", lambda: None)  # no GPU here; lowering only

    def abstract_workspace(prepare, args):
        return jax.ShapeDtypeStruct(jax.eval_shape(prepare, *args).shape, jnp.uint8)

    monkeypatch.setattr(jax_variants, "compute_workspace", abstract_workspace)
    case = cases.Case((40, 0, 17), 3, "varlen")
    x = inputs.to_jax(inputs.make_inputs(case))
    variant = jax_variants.Variant(kind, block_v, numerics)
    fn, args, feedback, info = jax_variants.build(variant, case, x, inverse="stable")
    text = (timing.chain_jax(fn, 3, feedback).trace(*args)
            .lower(lowering_platforms=("cuda",)).as_text())
    return text, info


@pytest.mark.parametrize("kind,block_v,prepares,recurrences", [
    ("prepare", None, 3, 0), ("recurrence", 32, 0, 3), ("recurrence", "auto", 0, 3),
    ("total", 128, 3, 3), ("total", "auto", 3, 3), ("recurrence", "baseline", 0, 3),
    ("total", "baseline", 3, 3)])
def test_kernel_variants_lower_to_one_custom_call_per_chained_call(
        monkeypatch, kind, block_v, prepares, recurrences):
    """What the GPU timing will compile: R chained calls, each with its custom calls, for CUDA."""
    text, info = _lowered_chain(monkeypatch, kind, block_v)
    if block_v == "auto":
        assert info["block_v_used"] in (16, 32, 64, 128)
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
    env = _bench_env(XDG_CACHE_HOME=cache, HOME=tmp_path / "home")
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
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


# --- decode cases --------------------------------------------------------------------------------

DECODE_CASES = {"decode3x2_t1_bf16_P5", "decode3x2_t1_f32_P5", "decode2x1_t2_bf16_P4",
                "decode2x1_t2_f32_P4"}


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    """The command end to end on tiny decode cases (pools larger than N, both state dtypes):
    the reference is timed, the kernel variants and the torch peer are skipped with a reason."""
    out = tmp_path_factory.mktemp("bench_decode")
    cmd = [sys.executable, "-m", "jax_kda.bench", "--decode", "3,2", "--decode", "2,1,2",
           "--pool-extra", "2", "--variants", "reference,decode,decode_prefill",
           "--compare", "fla", "--repeats", "2", "--warmup", "0", "--inner", "2",
           "--out", str(out), "--tag", "dec", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    # --pool-extra 2 gives P = N + 2 for both shapes
    return out, done


def test_decode_command_prints_the_decode_table(decode_run):
    _, done = decode_run
    assert done.returncode == 0, done.stdout + done.stderr
    header = next(ln for ln in done.stdout.splitlines() if ln.startswith("case "))
    assert header.split()[:6] == ["case", "state", "MB", "floor", "us", "reference"], header
    for name in DECODE_CASES:
        assert name in done.stdout
    assert "floor = state bytes / 4.3 TB/s" in done.stdout
    row = next(ln for ln in done.stdout.splitlines() if ln.startswith("decode3x2_t1_bf16"))
    assert "TB/s" in row


def test_decode_json_has_floors_and_bandwidth(decode_run):
    out, _ = decode_run
    data = json.loads((out / "dec.json").read_text())
    assert {c["name"] for c in data["cases"]} == DECODE_CASES
    assert data["meta"]["decode_baseline"] == "decode" and data["meta"]["copy_tb_s"] == 4.3
    got = {(r["case"], r["variant"]): r for r in data["results"]}
    assert set(got) == {(c, v) for c in DECODE_CASES
                        for v in ("reference", "decode", "decode_prefill", "fla")}
    for (case, variant), r in got.items():
        c = cases.DecodeCase(r["num_seqs"], r["heads"], r["tokens_per_seq"], r["state_dtype"],
                             r["pool_rows"])
        assert c.name == case and r["pool_rows"] == r["num_seqs"] + 2
        assert r["state_bytes"] == 2 * r["num_seqs"] * r["heads"] * 128 * 128 * c.state_itemsize
        assert r["floor_us"] == pytest.approx(r["state_bytes"] / 4.3e12 * 1e6)
        if variant == "reference":
            assert r["status"] == "ok", r
            assert r["inner"] == 2 and len(r["samples_us"]) == 2
            assert r["achieved_tb_s"] == pytest.approx(r["state_bytes"] / (r["median_us"] * 1e-6)
                                                       / 1e12)
            assert r["of_copy_rate"] == pytest.approx(r["floor_us"] / r["median_us"])
            assert "donated pool" in r["timer"]
        else:  # no GPU kernels, no torch here
            assert r["status"] == "skipped" and r["error"], r
            assert "achieved_tb_s" not in r and r["ratio_vs_baseline"] is None


def test_decode_preset_dry_run_lists_the_decode_table():
    done = subprocess.run([sys.executable, "-m", "jax_kda.bench", "--preset", "decode",
                           "--variants", "decode,decode_prefill,reference", "--compare", "fla",
                           "--dry-run"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    listed = re.findall(r"case (decode\S+): decode N=(\d+) heads=(\d+) t=(\d+) pool_rows=(\d+) "
                        r"state=(\w+)", done.stdout)
    want = [(n, h, t, d) for n, h, t in ((64, 12, 1), (256, 12, 1), (1024, 12, 1), (256, 96, 1),
                                         (256, 12, 4)) for d in ("bf16", "f32")]
    assert [(int(n), int(h), int(t), d) for _, n, h, t, _, d in listed] == want
    assert all(p == n for _, n, _, _, p, _ in listed)  # P = N
    assert "variants: decode, decode_prefill, reference, fla (baseline decode)" in done.stdout


def test_decode_preset_is_the_decode_table_and_defaults_to_the_decode_variants():
    from jax_kda.bench import cli

    preset = cases.decode_cases()
    assert [c.name for c in preset] == [
        f"decode{n}x{h}_t{t}_{d}" for n, h, t in ((64, 12, 1), (256, 12, 1), (1024, 12, 1),
                                                   (256, 96, 1), (256, 12, 4))
        for d in ("bf16", "f32")]
    assert preset[0].state_bytes == 64 * 12 * 128 * 128 * 2 * 2  # bf16, read + written
    args = cli._parser().parse_args(["--preset", "decode", "--compare", "fla"])
    variants = cli._variants(args, True, preset)
    assert [v.name for v in variants] == ["decode", "decode_prefill", "fla"]
    assert cli._baselines(args, preset, variants) == {"decode": "decode"}
    mixed = preset[:1] + [cases.Case((64,), 2)]
    variants = cli._variants(cli._parser().parse_args([]), True, mixed)
    assert [v.kind for v in variants][-2:] == ["decode", "decode_prefill"]
    assert cli._baselines(cli._parser().parse_args([]), mixed, variants) == {
        "prefill": "total:bv=128", "decode": "decode"}


def test_decode_cases_are_checked():
    for bad in ({"num_seqs": 0, "heads": 1}, {"num_seqs": 2, "heads": 1, "tokens_per_seq": 17},
                {"num_seqs": 2, "heads": 1, "state_dtype": "f16"},
                {"num_seqs": 4, "heads": 1, "pool_rows": 3}):
        with pytest.raises(ValueError):
            cases.DecodeCase(**bad)
    assert cases.parse_decode("256,12") == (256, 12, 1)
    done = subprocess.run([sys.executable, "-m", "jax_kda.bench", "--decode", "4,2",
                           "--state-dtype", "f16", "--dry-run"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0 and "--state-dtype" in done.stderr


def test_decode_inputs_index_distinct_pool_rows():
    from jax_kda.bench import inputs

    case = cases.DecodeCase(5, 2, 3, "f32", pool_rows=9)
    x = inputs.make_inputs(case, seed=1)
    assert x["q"].shape == (5, 3, 2, 128) and x["beta"].shape == (5, 3, 2)
    assert x["pool"].shape == (9, 2, 128, 128)
    idx = x["state_indices"]
    assert idx.dtype.name == "int32" and len(set(idx.tolist())) == 5 and idx.min() >= 0
    assert idx.max() < 9
    full = inputs.make_inputs(cases.DecodeCase(6, 1), seed=1)["state_indices"]
    assert sorted(full.tolist()) == list(range(6))  # P = N: a permutation of the pool
    j = inputs.to_jax(x, case)
    assert j["pool"].dtype == jnp.float32 and j["q"].dtype == jnp.bfloat16
    assert inputs.to_jax(x, cases.DecodeCase(5, 2, 3, "bf16", 9))["pool"].dtype == jnp.bfloat16


def test_decode_and_decode_prefill_steps_agree_and_chain_in_place():
    """The two jax_kda steps compute the same step (bitwise, as kda_decode promises), here on the
    reference; the timed chain donates the pool, runs every step, and leaves other rows alone."""
    from jax_kda.bench import decode_variants, inputs, jax_variants

    case = cases.DecodeCase(3, 2, 2, "bf16", pool_rows=5)
    x = inputs.to_jax(inputs.make_inputs(case), case)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["pool"],
            x["state_indices"])
    out_d, pool_d = decode_variants.decode_step("reference")(*args)
    out_p, pool_p = decode_variants.prefill_step("reference")(*args)
    assert jnp.array_equal(out_d, out_p) and jnp.array_equal(pool_d, pool_p)

    fn, fn_args, feedback, _ = decode_variants.build(jax_variants.Variant("reference"), case, x,
                                                     inverse="stable")
    donated = fn_args[decode_variants.POOL]
    assert donated is not x["pool"]  # each variant donates its own copy
    chained = decode_variants.chain(fn, 3, feedback)(*fn_args)
    assert donated.is_deleted()
    step_args = args
    for _ in range(3):
        outs = fn(*step_args)
        step_args = feedback(step_args, outs)
    assert jnp.array_equal(outs[1], chained[1]) and jnp.array_equal(outs[0], chained[0])
    untouched = jnp.asarray(sorted(set(range(5)) - set(x["state_indices"].tolist())))
    assert jnp.array_equal(chained[1][untouched], x["pool"][untouched])
    assert not jnp.array_equal(chained[1], x["pool"])


@pytest.mark.parametrize("kind,targets", [
    ("decode", {"jax_kda_decode_v1": 3}),
    ("decode_prefill", {"jax_kda_prepare_v1": 3, "jax_kda_recurrence_pool_v1": 3})])
def test_decode_variants_lower_to_chained_custom_calls_on_a_donated_pool(monkeypatch, kind,
                                                                         targets):
    """What the GPU timing compiles: R chained steps, each its custom calls, the pool argument
    donated into the pool result."""
    from jax_kda import api
    from jax_kda.bench import decode_variants, inputs, jax_variants

    monkeypatch.setattr(decode_variants, "kernels_status", lambda: (True, ""))
    monkeypatch.setattr(decode_variants, "decode_kernels_status", lambda: (True, ""))
    monkeypatch.setattr(api, "_require_kernels", lambda: None)  # no GPU here; lowering only
    case = cases.DecodeCase(3, 2, 2, "f32", pool_rows=5)
    x = inputs.to_jax(inputs.make_inputs(case), case)
    fn, args, feedback, _ = decode_variants.build(jax_variants.Variant(kind), case, x,
                                                  inverse="stable")
    text = (decode_variants.chain(fn, 3, feedback).trace(*args)
            .lower(lowering_platforms=("cuda",)).as_text())
    for target in ("jax_kda_decode_v1", "jax_kda_prepare_v1", "jax_kda_recurrence_pool_v1",
                   "jax_kda_recurrence_v1"):
        assert text.count(f"@{target}") == targets.get(target, 0), target
    assert re.findall(r"tf\.aliasing_output = (\d+)", text) == ["1"]  # pool in -> pool out


def test_decode_table_shows_floor_and_bandwidth():
    from jax_kda.bench import decode_variants

    c = cases.DecodeCase(64, 12).as_dict()
    rows = [{"case": c["name"], "variant": "decode", "status": "ok", "median_us": 25.0,
             "state_bytes": c["state_bytes"]},
            {"case": c["name"], "variant": "fla", "status": "ok", "median_us": 50.0,
             "state_bytes": c["state_bytes"]}]
    report.add_ratios(rows, "decode")
    decode_variants.add_floors(rows)
    assert rows[0]["achieved_tb_s"] == pytest.approx(c["state_bytes"] / 25e-6 / 1e12)
    text = decode_variants.format_table([c], ["decode", "fla"], rows, "decode")
    line = next(ln for ln in text.splitlines() if ln.startswith(c["name"]))
    assert f"{c['state_bytes'] / 4.3e12 * 1e6:.1f}" in line  # the floor, 11.7 us
    assert f"25.0 (1.00x) {rows[0]['achieved_tb_s']:.2f} TB/s" in line
    assert f"50.0 (0.50x) {rows[1]['achieved_tb_s']:.2f} TB/s" in line


# --- numerics modes ------------------------------------------------------------------------------

def _cpu_env():
    """This environment on the CPU: no GPU kernels, whatever the machine has."""
    return os.environ | {"JAX_PLATFORMS": "cpu"}


def test_numerics_dry_run_lists_each_modes_variants():
    done = subprocess.run([sys.executable, "-m", "jax_kda.bench", "--numerics", "flashkda,fp32",
                           "--variants", "prepare,recurrence,total,reference", "--block-v",
                           "16,auto", "--total-block-v", "128,auto", "--compare", "jla",
                           "--seqlen", "16", "--heads", "1", "--dry-run"],
                          capture_output=True, text=True, timeout=300, check=False, env=_cpu_env())
    assert done.returncode == 0, done.stdout + done.stderr
    # the flashkda names are those of earlier results; the fp32 ones carry the mode
    assert ("variants: prepare, recurrence:bv=16, recurrence:bv=auto, total:bv=128, "
            "total:bv=auto, reference, prepare:fp32, recurrence:fp32:bv=16, "
            "recurrence:fp32:bv=auto, total:fp32:bv=128, total:fp32:bv=auto, reference:fp32, "
            "jla (baseline total:bv=128)") in done.stdout


def test_unknown_numerics_fails_naming_the_option():
    done = subprocess.run([sys.executable, "-m", "jax_kda.bench", "--numerics", "flashkda,fp16",
                           "--dry-run"], capture_output=True, text=True, timeout=300,
                          check=False, env=_cpu_env())
    assert done.returncode != 0 and "--numerics" in done.stderr and "fp16" in done.stderr


def test_numerics_modes_make_variants_per_mode_for_prefill_and_decode():
    from jax_kda.bench import cli

    args = cli._parser().parse_args(["--numerics", "fp32,flashkda", "--variants",
                                     "total,reference,decode", "--total-block-v", "auto"])
    variants = cli._variants(args, True)
    assert [(v.name, v.numerics) for v in variants] == [
        ("total:fp32:bv=auto", "fp32"), ("reference:fp32", "fp32"), ("decode:fp32", "fp32"),
        ("total:bv=auto", "flashkda"), ("reference", "flashkda"), ("decode", "flashkda")]
    decode, prefill = cases.DecodeCase(2, 1), cases.Case((16,), 1)
    assert [v.name for v in variants if cli._applies(v, decode)] == [
        "reference:fp32", "decode:fp32", "reference", "decode"]
    assert [v.name for v in variants if cli._applies(v, prefill)] == [
        "total:fp32:bv=auto", "reference:fp32", "total:bv=auto", "reference"]


FP32_CASES = {"T64_H2", "varlen[17,0,40]_H1"}


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """The tiny preset on the CPU in both modes: the references run, the baseline kernel has no
    fp32 mode, and jla (not installed here) is skipped."""
    out = tmp_path_factory.mktemp("bench_fp32")
    cmd = [sys.executable, "-m", "jax_kda.bench", "--preset", "tiny", "--numerics",
           "flashkda,fp32", "--variants", "reference,recurrence", "--block-v", "baseline",
           "--compare", "jla", "--repeats", "2", "--warmup", "0", "--inner", "1",
           "--out", str(out), "--tag", "fp32", "--no-plot", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False,
                          env=_cpu_env())
    return out, done


def test_fp32_reference_runs_and_rows_record_the_mode(fp32_run):
    out, done = fp32_run
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((out / "fp32.json").read_text())
    assert data["meta"]["numerics"] == ["flashkda", "fp32"]
    got = {(r["case"], r["variant"]): r for r in data["results"]}
    assert set(got) == {(c, v) for c in FP32_CASES
                        for v in ("reference", "recurrence:bv=baseline", "reference:fp32",
                                  "recurrence:fp32:bv=baseline", "jla")}
    for case in FP32_CASES:
        fp32, flashkda = got[(case, "reference:fp32")], got[(case, "reference")]
        assert fp32["status"] == "ok" and fp32["numerics"] == "fp32", fp32
        assert fp32["kind"] == "reference" and len(fp32["samples_us"]) == 2
        assert flashkda["status"] == "ok" and flashkda["numerics"] == "flashkda"
        # against the run's baseline, the flashkda reference, as every other variant
        assert fp32["ratio_vs_baseline"] == pytest.approx(flashkda["median_us"] / fp32["median_us"])
        baseline_kernel = got[(case, "recurrence:fp32:bv=baseline")]
        assert baseline_kernel["status"] == "skipped" and baseline_kernel["numerics"] == "fp32"
        assert "runs the column split" in baseline_kernel["error"]
        assert got[(case, "jla")]["numerics"] is None  # a peer, not a jax_kda mode
    rows = {(r["case"], r["variant"]): r for r in csv.DictReader((out / "fp32.csv").open())}
    assert rows[("T64_H2", "reference:fp32")]["numerics"] == "fp32"
    assert rows[("T64_H2", "reference")]["numerics"] == "flashkda"
    assert rows[("T64_H2", "jla")]["numerics"] == ""


def test_jla_without_jla_is_skipped_with_a_reason(fp32_run):
    out, _ = fp32_run
    data = json.loads((out / "fp32.json").read_text())
    got = {r["case"]: r for r in data["results"] if r["variant"] == "jla"}
    single, packed = got["T64_H2"], got["varlen[17,0,40]_H1"]
    assert single["status"] == "skipped" and "jla" in single["error"], single
    assert packed["status"] == "skipped" and "cu_seqlens" in packed["error"], packed
    assert data["meta"]["compare_versions"] == {"jla": None}


def test_fp32_reference_variant_passes_the_mode_and_an_f32_state():
    from jax_kda.bench import inputs, jax_variants

    case = cases.Case((24,), 2)
    x = inputs.to_jax(inputs.make_inputs(case))
    runs = {}
    for numerics in ("flashkda", "fp32"):
        fn, args, _, _ = jax_variants.build(jax_variants.Variant("reference", numerics=numerics),
                                            case, x, inverse="stable")
        runs[numerics] = (args[-1], *fn(*args))
    state, out, final = runs["fp32"]
    assert state.dtype == jnp.float32 and final.dtype == jnp.float32
    assert jnp.array_equal(state, x["state"].astype(jnp.float32))
    state, out_bf16, final_bf16 = runs["flashkda"]
    assert state is x["state"] and final_bf16.dtype == jnp.bfloat16
    assert not jnp.array_equal(out, out_bf16)  # the two modes' arithmetic differ in the last bits


def test_fp32_variants_that_kda_prefill_lacks_are_unavailable():
    from jax_kda.bench import inputs, jax_variants

    case = cases.Case((16,), 1)
    x = inputs.to_jax(inputs.make_inputs(case))
    for variant, inverse, reason in [
            (jax_variants.Variant("total", "baseline", "fp32"), "stable", "runs the column split"),
            (jax_variants.Variant("reference", numerics="fp32"), "neumann", "has one f32 inverse")]:
        with pytest.raises(jax_variants.VariantUnavailable, match=reason):
            jax_variants.build(variant, case, x, inverse=inverse)


@pytest.mark.parametrize("kind,block_v,prepares,recurrences", [
    ("prepare", None, 3, 0), ("recurrence", 32, 0, 3), ("recurrence", "auto", 0, 3),
    ("total", 64, 3, 3), ("total", "auto", 3, 3)])
def test_fp32_kernel_variants_lower_to_the_fp32_custom_calls_on_f32_states(
        monkeypatch, kind, block_v, prepares, recurrences):
    """What the GPU timing of the fp32 mode compiles: its own kernels, and an f32 state from call
    to call (no bf16 state anywhere in the chain)."""
    from jax_kda import contract

    text, info = _lowered_chain(monkeypatch, kind, block_v, "fp32")
    assert text.count(f"@{contract.PREPARE_FP32_TARGET}") == prepares
    assert text.count(f"@{contract.RECURRENCE_FP32_TARGET}") == recurrences
    assert text.count(f"@{contract.PREPARE_TARGET}") == text.count(
        f"@{contract.RECURRENCE_TARGET}") == 0
    if recurrences:
        assert re.findall(r"block_v = (\d+) : i32", text) == [str(info["block_v_used"])] * 3
        assert set(re.findall(r"tensor<3x3x128x128x(\w+)>", text)) == {"f32"}


# --- the jla peer --------------------------------------------------------------------------------

class FakeJla:
    """Stands in for jla.ops.mosaic_gpu.kda (the real one needs a Hopper GPU): records what
    kda receives and returns (v, initial_state / 2), so a chain of calls shows in the state."""

    def __init__(self, supported=True):
        self.calls = []
        self.supported = supported

    def kda(self, q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, segment_ids=None, use_qk_l2norm=False, chunk_size=64, sub_chunk=16):
        self.calls.append({"q": q, "k": k, "v": v, "g": g, "beta": beta, "scale": scale,
                           "initial_state": initial_state, "cu_seqlens": cu_seqlens,
                           "output_final_state": output_final_state,
                           "use_qk_l2norm": use_qk_l2norm})
        return v, (initial_state / 2 if output_final_state else None)

    def supports_kda(self, q, k, v, g, beta, **options):
        return self.supported

    def install(self, monkeypatch):
        import types

        kda_module = types.ModuleType("jla.ops.mosaic_gpu.kda")
        kda_module.kda, kda_module.supports_kda = self.kda, self.supports_kda
        checks = types.ModuleType("jla.ops.mosaic_gpu.vector_gate_ops")
        checks.unsupported_reason = lambda *args: "the kernels need an sm_90 (Hopper) GPU"
        root = types.ModuleType("jla")
        root.__version__ = "0.0.fake"
        for name, module in (("jla", root), ("jla.ops", types.ModuleType("jla.ops")),
                             ("jla.ops.mosaic_gpu", types.ModuleType("jla.ops.mosaic_gpu")),
                             ("jla.ops.mosaic_gpu.kda", kda_module),
                             ("jla.ops.mosaic_gpu.vector_gate_ops", checks)):
            monkeypatch.setitem(sys.modules, name, module)
        return self


def test_jla_receives_its_gate_beta_and_transposed_state(monkeypatch):
    import numpy as np

    from jax_kda.bench import inputs, jla_compare

    fake = FakeJla().install(monkeypatch)
    case = cases.Case((40, 40), 2)  # batched: B = 2
    x = inputs.to_jax(inputs.make_inputs(case, seed=3))
    fn, args, feedback, info = jla_compare.build(case, x)
    with jax.disable_jit():  # one eager call: the fake sees the values, not tracers
        fn(*args)
    (call,) = fake.calls
    f64 = {name: np.asarray(x[name], np.float64) for name in ("g", "beta", "A_log", "dt_bias")}
    want_g = -5.0 / (1.0 + np.exp(-np.exp(f64["A_log"])[:, None] * (f64["g"] + f64["dt_bias"])))
    assert call["g"].dtype == jnp.float32 and call["g"].shape == (2, 40, 2, 128)
    np.testing.assert_allclose(np.asarray(call["g"]), want_g, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(call["g"]) < 0)  # a log-decay: exp(g) < 1 shrinks the state
    assert call["beta"].dtype == jnp.float32 and call["beta"].shape == (2, 40, 2)
    np.testing.assert_allclose(np.asarray(call["beta"]), 1 / (1 + np.exp(-f64["beta"])),
                               rtol=1e-6)
    state = np.asarray(x["state"], np.float32)  # ours [N, H, V, K]; jla's [B, H, K, V]
    assert call["initial_state"].dtype == jnp.float32
    assert np.array_equal(np.asarray(call["initial_state"]), np.swapaxes(state, -1, -2))
    for name in ("q", "k", "v"):
        assert call[name].dtype == jnp.bfloat16 and jnp.array_equal(call[name], x[name])
    assert call["scale"] == pytest.approx(128**-0.5) and call["cu_seqlens"] is None
    assert call["output_final_state"] and call["use_qk_l2norm"]
    assert "outside the timed call" in info["notes"]["inputs"]
    # the state chains: 3 calls of the fake halve it 3 times
    _, final = timing.chain_jax(fn, 3, feedback)(*args)
    assert np.array_equal(np.asarray(final), np.swapaxes(state, -1, -2) / 8)


def test_jla_that_refuses_the_call_is_skipped_with_its_reason(monkeypatch):
    from jax_kda.bench import inputs, jax_variants, jla_compare

    FakeJla(supported=False).install(monkeypatch)
    case = cases.Case((16,), 1)
    with pytest.raises(jax_variants.VariantUnavailable, match="sm_90"):
        jla_compare.build(case, inputs.to_jax(inputs.make_inputs(case)))
    for other in (cases.Case((16, 16), 1, "varlen"), cases.DecodeCase(2, 1)):
        with pytest.raises(jax_variants.VariantUnavailable):
            jla_compare.build(other, {})


def test_compare_jla_is_timed_in_the_jax_chain(monkeypatch, tmp_path):
    """--compare jla end to end with the fake: a timed row for the single-sequence case, a
    skipped one for the packed case."""
    from jax_kda.bench import cli

    fake = FakeJla().install(monkeypatch)
    code = cli.main(["--seqlen", "16", "--varlen", "8,8", "--heads", "1", "--variants",
                     "reference", "--compare", "jla", "--repeats", "2", "--warmup", "0",
                     "--inner", "2", "--min-chain-ms", "0", "--out", str(tmp_path), "--tag", "j",
                     "--no-plot", "--no-progress"])
    assert code == 0
    data = json.loads((tmp_path / "j.json").read_text())
    got = {(r["case"], r["variant"]): r for r in data["results"]}
    timed = got[("T16_H1", "jla")]
    assert timed["status"] == "ok" and timed["inner"] == 2 and "jit chain" in timed["timer"]
    assert timed["numerics"] is None and timed["ratio_vs_baseline"] is not None
    assert got[("varlen2x8_H1", "jla")]["status"] == "skipped"
    assert data["meta"]["compare_versions"] == {"jla": "0.0.fake"}
    assert fake.calls  # traced once per chain length (the call is jitted on its own)


def test_throughput_preset_lists_the_full_gpu_cases(capsys):
    from jax_kda.bench import cli

    code = cli.main(["--preset", "throughput", "--variants", "total", "--total-block-v",
                     "auto,baseline", "--compare", "flashkda", "--dry-run"])
    text = capsys.readouterr().out
    assert code == 0
    for name in ("T8192_H96", "T8192_H48", "T8192_H6", "varlen8x1024_H96", "varlen8x1024_H12"):
        assert name in text
    assert "T8192_H12" not in text and "T8192_H24" not in text


def test_sequence_parallel_variants_of_the_long_context_preset(capsys):
    from jax_kda.bench import cases as cases_mod
    from jax_kda.bench import cli
    from jax_kda.bench.jax_variants import Variant, unavailable_reason

    code = cli.main(["--preset", "long-context", "--numerics", "flashkda,fp32", "--variants",
                     "total", "--total-block-v", "auto", "--sequence-parallel", "4,16",
                     "--dry-run"])
    text = capsys.readouterr().out
    assert code == 0
    assert ("variants: total:bv=auto, total:fp32:bv=auto, total:fp32:bv=auto:sp=4, "
            "total:fp32:bv=auto:sp=16") in text  # segments in the fp32 mode only
    long = cases_mod.long_context_cases()
    assert {c.seq_lens[0] for c in long} == {8192, 32768, 65536, 131072}
    assert {c.heads for c in long} == {1, 4, 8, 12} and all(c.num_seqs == 1 for c in long)
    split = Variant("total", "auto", "fp32", segments=4)
    assert unavailable_reason(split, "stable") is None
    assert "recurrence='baseline' runs numerics='flashkda' only" in unavailable_reason(
        Variant("total", "baseline", "fp32"), "stable")
    assert "inverse='neumann'" in unavailable_reason(Variant("total", "auto", "fp32"), "neumann")


def test_sequence_parallel_counts_must_be_integers():
    from jax_kda.bench import cli

    with pytest.raises(SystemExit, match="--sequence-parallel"):
        cli.main(["--preset", "long-context", "--numerics", "fp32", "--variants", "total",
                  "--sequence-parallel", "four", "--dry-run"])


def test_interleave_takes_one_sample_of_each_sampler_per_round():
    calls = []

    def fake(name, seconds):
        return timing.Sampler(lambda: calls.append(name) or seconds, inner=2, method=name)

    a, b = timing.interleave([fake("a", 2e-6), fake("b", 4e-6)], repeats=3)
    assert calls == ["a", "b"] * 3
    assert a.samples_us == [1.0] * 3 and b.samples_us == [2.0] * 3
    assert a.method == "a, interleaved with 1 other(s)" and b.inner == 2
    collected = timing.collect(fake("c", 6e-6), repeats=2)
    assert collected.samples_us == [3.0, 3.0] and calls[-2:] == ["c", "c"]


def test_interleaved_run_times_every_variant_in_turns(tmp_path, monkeypatch):
    """--interleave on CPU: the reference in both numerics modes, on a prefill and a decode case;
    every row is timed with the requested repeats, its timer says it was interleaved, and a
    variant that cannot run is still recorded as skipped."""
    from jax_kda.bench import cli

    rounds = []
    real = timing.interleave
    monkeypatch.setattr(timing, "interleave",
                        lambda samplers, repeats: rounds.append(len(samplers)) or real(samplers,
                                                                                      repeats))
    code = cli.main(["--seqlen", "24", "--heads", "1", "--decode", "2,1,1",
                     "--state-dtype", "bf16", "--variants", "reference,prepare",
                     "--numerics", "flashkda,fp32", "--repeats", "2", "--warmup", "0",
                     "--interleave", "--no-plot", "--no-progress", "--out", str(tmp_path),
                     "--tag", "il"])
    assert code == 0
    data = json.loads((tmp_path / "il.json").read_text())
    assert data["meta"]["interleave"] is True
    rows = {(r["case"], r["variant"]): r for r in data["results"]}
    timed = [r for r in rows.values() if r["status"] == "ok"]
    assert {(r["case"], r["variant"]) for r in timed} == {
        ("T24_H1", "reference"), ("T24_H1", "reference:fp32"), ("decode2x1_t1_bf16", "reference"),
        ("decode2x1_t1_bf16", "reference:fp32")}
    assert all(len(r["samples_us"]) == 2 and "interleaved" in r["timer"] for r in timed)
    assert rows[("T24_H1", "prepare")]["status"] == "skipped"  # no kernels on this machine
    assert sorted(rounds) == [2, 2]  # each case's reference in both modes


def test_training_preset_dry_run_lists_the_training_table():
    done = subprocess.run([sys.executable, "-m", "jax_kda.bench", "--preset", "training",
                           "--numerics", "flashkda,fp32", "--compare", "jla-train",
                           "--compare", "fla-train", "--dry-run"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    listed = re.findall(r"case (\S+): seq_lens=\[([0-9, ]+)\] heads=(\d+) layout=(\w+)",
                        done.stdout)
    want = [("8192", h, "batched") for h in (96, 48, 24, 12, 6)]
    want.append((", ".join(["1024"] * 8), 32, "varlen"))
    assert [(lens, int(h), layout) for _, lens, h, layout in listed] == want
    variants = re.search(r"variants: (.*) \(baseline", done.stdout).group(1).split(", ")
    for name in ("train", "backward", "train:fp32", "backward:fp32", "total:bv=auto",
                 "jla-train", "fla-train"):
        assert name in variants, variants


def test_fla_train_is_a_prefill_peer_that_needs_torch():
    """fla-train runs on prefill cases only, and where torch (or a GPU) is missing it is skipped
    with the reason rather than failing the run."""
    from jax_kda.bench import cli, inputs, torch_compare
    from jax_kda.bench.jax_variants import Variant, VariantUnavailable

    prefill, decode = cases.Case((64,), 2), cases.DecodeCase(2, 1, 1, "bf16", 2)
    variant = Variant("fla-train")
    assert cli._applies(variant, prefill) and not cli._applies(variant, decode)
    ok, why = torch_compare.torch_status()
    if ok:
        pytest.skip("torch with a GPU is here: the builder would run")
    with pytest.raises(VariantUnavailable, match=why.split(" (")[0]):
        torch_compare.BUILDERS["fla-train"](prefill, inputs.make_inputs(prefill, seed=0))


@pytest.mark.parametrize("case", [cases.Case((40,), 2), cases.Case((17, 0, 23), 2, "varlen")],
                         ids=["batched", "packed"])
@pytest.mark.parametrize("numerics", ["flashkda", "fp32"])
def test_training_variants_time_the_gradient_of_the_loss(case, numerics):
    """"train" is value_and_grad and "backward" grad of sum(out * w) + sum(final * w') w.r.t. all
    eight inputs, the state in f32, as written here directly; the feedback changes no value."""
    from jax_kda import kda_prefill
    from jax_kda.bench import inputs, jax_variants, training

    x = inputs.to_jax(inputs.make_inputs(case, seed=3))
    w_out, w_state = training.loss_weights(case)
    assert w_out.shape[2] == case.heads and w_state.shape[0] == case.num_seqs
    extra = {"cu_seqlens": x["cu_seqlens"]} if case.layout == "varlen" else {}

    def loss(*primals):
        out, final = kda_prefill(*primals[:7], initial_state=primals[7],
                                 output_final_state=True, numerics=numerics, scale=128**-0.5,
                                 lower_bound=-5.0, **extra)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(final * w_state)

    primals = [x[n] for n in training.INPUTS[:7]] + [x["state"].astype(jnp.float32)]
    want_loss, want = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(8))))(*primals)
    got = {}
    for kind in ("train", "backward"):
        variant = jax_variants.Variant(kind, numerics=numerics)
        fn, args, feedback, _ = jax_variants.build(variant, case, x, inverse="stable")
        got[kind] = jax.jit(fn)(*args)
        (again,) = feedback(args, got[kind])
        for name in training.INPUTS:
            assert jnp.array_equal(again[name], args[0][name]), name
    got_loss, grads = got["train"]
    assert jnp.allclose(got_loss, want_loss, rtol=1e-6)
    for name, w in zip(training.INPUTS, want):
        for g in (grads[name], got["backward"][name]):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            assert jnp.allclose(g.astype(jnp.float32), w.astype(jnp.float32), rtol=1e-5,
                                atol=1e-6 * float(jnp.max(jnp.abs(w.astype(jnp.float32))))), name
