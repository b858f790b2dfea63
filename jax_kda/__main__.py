"""Demo: `python -m jax_kda` runs one KDA prefill and checks it against the float64 oracle.

On a machine with an NVIDIA GPU and the built kernels it runs the GPU kernels at Kimi-K3 shapes
(12 heads, as one GPU holds at TP8, T = 8192); elsewhere the pure-JAX reference on smaller shapes.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import kda_prefill, kernels_available, oracle, unavailable_reason

# The demo draws q, k, v ~ N(0, 1). There the bf16 roundings of the numerics contract
# (docs/numerics.md; kernels and reference alike)
# cost 5e-3 to 7.5e-3 relative RMSE against float64; FlashKDA's 5e-3 bound holds for its U(0, 1)
# inputs (both measured in tests/test_reference.py).
ORACLE_TOLERANCE = 1e-2


def _make_inputs(rng, T, H, dtype=jnp.bfloat16):
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)

    return {
        "q": normal(1, T, H, 128), "k": normal(1, T, H, 128), "v": normal(1, T, H, 128),
        "g": normal(1, T, H, 128), "beta": normal(1, T, H),
        "A_log": jnp.asarray(rng.uniform(-2.0, 1.0, H), jnp.float32),
        "dt_bias": jnp.asarray(rng.standard_normal((H, 128)), jnp.float32),
    }


def _median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def driver_gpus() -> list[str]:
    """The NVIDIA GPUs the driver lists (nvidia-smi -L), [] without a driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30,
                                check=False)  # a failing nvidia-smi lists no GPU
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in listed.stdout.splitlines() if line.startswith("GPU ")]


def main(argv=None) -> None:
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    if not on_gpu and driver_gpus():
        raise SystemExit(
            f"jax_kda demo: the NVIDIA driver lists {driver_gpus()[0]!r} but JAX sees no GPU "
            f"(devices: {jax.devices()}): JAX's CUDA plugin is missing. Install it with "
            "pip install 'jax-kda[cuda13]' (or run `make demo`, which does where a driver is "
            "present); the demo would otherwise run the reference on the CPU."
        )
    use_kernels = on_gpu and kernels_available()
    parser = argparse.ArgumentParser(prog="python -m jax_kda", description=__doc__)
    parser.add_argument("--seqlen", type=int, default=8192 if use_kernels else 1024)
    parser.add_argument("--heads", type=int, default=12 if use_kernels else 2)
    parser.add_argument("--check-tokens", type=int, default=512,
                        help="tokens of head 0 checked against the float64 oracle")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    T, H = args.seqlen, args.heads
    inputs = _make_inputs(rng, T, H)
    state0 = jnp.asarray(rng.standard_normal((1, H, 128, 128), dtype=np.float32) * 0.05,
                         jnp.float32)
    if use_kernels:
        backend, why = "kernel", "GPU kernels (CuTe DSL via XLA FFI)"
    elif on_gpu:
        backend = "reference"
        why = f"pure-JAX reference (kernels unavailable: {unavailable_reason()})"
    else:
        backend, why = "reference", "pure-JAX reference (no CUDA GPU visible)"

    run = jax.jit(lambda x, s: kda_prefill(**x, initial_state=s, output_final_state=True,
                                           backend=backend))
    out, final_state = jax.block_until_ready(run(inputs, state0))  # compile + first run
    seconds = _median_seconds(lambda: run(inputs, state0), repeats=5 if use_kernels else 2)

    n = min(args.check_tokens, T)
    sliced = {key: np.asarray(val[:, :n, :1].astype(jnp.float32)) if val.ndim >= 3
              else np.asarray(val[:1])
              for key, val in inputs.items()}
    # an f32 initial state is rounded to bf16 on entry (docs/numerics.md); the oracle starts there
    state_entry = np.asarray(state0[:, :1].astype(jnp.bfloat16).astype(jnp.float32))
    want, _ = oracle.kda_prefill_oracle(**sliced, initial_state=state_entry)
    got = np.asarray(out[:, :n, :1].astype(jnp.float32), np.float64)
    rel_rmse = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))

    print(f"jax_kda demo on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"backend:        {why}")
    print(f"shapes:         q/k/v/g {tuple(inputs['q'].shape)} bf16, "
          f"state {tuple(state0.shape)} f32")
    print(f"time:           {seconds * 1e3:.3f} ms per call (median, jit, incl. dispatch)")
    print(f"final state:    {final_state.dtype} {tuple(final_state.shape)}, "
          f"finite={bool(jnp.isfinite(final_state).all())}")
    print(f"vs f64 oracle:  relative RMSE {rel_rmse:.2e} on head 0, tokens 0..{n - 1} "
          f"(tolerance {ORACLE_TOLERANCE:g}) -> {'OK' if rel_rmse <= ORACLE_TOLERANCE else 'FAIL'}")
    if not rel_rmse <= ORACLE_TOLERANCE:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
