"""The ahead-of-time build's list of specialisations (jax_kda/_aot/specs.py) and the X-macro list
the C++ tables are compiled from; CPU only, nothing is compiled."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from jax_kda import _checks
from jax_kda._aot import build, specs


def test_baseline_recurrence_specs_for_both_archs():
    baseline = [s for s in specs.all_specs(specs.ARCHS) if s.kernel == "recurrence_baseline"]
    assert [s.prefix for s in baseline] == ["jax_kda_recurrence_baseline_sm90a",
                                            "jax_kda_recurrence_baseline_sm100a"]
    assert all(s.call == "recurrence" and s.variant == "baseline" for s in baseline)
    assert [s.variant_id for s in baseline] == [0, 0]
    # the stdlib-only copy of the attribute values equals the package's
    assert specs.BASELINE_BLOCK_V == _checks.BASELINE_BLOCK_V == 0
    assert specs.RECURRENCE_BLOCK_VS == _checks.BLOCK_V_CHOICES


def test_prefixes_are_unique_and_column_split_names_unchanged():
    prefixes = [s.prefix for s in specs.all_specs(specs.ARCHS)]
    assert len(prefixes) == len(set(prefixes))
    assert "jax_kda_recurrence_bv32_sm90a" in prefixes
    assert "jax_kda_prepare_neumann_sm100a" in prefixes


def test_every_recurrence_kernel_goes_into_the_recurrence_table(tmp_path):
    chosen = specs.all_specs(("sm_90a",))
    build._write_spec_lists(tmp_path, chosen)
    lines = (tmp_path / "kernels_specs.inc").read_text().splitlines()
    assert "JAX_KDA_RECURRENCE(jax_kda_recurrence_baseline_sm90a, 0, 90)" in lines
    assert "JAX_KDA_RECURRENCE(jax_kda_recurrence_bv16_sm90a, 16, 90)" in lines
    assert "JAX_KDA_PREPARE(jax_kda_prepare_neumann_sm90a, 1, 90)" in lines
    headers = (tmp_path / "kernels_headers.inc").read_text()
    assert '#include "jax_kda_recurrence_baseline_sm90a.h"' in headers


def _kernels_dir(tmp_path: pathlib.Path, *kernels: str) -> str:
    for kernel in kernels:
        (tmp_path / f"{kernel}.py").write_text("")
    return str(tmp_path)


@pytest.mark.parametrize("with_baseline", [False, True])
def test_present_specs_follow_the_kernel_sources(tmp_path, with_baseline):
    kernels = ["prepare", "recurrence"] + (["recurrence_baseline"] if with_baseline else [])
    present = specs.present_specs(_kernels_dir(tmp_path, *kernels), archs=specs.ARCHS)
    assert {s.kernel for s in present} == set(kernels)
    # the command line CMake runs lists the same prefixes
    listed = subprocess.run([sys.executable, specs.__file__, str(tmp_path)], capture_output=True,
                            text=True, check=True, env={"JAX_KDA_ARCHS": ",".join(specs.ARCHS)})
    assert listed.stdout.split() == [s.prefix for s in present]


def test_only_optional_kernels_may_be_missing_from_a_full_build(tmp_path, monkeypatch):
    """build() without allow_missing: a missing optional kernel is skipped, a required one fails."""
    compiled = []
    monkeypatch.setattr(build.concurrent.futures, "ProcessPoolExecutor", _InlinePool)
    monkeypatch.setattr(build, "_compile_one",
                        lambda spec, module, out: compiled.append(spec) or {"prefix": spec.prefix,
                                                                            "seconds": 0.0})
    monkeypatch.setattr(specs, "selected_archs", lambda: ("sm_90a",))
    report = build.build(tmp_path / "out", 1, "jax_kda.kernels", allow_missing=False)
    baseline_present = specs.kernel_source_present("recurrence_baseline")
    assert ("jax_kda_recurrence_baseline_sm90a" in report["skipped"]) != baseline_present
    assert {s.kernel for s in compiled} == {"prepare", "recurrence"} | (
        {"recurrence_baseline"} if baseline_present else set())
    with pytest.raises(SystemExit, match="jax_kda.no_such_kernels.prepare not found"):
        build.build(tmp_path / "out2", 1, "jax_kda.no_such_kernels", allow_missing=False)


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
