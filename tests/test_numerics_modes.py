"""kda_prefill / kda_decode with numerics="fp32", on the CPU: the reference path computes
jax_kda.reference_fp32's arithmetic, pools and decode follow the pool conventions, bad
combinations fail at trace time naming the argument, and the kernel path lowers to the fp32
mode's own custom calls (23,040-byte records, f32 states) while the default mode's lowering is
unchanged."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import bits, make_inputs, random_states

import jax_kda
from jax_kda import _kernel_path, contract, reference_fp32
from jax_kda.problem import Problem

SCALE, LOWER = 128**-0.5, -5.0


def reference(a, **kw):
    """The fp32 reference under jit (as the API runs it: eager dispatch reassociates nothing,
    but XLA's fusions may, so both sides are compiled)."""
    return jax.jit(lambda a, kw: reference_fp32.kda_prefill_reference_fp32(
        **a, **kw, scale=SCALE, lower_bound=LOWER))(a, kw)


@pytest.mark.parametrize("state_dtype", [None, jnp.bfloat16, jnp.float32])
def test_reference_backend_is_the_fp32_reference(state_dtype):
    rng = np.random.default_rng()
    a = make_inputs(rng, 2, 37, 2, regime="strong")
    kw = {}
    if state_dtype is not None:
        kw["initial_state"] = random_states(rng, 2, 2, state_dtype)
    out, final = jax_kda.kda_prefill(**a, **kw, output_final_state=True, numerics="fp32",
                                     backend="reference")
    want_out, want_final = reference(a, **kw)
    # no initial state: f32 (the mode's precision); else the initial state's dtype
    assert final.dtype == (state_dtype or jnp.float32)
    np.testing.assert_array_equal(bits(out), bits(want_out))
    np.testing.assert_array_equal(bits(final), bits(want_final.astype(final.dtype)))
    # and it is not the default mode's arithmetic
    default_out, _ = jax_kda.kda_prefill(**a, **kw, output_final_state=True, backend="reference")
    assert not np.array_equal(bits(out), bits(default_out))


def test_pool_rows_padding_and_untouched_rows():
    rng = np.random.default_rng()
    a = make_inputs(rng, 3, 20, 2, regime="strong")
    pool = random_states(rng, 6, 2, jnp.float32)
    idx = jnp.asarray([4, -1, 1], jnp.int32)
    out, new_pool = jax_kda.kda_prefill(**a, initial_state=pool, state_indices=idx,
                                        output_final_state=True, numerics="fp32",
                                        backend="reference")
    want_out, want_final = reference(a, initial_state=pool[jnp.asarray([4, 0, 1])])
    for n, row in ((0, 4), (2, 1)):
        np.testing.assert_array_equal(bits(out[n]), bits(want_out[n]))
        np.testing.assert_array_equal(bits(new_pool[row]), bits(want_final[n]))
    assert not np.asarray(out[1].astype(jnp.float32)).any()  # padding slot: zero outputs
    for row in (0, 2, 3, 5):  # rows no sequence owns
        np.testing.assert_array_equal(bits(new_pool[row]), bits(pool[row]))


def test_decode_is_prefill_on_the_tokens():
    rng = np.random.default_rng()
    a = make_inputs(rng, 3, 5, 2, regime="strong")
    pool = random_states(rng, 4, 2, jnp.float32)
    idx = jnp.asarray([2, 0, -1], jnp.int32)
    out, new_pool = jax_kda.kda_decode(**a, state=pool, state_indices=idx, numerics="fp32",
                                       backend="reference")
    want_out, want_pool = jax_kda.kda_prefill(**a, initial_state=pool, state_indices=idx,
                                              output_final_state=True, numerics="fp32",
                                              backend="reference")
    np.testing.assert_array_equal(bits(out), bits(want_out))
    np.testing.assert_array_equal(bits(new_pool), bits(want_pool))


@pytest.mark.parametrize("bad, message", [
    ({"numerics": "bf16"}, "numerics must be one of"),
    ({"numerics": None}, "numerics must be one of"),
    ({"numerics": "fp32", "inverse": "neumann"}, "inverse='neumann'"),
    ({"numerics": "fp32", "recurrence": "baseline"}, "recurrence='baseline'"),
    ({"numerics": "fp32", "checkpoint_every": 16, "sequence_parallel": 2},
     "sequence_parallel segments and checkpoint_every"),
])
def test_bad_combinations_name_the_argument(bad, message):
    a = make_inputs(np.random.default_rng(0), 1, 16, 1, regime="strong")
    with pytest.raises(ValueError, match=re.escape(message)):
        jax_kda.kda_prefill(**a, **bad)


def _decode_with_states(a, pool, idx, **kw):
    return jax.jit(lambda a, p: jax_kda.kda_decode(
        **{k: a[k] for k in DECODE_ARGS}, state=p, state_indices=idx, scale=SCALE,
        lower_bound=LOWER, numerics="fp32", output_intermediate_states=True, **kw))(a, pool)


DECODE_ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def _prefix_final_states(a, prefixes, states):
    """The fp32 prefill's final state on each token range (batch row, start, length) of a, from
    its initial state in states [len(prefixes), H, 128, 128]: one packed call (a packed sequence
    is the sequence alone, bit for bit: tests/test_reference_fp32.py)."""
    tokens = {k: (jnp.concatenate([x[b:b + 1, start:start + length]
                                   for b, start, length in prefixes], axis=1)
                  if x.ndim >= 3 else x) for k, x in a.items()}
    cu = jnp.asarray(np.cumsum([0] + [length for *_, length in prefixes]), jnp.int32)
    _, final = jax.jit(lambda a, s, c: jax_kda.kda_prefill(
        **a, initial_state=s, cu_seqlens=c, output_final_state=True, scale=SCALE,
        lower_bound=LOWER, numerics="fp32"))(tokens, states, cu)
    return final


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp32_decode_intermediate_states_are_prefix_prefills(dtype):
    """Reference backend: state i == the fp32 prefill's final state on the first i + 1 tokens,
    out and the pool as kda_decode without them; a padding slot gets zeros."""
    rng = np.random.default_rng()
    a = make_inputs(rng, 3, 5, 2, regime="strong")
    pool = random_states(rng, 4, 2, dtype)
    idx = jnp.asarray([2, -1, 0], jnp.int32)
    out, new_pool, states = _decode_with_states(a, pool, idx)
    assert states.shape == (3, 5, 2, 128, 128) and states.dtype == dtype
    plain_out, plain_pool = jax.jit(lambda a, p: jax_kda.kda_decode(
        **a, state=p, state_indices=idx, scale=SCALE, lower_bound=LOWER, numerics="fp32"))(
        a, pool)
    np.testing.assert_array_equal(bits(out), bits(plain_out))
    np.testing.assert_array_equal(bits(new_pool), bits(plain_pool))
    owners = ((0, 2), (2, 0))  # (sequence, pool row)
    prefixes = [(n, 0, i + 1) for n, _ in owners for i in range(5)]
    finals = _prefix_final_states(a, prefixes, pool[np.repeat([row for _, row in owners], 5)])
    for (n, _, length), final in zip(prefixes, finals, strict=True):
        np.testing.assert_array_equal(bits(states[n, length - 1]), bits(final))
    for n, row in owners:
        np.testing.assert_array_equal(bits(states[n, -1]), bits(new_pool[row]))
    assert not np.asarray(states[1].astype(jnp.float32)).any()
    assert not np.asarray(out[1].astype(jnp.float32)).any()


def _lowered_calls(monkeypatch, numerics, state_dtype=jnp.bfloat16, pooled=False,
                   checkpoint_every=None):
    monkeypatch.setattr(jax_kda.api, "_require_kernels", lambda: None)  # lowering needs no library
    B, T, H = 2, 40, 3
    S = jax.ShapeDtypeStruct
    tok = S((B, T, H, 128), jnp.bfloat16)
    args = (tok, tok, tok, tok, S((B, T, H), jnp.bfloat16), S((H,), jnp.float32),
            S((H, 128), jnp.float32), S((5 if pooled else B, H, 128, 128), state_dtype))
    idx = jnp.asarray([3, 1], jnp.int32) if pooled else None

    def f(q, k, v, g, beta, A_log, dt_bias, state):
        return jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state=state,
                                   state_indices=idx, output_final_state=True,
                                   checkpoint_every=checkpoint_every, backend="kernel",
                                   numerics=numerics)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return {m.group(1): line for line in text.splitlines()
            if (m := re.search(r"stablehlo\.custom_call @(\w+)\(", line))}


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.float32])
def test_fp32_mode_lowers_to_its_own_calls(monkeypatch, state_dtype):
    calls = _lowered_calls(monkeypatch, "fp32", state_dtype)
    assert set(calls) == {contract.PREPARE_FP32_TARGET, contract.RECURRENCE_FP32_TARGET}
    slots = contract.workspace_slots(80, 2)
    workspace = f"tensor<3x{slots}x{contract.FP32_RECORD_BYTES}xui8>"
    assert workspace in calls[contract.PREPARE_FP32_TARGET]
    rec = calls[contract.RECURRENCE_FP32_TARGET]
    assert "tensor<2x3x128x128xf32>" in rec and "bf16" in rec  # f32 states, bf16 v / out
    assert "2x3x128x128xbf16" not in rec
    assert re.search(r"block_v = (16|32|64|128) : i32", rec)


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("pooled,checkpoint_every", [(True, None), (False, 16), (True, 32)])
def test_fp32_pools_and_checkpoints_lower_to_the_fp32_pool_call(monkeypatch, state_dtype, pooled,
                                                               checkpoint_every):
    """A pool (updated in place: the pool operand aliases its result) or checkpoints in the fp32
    mode: the fp32 pool recurrence with the pool's own dtype and the fp32 record."""
    calls = _lowered_calls(monkeypatch, "fp32", state_dtype, pooled, checkpoint_every)
    assert set(calls) == {contract.PREPARE_FP32_TARGET, contract.RECURRENCE_FP32_POOL_TARGET}
    rec = calls[contract.RECURRENCE_FP32_POOL_TARGET]
    dt = "f32" if state_dtype == jnp.float32 else "bf16"
    assert f"x{contract.FP32_RECORD_BYTES}xui8>" in rec
    assert f"tensor<{5 if pooled else 2}x3x128x128x{dt}>" in rec
    assert f"checkpoint_chunks = {(checkpoint_every or 0) // 16} : i32" in rec
    assert "output_operand_aliases" in rec


def test_default_mode_still_lowers_to_the_flashkda_calls(monkeypatch):
    calls = _lowered_calls(monkeypatch, "flashkda")
    assert set(calls) == {contract.PREPARE_TARGET, contract.RECURRENCE_TARGET}
    assert f"x{contract.RECORD_BYTES}xui8" in calls[contract.PREPARE_TARGET]


def test_kernel_path_widens_a_bf16_state_for_the_fp32_recurrence(monkeypatch):
    """The fp32 recurrence takes and returns f32 states: a bf16 initial state is widened
    exactly and the result rounded once to the state dtype the caller asked for."""
    seen = {}

    def fake_recurrence(v, beta, workspace, cu, state0, *, launch, numerics, **_):
        seen.update(state_dtype=state0.dtype, numerics=numerics, launch=launch)
        return jnp.zeros(v.shape, jnp.bfloat16), state0 + 1
    monkeypatch.setattr(jax_kda._ffi, "recurrence_call", fake_recurrence)
    problem = Problem(batch=1, seqlen=16, heads=2, num_seqs=1, varlen=False,
                      state_dtype=np.dtype(jnp.bfloat16), scale=SCALE, lower_bound=LOWER,
                      numerics="fp32")
    state = jnp.full((1, 2, 128, 128), 0.5, jnp.bfloat16)
    _, final = _kernel_path.plain_recurrence(
        jnp.zeros((1, 16, 2, 128), jnp.bfloat16), jnp.zeros((1, 16, 2), jnp.bfloat16), None,
        jnp.asarray([0, 16], jnp.int32), state, problem=problem,
        launch=32)
    assert seen["state_dtype"] == jnp.float32 and seen["numerics"] == "fp32"
    assert final.dtype == jnp.bfloat16 and float(final[0, 0, 0, 0]) == 1.5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp32_checkpoints_are_prefix_prefills(dtype):
    """checkpoint_every in the fp32 mode (reference backend), packed sequences on a pool with a
    padding slot and an empty sequence: row checkpoint_offsets[s] + j is bitwise the fp32
    prefill's final state on the first (j + 1) n tokens of sequence s; the padding slot's rows are
    zero; out and pool as without checkpoints."""
    rng = np.random.default_rng()
    cu = np.array([0, 40, 40, 77, 90], np.int32)
    n, idx = 16, jnp.asarray([2, 0, -1, 3], jnp.int32)
    a = make_inputs(rng, 1, int(cu[-1]), 2, regime="strong")
    pool = random_states(rng, 4, 2, dtype)
    kw = {"cu_seqlens": jnp.asarray(cu), "initial_state": pool, "state_indices": idx,
          "output_final_state": True, "scale": SCALE, "lower_bound": LOWER, "numerics": "fp32"}
    out, new_pool, ckpts = jax.jit(lambda a: jax_kda.kda_prefill(**a, **kw, checkpoint_every=n))(a)
    plain_out, plain_pool = jax.jit(lambda a: jax_kda.kda_prefill(**a, **kw))(a)
    np.testing.assert_array_equal(bits(out), bits(plain_out))
    np.testing.assert_array_equal(bits(new_pool), bits(plain_pool))
    offsets = np.asarray(jax_kda.checkpoint_offsets(cu, n))
    assert ckpts.dtype == dtype and ckpts.shape[0] >= offsets[-1]
    np.testing.assert_array_equal(offsets, [0, 2, 2, 4, 4])  # 16, 32 of 40 and of 37 tokens
    rows, prefixes, owners = [], [], []  # checkpoint row, (0, start, length), pool row
    for s in range(len(cu) - 1):
        for j in range(offsets[s + 1] - offsets[s]):
            row = offsets[s] + j
            if int(idx[s]) < 0:
                assert not np.asarray(ckpts[row].astype(jnp.float32)).any()
                continue
            rows.append(row)
            prefixes.append((0, int(cu[s]), (j + 1) * n))
            owners.append(int(idx[s]))
    finals = _prefix_final_states(a, prefixes, pool[np.asarray(owners)])
    for row, final in zip(rows, finals, strict=True):
        np.testing.assert_array_equal(bits(ckpts[row]), bits(final))
