"""Decode steps of one shape, for Nsight Compute / Nsight Systems: where a step's time goes
(the kernel against launch and dispatch). Environment knobs: PROFILE_SEQS (N, default 64),
PROFILE_HEADS (default 12), PROFILE_TOKENS (t, default 1), PROFILE_POOL ("bf16" | "f32"),
PROFILE_NUMERICS ("flashkda" | "fp32"), PROFILE_ROWS ("random": N of 2N pool rows in a random
order, the default | "sorted": rows 0..N-1), PROFILE_CALLS (steps after the first, default 0)."""

import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda

rng = np.random.default_rng(0)
N, H = int(os.environ.get("PROFILE_SEQS", "64")), int(os.environ.get("PROFILE_HEADS", "12"))
t = int(os.environ.get("PROFILE_TOKENS", "1"))
pool_dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[os.environ.get("PROFILE_POOL", "bf16")]
numerics = os.environ.get("PROFILE_NUMERICS", "flashkda")


def bf16(*shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)


args = {"q": bf16(N, t, H, 128), "k": bf16(N, t, H, 128), "v": bf16(N, t, H, 128),
        "g": bf16(N, t, H, 128), "beta": bf16(N, t, H),
        "A_log": jnp.asarray(rng.uniform(-2, 1, H), jnp.float32),
        "dt_bias": jnp.asarray(rng.standard_normal((H, 128)), jnp.float32)}
pool = jnp.asarray(0.1 * rng.standard_normal((2 * N, H, 128, 128), dtype=np.float32), pool_dtype)
rows = {"random": rng.permutation(2 * N)[:N],  # as a server's pool
        "sorted": np.arange(N)}[os.environ.get("PROFILE_ROWS", "random")]
rows = jnp.asarray(rows, jnp.int32)
step = jax.jit(lambda a, p: jax_kda.kda_decode(**a, state=p, state_indices=rows,
                                               numerics=numerics, backend="kernel"),
               donate_argnums=1)
for _ in range(1 + int(os.environ.get("PROFILE_CALLS", "0"))):
    out, pool = step(args, pool)
jax.block_until_ready(pool)
print("profiled decode ran", out.shape, pool.dtype)
