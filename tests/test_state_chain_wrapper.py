"""jax_kda._state_chain's wrapper of the chain kernel, on CPU with the kernel's launch replaced
by its plain-JAX model (tests/state_chain_model.py): init rows and reset indices as the kernel
takes them, vmap folded into one launch, and the partitioning rule (rows and heads stay sharded,
nothing is gathered) on eight virtual devices in a subprocess, as tests/test_sharding.py runs."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from kda_testing import run_on_virtual_cpu_devices
from state_chain_model import state_chain_model

from jax_kda import _ffi, _state_chain

IN_SUBPROCESS = os.environ.get("KDA_CHAIN_SUBPROCESS") == "1"
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def launch_model(reset, init, gamma, A, B, Y):
    """The kernel's launch as the model: init [Ni, H, ...] rows indexed by reset directly."""
    rows = jnp.broadcast_to(init[None], (reset.shape[0],) + init.shape)
    return state_chain_model(reset, rows, gamma, A, B, Y)


@pytest.fixture
def modelled_launch(monkeypatch):
    monkeypatch.setattr(_ffi, "state_chain_call", launch_model)


def operands(rng, N=2, Ni=3, H=4, C=5, rows=32):
    f = lambda *s: jnp.asarray(0.05 * rng.standard_normal(s), jnp.float32)
    reset = np.full((N, C), -1, np.int32)
    reset[:, 0] = np.arange(N) % Ni
    reset[0, 3] = Ni - 1
    return (jnp.asarray(reset), f(N, Ni, H, 128, 128),
            jnp.asarray(rng.uniform(0.5, 1, (N, H, C, 128)), jnp.float32),
            f(N, H, C, 16, 128), f(N, H, C, rows, 128), f(N, H, C, rows, 128))


def test_rows_read_their_own_initial_states(modelled_launch):
    args = operands(np.random.default_rng(0))
    got = np.asarray(jax.jit(_state_chain.state_chain)(*args))
    want = np.asarray(state_chain_model(*args))
    np.testing.assert_array_equal(got, want)
    reset, init = np.asarray(args[0]), np.asarray(args[1])
    np.testing.assert_array_equal(got[1, :, 0], init[1, reset[1, 0]])
    np.testing.assert_array_equal(got[0, :, 3], init[0, 2])


def test_vmap_folds_into_one_launch(modelled_launch, monkeypatch):
    rng = np.random.default_rng(1)
    parts = [operands(rng) for _ in range(3)]
    stacked = [jnp.stack(xs) for xs in zip(*parts)]
    vmapped = jax.vmap(_state_chain.state_chain)
    got = jax.jit(vmapped)(*stacked)
    monkeypatch.undo()  # lowered with the real launch: one custom call, the 3 x 2 rows folded
    jax.clear_caches()
    launches = re.findall(r"custom_call @jax_kda_state_chain_v2\(.*",
                          jax.jit(jax.vmap(_state_chain.state_chain)).lower(*stacked).as_text())
    assert len(launches) == 1 and "-> tensor<6x4x5x128x128xf32>" in launches[0], launches
    for i, xs in enumerate(parts):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(state_chain_model(*xs)))


@pytest.mark.skipif(IN_SUBPROCESS, reason="this is the parent of the subprocess")
def test_partitioning_on_eight_virtual_cpu_devices():
    run_on_virtual_cpu_devices(__file__, "KDA_CHAIN_SUBPROCESS", "rows_and_heads_stay_sharded", 1,
                               timeout=600)


@pytest.mark.skipif(not IN_SUBPROCESS, reason="runs in the subprocess of the test above")
def test_rows_and_heads_stay_sharded(modelled_launch):
    mesh = jax.make_mesh((2, 4), ("data", "heads"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    args = operands(np.random.default_rng(2), N=4, H=8)
    specs = (P("data"), P("data", None, "heads"), *[P("data", "heads")] * 4)
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    run = jax.jit(_state_chain.state_chain)
    text = run.lower(*placed).compile().as_text()
    for name in COLLECTIVES:
        assert name not in text, name
    got = run(*placed)
    assert got.sharding.spec[:2] == ("data", "heads")
    np.testing.assert_allclose(np.asarray(got), np.asarray(state_chain_model(*args)),
                               rtol=1e-6, atol=1e-6)
