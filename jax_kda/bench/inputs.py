"""Realistic random inputs for one case, generated once in numpy and shared by every variant."""

from __future__ import annotations

import numpy as np

from .cases import STATE_DTYPES, Case, DecodeCase

HEAD_DIM = 128


def _l2_normalised(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(case: Case | DecodeCase, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 arrays in the kda_prefill layout of the case (never zeros: timings must not hit
    fast paths for zero data). q/k are L2-normalised as a model's would be; A_log and dt_bias are
    in [0, 1) like FlashKDA's own benchmark, so the gates decay at realistic rates.

    A decode case gets make_decode_inputs' arrays instead."""
    if case.kind == "decode":
        return make_decode_inputs(case, seed)
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


def make_decode_inputs(case: DecodeCase, seed: int = 0) -> dict[str, np.ndarray]:
    """The arrays of one decode step in kda_decode's layout, drawn as make_inputs draws them:
    q/k/v/g [N, t, H, 128], beta [N, t, H], A_log, dt_bias, a pool [P, H, 128, 128] (float32
    here; to_jax gives it the case's state dtype) and state_indices int32 [N]: N distinct rows
    of the pool in random order (a permutation of the pool when P = N), as a serving engine's
    slots are."""
    rng = np.random.default_rng(seed)
    N, t, H, D = case.num_seqs, case.tokens_per_seq, case.heads, HEAD_DIM
    lead = (N, t)
    return {
        "q": _l2_normalised(rng.standard_normal(lead + (H, D), dtype=np.float32)),
        "k": _l2_normalised(rng.standard_normal(lead + (H, D), dtype=np.float32)),
        "v": rng.standard_normal(lead + (H, D), dtype=np.float32),
        "g": rng.standard_normal(lead + (H, D), dtype=np.float32),
        "beta": rng.standard_normal(lead + (H,), dtype=np.float32),
        "A_log": rng.uniform(0.0, 1.0, H).astype(np.float32),
        "dt_bias": rng.uniform(0.0, 1.0, (H, D)).astype(np.float32),
        "pool": 0.05 * rng.standard_normal((case.pool_rows, H, D, D), dtype=np.float32),
        "state_indices": rng.permutation(case.pool_rows)[:N].astype(np.int32),
    }


BF16_KEYS = ("q", "k", "v", "g", "beta", "state")


def to_jax(inputs: dict[str, np.ndarray], case: Case | DecodeCase | None = None) -> dict:
    """The kda_prefill / kda_decode dtypes: bf16 activations and state, f32 gate parameters, int32
    cu_seqlens and state_indices; a decode case's pool in its state dtype."""
    import jax.numpy as jnp

    pool_dtype = jnp.dtype(STATE_DTYPES[case.state_dtype]) if case is not None and \
        case.kind == "decode" else jnp.bfloat16
    dtypes = dict.fromkeys(BF16_KEYS, jnp.bfloat16) | {"pool": pool_dtype}
    return {key: jnp.asarray(value, dtypes.get(key, value.dtype)) for key, value in inputs.items()}
