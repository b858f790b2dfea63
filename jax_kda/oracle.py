"""Float64 token-by-token KDA oracle in numpy: the exact math of docs/numerics.md, no chunking, no
roundings.

Per sequence and head, for each token t:
  q, k L2-normalised (x / sqrt(|x|^2 + 1e-6), the kernels' epsilon),
  a_t = 2^gate_t, gate_t = lower_bound * log2(e) * sigmoid(exp(A_log) * (g_t + dt_bias)),
  b_t = sigmoid(beta_t),
  S_t = S_{t-1} Diag(a_t) + b_t (v_t - S_{t-1} Diag(a_t) k_t) k_t^T,   o_t = scale * S_t q_t.
The state is V-major (S[v, k]). Vectorised over sequences of equal length and heads, serial in t.
"""

from __future__ import annotations

import numpy as np

HEAD_DIM = 128


def _f64(x):
    """float64 of x: exact for float64 input (finite differences need it), else via float32
    (which holds every bf16 / f16 / f32 value exactly)."""
    x = np.asarray(x)
    if x.dtype == np.float64:
        return x.astype(np.float64)
    return x.astype(np.float32).astype(np.float64)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # stable for large |x|


def _l2_normalize(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _run(q, k, v, gate, b, state, scale):
    """Sequences stacked on axis 0: q, k, v, gate [M, T, H, D]; b [M, T, H]; state [M, H, D, D]."""
    out = np.empty(v.shape, np.float64)
    decay = np.exp2(gate)
    for t in range(q.shape[1]):
        state = state * decay[:, t, :, None, :]  # S Diag(a): scales the key columns
        kt = k[:, t]
        predicted = np.matmul(state, kt[..., None])[..., 0]
        delta = b[:, t, :, None] * (v[:, t] - predicted)
        state = state + delta[..., :, None] * kt[..., None, :]
        out[:, t] = scale * np.matmul(state, q[:, t][..., None])[..., 0]
    return out, state


def kda_prefill_oracle(q, k, v, g, beta, A_log, dt_bias, *, scale=None, lower_bound=-5.0,
                       initial_state=None, cu_seqlens=None):
    """Exact KDA prefill in float64.

    Args: as kda_prefill (any float dtypes, numpy or JAX arrays): q, k, v, g [B, T, H, 128],
      beta [B, T, H] logits, A_log [H], dt_bias [H, 128], initial_state [N, H, 128, 128] or None,
      cu_seqlens [N+1] (B == 1, monotone) or None. scale defaults to 128 ** -0.5.
    Returns:
      out float64 [B, T, H, 128] (tokens outside every sequence are 0) and final state float64
      [N, H, 128, 128].
    """
    if scale is None:
        scale = HEAD_DIM**-0.5
    q, k, v, g, beta = (_f64(x) for x in (q, k, v, g, beta))
    A_log, dt_bias = _f64(A_log), _f64(dt_bias)
    B, T, H, D = q.shape
    qn, kn = _l2_normalize(q), _l2_normalize(k)
    x = np.exp(A_log)[:, None] * (g + dt_bias)
    gate = lower_bound * np.log2(np.e) * _sigmoid(x)
    b = _sigmoid(beta)

    if cu_seqlens is None:
        state = np.zeros((B, H, D, D)) if initial_state is None else _f64(initial_state)
        return _run(qn, kn, v, gate, b, state, scale)

    if B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {B}")
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    N = cu.shape[0] - 1
    state = np.zeros((N, H, D, D)) if initial_state is None else _f64(initial_state).copy()
    out = np.zeros((1, T, H, D))
    for n in range(N):
        lo, hi = int(cu[n]), int(cu[n + 1])
        part = slice(lo, hi)
        seq_out, seq_state = _run(qn[:, part], kn[:, part], v[:, part], gate[:, part], b[:, part],
                                  state[n:n + 1], scale)
        out[:, part] = seq_out
        state[n] = seq_state[0]
    return out, state
