"""The backward's chain kernel (jax_kda/kernels/state_chain.py) alone, for compute-sanitizer
(memcheck/racecheck), on random operands built on the host: no XLA GEMM runs in the process, so
the tool sees the chain kernel and a few copies only. Resets cover a start from an initial-state
row, continuation (-1) and out-of-range rows (the wrapper must turn them into -1); rows of one
chunk and of several; a vmapped call (the vmapped axis folds into the rows of one launch)."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda import _state_chain, contract
from jax_kda._ffi import ChainOperands

rng = np.random.default_rng(0)
D = 128


def f32(*shape, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32))


def operands(N, Ni, H, C, rows, reset):
    return ChainOperands(reset=jnp.asarray(reset, jnp.int32), init=f32(N, Ni, H, D, D),
                         A=f32(N, H, C, contract.CHUNK, D, scale=0.1),
                         B=f32(N, H, C, rows, D, scale=0.1), Y=f32(N, H, C, rows, D))


def run(N, Ni, H, C, reset_f, reset_r):
    gamma = jnp.asarray(-np.abs(rng.standard_normal((N, H, C, D), dtype=np.float32)))
    forward = operands(N, Ni, H, C, contract.FORWARD_CHAIN_ROWS, reset_f)
    reverse = operands(N, Ni, H, C, contract.REVERSE_CHAIN_ROWS, reset_r)
    return jax.block_until_ready(jax.jit(_state_chain.state_chains)(gamma, forward, reverse))


# 3 rows of 4 chunks: starts from row 0 and 1 of init, continuations, out-of-range rows (2, 7, -5)
(states, z), _ = run(3, 2, 2, 4, [[0, -1, 1, -1], [1, 2, -1, 0], [7, -1, -5, -1]],
                     [[-1, 0, -1, 1], [0, -1, 7, -1], [-1, -1, -1, 0]])
print("chain kernel ran", states.shape, z.shape, bool(jnp.isfinite(z).all()))
(states, z), _ = run(1, 1, 3, 1, [[0]], [[0]])  # a single chunk
print("single-chunk chain ran", states.shape)
gamma = jnp.asarray(-np.abs(rng.standard_normal((2, 1, 2, 3, D), dtype=np.float32)))
fwd = [operands(1, 1, 2, 3, contract.FORWARD_CHAIN_ROWS, [[0, -1, -1]]) for _ in range(2)]
rev = [operands(1, 1, 2, 3, contract.REVERSE_CHAIN_ROWS, [[-1, -1, 0]]) for _ in range(2)]
stack = lambda ops: jax.tree.map(lambda *xs: jnp.stack(xs), *ops)
(states, z), _ = jax.block_until_ready(jax.jit(jax.vmap(_state_chain.state_chains))(
    gamma, stack(fwd), stack(rev)))
print("vmapped chain ran", states.shape)
