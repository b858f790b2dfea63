"""Training on a data x head mesh: a step of a small KDA model split over batch rows and heads.

The model: 2 KDA layers with plain-JAX projections (x -> q, k on Hk = 4 heads and v, g, beta on
H = 8 heads, grouped value heads; the KDA output projected back and added to x), a squared-error
loss, jax.value_and_grad and one SGD update, jitted. Inputs are split over the batch ("data"),
weights over heads ("heads"), on a ("data": 2, "heads": 4) mesh with Auto axes
(custom_partitioning) and a ("data": 4, "heads": 2) mesh with Explicit axes (shard_map).

What is checked on 8 virtual CPU devices (the CPU runs backend "auto" as the reference forward
plus the custom VJP's backward, through the same partitioning as the kernels):
- each device's KDA forward and backward see its local rows and heads (B / data, H / heads);
- the compiled step moves no KDA operand, result or gradient between devices: its only
  collectives are all-reduces of the model's other arrays (the data-parallel sums of the weights'
  gradients, the loss's sum, the tensor-parallel sums of the residual stream over heads) and the
  exchange of dA_log's and ddt_bias's per-row partial sums over the data axis
  (f32 [rows, H / heads, 128]);
- the step equals the unsharded step (tolerances below), and the KDA call's gradients are bitwise
  those of the same call split over heads alone.

Like tests/test_sharding.py, the 8-device tests run in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (KDA_MESH_SUBPROCESS=1).
"""

import os
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from kda_testing import assert_bits, make_inputs, random_states, run_on_virtual_cpu_devices

import jax_kda
from jax_kda import _vjp, api

IN_SUBPROCESS = os.environ.get("KDA_MESH_SUBPROCESS") == "1"
DEVICES = 8
on_virtual_devices = pytest.mark.skipif(
    not IN_SUBPROCESS, reason="runs inside test_mesh_training_on_eight_virtual_cpu_devices' "
    "subprocess")

B, T, H, HK, D_MODEL, LAYERS = 4, 20, 8, 4, 32, 2  # T = 20: a partial last chunk
LR = 0.5
MESHES = {  # (data, heads), axis type
    "2x4-auto": ((2, 4), AxisType.Auto),
    "4x2-explicit": ((4, 2), AxisType.Explicit),
}


@pytest.mark.slow
@pytest.mark.skipif(IN_SUBPROCESS, reason="this is the parent of the subprocess")
def test_mesh_training_on_eight_virtual_cpu_devices():
    run_on_virtual_cpu_devices(__file__, "KDA_MESH_SUBPROCESS",
                               "not test_mesh_training_on_eight_virtual_cpu_devices", 6,
                               devices=DEVICES)


# ---------------------------------------------------------------------------------- the model


def init_params(rng):
    """Per layer: projections to q, k (Hk heads), v, g (H heads), beta; A_log; dt_bias with 32
    never-forgetting channels per head (dt_bias -40: the gate is 0 in f32), 32 slowly decaying
    ones (-4) and 64 others; the output projection."""
    def weight(*shape, fan_in=D_MODEL):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), jnp.float32)

    layers = []
    for _ in range(LAYERS):
        dt_bias = rng.standard_normal((H, 128))
        dt_bias[:, :32], dt_bias[:, 32:64] = -40.0, -4.0
        layers.append({
            "wq": weight(D_MODEL, HK, 128), "wk": weight(D_MODEL, HK, 128),
            "wv": weight(D_MODEL, H, 128), "wg": weight(D_MODEL, H, 128),
            "wb": weight(D_MODEL, H), "A_log": jnp.asarray(rng.uniform(-2, 1, H), jnp.float32),
            "dt_bias": jnp.asarray(dt_bias, jnp.float32), "wo": weight(H, 128, D_MODEL,
                                                                       fan_in=H * 128)})
    return layers


def param_specs(heads):
    """Every weight split over its head axis."""
    return [{"wq": P(None, heads, None), "wk": P(None, heads, None), "wv": P(None, heads, None),
             "wg": P(None, heads, None), "wb": P(None, heads), "A_log": P(heads),
             "dt_bias": P(heads, None), "wo": P(heads, None, None)} for _ in range(LAYERS)]


def layer(x, w, backend, residual):
    bf16 = lambda a: a.astype(jnp.bfloat16)
    q, k = (bf16(jnp.einsum("btd,dhk->bthk", x, w[name])) for name in ("wq", "wk"))
    v, g = (bf16(jnp.einsum("btd,dhk->bthk", x, w[name])) for name in ("wv", "wg"))
    beta = bf16(jnp.einsum("btd,dh->bth", x, w["wb"]))
    out, _ = jax_kda.kda_prefill(q, k, v, g, beta, w["A_log"], w["dt_bias"], backend=backend)
    # a sum over the heads: Explicit mesh axes want the result's sharding named (`residual`)
    return x + jnp.einsum("bthk,hkd->btd", out.astype(jnp.float32), w["wo"],
                          out_sharding=residual)


def loss_fn(params, x, target, backend="auto", residual=None):
    for w in params:
        x = layer(x, w, backend, residual)
    return jnp.mean((x - target) ** 2)


def train_step(params, x, target, backend="auto", residual=None):
    """(loss, gradients, updated weights). residual: the residual stream's sharding, on meshes
    with Explicit axes."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, target, backend, residual)
    return loss, grads, jax.tree.map(lambda p, d: p - LR * d, params, grads)


def make_batch(rng):
    x = jnp.asarray(rng.standard_normal((B, T, D_MODEL)), jnp.float32)
    return x, jnp.asarray(rng.standard_normal((B, T, D_MODEL)), jnp.float32)


def make_mesh(name):
    shape, axis_type = MESHES[name]
    return jax.make_mesh(shape, ("data", "heads"), axis_types=(axis_type,) * 2)


def placed(mesh, params, x, target):
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    params = jax.tree.map(put, params, param_specs("heads"))
    return params, put(x, P("data", None, None)), put(target, P("data", None, None))


# ------------------------------------------------------------------------------ HLO inspection

_COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
    r"(?:-start)?\(")


def collectives(hlo: str):
    """(op, [result shapes]) of every collective in a compiled module's text."""
    found = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            found.append((m.group(2), re.findall(r"\w+\[([\d,]*)\]", m.group(1))))
    return found


def disallowed_collectives(hlo: str, heads: int):
    """Collectives that would mean KDA's work crossed devices (`heads`: the head axis's size).

    Disallowed: any collective of an array shaped as a KDA operand or result, local or global
    ([rows, T, heads, 128] for q, k, v, g, out and their gradients, [rows, T, heads] for beta,
    [rows, heads, 128, 128] for states), and any all-gather, all-to-all or collective-permute other
    than of f32 [rows, H / heads, 128], the per-row sums of dA_log and ddt_bias exchanged to be
    summed over the rows in the unsharded order. Allowed: all-reduces of the model's other
    arrays: the weights' gradients summed over the data axis (data parallelism), the loss's sum,
    and the residual stream [B / data, T, D] summed over the head axis after the output
    projection and, in the backward, after the input projections (tensor parallelism)."""
    head_counts = {H, HK, H // heads, HK // heads}
    bad = []
    for op, shapes in collectives(hlo):
        dims = [[int(d) for d in s.split(",") if d] for s in shapes]
        kda_shaped = any(
            (len(d) == 4 and ((d[1] == T and d[2] in head_counts and d[3] == 128)
                              or d[2:] == [128, 128]))
            or (len(d) == 3 and d[1] == T and d[2] in head_counts) for d in dims)
        row_sums = all(len(d) == 3 and d[1:] == [H // heads, 128] for d in dims)
        if kda_shaped or (op != "all-reduce" and not row_sums):
            bad.append((op, shapes))
    return bad


def relative_error(got, want):
    got, want = (np.asarray(a, np.float64) for a in (got, want))
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# ------------------------------------------------------------------------------------- tests


@on_virtual_devices
def test_virtual_devices_are_there():
    assert len(jax.devices()) == DEVICES


class Recorder:
    """Wraps a step of the call path, recording the (q, v) head counts and batch it sees."""

    def __init__(self, step):
        self.step, self.seen = step, []

    def __call__(self, *arrays, problem):
        q, v = arrays[0], arrays[2]
        self.seen.append((q.shape[0], q.shape[2], v.shape[2]))
        return self.step(*arrays, problem=problem)


@on_virtual_devices
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_training_step_on_data_and_head_mesh(mesh_name, monkeypatch, rng):
    mesh = make_mesh(mesh_name)
    data, heads = mesh.shape["data"], mesh.shape["heads"]
    forward, backward = Recorder(api.dispatch), Recorder(_vjp.backward_step)
    monkeypatch.setattr(api, "dispatch", forward)
    monkeypatch.setattr(_vjp, "backward_step", backward)
    params, (x, target) = init_params(rng), make_batch(rng)

    explicit = MESHES[mesh_name][1] == AxisType.Explicit
    residual = NamedSharding(mesh, P("data", None, None)) if explicit else None
    step = jax.jit(partial(train_step, residual=residual))
    compiled = step.lower(*placed(mesh, params, x, target)).compile()
    hlo = compiled.as_text()
    local = (B // data, HK // heads, H // heads)
    # The forward and backward compiled run on the local rows and heads (the partitioning
    # callbacks run while compiling, after every trace); custom_partitioning also traces its body
    # on the global shapes, for their result shapes only.
    for seen in (forward.seen, backward.seen):
        assert seen and seen[-1] == local and set(seen) <= {local, (B, HK, H)}, seen
    assert not disallowed_collectives(hlo, heads), disallowed_collectives(hlo, heads)
    ops = {op for op, _ in collectives(hlo)}
    assert "all-reduce" in ops, ops  # the data-parallel gradient sums are there

    loss, grads, updated = compiled(*placed(mesh, params, x, target))
    want_loss, want_grads, want = jax.jit(train_step)(params, x, target)
    # The unsharded step sums the weights' gradients over B * T and the residual stream over H in
    # one dot each; split, XLA sums per device and all-reduces, a different f32 order (and the
    # gate gradients differ in their last bits, see the next test): not bitwise. The loss
    # agrees to 1e-5 (seen up to 2e-6), the gradients to 4e-3 of their largest value (2^-8, one
    # bf16 unit in the last place; seen up to 7e-4): the projections' results are rounded to
    # bf16 for KDA, so an f32 difference in the last bit flips an input's bf16 rounding now and
    # then, and the first layer's gradients (dA_log's sums cancel to ~1e-5 of their terms) carry
    # that. The updated weights then differ by at most LR times that, plus the f32 rounding of
    # the weight.
    assert relative_error(loss, want_loss) < 1e-5
    for (path, a), b, w, d in zip(jax.tree_util.tree_leaves_with_path(grads),
                                  jax.tree.leaves(want_grads), jax.tree.leaves(want),
                                  jax.tree.leaves(updated)):
        spec = param_specs("heads")[0][path[-1].key]
        for got in (a, d):
            assert got.sharding.is_equivalent_to(NamedSharding(mesh, spec), got.ndim), path
        assert relative_error(a, b) < 4e-3, (path, relative_error(a, b))
        largest = lambda x: float(np.max(np.abs(np.asarray(x))))
        bound = LR * 4e-3 * largest(b) + 2**-22 * largest(w)
        assert largest(np.asarray(d) - np.asarray(w)) <= bound, path
    assert all(np.any(np.asarray(d) != 0) for d in jax.tree.leaves(grads))


def kda_value_and_grads(args, out_cotangent, state_cotangent):
    """kda_prefill's outputs and the gradients of all its inputs for the given cotangents."""
    def f(a):
        return jax_kda.kda_prefill(**a, output_final_state=True)

    (out, state), pullback = jax.vjp(f, args)
    return out, state, pullback((out_cotangent, state_cotangent))[0]


@on_virtual_devices
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_kda_gradients_split_over_batch_and_heads(axis_type, rng):
    """One kda_prefill call's forward and backward split over batch and heads: bitwise the call
    split over heads alone (the batch split changes no bit: each row is computed alone, and the
    row sums of dA_log and ddt_bias are summed in the unsharded order); bitwise the unsharded call
    for out, the final state and the gradients of q, k, v, beta and the initial state. The gate's
    gradients (dg, and from it ddt_bias, dA_log) of every split program differ from the unsharded
    program's in the last bits (XLA on CPU compiles the unsharded program's gate gradient
    differently; so it was with the head split alone before the batch could split):
    assert_close_gate_gradients."""
    mesh = jax.make_mesh((2, 4), ("data", "heads"), axis_types=(axis_type,) * 2)
    args = make_inputs(rng, B, T, H)
    args["q"], args["k"] = (make_inputs(rng, B, T, HK)[name] for name in ("q", "k"))
    args["initial_state"] = random_states(rng, B, H, jnp.float32, scale=1.0)
    d_out = jnp.asarray(rng.standard_normal((B, T, H, 128)), jnp.bfloat16)
    d_state = jnp.asarray(rng.standard_normal((B, H, 128, 128)), jnp.float32)

    def put(specs):
        given = {name: jax.device_put(x, NamedSharding(mesh, specs[name]))
                 for name, x in args.items()}
        return (given, jax.device_put(d_out, NamedSharding(mesh, specs["out"])),
                jax.device_put(d_state, NamedSharding(mesh, specs["final_state"])))

    fn = jax.jit(kda_value_and_grads)
    both = put(jax_kda.sharding.head_specs("heads", "data"))
    compiled = fn.lower(*both).compile()
    got = compiled(*both)
    # the only collectives: those exchanging the row sums of dA_log and ddt_bias
    found = collectives(compiled.as_text())
    assert found and all(len(d) == 3 and d[1:] == [str(H // 4), "128"]
                         for _, shapes in found for d in (s.split(",") for s in shapes)), found
    heads_only = fn(*put(jax_kda.sharding.head_specs("heads")))
    assert_bits(jax.tree.leaves(got), jax.tree.leaves(heads_only))
    out, state, grads = got
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "heads")), 4)
    assert grads["q"].sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "heads")), 4)

    want_out, want_state, want = fn(args, d_out, d_state)
    assert_bits((out, state), (want_out, want_state))
    for name in ("q", "k", "v", "beta", "initial_state"):
        assert_bits(grads[name], want[name], name)
    assert_close_gate_gradients(grads, want)


def assert_close_gate_gradients(got, want):
    """dg within one bf16 unit in the last place of each element (the f32 values differ in their
    last bits, then round to bf16; one unit is up to 2**-7 of the value) plus 1e-6 of the
    largest; dA_log and ddt_bias (f32 sums over the tokens of those per-token values, with
    cancellation) within 1e-5 of their largest value (seen: up to 1.04e-6 on one CPU, 8 ulps; a
    misplaced row or head would be off by O(1))."""
    a, b = (np.asarray(x["g"], np.float64) for x in (got, want))
    bound = np.maximum(np.abs(a), np.abs(b)) * 2**-7 + 1e-6 * np.max(np.abs(b))
    assert np.all(np.abs(a - b) <= bound), np.max(np.abs(a - b) - bound)
    for name in ("A_log", "dt_bias"):
        assert relative_error(got[name], want[name]) < 1e-5, name


@on_virtual_devices
def test_sharded_helper_with_batch_axis(rng):
    """kda_prefill_sharded(batch_axis=...) on inputs given in any layout, differentiated: the
    same bits as plain jit on batch- and head-sharded inputs."""
    mesh = jax.make_mesh((2, 4), ("data", "tp"), axis_types=(AxisType.Auto,) * 2)
    args = make_inputs(rng, B, T, H)
    args["initial_state"] = random_states(rng, B, H, jnp.bfloat16, scale=1.0)
    d_out = jnp.asarray(rng.standard_normal((B, T, H, 128)), jnp.bfloat16)

    def grads_of(prefill):
        def loss(a):
            out, state = prefill(**a)
            return jnp.vdot(out.astype(jnp.float32), d_out) + jnp.sum(state.astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss))

    helper = partial(jax_kda.kda_prefill_sharded, mesh=mesh, head_axis="tp", batch_axis="data",
                     output_final_state=True)
    specs = jax_kda.sharding.head_specs("tp", "data")
    sharded = {name: jax.device_put(x, NamedSharding(mesh, specs[name]))
               for name, x in args.items()}
    plain = grads_of(partial(jax_kda.kda_prefill, output_final_state=True))(sharded)
    out, state = jax.jit(helper)(**args)  # replicated inputs: shard_map slices them
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, specs["out"]), 4)
    assert state.sharding.is_equivalent_to(NamedSharding(mesh, specs["final_state"]), 4)
    value, grads = grads_of(helper)(args)
    assert_bits(jax.tree.leaves(grads), jax.tree.leaves(plain[1]))
    assert relative_error(value, plain[0]) < 1e-6
    assert_bits((out, state), jax.jit(partial(jax_kda.kda_prefill, output_final_state=True))(
        **sharded))


@on_virtual_devices
def test_batch_split_errors_name_the_problem(rng):
    mesh = jax.make_mesh((2, 4), ("data", "tp"), axis_types=(AxisType.Auto,) * 2)
    args = make_inputs(rng, 1, 32, H)
    cu = jnp.asarray([0, 10, 32], jnp.int32)
    with pytest.raises(ValueError, match=r"split the batch, which only a batched call without "
                       r"cu_seqlens"):
        jax_kda.kda_prefill_sharded(**args, mesh=mesh, batch_axis="data", cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"divide the batch size B = 3"):
        jax_kda.kda_prefill_sharded(**make_inputs(rng, 3, 16, H), mesh=mesh, batch_axis="data")
    with pytest.raises(ValueError, match=r"batch_axis 'tp' must name axes of the mesh .* other "
                       r"than head_axis 'tp'"):
        jax_kda.kda_prefill_sharded(**make_inputs(rng, 2, 16, H), mesh=mesh, batch_axis="tp")


@on_virtual_devices
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_packed_documents_keep_the_batch_whole(axis_type, rng):
    """segment_ids (a packed call): batch-sharded inputs run with the batch whole on every device
    (only the heads split) and give the unsharded call's outputs and gradients."""
    mesh = jax.make_mesh((2, 4), ("data", "heads"), axis_types=(axis_type,) * 2)
    args = make_inputs(rng, B, T, H)
    ids = jnp.asarray(np.repeat(np.arange(B * 2).reshape(B, 2), T // 2, axis=1), jnp.int32)
    specs = jax_kda.sharding.head_specs("heads", "data")

    def value_and_grads(a, ids):
        def loss(a):
            out, _ = jax_kda.kda_prefill(**a, segment_ids=ids, max_segments=2 * B)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss)(a)

    sharded = {name: jax.device_put(x, NamedSharding(mesh, specs[name]))
               for name, x in args.items()}
    ids_sharded = jax.device_put(ids, NamedSharding(mesh, P("data", None)))
    got = jax.jit(value_and_grads)(sharded, ids_sharded)
    want = jax.jit(value_and_grads)(args, ids)
    assert relative_error(got[0], want[0]) < 1e-6
    for name in ("q", "k", "v", "beta"):
        assert_bits(got[1][name], want[1][name], name)
    assert_close_gate_gradients(got[1], want[1])


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_training_step_runs_the_kernels(kernel_gpus, rng):
    """The same step on one GPU, on a 1 x 1 ("data", "heads") mesh with the kernels
    (backend "kernel"): bitwise the step without a mesh, the kernels' custom calls in the
    compiled program, and close to the reference backend's step (the forwards round alike up to
    the reference's own rounding; the backward is the same)."""
    mesh = jax.sharding.Mesh(np.array(kernel_gpus[:1]).reshape(1, 1), ("data", "heads"))
    params, (x, target) = init_params(rng), make_batch(rng)
    step = jax.jit(partial(train_step, backend="kernel"))
    on_mesh = placed(mesh, params, x, target)
    hlo = step.lower(*on_mesh).compile().as_text()
    assert "jax_kda_recurrence_v1" in hlo and "jax_kda_prepare_v1" in hlo
    loss, _, updated = step(*on_mesh)
    assert_bits(jax.tree.leaves((loss, updated)), jax.tree.leaves(step(params, x, target)[::2]))
    ref_loss, _, ref_updated = jax.jit(partial(train_step, backend="reference"))(params, x, target)
    assert relative_error(loss, ref_loss) < 1e-2
    for got, want in zip(jax.tree.leaves(updated), jax.tree.leaves(ref_updated)):
        assert relative_error(got, want) < 1e-2
