"""segment_ids on the GPU kernels (marker gpu): kda_prefill(..., segment_ids=ids) against the same
documents through cu_seqlens, bitwise, with backend="kernel".

1. forward, both numerics modes, several launches: outputs and final states equal the exact
   documents' (N = the document count) also when max_segments leaves spare rows (more sequences,
   so possibly another launch: every launch gives the same bits); a spare row is an empty
   document, whose final state is its initial state (rounded to bf16 in the flashkda mode);
2. jax.grad (the kernels' forward and the XLA backward): every gradient equals the cu_seqlens
   call's with the same number of sequences (cu_seqlens padded to max_segments + 1 entries as
   segment_ids pads it; the XLA backward's matrix products are fixed per compiled shape, not
   across shapes);
3. vmap folds calls with segment_ids into one launch: each element equals its own call.
Documents of one token, over several 16-token chunks, a row that is one document; fresh random
inputs (seed printed) with never-forgetting channels.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import assert_bits, make_inputs, numpy_documents, random_ids, random_states

import jax_kda

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_gpus")]

BACKEND = "kernel"
DATA = ("q", "k", "v", "g", "beta")
NAMES = (*DATA, "A_log", "dt_bias", "initial_state")
B, T, H = 3, 300, 4
ROWS = ((1, 16, 17, 1, 265), (300,), (40, 1, 2, 100, 157))
DOCUMENTS = sum(len(row) for row in ROWS)


def packed(x):
    return x.reshape((1, B * T) + x.shape[2:])


def padded(cu, rows):
    """cu_seqlens with empty sequences at the end, rows + 1 entries."""
    return jnp.asarray(np.concatenate([cu, np.full(rows + 1 - len(cu), cu[-1])]), jnp.int32)


@pytest.mark.parametrize("numerics, recurrence", [
    ("flashkda", "auto"), ("flashkda", "baseline"), ("flashkda", 64), ("fp32", "auto"),
    ("fp32", 16)])
@pytest.mark.parametrize("spare", [0, 3])
def test_forward_equals_the_documents_through_cu_seqlens(rng, numerics, recurrence, spare):
    rows = DOCUMENTS + spare
    args = make_inputs(rng, B, T, H, regime="keep32")
    state = random_states(rng, rows, H)
    ids = random_ids(rng, ROWS)
    cu, count = numpy_documents(np.asarray(ids))
    assert count == DOCUMENTS
    call = partial(jax_kda.kda_prefill, output_final_state=True, numerics=numerics,
                   recurrence=recurrence, backend=BACKEND)
    out, final = jax.jit(partial(call, max_segments=rows))(**args, segment_ids=ids,
                                                          initial_state=state)
    want_out, want_final = jax.jit(call)(
        **{n: packed(x) if n in DATA else x for n, x in args.items()},
        cu_seqlens=jnp.asarray(cu), initial_state=state[:DOCUMENTS])
    assert_bits(out, want_out.reshape(out.shape), "out")
    assert_bits(final[:DOCUMENTS], want_final, "final states")
    spare_states = state[DOCUMENTS:]
    if numerics == "flashkda":
        spare_states = spare_states.astype(jnp.bfloat16).astype(jnp.float32)
    assert_bits(final[DOCUMENTS:], spare_states, "empty documents' final states")


def loss(primals, weights, **options):
    out, final = jax_kda.kda_prefill(*primals[:7], initial_state=primals[7],
                                     output_final_state=True, backend=BACKEND, **options)
    return (jnp.sum(out.astype(jnp.float32).reshape(weights[0].shape) * weights[0])
            + jnp.sum(final * weights[1]))


@pytest.mark.parametrize("numerics", ["flashkda", "fp32"])
@pytest.mark.parametrize("spare", [0, 3])
def test_gradients_equal_the_documents_through_cu_seqlens(rng, numerics, spare):
    rows = DOCUMENTS + spare
    args = make_inputs(rng, B, T, H, regime="keep32")
    primals = (*(args[n] for n in DATA), args["A_log"], args["dt_bias"],
               random_states(rng, rows, H))
    weights = (jnp.asarray(rng.standard_normal((B, T, H, 128)), jnp.float32),
               jnp.asarray(rng.standard_normal((rows, H, 128, 128)), jnp.float32))
    ids = random_ids(rng, ROWS)
    cu, _ = numpy_documents(np.asarray(ids))
    grad = lambda **options: jax.jit(jax.value_and_grad(partial(loss, numerics=numerics,
                                                                **options)))
    value, grads = grad(segment_ids=ids, max_segments=rows)(primals, weights)
    want_value, want = grad(cu_seqlens=padded(cu, rows))(
        tuple(packed(x) for x in primals[:5]) + primals[5:], weights)
    assert_bits(value, want_value, "loss")
    for name, got, w in zip(NAMES, grads, want):
        assert_bits(got, w.reshape(got.shape), f"d {name}")
        assert np.any(np.asarray(got, np.float32) != 0), name


def test_vmap_folds_calls_with_segment_ids(rng):
    n, rows = 3, DOCUMENTS + 2
    args = [make_inputs(rng, B, T, H, regime="keep32") for _ in range(n)]
    stacked = {name: jnp.stack([a[name] for a in args]) for name in DATA}
    ids = jnp.stack([random_ids(rng, ROWS) if e != 1 else random_ids(rng, ROWS[::-1])
                     for e in range(n)])
    states = jnp.stack([random_states(rng, rows, H) for _ in range(n)])
    call = partial(jax_kda.kda_prefill, A_log=args[0]["A_log"], dt_bias=args[0]["dt_bias"],
                   max_segments=rows, output_final_state=True, backend=BACKEND)
    one = jax.jit(lambda x, i, s: call(**x, segment_ids=i, initial_state=s))
    got = jax.jit(jax.vmap(one))(stacked, ids, states)
    for e in range(n):
        want = one({name: stacked[name][e] for name in DATA}, ids[e], states[e])
        assert_bits((got[0][e], got[1][e]), want, f"element {e}")
