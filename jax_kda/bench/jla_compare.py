"""jax-linear-attention (package `jla`: JAX Pallas Mosaic GPU kernels, Hopper only) as a peer:
its KDA forward, jla.ops.mosaic_gpu.kda.kda, timed in this process through JAX like jax_kda's own
variants (timing.time_jax: a jitted chain of calls, each starting from the previous final state).

jla takes its gates already applied, so they are computed once, outside the timed function, from
the numbers jax_kda receives (the case's inputs):

  g     = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias)), f32 [B, T, H, 128]: the
          natural-log decay of each key channel (jla multiplies the state by exp(g));
  beta  = sigmoid(beta_raw), f32 [B, T, H];
  state = the initial state in f32, transposed to jla's [B, H, K, V] (jax_kda's is [N, H, V, K]).

q, k, v stay bf16, and q and k are L2-normalised inside the call (use_qk_l2norm=True) as jax_kda
normalises them. jla takes no cu_seqlens (its segment_ids restart each segment from a zero
state), so it times batched and single-sequence cases and records packed cases of several
sequences, and decode cases, as skipped. "jla-train" (build_train) times jla's forward +
backward of the training loss of jax_kda/bench/training.py instead, the gate glue inside the
differentiated function.
"""

from __future__ import annotations

import importlib

from .cases import Case, DecodeCase
from .jax_variants import VariantUnavailable, prefill_options, zero_times

KDA_MODULE = "jla.ops.mosaic_gpu.kda"  # kda() and supports_kda()
# unsupported_reason(): why supports_kda says no
CHECKS_MODULE = "jla.ops.mosaic_gpu.vector_gate_ops"
STATE = 5  # position of the state in the timed function's arguments


def version() -> str | None:
    """jla's version, None when it is not importable."""
    try:
        return getattr(importlib.import_module("jla"), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - a broken optional import is reported as absent
        return None


def _check_case(case: Case | DecodeCase) -> None:
    if case.kind == "decode":
        raise VariantUnavailable("jla's kda reads no state pool (no state indices); decode cases "
                                 "are not timed")
    if case.layout == "varlen" and case.num_seqs > 1:
        raise VariantUnavailable("jla's kda takes no cu_seqlens (its segment_ids start every "
                                 "segment from a zero state): packed cases of several sequences "
                                 "are not timed")


def _kda_module():
    try:
        return importlib.import_module(KDA_MODULE)
    except Exception as err:  # absent, or broken (jla 0.1.0 pins another JAX than this one)
        raise VariantUnavailable(f"jla is not importable ({type(err).__name__}: {err})") from err


def to_jla(q, k, v, g, beta, A_log, dt_bias, state, *, lower_bound: float) -> tuple:
    """jla's (q, k, v, g, beta, initial_state) from jax_kda's inputs, traceable (the module
    docstring has the conversion)."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    decay_rate = jnp.exp(A_log)[:, None]  # [H, 1], against g [B, T, H, 128]
    log_decay = lower_bound * jax.nn.sigmoid(decay_rate * (g.astype(f32) + dt_bias))
    state_kv = jnp.swapaxes(state.astype(f32), -1, -2)  # [N, H, V, K] -> [B, H, K, V]
    return q, k, v, log_decay, jax.nn.sigmoid(beta.astype(f32)), state_kv


def convert_inputs(x: dict, *, lower_bound: float) -> tuple:
    """jla's (q, k, v, g, beta, initial_state) from a prefill case's jax inputs, on the device."""
    import functools

    import jax

    convert = jax.jit(functools.partial(to_jla, lower_bound=lower_bound))
    return tuple(jax.block_until_ready(convert(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["state"])))


def _why_unsupported(args: tuple, options: dict) -> str:
    """jla's own reason for refusing a call (the check behind supports_kda), where it has one."""
    q, k, v, g, beta, state = args
    try:
        checks = importlib.import_module(CHECKS_MODULE)
        reason = checks.unsupported_reason(q, k, v, g, beta.shape == q.shape[:3],
                                           options | {"initial_state": state})
    except Exception:  # noqa: BLE001 - the reason is a courtesy; the refusal stands without it
        reason = None
    return reason or "supports_kda returned False"


def _feedback(args, outs):
    """The next call starts from this call's final state. beta depends on it too: jla's
    intra-chunk kernels read only q, k, g and beta, and without a dependency on the state XLA
    could merge them across the chained calls; beta is the smallest of those inputs."""
    q, k, v, g, beta, _ = args
    _, final_state = outs
    return q, k, v, g, beta + zero_times(final_state), final_state


def build(case: Case | DecodeCase, x: dict):
    """(fn, args, feedback, info) as jax_variants.build: fn(*args) is one jla.ops.mosaic_gpu.kda
    call on the case's inputs converted to jla's conventions, feedback chains the state."""
    import jax

    _check_case(case)
    module = _kda_module()
    opts = prefill_options(case, inverse="stable")
    args = convert_inputs(x, lower_bound=opts["lower_bound"])
    options = {"scale": opts["scale"], "output_final_state": True, "use_qk_l2norm": True}
    if not module.supports_kda(*args[:STATE], initial_state=args[STATE], **options):
        raise VariantUnavailable(f"jla's kda does not take this call: "
                                 f"{_why_unsupported(args, options)}")

    def jla_kda(q, k, v, g, beta, state):
        return module.kda(q, k, v, g, beta, initial_state=state, **options)

    # jitted on its own, so that a chain of R calls traces and lowers jla's Pallas kernels once
    notes = {"inputs": "g as jla's log-decay, beta after the sigmoid and the f32 [B, H, K, V] "
             "state computed once, outside the timed call"}
    return jax.jit(jla_kda), args, _feedback, {"notes": notes}


def build_train(case: Case | DecodeCase, x: dict):
    """(fn, args, feedback, info) of jla's forward + backward of the training loss
    (jax_kda/bench/training.py), on the case's jax inputs."""
    from . import training

    _check_case(case)
    return training.build_jla(case, x, _kda_module().kda)
