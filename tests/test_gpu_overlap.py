"""The overlapped prefill on a GPU (one custom call: prepare on a few CTAs per SM, the column-split
recurrence launched behind it and reading each record once prepare's ready counters say it is
written): bitwise the two separate calls, for every column split, with the kernels side by side
and one after the other, run to run, on memory that held garbage before."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_ffi_gpu

import jax_kda
from jax_kda import _ffi, contract
from jax_kda._launch import RecurrenceLaunch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_gpus")]

SCALE, LOWER_BOUND = 128**-0.5, -5.0


def _inputs(seed, cu, heads):
    return test_ffi_gpu._inputs(seed, total=cu[-1], heads=heads, cu=cu)


def _separate(args, block_v):
    q, k, v, g, beta, a_log, dt_bias, cu, state0 = args
    ws = _ffi.prepare_call(q, k, g, beta, a_log, dt_bias, cu, scale=SCALE,
                           lower_bound=LOWER_BOUND, inverse="stable")
    return _ffi.recurrence_call(v, beta, ws, cu, state0,
                                launch=RecurrenceLaunch("column_split", block_v))


def _fused(args, block_v, side_by_side):
    return _ffi.prefill_overlap_call(
        *args, scale=SCALE, lower_bound=LOWER_BOUND, inverse="stable",
        launch=RecurrenceLaunch("column_split", block_v, side_by_side))


def _poison_allocator():
    """Leave NaN bit patterns in memory the allocator hands out next (the workspace and the
    counters of the following call are scratch results: a record read before it is written would
    show up as a difference)."""
    garbage = jnp.full((64 << 20,), -1, jnp.int32)  # 256 MiB of 0xffffffff
    garbage.block_until_ready()
    del garbage


def _bits(x):
    return np.asarray(x.view(jnp.uint16))


CASES = {
    # packed, empty sequences (first, inner, last), a partial last chunk, one-token sequences
    "packed": ((0, 0, 17, 17, 300, 301, 365, 365), 4),
    # one sequence of 128 chunks and a partial one at 6 heads
    "long": ((0, 2048 + 5), 6),
    # 40 heads x 8 CTAs (block_v 16) fill the SMs: the call runs the kernels one after the other
    "full": ((0, 100, 260), 40),
}


@pytest.mark.parametrize("block_v", contract.OVERLAP_COLUMN_SPLITS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_call_is_bitwise_the_two_separate_calls(case, block_v):
    cu, heads = CASES[case]
    args = _inputs(sorted(CASES).index(case), cu, heads)
    want_out, want_state = jax.jit(_separate, static_argnums=1)(args, block_v)
    fused = jax.jit(_fused, static_argnums=(1, 2))
    for side_by_side in (True, False, True):  # the last one: run to run
        _poison_allocator()
        out, state = fused(args, block_v, side_by_side)
        np.testing.assert_array_equal(_bits(out), _bits(want_out), err_msg=f"{side_by_side}")
        np.testing.assert_array_equal(_bits(state), _bits(want_state), err_msg=f"{side_by_side}")


def test_kda_prefill_overlap_true_matches_the_default():
    """Batched input with an f32 initial state (rounded to bf16 on entry either way):
    overlap=True (one call) equals the default and overlap=False (two calls) bit for bit."""
    B, T, H = 2, 777, 6
    keys = jax.random.split(jax.random.key(7), 8)
    bf = jnp.bfloat16
    x = {"q": jax.random.normal(keys[0], (B, T, H, 128), bf),
         "k": jax.random.normal(keys[1], (B, T, H, 128), bf),
         "v": jax.random.normal(keys[2], (B, T, H, 128), bf),
         "g": jax.random.normal(keys[3], (B, T, H, 128), bf),
         "beta": jax.random.normal(keys[4], (B, T, H), bf),
         "A_log": jax.random.uniform(keys[5], (H,), jnp.float32, -1.5, 1.0),
         "dt_bias": jax.random.normal(keys[6], (H, 128), jnp.float32),
         "initial_state": jax.random.normal(keys[7], (B, H, 128, 128), jnp.float32) * 0.1}
    runs = {}
    for overlap in (None, True, False):
        fn = jax.jit(lambda a, o=overlap: jax_kda.kda_prefill(
            **a, output_final_state=True, backend="kernel", overlap=o))
        lowered = fn.lower(x).as_text()
        assert ("jax_kda_prefill_overlap_v1" in lowered) == bool(overlap)
        _poison_allocator()
        runs[overlap] = fn(x)
    for overlap in (None, True):
        np.testing.assert_array_equal(_bits(runs[overlap][0]), _bits(runs[False][0]))
        np.testing.assert_array_equal(np.asarray(runs[overlap][1]), np.asarray(runs[False][1]))
    assert runs[False][1].dtype == jnp.float32
