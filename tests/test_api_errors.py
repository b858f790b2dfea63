"""Every trace-time error path of kda_prefill: bad input must fail with a message naming the
argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import make_inputs

import jax_kda

B, T, H = 2, 20, 3


def make_args(b=B, t=T, h=H, seed=0):
    return make_inputs(np.random.default_rng(seed), b, t, h)


def call(args, **kw):
    kw.setdefault("backend", "reference")
    return jax_kda.kda_prefill(**args, **kw)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_wrong_input_dtype(name):
    args = make_args()
    args[name] = args[name].astype(jnp.float32)
    with pytest.raises(TypeError, match=rf"{name} must have dtype bfloat16, got float32"):
        call(args)


@pytest.mark.parametrize("name", ["A_log", "dt_bias"])
def test_wrong_param_dtype(name):
    args = make_args()
    args[name] = args[name].astype(jnp.bfloat16)
    with pytest.raises(TypeError, match=rf"{name} must have dtype float32, got bfloat16"):
        call(args)


def test_head_dim_not_128():
    args = make_args()
    for name in ("q", "k", "v", "g"):
        args[name] = args[name][..., :64]
    with pytest.raises(ValueError, match="head dim must be 128.*got 64"):
        call(args)


def test_q_wrong_rank():
    args = make_args()
    args["q"] = args["q"][0]
    with pytest.raises(ValueError, match=r"q must have rank 4"):
        call(args)


@pytest.mark.parametrize("name", ["k", "v", "g"])
def test_mismatched_tokens(name):
    args = make_args()
    args[name] = args[name][:, :-1]
    with pytest.raises(ValueError,
                       match=rf"{name} must have shape .*\(2, 20, 3, 128\), got \(2, 19, 3, 128\)"):
        call(args)


def test_mismatched_heads_in_beta():
    args = make_args()
    args["beta"] = args["beta"][..., :2]
    with pytest.raises(ValueError,
                       match=r"beta must have shape \[B, T, H\] = \(2, 20, 3\), got \(2, 20, 2\)"):
        call(args)


@pytest.mark.parametrize(
    "name,shape", [("A_log", (4,)), ("dt_bias", (3, 64)), ("dt_bias", (128,))]
)
def test_wrong_param_shape(name, shape):
    args = make_args()
    args[name] = jnp.zeros(shape, jnp.float32)
    with pytest.raises(ValueError, match=rf"{name} must have shape"):
        call(args)


def test_not_an_array():
    args = make_args()
    args["q"] = [[1.0]]
    with pytest.raises(TypeError, match="q must be an array, got list"):
        call(args)


@pytest.mark.parametrize("shape",
                         [(2, 4, 128, 128), (2, 3, 128), (1, 3, 128, 128), (2, 3, 64, 128)])
def test_initial_state_wrong_shape(shape):
    args = make_args()
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, H, 128, 128\]"):
        call(args, initial_state=jnp.zeros(shape, jnp.bfloat16))


def test_initial_state_wrong_dtype():
    args = make_args()
    with pytest.raises(TypeError,
                       match="initial_state must have dtype bfloat16 or float32, got float16"):
        call(args, initial_state=jnp.zeros((B, H, 128, 128), jnp.float16))


def test_state_count_must_match_cu_seqlens():
    args = make_args(b=1)
    cu = jnp.array([0, 5, 20], jnp.int32)  # N = 2
    with pytest.raises(ValueError, match=r"initial_state must have shape .*\(2, 3, 128, 128\), "
                                         r"got \(3, 3, 128, 128\)"):
        call(args, cu_seqlens=cu, initial_state=jnp.zeros((3, H, 128, 128), jnp.float32))


def test_cu_seqlens_needs_batch_one():
    args = make_args(b=2)
    with pytest.raises(ValueError, match="batch size B must be 1.*got B = 2"):
        call(args, cu_seqlens=jnp.array([0, 20], jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.uint32, jnp.int16])
def test_cu_seqlens_dtype(dtype):
    args = make_args(b=1)
    with pytest.raises(TypeError, match="cu_seqlens must have dtype int32 or int64"):
        call(args, cu_seqlens=jnp.array([0, 20]).astype(dtype))


@pytest.mark.parametrize("value", [np.array([[0, 20]], np.int32), np.array([0], np.int32)])
def test_cu_seqlens_rank_and_length(value):
    args = make_args(b=1)
    with pytest.raises(ValueError, match=r"cu_seqlens must have rank 1 and shape \[N\+1\]"):
        call(args, cu_seqlens=jnp.asarray(value))


@pytest.mark.parametrize("values", [[1, 20], [0, 19], [0, 12, 5, 20], [0, 21]])
def test_concrete_cu_seqlens_values_checked(values):
    args = make_args(b=1)
    with pytest.raises(ValueError,
                       match="cu_seqlens must be non-decreasing, start at 0 and end at T = 20"):
        call(args, cu_seqlens=jnp.array(values, jnp.int32))


@pytest.mark.parametrize("lb", [0.0, 0.5, -5.01, -100.0])
def test_lower_bound_range(lb):
    with pytest.raises(ValueError, match=r"lower_bound must lie in \[-5, 0\)"):
        call(make_args(), lower_bound=lb)


def test_lower_bound_edges_accepted():
    out, _ = call(make_args(t=3), lower_bound=-5.0)
    assert out.shape == (B, 3, H, 128)


def test_traced_scale_rejected():
    args = make_args()
    with pytest.raises(TypeError, match="scale must be a static Python number"):
        jax.jit(lambda s: call(args, scale=s))(1.0)


def test_nonfinite_scale_rejected():
    with pytest.raises(ValueError, match="scale must be finite"):
        call(make_args(), scale=float("nan"))


@pytest.mark.parametrize("scale", [0.0, -0.1])
def test_non_positive_scale_rejected(scale):
    """A zero or negative scale would silently zero or flip every output."""
    with pytest.raises(ValueError, match=f"kda_prefill: scale must be positive, got {scale}"):
        call(make_args(), scale=scale)


def test_unknown_inverse():
    with pytest.raises(ValueError, match="inverse must be one of .*'exact'"):
        call(make_args(), inverse="exact")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of .*'cuda'"):
        call(make_args(), backend="cuda")


@pytest.mark.parametrize("recurrence", [8, 48, 256, "32", 16.0, True, "column_split", "Baseline",
                                        None])
def test_bad_recurrence(recurrence):
    with pytest.raises(ValueError, match=r"recurrence must be one of \('auto', 'baseline', 16, "
                                         r"32, 64, 128\)"):
        call(make_args(), recurrence=recurrence)


@pytest.mark.parametrize("removed", ["column_split", "overlap"])
def test_removed_launch_keywords_are_unknown(removed):
    with pytest.raises(TypeError, match=removed):
        call(make_args(), **{removed: 16})


def test_reference_backend_ignores_the_recurrence_launch():
    args = make_args(t=21)
    want = call(args, output_final_state=True)
    for recurrence in ("baseline", 16, 128):
        got = call(args, output_final_state=True, recurrence=recurrence)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_output_final_state_must_be_bool():
    with pytest.raises(TypeError, match="output_final_state must be a bool"):
        call(make_args(), output_final_state="yes")


def test_kernel_backend_without_gpu_is_clear():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present")
    with pytest.raises(jax_kda.KernelsUnavailableError, match="backend='kernel'"):
        call(make_args(), backend="kernel")


def test_final_state_dtype_follows_initial_state():
    args = make_args(t=5)
    for dtype in (jnp.float32, jnp.bfloat16):
        _, st = call(args, initial_state=jnp.ones((B, H, 128, 128), dtype), output_final_state=True)
        assert st.dtype == dtype and st.shape == (B, H, 128, 128)
    _, st = call(args, output_final_state=True)
    assert st.dtype == jnp.bfloat16
    _, st = call(args)
    assert st is None
