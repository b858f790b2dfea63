"""kda_prefill(..., save_states_every=n): the forward keeps each sequence's f32 state every n
tokens and the backward recomputes the states inside each n-token segment (jax_kda._vjp,
jax_kda.reference_backward step 2), and the custom VJP's named residuals under jax.checkpoint.

On the CPU ("auto" runs the reference forward and the custom VJP): the gradients with n against
the gradients that recompute every state (kda_prefill_vjp without saved states), both numerics
modes, packed sequences with an empty one and lengths that are no multiple of n, grouped value
heads, under vmap; the forward's outputs bitwise those of the call without n; the option errors;
what a jax.checkpoint policy keeps (jaxpr of the gradient of a kernel-backend layer). On the GPU
(marker gpu): the kernel backend with n against the reference forward with n (on the CPU device),
the outputs bitwise the plain call's, run to run the same bits.

Inputs are fresh random numbers (seed printed; JAX_KDA_TEST_SEED=<seed> repeats a run) in the
keep32 regime (32 never-forgetting key channels per head) or, on the GPU, slow decays too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import assert_bits, make_inputs, random_states

import jax_kda
from jax_kda import _vjp, api, contract, reference_backward
from jax_kda.bench import gradients

T, HK, H = 160, 1, 2  # grouped value heads: G = 2
# two vmapped elements of three packed sequences: lengths 30, 0, 130 and 0, 100, 60
CU = np.array([[0, 30, 30, 160], [0, 0, 100, 160]], np.int32)
EVERY = 48  # 3 chunks per segment: a chain of 2 steps
# flashkda: the call and a second, fp32 forward for the states; fp32 with sequence_parallel
# "off": one forward, the call itself with checkpoints
PATHS = (("flashkda", "auto"), ("fp32", "off"))
DATA = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
NAMES = (*DATA, "initial_state")
# n against recomputing every state: the saved states are the fp32 forward's (relative error
# ~5e-4 in the never-forgetting channels), so the bf16 gradients differ by a few of their own
# rounding steps and the f32 parameter gradients by what the states' error carries into them
# (largest over 30 seeds: 1.6e-3 on dg, 1.9e-4 on ddt_bias); dv and the initial state's gradient
# come from the reverse chain alone: bitwise.
BF16_RMSE, F32_RMSE = 4e-3, 3e-3


def make_case(rng, regime="keep32"):
    """Two vmapped elements: (primals in NAMES order, cotangents of out and the final states)."""
    def element():
        args = make_inputs(rng, 1, T, H, regime=regime)
        qk = make_inputs(rng, 1, T, HK, regime=regime)
        args.update(q=qk["q"], k=qk["k"])
        return (*(args[n] for n in DATA), random_states(rng, 3, H))

    elements = [element() for _ in CU]
    primals = tuple(jnp.stack(x) for x in zip(*elements))
    d_out = jnp.asarray(rng.standard_normal((len(CU), 1, T, H, 128)), jnp.bfloat16)
    d_final = jnp.asarray(rng.standard_normal((len(CU), 3, H, 128, 128)), jnp.float32)
    return primals, (d_out, d_final)


def _prefill(primals, cu, **options):
    return jax_kda.kda_prefill(*primals[:7], initial_state=primals[7], cu_seqlens=cu,
                               output_final_state=True, **options)


@functools.cache
def vjp_with(numerics, sequence_parallel, every=EVERY):
    """jit(vmap(primal outputs and gradients of kda_prefill)) for one configuration."""
    def one(primals, cu, cotangents):
        f = lambda *p: _prefill(p, cu, numerics=numerics, sequence_parallel=sequence_parallel,
                                save_states_every=every)
        outputs, pullback = jax.vjp(f, *primals)
        return outputs, pullback(cotangents)

    return jax.jit(jax.vmap(one))


@jax.jit
@jax.vmap
def recompute_everything(primals, cu, cotangents):
    """The gradients without saved states (kda_prefill_vjp; the custom VJP's backward for n =
    None) and the plain outputs of each path's call."""
    grads = reference_backward.kda_prefill_vjp(*primals, cu, *cotangents, scale=None,
                                               lower_bound=-5.0)
    plain = {m: _prefill(primals, cu, numerics=m, sequence_parallel=sp) for m, sp in PATHS}
    return tuple(grads), plain


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(np.random.SeedSequence().entropy % 2**63)
    primals, cotangents = make_case(rng)
    return primals, cotangents, recompute_everything(primals, jnp.asarray(CU), cotangents)


@pytest.mark.parametrize("numerics, sequence_parallel", PATHS)
def test_gradients_with_saved_states_match_recomputing_every_state(numerics, sequence_parallel,
                                                                   case):
    """Packed sequences (an empty one, lengths no multiple of n), grouped heads, under vmap:
    the gradients with n are those without it to the stated tolerance (exactly for dv and the
    initial state), and the forward's outputs are the plain call's, bitwise."""
    primals, cotangents, (want, plain) = case
    outputs, got = vjp_with(numerics, sequence_parallel)(primals, jnp.asarray(CU), cotangents)
    assert_bits(outputs[:2], plain[numerics][:2], f"{numerics} outputs")
    for name, x, gx, w in zip(NAMES, primals, got, want):
        assert gx.dtype == x.dtype and gx.shape == x.shape, name
        assert np.all(np.isfinite(np.asarray(gx, np.float32))), name
        if name in ("v", "initial_state"):
            assert_bits(gx, w, name)
            continue
        error = gradients.rel_rmse(gx, np.asarray(w, np.float64))
        if x.dtype == jnp.bfloat16:
            assert error <= BF16_RMSE, (name, error)
        else:  # f32: the saved states' rounding shows
            assert 0 < error <= F32_RMSE, (name, error)
    # the empty sequences pass their state gradient through
    np.testing.assert_array_equal(np.asarray(got[7][0, 1]), np.asarray(cotangents[1][0, 1]))
    np.testing.assert_array_equal(np.asarray(got[7][1, 0]), np.asarray(cotangents[1][1, 0]))


def test_both_modes_share_the_saved_states(case):
    """The flashkda mode's states come from a second, fp32-mode forward: its gradients are
    those of the fp32 mode's one forward (the backward differentiates one function in both)."""
    primals, cotangents, _ = case
    cu = jnp.asarray(CU)
    _, flashkda = vjp_with(*PATHS[0])(primals, cu, cotangents)
    _, fp32 = vjp_with(*PATHS[1])(primals, cu, cotangents)
    for name, a, b in zip(NAMES, flashkda, fp32):
        assert gradients.rel_rmse(a, np.asarray(b, np.float64)) <= 1e-6, name


@pytest.mark.parametrize("chunks_per_segment", [1, 2, 3])
def test_segment_chains_rebuild_the_serial_chain(chunks_per_segment):
    """reference_backward step 2 from the serial chain's own states at every segment's start
    gives the serial chain's states at every chunk (7 chunks: the last segment is partial)."""
    rng = np.random.default_rng(3)
    Tc, m = 7 * 16, chunks_per_segment
    args = make_inputs(rng, 2, Tc, H, regime="keep32")
    chunk = lambda x: jnp.moveaxis(x.astype(jnp.float32).reshape(
        (2, 7, 16) + x.shape[2:]), 3, 1)  # [B, T, H, ...] -> [B, H, C, 16, ...]
    f = reference_backward.chunk_factors(
        *(chunk(args[n]) for n in ("q", "k", "g", "beta")), args["A_log"], args["dt_bias"],
        jnp.ones((2, H, 7, 16), bool), scale=128**-0.5, lower_bound=-5.0)
    v = chunk(args["v"])
    serial = reference_backward.forward_states(f, v, random_states(rng, 2, H))
    starts = serial[:, :, ::m]
    got = reference_backward.forward_states_from_segments(f, v, starts, m)
    assert got.shape == serial.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(serial), rtol=0, atol=1e-5)
    assert_bits(got[:, :, ::m], starts)


# ------------------------------------------------------------------------------------- options


@pytest.mark.parametrize("options, message", [
    ({"save_states_every": 0}, "save_states_every must be None or a positive multiple of 16"),
    ({"save_states_every": 24}, "save_states_every must be None or a positive multiple of 16"),
    ({"save_states_every": True}, "save_states_every must be None or a positive multiple"),
    ({"save_states_every": 16.0}, "save_states_every must be None or a positive multiple"),
    ({"save_states_every": 16, "checkpoint_every": 16}, "excludes checkpoint_every"),
    ({"save_states_every": 16, "state_indices": "pool"}, "excludes state pools"),
    ({"save_states_every": 16, "numerics": "fp32", "sequence_parallel": 2},
     "excludes explicit sequence_parallel counts"),
])
def test_bad_options_raise_naming_the_argument(options, message):
    rng = np.random.default_rng(0)
    args = make_inputs(rng, 1, 32, 1)
    state = random_states(rng, 1, 1)
    if options.get("state_indices") == "pool":
        options = dict(options, state_indices=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda: jax_kda.kda_prefill(**args, initial_state=state, **options))


def test_the_reference_backend_ignores_it():
    """backend="reference" is plain JAX autodiff: the gradient's program is the same with n."""
    rng = np.random.default_rng(2)
    args = make_inputs(rng, 1, 48, 1)
    state = random_states(rng, 1, 1)

    def grad_program(every):
        loss = lambda v: jnp.sum(jax_kda.kda_prefill(
            **dict(args, v=v), initial_state=state, backend="reference",
            save_states_every=every)[0].astype(jnp.float32))
        return str(jax.make_jaxpr(jax.grad(loss))(args["v"]))

    assert grad_program(16) == grad_program(None)


# ------------------------------------------------------------------------ named residuals


def _layer(v, q_source, x, numerics, every):
    """A layer differentiated w.r.t. v whose q is sin(q_source) computed inside it: q is no
    function of v, so a sin in the backward means q was recomputed there, not saved."""
    q = jnp.sin(q_source.astype(jnp.float32)).astype(jnp.bfloat16)
    k, g, beta, A_log, dt_bias = x
    out, state = jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, backend="kernel",
                                     numerics=numerics, output_final_state=True,
                                     save_states_every=every)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(state.astype(jnp.float32))


def _forward_and_backward(policy, numerics="flashkda", every=32):
    """The jaxpr text of value_and_grad (w.r.t. v) of the layer under jax.checkpoint(policy):
    (outside the rematerialised part, inside it: what the backward recomputes)."""
    rng = np.random.default_rng(1)
    args = make_inputs(rng, 1, 64, 2)
    x = tuple(args[n] for n in ("k", "g", "beta", "A_log", "dt_bias"))
    layer = jax.checkpoint(functools.partial(_layer, numerics=numerics, every=every),
                           policy=policy)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(layer))(args["v"], args["q"], x).jaxpr
    remat = [e for e in jaxpr.eqns if e.primitive.name in ("remat2", "checkpoint")]
    assert len(remat) == 1, [e.primitive.name for e in jaxpr.eqns]
    outside = "\n".join(str(e) for e in jaxpr.eqns if e is not remat[0])
    return outside, str(remat[0].params["jaxpr"])


def test_a_checkpoint_policy_keeps_or_drops_the_named_residuals(monkeypatch):
    """jax.checkpoint around a layer honours the names of the custom VJP's residuals: saving
    STATES_NAME runs the states' forward (the fp32 pool recurrence with checkpoints) once, in
    the forward pass; dropping it moves that forward into the backward; INPUTS_NAME decides
    whether the layer's q (sin of its input) is saved or recomputed. Traced for the kernel
    backend (no GPU needed)."""
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    states_call = f"target_name={contract.RECURRENCE_FP32_POOL_TARGET}"
    names = jax.checkpoint_policies
    for policy, states_saved, inputs_saved in [
        (names.save_only_these_names(_vjp.STATES_NAME), True, False),
        (names.save_only_these_names(_vjp.STATES_NAME, _vjp.INPUTS_NAME), True, True),
        (names.save_any_names_but_these(_vjp.STATES_NAME), False, True),
        (names.nothing_saveable, False, False),
    ]:
        outside, backward = _forward_and_backward(policy)
        assert (states_call in outside) == states_saved, policy
        assert (states_call in backward) != states_saved, policy
        assert (" sin " in backward) != inputs_saved, policy
    # fp32 with sequence_parallel "auto" on one sequence: the call and the states' forward are
    # separate; the call's own recurrence stays in the forward pass only
    outside, backward = _forward_and_backward(names.save_only_these_names(_vjp.STATES_NAME),
                                              numerics="fp32")
    assert states_call in outside and states_call not in backward


def test_without_save_states_every_no_states_are_kept(monkeypatch):
    """n = None: no states' forward anywhere (the residuals are the inputs)."""
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    outside, backward = _forward_and_backward(jax.checkpoint_policies.everything_saveable,
                                              every=None)
    call = f"target_name={contract.RECURRENCE_FP32_POOL_TARGET}"
    assert call not in outside and call not in backward
    assert f"target_name={contract.RECURRENCE_TARGET}" in outside


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("numerics, sequence_parallel, packed", [
    ("flashkda", "auto", True),  # the call and a second, fp32 forward for the states
    ("fp32", "off", True),  # one forward: the call with checkpoints
    ("fp32", "auto", False),  # one sequence that "auto" may cut: two forwards
])
def test_gpu_kernels_with_saved_states(kernel_gpus, rng, numerics, sequence_parallel, packed):
    """The kernel backend with n = 64 against the reference forward with n (backend "auto" on
    the CPU device) and against recomputing every state; packed sequences (an empty one,
    lengths no multiple of 64) or one sequence, grouped heads, slowly decaying heads beside
    heads with never-forgetting channels; the outputs bitwise the plain call's; run to run the
    same bits."""
    Tg, Hk, Hg, every = 1024, 2, 4, 64
    cu = jnp.asarray([0, 300, 300, 1000, Tg], jnp.int32) if packed else None
    N = 4 if packed else 1
    slow = make_inputs(rng, 1, Tg, Hg // 2, regime="slow")
    keep = make_inputs(rng, 1, Tg, Hg // 2, regime="keep32")
    per_head = {n: jnp.concatenate([slow[n], keep[n]], axis=0 if n in ("A_log", "dt_bias") else 2)
                for n in DATA[2:]}
    qk = make_inputs(rng, 1, Tg, Hk)
    primals = (qk["q"], qk["k"], *(per_head[n] for n in DATA[2:]), random_states(rng, N, Hg))
    cotangents = (jnp.asarray(rng.standard_normal((1, Tg, Hg, 128)), jnp.bfloat16),
                  jnp.asarray(rng.standard_normal((N, Hg, 128, 128)), jnp.float32))

    def run(backend, every, device):
        def f(*p):
            return _prefill(p, cu, numerics=numerics, sequence_parallel=sequence_parallel,
                            backend=backend, save_states_every=every)

        def both(primals, cotangents):
            outputs, pullback = jax.vjp(f, *primals)
            return outputs, pullback(cotangents)

        put = lambda tree: jax.device_put(tree, device)
        with jax.default_device(device):
            return jax.jit(both)(put(primals), put(cotangents))

    gpu, cpu = kernel_gpus[0], jax.devices("cpu")[0]
    outputs, got = run("kernel", every, gpu)
    plain = jax.jit(lambda p: _prefill(p, cu, numerics=numerics,
                                       sequence_parallel=sequence_parallel,
                                       backend="kernel"))(primals)
    assert_bits(outputs[:2], plain[:2], "outputs")
    assert_bits(run("kernel", every, gpu)[1], got, "run to run")
    _, want = run("auto", every, cpu)  # the fp32 reference's states: f32 sums in another order
    _, every_state = run("auto", None, cpu)
    for name, x, gx, w, w0 in zip(NAMES, primals, got, want, every_state):
        assert np.all(np.isfinite(np.asarray(gx, np.float32))), name
        bf16 = x.dtype == jnp.bfloat16
        error = gradients.rel_rmse(gx, np.asarray(w, np.float64))
        assert error <= (BF16_RMSE if bf16 else F32_RMSE), (name, error)
        # slow decays carry the saved states' error into the f32 gradients (docs/training.md:
        # up to 2.1e-3 at n = 64, T = 1024)
        error = gradients.rel_rmse(gx, np.asarray(w0, np.float64))
        assert error <= (BF16_RMSE if bf16 else 1e-2), (name, error)
