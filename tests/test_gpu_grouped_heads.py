"""Grouped value heads (GVA) on the GPU kernels (marker gpu): q and k on Hk heads, everything else
on H = G * Hk; value head j reads query/key head j // G.

The grouped specialisations of the prepare kernels (both numerics modes) and of the fused decode
kernel read each query/key head in place; their results must be bitwise those of the same call
with q and k repeated G times (which runs the plain specialisations):
1. kda_prefill, both numerics modes, every launch (recurrence "auto", "baseline" where the mode
   has it, 16, 32, 64, 128), batched and packed (with empty and short sequences), with initial
   states; G in {2, 3, 8}; Hk = 1 and several; the workspace of the prepare call itself too;
2. state pools with padding slots and checkpoints, both modes; sequence-parallel pieces (fp32);
3. kda_decode (the fused kernel of each mode), t in {1, 5, 16}, bf16 and f32
   pools, intermediate states, both inverses;
4. vmap folded into heads (per-element A_log) on the kernels;
5. the kernels against the reference backend on the CPU (which repeats q and k), within the
   prefill's tolerance (tests/test_gpu_numerics.py);
6. jax.grad through the kernel forward: run to run the same bits, dq and dk at Hk heads.
Inputs are fresh random numbers (seed printed; JAX_KDA_TEST_SEED=<seed> repeats a run) in gate
regimes with slowly decaying and never-forgetting channels.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import assert_bits, grouped_inputs, random_states, repeated_qk

import jax_kda
from jax_kda import _ffi, contract

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_gpus")]

BACKEND = "kernel"
DATA = ("q", "k", "v", "g", "beta")
LAUNCHES = {"flashkda": ("auto", "baseline", *contract.COLUMN_SPLITS),
            "fp32": ("auto", *contract.COLUMN_SPLITS)}
# kernel vs reference (tests/test_gpu_numerics.py, docs/numerics.md section 8)
REFERENCE_RMSE, REFERENCE_BIT_EQUAL = 2.5e-3, 0.5


def both(fn, args, G):
    return fn(**args), fn(**repeated_qk(args, G))


def launches():
    return [(numerics, launch) for numerics, options in LAUNCHES.items() for launch in options]


# ------------------------------------------------------------------------------ 1. prefill
@pytest.mark.parametrize("numerics,recurrence", launches())
@pytest.mark.parametrize("B,T,Hk,G", [(2, 300, 2, 3), (1, 1000, 1, 8), (3, 17, 4, 2)])
def test_prefill_equals_repeated_qk(rng, numerics, recurrence, B, T, Hk, G):
    args = grouped_inputs(rng, B, T, Hk, G)
    args["initial_state"] = random_states(rng, B, Hk * G)
    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, numerics=numerics,
                         recurrence=recurrence, backend=BACKEND))
    got, want = both(fn, args, G)
    assert_bits(got, want)


@pytest.mark.parametrize("numerics,recurrence", launches())
def test_packed_prefill_equals_repeated_qk(rng, numerics, recurrence):
    Hk, G = 3, 2
    cu = jnp.asarray([0, 0, 1, 130, 130, 517, 600], jnp.int32)
    args = grouped_inputs(rng, 1, 600, Hk, G, regime="slow")
    args["initial_state"] = random_states(rng, 6, Hk * G, jnp.bfloat16)
    fn = jax.jit(partial(jax_kda.kda_prefill, cu_seqlens=cu, output_final_state=True,
                         numerics=numerics, recurrence=recurrence, backend=BACKEND))
    got, want = both(fn, args, G)
    assert_bits(got, want)


@pytest.mark.parametrize("numerics", ["flashkda", "fp32"])
@pytest.mark.parametrize("inverse", ["stable", "neumann"])
def test_prepare_workspace_equals_repeated_qk(rng, numerics, inverse):
    """The prepare call alone: the grouped specialisation writes the same records (in the chunk
    slots the sequences use; the spare slots of contract.workspace_slots' bound are never written
    nor read)."""
    if numerics == "fp32" and inverse == "neumann":
        pytest.skip("the fp32 mode has one inverse")
    Hk, G, T = 2, 4, 200
    x = grouped_inputs(rng, 1, T, Hk, G)
    cu = jnp.asarray([0, 77, T], jnp.int32)

    def prepare(q, k, g, beta, A_log, dt_bias):
        return _ffi.prepare_call(q[0], k[0], g[0], beta[0], A_log, dt_bias, cu, scale=0.08,
                                 lower_bound=-5.0, inverse=inverse, numerics=numerics)

    fn = jax.jit(prepare)
    names = ("q", "k", "g", "beta", "A_log", "dt_bias")
    got = fn(*(x[a] for a in names))
    rep = repeated_qk(x, G)
    want = fn(*(rep[a] for a in names))
    bounds = np.asarray(cu)
    used = np.concatenate([  # chunk c of sequence n: slot cu[n] // 16 + n + c
        bounds[n] // contract.CHUNK + n + np.arange(-(-(end - start) // contract.CHUNK))
        for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]))])
    assert used.size < got.shape[1]  # spare slots exist, and are left out
    assert_bits(np.asarray(got)[:, used], np.asarray(want)[:, used])


# ------------------------------------------------------------------------------ 2. serving
@pytest.mark.parametrize("numerics", ["flashkda", "fp32"])
@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("recurrence", ["auto", 16, 64])
def test_pools_and_checkpoints(rng, numerics, state_dtype, recurrence):
    Hk, G = 2, 3
    args = grouped_inputs(rng, 1, 160, Hk, G)
    args["initial_state"] = random_states(rng, 6, Hk * G, state_dtype)
    fn = jax.jit(partial(jax_kda.kda_prefill, cu_seqlens=jnp.asarray([0, 100, 100, 160],
                                                                     jnp.int32),
                         state_indices=jnp.asarray([5, -1, 1], jnp.int32), checkpoint_every=32,
                         output_final_state=True, numerics=numerics, recurrence=recurrence,
                         backend=BACKEND))
    got, want = both(fn, args, G)
    assert_bits(got, want)


@pytest.mark.parametrize("segments", ["auto", 4])
def test_sequence_parallel_pieces(rng, segments):
    Hk, G = 1, 2
    args = grouped_inputs(rng, 1, 4096, Hk, G)
    args["initial_state"] = random_states(rng, 1, Hk * G)
    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, numerics="fp32",
                         sequence_parallel=segments, backend=BACKEND))
    got, want = both(fn, args, G)
    assert_bits(got, want)


@pytest.mark.parametrize("numerics,inverse", [("flashkda", "stable"), ("flashkda", "neumann"),
                                              ("fp32", "stable")])
@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("t", [1, 5, 16])
@pytest.mark.parametrize("intermediate", [False, True])
def test_decode_equals_repeated_qk(rng, numerics, inverse, state_dtype, t, intermediate):
    Hk, G, N = 3, 4, 5
    args = grouped_inputs(rng, N, t, Hk, G)
    args["state"] = random_states(rng, 7, Hk * G, state_dtype)
    # traced indices: under jit an index >= P (9) is a padding slot, like a negative one
    args["state_indices"] = jnp.asarray([6, -1, 0, 3, 9], jnp.int32)
    fn = jax.jit(partial(jax_kda.kda_decode, output_intermediate_states=intermediate,
                         numerics=numerics, inverse=inverse, backend=BACKEND))
    got, want = both(fn, args, G)
    assert_bits(got, want)


def test_decode_equals_grouped_prefill(rng):
    """kda_decode's contract with grouped heads: bitwise kda_prefill on the same tokens."""
    Hk, G, N, t = 2, 2, 4, 3
    args = grouped_inputs(rng, N, t, Hk, G)
    state = random_states(rng, N, Hk * G, jnp.bfloat16)
    out, new = jax.jit(partial(jax_kda.kda_decode, backend=BACKEND))(**args, state=state)
    want = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, backend=BACKEND))(
        **args, initial_state=state)
    assert_bits((out, new), want)


# ------------------------------------------------------------------------------ 3. vmap
def test_vmap_folded_into_heads(rng):
    n, Hk, G = 3, 2, 3
    args = grouped_inputs(rng, 2, 100, Hk, G)
    A_log = jnp.stack([args["A_log"] + 0.3 * i for i in range(n)])
    q = jnp.stack([grouped_inputs(rng, 2, 100, Hk, 1)["q"] for _ in range(n)])

    def call(q, A_log):
        return jax_kda.kda_prefill(q, *(args[a] for a in DATA[1:]), A_log, args["dt_bias"],
                                   output_final_state=True, backend=BACKEND)

    got = jax.jit(jax.vmap(call))(q, A_log)
    for i in range(n):
        element = repeated_qk(dict(args, q=q[i], A_log=A_log[i]), G)
        want = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, backend=BACKEND))(
            **element)
        assert_bits((got[0][i], got[1][i]), want, f"element {i}")


# ------------------------------------------------------------------------------ 4. vs reference
def _compare(name, got, want):
    g = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(want).astype(jnp.float32), np.float64)
    rel = float(np.sqrt(np.mean((g - w) ** 2) / max(np.mean(w**2), 1e-30)))
    equal = float(np.mean(np.asarray(jnp.asarray(got).astype(jnp.bfloat16)).view(np.int16)
                          == np.asarray(jnp.asarray(want).astype(jnp.bfloat16)).view(np.int16)))
    print(f"\n  {name}: rel RMSE {rel:.2e}, bit-equal {equal:.4f}")
    assert rel <= REFERENCE_RMSE and equal >= REFERENCE_BIT_EQUAL, (name, rel, equal)


def test_kernels_match_the_reference(rng):
    Hk, G = 2, 4
    args = grouped_inputs(rng, 2, 500, Hk, G, regime="mixed")
    args["initial_state"] = random_states(rng, 2, Hk * G)
    got = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, backend=BACKEND))(**args)
    cpu = jax.devices("cpu")[0]
    want = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, backend="reference"))(
        **jax.device_put(args, cpu))
    _compare("out", got[0], want[0])
    _compare("final state", got[1], want[1])


# ------------------------------------------------------------------------------ 5. grad
def test_gradients_through_the_kernel_forward(rng):
    Hk, G = 2, 2
    args = grouped_inputs(rng, 1, 256, Hk, G)
    weights = jnp.asarray(rng.standard_normal((1, 256, Hk * G, 128)), jnp.float32)

    def loss(q, k, v, g, beta, A_log, dt_bias):
        out, _ = jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, backend=BACKEND)
        return jnp.sum(out.astype(jnp.float32) * weights)

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(7))))
    names = (*DATA, "A_log", "dt_bias")
    got = grad(*(args[a] for a in names))
    assert_bits(got, grad(*(args[a] for a in names)), "run to run")
    assert got[0].shape == args["q"].shape and got[1].shape == args["k"].shape
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in got)
