"""Small KDA calls for compute-sanitizer (memcheck/racecheck): varlen prefill (an empty sequence,
a partial last chunk), every block_v and the baseline recurrence, both inverses; then a state pool
prefill with checkpoints and decode steps with padding and out-of-range pool indices."""

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
# every column split and the baseline recurrence
recurrences = [dict(column_split=bv) for bv in (16, 32, 64, 128)] + [dict(recurrence="baseline")]
for inverse in ("stable", "neumann"):
    for which in recurrences:
        out, st = jax_kda.kda_prefill(**args, cu_seqlens=jnp.asarray(cu), inverse=inverse,
                                      output_final_state=True, backend="kernel", **which)
        jax.block_until_ready((out, st))
print("sanitizer case ran", out.shape, st.shape)

# An odd T * H: beta's last element starts a 4-byte word that would end past the array, which
# prepare copies synchronously instead (the path no other case takes).
T_odd, H_odd = 69, 3
odd = {name: bf16(1, T_odd, H_odd, 128) for name in ("q", "k", "v", "g")}
odd.update(beta=bf16(1, T_odd, H_odd), A_log=jnp.zeros((H_odd,), jnp.float32),
           dt_bias=jnp.asarray(rng.standard_normal((H_odd, 128)), jnp.float32))
out = jax_kda.kda_prefill(**odd, cu_seqlens=jnp.asarray([0, 3, T_odd], jnp.int32),
                          backend="kernel")
jax.block_until_ready(out)
print("odd T * H case ran", out[0].shape)

# Serving: pool prefill with checkpoints and decode steps, indices that are padding (negative),
# out of range (>= P, only caught at run time under jit) and in range, bf16 and f32 pools.
P = 4
idx = jnp.asarray([2, -1, 7, 0], jnp.int32)  # 7 >= P: padding under jit
prefill = jax.jit(lambda a, pool, idx: jax_kda.kda_prefill(
    **a, cu_seqlens=jnp.asarray(cu), initial_state=pool, state_indices=idx,
    output_final_state=True, checkpoint_every=16, backend="kernel"))
step = {name: x[:, :12].reshape((4, 3) + x.shape[2:]) for name, x in args.items()
        if name in ("q", "k", "v", "g", "beta")}
for dtype in (jnp.bfloat16, jnp.float32):
    pool = jnp.asarray(rng.standard_normal((P, H, 128, 128), dtype=np.float32), dtype)
    out, pool, ckpts = jax.block_until_ready(prefill(args, pool, idx))
    for inverse in ("stable", "neumann"):
        for intermediate in (False, True):
            result = jax.block_until_ready(jax.jit(lambda s, pool, idx: jax_kda.kda_decode(
                **s, A_log=args["A_log"], dt_bias=args["dt_bias"], state=pool, state_indices=idx,
                inverse=inverse, output_intermediate_states=intermediate, backend="kernel"))(
                    step, pool, idx))
print("sanitizer serving case ran", ckpts.shape, result[0].shape)
