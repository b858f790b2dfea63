"""One KDA prefill at T=8192, 12 heads (Kimi-K3 at TP8), for Nsight Compute. Environment knobs:
PROFILE_HEADS (default 12), PROFILE_NUMERICS ("flashkda" | "fp32"), PROFILE_SPLIT (column split,
default: the launch heuristic), PROFILE_CALLS (calls after the first, default 0: a timeline
profiler sees warm calls)."""

import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda

rng = np.random.default_rng(0)
T, H = 8192, int(os.environ.get("PROFILE_HEADS", "12"))
options = {"numerics": os.environ.get("PROFILE_NUMERICS", "flashkda")}
if os.environ.get("PROFILE_SPLIT"):
    options["column_split"] = int(os.environ["PROFILE_SPLIT"])


def bf16(*shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)


args = {"q": bf16(1, T, H, 128), "k": bf16(1, T, H, 128), "v": bf16(1, T, H, 128),
        "g": bf16(1, T, H, 128), "beta": bf16(1, T, H),
        "A_log": jnp.asarray(rng.uniform(-2, 1, H), jnp.float32),
        "dt_bias": jnp.asarray(rng.standard_normal((H, 128)), jnp.float32)}
prefill = jax.jit(lambda a: jax_kda.kda_prefill(**a, backend="kernel", **options))
for _ in range(1 + int(os.environ.get("PROFILE_CALLS", "0"))):
    out, _ = prefill(args)
    jax.block_until_ready(out)
print("profiled case ran", out.shape)
