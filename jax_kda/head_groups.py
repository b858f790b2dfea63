"""Grouped value heads (GVA): q and k on Hk heads, v, g, beta, A_log, dt_bias, the states and the
outputs on H = G * Hk heads; value head j reads query/key head j // G (fla's convention: each
query/key head serves G consecutive value heads). G = 1 is the ungrouped call.

The GPU kernels read each query/key head in place (the prepare and decode kernels compute
j // G); the pure-JAX paths repeat q and k to H heads with `repeat_qk`, which gives exactly the
call on the repeated q and k.
"""

from __future__ import annotations

import jax.numpy as jnp


def group_size(qk_heads: int, heads: int) -> int:
    """G = H // Hk (the caller has checked that Hk divides H)."""
    return heads // qk_heads


def repeat_qk(x, group: int, axis: int = 2):
    """q or k with each head repeated `group` times in place ([.., Hk, ..] -> [.., Hk * G, ..],
    head j of the result = head j // G of x); x itself for group 1."""
    return x if group == 1 else jnp.repeat(x, group, axis=axis)
