"""The ahead-of-time build's list of specialisations (jax_kda/_aot/specs.py), the X-macro list
the C++ tables are compiled from and the generated contract header; CPU only, nothing is
compiled."""

from __future__ import annotations

import re
import subprocess
import sys

from jax_kda import contract
from jax_kda._aot import build, specs


def test_baseline_recurrence_specs_for_every_arch():
    baseline = [s for s in specs.all_specs(tuple(contract.ARCHS))
                if s.kernel == "recurrence_baseline"]
    assert [s.prefix for s in baseline] == ["jax_kda_recurrence_baseline_sm90a",
                                            "jax_kda_recurrence_baseline_sm100a"]
    assert all(s.call == "recurrence" and s.options == {} for s in baseline)
    assert [s.variant_id for s in baseline] == [contract.BASELINE_BLOCK_V] * 2


def test_prefixes_are_unique_and_names_unchanged():
    all_specs = specs.all_specs(tuple(contract.ARCHS))
    prefixes = [s.prefix for s in all_specs]
    assert len(prefixes) == len(set(prefixes))
    assert "jax_kda_recurrence_bv32_sm90a" in prefixes
    assert "jax_kda_prepare_neumann_sm100a" in prefixes
    assert {s.options["block_v"] for s in all_specs if s.kernel == "recurrence"} == set(
        contract.COLUMN_SPLITS)


def test_every_recurrence_kernel_goes_into_the_recurrence_table(tmp_path):
    chosen = specs.all_specs(("sm_90a",))
    build._write_spec_lists(tmp_path, chosen)
    lines = (tmp_path / "kernels_specs.inc").read_text().splitlines()
    assert "JAX_KDA_RECURRENCE(jax_kda_recurrence_baseline_sm90a, 0, 90)" in lines
    assert "JAX_KDA_RECURRENCE(jax_kda_recurrence_bv16_sm90a, 16, 90)" in lines
    assert "JAX_KDA_PREPARE(jax_kda_prepare_neumann_sm90a, 1, 0, 90)" in lines
    headers = (tmp_path / "kernels_headers.inc").read_text()
    assert '#include "jax_kda_recurrence_baseline_sm90a.h"' in headers


def test_fp32_mode_kernels_have_their_own_tables(tmp_path):
    chosen = specs.all_specs(("sm_90a",))
    fp32 = [s for s in chosen if s.kernel.endswith("_fp32")]
    assert sorted(s.prefix for s in fp32) == sorted(
        ["jax_kda_prepare_fp32_sm90a", "jax_kda_prepare_fp32_grouped_sm90a"]
        + [f"jax_kda_recurrence_fp32_bv{bv}_sm90a" for bv in contract.COLUMN_SPLITS]
        + [f"jax_kda_recurrence_fp32_pool_{dt}_bv{bv}_sm90a" for bv in contract.COLUMN_SPLITS
           for dt in contract.STATE_DTYPE_IDS]
        + [f"jax_kda_decode_fp32_{dt}{st}{grouped}_sm90a" for dt in contract.STATE_DTYPE_IDS
           for st in ("", "_states") for grouped in ("", "_grouped")])
    assert {s.call for s in fp32} == {"prepare_fp32", "recurrence_fp32", "recurrence_fp32_pool",
                                      "decode_fp32"}
    decode = [s for s in fp32 if s.call == "decode_fp32"]
    assert all(s.options == {"state_dtype": s.state_dtype, "intermediate": s.intermediate,
                             "grouped": s.grouped} for s in decode)
    pool = [s for s in fp32 if s.call == "recurrence_fp32_pool"]
    assert all(s.options == {"block_v": s.variant, "state_dtype": s.state_dtype, "serving": True}
               for s in pool)
    build._write_spec_lists(tmp_path, chosen)
    lines = (tmp_path / "kernels_specs.inc").read_text().splitlines()
    # the prepare's inverse attribute is the stable id; recurrences are keyed by block_v
    stable = contract.INVERSE_IDS["stable"]
    assert f"JAX_KDA_PREPARE_FP32(jax_kda_prepare_fp32_sm90a, {stable}, 0, 90)" in lines
    assert f"JAX_KDA_PREPARE_FP32(jax_kda_prepare_fp32_grouped_sm90a, {stable}, 1, 90)" in lines
    assert "JAX_KDA_RECURRENCE_FP32(jax_kda_recurrence_fp32_bv64_sm90a, 64, 90)" in lines
    f32_id = contract.STATE_DTYPE_IDS["f32"]
    assert (f"JAX_KDA_RECURRENCE_FP32_POOL(jax_kda_recurrence_fp32_pool_f32_bv16_sm90a, 16, "
            f"{f32_id}, 90)") in lines
    # the decode: keyed by the pool dtype and grouped, like the flashkda decode's table
    assert f"JAX_KDA_DECODE_FP32(jax_kda_decode_fp32_f32_sm90a, {f32_id}, 0, 0, 90)" in lines
    assert (f"JAX_KDA_DECODE_FP32(jax_kda_decode_fp32_f32_states_grouped_sm90a, {f32_id}, 1, 1, "
            "90)") in lines
    # and not in the flashkda tables
    assert not any(line.startswith(("JAX_KDA_PREPARE(", "JAX_KDA_RECURRENCE(",
                                    "JAX_KDA_RECURRENCE_POOL(", "JAX_KDA_DECODE("))
                   and "fp32" in line for line in lines)


def test_grouped_value_heads_add_specialisations_of_the_kernels_that_read_q_and_k(tmp_path):
    """prepare and decode (both modes) have a grouped specialisation each (q, k on fewer heads);
    every existing specialisation keeps its name, options and X-macro values (plus grouped = 0)."""
    chosen = specs.all_specs(("sm_90a",))
    grouped = [s for s in chosen if s.grouped]
    assert sorted(s.prefix for s in grouped) == sorted(
        ["jax_kda_prepare_stable_grouped_sm90a", "jax_kda_prepare_neumann_grouped_sm90a",
         "jax_kda_prepare_fp32_grouped_sm90a"]
        + [f"jax_kda_decode_{inv}_{dt}{st}_grouped_sm90a" for inv in contract.INVERSE_IDS
           for dt in contract.STATE_DTYPE_IDS for st in ("", "_states")]
        + [f"jax_kda_decode_fp32_{dt}{st}_grouped_sm90a" for dt in contract.STATE_DTYPE_IDS
           for st in ("", "_states")])
    assert {s.kernel for s in grouped} == {"prepare", "prepare_fp32", "decode", "decode_fp32"}
    assert all(s.options["grouped"] for s in grouped)
    plain = {s.prefix for s in chosen if not s.grouped}
    # 40 prefill and serving specialisations, 1 backward chain kernel (both chains)
    assert len(plain) == 41 and {s.prefix.replace("_grouped", "") for s in grouped} <= plain
    build._write_spec_lists(tmp_path, chosen)
    lines = (tmp_path / "kernels_specs.inc").read_text().splitlines()
    assert "JAX_KDA_PREPARE(jax_kda_prepare_stable_grouped_sm90a, 0, 1, 90)" in lines
    assert "JAX_KDA_PREPARE(jax_kda_prepare_stable_sm90a, 0, 0, 90)" in lines
    f32 = contract.STATE_DTYPE_IDS["f32"]
    assert (f"JAX_KDA_DECODE(jax_kda_decode_neumann_f32_states_grouped_sm90a, 1, {f32}, 1, 1, 90)"
            in lines)
    assert f"JAX_KDA_DECODE(jax_kda_decode_neumann_f32_sm90a, 1, {f32}, 0, 0, 90)" in lines


def test_the_command_line_cmake_runs_lists_every_prefix():
    listed = subprocess.run([sys.executable, specs.__file__], capture_output=True, text=True,
                            check=True, env={"JAX_KDA_ARCHS": ",".join(contract.ARCHS)})
    assert listed.stdout.split() == [s.prefix for s in specs.all_specs(tuple(contract.ARCHS))]


def test_build_compiles_every_spec_and_writes_the_contract_header(tmp_path, monkeypatch):
    compiled = []
    monkeypatch.setattr(build.concurrent.futures, "ProcessPoolExecutor", _InlinePool)
    monkeypatch.setattr(build, "_compile_one",
                        lambda spec, out: compiled.append(spec) or {"prefix": spec.prefix,
                                                                    "seconds": 0.0})
    monkeypatch.setattr(specs, "selected_archs", lambda: ("sm_90a",))
    report = build.build(tmp_path / "out", 1)
    assert sorted(r["prefix"] for r in report["built"]) == sorted(
        s.prefix for s in specs.all_specs(("sm_90a",)))
    header = (tmp_path / "out" / "kernel_contract.h").read_text()
    assert header == contract.cpp_header()


def test_build_reports_each_specialisation_as_it_finishes(tmp_path, monkeypatch):
    """One "[i/n] prefix seconds" line per finished specialisation, after a line naming the
    count, on the stream the build is given (the command line picks it: progress_stream)."""
    import io

    monkeypatch.setattr(build.concurrent.futures, "ProcessPoolExecutor", _InlinePool)
    monkeypatch.setattr(build, "_compile_one", lambda spec, out: {"prefix": spec.prefix,
                                                                   "seconds": 1.5})
    monkeypatch.setattr(specs, "selected_archs", lambda: ("sm_100a",))
    wanted = [s.prefix for s in specs.all_specs(("sm_100a",))]
    progress = io.StringIO()
    build.build(tmp_path / "out", 2, progress)
    lines = progress.getvalue().splitlines()
    assert lines[0] == (f"jax_kda AOT: compiling {len(wanted)} kernel specialisations (sm_100a) "
                        "in 2 processes")
    # counted in the order they finish, each specialisation once
    assert [line.split()[0] for line in lines[1:]] == [
        f"[{i}/{len(wanted)}]" for i in range(1, len(wanted) + 1)]
    assert sorted(line.split(maxsplit=1)[1] for line in lines[1:]) == sorted(
        f"{prefix} 1.5 s" for prefix in wanted)


def test_progress_goes_to_stdout_without_a_terminal(monkeypatch):
    """Captured stdout and no controlling terminal (CI, Bazel): progress stays on stdout."""
    import builtins
    import io

    def no_tty(path, *args, **kwargs):
        raise OSError(6, "No such device or address", path)

    captured = io.StringIO()
    monkeypatch.setattr(build.sys, "stdout", captured)
    monkeypatch.setattr(builtins, "open", no_tty)
    assert build.progress_stream() is captured


def test_contract_header_carries_the_python_numbers(tmp_path):
    """The header the handlers are compiled against, written by the script CMake runs."""
    out = tmp_path / "kernel_contract.h"
    subprocess.run([sys.executable, contract.__file__, "--header", str(out)], check=True, env={})
    text = out.read_text()

    def value(name):
        return re.search(rf"{name}(?:\[\])? = ([^;]+);", text).group(1)

    assert int(value("kHeadDim")) == contract.HEAD_DIM
    assert int(value("kChunk")) == contract.CHUNK
    assert int(value("kRecordBytes")) == contract.RECORD_BYTES
    assert int(value("kAbiVersion")) == contract.ABI_VERSION
    assert int(value("kBaselineBlockV")) == contract.BASELINE_BLOCK_V
    assert value("kColumnSplits") == "{" + ", ".join(map(str, contract.COLUMN_SPLITS)) + "}"
    assert value("kSupportedSms") == "{" + ", ".join(
        str(contract.arch_sm(a)) for a in contract.ARCHS) + "}"
    assert int(value("kInverseNeumann")) == contract.INVERSE_IDS["neumann"]


def test_workspace_slots_match_the_layout():
    assert contract.workspace_slots(0, 1) == 1
    assert contract.workspace_slots(41, 4) == 3 + 4
    assert contract.workspace_slots(32, 2) == 2 + 2
    fields = sorted([contract.KD_OFFSET, contract.QD_OFFSET, contract.KR_OFFSET,
                     contract.GT_OFFSET, contract.INV_OFFSET, contract.MQK_OFFSET])
    assert fields == [0, 4096, 8192, 12288, 12800, 13312]
    assert contract.RECORD_BYTES == contract.MQK_OFFSET + 16 * 16 * 2


class _InlinePool:
    """A stand-in for the process pool: runs each job at submit time."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        import concurrent.futures

        future = concurrent.futures.Future()
        future.set_result(fn(*args))
        return future
