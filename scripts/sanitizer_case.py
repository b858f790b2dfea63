"""A small KDA prefill for compute-sanitizer (memcheck/racecheck): varlen (an empty sequence, a
partial last chunk), every block_v and the baseline recurrence, both inverses."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda

rng = np.random.default_rng(0)
cu = np.array([0, 5, 5, 37, 70], np.int32)
T, H = int(cu[-1]), 2


def bf16(*shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)


args = dict(q=bf16(1, T, H, 128), k=bf16(1, T, H, 128), v=bf16(1, T, H, 128), g=bf16(1, T, H, 128),
            beta=bf16(1, T, H), A_log=jnp.zeros((H,), jnp.float32),
            dt_bias=jnp.asarray(rng.standard_normal((H, 128)), jnp.float32))
recurrences = [dict(column_split=bv) for bv in (16, 32, 64, 128)] + [dict(recurrence="baseline")]
for inverse in ("stable", "neumann"):
    for which in recurrences:
        out, st = jax_kda.kda_prefill(**args, cu_seqlens=jnp.asarray(cu), inverse=inverse,
                                      output_final_state=True, backend="kernel", **which)
        jax.block_until_ready((out, st))
print("sanitizer case ran", out.shape, st.shape)
