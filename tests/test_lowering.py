"""Lowering of the two custom calls for CUDA, checked on CPU (no GPU, no library needed).

What the handlers decode is fixed here: target names, operand order and row-major layouts,
attribute names and 32-bit types, the workspace shape of docs/kernel_abi.md, and the
final-state alias.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kda import _ffi, contract

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


def _avals(total, heads, seqs):
    S = jax.ShapeDtypeStruct
    token = S((total, heads, 128), BF16)
    return {
        "q": token, "k": token, "g": token, "v": token,
        "beta": S((total, heads), BF16), "A_log": S((heads,), F32), "dt_bias": S((heads, 128), F32),
        "cu_seqlens": S((seqs + 1,), I32), "state0": S((seqs, heads, 128, 128), BF16),
    }


def _launch(block_v):
    """The launch whose block_v attribute is `block_v` (contract.BASELINE_BLOCK_V: baseline)."""
    return "baseline" if block_v == contract.BASELINE_BLOCK_V else block_v


def _lower_both(total, heads, seqs, *, inverse="stable", block_v=32, scale=0.125,
                lower_bound=-5.0, alias_state=True):
    def prefill(q, k, g, v, beta, A_log, dt_bias, cu_seqlens, state0):
        workspace = _ffi.prepare_call(q, k, g, beta, A_log, dt_bias, cu_seqlens, scale=scale,
                                      lower_bound=lower_bound, inverse=inverse)
        return _ffi.recurrence_call(v, beta, workspace, cu_seqlens, state0,
                                    launch=_launch(block_v), alias_state=alias_state)

    a = _avals(total, heads, seqs)
    args = [a[n] for n in ("q", "k", "g", "v", "beta", "A_log", "dt_bias", "cu_seqlens", "state0")]
    return jax.jit(prefill).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text):
    """{target: the full custom_call line} for every custom call in the module."""
    calls = {}
    for line in text.splitlines():
        match = re.search(r"stablehlo\.custom_call @(\w+)\(", line)
        if match:
            assert match.group(1) not in calls, f"{match.group(1)} emitted twice"
            calls[match.group(1)] = line
    return calls


@pytest.mark.parametrize("total,heads,seqs", [(40, 2, 2), (33, 12, 3), (7, 1, 1), (2048, 6, 1)])
def test_two_versioned_custom_calls_with_abi_shapes(total, heads, seqs):
    calls = _custom_calls(_lower_both(total, heads, seqs))
    assert set(calls) == {"jax_kda_prepare_v1", "jax_kda_recurrence_v1"}
    slots = math.ceil(total / 16) + seqs  # docs/kernel_abi.md: S = ceil(T_total / 16) + N
    workspace = f"tensor<{heads}x{slots}x13824xui8>"
    token, beta = f"tensor<{total}x{heads}x128xbf16>", f"tensor<{total}x{heads}xbf16>"
    state = f"tensor<{seqs}x{heads}x128x128xbf16>"
    prepare_sig = (f"({token}, {token}, {token}, {beta}, tensor<{heads}xf32>, "
                   f"tensor<{heads}x128xf32>, tensor<{seqs + 1}xi32>) -> {workspace}")
    assert prepare_sig in calls["jax_kda_prepare_v1"]
    recurrence_sig = (f"({token}, {beta}, {workspace}, tensor<{seqs + 1}xi32>, {state}) -> "
                      f"({token}, {state})")
    assert recurrence_sig in calls["jax_kda_recurrence_v1"]


def test_recurrence_consumes_the_prepare_result():
    text = _lower_both(40, 2, 2)
    prepare_result = re.search(r"(%\w+) = stablehlo\.custom_call @jax_kda_prepare_v1",
                               text).group(1)
    operands = re.search(r"custom_call @jax_kda_recurrence_v1\(([^)]*)\)", text).group(1)
    assert [o.strip() for o in operands.split(",")][2] == prepare_result


def test_row_major_operand_and_result_layouts():
    calls = _custom_calls(_lower_both(40, 2, 2))
    rank3, rank2, rank1, rank4 = ("dense<[2, 1, 0]> : tensor<3xindex>",
                                  "dense<[1, 0]> : tensor<2xindex>",
                                  "dense<0> : tensor<1xindex>",
                                  "dense<[3, 2, 1, 0]> : tensor<4xindex>")
    expected = {
        "jax_kda_prepare_v1": ([rank3, rank3, rank3, rank2, rank1, rank2, rank1], [rank3]),
        "jax_kda_recurrence_v1": ([rank3, rank2, rank3, rank1, rank4], [rank3, rank4]),
    }
    for target, (operands, results) in expected.items():
        line = calls[target]
        assert f"operand_layouts = [{', '.join(operands)}]" in line, target
        assert f"result_layouts = [{', '.join(results)}]" in line, target


@pytest.mark.parametrize("inverse,inverse_id", [("stable", 0), ("neumann", 1)])
def test_prepare_attributes_are_f32_and_i32(inverse, inverse_id):
    # Python ints/floats on purpose: the wrapper must still emit 32-bit attributes.
    calls = _custom_calls(_lower_both(40, 2, 2, inverse=inverse, scale=1, lower_bound=-2))
    line = calls["jax_kda_prepare_v1"]
    assert f"inverse = {inverse_id} : i32" in line
    assert re.search(r"scale = 1\.0+e\+00 : f32", line)
    assert re.search(r"lower_bound = -2\.0+e\+00 : f32", line)
    assert not re.search(r": (i64|f64)", line)


@pytest.mark.parametrize("block_v", [16, 32, 64, 128, 0])  # 0: the baseline kernel
def test_recurrence_block_v_attribute_is_i32(block_v):
    line = _custom_calls(_lower_both(40, 2, 2, block_v=block_v))["jax_kda_recurrence_v1"]
    assert f"block_v = {block_v} : i32" in line
    assert not re.search(r": (i64|f64)", line)


@pytest.mark.parametrize("recurrence", ["auto", 64])
def test_kda_prefill_recurrence_option_picks_the_kernel(monkeypatch, recurrence):
    """recurrence="baseline" emits the same recurrence custom call with block_v = 0; "auto" (the
    heuristic's choice here) or a column count emits that column split."""
    import jax_kda
    from jax_kda import _launch, api

    monkeypatch.setattr(api, "_require_kernels", lambda: None)  # lowering needs no GPU
    B, T, H = 2, 40, 3
    S = jax.ShapeDtypeStruct
    args = [S((B, T, H, 128), BF16)] * 4 + [S((B, T, H), BF16), S((H,), F32), S((H, 128), F32)]

    def lower(**options):
        fn = lambda *a: jax_kda.kda_prefill(*a, backend="kernel", output_final_state=True,
                                            **options)
        return _custom_calls(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text())

    baseline = lower(recurrence="baseline")
    assert set(baseline) == {"jax_kda_prepare_v1", "jax_kda_recurrence_v1"}
    assert f"block_v = {contract.BASELINE_BLOCK_V} : i32" in baseline["jax_kda_recurrence_v1"]
    assert contract.BASELINE_BLOCK_V == 0
    split = lower(recurrence=recurrence)["jax_kda_recurrence_v1"]
    want = _launch.choose_block_v(num_seqs=B, heads=H) if recurrence == "auto" else recurrence
    assert f"block_v = {want} : i32" in split
    # the prepare call does not depend on the recurrence kernel
    assert baseline["jax_kda_prepare_v1"] == lower()["jax_kda_prepare_v1"]


def test_default_recurrence_runs_the_baseline_for_many_short_sequences(monkeypatch):
    """recurrence="auto" (the default): 48 sequences of 64 tokens x 4 heads (192 pairs on a
    132-SM H200, <= 1024 tokens each) lower to the baseline kernel; the same call on a state pool
    (which the baseline kernel does not serve) to the column split."""
    import jax_kda
    from jax_kda import api

    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    monkeypatch.setattr(jax_kda._launch, "gpu_sm_count", lambda: 132)
    B, T, H = 48, 64, 4
    S = jax.ShapeDtypeStruct
    args = [S((B, T, H, 128), BF16)] * 4 + [S((B, T, H), BF16), S((H,), F32), S((H, 128), F32)]
    pool = S((B, H, 128, 128), BF16)

    def lower(**options):
        fn = lambda *a, **kw: jax_kda.kda_prefill(*a, **kw, backend="kernel",
                                                  output_final_state=True)
        return jax.jit(fn).trace(*args, **options).lower(lowering_platforms=("cuda",)).as_text()

    assert f"block_v = {contract.BASELINE_BLOCK_V} : i32" in _custom_calls(lower())[
        "jax_kda_recurrence_v1"]
    pooled = lower(initial_state=pool, state_indices=S((B,), jnp.int32))
    assert re.findall(r"block_v = (\d+) : i32", pooled) == ["64"]


def test_final_state_aliases_initial_state_on_request():
    aliased = _custom_calls(_lower_both(40, 2, 2))["jax_kda_recurrence_v1"]
    assert re.search(r"output_operand_alias<output_tuple_indices = \[1\], operand_index = 4,",
                     aliased)
    plain = _custom_calls(_lower_both(40, 2, 2, alias_state=False))["jax_kda_recurrence_v1"]
    assert "output_operand_alias" not in plain


def test_int64_cu_seqlens_are_passed_as_int32():
    a = _avals(40, 2, 2)
    cu64 = jax.ShapeDtypeStruct((3,), np.int64)

    def prepare(q, beta, A_log, dt_bias, cu):
        return _ffi.prepare_call(q, q, q, beta, A_log, dt_bias, cu, scale=0.1, lower_bound=-5.0,
                                 inverse="stable")

    with jax.enable_x64(True):
        text = jax.jit(prepare).trace(a["q"], a["beta"], a["A_log"], a["dt_bias"], cu64).lower(
            lowering_platforms=("cuda",)).as_text()
    line = _custom_calls(text)["jax_kda_prepare_v1"]
    assert "tensor<3xi32>) -> tensor<2x5x13824xui8>" in line


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"q": jax.ShapeDtypeStruct((40, 2, 128), F32)}, TypeError, "q: expected dtype bfloat16"),
        ({"k": jax.ShapeDtypeStruct((40, 3, 128), BF16)}, ValueError,
         r"k: expected shape \(40, 2, 128\)"),
        ({"beta": jax.ShapeDtypeStruct((40, 2, 1), BF16)}, ValueError, "beta: expected shape"),
        ({"A_log": jax.ShapeDtypeStruct((2,), BF16)}, TypeError, "A_log: expected dtype float32"),
        ({"cu_seqlens": jax.ShapeDtypeStruct((1,), I32)}, ValueError, "N >= 1"),
    ],
)
def test_prepare_wrapper_rejects_bad_operands(change, error, match):
    a = {**_avals(40, 2, 2), **change}

    def prepare(q, k, g, beta, A_log, dt_bias, cu):
        return _ffi.prepare_call(q, k, g, beta, A_log, dt_bias, cu, scale=0.1, lower_bound=-5.0,
                                 inverse="stable")

    with pytest.raises(error, match=match):
        jax.jit(prepare).trace(a["q"], a["k"], a["g"], a["beta"], a["A_log"], a["dt_bias"],
                               a["cu_seqlens"])


def test_recurrence_wrapper_rejects_wrong_workspace_and_unresolved_launches():
    a = _avals(40, 2, 2)
    bad_ws = jax.ShapeDtypeStruct((2, 4, 13824), jnp.uint8)  # S must be ceil(40/16) + 2 = 5
    with pytest.raises(ValueError, match="workspace: expected shape"):
        jax.jit(lambda *x: _ffi.recurrence_call(*x, launch=_launch(32))).trace(
            a["v"], a["beta"], bad_ws, a["cu_seqlens"], a["state0"])
    good_ws = jax.ShapeDtypeStruct((2, 5, 13824), jnp.uint8)
    for bad in ("auto", 48, None, True):
        with pytest.raises(ValueError, match=r"launch: expected 'baseline' or one of"):
            jax.jit(lambda *x, bad=bad: _ffi.recurrence_call(*x, launch=bad)).trace(
                a["v"], a["beta"], good_ws, a["cu_seqlens"], a["state0"])
