"""Training steps the benchmark times: forward + backward of one loss through kda_prefill (kinds
"train" and "backward", in each numerics mode) and through jax-linear-attention's kda
("jla-train", with its gate glue differentiated by JAX); fla's ("fla-train", torch autograd) is
torch_compare.build_fla_train, with the weights of loss_weight_arrays.

The loss is sum(out * w_out) + sum(final_state * w_state) with fixed random f32 weights, so that
both cotangents reach the backward. "train" is jax.value_and_grad of it w.r.t. q, k, v, g, beta,
A_log, dt_bias and the initial state (f32); "backward" is jax.grad alone (the loss value unused, so
XLA drops the forward: the backward's own time). Each call's A_log depends on the previous call's
results (0 * one element), so a chain of calls can be neither merged nor dropped.
"""

from __future__ import annotations

import functools

import numpy as np

from .jax_variants import (
    Variant,
    VariantUnavailable,
    prefill_options,
    sequence_kwargs,
    unavailable_reason,
)
from .jla_compare import to_jla

INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state")


def loss_weight_arrays(case, seed: int = 0):
    """(w_out [B, T, H, 128], w_state [N, H, 128, 128]) f32 numpy for the case's layout (the
    torch peers take them too)."""
    rng = np.random.default_rng(seed)
    rows, tokens = (1, case.tokens) if case.layout == "varlen" else (case.num_seqs,
                                                                    case.seq_lens[0])
    return (rng.standard_normal((rows, tokens, case.heads, 128)).astype(np.float32),
            rng.standard_normal((case.num_seqs, case.heads, 128, 128)).astype(np.float32))


def loss_weights(case, seed: int = 0):
    """loss_weight_arrays as jax arrays."""
    import jax.numpy as jnp

    return tuple(jnp.asarray(w) for w in loss_weight_arrays(case, seed))


def kda_prefill_loss(numerics, weights, options, x):
    """The loss through kda_prefill (backend "auto": the kernels where they run, else the
    reference); x: the INPUTS as a dict, options: kda_prefill's keyword options."""
    import jax.numpy as jnp

    from .. import kda_prefill

    out, state = kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                             initial_state=x["state"], output_final_state=True, numerics=numerics,
                             **options)
    return jnp.sum(out.astype(jnp.float32) * weights[0]) + jnp.sum(state * weights[1])


def jla_loss(kda, weights, options, x):
    """The loss through jla's kda: its gate, beta and state converted from jax_kda's inputs
    (jla_compare.to_jla) inside the differentiated function, its final state [B, H, K, V]
    transposed back to jax_kda's [N, H, V, K]."""
    import jax.numpy as jnp

    q, k, v, g, beta, state = to_jla(*(x[name] for name in INPUTS),
                                     lower_bound=options["lower_bound"])
    out, final = kda(q, k, v, g, beta, scale=options["scale"], initial_state=state,
                     output_final_state=True, use_qk_l2norm=True)
    return (jnp.sum(out.astype(jnp.float32) * weights[0])
            + jnp.sum(jnp.swapaxes(final, -1, -2) * weights[1]))


def feedback(args, outs):
    """A_log of the next call depends on this call's results (0 * one element)."""
    import jax
    import jax.numpy as jnp

    (x,) = args
    leaf = jax.tree_util.tree_leaves(outs)[-1]
    return (dict(x, A_log=x["A_log"] + 0.0 * leaf.reshape(-1)[0].astype(jnp.float32)),)


def _inputs(x: dict) -> dict:
    """The differentiated inputs from a case's jax inputs, the initial state in f32."""
    import jax.numpy as jnp

    return {name: x[name].astype(jnp.float32) if name == "state" else x[name]
            for name in INPUTS}


def build(variant: Variant, case, x: dict, *, inverse: str):
    """(fn, args, feedback, info) as jax_variants.build, for the kinds "train" and "backward"."""
    import jax

    why_not = unavailable_reason(variant, inverse)
    if why_not:
        raise VariantUnavailable(why_not)
    options = prefill_options(case, inverse) | sequence_kwargs(case, x)
    loss = functools.partial(kda_prefill_loss, variant.numerics, loss_weights(case), options)
    step = jax.value_and_grad(loss) if variant.kind == "train" else jax.grad(loss)
    return step, (_inputs(x),), feedback, {}


def build_jla(case, x: dict, kda):
    """(fn, args, feedback, info) of jla's forward + backward ("jla-train") with jla's `kda`."""
    import jax

    options = prefill_options(case, "stable")  # scale and lower_bound; jla has no inverse option
    step = jax.value_and_grad(functools.partial(jla_loss, kda, loss_weights(case), options))
    notes = {"inputs": "jla's gate and beta sigmoid computed from g, A_log, dt_bias and the beta "
             "logit inside the differentiated function"}
    return step, (_inputs(x),), feedback, {"notes": notes}
