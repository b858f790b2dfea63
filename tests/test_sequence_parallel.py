"""Sequence parallelism of the fp32 mode (jax_kda._sequence_parallel), on the CPU with the
reference backend: segments agree with the serial fp32 mode to f32 level and are as accurate
against the float64 oracle; one segment and "auto" are the serial mode bit for bit; the kernel
path lowers to the fp32 custom calls; bad arguments fail naming sequence_parallel."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda import _sequence_parallel, contract, oracle
from jax_kda.bench import regimes


def run(a, state, segments):
    return jax.jit(lambda a, s: jax_kda.kda_prefill(
        **a, initial_state=s, output_final_state=True, numerics="fp32", backend="reference",
        sequence_parallel=segments))(a, state)


def rel(got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want).astype(jnp.float32), np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


@pytest.mark.parametrize("regime,B,T,segments", [("slow", 2, 300, 4), ("keep32", 1, 1024, 8),
                                                 ("fla", 1, 520, 3), ("slow", 1, 1024, 16)])
def test_segments_agree_with_serial_and_are_as_accurate(regime, B, T, segments):
    rng = np.random.default_rng(segments)
    a = regimes.make_inputs(rng, T, 2, regime, "normal", B=B)
    state = jnp.asarray(rng.standard_normal((B, 2, 128, 128)) * 0.1, jnp.float32)
    serial_out, serial_state = run(a, state, "off")
    out, final = run(a, state, segments)
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    equal = float(np.mean(np.asarray(out) == np.asarray(serial_out)))
    assert rel(out, serial_out) <= 5e-4 and equal >= 0.97, (rel(out, serial_out), equal)
    assert rel(final, serial_state) <= 1e-4
    want_out, want_state = oracle.kda_prefill_oracle(
        **{k: np.asarray(v.astype(jnp.float32)) for k, v in a.items()},
        initial_state=np.asarray(state))
    assert rel(out, want_out) <= 1.1 * rel(serial_out, want_out)
    assert rel(final, want_state) <= 1.1 * rel(serial_state, want_state)


def test_one_segment_and_auto_are_the_serial_mode():
    rng = np.random.default_rng(0)
    a = regimes.make_inputs(rng, 100, 1, "fla", "normal", B=2)
    state = jnp.zeros((2, 1, 128, 128), jnp.float32)
    serial = run(a, state, "off")
    for same in (1, "auto"):
        for x, y in zip(run(a, state, same), serial):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_segments_hold_whole_chunks_and_cover_the_sequence():
    for T in (1, 15, 16, 17, 300, 8192):
        for n in (1, 2, 3, 7, 64):
            length = _sequence_parallel.segment_length(T, n)
            assert length % contract.CHUNK == 0 and length > 0
            assert -(-T // length) <= n and -(-T // length) * length >= T


@pytest.mark.parametrize("bad, message", [
    (dict(sequence_parallel=4), "numerics='fp32'"),
    (dict(sequence_parallel=0, numerics="fp32"), "segment count"),
    (dict(sequence_parallel=True, numerics="fp32"), "segment count"),
    (dict(sequence_parallel="on", numerics="fp32"), "sequence_parallel must be"),
    (dict(sequence_parallel=2, numerics="fp32", cu_seqlens=jnp.asarray([0, 16], jnp.int32)),
     "batched input"),
])
def test_bad_arguments_name_sequence_parallel(bad, message):
    a = regimes.make_inputs(np.random.default_rng(0), 16, 1)
    with pytest.raises(ValueError, match=re.escape(message)):
        jax_kda.kda_prefill(**a, **bad)


def test_kernel_path_runs_three_serial_prefills_of_the_segments(monkeypatch):
    monkeypatch.setattr(jax_kda.api, "_require_kernels", lambda: None)  # lowering needs no library
    S = jax.ShapeDtypeStruct
    tok = S((2, 512, 3, 128), jnp.bfloat16)
    args = (tok, tok, tok, tok, S((2, 512, 3), jnp.bfloat16), S((3,), jnp.float32),
            S((3, 128), jnp.float32))
    f = lambda *x: jax_kda.kda_prefill(*x, backend="kernel", numerics="fp32",
                                       output_final_state=True, sequence_parallel=4)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(jax_kda_\w+)\(", text)
    assert sorted(calls) == sorted([contract.PREPARE_FP32_TARGET] * 3
                                   + [contract.RECURRENCE_FP32_TARGET] * 3)
    # 2 sequences x 4 segments of 128 tokens: 8 packed sequences, f32 states
    assert "tensor<8x3x128x128xf32>" in text
