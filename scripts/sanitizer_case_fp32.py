"""Small fp32-mode KDA calls for compute-sanitizer (memcheck/racecheck): varlen prefill (an empty
sequence, a partial last chunk) at every column split with an f32 initial state, a state pool
with padding and out-of-range indices (f32 and bf16 pools, with checkpoints at every column
split: the fp32 pool recurrence), a decode step, and the fused fp32 decode kernel on both pool
dtypes with and without the intermediate states (t = 3, and t = 16 with grouped q / k heads)."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda
from jax_kda import _ffi

rng = np.random.default_rng(0)
cu = np.array([0, 5, 5, 37, 70], np.int32)
T, H, N = int(cu[-1]), 2, len(cu) - 1


def bf16(*shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)


args = dict(q=bf16(1, T, H, 128), k=bf16(1, T, H, 128), v=bf16(1, T, H, 128), g=bf16(1, T, H, 128),
            beta=bf16(1, T, H), A_log=jnp.zeros((H,), jnp.float32),
            dt_bias=jnp.asarray(rng.standard_normal((H, 128)), jnp.float32))
state = jnp.asarray(rng.standard_normal((N, H, 128, 128), dtype=np.float32), jnp.float32)
for bv in (16, 32, 64, 128):
    out, st = jax.block_until_ready(jax_kda.kda_prefill(
        **args, cu_seqlens=jnp.asarray(cu), initial_state=state, output_final_state=True,
        backend="kernel", recurrence=bv, numerics="fp32"))
print("fp32 sanitizer case ran", out.shape, st.shape)

P = 4
idx = jnp.asarray([2, -1, 7, 0], jnp.int32)  # 7 >= P: padding under jit
pool = jnp.asarray(rng.standard_normal((P, H, 128, 128), dtype=np.float32), jnp.float32)
out, pool = jax.block_until_ready(jax.jit(lambda a, pool, idx: jax_kda.kda_prefill(
    **a, cu_seqlens=jnp.asarray(cu), initial_state=pool, state_indices=idx,
    output_final_state=True, backend="kernel", numerics="fp32"))(args, pool, idx))
for dtype in (jnp.float32, jnp.bfloat16):
    for bv in (16, 32, 64, 128):
        res = jax.block_until_ready(jax.jit(lambda a, p, idx: jax_kda.kda_prefill(
            **a, cu_seqlens=jnp.asarray(cu), initial_state=p, state_indices=idx,
            output_final_state=True, checkpoint_every=16, backend="kernel", recurrence=bv,
            numerics="fp32"))(args, pool.astype(dtype), idx))
print("fp32 sanitizer pool + checkpoints case ran", res[2].shape)
step = {name: x[:, :12].reshape((4, 3) + x.shape[2:]) for name, x in args.items()
        if name in ("q", "k", "v", "g", "beta")}
result = jax.block_until_ready(jax.jit(lambda s, pool, idx: jax_kda.kda_decode(
    **s, A_log=args["A_log"], dt_bias=args["dt_bias"], state=pool, state_indices=idx,
    backend="kernel", numerics="fp32"))(step, pool, idx))
print("fp32 sanitizer serving case ran", result[0].shape)


def fused(q, k, rest, pool, idx, states=False):
    return _ffi.decode_call(q, k, *rest, idx, pool, scale=128**-0.5, lower_bound=-5.0,
                            inverse="stable", intermediate_states=states, numerics="fp32")


rest = (step["v"], step["g"], step["beta"], args["A_log"], args["dt_bias"])
for dtype in (jnp.float32, jnp.bfloat16):
    for states in (False, True):
        res = jax.block_until_ready(jax.jit(fused, static_argnums=5)(
            step["q"], step["k"], rest, pool.astype(dtype), idx, states))
long = {name: x[:, :64].reshape((4, 16) + x.shape[2:]) for name, x in args.items()
        if name in ("q", "k", "v", "g", "beta")}
rest = (long["v"], long["g"], long["beta"], args["A_log"], args["dt_bias"])
res = jax.block_until_ready(jax.jit(fused, static_argnums=5)(
    long["q"][:, :, :1], long["k"][:, :, :1], rest, pool, idx, True))
print("fp32 sanitizer fused decode case ran", res[0].shape)
