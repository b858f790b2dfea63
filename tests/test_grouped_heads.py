"""Grouped value heads (GVA) on the CPU: q and k on Hk heads, everything else on H = G * Hk; value
head j reads query/key head j // G.

1. Every pure-JAX path (backend="reference", and "auto" on the CPU, which runs the kernel path's
   steps 2-4 around the reference: custom VJP, vmap folding, head partitioning) gives bitwise the
   results of the same call with q and k repeated G times: both numerics modes, batched and
   packed, initial states, pools with padding slots and checkpoints, sequence-parallel pieces
   (fp32), kda_decode with intermediate states.
2. vmap folds grouped calls into the batch and into the heads (per-element A_log / dt_bias), each
   element's value heads still reading its own query/key heads.
3. jax.grad on the kernel backends: dv, dg, dbeta, dA_log, ddt_bias and the initial state's
   gradient are bitwise those of the repeated call; dq and dk are the f32 gradients of the
   repeated call summed over each group in a fixed pairwise order, rounded once; run to run the
   same bits.
4. The CUDA lowering (on the CPU, no GPU needed) hands the prepare and decode custom calls q and
   k at Hk heads, with no repeat of them anywhere in the program (the reference lowering, which
   repeats them, is the positive control).
5. Shapes that do not group fail at trace time with errors naming the arguments.
6. jax.export of a grouped call runs on the CPU and equals the repeated call.
Inputs are fresh random numbers (seed printed by the rng fixture) in gate regimes with slowly
decaying and never-forgetting channels.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import assert_bits, grouped_inputs, random_states, repeated_qk

import jax_kda
from jax_kda import api, reference_backward

DATA = ("q", "k", "v", "g", "beta")


def both(fn, args, G):
    """fn on the grouped arrays and on the repeated ones."""
    return fn(**args), fn(**repeated_qk(args, G))


# ------------------------------------------------------------------------------ 1. every path
@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("numerics", ["flashkda", "fp32"])
@pytest.mark.parametrize("Hk,G,varlen", [(1, 3, False), (2, 2, True)])
def test_prefill_equals_the_call_on_repeated_qk(rng, backend, numerics, Hk, G, varlen):
    args = grouped_inputs(rng, 1 if varlen else 2, 40, Hk, G)
    extra = {}
    if varlen:
        extra["cu_seqlens"] = jnp.asarray([0, 17, 17, 40], jnp.int32)
    N = 3 if varlen else 2
    args["initial_state"] = random_states(rng, N, Hk * G)
    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, numerics=numerics,
                         backend=backend, **extra))
    got, want = both(fn, args, G)
    assert got[0].shape == (args["v"].shape) and got[1].shape == (N, Hk * G, 128, 128)
    assert_bits(got, want)


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("numerics", ["flashkda", "fp32"])
def test_pools_and_checkpoints(rng, backend, numerics):
    Hk, G = 2, 2
    args = grouped_inputs(rng, 1, 48, Hk, G, regime="slow")
    args["initial_state"] = random_states(rng, 5, Hk * G)
    fn = jax.jit(partial(jax_kda.kda_prefill, cu_seqlens=jnp.asarray([0, 35, 35, 48], jnp.int32),
                         state_indices=jnp.asarray([3, -1, 0], jnp.int32),
                         output_final_state=True, checkpoint_every=16, numerics=numerics,
                         backend=backend))
    got, want = both(fn, args, G)
    assert len(got) == 3 and got[2].shape[1] == Hk * G
    assert_bits(got, want)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_sequence_parallel_pieces(rng, backend):
    Hk, G = 1, 2
    args = grouped_inputs(rng, 2, 70, Hk, G)
    args["initial_state"] = random_states(rng, 2, Hk * G)
    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, numerics="fp32",
                         sequence_parallel=3, backend=backend))
    got, want = both(fn, args, G)
    assert_bits(got, want)


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("numerics", ["flashkda", "fp32"])
@pytest.mark.parametrize("pooled", [False, True])
def test_decode_with_intermediate_states(rng, backend, numerics, pooled):
    Hk, G, N, t = 2, 3, 3, 4
    args = grouped_inputs(rng, N, t, Hk, G)
    extra = {}
    if pooled:
        args["state"] = random_states(rng, 5, Hk * G)
        extra["state_indices"] = jnp.asarray([4, -1, 1], jnp.int32)
    else:
        args["state"] = random_states(rng, N, Hk * G, jnp.bfloat16)
    fn = jax.jit(partial(jax_kda.kda_decode, output_intermediate_states=True,
                         numerics=numerics, backend=backend, **extra))
    got, want = both(fn, args, G)
    assert got[2].shape == (N, t, Hk * G, 128, 128)
    assert_bits(got, want)


def test_decode_equals_prefill_on_the_same_tokens(rng):
    """The contract kda_decode keeps with grouped heads too (reference backend)."""
    Hk, G = 1, 4
    args = grouped_inputs(rng, 2, 5, Hk, G)
    state = random_states(rng, 2, Hk * G)
    out, new = jax_kda.kda_decode(**args, state=state, backend="reference")
    want = jax_kda.kda_prefill(**args, initial_state=state, output_final_state=True,
                               backend="reference")
    assert_bits((out, new), want)


# ------------------------------------------------------------------------------ 2. vmap folding
def test_vmap_folds_into_heads_keeping_each_elements_groups(rng):
    """A_log and dt_bias vmapped: the elements become extra heads of one call (n * Hk query/key
    heads, n * H value heads); element i must still read its own q and k."""
    n, Hk, G = 3, 2, 2
    args = grouped_inputs(rng, 2, 24, Hk, G)
    stacked = {name: jnp.stack([x] * n) if name in ("A_log", "dt_bias") else x
               for name, x in args.items()}
    stacked["A_log"] = stacked["A_log"] + jnp.arange(n, dtype=jnp.float32)[:, None] * 0.5
    # a different q and k per element, so that a mix-up of elements shows
    stacked["q"] = jnp.stack([grouped_inputs(rng, 2, 24, Hk, 1)["q"] for _ in range(n)])
    axes = {name: 0 if name in ("q", "A_log", "dt_bias") else None for name in stacked}

    def call(q, k, v, g, beta, A_log, dt_bias):
        return jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, output_final_state=True)

    got = jax.jit(jax.vmap(call, in_axes=tuple(axes[a] for a in (*DATA, "A_log", "dt_bias"))))(
        *(stacked[a] for a in (*DATA, "A_log", "dt_bias")))
    for i in range(n):
        element = dict(args, q=stacked["q"][i], A_log=stacked["A_log"][i],
                       dt_bias=stacked["dt_bias"][i])
        want = jax_kda.kda_prefill(**repeated_qk(element, G), output_final_state=True,
                                   backend="reference")
        assert_bits((got[0][i], got[1][i]), want, f"element {i}")


def test_vmap_folds_into_the_batch(rng):
    n, Hk, G = 2, 1, 3
    elements = [grouped_inputs(rng, 2, 20, Hk, G) for _ in range(n)]
    stacked = {name: jnp.stack([e[name] for e in elements]) for name in DATA}
    shared = elements[0]

    def call(q, k, v, g, beta):
        return jax_kda.kda_prefill(q, k, v, g, beta, shared["A_log"], shared["dt_bias"],
                                   output_final_state=True)

    got = jax.jit(jax.vmap(call))(*(stacked[a] for a in DATA))
    for i, element in enumerate(elements):
        element = dict(element, A_log=shared["A_log"], dt_bias=shared["dt_bias"])
        want = jax_kda.kda_prefill(**repeated_qk(element, G), output_final_state=True,
                                   backend="reference")
        assert_bits((got[0][i], got[1][i]), want, f"element {i}")


# ------------------------------------------------------------------------------ 3. gradients
def _tree_sum_groups(x, G):
    """[B, T, Hk * G, 128] f32 -> [B, T, Hk, 128]: reference_backward.tree_sum's order written
    out (zero-padded to a power of two n, then a[i] + a[i + n / 2]) in numpy f32."""
    x = np.asarray(x, np.float32)
    B, T, H, D = x.shape
    parts = [x.reshape(B, T, H // G, G, D)[:, :, :, i] for i in range(G)]
    n = 1 << max(G - 1, 0).bit_length()
    parts += [np.zeros_like(parts[0])] * (n - G)
    while len(parts) > 1:
        half = len(parts) // 2
        parts = [parts[i] + parts[i + half] for i in range(half)]
    return parts[0]


@pytest.mark.parametrize("G", [2, 3])
def test_gradients_sum_each_group_in_a_fixed_order(rng, G):
    Hk = 2
    args = grouped_inputs(rng, 1, 40, Hk, G, regime="slow")
    args["initial_state"] = random_states(rng, 2, Hk * G)
    cu = jnp.asarray([0, 23, 40], jnp.int32)
    weights = jnp.asarray(rng.standard_normal((1, 40, Hk * G, 128)), jnp.float32)
    names = (*DATA, "A_log", "dt_bias", "initial_state")

    def loss(*xs, backend="auto"):
        out, state = jax_kda.kda_prefill(**dict(zip(names, xs)), cu_seqlens=cu,
                                         output_final_state=True, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(state ** 2)

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))
    got = grad(*(args[a] for a in names))
    assert_bits(got, grad(*(args[a] for a in names)), "run to run")
    rep = repeated_qk(args, G)
    want = grad(*(rep[a] for a in names))
    assert got[0].shape == args["q"].shape and got[1].shape == args["k"].shape
    assert_bits(got[2:], want[2:], "dv .. dinitial_state")
    # dq, dk: the repeated call's f32 gradients summed over each group, rounded once. Computed
    # here by a separate XLA program, whose fusions may round an f32 intermediate differently
    # (by ~1e-6 of the parts' size): all but a few elements bitwise, the rest one bf16 step
    # apart, or, where the G parts cancel, apart by at most 2^-16 of the parts' summed sizes.
    out, state = jax_kda.kda_prefill(**rep, cu_seqlens=cu, output_final_state=True,
                                     backend="reference")
    f32 = reference_backward.kda_prefill_vjp_f32(
        *(rep[a] for a in names), cu, weights.astype(out.dtype), 2 * state.astype(jnp.float32))
    for i, name in ((0, "dq"), (1, "dk")):
        summed = np.asarray(jnp.asarray(_tree_sum_groups(f32[i], G)).astype(jnp.bfloat16))
        grad_i = np.asarray(got[i])
        differ = grad_i != summed
        assert differ.mean() <= 1e-3, (name, differ.sum())
        step = np.abs(summed.astype(np.float32)) * 2.0 ** -7  # one bf16 step (relative)
        parts = np.abs(np.asarray(f32[i])).reshape(grad_i.shape[:3] + (G, -1)).sum(3)
        assert np.all(np.abs(grad_i.astype(np.float32) - summed.astype(np.float32))
                      <= step + 2.0 ** -16 * parts + 1e-30), name
    # the gradient of the grouped function itself: jax autodiff of the reference backend
    # (through its repeat of q and k) agrees within the two backward algorithms' roundings
    ref = jax.jit(jax.grad(partial(loss, backend="reference"), argnums=(0, 1)))(
        *(args[a] for a in names))
    for i in range(2):
        a, b = (np.asarray(x[i], np.float32) for x in (ref, got))
        assert np.linalg.norm(a - b) <= 0.02 * np.linalg.norm(a), (i, np.linalg.norm(a - b))


# ------------------------------------------------------------------------------ 4. lowering
def _custom_call_lines(text):
    return {m.group(1): line for line in text.splitlines()
            if (m := re.search(r"stablehlo\.custom_call @(\w+)\(", line))}


def _repeats(text, Hk, G):
    """Whether the program builds a [.., Hk, G, 128] bf16 tensor (jnp.repeat's broadcast) or
    gathers: how a repeat of q or k would look."""
    return bool(re.search(rf"tensor<[0-9x]*x{Hk}x{G}x128xbf16>", text)) or "gather" in text


@pytest.mark.parametrize("numerics", ["flashkda", "fp32"])
def test_cuda_lowering_reads_qk_at_their_own_heads(monkeypatch, numerics):
    monkeypatch.setattr(api, "_require_kernels", lambda: None)  # lowering needs no GPU
    B, T, Hk, G = 2, 40, 3, 2
    args = grouped_inputs(np.random.default_rng(0), B, T, Hk, G)
    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, numerics=numerics,
                         backend="kernel"))
    text = fn.trace(**args).lower(lowering_platforms=("cuda",)).as_text()
    prepare = "jax_kda_prepare_v1" if numerics == "flashkda" else "jax_kda_prepare_fp32_v1"
    line = _custom_call_lines(text)[prepare]
    qk, value = f"tensor<{B * T}x{Hk}x128xbf16>", f"tensor<{B * T}x{Hk * G}x128xbf16>"
    assert f"({qk}, {qk}, {value}, tensor<{B * T}x{Hk * G}xbf16>, tensor<{Hk * G}xf32>" in line
    assert not _repeats(text, Hk, G)
    # the positive control: the reference lowering repeats q and k, and the check sees it
    ref = jax.jit(partial(jax_kda.kda_prefill, backend="reference")).trace(**args).lower(
        lowering_platforms=("cpu",)).as_text()
    assert _repeats(ref, Hk, G)


@pytest.mark.parametrize("pooled", [False, True])
def test_cuda_lowering_of_decode_reads_qk_at_their_own_heads(monkeypatch, pooled):
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    N, t, Hk, G = 4, 2, 2, 4
    args = grouped_inputs(np.random.default_rng(1), N, t, Hk, G)
    args["state"] = random_states(np.random.default_rng(2), 6 if pooled else N, Hk * G)
    extra = {"state_indices": jnp.asarray([5, -1, 0, 2], jnp.int32)} if pooled else {}
    fn = jax.jit(partial(jax_kda.kda_decode, output_intermediate_states=True, backend="kernel",
                         **extra))
    text = fn.trace(**args).lower(lowering_platforms=("cuda",)).as_text()
    line = _custom_call_lines(text)["jax_kda_decode_v1"]
    qk, value = f"tensor<{N}x{t}x{Hk}x128xbf16>", f"tensor<{N}x{t}x{Hk * G}x128xbf16>"
    assert f"({qk}, {qk}, {value}, {value}, tensor<{N}x{t}x{Hk * G}xbf16>" in line
    assert not _repeats(text, Hk, G)


def test_cuda_lowering_of_a_vmap_folded_into_heads(monkeypatch):
    """n elements folded into heads: one prepare call on n * Hk query/key heads."""
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    n, B, T, Hk, G = 3, 1, 32, 2, 2
    args = grouped_inputs(np.random.default_rng(3), B, T, Hk, G)
    A_log = jnp.stack([args["A_log"]] * n)

    def call(A_log):
        return jax_kda.kda_prefill(*(args[a] for a in DATA), A_log, args["dt_bias"],
                                   backend="kernel")[0]

    text = jax.jit(jax.vmap(call)).trace(A_log).lower(lowering_platforms=("cuda",)).as_text()
    line = _custom_call_lines(text)["jax_kda_prepare_v1"]
    qk, value = f"tensor<{B * T}x{n * Hk}x128xbf16>", f"tensor<{B * T}x{n * Hk * G}x128xbf16>"
    assert f"({qk}, {qk}, {value}," in line


# ------------------------------------------------------------------------------ 5. errors
@pytest.mark.parametrize("fn", ["kda_prefill", "kda_decode"])
def test_value_heads_must_be_a_multiple_of_the_query_key_heads(fn):
    args = grouped_inputs(np.random.default_rng(4), 2, 3, 2, 2)
    args["q"], args["k"] = args["q"][:, :, :1], args["k"][:, :, :1]
    args["v"], args["g"], args["beta"] = (args[a][:, :, :3] for a in ("v", "g", "beta"))
    args["A_log"], args["dt_bias"] = args["A_log"][:3], args["dt_bias"][:3]
    args["q"] = jnp.concatenate([args["q"]] * 2, axis=2)
    args["k"] = jnp.concatenate([args["k"]] * 2, axis=2)
    kw = {"state": random_states(np.random.default_rng(5), 2, 3)} if fn == "kda_decode" else {}
    with pytest.raises(ValueError, match=rf"{fn}: the value heads H = 3 \(axis 2 of v, g and "
                       r"beta.*multiple of the query/key heads Hk = 2 \(axis 2 of q and k\)"):
        getattr(jax_kda, fn)(**args, **kw, backend="reference")


@pytest.mark.parametrize("name,shape,match", [
    ("k", (2, 5, 4, 128), r"k must have shape \[B, T, Hk, 128\] like q = \(2, 5, 2, 128\)"),
    ("g", (2, 5, 2, 128), r"g must have shape \[B, T, H, 128\] like v = \(2, 5, 4, 128\)"),
    ("beta", (2, 5, 2), r"beta must have shape \[B, T, H\] = \(2, 5, 4\)"),
    ("A_log", (2,), r"A_log must have shape \[H\] = \(4,\)"),
    ("initial_state", (2, 2, 128, 128), r"initial_state must have shape \[N, H, 128, 128\]"),
])
def test_every_other_argument_is_on_the_value_heads(name, shape, match):
    args = grouped_inputs(np.random.default_rng(6), 2, 5, 2, 2)
    args[name] = jnp.zeros(shape, jnp.float32 if name in ("A_log", "initial_state")
                           else jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        jax_kda.kda_prefill(**args, backend="reference")


# ------------------------------------------------------------------------------ 6. export
def test_export_runs_on_cpu(rng):
    Hk, G = 2, 2
    args = grouped_inputs(rng, 1, 24, Hk, G)
    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True))
    exported = jax_kda.export.export(fn, platforms=("cuda", "cpu"))(**args)
    got = exported.call(**args)
    want = jax_kda.kda_prefill(**repeated_qk(args, G), output_final_state=True, backend="reference")
    assert_bits(got, want)
