"""The gate regimes and input laws the accuracy measurements use (docs/fp32_mode.md, section 4):
one definition for the tests, the accuracy benchmark and the notebooks.

Regimes (A_log, dt_bias, raw gate g):
* strong: A_log ~ U(0,1), dt_bias ~ U(0,1), g ~ 3 N(0,1) (strongly decaying gates);
* fla: A_log = log U(1,16), dt_bias ~ N(0,1), g ~ N(0,1) (fla's test protocol);
* keep32: fla, with dt_bias = -30 on 32 random key channels of 128 per head (they never forget);
* slow: g = -8, A_log = 0, dt_bias = 0 (every channel decays slowly, ~1/600 per token);
* collinear: no decay and one key per head for every token with beta logit 8 (b ~ 1): (I + L)
  near singular.
Laws of q, k, v: "normal" N(0,1) or "uniform" U(0,1) (FlashKDA's test inputs, correlated keys);
beta logits ~ N(0,1).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

D = 128
REGIMES = ("strong", "fla", "keep32", "slow", "collinear")
LAWS = ("normal", "uniform")


def gates(rng, regime: str, B: int, T: int, H: int):
    """(A_log [H], dt_bias [H, 128], raw gate g [B, T, H, 128]) as float64 numpy arrays."""
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    if regime == "strong":
        return (rng.uniform(0, 1, H), rng.uniform(0, 1, (H, D)),
                3 * rng.standard_normal((B, T, H, D)))
    if regime == "slow":
        return np.zeros(H), np.zeros((H, D)), np.full((B, T, H, D), -8.0)
    if regime == "collinear":  # sigmoid(~-20) ~ 0: no decay; make_inputs repeats one key
        return np.ones(H), np.full((H, D), -8.0), rng.standard_normal((B, T, H, D))
    a_log, dt = np.log(rng.uniform(1, 16, H)), rng.standard_normal((H, D))
    if regime == "keep32":
        for h in range(H):
            dt[h, rng.choice(D, 32, replace=False)] = -30.0
    return a_log, dt, rng.standard_normal((B, T, H, D))


def make_inputs(rng, T: int, H: int, regime: str = "fla", law: str = "normal", B: int = 1):
    """kda_prefill's arrays for one regime: bf16 q, k, v, g [B, T, H, 128], beta [B, T, H];
    f32 A_log [H], dt_bias [H, 128]."""
    if law not in LAWS:
        raise ValueError(f"law must be one of {LAWS}, got {law!r}")
    draw = rng.standard_normal if law == "normal" else rng.random
    a_log, dt, g = gates(rng, regime, B, T, H)
    k, beta = draw((B, T, H, D)), rng.standard_normal((B, T, H))
    if regime == "collinear":
        k, beta = np.broadcast_to(draw((B, 1, H, D)), k.shape), np.full(beta.shape, 8.0)
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
    return {"q": bf16(draw((B, T, H, D))), "k": bf16(k), "v": bf16(draw((B, T, H, D))),
            "g": bf16(g), "beta": bf16(beta),
            "A_log": jnp.asarray(a_log, jnp.float32), "dt_bias": jnp.asarray(dt, jnp.float32)}
