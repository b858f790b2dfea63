"""Bad or unusual input as a demanding user gives it: every public function names the argument,
the sharded helpers check what kda_prefill / kda_decode check, and an eager call compiles once."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import make_inputs

import jax_kda

B, T, H = 1, 37, 3  # a shape no other test uses: the compile counted below is this file's own
ARRAYS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def make_args(b=B, t=T, h=H, seed=0):
    return make_inputs(np.random.default_rng(seed), b, t, h)


def decode_args(n=2, t=1, h=H):
    args = make_args(n, t, h)
    return args, jnp.zeros((n, h, 128, 128), jnp.float32)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("bad", [None, [1.0, 2.0]])
@pytest.mark.parametrize("name", ARRAYS + ("initial_state",))
def test_a_non_array_in_any_slot_is_named(name, bad, backend):
    args = make_args()
    if name == "initial_state":
        kw = {"initial_state": bad}
        if bad is None:
            pytest.skip("initial_state=None is the zero state")
    else:
        args[name] = bad
        kw = {}
    with pytest.raises(TypeError, match=rf"kda_prefill: {name} must be an array, got "):
        jax_kda.kda_prefill(**args, backend=backend, **kw)


@pytest.mark.parametrize("bad", [None, [1.0]])
@pytest.mark.parametrize("name", ARRAYS + ("state",))
def test_decode_names_a_non_array(name, bad):
    args, state = decode_args()
    if name == "state":
        state = bad
    else:
        args[name] = bad
    expected = TypeError if bad is not None or name != "state" else ValueError
    with pytest.raises(expected, match=rf"kda_decode: {name} (must be an array|is required)"):
        jax_kda.kda_decode(**args, state=state)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("shape", [(0, T, H), (B, 0, H), (B, T, 0)])
def test_empty_axes_are_named(shape, backend):
    args = make_args(*shape)
    with pytest.raises(ValueError, match=r"q's B, T and Hk .* must be >= 1"):
        jax_kda.kda_prefill(**args, backend=backend)


def test_checkpoint_offsets_names_a_bad_interval():
    cu = np.array([0, 20, 40], np.int32)
    for bad in ("16", 16.0, True, 0, 24, None):
        with pytest.raises(ValueError, match=r"checkpoint_every must be a positive multiple"):
            jax_kda.checkpoint_offsets(cu, bad)
    np.testing.assert_array_equal(jax_kda.checkpoint_offsets(cu, 16), [0, 1, 2])


def test_eager_calls_compile_once(monkeypatch):
    """An eager (un-jitted) call with the default backend compiles once per configuration: the
    second call with new values of the same shapes does not trace again."""
    from jax_kda import api

    traces = []
    dispatch = api.dispatch
    monkeypatch.setattr(api, "dispatch", lambda *a, problem: (traces.append(problem),
                                                              dispatch(*a, problem=problem))[1])
    first = make_args(seed=1)
    jax_kda.kda_prefill(**first)
    start = time.perf_counter()
    out, _ = jax_kda.kda_prefill(**make_args(seed=2))
    out.block_until_ready()
    assert len(traces) == 1, traces
    assert time.perf_counter() - start < 1.0
    # and it is the same function as under jit
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(
        jax.jit(lambda a: jax_kda.kda_prefill(**a)[0])(make_args(seed=2)), np.float32))


# ----------------------------------------------------------------- the sharded helpers check alike


def one_device_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))


def test_sharded_prefill_reports_the_global_shape():
    args = make_args()
    args["q"] = args["q"][0]
    with pytest.raises(ValueError, match=rf"kda_prefill_sharded: q must have rank 4 .*\({T}, {H}, "
                                         r"128\)"):
        jax_kda.kda_prefill_sharded(**args, mesh=one_device_mesh())


@pytest.mark.parametrize("cu", [[0, 20, 10, 37], [0, 20, 40], [1, 20, 37]])
def test_sharded_prefill_checks_cu_seqlens_values(cu):
    with pytest.raises(ValueError, match=r"kda_prefill_sharded: cu_seqlens must be non-decreasing"):
        jax_kda.kda_prefill_sharded(**make_args(), cu_seqlens=jnp.asarray(cu, jnp.int32),
                                    mesh=one_device_mesh())


@pytest.mark.parametrize("indices, match", [([9, 0], r"must be < P = 4"),
                                            ([1, 1], r"must not repeat a pool row")])
def test_sharded_helpers_check_state_indices(indices, match):
    pool = jnp.zeros((4, H, 128, 128), jnp.float32)
    idx = jnp.asarray(indices, jnp.int32)
    with pytest.raises(ValueError, match="kda_prefill_sharded: state_indices " + match):
        jax_kda.kda_prefill_sharded(**make_args(b=2), initial_state=pool, state_indices=idx,
                                    mesh=one_device_mesh())
    args, _ = decode_args()
    with pytest.raises(ValueError, match="kda_decode_sharded: state_indices " + match):
        jax_kda.kda_decode_sharded(**args, state=pool, state_indices=idx, mesh=one_device_mesh())


def test_sharded_prefill_checks_its_flags_and_options():
    mesh = one_device_mesh()
    with pytest.raises(TypeError, match="kda_prefill_sharded: output_final_state must be a bool"):
        jax_kda.kda_prefill_sharded(**make_args(), output_final_state="yes", mesh=mesh)
    with pytest.raises(ValueError, match="kda_prefill_sharded: numerics must be one of"):
        jax_kda.kda_prefill_sharded(**make_args(), numerics="bf16", mesh=mesh)
    with pytest.raises(ValueError, match="kda_prefill_sharded: recurrence='baseline' runs "):
        jax_kda.kda_prefill_sharded(**make_args(), numerics="fp32", recurrence="baseline",
                                    mesh=mesh)


def test_sharded_prefill_equals_kda_prefill_on_one_device():
    args = make_args(seed=3)
    want = jax_kda.kda_prefill(**args, output_final_state=True, backend="reference")
    got = jax_kda.kda_prefill_sharded(**args, output_final_state=True, backend="reference",
                                      mesh=one_device_mesh())
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
