"""Every combination of kda_prefill's run options raises the same error, or none, on every backend
and whether or not the GPU kernels are installed: the option rules are checked once
(jax_kda.options), before a backend is chosen.

Each combination is traced (jax.jit(...).trace: nothing runs), so the kernel path is followed to
its custom calls on this CPU-only machine too."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from kda_testing import make_inputs

import jax_kda
from jax_kda import _ffi, api, options

B, T, H = 1, 40, 2
GRID = {
    "recurrence": options.RECURRENCES,
    "numerics": ("flashkda", "fp32"),
    "inverse": ("stable", "neumann"),
    "sequence_parallel": ("auto", "off", 2),
    "pool": (False, True),
    "checkpoint_every": (None, 16),
}


def _args():
    return make_inputs(np.random.default_rng(0), B, T, H)


def _outcome(args, backend, *, pool, **run_options):
    """None when the call traces, else (error type, message)."""
    kwargs = dict(run_options, backend=backend, output_final_state=True)
    if pool:
        kwargs["initial_state"] = jnp.zeros((3, H, 128, 128), jnp.float32)
        kwargs["state_indices"] = jnp.array([2], jnp.int32)
    try:
        jax.jit(lambda a: jax_kda.kda_prefill(**a, **kwargs)).trace(args)
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return None


def test_every_option_combination_fails_alike_on_every_backend(monkeypatch):
    """backend="reference", "kernel" (its availability check passed: the trace stops before
    anything would run on a GPU) and "auto" with the kernels installed or not."""
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    args = _args()
    names = list(GRID)
    raised = 0
    for values in itertools.product(*GRID.values()):
        combo = dict(zip(names, values))
        outcomes = {}
        for installed in (False, True):
            monkeypatch.setattr(_ffi, "kernels_available", lambda installed=installed: installed)
            outcomes[f"auto, kernels installed: {installed}"] = _outcome(args, "auto", **combo)
        outcomes["reference"] = _outcome(args, "reference", **combo)
        outcomes["kernel"] = _outcome(args, "kernel", **combo)
        assert len(set(outcomes.values())) == 1, (combo, outcomes)
        raised += outcomes["reference"] is not None
    total = int(np.prod([len(v) for v in GRID.values()]))
    # the grid holds both kinds: the comparison above saw errors and clean traces
    assert 0 < raised < total, (raised, total)


SEGMENT_GRID = {
    "cu_seqlens": (False, True),
    "pool": (False, True),
    "checkpoint_every": (None, 16),
    "max_segments": (None, 0, 4),
    "output_final_state": (False, True),
}


def test_segment_ids_rules_fail_alike_on_every_backend(monkeypatch):
    """segment_ids with every option it cannot go with, max_segments good and bad, states asked
    for with and without max_segments: the same error (or none) on every backend."""
    monkeypatch.setattr(api, "_require_kernels", lambda: None)
    args = _args()
    ids = jnp.asarray([[0] * 10 + [1] * 30], jnp.int32)
    raised = 0
    for values in itertools.product(*SEGMENT_GRID.values()):
        combo = dict(zip(SEGMENT_GRID, values))
        kwargs = {"segment_ids": ids, "output_final_state": combo["output_final_state"],
                  "max_segments": combo["max_segments"],
                  "checkpoint_every": combo["checkpoint_every"]}
        if combo["cu_seqlens"]:
            kwargs["cu_seqlens"] = jnp.asarray([0, 10, T], jnp.int32)
        if combo["pool"]:
            kwargs["initial_state"] = jnp.zeros((3, H, 128, 128), jnp.float32)
            kwargs["state_indices"] = jnp.zeros((4,), jnp.int32)
        outcomes = set()
        for backend, installed in (("auto", False), ("auto", True), ("reference", True),
                                   ("kernel", True)):
            monkeypatch.setattr(_ffi, "kernels_available", lambda installed=installed: installed)
            try:
                jax.jit(lambda a: jax_kda.kda_prefill(**a, **kwargs, backend=backend)).trace(args)
                outcomes.add(None)
            except (TypeError, ValueError) as error:
                outcomes.add((type(error).__name__, str(error)))
        assert len(outcomes) == 1, (combo, outcomes)
        raised += outcomes != {None}
    total = int(np.prod([len(v) for v in SEGMENT_GRID.values()]))
    assert 0 < raised < total, (raised, total)
