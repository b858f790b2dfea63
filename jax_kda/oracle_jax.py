"""Float64 token-by-token KDA prefill in JAX: the exact function, differentiable by autodiff.

The same math as the numpy oracle (jax_kda.oracle, docs/numerics.md section 1), written in JAX so
that `jax.vjp` gives its exact derivatives. `kda_prefill_oracle_vjp` returns the float64 gradients
of out and the final state w.r.t. q, k, v, g, beta, A_log, dt_bias and the initial state: the
definition that the chunkwise backward (jax_kda.reference_backward) is measured against.

Per sequence and head, for each token t (no chunking, no roundings):
  q, k L2-normalised (x / sqrt(|x|^2 + 1e-6)),
  gate_t = lower_bound * log2(e) * sigmoid(exp(A_log) * (g_t + dt_bias)),  a_t = 2^gate_t,
  b_t = sigmoid(beta_t),
  S_t = S_{t-1} Diag(a_t) + b_t (v_t - S_{t-1} Diag(a_t) k_t) k_t^T,   o_t = scale * S_t q_t.

Float64 comes from a scoped `jax.enable_x64(True)` inside each function; a caller that takes
`jax.vjp` of `kda_prefill_oracle_jax` itself must do so (and call the returned function) inside
that context, with float64 primals, or the cotangents come back in the primals' narrower dtypes.
`kda_prefill_oracle_vjp` does all of that.

The sigmoid is `jax.nn.sigmoid` (lax.logistic), whose derivative is s (1 - s) from the value s:
finite for every argument, so channels that never forget (exp(A_log) (g + dt_bias) ~ -500, s ~
1e-217) get finite, correct gradients. Serial in t (lax.scan over blocks of 16 tokens, each block
a scan over its tokens, rematerialised in the backward pass so that it keeps one state per block
instead of one per token); vectorised over sequences and heads. Packed sequences (cu_seqlens,
concrete values) are gathered into rows of the longest sequence's length, padded with zero tokens
(k = 0, gate 0, b 0), which leave the state unchanged.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HEAD_DIM = 128
_BLOCK = 16  # tokens per rematerialised block of the token scan
_HIGHEST = lax.Precision.HIGHEST


def _l2_normalize(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _run(q, k, v, gate, b, state, scale):
    """Token-major [T, N, H, ...] inputs (T a multiple of 16), state [N, H, V, K] -> out, state."""

    def token(state, x):
        qt, kt, vt, gt, bt = x
        state = state * jnp.exp2(gt)[..., None, :]  # S Diag(a): scales the key columns
        predicted = jnp.einsum("nhvk,nhk->nhv", state, kt, precision=_HIGHEST)
        delta = bt[..., None] * (vt - predicted)
        state = state + delta[..., :, None] * kt[..., None, :]
        return state, scale * jnp.einsum("nhvk,nhk->nhv", state, qt, precision=_HIGHEST)

    @jax.checkpoint
    def block(state, x):
        return lax.scan(token, state, x)

    blocks = jax.tree.map(lambda a: a.reshape((-1, _BLOCK) + a.shape[1:]), (q, k, v, gate, b))
    state, out = lax.scan(block, state, blocks)
    return out.reshape((-1,) + out.shape[2:]), state


def kda_prefill_oracle_jax(q, k, v, g, beta, A_log, dt_bias, *, scale=None, lower_bound=-5.0,
                           initial_state=None, cu_seqlens=None):
    """Exact KDA prefill in float64, differentiable.

    Args: as kda_prefill: q, k, v, g [B, T, H, 128], beta [B, T, H] logits, A_log [H], dt_bias
      [H, 128], initial_state [N, H, 128, 128] or None (zeros), cu_seqlens None or [N+1] concrete
      non-decreasing values with B == 1 (empty sequences allowed; tokens covered by no sequence
      get out 0). Any float dtypes; computed in float64. scale defaults to 128 ** -0.5.
    Returns:
      out float64 [B, T, H, 128] and the final state float64 [N, H, 128, 128].
    """
    if scale is None:
        scale = HEAD_DIM**-0.5
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(x).astype(jnp.float64)
        q, k, v, g, beta, A_log, dt_bias = map(f64, (q, k, v, g, beta, A_log, dt_bias))
        B, T, H, D = q.shape
        qn, kn = _l2_normalize(q), _l2_normalize(k)
        x = jnp.exp(A_log)[:, None] * (g + dt_bias)
        gate = lower_bound * math.log2(math.e) * jax.nn.sigmoid(x)
        b = jax.nn.sigmoid(beta)

        if cu_seqlens is None:
            N, length = B, T
            token = valid = None
        else:
            if B != 1:
                raise ValueError(f"cu_seqlens needs batch size 1, got {B}")
            cu = np.clip(np.asarray(cu_seqlens, np.int64), 0, T)
            starts, lengths = cu[:-1], np.maximum(cu[1:] - cu[:-1], 0)
            N, length = len(lengths), int(lengths.max(initial=0))
            offsets = np.arange(length)
            valid = offsets[None] < lengths[:, None]  # [N, length]
            token = np.where(valid, starts[:, None] + offsets[None], 0)

        state = (jnp.zeros((N, H, D, D), jnp.float64) if initial_state is None
                 else f64(initial_state))
        padded = -(-length // _BLOCK) * _BLOCK

        def token_major(x):  # [B, T, H, ...] -> [padded, N, H, ...], zero tokens appended
            if token is not None:
                mask = valid.reshape(valid.shape + (1,) * (x.ndim - 2))
                x = jnp.where(mask, x[0][token], 0.0)
            x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
            return jnp.moveaxis(x, 1, 0)

        out, state = _run(*map(token_major, (qn, kn, v, gate, b)), state, scale)
        out = jnp.moveaxis(out[:length], 0, 1)  # [N, length, H, D]
        if token is not None:
            out = jnp.zeros((T, H, D), jnp.float64).at[token[valid]].set(out[valid])[None]
        return out, state


def kda_prefill_oracle_vjp(q, k, v, g, beta, A_log, dt_bias, *, scale=None, lower_bound=-5.0,
                           initial_state=None, cu_seqlens=None, d_out=None, d_final_state=None):
    """The exact prefill and its vector-Jacobian product, all in float64.

    Args: as kda_prefill_oracle_jax, plus the cotangents d_out [B, T, H, 128] and d_final_state
      [N, H, 128, 128] (None: zero).
    Returns:
      (out, final_state, grads) as numpy float64, grads = (dq, dk, dv, dg, dbeta, dA_log, ddt_bias,
      dinitial_state) in the primals' shapes; dinitial_state is None without an initial state.
    """
    primals = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    cu = None if cu_seqlens is None else tuple(int(c) for c in np.asarray(cu_seqlens))
    with jax.enable_x64(True):
        as_f64 = lambda x: None if x is None else jnp.asarray(x).astype(jnp.float64)
        out, final, grads = _vjp(tuple(map(as_f64, primals)), as_f64(d_out), as_f64(d_final_state),
                                 scale=scale, lower_bound=lower_bound, cu_seqlens=cu)
        return np.asarray(out), np.asarray(final), tuple(
            None if x is None else np.asarray(x) for x in grads)


@functools.partial(jax.jit, static_argnames=("scale", "lower_bound", "cu_seqlens"))
def _vjp(primals, d_out, d_final_state, *, scale, lower_bound, cu_seqlens):
    def prefill(q, k, v, g, beta, A_log, dt_bias, initial_state):
        return kda_prefill_oracle_jax(
            q, k, v, g, beta, A_log, dt_bias, scale=scale, lower_bound=lower_bound,
            initial_state=initial_state,
            cu_seqlens=None if cu_seqlens is None else np.array(cu_seqlens))

    (out, final), pullback = jax.vjp(prefill, *primals)
    d_out = jnp.zeros_like(out) if d_out is None else d_out
    d_final_state = jnp.zeros_like(final) if d_final_state is None else d_final_state
    return out, final, pullback((d_out, d_final_state))
