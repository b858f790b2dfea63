"""Seconds-long GPU check of the serving kernels against the prefill kernels, bitwise: kda_decode
(t = 1, 3, 16; both inverses; bf16 and f32 pools with padding and out-of-range slots; intermediate
states), pool prefill (every column split) and checkpoints. Prints one line per check and exits 1
on the first mismatch."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda

rng = np.random.default_rng(0)
H = 3
A_log = jnp.asarray(rng.uniform(0, 1, H), jnp.float32)
dt_bias = jnp.asarray(rng.uniform(0, 1, (H, 128)), jnp.float32)
failures = 0


def bf16(*shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)


def same(name, a, b):
    global failures
    a, b = np.asarray(a), np.asarray(b)
    ok = a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    failures += not ok


def tokens(n, t):
    return {"q": bf16(n, t, H, 128), "k": bf16(n, t, H, 128), "v": bf16(n, t, H, 128),
            "g": bf16(n, t, H, 128), "beta": bf16(n, t, H)}


prefill = jax.jit(lambda x, s, inverse: jax_kda.kda_prefill(
    **x, A_log=A_log, dt_bias=dt_bias, initial_state=s, output_final_state=True,
    inverse=inverse, backend="kernel"), static_argnames="inverse")
for dtype in (jnp.bfloat16, jnp.float32):
    for inverse in ("stable", "neumann"):
        for t in (1, 3, 16):
            N, P = 4, 6
            pool = jnp.asarray(rng.standard_normal((P, H, 128, 128), dtype=np.float32) * 0.1, dtype)
            idx = jnp.asarray([4, -1, 9, 1], jnp.int32)  # -1 and 9 >= P: padding slots
            x = tokens(N, t)
            decode = jax.jit(lambda x, pool, idx, inverse=inverse: jax_kda.kda_decode(
                **x, A_log=A_log, dt_bias=dt_bias, state=pool, state_indices=idx, inverse=inverse,
                output_intermediate_states=True, backend="kernel"))
            out, new_pool, states = decode(x, pool, idx)
            rows = jnp.asarray([4, 0, 0, 1])
            want_out, want_state = prefill(x, pool[rows], inverse)
            tag = f"decode {jnp.dtype(dtype).name} {inverse} t={t}"
            same(f"{tag}: out", out[jnp.asarray([0, 3])], want_out[jnp.asarray([0, 3])])
            same(f"{tag}: pool rows", new_pool[jnp.asarray([4, 1])],
                 want_state[jnp.asarray([0, 3])])
            same(f"{tag}: untouched rows", new_pool[jnp.asarray([0, 2, 3, 5])],
                 pool[jnp.asarray([0, 2, 3, 5])])
            same(f"{tag}: padding out zero", out[jnp.asarray([1, 2])],
                 jnp.zeros_like(out[jnp.asarray([1, 2])]))
            for i in (0, t - 1):
                prefix = {name: a[:, : i + 1] for name, a in x.items()}
                _, s_i = prefill(prefix, pool[rows], inverse)
                same(f"{tag}: state after token {i}", states[jnp.asarray([0, 3]), i],
                     s_i[jnp.asarray([0, 3])])

# pool prefill and checkpoints, packed sequences (one empty), every column split
cu = jnp.asarray([0, 37, 37, 100], jnp.int32)
x = {name: a.reshape((1, 100) + a.shape[2:]) for name, a in tokens(1, 100).items()}
for dtype in (jnp.bfloat16, jnp.float32):
    pool = jnp.asarray(rng.standard_normal((5, H, 128, 128), dtype=np.float32) * 0.1, dtype)
    idx = jnp.asarray([3, 0, 1], jnp.int32)
    plain = jax.jit(lambda x, s: jax_kda.kda_prefill(
        **x, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, initial_state=s,
        output_final_state=True, backend="kernel"))
    want_out, want_state = plain(x, pool[idx])
    for split in (16, 32, 64, 128):
        run = jax.jit(lambda x, pool, split=split: jax_kda.kda_prefill(
            **x, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, initial_state=pool,
            state_indices=idx, output_final_state=True, checkpoint_every=32, recurrence=split,
            backend="kernel"))
        out, new_pool, ckpts = run(x, pool)
        tag = f"pool prefill {jnp.dtype(dtype).name} bv{split}"
        same(f"{tag}: out", out, want_out)
        same(f"{tag}: pool rows", new_pool[idx], want_state)
        same(f"{tag}: untouched rows", new_pool[jnp.asarray([2, 4])], pool[jnp.asarray([2, 4])])
        offsets = np.asarray(jax_kda.checkpoint_offsets(cu, 32))
        for s, (lo, hi) in enumerate(zip(np.asarray(cu)[:-1], np.asarray(cu)[1:])):
            for j in range(offsets[s + 1] - offsets[s]):
                n_tok = 32 * (j + 1)
                seq = {name: a[:, lo:lo + n_tok] for name, a in x.items()}
                _, st = jax.jit(lambda x, s0: jax_kda.kda_prefill(
                    **x, A_log=A_log, dt_bias=dt_bias, initial_state=s0,
                    output_final_state=True, backend="kernel"))(seq, pool[idx[s]][None])
                same(f"{tag}: checkpoint {j} of sequence {s}", ckpts[offsets[s] + j], st[0])
print("serving smoke:", "all bitwise equal" if not failures else f"{failures} FAILED")
sys.exit(1 if failures else 0)
