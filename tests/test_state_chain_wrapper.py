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
from state_chain_model import state_chains_model

from jax_kda import _ffi, _state_chain
from jax_kda._ffi import ChainOperands

IN_SUBPROCESS = os.environ.get("KDA_CHAIN_SUBPROCESS") == "1"
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def launch_model(gamma, forward, reverse):
    """The kernel's launch as the model: init [Ni, H, ...] rows indexed by reset directly."""
    rows = lambda ops: ops._replace(
        init=jnp.broadcast_to(ops.init[None], (ops.reset.shape[0],) + ops.init.shape))
    return state_chains_model(gamma, rows(forward), rows(reverse))


@pytest.fixture
def modelled_launch(monkeypatch):
    monkeypatch.setattr(_ffi, "state_chains_call", launch_model)


def chain_operands(rng, rows, N, Ni, H, C, reset_chunk):
    f = lambda *s: jnp.asarray(0.05 * rng.standard_normal(s), jnp.float32)
    reset = np.full((N, C), -1, np.int32)
    reset[:, reset_chunk] = np.arange(N) % Ni
    reset[0, 3] = Ni - 1
    return ChainOperands(jnp.asarray(reset), f(N, Ni, H, 128, 128), f(N, H, C, 16, 128),
                         f(N, H, C, rows, 128), f(N, H, C, rows, 128))


def operands(rng, N=2, Ni=3, H=4, C=5):
    """(gamma, forward, reverse): each chain starts from its own init rows (the forward chain at
    chunk 0, the reverse one at chunk C - 1) and restarts at chunk 3."""
    gamma = jnp.asarray(rng.uniform(0.5, 1, (N, H, C, 128)), jnp.float32)
    return (gamma, chain_operands(rng, 16, N, Ni, H, C, 0),
            chain_operands(rng, 32, N, Ni, H, C, C - 1))


def flat(args):
    gamma, forward, reverse = args
    return (gamma,) + tuple(forward) + tuple(reverse)


def unflat(xs):
    return xs[0], ChainOperands(*xs[1:6]), ChainOperands(*xs[6:])


def test_rows_read_their_own_initial_states(modelled_launch):
    args = operands(np.random.default_rng(0))
    got = jax.tree.map(np.asarray, jax.jit(_state_chain.state_chains)(*args))
    want = jax.tree.map(np.asarray, state_chains_model(*args))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    (states_f, _), (states_r, _) = got
    forward, reverse = args[1:]
    for states, ops, start in ((states_f, forward, 0), (states_r, reverse, 4)):
        reset, init = np.asarray(ops.reset), np.asarray(ops.init)
        np.testing.assert_array_equal(states[1, :, start], init[1, reset[1, start]])
        np.testing.assert_array_equal(states[0, :, 3], init[0, 2])


def test_vmap_folds_into_one_launch(modelled_launch, monkeypatch):
    rng = np.random.default_rng(1)
    parts = [flat(operands(rng)) for _ in range(3)]
    stacked = [jnp.stack(xs) for xs in zip(*parts)]
    vmapped = jax.vmap(lambda *xs: _state_chain.state_chains(*unflat(xs)))
    got = jax.jit(vmapped)(*stacked)
    monkeypatch.undo()  # lowered with the real launch: one custom call, the 3 x 2 rows folded
    jax.clear_caches()
    launches = re.findall(r"custom_call @jax_kda_state_chains_v1\(.*",
                          jax.jit(vmapped).lower(*stacked).as_text())
    assert len(launches) == 1 and "tensor<6x4x5x128x128xf32>" in launches[0], launches
    for i, xs in enumerate(parts):
        want = state_chains_model(*unflat(xs))
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b)),
                     got, want)


@pytest.mark.skipif(IN_SUBPROCESS, reason="this is the parent of the subprocess")
def test_partitioning_on_eight_virtual_cpu_devices():
    run_on_virtual_cpu_devices(__file__, "KDA_CHAIN_SUBPROCESS", "rows_and_heads_stay_sharded", 1,
                               timeout=600)


@pytest.mark.skipif(not IN_SUBPROCESS, reason="runs in the subprocess of the test above")
def test_rows_and_heads_stay_sharded(modelled_launch):
    mesh = jax.make_mesh((2, 4), ("data", "heads"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    args = flat(operands(np.random.default_rng(2), N=4, H=8))
    chain = (P("data"), P("data", None, "heads"), *[P("data", "heads")] * 3)
    specs = (P("data", "heads"),) + chain * 2
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    run = jax.jit(lambda *xs: _state_chain.state_chains(*unflat(xs)))
    text = run.lower(*placed).compile().as_text()
    for name in COLLECTIVES:
        assert name not in text, name
    got = run(*placed)
    for x in jax.tree.leaves(got):
        assert x.sharding.spec[:2] == ("data", "heads")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                                                         atol=1e-6),
                 got, state_chains_model(*unflat(args)))
