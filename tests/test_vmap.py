"""vmap of kda_prefill: the kernel path folds the vmapped axis into B, N or H (one kernel call).

On CPU the kernels cannot run, so the folding rule is exercised with the pure-JAX reference as its
core (`reference_core`): the vmapped result must equal a Python loop over the elements bit for bit,
and the core must have been traced with the folded shape. The same rule on the real kernel path is
checked by lowering for CUDA: a vmapped call holds exactly one prepare and one recurrence custom
call.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import make_inputs, random_states

import jax_kda
from jax_kda import _batching, _checks, _ffi, _kernel_path, _launch, contract, reference

H = 2


def states(rng, n, rows, h=H):
    """bf16 initial states [n, rows, h, 128, 128], a vmapped axis of n."""
    return random_states(rng, n * rows, h, jnp.bfloat16, scale=1.0).reshape(n, rows, h, 128, 128)


def make_batch(n, b, t, h=H, seed=0, state=True):
    """Inputs with a leading vmapped axis of size n on every argument."""
    rng = np.random.default_rng(seed)
    batch = jax.tree.map(lambda *x: jnp.stack(x), *(make_inputs(rng, b, t, h) for _ in range(n)))
    batch["state"] = states(rng, n, b, h) if state else None
    return batch


class ReferenceCore:
    """Stands in for _kernel_path.prefill on CPU; records the shapes it is traced with."""

    def __init__(self):
        self.q_shapes = []

    def __call__(self, q, k, v, g, beta, A_log, dt_bias, state, cu, state_indices=None,
                 ckpt_offsets=None, *, problem):
        self.q_shapes.append(tuple(q.shape))
        assert A_log.shape == (problem.heads,) and q.shape[2] == problem.heads
        assert q.shape[:2] == (problem.batch, problem.seqlen)
        assert state_indices is None and ckpt_offsets is None
        out, state = reference.kda_prefill_reference(
            q, k, v, g, beta, A_log, dt_bias, scale=problem.scale, lower_bound=problem.lower_bound,
            initial_state=state, cu_seqlens=cu, inverse="stable",
        )
        return out, state, None


def problem_for(x, cu=None):
    return _checks.check_prefill(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], scale=None,
        lower_bound=-5.0, initial_state=x.get("state"), output_final_state=True, cu_seqlens=cu,
        state_indices=None, checkpoint_every=None, numerics="flashkda", inverse="stable",
        sequence_parallel="auto", recurrence="auto", backend="kernel",
    )


ORDER = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "cu")
NO_POOL = (None, None)  # state_indices, ckpt_offsets of the folding wrapper
DATA = ("q", "k", "v", "g", "beta")
SCALE = 128**-0.5

# The loop side: one unbatched reference call per element (jitted once per element shape and shared
# by the tests, which mostly use the same element shapes: compiling the reference takes seconds).
_reference_jit = jax.jit(reference.kda_prefill_reference,
                         static_argnames=("scale", "lower_bound", "inverse"))


def reference_one(q, k, v, g, beta, A_log, dt_bias, state=None, cu=None):
    return _reference_jit(q, k, v, g, beta, A_log, dt_bias, scale=SCALE, lower_bound=-5.0,
                          initial_state=state, cu_seqlens=cu, inverse="stable")


def element(args, mapped, i):
    """Element i of the vmapped arguments (unmapped ones are shared as they are)."""
    return {a: (x[i] if a in mapped and x is not None else x) for a, x in args.items()}


def run_vmap_and_loop(batch, mapped, n, cu=None):
    """vmap of the folding wrapper vs a loop of unbatched calls; `mapped` names the vmapped args."""
    args = {a: (batch[a] if a in mapped else (None if batch.get(a) is None else batch[a][0]))
            for a in ORDER[:8]}
    args["cu"] = cu
    core = ReferenceCore()
    fn = _batching.with_folding_vmap(core, problem_for(element(args, mapped, 0), cu))
    in_axes = tuple(0 if a in mapped and args[a] is not None else None for a in ORDER)
    result = jax.jit(jax.vmap(fn, in_axes=in_axes + (None, None)))(*(args[a] for a in ORDER),
                                                                  *NO_POOL)
    loop = [reference_one(**element(args, mapped, i)) for i in range(n)]
    return result, loop, list(core.q_shapes)

def assert_same_as_loop(result, loop):
    out, state, checkpoints = result
    assert checkpoints is None
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.stack([np.asarray(o, np.float32) for o, _ in loop]))
    np.testing.assert_array_equal(np.asarray(state, np.float32),
                                  np.stack([np.asarray(s, np.float32) for _, s in loop]))


# Element shapes shared by the tests (one loop-side compile each): fixed length B=2, T=20; varlen
# T=40 in three sequences (lengths not multiples of 16, one empty).
B, T = 2, 20
VT = 40


def varlen_cu(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def test_batched_inputs_fold_into_batch():
    n = 3
    batch = make_batch(n, B, T)
    result, loop, traced = run_vmap_and_loop(batch, DATA + ("state",), n)
    assert_same_as_loop(result, loop)
    assert (n * B, T, H, 128) in traced, traced


def test_shared_state_and_partly_batched_inputs_fold_into_batch():
    n = 2
    batch = make_batch(n, B, T, seed=1)
    result, loop, traced = run_vmap_and_loop(batch, ("q", "v"), n)
    assert_same_as_loop(result, loop)
    assert (n * B, T, H, 128) in traced, traced


def test_vmapped_head_parameters_fold_into_heads():
    n = 3
    batch = make_batch(n, B, T, seed=2)
    result, loop, traced = run_vmap_and_loop(batch, DATA + ("A_log", "dt_bias", "state"), n)
    assert_same_as_loop(result, loop)
    assert (B, T, n * H, 128) in traced, traced


def test_varlen_folds_into_sequences_shared_cu_seqlens():
    n = 3
    batch = make_batch(n, 1, VT, seed=3)
    batch["state"] = states(np.random.default_rng(4), n, 3)
    result, loop, traced = run_vmap_and_loop(batch, DATA + ("state",), n, cu=varlen_cu([17, 0, 23]))
    assert_same_as_loop(result, loop)
    assert (1, n * VT, H, 128) in traced, traced


def vmapped_cu_case(seed, mapped):
    n = 3
    batch = make_batch(n, 1, VT, seed=seed)
    batch["state"] = states(np.random.default_rng(seed + 1), n, 3)
    args = {a: (batch[a] if a in mapped else batch[a][0]) for a in ORDER[:8]}
    args["cu"] = jnp.stack([varlen_cu([1, 39, 0]), varlen_cu([40, 0, 0]), varlen_cu([16, 3, 21])])
    mapped = mapped + ("cu",)
    core = ReferenceCore()
    fn = _batching.with_folding_vmap(core, problem_for(element(args, mapped, 0), args["cu"][0]))
    in_axes = tuple(0 if a in mapped else None for a in ORDER)
    result = jax.jit(jax.vmap(fn, in_axes=in_axes + (None, None)))(*(args[a] for a in ORDER),
                                                                  *NO_POOL)
    loop = [reference_one(**element(args, mapped, i)) for i in range(n)]
    assert_same_as_loop(result, loop)
    return n, core.q_shapes


def test_varlen_with_vmapped_cu_seqlens_folds_into_sequences():
    n, traced = vmapped_cu_case(5, DATA + ("state",))
    assert (1, n * VT, H, 128) in traced, traced


def test_vmapped_head_parameters_and_cu_seqlens_run_one_after_another():
    """No single call fits (heads and sequence boundaries differ): the lax.map fallback, still
    exact."""
    _, traced = vmapped_cu_case(7, DATA + ("A_log", "dt_bias", "state"))
    assert all(shape == (1, VT, H, 128) for shape in traced), traced


def test_nested_vmap_folds_both_axes():
    n1, n2 = 2, 2
    rng = np.random.default_rng(9)
    x = make_inputs(rng, n1 * n2 * B, T, H)
    A_log, dt_bias = x.pop("A_log"), x.pop("dt_bias")
    x = {a: v.reshape(n1, n2, B, *v.shape[1:]) for a, v in x.items()}
    x["state"] = states(rng, n1 * n2, B).reshape(n1, n2, B, H, 128, 128)
    names = DATA + ("state",)
    one = {a: x[a][0, 0] for a in names}
    one.update(A_log=A_log, dt_bias=dt_bias)
    core = ReferenceCore()
    fn = _batching.with_folding_vmap(core, problem_for(one))
    # A_log and dt_bias are passed as arguments, not closed over: XLA would constant-fold the
    # reference's gate math with its evaluator, whose exp2/tanh bits differ from compiled code.
    call = lambda q, k, v, g, beta, state, A_log, dt_bias: fn(
        q, k, v, g, beta, A_log, dt_bias, state, None, *NO_POOL)
    in_axes = (0,) * 6 + (None, None)
    out, state, _ = jax.jit(jax.vmap(jax.vmap(call, in_axes), in_axes))(
        *(x[a] for a in names), A_log, dt_bias)
    assert (n1 * n2 * B, T, H, 128) in core.q_shapes, core.q_shapes
    for i in range(n1):
        for j in range(n2):
            o, s = reference_one(*(x[a][i, j] for a in DATA), A_log, dt_bias, x["state"][i, j])
            np.testing.assert_array_equal(np.asarray(out[i, j], np.float32),
                                          np.asarray(o, np.float32))
            np.testing.assert_array_equal(np.asarray(state[i, j], np.float32),
                                          np.asarray(s, np.float32))


# ------------------------------------------------------------------ through the public kda_prefill


@pytest.fixture
def kernel_path_on_cpu(monkeypatch):
    """backend="kernel" on CPU: skip the availability check, run the reference as the 'kernel'."""
    core = ReferenceCore()
    monkeypatch.setattr(jax_kda.api, "_require_kernels", lambda: None)
    monkeypatch.setattr(_kernel_path, "prefill", core)
    return core


def public_call(backend, **kw):
    def call(q, k, v, g, beta, A_log, dt_bias, state):
        return jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state=state,
                                   output_final_state=True, backend=backend, **kw)
    return call


@pytest.mark.parametrize("in_axes", [(0, 0, 0, 0, 0, None, None, 0),
                                     (2, 2, 2, 2, 2, None, None, None)])
def test_public_kernel_path_folds_and_matches_loop(kernel_path_on_cpu, in_axes):
    n = 2
    batch = make_batch(n, B, T, seed=10)
    args = [batch[a] for a in ORDER[:8]]
    # Move the vmapped axis where in_axes says; unmapped arguments lose it.
    args = [x[0] if ax is None else jnp.moveaxis(x, 0, ax) for x, ax in zip(args, in_axes)]
    call = public_call("kernel")
    out, state = jax.jit(jax.vmap(call, in_axes=in_axes))(*args)
    assert (n * B, T, H, 128) in kernel_path_on_cpu.q_shapes, kernel_path_on_cpu.q_shapes
    for i in range(n):
        o, s = reference_one(*(x if ax is None else jnp.take(x, i, axis=ax)
                               for x, ax in zip(args, in_axes)))
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(o, np.float32))
        np.testing.assert_array_equal(np.asarray(state[i], np.float32), np.asarray(s, np.float32))


def test_public_auto_backend_vmaps_both_branches(monkeypatch):
    """With the kernels built, "auto" is a platform switch: vmap batches both branches; lowered for
    CUDA it holds one folded pair of custom calls, and run on CPU it is the vmapped reference."""
    monkeypatch.setattr(_ffi, "kernels_available", lambda: True)  # lowering needs no library
    n = 2
    batch = make_batch(n, B, T, seed=11)
    args = [batch[a] for a in ORDER[:8]]
    in_axes = (0, 0, 0, 0, 0, None, None, 0)
    args = [x[0] if ax is None else x for x, ax in zip(args, in_axes)]
    vmapped = jax.jit(jax.vmap(public_call("auto"), in_axes=in_axes))
    text = vmapped.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert sorted(custom_call_targets(text)) == ["jax_kda_prepare_v1", "jax_kda_recurrence_v1"]
    assert f"tensor<{n * B * T}x{H}x128xbf16>" in text
    out, state = vmapped(*args)
    for i in range(n):
        o, s = reference_one(*(x if ax is None else x[i] for x, ax in zip(args, in_axes)))
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(o, np.float32))
        np.testing.assert_array_equal(np.asarray(state[i], np.float32), np.asarray(s, np.float32))


def custom_call_targets(text):
    return re.findall(r"custom_call @(jax_kda_\w+)\(", text)


@pytest.mark.parametrize("recurrence", ["auto", "baseline"])
def test_vmapped_kernel_call_lowers_to_one_pair_of_custom_calls(monkeypatch, recurrence):
    monkeypatch.setattr(jax_kda.api, "_require_kernels", lambda: None)
    n, b, t = 3, 2, 24
    batch = make_batch(n, b, t, seed=10)
    args = [batch[a] for a in ORDER[:8]]
    in_axes = (0, 0, 0, 0, 0, None, None, 0)
    args = [x[0] if ax is None else x for x, ax in zip(args, in_axes)]
    call = public_call("kernel", recurrence=recurrence)
    text = (jax.jit(jax.vmap(call, in_axes=in_axes)).trace(*args)
            .lower(lowering_platforms=("cuda",)).as_text())
    targets = custom_call_targets(text)
    assert sorted(targets) == ["jax_kda_prepare_v1", "jax_kda_recurrence_v1"], targets
    # The kernels see all n*B sequences as one packed call: [n*B*T, H, 128] tokens.
    assert f"tensor<{n * b * t}x{H}x128xbf16>" in text
    assert f"tensor<{n * b}x{H}x128x128xbf16>" in text
    # The launch heuristic chose the column split for the folded problem (n*B sequences); the
    # baseline kernel stays the baseline kernel through the folding.
    block_v = [int(m) for m in re.findall(r"block_v = (\d+) : i32", text)]
    if recurrence == "baseline":
        assert block_v == [contract.BASELINE_BLOCK_V]
    else:
        assert block_v == [_launch.choose_block_v(num_seqs=n * b, heads=H)]


def test_vmapped_head_parameters_lower_to_one_call_with_more_heads(monkeypatch):
    monkeypatch.setattr(jax_kda.api, "_require_kernels", lambda: None)
    n, b, t = 2, 1, 16
    batch = make_batch(n, b, t, seed=11)
    args = [batch[a] for a in ORDER[:8]]
    text = (jax.jit(jax.vmap(public_call("kernel"))).trace(*args)
            .lower(lowering_platforms=("cuda",)).as_text())
    assert sorted(custom_call_targets(text)) == ["jax_kda_prepare_v1", "jax_kda_recurrence_v1"]
    assert f"tensor<{b * t}x{n * H}x128xbf16>" in text


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_vmapped_kernels_equal_a_loop(varlen, kernel_gpus):
    gpus = kernel_gpus
    n, t, h = 3, 300, 6
    batch = make_batch(n, 1 if varlen else 2, t, h=h, seed=12)
    cu = varlen_cu([17, 0, 283]) if varlen else None
    if varlen:
        batch["state"] = states(np.random.default_rng(13), n, 3, h)
    names = DATA + ("state",)

    def call(q, k, v, g, beta, state, A_log, dt_bias):
        return jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state=state,
                                   cu_seqlens=cu, output_final_state=True, backend="kernel")

    args = jax.device_put([batch[a] for a in names] + [batch["A_log"][0], batch["dt_bias"][0]],
                          gpus[0])
    vmapped = jax.jit(jax.vmap(call, in_axes=(0,) * 6 + (None, None)))
    text = vmapped.lower(*args).as_text()
    assert sorted(custom_call_targets(text)) == ["jax_kda_prepare_v1", "jax_kda_recurrence_v1"]
    out, state = vmapped(*args)
    one = jax.jit(call)
    for i in range(n):
        o, s = one(*(x[i] for x in args[:6]), *args[6:])
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(o, np.float32))
        np.testing.assert_array_equal(np.asarray(state[i], np.float32), np.asarray(s, np.float32))
