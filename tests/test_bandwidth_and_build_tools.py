"""The tools behind BENCHMARKS.md's prepare-bandwidth section, on CPU: the byte count the bandwidth
is computed from, and the build-against-build bitwise comparison (which must notice one flipped
bit or a missing array)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np

from jax_kda import contract
from jax_kda.bench import inputs
from jax_kda.bench.cases import Case

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "scripts")]

import build_outputs
import prepare_bandwidth


def test_prepare_bytes_are_the_inputs_read_and_the_records_written():
    case = Case((37, 0, 16, 5), 3, layout="varlen")
    x = inputs.to_jax(inputs.make_inputs(case), case)
    read = sum(x[k].size * x[k].dtype.itemsize for k in ("q", "k", "g", "beta"))
    chunks = 3 + 0 + 1 + 1  # ceil(37 / 16), an empty sequence, 16, 5
    for numerics in contract.NUMERICS:
        want = read + case.heads * chunks * contract.record_bytes(numerics)
        assert prepare_bandwidth.prepare_bytes(case, numerics) == want


def test_build_compare_notices_one_flipped_bit_and_a_missing_array(tmp_path, capsys):
    rng = np.random.default_rng()
    arrays = {"a/out": rng.integers(0, 256, 1000, dtype=np.uint8),
              "b/state": rng.integers(0, 256, 64, dtype=np.uint8)}
    np.savez(tmp_path / "x.npz", **arrays)
    np.savez(tmp_path / "same.npz", **{k: v.copy() for k, v in arrays.items()})
    assert build_outputs.compare(tmp_path / "x.npz", tmp_path / "same.npz") == 0
    flipped = {k: v.copy() for k, v in arrays.items()}
    flipped["a/out"][rng.integers(1000)] ^= np.uint8(1 << rng.integers(8))
    np.savez(tmp_path / "flipped.npz", **flipped)
    assert build_outputs.compare(tmp_path / "x.npz", tmp_path / "flipped.npz") == 1
    assert "DIFF a/out" in capsys.readouterr().out
    np.savez(tmp_path / "missing.npz", **{"a/out": arrays["a/out"]})
    assert build_outputs.compare(tmp_path / "x.npz", tmp_path / "missing.npz") == 1
