"""Serving kernels on the GPU (marker gpu): kda_decode and kda_prefill on state pools, checkpoints.

The contract is the one tests/test_serving.py checks on the CPU reference; here the kernels
(backend="kernel": the fused decode kernel jax_kda_decode_v1, the pool recurrence
jax_kda_recurrence_pool_v1, the plain recurrence jax_kda_recurrence_v1) must meet it:

1. kda_decode == kda_prefill on the same tokens and states, bitwise (out, updated pool, and
   intermediate state i == the final state of a prefill on the first i + 1 tokens); N in {1, 5},
   t in {1, 3, 16}, H in {1, 12}, both inverses, bf16 and f32 pools with padding slots; and the
   decode kernel vs the reference backend (run on the CPU) within the prefill's tolerance:
   relative RMSE <= 2.5e-3 and >= 50 % of the elements bit-equal (tests/test_gpu_numerics.py).
2. Pool prefill == gather rows / kda_prefill / scatter back, bitwise, for every column split,
   batched and packed, bf16 and f32; checkpoints == prefix prefills bitwise, and close to the
   reference backend's.
3. Guard rows: rows nobody indexes (at both ends of the pool) and every non-indexed row keep their
   bits when state_indices hold negative values and values >= P (under jit, unchecked); padding
   slots' outputs are zero; the results equal those of the same call with -1 for those slots.
4. In place: with the pool donated, the compiled HLO copies no pool, the result is the donated
   buffer, and the results equal the non-donated call's.
   Sections 2-4 run in both numerics modes (fp32: jax_kda_recurrence_fp32_pool_v1).
5. CUDA graphs (command buffers) give the same bits as plain launches.
6. vmap of kda_decode / pool prefill == a loop, bitwise (one folded kernel call).
7. Chained decode steps of 16 tokens == one prefill, bitwise; token-by-token decoding reaches the
   prefill's state within the bound measured on the CPU (tests/test_serving.py).

Inputs are fresh random numbers (seed printed; JAX_KDA_TEST_SEED=<seed> repeats a run). Before
kernel calls whose padding outputs must be zero, the allocator is handed back NaN-filled blocks
of the output sizes (best effort: freed blocks are usually reused for the next allocations), so
an output the kernel forgets to write is unlikely to be zero by chance.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import assert_bits, assert_zero, bits, make_inputs, random_states

import jax_kda
from jax_kda import contract

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_gpus")]

BACKEND = "kernel"  # the backend under test (everything compared with it runs on the same one)
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
DATA = ("q", "k", "v", "g", "beta")
COLUMN_SPLITS = contract.COLUMN_SPLITS
DECODE_TARGET = "jax_kda_decode_v1"
POOL_TARGET = "jax_kda_recurrence_pool_v1"
# the pool tests of sections 2-4 run in both numerics modes, each on its own pool recurrence
NUMERICS = ["flashkda", "fp32"]
POOL_TARGETS = {"flashkda": POOL_TARGET, "fp32": "jax_kda_recurrence_fp32_pool_v1"}
# kernel vs reference (tests/test_gpu_numerics.py, docs/numerics.md section 8)
REFERENCE_RMSE, REFERENCE_BIT_EQUAL = 2.5e-3, 0.5
# token-by-token decode vs chunked prefill over 64 tokens (measured on the CPU reference,
# tests/test_serving.py: state <= 6.6e-3, outputs <= 7.6e-3)
TOKEN_BY_TOKEN_RMSE = 1.5e-2


# ---------------------------------------------------------------------------------------- helpers


def cpu():
    return jax.devices("cpu")[0]


def compare(name, got, want):
    """Relative RMSE, fraction of bit-equal elements (as bf16) and max bf16 ulp distance,
    printed."""
    g = np.asarray(jnp.asarray(got).astype(F32), np.float64)
    w = np.asarray(jnp.asarray(want).astype(F32), np.float64)
    assert np.isfinite(g).all(), f"{name}: non-finite values"
    rel = float(np.sqrt(np.mean((g - w) ** 2) / max(np.mean(w**2), 1e-30)))
    g16 = np.asarray(jnp.asarray(got).astype(BF16)).view(np.int16).astype(np.int32)
    w16 = np.asarray(jnp.asarray(want).astype(BF16)).view(np.int16).astype(np.int32)
    to_line = lambda b: np.where(b < 0, -32768 - b, b)
    ulp = int(np.abs(to_line(g16) - to_line(w16)).max()) if g16.size else 0
    equal = float(np.mean(g16 == w16)) if g16.size else 1.0
    print(f"\n  {name}: rel RMSE {rel:.2e}, bit-equal {equal:.4f}, max ulp {ulp}")
    return rel, equal


def assert_close_to_reference(name, got, want):
    rel, equal = compare(name, got, want)
    assert rel <= REFERENCE_RMSE and equal >= REFERENCE_BIT_EQUAL, (name, rel, equal)


def dirty_allocator(*arrays_like):
    """Allocate NaN-filled device blocks of these sizes and free them again, so the next
    allocations (the outputs) likely start as NaN rather than zero."""
    junk = [jnp.full((max(np.prod(a.shape) * np.dtype(a.dtype).itemsize // 4, 1),), jnp.nan, F32)
            for a in arrays_like]
    jax.block_until_ready(junk)
    del junk


@functools.cache
def decode_fn(backend, inverse="stable", intermediate=True, pooled=True):
    def run(x, state, idx):
        return jax_kda.kda_decode(**x, state=state, state_indices=idx if pooled else None,
                                  inverse=inverse, output_intermediate_states=intermediate,
                                  backend=backend)

    return jax.jit(run)


@functools.cache
def prefill_fn(backend, inverse="stable", checkpoint_every=None, recurrence="auto",
               numerics="flashkda"):
    """(x, state or None, cu_seqlens or None, state_indices or None) -> kda_prefill's results."""
    def run(x, state, cu, idx):
        return jax_kda.kda_prefill(**x, initial_state=state, cu_seqlens=cu, state_indices=idx,
                                   output_final_state=True, checkpoint_every=checkpoint_every,
                                   inverse=inverse, recurrence=recurrence, backend=backend,
                                   numerics=numerics)

    return jax.jit(run)


def on_cpu(*args):
    return jax.device_put(args, cpu())


def gather_rows(rng, pool, idx, dtype, h):
    """pool[idx[n]] per sequence (padding slots: an arbitrary random state)."""
    rows = np.array(random_states(rng, len(idx), h, dtype))
    pool_np = np.asarray(pool)
    for n, i in enumerate(idx):
        if i >= 0:
            rows[n] = pool_np[i]
    return jnp.asarray(rows)


def scatter_rows(pool, idx, finals):
    out = np.array(pool, copy=True)
    for n, i in enumerate(idx):
        if i >= 0:
            out[i] = np.asarray(finals[n])
    return out


def sequence_tokens(x, cu, s, length):
    if cu is None:
        return {name: x[name][s, :length] for name in DATA}
    return {name: x[name][0, cu[s]:cu[s] + length] for name in DATA}


def prefix_final_states(x, cu, segments, states, inverse="stable", numerics="flashkda"):
    """The backend's kda_prefill final state of each (sequence, token count) in `segments`, from
    states[i]: one packed plain prefill (a packed sequence is bitwise the sequence alone)."""
    parts = [sequence_tokens(x, cu, s, length) for s, length in segments]
    packed = {name: jnp.concatenate([p[name] for p in parts])[None] for name in DATA}
    packed.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
    bounds = np.concatenate([[0], np.cumsum([length for _, length in segments])]).astype(np.int32)
    _, final = prefill_fn(BACKEND, inverse, numerics=numerics)(packed, states,
                                                               jnp.asarray(bounds), None)
    return final


def padding_tokens(cu, idx, B, T):
    """bool [B, T]: tokens of padding sequences (batched: cu is None)."""
    mask = np.zeros((B, T), bool)
    for s, i in enumerate(idx):
        if i < 0:
            if cu is None:
                mask[s] = True
            else:
                mask[0, cu[s]:cu[s + 1]] = True
    return mask


# ------------------------------------------------------- 1. decode kernel vs prefill kernels


def _decode_case(rng, N, t, H, dtype):
    P = N + 4
    idx = [P - 2] if N == 1 else [P - 1, -1, 0, 3, -1]
    return P, idx, make_inputs(rng, N, t, H), random_states(rng, P, H, dtype)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("inverse", ["stable", "neumann"])
@pytest.mark.parametrize("H", [1, 12])
@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("N", [1, 5])
def test_decode_kernel_equals_prefill_kernels_bitwise(rng, N, t, H, inverse, dtype):
    P, idx, x, pool = _decode_case(rng, N, t, H, dtype)
    idx_j = jnp.asarray(idx, I32)
    dirty_allocator(x["q"], pool, pool, jax.ShapeDtypeStruct((N, t, H, 128, 128), dtype))
    out, new_pool, states = decode_fn(BACKEND, inverse)(x, pool, idx_j)
    assert out.dtype == BF16 and new_pool.dtype == dtype and states.dtype == dtype
    assert states.shape == (N, t, H, 128, 128)
    out_p, pool_p = prefill_fn(BACKEND, inverse)(x, pool, None, idx_j)  # pool prefill, B=N, T=t
    assert_bits(out, out_p, "out vs kda_prefill")
    assert_bits(new_pool, pool_p, "updated pool vs kda_prefill")

    valid = np.asarray(idx) >= 0
    written = sorted(i for i in idx if i >= 0)
    untouched = [r for r in range(P) if r not in written]
    assert_bits(np.asarray(new_pool)[untouched], np.asarray(pool)[untouched], "rows not indexed")
    assert not np.array_equal(bits(new_pool)[written], bits(pool)[written])
    assert_zero(np.asarray(out)[~valid], "out of padding slots")
    assert_zero(np.asarray(states)[~valid], "intermediate states of padding slots")

    seqs = [n for n in range(N) if valid[n]]
    segments = [(n, i + 1) for n in seqs for i in range(t)]
    init = jnp.asarray(np.asarray(pool)[[idx[n] for n, _ in segments]])
    prefixes = prefix_final_states(x, None, segments, init, inverse)
    for (n, length), prefix in zip(segments, prefixes):
        assert_bits(states[n, length - 1], prefix, f"state after {length} tokens of sequence {n}")
    for n in seqs:
        assert_bits(states[n, t - 1], new_pool[idx[n]], f"last state of sequence {n}")

    out2, pool2 = decode_fn(BACKEND, inverse, intermediate=False)(x, pool, idx_j)
    assert_bits(out2, out, "out without intermediate states")
    assert_bits(pool2, new_pool, "pool without intermediate states")


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("inverse", ["stable", "neumann"])
@pytest.mark.parametrize("t", [1, 3, 16])
def test_decode_kernel_close_to_reference(rng, t, inverse, dtype):
    N, H = 5, 12
    P, idx, x, pool = _decode_case(rng, N, t, H, dtype)
    idx_j = jnp.asarray(idx, I32)
    out, new_pool, states = decode_fn(BACKEND, inverse)(x, pool, idx_j)
    out_r, pool_r, states_r = decode_fn("reference", inverse)(*on_cpu(x, pool, idx_j))
    valid = np.asarray(idx) >= 0
    rows = [i for i in idx if i >= 0]
    assert_close_to_reference("out", np.asarray(out)[valid], np.asarray(out_r)[valid])
    assert_close_to_reference("new states", np.asarray(new_pool)[rows],
                              np.asarray(pool_r)[rows])
    assert_close_to_reference("intermediate states", np.asarray(states)[valid],
                              np.asarray(states_r)[valid])
    untouched = [r for r in range(P) if r not in rows]
    assert_bits(np.asarray(new_pool)[untouched], np.asarray(pool)[untouched], "rows not indexed")
    assert_zero(np.asarray(out)[~valid], "out of padding slots")


# ------------------------------------------------- 2. pool prefill == gather / prefill / scatter


# (B, T, cu_seqlens or None, H, P, state_indices, checkpoint_every)
POOL_CASES = {
    "batched": (3, 100, None, 6, 7, [5, -1, 0], 32),
    # lengths 37, 0, 1, 130, 16, 5, 256; the 130-token sequence (8 checkpoints) is padding
    "packed": (1, 445, [0, 37, 37, 38, 168, 184, 189, 445], 3, 10, [9, 0, 4, -1, 2, -1, 7], 16),
}


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("layout", list(POOL_CASES))
def test_pool_prefill_equals_gather_prefill_scatter_for_every_column_split(rng, layout, dtype,
                                                                           numerics):
    B, T, cu, H, P, idx, n = POOL_CASES[layout]
    N = B if cu is None else len(cu) - 1
    x = make_inputs(rng, B, T, H)
    pool = random_states(rng, P, H, dtype)
    cu_j = None if cu is None else jnp.asarray(cu, I32)
    idx_j = jnp.asarray(idx, I32)
    rows = gather_rows(rng, pool, idx, dtype, H)
    mode = {"numerics": numerics}
    out_r, final_r = prefill_fn(BACKEND, **mode)(x, rows, cu_j, None)  # plain, per-sequence states
    want_pool = scatter_rows(pool, idx, final_r)
    pad = padding_tokens(cu, idx, B, T)

    cu_np = np.arange(B + 1, dtype=np.int32) * T if cu is None else np.asarray(cu, np.int32)
    offsets = np.asarray(jax_kda.checkpoint_offsets(cu_np, n))
    capacity = B * ((T - 1) // n) if cu is None else T // n
    segments = [(s, (j + 1) * n) for s in range(N) for j in range(offsets[s + 1] - offsets[s])]
    prefixes = prefix_final_states(x, cu, segments, rows[np.array([s for s, _ in segments])],
                                   **mode)

    def check(results, what):
        out, new_pool, ckpts = results
        assert ckpts.shape == (capacity, H, 128, 128) and ckpts.dtype == dtype, what
        assert_bits(np.asarray(out)[~pad], np.asarray(out_r)[~pad], f"{what}: out")
        assert_zero(np.asarray(out)[pad], f"{what}: out of padding slots")
        assert_bits(new_pool, want_pool, f"{what}: updated pool")
        for (s, length), prefix in zip(segments, prefixes):
            row = offsets[s] + length // n - 1
            if idx[s] >= 0:
                assert_bits(ckpts[row], prefix, f"{what}: checkpoint at {length} of sequence {s}")
            else:
                assert_zero(ckpts[row], f"{what}: checkpoint of padding sequence {s}")
        assert_zero(ckpts[offsets[-1]:], f"{what}: rows past the total")

    for split in COLUMN_SPLITS:
        dirty_allocator(x["v"], pool, jax.ShapeDtypeStruct((capacity, H, 128, 128), dtype))
        check(prefill_fn(BACKEND, "stable", n, split, **mode)(x, pool, cu_j, idx_j),
              f"{numerics}, column_split {split}")
    # checkpoints of per-sequence states (no pool): the pool kernel with identity rows
    plain = prefill_fn(BACKEND, "stable", n, **mode)(x, rows, cu_j, None)
    assert_bits(plain[0], out_r, "per-sequence states with checkpoints: out")
    assert_bits(plain[1], final_r, "per-sequence states with checkpoints: final states")
    for (s, length), prefix in zip(segments, prefixes):
        assert_bits(plain[2][offsets[s] + length // n - 1], prefix,
                    f"per-sequence states: checkpoint at {length} of sequence {s}")

    kernel = prefill_fn(BACKEND, "stable", n, **mode)(x, pool, cu_j, idx_j)
    ref = prefill_fn("reference", "stable", n, **mode)(*on_cpu(x, pool, cu_j, idx_j))
    written = [i for i in idx if i >= 0]
    ckpt_rows = [offsets[s] + j for s in range(N) if idx[s] >= 0
                 for j in range(offsets[s + 1] - offsets[s])]
    assert len(ckpt_rows) >= 4
    assert_close_to_reference("out", np.asarray(kernel[0])[~pad], np.asarray(ref[0])[~pad])
    assert_close_to_reference("final states", np.asarray(kernel[1])[written],
                              np.asarray(ref[1])[written])
    assert_close_to_reference("checkpoints", np.asarray(kernel[2])[ckpt_rows],
                              np.asarray(ref[2])[ckpt_rows])


# ------------------------------------------------------------------------------- 3. guard rows

G = 3  # guard rows at each end of the pool, never indexed


def _bad_indices(idx, rows):
    """idx with its padding slots replaced by negative values and values >= rows."""
    bad = iter([rows, -(2**31), 2**31 - 1, rows + 5, -7, -1])
    return [i if i >= 0 else next(bad) for i in idx]


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("layout", list(POOL_CASES))
def test_guard_rows_survive_pool_prefill(rng, layout, dtype, numerics):
    B, T, cu, H, P, idx, n = POOL_CASES[layout]
    idx = list(idx)
    if layout == "batched":
        B, idx = B + 1, idx + [-1]  # a second padding slot
    else:
        idx[2] = -1  # a third padding slot (the length-1 sequence)
    rows = P + 2 * G
    idx = [i + G if i >= 0 else -1 for i in idx]  # the sequences' rows lie between the guards
    bad = _bad_indices(idx, rows)
    assert any(b >= rows for b in bad) and any(b < -1 for b in bad)
    x = make_inputs(rng, B, T, H)
    pool = random_states(rng, rows, H, dtype)
    cu_j = None if cu is None else jnp.asarray(cu, I32)
    fn = prefill_fn(BACKEND, "stable", n, numerics=numerics)
    capacity = B * ((T - 1) // n) if cu is None else T // n
    dirty_allocator(x["v"], pool, jax.ShapeDtypeStruct((capacity, H, 128, 128), dtype))
    got = fn(x, pool, cu_j, jnp.asarray(bad, I32))  # under jit: values unchecked
    clean = fn(x, pool, cu_j, jnp.asarray(idx, I32))
    for name, a, b in zip(("out", "pool", "checkpoints"), got, clean):
        assert_bits(a, b, f"{name}: bad padding indices vs -1")
    untouched = [r for r in range(rows) if r not in idx]
    assert untouched[:G] == list(range(G)) and untouched[-G:] == list(range(P + G, rows))
    assert_bits(np.asarray(got[1])[untouched], np.asarray(pool)[untouched],
                "guard rows and rows not indexed")
    pad = padding_tokens(cu, idx, B, T)
    assert_zero(np.asarray(got[0])[pad], "out of padding slots")
    cu_np = np.arange(B + 1, dtype=np.int32) * T if cu is None else np.asarray(cu, np.int32)
    offsets = np.asarray(jax_kda.checkpoint_offsets(cu_np, n))
    for s, i in enumerate(idx):
        if i < 0:
            assert_zero(got[2][offsets[s]:offsets[s + 1]], f"checkpoints of padding slot {s}")


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("t", [1, 16])
def test_guard_rows_survive_decode(rng, t, dtype):
    N, H, P = 6, 4, 5
    rows = P + 2 * G
    idx = [G + 1, -1, G + 4, -1, G, -1]
    bad = _bad_indices(idx, rows)
    x = make_inputs(rng, N, t, H)
    pool = random_states(rng, rows, H, dtype)
    fn = decode_fn(BACKEND)
    dirty_allocator(x["q"], pool, jax.ShapeDtypeStruct((N, t, H, 128, 128), dtype))
    got = fn(x, pool, jnp.asarray(bad, I32))
    clean = fn(x, pool, jnp.asarray(idx, I32))
    for name, a, b in zip(("out", "pool", "states"), got, clean):
        assert_bits(a, b, f"{name}: bad padding indices vs -1")
    untouched = [r for r in range(rows) if r not in idx]
    assert_bits(np.asarray(got[1])[untouched], np.asarray(pool)[untouched],
                "guard rows and rows not indexed")
    padding = np.asarray(idx) < 0
    assert_zero(np.asarray(got[0])[padding], "out of padding slots")
    assert_zero(np.asarray(got[2])[padding], "intermediate states of padding slots")


# --------------------------------------------------------------------------------- 4. in place


def _pool_copies(hlo, pool):
    """Lines of compiled HLO text that copy an array of the pool's shape (copy or copy-start,
    fused or not)."""
    dtype = {"bfloat16": "bf16", "float32": "f32"}[np.dtype(pool.dtype).name]
    shape = f"{dtype}[{','.join(str(d) for d in pool.shape)}]"
    found = []
    for line in hlo.splitlines():
        head = re.split(r"\bcopy(?:-start)?\(", line, maxsplit=1)
        if len(head) == 2 and shape in head[0]:
            found.append(line.strip())
    return found


def _check_in_place(fn, keep, kwargs, pool_name, pool, target, pointer_result=1):
    want = keep(**kwargs, **{pool_name: pool})
    donated = jnp.array(pool, copy=True)
    pointer = donated.unsafe_buffer_pointer()
    hlo = fn.lower(**kwargs, **{pool_name: donated}).compile().as_text()
    assert target in hlo
    assert "input_output_alias" in hlo
    copies = _pool_copies(hlo, pool)
    assert not copies, f"the donated pool is copied: {copies}"
    kept_hlo = keep.lower(**kwargs, **{pool_name: pool}).compile().as_text()
    if not _pool_copies(kept_hlo, pool):  # the check above must be able to see a copy
        warnings.warn("the non-donated call's HLO shows no pool copy either (format changed?)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "donated buffers were not usable" is a warning
        got = fn(**kwargs, **{pool_name: donated})
    assert donated.is_deleted()
    assert got[pointer_result].unsafe_buffer_pointer() == pointer, (
        "the pool was not updated in place")
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bits(a, b, f"result {i}: donated vs not donated")
    return got


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_decode_updates_a_donated_pool_in_place(rng, dtype):
    N, t, H, P = 8, 4, 12, 64
    x = make_inputs(rng, N, t, H)
    pool = random_states(rng, P, H, dtype)
    idx = jnp.asarray([40, -1, 3, 63, 17, 0, -1, 8], I32)
    options = {"output_intermediate_states": True, "backend": BACKEND}
    fn = jax.jit(partial(jax_kda.kda_decode, **options), donate_argnames="state")
    keep = jax.jit(partial(jax_kda.kda_decode, **options))
    got = _check_in_place(fn, keep, dict(x, state_indices=idx), "state", pool, DECODE_TARGET)
    # the next step of a serving loop: the returned pool donated again
    x2 = make_inputs(rng, N, t, H)
    x2.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
    _check_in_place(fn, keep, dict(x2, state_indices=idx), "state", got[1], DECODE_TARGET)


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_pool_prefill_updates_a_donated_pool_in_place(rng, dtype, numerics):
    B, T, cu, H, P, idx, n = POOL_CASES["packed"]
    x = make_inputs(rng, B, T, H)
    pool = random_states(rng, P, H, dtype)
    options = {"output_final_state": True, "checkpoint_every": n, "backend": BACKEND,
               "numerics": numerics}
    fn = jax.jit(partial(jax_kda.kda_prefill, **options), donate_argnames="initial_state")
    keep = jax.jit(partial(jax_kda.kda_prefill, **options))
    _check_in_place(fn, keep, dict(x, cu_seqlens=jnp.asarray(cu, I32),
                                   state_indices=jnp.asarray(idx, I32)),
                    "initial_state", pool, POOL_TARGETS[numerics])


# ------------------------------------------------------------------------------ 5. CUDA graphs

# Runs in a fresh process (XLA flags are read once): a serving loop of donated decode steps on an
# f32 pool, then a pool prefill with checkpoints, three times over (a command buffer is recorded,
# replayed, and replayed with other buffers). argv: output .npz, seed, backend.
_GRAPH_SCRIPT = textwrap.dedent("""
    import json, re, sys
    from functools import partial
    import jax, jax.numpy as jnp, numpy as np
    import jax_kda

    path, seed, backend, numerics = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    rng = np.random.default_rng(seed)
    N, P, H, t = 4, 7, 6, 3
    bf = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)
    heads = dict(A_log=jnp.asarray(rng.uniform(-2.0, 1.0, H), jnp.float32),
                 dt_bias=jnp.asarray(rng.standard_normal((H, 128)), jnp.float32))
    steps = [dict(q=bf(N, t, H, 128), k=bf(N, t, H, 128), v=bf(N, t, H, 128),
                  g=bf(N, t, H, 128), beta=bf(N, t, H), **heads) for _ in range(4)]
    T, cu = 70, jnp.asarray([0, 30, 30, 70], jnp.int32)
    prompt = dict(q=bf(1, T, H, 128), k=bf(1, T, H, 128), v=bf(1, T, H, 128),
                  g=bf(1, T, H, 128), beta=bf(1, T, H), **heads)
    pool0 = np.asarray(rng.standard_normal((P, H, 128, 128), dtype=np.float32) * 0.1)
    idx = jnp.asarray([5, -1, 0, 2], jnp.int32)
    decode = jax.jit(partial(jax_kda.kda_decode, output_intermediate_states=True,
                             backend=backend, numerics=numerics), donate_argnames="state")
    prefill = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, checkpoint_every=16,
                              backend=backend, numerics=numerics))
    results = {}
    for rep in range(3):
        pool = jnp.asarray(pool0)
        for s, x in enumerate(steps):
            out, pool, states = decode(**x, state=pool, state_indices=idx)
            results[f"decode_out_{rep}_{s}"] = np.asarray(out.astype(jnp.float32))
            results[f"decode_states_{rep}_{s}"] = np.asarray(states)
        out, pool, ckpts = prefill(**prompt, cu_seqlens=cu, initial_state=pool,
                                   state_indices=jnp.asarray([1, 3, 6], jnp.int32))
        results[f"prefill_out_{rep}"] = np.asarray(out.astype(jnp.float32))
        results[f"prefill_checkpoints_{rep}"] = np.asarray(ckpts)
        results[f"pool_{rep}"] = np.asarray(pool)
    np.savez(path, **results)
    hlo = decode.lower(**steps[0], state=pool, state_indices=idx).compile().as_text()
    blocks = re.findall(r"%command_buffer[^{]*\\{(.*?)\\n\\}", hlo, re.S)
    print(json.dumps({"command_buffer_with_kda": any("jax_kda_" in b for b in blocks),
                      "command_buffers": len(blocks)}))
""")


def run_graph_script(tmp_path, name, xla_flags, seed, numerics):
    env = dict(os.environ, XLA_FLAGS=xla_flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    path = tmp_path / f"{name}.npz"
    run = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT, str(path), str(seed), BACKEND,
                          numerics],
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return dict(np.load(path)), json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("numerics", NUMERICS)
def test_command_buffers_give_the_same_bits(tmp_path, rng, numerics):
    seed = int(rng.integers(2**31))
    plain, _ = run_graph_script(tmp_path, "plain", "--xla_gpu_enable_command_buffer=", seed,
                                numerics)
    graphs, info = run_graph_script(
        tmp_path, "graphs",
        "--xla_gpu_enable_command_buffer=+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1", seed,
        numerics)
    assert plain.keys() == graphs.keys() and len(plain) == 3 * (2 * 4 + 3)
    for key in plain:
        assert_bits(graphs[key], plain[key], key)
    for rep in (1, 2):  # replays equal the first run
        for s in range(4):
            assert_bits(graphs[f"decode_out_{rep}_{s}"], graphs[f"decode_out_0_{s}"],
                        f"replay {rep}, step {s}")
        assert_bits(graphs[f"pool_{rep}"], graphs["pool_0"], f"replay {rep}: pool")
    if not info["command_buffer_with_kda"]:
        # Newer XLA builds command buffers from thunks after HLO scheduling, which the HLO text
        # does not show; then only the identical results above are checked.
        warnings.warn(f"no HLO command_buffer computation holds a jax_kda custom call: {info}")


# ----------------------------------------------------------------------------------- 6. vmap


def test_vmap_of_kernel_decode_and_pool_prefill_equals_a_loop(rng):
    """One folded kernel call for the whole vmapped batch (pools stacked, indices shifted), bitwise
    a loop; an index >= P must not reach the next element's rows."""
    n_el, N, t, H, P = 3, 4, 2, 4, 6
    xs = [make_inputs(rng, N, t, H) for _ in range(n_el)]
    heads = (xs[0]["A_log"], xs[0]["dt_bias"])
    pools = random_states(rng, n_el * P, H, F32).reshape(n_el, P, H, 128, 128)
    idxs = [[5, -1, 0, 2], [-1, 1, 3, 4], [2, 5, -1, -1]]
    past = jnp.asarray([[i if i >= 0 else P + e for i in idx] for e, idx in enumerate(idxs)], I32)

    def decode(q, k, v, g, beta, A_log, dt_bias, pool, idx):
        return jax_kda.kda_decode(q, k, v, g, beta, A_log, dt_bias, state=pool,
                                  state_indices=idx, output_intermediate_states=True,
                                  backend=BACKEND)

    stacked = [jnp.stack([x[a] for x in xs]) for a in DATA]
    got = jax.jit(jax.vmap(decode, in_axes=(0,) * 5 + (None, None, 0, 0)))(
        *stacked, *heads, pools, past)
    one = jax.jit(decode)
    for e in range(n_el):
        want = one(*(xs[e][a] for a in DATA), *heads, pools[e], jnp.asarray(idxs[e], I32))
        for name, a, b in zip(("out", "pool", "states"), got, want):
            assert_bits(a[e], b, f"decode element {e}: {name}")

    B, T, cu, H, P, idx, n = POOL_CASES["packed"]
    xs = [make_inputs(rng, B, T, H) for _ in range(2)]
    heads = (xs[0]["A_log"], xs[0]["dt_bias"])
    pools = random_states(rng, 2 * P, H, BF16).reshape(2, P, H, 128, 128)
    idxs = [idx, [0, 9, -1, 4, 5, 1, -1]]
    past = jnp.asarray([[i if i >= 0 else P + 1 for i in idx] for idx in idxs], I32)

    def prefill(q, k, v, g, beta, A_log, dt_bias, cu, pool, idx):
        return jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, cu_seqlens=cu,
                                   initial_state=pool, state_indices=idx,
                                   output_final_state=True, checkpoint_every=n, backend=BACKEND)

    stacked = [jnp.stack([x[a] for x in xs]) for a in DATA]
    cu_j = jnp.asarray(cu, I32)
    got = jax.jit(jax.vmap(prefill, in_axes=(0,) * 5 + (None, None, None, 0, 0)))(
        *stacked, *heads, cu_j, pools, past)
    one = jax.jit(prefill)
    for e in range(2):
        want = one(*(xs[e][a] for a in DATA), *heads, cu_j, pools[e], jnp.asarray(idxs[e], I32))
        for name, a, b in zip(("out", "pool", "checkpoints"), got, want):
            assert_bits(a[e], b, f"prefill element {e}: {name}")


# --------------------------------------------------------------------------------- 7. chains


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_chained_decode_steps_of_sixteen_tokens_equal_one_prefill(rng, dtype):
    N, H, t = 3, 6, 16
    x = make_inputs(rng, N, 4 * t, H)
    state0 = random_states(rng, N, H, dtype)
    step = decode_fn(BACKEND, "stable", intermediate=False, pooled=False)
    state, outs = state0, []
    for i in range(4):
        out, state = step({a: (x[a][:, i * t:(i + 1) * t] if a in DATA else x[a]) for a in x},
                          state, None)
        outs.append(out)
    out_r, final_r = prefill_fn(BACKEND)(x, state0, None, None)
    assert_bits(jnp.concatenate(outs, axis=1), out_r, "out of four chained steps")
    assert_bits(state, final_r, "state after four chained steps")


def test_token_by_token_decode_reaches_the_prefill_state(rng):
    N, H, P, T = 3, 6, 5, 64
    idx = jnp.asarray([3, -1, 0], I32)
    x = make_inputs(rng, N, T, H)
    background = random_states(rng, P, H, F32)
    pools, outs = {}, {}
    for dtype in (BF16, F32):
        pool = background.astype(dtype).at[np.array([3, 0])].set(0)
        step, per_token = decode_fn(BACKEND), []
        for i in range(T):
            out, pool, _ = step({a: (x[a][:, i:i + 1] if a in DATA else x[a]) for a in x},
                                pool, idx)
            per_token.append(out)
        pools[dtype], outs[dtype] = pool, jnp.concatenate(per_token, axis=1)
    rows = np.array([3, 0])
    assert_bits(pools[F32][rows], pools[BF16][rows].astype(F32), "f32 pool vs bf16 pool")
    assert_bits(outs[F32], outs[BF16], "out, f32 vs bf16 pool")
    assert_bits(np.asarray(pools[F32])[[1, 2, 4]], np.asarray(background)[[1, 2, 4]],
                "rows not indexed (f32, unrounded)")
    assert_zero(outs[BF16][1], "out of the padding slot")
    out_r, final_r = prefill_fn(BACKEND)(x, jnp.zeros((N, H, 128, 128), BF16), None, None)
    seqs = np.array([0, 2])
    state_err = compare("state, token by token vs prefill", pools[BF16][rows], final_r[seqs])[0]
    out_err = compare("out, token by token vs prefill", outs[BF16][seqs], out_r[seqs])[0]
    assert 0 < state_err <= TOKEN_BY_TOKEN_RMSE and out_err <= TOKEN_BY_TOKEN_RMSE
