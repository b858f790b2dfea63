"""kda_prefill(..., segment_ids=ids): packed documents given as segment ids (jax_kda.segments).

1. cu_seqlens_from_segment_ids against a numpy loop on random ids (under jit and vmap too);
2. segment_ids against the same documents through cu_seqlens, bitwise: outputs, final states and
   the gradients of every input, in both numerics modes, through the custom VJP of the kernel
   backends ("auto", which runs the reference forward on this CPU) and the reference's
   autodiff; documents of one token, documents over several 16-token chunks, a row that is one
   document, several rows of several documents, a row starting with the id the previous one
   ended with;
3. under vmap and jit: spare rows past the documents (empty documents) and more documents than
   max_segments (NaN under jit, an error outside); the kernel backend lowers to one pair of
   kernel calls, under value_and_grad and vmap too;
4. every error, named.
Inputs are fresh random numbers (seed printed) in a gate regime with never-forgetting channels.
The kernels: tests/test_gpu_segment_ids.py.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import assert_bits, make_inputs, numpy_documents, random_ids, random_states

import jax_kda

DATA = ("q", "k", "v", "g", "beta")
NAMES = (*DATA, "A_log", "dt_bias", "initial_state")
B, T, H = 3, 40, 2
# lengths of each row's documents: one-token documents, documents over several chunks, a row
# that is one document
ROWS = ((1, 20, 1, 18), (40,), (15, 2, 23))
DOCUMENTS = sum(len(row) for row in ROWS)


def random_run_ids(rng, b, t):
    """[b, t] ids with runs of random lengths (1 .. 24) and values from a small range, so that
    neighbouring runs sometimes repeat a value (one longer document then)."""
    ids = np.empty((b, t), np.int32)
    for row in ids:
        pos = 0
        while pos < t:
            n = int(rng.integers(1, 25))
            row[pos:pos + n] = rng.integers(0, 3)
            pos += n
    return ids


# ----------------------------------------------------------------------- 1. the conversion


def expected_boundaries(ids, max_segments):
    """The numpy loop's cu_seqlens cut or padded to max_segments + 1 entries, and the count."""
    cu, count = numpy_documents(ids)
    starts = cu[:-1][:max_segments]  # past max_segments only the first documents fit
    return np.concatenate([starts, np.full(max_segments + 1 - len(starts), ids.size)]), count


def test_conversion_matches_a_numpy_loop(rng):
    convert = jax.jit(jax_kda.cu_seqlens_from_segment_ids, static_argnums=1)
    for b, t in ((1, 1), (3, 50)):
        ids = random_run_ids(rng, b, t)
        count = numpy_documents(ids)[1]
        for max_segments in (None, count + 5, max(1, count - 1)):
            cu, n = convert(jnp.asarray(ids), max_segments)
            want, _ = expected_boundaries(ids, b * t if max_segments is None else max_segments)
            assert cu.dtype == jnp.int32 and int(n) == count
            np.testing.assert_array_equal(np.asarray(cu), want, err_msg=(b, t, max_segments))
    # eager, from numpy ids
    cu, n = jax_kda.cu_seqlens_from_segment_ids(ids, 7)
    np.testing.assert_array_equal(np.asarray(cu), expected_boundaries(ids, 7)[0])
    assert int(n) == count
    # under vmap
    ids = np.stack([random_run_ids(rng, 4, 33) for _ in range(3)])
    got_cu, got_n = jax.jit(jax.vmap(partial(jax_kda.cu_seqlens_from_segment_ids,
                                             max_segments=40)))(jnp.asarray(ids))
    for i in range(3):
        want, count = expected_boundaries(ids[i], 40)
        np.testing.assert_array_equal(np.asarray(got_cu[i]), want)
        assert int(got_n[i]) == count


# --------------------------------------------------- 2. segment_ids == cu_seqlens, bitwise


def loss_and_results(primals, weights, *, numerics, backend, **documents):
    """A loss of out and of the final states, and (out, final states) as aux."""
    out, final = jax_kda.kda_prefill(*primals[:7], initial_state=primals[7],
                                     output_final_state=True, numerics=numerics,
                                     backend=backend, **documents)
    loss = (jnp.sum(out.astype(jnp.float32).reshape(weights[0].shape) * weights[0])
            + jnp.sum(final * weights[1]))
    return loss, (out, final)


@pytest.mark.parametrize("numerics, backend", [("flashkda", "auto"), ("fp32", "reference")])
def test_segment_ids_equal_the_documents_through_cu_seqlens(rng, numerics, backend):
    """Outputs, final states and every gradient, bitwise, through the custom VJP ("auto") and
    the reference's autodiff, with max_segments the document count (finite: no overflow).

    Eager calls: the packed call that segment_ids makes is the cu_seqlens call's problem, so
    the second call reuses the first one's compiled programs (this file stays fast); test 4
    compares jitted calls with spare rows."""
    args = make_inputs(rng, B, T, H, regime="keep32")
    state = random_states(rng, DOCUMENTS, H)
    primals = (*(args[n] for n in DATA), args["A_log"], args["dt_bias"], state)
    weights = (jnp.asarray(rng.standard_normal((B, T, H, 128)), jnp.float32),
               jnp.asarray(rng.standard_normal((DOCUMENTS, H, 128, 128)), jnp.float32))
    ids = random_ids(rng, ROWS)
    cu, count = numpy_documents(np.asarray(ids))
    assert count == DOCUMENTS
    run = jax.value_and_grad(partial(loss_and_results, numerics=numerics, backend=backend),
                             has_aux=True)

    (_, (out, final)), grads = run(primals, weights, segment_ids=ids, max_segments=DOCUMENTS)
    packed = tuple(x.reshape((1, B * T) + x.shape[2:]) for x in primals[:5])
    (_, (want_out, want_final)), want_grads = run(packed + primals[5:], weights,
                                                  cu_seqlens=jnp.asarray(cu))
    assert_bits(out, want_out.reshape(B, T, H, 128), "out")
    assert_bits(final, want_final, "final states")
    for name, got, want in zip(NAMES, grads, want_grads):
        assert_bits(got, want.reshape(got.shape), f"d {name}")
        assert np.any(np.asarray(got, np.float32) != 0), name


# ------------------------------------------------- 3. spare rows, too many documents, vmap


def test_vmap_spare_rows_and_too_many_documents(rng):
    """jax.vmap of a jitted call ("auto": the kernel path folds the packed calls into one, here
    on the reference) with max_segments = 5: element 0 holds 4 documents and equals them through
    cu_seqlens bitwise; its spare row is an empty document whose final state is its initial
    state rounded to bf16 (the flashkda mode's state). Element 1 holds 6: its outputs and final
    states are NaN, and a concrete call raises."""
    b, t, h, max_segments = 2, 24, 1, 5
    structures = (((1, 12, 11), (24,)), ((24,), (5, 1, 1, 2, 15)))
    args = [make_inputs(rng, b, t, h, regime="keep32") for _ in structures]
    ids = jnp.stack([random_ids(rng, rows) for rows in structures])
    states = jnp.stack([random_states(rng, max_segments, h) for _ in structures])
    stacked = {name: jnp.stack([a[name] for a in args]) for name in DATA}
    shared = {name: args[0][name] for name in ("A_log", "dt_bias")}
    call = partial(jax_kda.kda_prefill, **shared, output_final_state=True)
    out, final = jax.jit(jax.vmap(lambda x, i, s: call(**x, segment_ids=i, initial_state=s,
                                                       max_segments=max_segments)))(
        stacked, ids, states)
    assert out.shape == (2, b, t, h, 128) and final.shape == (2, max_segments, h, 128, 128)

    cu, count = numpy_documents(np.asarray(ids[0]))
    assert count == 4
    packed = {name: stacked[name][0].reshape((1, b * t) + stacked[name].shape[3:])
              for name in DATA}
    want_out, want_final = jax.jit(lambda x, cu, s: call(**x, cu_seqlens=cu, initial_state=s))(
        packed, jnp.asarray(cu), states[0, :count])
    assert_bits(out[0], want_out.reshape(out.shape[1:]), "out")
    assert_bits(final[0, :count], want_final, "final states")
    assert_bits(final[0, count:], states[0, count:].astype(jnp.bfloat16).astype(jnp.float32),
                "the empty document's final state")

    assert numpy_documents(np.asarray(ids[1]))[1] == 6
    for x in (out[1], final[1]):
        assert np.isnan(np.asarray(x, np.float32)).all()
    with pytest.raises(ValueError, match=r"kda_prefill: segment_ids hold 6 documents, more "
                                         r"than max_segments = 5"):
        call(**{name: stacked[name][1] for name in DATA}, segment_ids=ids[1],
             initial_state=states[1], max_segments=max_segments)


def test_kernel_backend_lowers_to_one_pair_of_kernel_calls(monkeypatch):
    """backend="kernel" lowered for CUDA (no GPU needed): the documents are one packed call, so
    value_and_grad and a vmap of it each hold the prepare and the recurrence custom calls once."""
    from jax_kda import api

    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    rng = np.random.default_rng(0)
    args = make_inputs(rng, 2, 24, 1)
    ids = random_ids(rng, ((1, 12, 11), (24,)))

    def loss(a, i):
        out, final = jax_kda.kda_prefill(**a, segment_ids=i, max_segments=5, backend="kernel",
                                         output_final_state=True)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(final.astype(jnp.float32))

    stack = lambda x: jnp.stack([x, x])
    for fn, given in ((jax.value_and_grad(loss), (args, ids)),
                      (jax.vmap(loss), (jax.tree.map(stack, args), stack(ids)))):
        text = jax.jit(fn).trace(*given).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @jax_kda_prepare_v1(") == 1, fn
        assert text.count("custom_call @jax_kda_recurrence_v1(") == 1, fn


# ------------------------------------------------------------------------------ 4. errors


def _trace(**options):
    args = make_inputs(np.random.default_rng(0), 2, 8, 1)
    ids = options.pop("segment_ids", jnp.zeros((2, 8), jnp.int32))
    options.setdefault("max_segments", 4)
    jax.jit(lambda a, i: jax_kda.kda_prefill(**a, segment_ids=i, **options)).trace(args, ids)


@pytest.mark.parametrize("options, error, match", [
    ({"segment_ids": jnp.zeros((2, 8), jnp.float32)}, TypeError,
     "segment_ids must have an integer dtype"),
    ({"segment_ids": jnp.zeros((2, 8), bool)}, TypeError, "segment_ids must have an integer dtype"),
    ({"segment_ids": [[0] * 8] * 2}, TypeError, "segment_ids must be an array"),
    ({"segment_ids": jnp.zeros((16,), jnp.int32)}, ValueError,
     r"segment_ids must have shape \[B, T\] = \(2, 8\)"),
    ({"segment_ids": jnp.zeros((2, 7), jnp.int32)}, ValueError,
     r"segment_ids must have shape \[B, T\] = \(2, 8\)"),
    ({"cu_seqlens": jnp.asarray([0, 16], jnp.int32)}, ValueError,
     "segment_ids and cu_seqlens exclude each other"),
    ({"checkpoint_every": 16}, ValueError, "segment_ids and checkpoint_every exclude each other"),
    ({"state_indices": jnp.zeros((16,), jnp.int32),
      "initial_state": jnp.zeros((4, 1, 128, 128), jnp.float32)}, ValueError,
     "segment_ids and state_indices exclude each other"),
    ({"max_segments": 0}, ValueError, "max_segments must be a static int >= 1"),
    ({"max_segments": 2.0}, ValueError, "max_segments must be a static int >= 1"),
    ({"max_segments": True}, ValueError, "max_segments must be a static int >= 1"),
    ({"max_segments": None}, ValueError, "segment_ids needs max_segments, a static bound"),
    ({"max_segments": None, "output_final_state": True}, ValueError,
     "segment_ids needs max_segments, a static bound"),
    ({"initial_state": jnp.zeros((3, 1, 128, 128), jnp.float32), "max_segments": 4}, ValueError,
     r"initial_state must have shape \[max_segments, H, 128, 128\] \(one state per document\)"),
])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_errors_name_the_argument(options, error, match, backend):
    with pytest.raises(error, match="kda_prefill: " + match):
        _trace(**options, backend=backend)


def test_max_segments_needs_segment_ids():
    args = make_inputs(np.random.default_rng(0), 1, 8, 1)
    with pytest.raises(ValueError, match="kda_prefill: max_segments bounds the documents of "
                                         "segment_ids; it needs segment_ids"):
        jax_kda.kda_prefill(**args, max_segments=4)


def test_max_segments_must_be_static():
    with pytest.raises(ValueError, match="kda_prefill: max_segments must be a static int"):
        jax.jit(lambda m: _trace(max_segments=m)).trace(4)


def test_conversion_names_its_arguments():
    fn = "cu_seqlens_from_segment_ids"
    with pytest.raises(TypeError, match=f"{fn}: segment_ids must have an integer dtype"):
        jax_kda.cu_seqlens_from_segment_ids(jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=rf"{fn}: segment_ids must have shape \[B, T\]"):
        jax_kda.cu_seqlens_from_segment_ids(jnp.zeros((6,), jnp.int32))
    with pytest.raises(ValueError, match=f"{fn}: max_segments must be a static int >= 1"):
        jax_kda.cu_seqlens_from_segment_ids(jnp.zeros((2, 3), jnp.int32), 0)
