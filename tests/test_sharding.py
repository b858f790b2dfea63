"""Head-sharded kda_prefill and kda_decode (tensor parallelism): the helpers and plain jit.

The CPU tests need several devices, and XLA's device count is fixed when jax initialises. So
`test_sharding_on_eight_virtual_cpu_devices` re-runs this file in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 and KDA_SHARDING_SUBPROCESS=1; only there do the
`on_virtual_devices` tests run (they skip in the parent run). Other test files are unaffected.
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
from jax_kda import _launch, api

IN_SUBPROCESS = os.environ.get("KDA_SHARDING_SUBPROCESS") == "1"
DEVICES = 8
on_virtual_devices = pytest.mark.skipif(
    not IN_SUBPROCESS, reason="runs inside test_sharding_on_eight_virtual_cpu_devices' subprocess"
)
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")

B, T, H = 2, 20, 16


@pytest.mark.slow
@pytest.mark.skipif(IN_SUBPROCESS, reason="this is the parent of the subprocess")
def test_sharding_on_eight_virtual_cpu_devices():
    run_on_virtual_cpu_devices(__file__, "KDA_SHARDING_SUBPROCESS",
                               "not test_sharding_on_eight_virtual_cpu_devices", 8,
                               devices=DEVICES, timeout=1200)


def make_args(b=B, t=T, h=H, seed=0, state_dtype=jnp.bfloat16, num_seqs=None):
    rng = np.random.default_rng(seed)
    args = make_inputs(rng, b, t, h)
    args["initial_state"] = random_states(rng, num_seqs or b, h, state_dtype, scale=1.0)
    return args


def run_compiled(fn, **kwargs):
    """fn's results on kwargs and the text of its compiled program, from one compilation."""
    compiled = fn.lower(**kwargs).compile()
    return compiled(**kwargs), compiled.as_text()


def head_mesh(axis_types=None):
    return jax.make_mesh((DEVICES,), ("tp",), axis_types=axis_types or (AxisType.Auto,))


def put_head_sharded(args, mesh):
    specs = jax_kda.sharding.head_specs("tp")
    return {name: jax.device_put(x, NamedSharding(mesh, specs[name])) for name, x in args.items()}


_unsharded = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, backend="reference"))


@on_virtual_devices
def test_virtual_devices_are_there():
    assert len(jax.devices()) == DEVICES


@on_virtual_devices
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_sharded_equals_unsharded_without_collectives(backend):
    mesh = head_mesh()
    args = make_args()
    fn = jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh, head_axis="tp",
                         output_final_state=True, backend=backend))
    (out, state), hlo = run_compiled(fn, **put_head_sharded(args, mesh))
    assert_bits((out, state), _unsharded(**args))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "tp")), out.ndim)
    assert state.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), state.ndim)
    assert state.dtype == jnp.bfloat16
    found = [c for c in COLLECTIVES if c in hlo]
    assert not found, found


@on_virtual_devices
def test_sharded_varlen_f32_state_from_replicated_inputs():
    mesh = head_mesh()
    args = make_args(b=1, t=37, seed=1, state_dtype=jnp.float32, num_seqs=3)
    cu = jnp.asarray([0, 16, 16, 37], jnp.int32)
    fn = jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh, output_final_state=True))
    out, state = fn(**args, cu_seqlens=cu)  # unsharded inputs: shard_map slices them locally
    assert_bits((out, state), _unsharded(**args, cu_seqlens=cu))
    assert state.dtype == jnp.float32


@on_virtual_devices
@pytest.mark.parametrize("varlen", [False, True])
def test_explicit_mesh_unsharded_inputs_without_initial_state(varlen):
    """jax.make_mesh's default (explicit axes) with plain replicated inputs and no initial state:
    the helper must move inputs to the head layout and the zero state must vary like them."""
    mesh = jax.make_mesh((DEVICES,), ("tp",))
    args = make_args(b=1 if varlen else 2, t=37, seed=3, num_seqs=3 if varlen else None)
    del args["initial_state"]
    extra = {"cu_seqlens": jnp.asarray([0, 5, 5, 37], jnp.int32)} if varlen else {}
    fn = jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh, output_final_state=True))
    got, hlo = run_compiled(fn, **args, **extra)
    assert_bits(got, _unsharded(**args, **extra))
    assert not [c for c in COLLECTIVES if c in hlo]


@on_virtual_devices
@pytest.mark.parametrize("head_sharded", [True, False])
def test_context_mesh_with_explicit_axes(head_sharded):
    """The context mesh takes the same inputs as mesh=: head-sharded or not."""
    mesh = head_mesh(axis_types=(AxisType.Explicit,))
    args = make_args(seed=2)
    with jax.set_mesh(mesh):
        given = put_head_sharded(args, mesh) if head_sharded else args
        fn = jax.jit(partial(jax_kda.kda_prefill_sharded, output_final_state=True))
        (out, state), hlo = run_compiled(fn, **given)
    assert_bits((out, state), _unsharded(**args))
    if head_sharded:
        assert not [c for c in COLLECTIVES if c in hlo]


@on_virtual_devices
def test_two_dimensional_mesh_heads_on_one_axis():
    mesh = jax.make_mesh((2, DEVICES // 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    args = make_args(seed=3)
    fn = jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh, head_axis="tp",
                         output_final_state=True))
    (out, state), hlo = run_compiled(fn, **put_head_sharded(args, mesh))
    assert_bits((out, state), _unsharded(**args))
    assert not [c for c in COLLECTIVES if c in hlo]


@on_virtual_devices
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_plain_jit_on_head_sharded_inputs_partitions_over_heads(backend):
    """No helper: each device runs its local heads; no collective of any kind in the program."""
    mesh = head_mesh()
    args = make_args(seed=4)
    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, backend=backend))
    (out, state), hlo = run_compiled(fn, **put_head_sharded(args, mesh))
    assert_bits((out, state), _unsharded(**args))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "tp")), out.ndim)
    assert not [c for c in COLLECTIVES if c in hlo]


@on_virtual_devices
@pytest.mark.parametrize("varlen", [False, True])
def test_plain_jit_explicit_mesh_without_initial_state(varlen):
    """jax.make_mesh's default (Explicit axes), head-sharded inputs, no initial state: the call
    runs under shard_map on the local heads (the zero state is made per device)."""
    mesh = jax.make_mesh((DEVICES,), ("tp",))
    args = make_args(b=1 if varlen else 2, t=37, seed=8, num_seqs=3 if varlen else None)
    del args["initial_state"]
    extra = {"cu_seqlens": jnp.asarray([0, 5, 5, 37], jnp.int32)} if varlen else {}
    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True))
    got, hlo = run_compiled(fn, **put_head_sharded(args, mesh), **extra)
    assert_bits(got, _unsharded(**args, **extra))
    assert not [c for c in COLLECTIVES if c in hlo]


class RecordingCore:
    """Stands in for the kernel path on CPU: the reference, recording the head counts it sees."""

    def __init__(self):
        self.heads = []

    def __call__(self, q, k, v, g, beta, A_log, dt_bias, state, cu, state_indices, ckpt_offsets,
                 *, problem):
        self.heads.append(q.shape[2])
        return jax_kda._reference_path.prefill(q, k, v, g, beta, A_log, dt_bias, state, cu,
                                               state_indices, problem=problem)


@on_virtual_devices
def test_plain_jit_kernel_path_runs_on_local_heads(monkeypatch):
    """The custom_partitioning rule hands each device H / devices heads (here the kernel path is
    the reference, so it can run on CPU)."""
    core = RecordingCore()
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    monkeypatch.setattr(jax_kda._kernel_path, "prefill", core)
    mesh = head_mesh()
    args = make_args(seed=6)
    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, backend="kernel"))
    got, hlo = run_compiled(fn, **put_head_sharded(args, mesh))
    assert_bits(got, _unsharded(**args))
    assert H // DEVICES in core.heads and H not in core.heads[-1:], core.heads
    assert not [c for c in COLLECTIVES if c in hlo]


@on_virtual_devices
def test_pools_checkpoints_and_decode_shard_over_heads():
    """A head-sharded state pool (prefill with checkpoints, then a decode step) under plain jit
    and under the helpers: bitwise the unsharded results, no collectives."""
    mesh = head_mesh()
    specs = jax_kda.sharding.head_specs("tp")
    args = make_args(b=1, t=40, seed=9)
    del args["initial_state"]
    pool = random_states(np.random.default_rng(10), 5, H, scale=1.0)
    cu = jnp.asarray([0, 24, 24, 40], jnp.int32)
    idx = jnp.asarray([3, -1, 0], jnp.int32)
    prefill = partial(jax_kda.kda_prefill, cu_seqlens=cu, state_indices=idx,
                      output_final_state=True, checkpoint_every=16)
    want = jax.jit(prefill)(**args, initial_state=pool)
    sharded = put_head_sharded(args, mesh)
    sharded_pool = jax.device_put(pool, NamedSharding(mesh, specs["initial_state"]))
    plain = jax.jit(prefill)
    helper = jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh, cu_seqlens=cu,
                             state_indices=idx, output_final_state=True, checkpoint_every=16))
    for fn in (plain, helper):
        got, hlo = run_compiled(fn, **sharded, initial_state=sharded_pool)
        assert_bits(got, want)
        assert not [c for c in COLLECTIVES if c in hlo]

    step = make_args(b=3, t=2, seed=11)
    del step["initial_state"]
    decode = partial(jax_kda.kda_decode, state_indices=idx)
    pool_after = want[1]
    want = jax.jit(decode)(**step, state=pool_after)
    step_sharded = put_head_sharded(step, mesh)
    sharded_pool = jax.device_put(pool_after, NamedSharding(mesh, specs["initial_state"]))
    assert_bits(jax.jit(decode)(**step_sharded, state=sharded_pool), want)
    helper = jax.jit(partial(jax_kda.kda_decode_sharded, mesh=mesh, state_indices=idx))
    assert_bits(helper(**step_sharded, state=sharded_pool), want)


@on_virtual_devices
@pytest.mark.parametrize("numerics", ["flashkda", "fp32"])
def test_plain_jit_kernel_decode_runs_on_local_heads(monkeypatch, numerics):
    """kda_decode's kernel path (each mode's fused decode; here the reference stands in for it,
    so it runs on CPU) gets H / devices heads and its rows of a head-sharded pool, with
    intermediate states: bitwise the unsharded step, no collectives."""
    heads = []

    def core(*arrays, problem):
        heads.append(arrays[0].shape[2])
        return jax_kda._reference_path.decode(*arrays, problem=problem)

    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    monkeypatch.setattr(jax_kda._kernel_path, "decode", core)
    mesh = head_mesh()
    specs = jax_kda.sharding.head_specs("tp")
    step = make_args(b=3, t=3, seed=12)
    del step["initial_state"]
    pool = random_states(np.random.default_rng(13), 5, H, jnp.float32, scale=1.0)
    idx = jnp.asarray([4, -1, 1], jnp.int32)
    decode = jax.jit(partial(jax_kda.kda_decode, state_indices=idx, numerics=numerics,
                             output_intermediate_states=True, backend="kernel"))
    want = decode(**step, state=pool)
    sharded_pool = jax.device_put(pool, NamedSharding(mesh, specs["initial_state"]))
    got, hlo = run_compiled(decode, **put_head_sharded(step, mesh), state=sharded_pool)
    assert_bits(got, want)
    assert H // DEVICES in heads, heads
    assert not [c for c in COLLECTIVES if c in hlo]


@on_virtual_devices
def test_errors_name_the_problem():
    mesh = head_mesh()
    not_divisible = rf"H = 6 must be a multiple of the size of mesh axis 'tp' \({DEVICES}\)"
    with pytest.raises(ValueError, match=not_divisible):
        jax_kda.kda_prefill_sharded(**make_args(h=6), mesh=mesh)
    with pytest.raises(ValueError, match=r"head_axis 'model' is not an axis of the mesh"):
        jax_kda.kda_prefill_sharded(**make_args(), mesh=mesh, head_axis="model")
    with pytest.raises(ValueError, match=r"no mesh"):
        jax_kda.kda_prefill_sharded(**make_args())


class RecordingHeads:
    """The kernel path's stand-in on CPU (the reference), recording (q's heads, v's heads)."""

    def __init__(self):
        self.heads = []

    def __call__(self, q, k, v, g, beta, A_log, dt_bias, state, cu, state_indices, ckpt_offsets,
                 *, problem):
        self.heads.append((q.shape[2], v.shape[2]))
        return jax_kda._reference_path.prefill(q, k, v, g, beta, A_log, dt_bias, state, cu,
                                               state_indices, problem=problem)


def grouped_args(seed, G=2):
    """make_args with q and k on H // G heads (grouped value heads)."""
    args = make_args(seed=seed)
    qk = make_inputs(np.random.default_rng(seed + 100), B, T, H // G)
    args["q"], args["k"] = qk["q"], qk["k"]
    return args


@on_virtual_devices
def test_grouped_heads_shard_in_whole_groups(monkeypatch):
    """q and k on Hk = 8 heads, the rest on H = 16: plain jit (custom_partitioning on Auto axes,
    shard_map on Explicit ones) and the helper put one query/key head and its two value heads on
    each device; bitwise the unsharded call, no collectives; the kernel path sees 1 and 2 heads,
    and its CUDA lowering hands the prepare call q at one head, g at two."""
    args = grouped_args(seed=12)
    want = _unsharded(**args)
    for mesh in (head_mesh(), jax.make_mesh((DEVICES,), ("tp",))):
        sharded = put_head_sharded(args, mesh)
        for fn in (jax.jit(partial(jax_kda.kda_prefill, output_final_state=True)),
                   jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh,
                                   output_final_state=True))):
            got, hlo = run_compiled(fn, **sharded)
            assert_bits(got, want)
            assert not [c for c in COLLECTIVES if c in hlo]
    core = RecordingHeads()
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    monkeypatch.setattr(jax_kda._kernel_path, "prefill", core)
    mesh = head_mesh()
    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, backend="kernel"))
    got, hlo = run_compiled(fn, **put_head_sharded(args, mesh))
    assert_bits(got, want)
    assert (1, 2) in core.heads and (H // 2, H) not in core.heads[-1:], core.heads
    monkeypatch.undo()
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    jax.clear_caches()
    helper = jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh, output_final_state=True,
                             backend="kernel"))
    text = helper.trace(**put_head_sharded(args, mesh)).lower(
        lowering_platforms=("cuda",)).as_text()
    qk, value = f"tensor<{B * T}x1x128xbf16>", f"tensor<{B * T}x2x128xbf16>"
    prepare = [line for line in text.splitlines() if "custom_call @jax_kda_prepare_v1(" in line]
    assert len(prepare) == 1 and f"({qk}, {qk}, {value}, " in prepare[0], prepare


@on_virtual_devices
def test_grouped_heads_decode_and_errors():
    mesh = head_mesh()
    specs = jax_kda.sharding.head_specs("tp")
    step = grouped_args(seed=13)
    del step["initial_state"]
    step = {name: x[:, :2] if name in DATA_NAMES else x for name, x in step.items()}
    pool = random_states(np.random.default_rng(14), 4, H, scale=1.0)
    idx = jnp.asarray([2, -1], jnp.int32)
    decode = partial(jax_kda.kda_decode, state_indices=idx, output_intermediate_states=True)
    want = jax.jit(decode)(**step, state=pool)
    sharded_pool = jax.device_put(pool, NamedSharding(mesh, specs["initial_state"]))
    step_sharded = put_head_sharded(step, mesh)
    assert_bits(jax.jit(decode)(**step_sharded, state=sharded_pool), want)
    helper = jax.jit(partial(jax_kda.kda_decode_sharded, mesh=mesh, state_indices=idx,
                             output_intermediate_states=True))
    assert_bits(helper(**step_sharded, state=sharded_pool), want)
    # Hk = 4 query/key heads cannot be split over 8 devices in whole groups
    args = grouped_args(seed=15, G=4)
    with pytest.raises(ValueError, match=r"Hk = 4 of q and k \(each device holds whole groups "
                       rf"of H // Hk = 4 value heads.*mesh axis 'tp' \({DEVICES}\)"):
        jax_kda.kda_prefill_sharded(**args, mesh=mesh)


DATA_NAMES = ("q", "k", "v", "g", "beta")


def recurrence_block_v(text):
    return [int(m) for m in re.findall(r"block_v = (\d+) : i32", text)]


@on_virtual_devices
@pytest.mark.parametrize("recurrence", ["auto", "baseline"])
def test_cuda_lowering_runs_kernels_on_local_heads(monkeypatch, recurrence):
    pytest.importorskip("jax_kda._ffi")
    monkeypatch.setattr(api, "_require_kernels", lambda: None)  # lowering needs no GPU
    mesh = head_mesh()
    args = make_args(seed=5)
    fn = jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh, output_final_state=True,
                         backend="kernel", recurrence=recurrence))
    text = fn.trace(**put_head_sharded(args, mesh)).lower(lowering_platforms=("cuda",)).as_text()
    local = H // DEVICES
    assert re.search(rf"custom_call @jax_kda_prepare_v1\(.*tensor<{B * T}x{local}x128xbf16>", text)
    assert re.search(rf"custom_call @jax_kda_recurrence_v1\(.*tensor<{B}x{local}x128x128xbf16>",
                     text)
    # The launch heuristic ran on the local head count (the baseline kernel has no column split).
    want = 0 if recurrence == "baseline" else _launch.choose_block_v(num_seqs=B, heads=local)
    assert recurrence_block_v(text) == [want]
    assert not [c for c in ("all_gather", "all_to_all", "collective_permute", "all_reduce")
                if c in text]


@on_virtual_devices
def test_sequence_parallel_shards_over_heads(monkeypatch):
    """The fp32 mode cut into pieces: head-sharded equals unsharded (reference, bit for bit),
    and the CUDA lowering runs one fp32 prepare and three fp32 recurrences on the local heads
    without collectives."""
    mesh = head_mesh()
    args = make_args(t=70, seed=6, state_dtype=jnp.float32)
    options = {"output_final_state": True, "numerics": "fp32", "sequence_parallel": 3}
    fn = jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh, head_axis="tp",
                         backend="reference", **options))
    want = jax.jit(partial(jax_kda.kda_prefill, backend="reference", **options))(**args)
    assert_bits(fn(**put_head_sharded(args, mesh)), want)
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    kernel = jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh, backend="kernel", **options))
    text = kernel.trace(**put_head_sharded(args, mesh)).lower(
        lowering_platforms=("cuda",)).as_text()
    local = H // DEVICES
    prepare = rf"custom_call @jax_kda_prepare_fp32_v1\(.*tensor<{B * 70}x{local}x128xbf16>"
    assert len(re.findall(prepare, text)) == 1
    assert text.count("custom_call @jax_kda_recurrence_fp32_v1(") == 3
    assert not [c for c in ("all_gather", "all_to_all", "collective_permute", "all_reduce")
                if c in text]


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_one_device_mesh_equals_unsharded_kernel_call(kernel_gpus):
    gpus = kernel_gpus
    mesh = jax.sharding.Mesh(np.array(gpus[:1]), ("tp",))
    args = make_args(t=300, h=12, seed=7)
    kernel = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, backend="kernel"))
    sharded = jax.jit(partial(jax_kda.kda_prefill_sharded, mesh=mesh, output_final_state=True,
                              backend="kernel"))
    assert_bits(sharded(**put_head_sharded(args, mesh)), kernel(**args))
    hlo = sharded.lower(**put_head_sharded(args, mesh)).compile().as_text()
    assert "jax_kda_recurrence_v1" in hlo
    assert not [c for c in COLLECTIVES if c in hlo]
