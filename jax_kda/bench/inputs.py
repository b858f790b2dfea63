"""Realistic random inputs for one case, generated once in numpy and shared by every variant."""

from __future__ import annotations

import numpy as np

from .cases import Case

HEAD_DIM = 128


def _l2_normalised(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 arrays in the kda_prefill layout of the case (never zeros: timings must not hit
    fast paths for zero data). q/k are L2-normalised as a model's would be; A_log and dt_bias are
    in [0, 1) like FlashKDA's own benchmark, so the gates decay at realistic rates."""
    rng = np.random.default_rng(seed)
    H, D = case.heads, HEAD_DIM
    if case.layout == "batched":
        lead = (case.num_seqs, case.seq_lens[0])
    else:
        lead = (1, case.tokens)
    state_shape = (case.num_seqs, H, D, D)
    return {
        "q": _l2_normalised(rng.standard_normal(lead + (H, D), dtype=np.float32)),
        "k": _l2_normalised(rng.standard_normal(lead + (H, D), dtype=np.float32)),
        "v": rng.standard_normal(lead + (H, D), dtype=np.float32),
        "g": rng.standard_normal(lead + (H, D), dtype=np.float32),
        "beta": rng.standard_normal(lead + (H,), dtype=np.float32),
        "A_log": rng.uniform(0.0, 1.0, H).astype(np.float32),
        "dt_bias": rng.uniform(0.0, 1.0, (H, D)).astype(np.float32),
        "state": (0.05 * rng.standard_normal(state_shape, dtype=np.float32)),
        "cu_seqlens": np.asarray(case.cu_seqlens(), np.int32),
    }


BF16_KEYS = ("q", "k", "v", "g", "beta", "state")


def to_jax(inputs: dict[str, np.ndarray]) -> dict:
    """The kda_prefill dtypes: bf16 activations and state, f32 gate parameters, int32 cu_seqlens."""
    import jax.numpy as jnp

    return {
        key: jnp.asarray(value, jnp.bfloat16 if key in BF16_KEYS else value.dtype)
        for key, value in inputs.items()
    }
