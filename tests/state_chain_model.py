"""A plain-JAX model of the chain kernel (jax_kda/kernels/state_chain.py's docstring, written
from it): the two recurrences the kernel runs, in f32 at HIGHEST precision, as lax.scan. The CPU
tests put it in the kernel's place to check the operands jax_kda.reference_backward builds for it;
the GPU tests compare the kernel with it."""

import jax
import jax.numpy as jnp
from jax import lax

from jax_kda._ffi import ChainOperands

HIGHEST = lax.Precision.HIGHEST


def f32_product(spec, a, b):
    """An f32 matrix product (XLA's order of summation)."""
    return jnp.einsum(spec, a, b, precision=HIGHEST)


def chain_model(gamma, ops: ChainOperands, reverse: bool, product=f32_product):
    """One chain: reset [N, C], init [N, Ni, H, 128, 128], gamma [N, H, C, 128],
    A [N, H, C, 16, 128], B, Y [N, H, C, R, 128] -> (the state entering every chunk
    [N, H, C, 128, 128], Z's first 16 rows [N, H, C, 16, 128]), the chunks visited from the last
    when `reverse`; product(spec, a, b) computes both matrix products of a step."""
    num_init, rows = ops.init.shape[1], ops.B.shape[-2]

    def one_row(reset, init, gamma, A, B, Y):
        def step(X, xs):
            r, g, a, b, y = xs
            start = init[jnp.clip(r, 0, num_init - 1)]
            X = jnp.where((r >= 0) & (r < num_init), start, X)
            P = product("hrk,hvk->hrv", a, X)
            Z = y - jnp.pad(P, ((0, 0), (0, rows - P.shape[1]), (0, 0)))
            X_next = X * g[:, None, :] + product("hrv,hrk->hvk", Z, b)
            return X_next, (X, Z[:, :P.shape[1]])

        chunks_first = lambda x: jnp.moveaxis(x, 1, 0)
        X0 = jnp.zeros(init.shape[1:], jnp.float32)
        _, (states, z) = lax.scan(step, X0, (reset,) + tuple(map(chunks_first, (gamma, A, B, Y))),
                                  reverse=reverse)
        return jnp.moveaxis(states, 0, 1), jnp.moveaxis(z, 0, 1)

    return jax.vmap(one_row)(ops.reset, ops.init, gamma, ops.A, ops.B, ops.Y)


def state_chains_model(gamma, forward: ChainOperands, reverse: ChainOperands,
                       product=f32_product):
    """jax_kda._state_chain.state_chains as the model: the forward chain first to last, the
    reverse chain last to first."""
    return (chain_model(gamma, forward, False, product),
            chain_model(gamma, reverse, True, product))
