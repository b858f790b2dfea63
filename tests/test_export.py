"""jax.export of a function calling kda_prefill: custom calls allowed via the package's list."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jax_export
from kda_testing import make_inputs, random_states

import jax_kda
from jax_kda import _ffi

B, T, H = 2, 19, 2


def make_args(seed=0, t=T, h=H):
    """model's positional arrays: kda_prefill's, then an f32 initial state."""
    rng = np.random.default_rng(seed)
    return (*make_inputs(rng, B, t, h).values(), random_states(rng, B, h, scale=1.0))


def model(q, k, v, g, beta, A_log, dt_bias, state, backend="auto", **options):
    out, final_state = jax_kda.kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state=state,
                                          output_final_state=True, backend=backend, **options)
    return out.astype(jnp.float32) * 2.0, final_state  # some surrounding model code


@pytest.fixture
def cuda_path_lowerable(monkeypatch):
    """backend="auto" emits the CUDA branch only when the FFI library is present; lowering the
    branch needs no library, so on a machine without a build pretend it is there."""
    if not _ffi.kernels_available():
        monkeypatch.setattr(_ffi, "kernels_available", lambda: True)


def kda_targets(text):
    return sorted(set(re.findall(r"custom_call @(jax_kda_\w+)\(", text)))


def test_targets_match_the_ffi_layer():
    assert set(jax_kda.export.CUSTOM_CALL_TARGETS) == set(_ffi._HANDLER_SYMBOLS)
    checks = jax_kda.disabled_safety_checks()
    assert checks == [jax_export.DisabledSafetyCheck.custom_call(t)
                      for t in jax_kda.export.CUSTOM_CALL_TARGETS]


def test_export_without_the_list_is_refused(cuda_path_lowerable):
    args = make_args()
    with pytest.raises(ValueError, match="jax_kda_prepare_v1|custom call"):
        jax_export.export(jax.jit(model), platforms=("cuda",))(*args)


def test_cuda_cpu_export_roundtrip_runs_the_cpu_part(cuda_path_lowerable):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    args = make_args(seed=1)
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    exported = jax_kda.export.export(jax.jit(model), platforms=("cuda", "cpu"))(*avals)
    assert exported.platforms == ("cuda", "cpu")
    assert kda_targets(exported.mlir_module()) == ["jax_kda_prepare_v1", "jax_kda_recurrence_v1"]

    restored = jax_export.deserialize(exported.serialize())
    assert restored.platforms == ("cuda", "cpu")
    got = restored.call(*args)
    want = jax.jit(partial(model, backend="reference"))(*args)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_training_step_export_roundtrip(cuda_path_lowerable):
    """A training step (value_and_grad of a loss of model) exports for CUDA and CPU: the CUDA path
    holds the forward's calls and the backward's chain kernel (both chains), and the restored
    export's CPU path gives the jitted step's values and gradients, bitwise."""
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    args = make_args(seed=5)

    def loss(*args):
        out, state = model(*args)
        return jnp.sum(out * out) + jnp.sum(state.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    exported = jax_kda.export.export(step, platforms=("cuda", "cpu"))(*avals)
    text = exported.mlir_module()
    assert kda_targets(text) == ["jax_kda_prepare_v1", "jax_kda_recurrence_v1",
                                 "jax_kda_state_chains_v1"]
    got = jax_export.deserialize(exported.serialize()).call(*args)
    want = step(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_plain_jax_export_accepts_the_public_list(cuda_path_lowerable):
    args = make_args(seed=2)
    exported = jax_export.export(jax.jit(model), platforms=("cuda",),
                                 disabled_checks=jax_kda.disabled_safety_checks())(*args)
    assert kda_targets(exported.mlir_module()) == ["jax_kda_prepare_v1", "jax_kda_recurrence_v1"]


def test_export_of_the_baseline_kernel_uses_the_same_target(cuda_path_lowerable):
    """recurrence="baseline" is an attribute value (block_v = 0) of the same versioned target, so
    the export helpers need nothing new."""
    args = make_args(seed=4)
    exported = jax_kda.export.export(jax.jit(partial(model, recurrence="baseline")),
                                     platforms=("cuda",))(*args)
    text = exported.mlir_module()
    assert kda_targets(text) == ["jax_kda_prepare_v1", "jax_kda_recurrence_v1"]
    assert re.findall(r"block_v = (\d+) : i32", text) == ["0"]


def test_sequence_parallel_export_roundtrip(cuda_path_lowerable):
    """The fp32 mode cut into pieces exports like the serial call: its CUDA part holds one fp32
    prepare and three fp32 recurrences, its CPU part runs the reference's same segmentation."""
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    args = make_args(seed=5, t=70)
    cut = partial(model, numerics="fp32", sequence_parallel=3)
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    exported = jax_kda.export.export(jax.jit(cut), platforms=("cuda", "cpu"))(*avals)
    text = exported.mlir_module()
    assert kda_targets(text) == ["jax_kda_prepare_fp32_v1", "jax_kda_recurrence_fp32_v1"]
    assert text.count("custom_call @jax_kda_recurrence_fp32_v1(") == 3
    got = jax_export.deserialize(exported.serialize()).call(*args)
    want = jax.jit(partial(cut, backend="reference"))(*args)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_cpu_only_export_needs_no_disabled_checks():
    """Exported for CPU alone, backend="auto" holds only the reference: nothing to allow."""
    args = make_args(seed=3)
    exported = jax_export.export(jax.jit(model), platforms=("cpu",))(*args)
    assert kda_targets(exported.mlir_module()) == []


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_runs_a_deserialized_export(kernel_gpus):
    gpus = kernel_gpus
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    args = jax.device_put(make_args(seed=4, t=300, h=6), gpus[0])
    exported = jax_kda.export.export(jax.jit(model), platforms=("cuda", "cpu"))(*args)
    restored = jax_export.deserialize(exported.serialize())
    got = jax.jit(restored.call)(*args)
    want = jax.jit(partial(model, backend="kernel"))(*args)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
