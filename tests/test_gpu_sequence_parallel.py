"""Sequence parallelism of the fp32 mode on the GPU kernels (marker gpu).

- kernel vs the reference's same segmentation (jax_kda._sequence_parallel on
  jax_kda.reference_fp32): out relative RMSE <= 5e-4 with >= 97 % of the elements bit-equal,
  final state <= 1e-4 (the fp32 mode's kernel-vs-reference bounds, tests/test_gpu_fp32.py; the
  combine's f32 products add only f32-level differences);
- kernel vs kernel: every column split gives the same bits, run to run too; the serial fp32
  kernels agree to the same bounds;
- kernel vs the float64 oracle: within 1.1x of the serial fp32 kernels' error (out and final
  state) in every gate regime of docs/fp32_mode.md section 4.
The measured figures are printed (pytest -s).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import make_inputs, random_states

import jax_kda
from jax_kda import oracle

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_gpus")]

PACKED_LENS = [1500, 0, 1, 100, 0, 3000, 37]  # long ones cut, short and empty ones not


def rel_and_equal(name, got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want).astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), f"{name}: non-finite output"
    rel = float(np.sqrt(np.mean((got - want) ** 2) / max(np.mean(want**2), 1e-30)))
    equal = float(np.mean(got == want))
    print(f"\n  {name}: rel RMSE {rel:.2e}, bit-equal {equal:.4f}")
    return rel, equal


def prefill(backend, segments, **options):
    return jax.jit(lambda a, extra: jax_kda.kda_prefill(
        **a, **extra, backend=backend, output_final_state=True, numerics="fp32",
        sequence_parallel=segments, **options))


def packed_case(seed, H=2, regime="keep32"):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(PACKED_LENS)]).astype(np.int32)
    a = make_inputs(rng, 1, int(cu[-1]), H, regime=regime)
    state = random_states(rng, len(PACKED_LENS), H, jnp.float32)
    return a, {"cu_seqlens": jnp.asarray(cu), "initial_state": state}


@pytest.mark.parametrize("segments", [3, 8])
def test_kernel_matches_the_reference_segmentation(segments):
    a, extra = packed_case(segments)
    out, final = prefill("kernel", segments)(a, extra)
    cpu = jax.devices("cpu")[0]
    want_out, want_final = prefill("reference", segments)(*jax.device_put((a, extra), cpu))
    rel, equal = rel_and_equal(f"sp={segments} out vs reference", out, want_out)
    assert rel <= 5e-4 and equal >= 0.97
    assert rel_and_equal(f"sp={segments} state vs reference", final, want_final)[0] <= 1e-4
    for n in (1, 4):  # empty sequences return their f32 initial state bit for bit
        np.testing.assert_array_equal(np.asarray(final[n]), np.asarray(extra["initial_state"][n]))


def test_every_column_split_and_every_run_give_the_same_bits():
    a, extra = packed_case(11)
    first = prefill("kernel", 6)(a, extra)
    for split in (16, 32, 64, 128, 16):
        got = prefill("kernel", 6, recurrence=split)(a, extra)
        for x, y in zip(got, first):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_agrees_with_the_serial_kernels():
    a, extra = packed_case(12)
    serial_out, serial_final = prefill("kernel", "off")(a, extra)
    out, final = prefill("kernel", 8)(a, extra)
    rel, equal = rel_and_equal("sp=8 out vs serial kernels", out, serial_out)
    assert rel <= 5e-4 and equal >= 0.97
    assert rel_and_equal("sp=8 state vs serial kernels", final, serial_final)[0] <= 1e-4


REGIMES = ("strong", "fla", "keep32", "slow")


@pytest.mark.parametrize("regime", REGIMES)
def test_as_accurate_as_the_serial_mode(regime):
    rng = np.random.default_rng(REGIMES.index(regime))
    a = make_inputs(rng, 1, 16384, 1, regime=regime)
    want_out, want_state = oracle.kda_prefill_oracle(
        **{k: np.asarray(v.astype(jnp.float32)) for k, v in a.items()})
    serial = prefill("kernel", "off")(a, {})
    cut = prefill("kernel", 16)(a, {})
    errors = {}
    for name, (out, state) in (("serial", serial), ("sp=16", cut)):
        errors[name] = (rel_and_equal(f"{regime} {name} out vs oracle", out, want_out)[0],
                        rel_and_equal(f"{regime} {name} state vs oracle", state, want_state)[0])
    assert errors["sp=16"][0] <= 1.1 * errors["serial"][0], errors
    assert errors["sp=16"][1] <= 1.1 * errors["serial"][1], errors
