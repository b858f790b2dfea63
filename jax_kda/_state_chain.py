"""The backward pass's serial chains on the GPU: jax_kda/kernels/state_chain.py's custom call (both
chains in one launch) as a JAX function that vmaps (one launch: the vmapped axis folds into the
rows) and partitions (each device runs its own rows and heads: chains are independent, so no
collective; inside shard_map the arrays are one device's already and the kernel runs on them as
they are).

state_chains(gamma, forward, reverse) -> ((states, z) of the forward chain, (states, z) of the
reverse chain), each chain's operands a ChainOperands with per-row initial states:
  reset int32 [N, C]: r >= 0 starts chunk c of row n from init[n, r] (r < Ni), -1 continues;
  init [N, Ni, H, 128, 128]; A [N, H, C, 16, 128]; B, Y [N, H, C, R, 128]; gamma [N, H, C, 128]
  shared; states [N, H, C, 128, 128], the state entering every chunk, and z [N, H, C, 16, 128],
  the first 16 rows of Z (the kernel's docstring has the recurrence). R = 16 for the forward chain
  (chunks first to last), 32 for the reverse one (last to first). All f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _ffi
from ._ffi import ChainOperands
from ._manual_axes import vary_like, varying_axes


def _flat_init(ops: ChainOperands) -> ChainOperands:
    """init's rows flattened to [N * Ni, ...], reset made global."""
    N, Ni = ops.init.shape[:2]
    row0 = (jnp.arange(N, dtype=jnp.int32) * Ni)[:, None]
    reset = jnp.where((ops.reset >= 0) & (ops.reset < Ni), row0 + ops.reset, -1)
    return ops._replace(reset=reset, init=ops.init.reshape((N * Ni,) + ops.init.shape[2:]))


def _launch(gamma, *flat):
    """One kernel launch; flat: the forward chain's five operands, then the reverse chain's."""
    forward, reverse = ChainOperands(*flat[:5]), ChainOperands(*flat[5:])
    (states_f, z_f), (states_r, z_r) = _ffi.state_chains_call(
        gamma, _flat_init(forward), _flat_init(reverse))
    return states_f, z_f, states_r, z_r


# Shardy factors: n (rows) and h (heads) may stay sharded, every other one is replicated.
_CHAIN = "n c, n {i} h v k, n h c r k, n h c {s} k, n h c {s} v"
_RULE = (f"n h c k, {_CHAIN.format(i='i', s='s')}, {_CHAIN.format(i='j', s='t')}"
         " -> n h c v k, n h c r v, n h c v k, n h c r v")
# (in the order the factors first appear in the rule, which Shardy requires)
_REPLICATED = tuple(f for f in dict.fromkeys(_RULE.replace(",", " ").split())
                    if f not in ("n", "h", "->"))


def _specs(mesh, gamma_sharding):
    spec = tuple(gamma_sharding.spec) + (None,) * 4
    n, h = spec[0], spec[1]
    shard = lambda *axes: NamedSharding(mesh, P(*axes))
    chain = (shard(n, None), shard(n, None, h), shard(n, h), shard(n, h), shard(n, h))
    return (shard(n, h),) + chain * 2, (shard(n, h),) * 4


def _partition(mesh, arg_shapes, result_shape):
    args, out = _specs(mesh, arg_shapes[0].sharding)
    return mesh, _launch, out, args


_partitioned = custom_partitioning(_launch)
_partitioned.def_partition(_partition, sharding_rule=_RULE,
                           need_replication_factors=_REPLICATED)


@jax.custom_batching.custom_vmap
def _state_chains(gamma, *flat):
    if varying_axes(gamma):  # inside shard_map: the arrays are one device's already
        return tuple(vary_like(x, gamma) for x in _launch(gamma, *flat))
    return _partitioned(gamma, *flat)


@_state_chains.def_vmap
def _fold_rows(axis_size, in_batched, *args):
    """The vmapped axis folded into the rows N (a free reshape): one launch."""
    lead = [x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
            for x, batched in zip(args, in_batched)]
    results = _state_chains(*(x.reshape((-1,) + x.shape[2:]) for x in lead))
    return tuple(x.reshape((axis_size, -1) + x.shape[1:]) for x in results), (True,) * 4


def state_chains(gamma, forward: ChainOperands, reverse: ChainOperands):
    """Both chains (module docstring): ((states, z) forward, (states, z) reverse)."""
    states_f, z_f, states_r, z_r = _state_chains(gamma, *forward, *reverse)
    return (states_f, z_f), (states_r, z_r)
