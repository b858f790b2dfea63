"""The fp32 numerics mode's GPU kernels (marker gpu): kernel vs reference, kernel vs kernel,
kernel vs the float64 oracle, pools and decode.

- kernel vs jax_kda.reference_fp32 (which mirrors every step, docs/fp32_mode.md section 6): only
  the f32 addition order inside the MMA chains and the approximate functions' last bits differ,
  and nothing in between is rounded to bf16, so the results agree to f32 level. Bounds: out
  relative RMSE <= 5e-4 with >= 97 % of the elements bit-equal; final state relative RMSE <= 1e-4.
- the prepare kernel's record vs the reference's prepare, field by field: each hi + lo pair within
  3e-5 relative RMSE of the reference's value (H200: <= 7.5e-6), kd (stored without lo) within
  5e-4, >= 99 % of the hi parts bit-equal.
- kernel vs kernel: every column split gives the same bits, run to run too; packed sequences equal
  the sequences run alone; a zero-length sequence returns its f32 initial state bit for bit.
- kernel vs float64 oracle: out <= 3.0e-3 and final state <= 2.5e-3 relative RMSE in the gate
  regimes of docs/fp32_mode.md, and at least 1.5x (out) / 1.8x (state) below the default mode's
  error.
- decode: with output_intermediate_states, state i is bitwise the kernel prefill's final state on
  the first i + 1 tokens (bf16 and f32 pools, a padding slot). The fused fp32 decode kernel: out
  and the pool rows bitwise the prefill kernels' (t = 1 .. 16, gate regimes with slow-decay and
  never-forgetting channels, grouped heads), padding slots and rows not indexed as they must be.
The measured figures are printed (pytest -s).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import bits, make_inputs, random_states

import jax_kda
from jax_kda import _ffi, contract, oracle, reference_fp32
from jax_kda.kernels import workspace_layout

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_gpus")]

SCALE, LOWER = 128**-0.5, -5.0
FP32 = {"numerics": "fp32"}


def compare(name, got, want):
    """(relative RMSE, fraction of bit-equal elements), printed."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want).astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), f"{name}: non-finite kernel output"
    rel = float(np.sqrt(np.mean((got - want) ** 2) / max(np.mean(want**2), 1e-30)))
    equal = float(np.mean(got == want)) if got.size else 1.0
    print(f"\n  {name}: rel RMSE {rel:.2e}, bit-equal {equal:.4f}")
    return rel, equal


def prefill(backend, **options):
    return jax.jit(lambda a, extra: jax_kda.kda_prefill(
        **a, **extra, backend=backend, output_final_state=True, numerics="fp32", **options))


def run_both(args, **arrays):
    """(kernels on the GPU, fp32 reference on the CPU)."""
    cpu = jax.devices("cpu")[0]
    return (prefill("kernel")(args, arrays),
            prefill("reference")(*jax.device_put((args, arrays), cpu)))


CASES = [  # (B, T, H, cu_seqlens or None)
    (2, 100, 3, None),
    (1, 15, 2, None),
    (1, 445, 3, [0, 37, 37, 38, 168, 184, 189, 445]),  # empty, length 1, not multiples of 16
]


@pytest.mark.parametrize("init_dtype", [None, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}{'varlen' if c[3] else ''}")
def test_kernel_matches_fp32_reference(case, init_dtype):
    B, T, H, cu = case
    rng = np.random.default_rng()
    args = make_inputs(rng, B, T, H, regime="fla")
    N = B if cu is None else len(cu) - 1
    arrays = {}
    if cu is not None:
        arrays["cu_seqlens"] = jnp.asarray(cu, jnp.int32)
    if init_dtype is not None:
        arrays["initial_state"] = random_states(rng, N, H, init_dtype)
    (out_k, st_k), (out_r, st_r) = run_both(args, **arrays)
    assert out_k.dtype == jnp.bfloat16 and st_k.dtype == st_r.dtype == (init_dtype or jnp.float32)
    rel, equal = compare("out", out_k, out_r)
    assert rel <= 5e-4 and equal >= 0.97
    rel, _ = compare("final state", st_k, st_r)
    assert rel <= (1e-4 if init_dtype != jnp.bfloat16 else 4e-3)  # bf16: one rounding at the end


def test_prepare_record_matches_reference():
    rng = np.random.default_rng()
    T, H = 77, 2
    cu = np.array([0, 20, 21, 77], np.int32)
    a = make_inputs(rng, 1, T, H, regime="fla")
    flat = {k: v[0] for k, v in a.items() if k in ("q", "k", "g", "beta")}
    ws = jax.jit(lambda f: _ffi.prepare_call(
        f["q"], f["k"], f["g"], f["beta"], a["A_log"], a["dt_bias"], jnp.asarray(cu),
        scale=SCALE, lower_bound=LOWER, inverse="stable", numerics="fp32"))(flat)
    assert ws.shape[-1] == contract.FP32_RECORD_BYTES
    decoded = workspace_layout.decode_fp32_workspace(np.asarray(ws), cu)
    for n in range(len(cu) - 1):
        lo, hi = cu[n], cu[n + 1]
        C = -(-(hi - lo) // 16)
        pad = C * 16 - (hi - lo)

        def chunked(x):
            x = np.asarray(x[0, lo:hi].astype(jnp.float32))
            x = np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
            return jnp.asarray(np.moveaxis(x.reshape((C, 16) + x.shape[1:]), 2, 0), jnp.bfloat16)

        valid = jnp.asarray(np.arange(C * 16).reshape(C, 16) < hi - lo)
        want = reference_fp32.prepare_reference_fp32(
            chunked(a["q"]), chunked(a["k"]), chunked(a["g"]), chunked(a["beta"]),
            a["A_log"][:, None], a["dt_bias"][:, None, :], scale=SCALE, lower_bound=LOWER,
            valid=valid[None])
        sel = decoded["seq"] == n
        for field in ("kd", "qd", "kr", "inv", "mqk"):
            pair = getattr(want, field)
            # the value each pair stands for: hi + lo (hi alone where the record keeps no lo)
            got = decoded[f"{field}_hi"][:, sel].view(jnp.bfloat16).astype(np.float32)
            if pair.lo is not None:
                got = got + decoded[f"{field}_lo"][:, sel].view(jnp.bfloat16).astype(np.float32)
            want_value = np.asarray(reference_fp32._value(pair), np.float32).reshape(got.shape)
            rel, equal = compare(f"seq {n} {field}", got, want_value)
            hi_equal = float(np.mean(decoded[f"{field}_hi"][:, sel]
                                     == np.asarray(pair.hi).view(np.uint16).reshape(got.shape)))
            # hi + lo pairs agree to f32 level; kd (hi only) to bf16 level: a last-bit difference
            # of e = ex2(G) flips a rounding now and then (H200: 0.07-0.1 % of kd elements)
            assert rel <= (3e-5 if pair.lo is not None else 5e-4) and hi_equal >= 0.99, field
        got_gt = decoded["gt"][:, sel].astype(np.float64)
        want_gt = np.asarray(want.gt, np.float64).reshape(got_gt.shape)
        assert float(np.max(np.abs(got_gt - want_gt) / np.maximum(np.abs(want_gt), 1e-30))) <= 2e-4


@pytest.mark.parametrize("shape", [(1, 2048, 6, None), (1, 17, 1, None), (3, 300, 5, None),
                                   (1, 1000, 3, [0, 0, 1, 17, 17, 500, 1000]),
                                   (1, 4096, 24, [0, 256, 1024, 1025, 4096])],
                         ids=lambda s: f"B{s[0]}T{s[1]}H{s[2]}{'v' if s[3] else ''}")
def test_every_column_split_is_bitwise_identical_and_repeatable(shape):
    B, T, H, cu = shape
    rng = np.random.default_rng()
    args = make_inputs(rng, B, T, H, regime="keep32")
    N = B if cu is None else len(cu) - 1
    kw = dict(output_final_state=True, backend="kernel", numerics="fp32",
              initial_state=random_states(rng, N, H))
    if cu is not None:
        kw["cu_seqlens"] = jnp.asarray(cu, jnp.int32)
    run = {bv: jax.jit(lambda a, bv=bv: jax_kda.kda_prefill(**a, recurrence=bv, **kw))
           for bv in contract.COLUMN_SPLITS}
    base_out, base_state = run[128](args)
    assert np.isfinite(np.asarray(base_out.astype(jnp.float32))).all()
    for bv, f in run.items():
        for _ in range(2 if bv == 16 else 1):  # run to run as well
            out, state = f(args)
            np.testing.assert_array_equal(bits(out), bits(base_out), err_msg=f"out, {bv} vs 128")
            np.testing.assert_array_equal(bits(state), bits(base_state),
                                          err_msg=f"state, {bv} vs 128")


def test_packed_equals_each_sequence_alone_and_empty_keeps_its_state():
    rng = np.random.default_rng()
    lens = [33, 1, 0, 160, 7]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    a = make_inputs(rng, 1, int(cu[-1]), 4, regime="fla")
    state0 = random_states(rng, len(lens), 4)
    run = jax.jit(lambda x, s, c: jax_kda.kda_prefill(
        **x, cu_seqlens=c, initial_state=s, output_final_state=True, backend="kernel", **FP32))
    out, st = run(a, state0, jnp.asarray(cu))
    np.testing.assert_array_equal(bits(st[2]), bits(state0[2]))  # empty: f32 state as is
    for n, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        if hi == lo:
            continue
        part = {k: (v[:, lo:hi] if v.ndim >= 3 else v) for k, v in a.items()}
        o1, s1 = run(part, state0[n:n + 1], jnp.asarray([0, hi - lo], jnp.int32))
        np.testing.assert_array_equal(bits(o1[0]), bits(out[0, lo:hi]))
        np.testing.assert_array_equal(bits(s1[0]), bits(st[n]))


def test_pool_and_decode_are_the_prefill_on_the_rows():
    rng = np.random.default_rng()
    a = make_inputs(rng, 3, 9, 2, regime="fla")
    pool = random_states(rng, 5, 2)
    idx = jnp.asarray([4, -1, 0], jnp.int32)
    rows = pool[jnp.asarray([4, 0, 0])]
    want_out, want_final = prefill("kernel")(a, {"initial_state": rows})
    out, new_pool = jax.jit(lambda a, p: jax_kda.kda_prefill(
        **a, initial_state=p, state_indices=idx, output_final_state=True, backend="kernel",
        **FP32))(a, pool)
    d_out, d_pool = jax.jit(lambda a, p: jax_kda.kda_decode(
        **a, state=p, state_indices=idx, backend="kernel", **FP32))(a, pool)
    for o, p in ((out, new_pool), (d_out, d_pool)):
        for n, row in ((0, 4), (2, 0)):
            np.testing.assert_array_equal(bits(o[n]), bits(want_out[n]))
            np.testing.assert_array_equal(bits(p[row]), bits(want_final[n]))
        assert not np.asarray(o[1].astype(jnp.float32)).any()
        for row in (1, 2, 3):
            np.testing.assert_array_equal(bits(p[row]), bits(pool[row]))


@pytest.mark.parametrize("t,regime,grouped", [(1, "fla", False), (5, "keep32", False),
                                              (16, "slow", False), (3, "fla", True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_decode_kernel_is_the_prefill_bitwise(t, regime, grouped, dtype):
    """The fp32 mode's fused decode kernel (custom call jax_kda_decode_fp32_v1) on a pool with a
    padding slot and rows in random order: out and every indexed row bitwise the fp32 prefill
    kernels' on the same tokens from the row's state, intermediate state i bitwise their final
    state on tokens 0..i; the padding slot's out and states +0, the rows not indexed untouched;
    out and the pool the same with and without the intermediate states, and run to run."""
    rng = np.random.default_rng()
    N, H, P = 5, 4, 9
    a = make_inputs(rng, N, t, H, regime=regime)
    if grouped:  # q and k on H / 2 heads
        qk = make_inputs(rng, N, t, H // 2, regime=regime)
        a["q"], a["k"] = qk["q"], qk["k"]
    pool = random_states(rng, P, H, dtype)
    idx = jnp.asarray(rng.permutation(P)[:N], jnp.int32).at[2].set(-1)
    fused = jax.jit(lambda a, p, states: _ffi.decode_call(
        a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], idx, p,
        scale=SCALE, lower_bound=LOWER, inverse="stable", intermediate_states=states,
        numerics="fp32"), static_argnums=2)
    out, new_pool, _ = fused(a, pool, False)
    out2, new_pool2, states = fused(a, pool, True)
    np.testing.assert_array_equal(bits(out), bits(out2))
    np.testing.assert_array_equal(bits(new_pool), bits(new_pool2))
    out3, new_pool3, states3 = fused(a, pool, True)
    for x, y in ((out, out3), (new_pool, new_pool3), (states, states3)):
        np.testing.assert_array_equal(bits(x), bits(y))
    rows = pool[jnp.maximum(idx, 0)]
    want_out, want_final = prefill("kernel")(a, {"initial_state": rows})
    indexed = set(np.asarray(idx).tolist())
    for n, row in enumerate(np.asarray(idx).tolist()):
        if row < 0:
            assert not np.asarray(out[n].astype(jnp.float32)).any()
            assert not np.asarray(states[n].astype(jnp.float32)).any()
            continue
        np.testing.assert_array_equal(bits(out[n]), bits(want_out[n]))
        np.testing.assert_array_equal(bits(new_pool[row]),
                                      bits(want_final[n].astype(dtype)))
        np.testing.assert_array_equal(bits(states[n, t - 1]), bits(new_pool[row]))
        for i in range(t - 1):
            part = {k: (x[n:n + 1, :i + 1] if x.ndim >= 3 else x) for k, x in a.items()}
            _, final = prefill("kernel")(part, {"initial_state": rows[n:n + 1]})
            np.testing.assert_array_equal(bits(states[n, i]), bits(final[0].astype(dtype)),
                                          err_msg=f"sequence {n}, state {i}")
    for row in range(P):
        if row not in indexed:
            np.testing.assert_array_equal(bits(new_pool[row]), bits(pool[row]))


@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_intermediate_states_are_prefix_prefills_bitwise(t, dtype):
    """kda_decode(output_intermediate_states=True) on a pool with a padding slot: state i ==
    the kernel prefill's final state on the first i + 1 tokens, bitwise; out and the pool ==
    kda_decode without them; the padding slot's out and states are zero."""
    rng = np.random.default_rng()
    H = 2
    a = make_inputs(rng, 3, t, H, regime="fla")
    pool = random_states(rng, 4, H, dtype)
    idx = jnp.asarray([3, -1, 1], jnp.int32)
    decode = jax.jit(lambda a, p, states: jax_kda.kda_decode(
        **a, state=p, state_indices=idx, backend="kernel", output_intermediate_states=states,
        **FP32), static_argnums=2)
    out, new_pool, states = decode(a, pool, True)
    plain_out, plain_pool = decode(a, pool, False)
    np.testing.assert_array_equal(bits(out), bits(plain_out))
    np.testing.assert_array_equal(bits(new_pool), bits(plain_pool))
    for n, row in ((0, 3), (2, 1)):
        for i in range(t):
            part = {k: (x[n:n + 1, :i + 1] if x.ndim >= 3 else x) for k, x in a.items()}
            _, final = prefill("kernel")(part, {"initial_state": pool[row:row + 1]})
            np.testing.assert_array_equal(bits(states[n, i]), bits(final[0]))
        np.testing.assert_array_equal(bits(states[n, -1]), bits(new_pool[row]))
    assert not np.asarray(states[1].astype(jnp.float32)).any()
    assert not np.asarray(out[1].astype(jnp.float32)).any()
    for row in (0, 2):
        np.testing.assert_array_equal(bits(new_pool[row]), bits(pool[row]))


def test_vmap_folds_into_one_call_with_the_same_bits():
    rng = np.random.default_rng()
    stacked = [make_inputs(rng, 2, 50, 2, regime="fla") for _ in range(3)]
    batch = jax.tree.map(lambda *x: jnp.stack(x), *stacked)
    f = lambda a: jax_kda.kda_prefill(**a, backend="kernel", output_final_state=True, **FP32)
    outs, states = jax.jit(jax.vmap(f))(batch)
    for i, a in enumerate(stacked):
        o, s = jax.jit(f)(a)
        np.testing.assert_array_equal(bits(outs[i]), bits(o))
        np.testing.assert_array_equal(bits(states[i]), bits(s))


def _oracle_error(a, out, final):
    want_out, want_final = oracle.kda_prefill_oracle(
        **{k: np.asarray(v.astype(jnp.float32)) for k, v in a.items()})
    rel = lambda x, y: float(np.sqrt(np.mean((np.asarray(x, np.float64) - y) ** 2) / np.mean(y**2)))
    return (rel(jnp.asarray(out).astype(jnp.float32), want_out),
            rel(jnp.asarray(final).astype(jnp.float32), want_final))


@pytest.mark.parametrize("law", ["normal", "uniform"])
@pytest.mark.parametrize("regime", ["strong", "fla", "keep32", "slow"])
def test_fp32_kernels_against_the_float64_oracle(regime, law):
    rng = np.random.default_rng()
    a = make_inputs(rng, 1, 2048, 2, law=law, regime=regime)
    run = lambda numerics: jax.jit(lambda x: jax_kda.kda_prefill(
        **x, backend="kernel", output_final_state=True, numerics=numerics))(a)
    fp32_out, fp32_state = _oracle_error(a, *run("fp32"))
    bf16_out, bf16_state = _oracle_error(a, *run("flashkda"))
    print(f"\n  {regime}/{law}: fp32 out {fp32_out:.2e} state {fp32_state:.2e}; "
          f"flashkda out {bf16_out:.2e} state {bf16_state:.2e}")
    assert fp32_out <= 3.0e-3 and fp32_state <= 2.5e-3
    assert fp32_out * 1.5 <= bf16_out and fp32_state * 1.8 <= bf16_state
