"""Keeping arrays' manual-axis types consistent inside jax.shard_map.

Under shard_map every array records which manual mesh axes it varies over. An array made from
scratch (zeros) or returned by a custom call is recorded as not varying, while the inputs vary over
the head axis; lax.scan carries and the branches of lax.platform_dependent must agree, so such
arrays are cast to vary like the inputs.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.11; older releases: aval.vma
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def vary_like(x, like):
    """x cast to vary over every manual axis `like` varies over (a no-op outside shard_map)."""
    missing = varying_axes(like) - varying_axes(x)
    return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x
