"""The FFI handlers on a real GPU: validation errors reach Python, runs are deterministic, the
final state can be donated, each device gets its own modules, and CUDA-graph capture of the
custom calls (XLA command buffers) gives the same bits. Numerics are other tests' business."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import assert_bits, make_inputs, random_states

from jax_kda import _ffi, contract

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("kernel_gpus"),
]

T, H, N = 70, 3, 2  # T not a multiple of 16, two sequences


def _inputs(seed=0, total=T, heads=H, cu=(0, 30, T)):
    """The FFI calls' operands: packed tokens [total, heads, ...], cu_seqlens, bf16 states."""
    rng = np.random.default_rng(seed)
    a = make_inputs(rng, 1, total, heads)
    state0 = random_states(rng, len(cu) - 1, heads, jnp.bfloat16)
    return (*(a[name][0] for name in ("q", "k", "v", "g", "beta")), a["A_log"], a["dt_bias"],
            jnp.asarray(cu, jnp.int32), state0)


SPLIT_32 = 32  # a launch: value columns per CTA of the column split


def _run(q, k, v, g, beta, a_log, dt_bias, cu, state0, *, launch=SPLIT_32, inverse="stable"):
    ws = _ffi.prepare_call(q, k, g, beta, a_log, dt_bias, cu, scale=128**-0.5, lower_bound=-5.0,
                           inverse=inverse)
    return _ffi.recurrence_call(v, beta, ws, cu, state0, launch=launch)


def test_kernels_run_and_are_deterministic():
    args = _inputs()
    f = jax.jit(_run, static_argnames=("launch", "inverse"))
    out1, st1 = f(*args)
    out2, st2 = f(*args)
    assert bool(jnp.isfinite(out1.astype(jnp.float32)).all())
    assert bool(jnp.isfinite(st1.astype(jnp.float32)).all())
    assert_bits((out1, st1), (out2, st2))


LAUNCHES = [*contract.COLUMN_SPLITS, "baseline"]


@pytest.mark.parametrize("launch", LAUNCHES, ids=str)
@pytest.mark.parametrize("inverse", ["stable", "neumann"])
def test_every_specialisation_launches(launch, inverse):
    out, state = jax.jit(_run, static_argnames=("launch", "inverse"))(
        *_inputs(), launch=launch, inverse=inverse)
    assert out.shape == (T, H, 128) and state.shape == (N, H, 128, 128)
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())


def test_donated_state_gives_the_same_result():
    args = _inputs()
    expected = jax.jit(_run)(*args)
    donated = jax.jit(_run, donate_argnums=(8,))(*args[:8], jnp.array(args[8]))
    assert_bits(donated, expected)


def _recurrence_ffi_call(v, state0):
    """The recurrence custom call without the Python wrapper's checks."""
    return jax.ffi.ffi_call(contract.RECURRENCE_TARGET,
                            (jax.ShapeDtypeStruct(v.shape, v.dtype),
                             jax.ShapeDtypeStruct(state0.shape, state0.dtype)))


def test_handler_shape_errors_reach_python():
    """Bypass the Python wrapper's checks: the C++ handler must refuse a wrong workspace."""
    _, _, v, _, beta, _, _, cu, state0 = _inputs()
    bad_ws = jnp.zeros((H, 3, contract.RECORD_BYTES), jnp.uint8)  # needs ceil(70/16) + 2 = 7 slots
    call = _recurrence_ffi_call(v, state0)
    with pytest.raises(Exception, match=r"jax_kda: recurrence: operand workspace has shape "
                                        r"\[3, 3, 13824\], expected \[3, 7, 13824\]"):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, block_v=np.int32(32)))(
            v, beta, bad_ws, cu, state0))


def test_handler_attribute_errors_reach_python():
    _, _, v, _, beta, _, _, cu, state0 = _inputs()
    ws = jnp.zeros((H, 7, contract.RECORD_BYTES), jnp.uint8)
    call = _recurrence_ffi_call(v, state0)
    with pytest.raises(Exception, match=r"block_v must be 0 \(baseline kernel\) or one of "
                                        r"16, 32, 64, 128 \(column split\), got 48"):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, block_v=np.int32(48)))(
            v, beta, ws, cu, state0))


@pytest.mark.skipif(len(_ffi.kernel_gpus()) < 2, reason="needs two GPUs")
def test_second_device_gets_its_own_modules():
    args = _inputs()
    on0 = jax.jit(_run)(*jax.device_put(args, _ffi.kernel_gpus()[0]))
    on1 = jax.jit(_run)(*jax.device_put(args, _ffi.kernel_gpus()[1]))
    assert_bits(on1, on0)


_GRAPH_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, jax, jax.numpy as jnp
    sys.path.insert(0, sys.argv[1])
    from test_ffi_gpu import _inputs, _run
    f = jax.jit(_run)
    outs = [f(*_inputs()) for _ in range(3)]  # several runs: record, then replay the graph
    np.savez(sys.argv[2], *[np.asarray(x.view(jnp.uint16)) for o in outs for x in o])
""")


def test_cuda_graph_capture_gives_identical_bits(tmp_path):
    """Same computation in fresh processes with and without command buffers on custom calls."""
    results = {}
    graph_flags = "--xla_gpu_enable_command_buffer=CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    for name, flags in (("plain", "--xla_gpu_enable_command_buffer="), ("graph", graph_flags)):
        env = dict(os.environ, XLA_FLAGS=flags)
        out = tmp_path / f"{name}.npz"
        command = [sys.executable, "-c", _GRAPH_SCRIPT, os.path.dirname(__file__), str(out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        results[name] = np.load(out)
    for key in results["plain"].files:
        np.testing.assert_array_equal(results["plain"][key], results["graph"][key])
