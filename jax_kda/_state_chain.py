"""The backward pass's serial chains on the GPU: jax_kda/kernels/state_chain.py's custom call as
a JAX function that vmaps (one launch: the vmapped axis folds into the rows) and partitions (each
device runs its own rows and heads: chains are independent, so no collective; inside shard_map
the arrays are one device's already and the kernel runs on them as they are).

state_chain(reset, init, gamma, A, B, Y) -> states, with per-row initial states:
  reset int32 [N, C]: r >= 0 starts chunk c of row n from init[n, r] (r < Ni), -1 continues;
  init [N, Ni, H, 128, 128]; gamma [N, H, C, 128]; A [N, H, C, 16, 128]; B, Y [N, H, C, R, 128];
  states [N, H, C, 128, 128], the state entering every chunk (the kernel's docstring has the
  recurrence). All f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _ffi
from ._manual_axes import vary_like, varying_axes


def _launch(reset, init, gamma, A, B, Y):
    """One kernel launch: init's rows flattened to [N * Ni, ...], reset made global."""
    N, Ni = init.shape[:2]
    row0 = (jnp.arange(N, dtype=jnp.int32) * Ni)[:, None]
    reset = jnp.where((reset >= 0) & (reset < Ni), row0 + reset, -1)
    flat = init.reshape((N * Ni,) + init.shape[2:])
    return _ffi.state_chain_call(reset, flat, gamma, A, B, Y)


# Shardy factors: n (rows) and h (heads) may stay sharded, every other one is replicated.
_RULE = ("n c, n i h v k, n h c k, n h c r k, n h c s k, n h c s v -> n h c v k")
_REPLICATED = ("c", "i", "v", "k", "r", "s")


def _specs(mesh, gamma_sharding):
    spec = tuple(gamma_sharding.spec) + (None,) * 4
    n, h = spec[0], spec[1]
    shard = lambda *axes: NamedSharding(mesh, P(*axes))
    args = (shard(n, None), shard(n, None, h), shard(n, h), shard(n, h), shard(n, h),
            shard(n, h))
    return args, shard(n, h)


def _partition(mesh, arg_shapes, result_shape):
    args, out = _specs(mesh, arg_shapes[2].sharding)
    return mesh, _launch, out, args


_partitioned = custom_partitioning(_launch)
_partitioned.def_partition(_partition, sharding_rule=_RULE,
                           need_replication_factors=_REPLICATED)


@jax.custom_batching.custom_vmap
def state_chain(reset, init, gamma, A, B, Y):
    if varying_axes(gamma):  # inside shard_map: the arrays are one device's already
        return vary_like(_launch(reset, init, gamma, A, B, Y), gamma)
    return _partitioned(reset, init, gamma, A, B, Y)


@state_chain.def_vmap
def _fold_rows(axis_size, in_batched, *args):
    """The vmapped axis folded into the rows N (a free reshape): one launch."""
    lead = [x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
            for x, batched in zip(args, in_batched)]
    folded = [x.reshape((-1,) + x.shape[2:]) for x in lead]
    states = state_chain(*folded)
    return states.reshape((axis_size, -1) + states.shape[1:]), True
