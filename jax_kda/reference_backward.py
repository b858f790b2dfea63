"""The backward pass of KDA prefill in pure JAX: gradients of the exact function, chunkwise, in f32.

`kda_prefill_vjp` is the vector-Jacobian product of the exact prefill (docs/numerics.md section 1:
no rounding anywhere): given the inputs and the cotangents of out and of the final state it returns
the gradients w.r.t. q, k, v, g, beta, A_log, dt_bias and the initial state. Neither numerics
mode's roundings (bf16 steps, hi/lo products) are differentiated: both modes compute the same
function up to rounding, and this is its derivative. It is the definition a GPU backward kernel
implements; the float64 autodiff of jax_kda.oracle_jax is what it is measured against
(tests/test_reference_backward.py, benchmarks/grad_accuracy.py).

Notation: per sequence and head, chunks of 16 tokens (the forward's), rows r, c = 0..15, key
channels k, value columns j; the state S is V x K (state[v, k]). Rows past a sequence's end are
zero tokens (q = k = v = 0, gate 0, b 0, cotangent 0). All arithmetic is f32; every matrix product
is an f32 dot at precision HIGHEST (no TF32); 2^x is exp2.

1. Recompute, chunk-parallel (nothing is saved by the forward):
     rho_q = 1 / sqrt(|q|^2 + 1e-6), q^ = q rho_q              (likewise k)
     x = exp(A_log) (g + dt_bias),  s = sigmoid(x),  gamma = gs s,  gs = f32(lower_bound log2 e)
     G_r = G_{r-1} + gamma_r                        (sequential over the rows, G_-1 = 0)
     e = 2^G,  er = 2^(G_15 - G),  rel = 2^(G - G_7),  irel = 2^(G_7 - G),  gt = 2^G_15
     qd = scale q^ e,  kd = k^ e,  kr = k^ er                     (the inter-chunk operands)
     qL = scale q^ rel,  kL = k^ rel,  kiL = k^ irel              (the intra-chunk operands)
     b = sigmoid(beta),  A = strict(kL kiL^T),  L = Diag(b) A,  Mqk = causal(qL kiL^T),
     W = (I + L)^-1 by forward substitution (row r = e_r - L[r, :] W).
   Why these are safe in f32: every gate lies in [lower_bound log2 e, 0], so 0 >= G_r >= 16
   lower_bound log2 e >= -115.4 at lower_bound >= -5, and 2^G_r, 2^-G_r are finite (< 2^126). The
   inter-chunk factors e, er, gt are <= 1 and underflow only where a product's contribution is below
   the f32 resolution of its result. The intra-chunk products need k^_r k^_c 2^(G_r - G_c) (r >= c,
   <= 1); as (k^_r 2^G_r)(k^_c 2^-G_c) their factors reach 2^-115 and 2^115, and a key element below
   2^-11 makes k^ 2^G subnormal, which .ftz GPU arithmetic and XLA on CPU flush to zero, losing
   terms as large as 2^-5 k^ k^. Relative to row 7 both factors stay within 2^+-58 (|G_r - G_7| <= 8
   gates). This is the fp32 forward's factorisation (docs/fp32_mode.md, "Why row 7"). The anchor
   cancels in every product, so it is a constant under differentiation.

2. Forward state recompute, serial over chunks (lax.scan with `unroll`, or chains="kernel": the GPU
   chain kernel, both chains in one launch, chains_on_kernel):
     S_0 = initial state (zeros if none);
     P = kd S_c^T,  u = Diag(b) (v - P),  U = W u,  S_{c+1} = S_c Diag(gt) + U^T kr.
   Saved: S_c, the state at every chunk's start ([N, H, C, 128, 128] f32; packed [1, H, S, ...]),
   and the residual v - P of every chunk.

3. Reverse state-gradient chain, serial over chunks from the last (lax.scan reverse with `unroll`,
   or the chain kernel, chains_on_kernel):
     dS_C = d_final_state;  per chunk, given dS_{c+1} (the gradient w.r.t. the state after it):
     dU = Mqk^T dout + kr dS_{c+1}^T,   du = W^T dU,
     dS_c = dS_{c+1} Diag(gt) + [dout; -Diag(b) du]^T [qd; kd]   (one product over 32 rows).
   Mqk^T dout is computed chunk-parallel before the chain; the chain needs no forward state.
   Saved: dS_{c+1} and du for every chunk; d_initial_state = dS_0.

4. Chunk-parallel gradients (every chunk at once, from S_c, v - P, dS_{c+1}, du):
     u, U from v - P as in 2;
     dp = Diag(b) du,  dv = dp,  [dqd; dkd] = [dout; -dp] S_c,  dkr = U dS_{c+1},
     dgt[k] = sum_j S_c[j, k] dS_{c+1}[j, k],
     dL = -strict(du U^T),  dA = Diag(b) dL,  dMqk = causal(dout U^T),
     db_r = sum_j du[r, j] (v - P)[r, j] + sum_c dL[r, c] A[r, c],
     dqL = dMqk kiL,  dkL = dA kiL,  dkiL = dA^T kL + dMqk^T qL,
     dq^ = scale (e dqd + rel dqL),  dk^ = e dkd + er dkr + rel dkL + irel dkiL,
     dG = ln2 (qd dqd + kd dkd - kr dkr + qL dqL + kL dkL - kiL dkiL)   (added left to right),
     dG_15 += ln2 (gt dgt + sum_r kr_r dkr_r),
     dgamma_r = sum_{i >= r} dG_i   (sequential from row 15 down).
   These are the derivatives of the chunk form (docs/numerics.md section 1)
     out = qd S_c^T + Mqk U,  S_{c+1} = S_c Diag(gt) + U^T kr,
     U = (I + L)^-1 Diag(b) (v - kd S_c^T),
   with d(X^-1) = -X^-1 dX X^-1 (so dL = -W^T dU u^T W^T = -du U^T) and d 2^y / dy = ln2 2^y.

5. Token-parallel:
     dx = dgamma gs s sigmoid(-x),   dg = dx exp(A_log),   dbeta = db sigmoid(beta) sigmoid(-beta),
     dq = rho_q (dq^ - q^ (q^ . dq^))   (likewise dk),
     ddt_bias[h, k] = sum over tokens of dg,   dA_log[h] = sum over k and tokens of dx x.
   sigmoid'(x) is the product of two sigmoid values, finite for every x: where a channel never
   forgets (x ~ -500, s = 0 in f32) it is 0, where differentiating 1 / (1 + e^-x) would give
   0 * inf.

Reduction order (every run gives the same bits): sums that are not matrix products are pairwise
trees (`tree_sum`: the axis zero-padded to a power of two n, then a[i] + a[i + n/2] until one is
left); over tokens: the 16 rows of a chunk, then the chunks of a sequence, then the sequences
(packed: the 16 rows of a slot, then the slots); dA_log then over the 128 channels. The running
sums (G, dgamma) are sequential over rows. Inside a matrix product (over V, K, 16 or 32 rows) the
order is XLA's, fixed for a compiled program; a kernel fixes its own (k-blocks ascending).

Packed sequences (B = 1, cu_seqlens [N+1]) lie on the chunk slots of the kernels' workspace
(jax_kda.contract.workspace_slots), as one row: S = ceil(T / 16) + N slots, chunk c of sequence n in
slot cu[n] // 16 + n + c, so every sequence starts a fresh slot wherever its first token lies and
sequences in order never share one. Rows past a sequence's end and the slots no chunk uses (spare)
are zero tokens. cu is clamped into [0, T] and end < start is an empty sequence, as in the forward;
an empty sequence has no slot. Per slot, computed on device from cu: its sequence and whether it
is that sequence's first or last slot. Steps 1 and 4 run over the S slots as over chunks; the
chains of 2 and 3 run over the S slots of the row and restart per sequence:
     2: at a sequence's first slot the state is its initial state (S_in = initial_state[n]);
     3: at a sequence's last slot the state gradient is its d_final_state[n], and the gradient
        leaving its first slot is d_initial_state[n]; an empty sequence's is its d_final_state.
A spare slot (gt = 1, U = 0, du = 0) passes on whatever reaches it, and the next restart drops it.
Tokens of no sequence get exact zeros. Sequences that overlap (only a malformed cu, e.g. a
sequence after an end < start pair) may share slots: a slot belongs to the highest-numbered
sequence whose first slot is at or before it; their gradients are meaningless, every index stays
in bounds.
The sums over tokens take the slots in order (rows, then slots), which for more than one sequence
is not the order of the batched layout: A_log's and dt_bias's gradients agree with the sequences'
own in the last bits only (tests/test_reference_backward.py).

Memory: S_c and dS_{c+1}, 128 KiB per head and chunk: B ceil(T / 16) chunks batched,
ceil(T / 16) + N slots packed (a kernel would save S_c every few chunks and recompute the rest).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _state_chain, head_groups
from ._ffi import ChainOperands
from ._manual_axes import vary_like
from .contract import CHUNK, HEAD_DIM, workspace_slots

_HIGHEST = lax.Precision.HIGHEST
_LN2 = np.float32(math.log(2.0))
_ANCHOR_ROW = 7  # intra-chunk products are decayed relative to this row's cumulative gate


def _dot(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def tree_sum(x, axis):
    """Sum over `axis` as a pairwise tree in a fixed order: zero-pad to a power of two n, then
    a[i] + a[i + n/2] until one element is left."""
    x = jnp.moveaxis(x, axis, 0)
    n = 1 << max(x.shape[0] - 1, 0).bit_length()
    x = jnp.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


def running_sum(x, reverse=False):
    """Running sum over the rows (axis -2) of [..., 16, 128], one row added at a time, from row 0
    (row r holds rows 0..r) or, reversed, from row 15 (row r holds rows r..15). Unrolled: one
    fused elementwise kernel, where a 16-trip loop costs a launch per trip on a GPU."""
    order = range(x.shape[-2] - 1, -1, -1) if reverse else range(x.shape[-2])
    sums, total = {}, None
    for r in order:
        total = x[..., r, :] if total is None else total + x[..., r, :]
        sums[r] = total
    return jnp.stack([sums[r] for r in range(x.shape[-2])], axis=-2)


def _strict_lower():
    r = np.arange(CHUNK)
    return r[:, None] > r[None, :]


# ----------------------------------------------------------------------------- layout


class ChunkLayout(NamedTuple):
    """Where the rows of the [N, C, 16] chunk grid come from (batched: N = B, C = ceil(T / 16);
    packed: one row of S slots, N = 1, C = S): token [N, C, 16] int32 (packed) or None (batched:
    row t of sequence n is token t of batch row n); valid [N, C, 16] bool; slots (packed only)."""

    token: jax.Array | None
    valid: jax.Array
    slots: Slots | None


class Slots(NamedTuple):
    """Per chunk slot of the packed layout [S]: the sequence whose chunk it holds (0 where none:
    an index only read under `first` / `last`), and whether it is that sequence's first / last."""

    sequence: jax.Array
    first: jax.Array
    last: jax.Array


def chunk_layout(B, T, cu_seqlens) -> ChunkLayout:
    """The chunk grid of a call's B x T tokens: batched (cu_seqlens None) or the packed row's
    slots (B = 1; the module docstring, "Packed sequences")."""
    num_chunks = -(-T // CHUNK)
    rows = jnp.arange(num_chunks * CHUNK, dtype=jnp.int32).reshape(num_chunks, CHUNK)
    if cu_seqlens is None:
        return ChunkLayout(None, jnp.broadcast_to(rows < T, (B, num_chunks, CHUNK)), None)
    if B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {B}")
    N = cu_seqlens.shape[0] - 1
    cu = jnp.clip(cu_seqlens.astype(jnp.int32), 0, T)  # as the forward: clamped, end < start empty
    starts, lengths = cu[:-1], jnp.maximum(cu[1:] - cu[:-1], 0)
    # the workspace's slots (contract.workspace_slots): chunk c of sequence n in slot
    # cu[n] // 16 + n + c, so sequences in order never share a slot
    num_slots = workspace_slots(T, N)
    first_slot = starts // CHUNK + jnp.arange(N, dtype=jnp.int32)
    # each slot's sequence: the last non-empty one starting at or before it (a running max)
    claimed = jnp.zeros(num_slots, jnp.int32).at[jnp.where(lengths > 0, first_slot, num_slots)].max(
        jnp.arange(1, N + 1, dtype=jnp.int32), mode="drop")
    owner = lax.cummax(claimed) - 1  # -1: before every sequence
    sequence = jnp.maximum(owner, 0)
    chunk = jnp.arange(num_slots, dtype=jnp.int32) - first_slot[sequence]
    num_seq_chunks = -(-lengths[sequence] // CHUNK)
    used = (owner >= 0) & (chunk < num_seq_chunks)
    row = chunk[:, None] * CHUNK + jnp.arange(CHUNK, dtype=jnp.int32)
    valid = used[:, None] & (row < lengths[sequence][:, None])
    token = jnp.where(valid, starts[sequence][:, None] + row, 0)
    slots = Slots(sequence, used & (chunk == 0), used & (chunk == num_seq_chunks - 1))
    return ChunkLayout(token[None], valid[None], slots)


def to_chunks(x, layout: ChunkLayout):
    """[B, T, H, ...] -> f32 [N, H, C, 16, ...], rows outside the sequence 0."""
    N, num_chunks = layout.valid.shape[:2]
    if layout.token is None:
        pad = num_chunks * CHUNK - x.shape[1]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((N, num_chunks, CHUNK) + x.shape[2:])
    else:
        x = x[0][layout.token]
    mask = layout.valid.reshape(layout.valid.shape + (1,) * (x.ndim - 3))
    return jnp.moveaxis(jnp.where(mask, x.astype(jnp.float32), 0.0), 3, 1)


def _from_chunks(x, layout: ChunkLayout, T):
    """[N, H, C, 16, ...] -> [B, T, H, ...]: rows outside the sequence dropped, tokens of no
    sequence 0."""
    x = jnp.moveaxis(x, 1, 3)  # [N, C, 16, H, ...]
    N, num_chunks = x.shape[:2]
    if layout.token is None:
        return x.reshape((N, num_chunks * CHUNK) + x.shape[3:])[:, :T]
    target = jnp.where(layout.valid, layout.token, T)  # T is out of range: dropped
    return jnp.zeros((T,) + x.shape[3:], x.dtype).at[target].set(x, mode="drop")[None]


# ----------------------------------------------------------------------------- 1. recompute


class ChunkFactors(NamedTuple):
    """Step 1's recomputed quantities; leading axes [N, H, C]; f32."""

    qn: jax.Array  # [..., 16, 128] q^
    kn: jax.Array  # [..., 16, 128] k^
    q_rho: jax.Array  # [..., 16]   1 / sqrt(|q|^2 + 1e-6)
    k_rho: jax.Array  # [..., 16]
    x: jax.Array  # [..., 16, 128] exp(A_log) (g + dt_bias)
    b: jax.Array  # [..., 16]   sigmoid(beta), 0 on zero rows
    e: jax.Array  # [..., 16, 128] 2^G
    er: jax.Array  # [..., 16, 128] 2^(G_15 - G)
    rel: jax.Array  # [..., 16, 128] 2^(G - G_7)
    irel: jax.Array  # [..., 16, 128] 2^(G_7 - G)
    gt: jax.Array  # [..., 128]  2^G_15
    qd: jax.Array  # [..., 16, 128] scale q^ e
    kd: jax.Array  # [..., 16, 128] k^ e
    kr: jax.Array  # [..., 16, 128] k^ er
    qL: jax.Array  # [..., 16, 128] scale q^ rel
    kL: jax.Array  # [..., 16, 128] k^ rel
    kiL: jax.Array  # [..., 16, 128] k^ irel
    A: jax.Array  # [..., 16, 16] strict(kL kiL^T)
    W: jax.Array  # [..., 16, 16] (I + Diag(b) A)^-1
    mqk: jax.Array  # [..., 16, 16] causal(qL kiL^T)


def _l2_normalize(x):
    rho = lax.rsqrt(tree_sum(x * x, -1) + np.float32(1e-6))
    return x * rho[..., None], rho


def _gate_scale(lower_bound):
    return np.float32(np.float64(lower_bound) * math.log2(math.e))


def forward_substitution(L):
    """(I + L)^-1 for strictly lower-triangular L [..., 16, 16] by forward substitution."""

    # rows as vectors, unrolled: elementwise work XLA fuses (a 16-trip loop of products would
    # cost a launch per trip on a GPU); W[r] = e_r - sum_{c < r} L[r, c] W[c], c ascending
    rows = []
    for r in range(CHUNK):
        row = jnp.broadcast_to((np.arange(CHUNK) == r).astype(np.float32), L.shape[:-1])
        for c in range(r):
            row = row - L[..., r, c, None] * rows[c]
        rows.append(row)
    return jnp.stack(rows, axis=-2)


def chunk_factors(q, k, g, beta, A_log, dt_bias, valid, *, scale, lower_bound) -> ChunkFactors:
    """Step 1 on chunked f32 inputs [N, H, C, 16, ...] (zero rows 0); A_log [H],
    dt_bias [H, 128]."""
    qn, q_rho = _l2_normalize(q)
    kn, k_rho = _l2_normalize(k)
    x = jnp.exp(A_log)[:, None, None, None] * (g + dt_bias[:, None, None, :])
    gate = jnp.where(valid[..., None], _gate_scale(lower_bound) * jax.nn.sigmoid(x), 0.0)
    G = running_sum(gate)
    G_last = G[..., -1:, :]
    anchor = lax.stop_gradient(G[..., _ANCHOR_ROW:_ANCHOR_ROW + 1, :])
    e, er = jnp.exp2(G), jnp.exp2(G_last - G)
    rel, irel = jnp.exp2(G - anchor), jnp.exp2(anchor - G)
    scale = np.float32(scale)
    qL, kL, kiL = scale * qn * rel, kn * rel, kn * irel
    b = jnp.where(valid, jax.nn.sigmoid(beta), 0.0)
    strict = _strict_lower()
    A = jnp.where(strict, _dot("...rk,...ck->...rc", kL, kiL), 0.0)
    mqk = jnp.where(~strict.T, _dot("...rk,...ck->...rc", qL, kiL), 0.0)
    return ChunkFactors(
        qn=qn, kn=kn, q_rho=q_rho, k_rho=k_rho, x=x, b=b, e=e, er=er, rel=rel, irel=irel,
        gt=e[..., -1, :], qd=scale * qn * e, kd=kn * e, kr=kn * er, qL=qL, kL=kL, kiL=kiL,
        A=A, W=forward_substitution(b[..., :, None] * A), mqk=mqk)


def chunked_factors(layout: ChunkLayout, q, k, g, beta, A_log, dt_bias, *, scale,
                    lower_bound) -> ChunkFactors:
    """Step 1 on the call's inputs ([B, T, H, ...]; A_log, dt_bias f32): chunked on `layout`
    (chunk_layout), then chunk_factors."""
    chunked = lambda x: to_chunks(x, layout)
    qc = chunked(q)
    return chunk_factors(qc, chunked(k), chunked(g), chunked(beta), A_log, dt_bias,
                         jnp.broadcast_to(layout.valid[:, None], qc.shape[:-1]),
                         scale=scale, lower_bound=lower_bound)


# ------------------------------------------------------------------------- 2. and 3.: the chains


def _chunks_first(x):
    return jnp.moveaxis(x, 2, 0)


def _chunks_back(x):
    return jnp.moveaxis(x, 0, 2)


def delta_update(f: ChunkFactors, v, state):
    """(v - P, U) of step 2 for states [..., 128 (v), 128 (k)] at the chunks' start."""
    residual = v - _dot("...rk,...vk->...rv", f.kd, state)
    return residual, _update_of(f, residual)


def _update_of(f: ChunkFactors, residual):
    """U = W Diag(b) (v - P) of step 2, from the residual v - P."""
    return _dot("...rc,...cv->...rv", f.W, f.b[..., None] * residual)


def _sequence_row(x, slots: Slots, index):
    """Row slots.sequence[index] of a per-sequence [N, ...] array, as [1, ...]."""
    return lax.dynamic_index_in_dim(x, slots.sequence[index], 0, keepdims=True)


def forward_states(f: ChunkFactors, v, state0, unroll=1, slots: Slots | None = None):
    """Step 2: (the state at every chunk's start [N, H, C, 128, 128], the residual v - P of every
    chunk [N, H, C, 16, 128]). With slots (the packed layout, N = 1) state0 is per sequence
    [num_seqs, H, 128, 128] and a sequence's first slot starts from its row; a slot of no
    sequence (zero tokens: gt = 1, U = 0) passes the state on."""

    def step(state, x):
        fc, vc, index = x
        if slots is not None:
            state = jnp.where(slots.first[index], _sequence_row(state0, slots, index), state)
        residual, U = delta_update(fc, vc, state)
        return state * fc.gt[..., None, :] + _dot("...rv,...rk->...vk", U, fc.kr), (state,
                                                                                    residual)

    num_chunks = v.shape[2]
    xs = (ChunkFactors(*map(_chunks_first, f)), _chunks_first(v), jnp.arange(num_chunks))
    init = state0 if slots is None else vary_like(jnp.zeros_like(state0[:1]), v)
    _, (states, residual) = lax.scan(step, init, xs, unroll=unroll)
    return _chunks_back(states), _chunks_back(residual)


def reverse_state_gradients(f: ChunkFactors, d_out, d_final_state, unroll=1,
                            slots: Slots | None = None):
    """Step 3 -> (dS after every chunk [N, H, C, 128, 128], du [N, H, C, 16, 128], dS_0). With
    slots (packed, N = 1) d_final_state is per sequence [num_seqs, H, 128, 128]: a sequence's
    last slot starts from its row, and dS_0[n] is the gradient leaving sequence n's first slot
    (an empty sequence has none: its d_final_state row)."""
    dU_out = _dot("...rc,...rv->...cv", f.mqk, d_out)  # Mqk^T dout, chunk-parallel

    def step(carry, x):
        dS, d_initial = carry
        kr, W, gt, b, qd, kd, dU_out, d_out, index = x
        if slots is not None:
            dS = jnp.where(slots.last[index], _sequence_row(d_final_state, slots, index), dS)
        du = _value_gradient(W, kr, dU_out, dS)
        dS_start = _state_gradient_step(dS, gt, d_out, b, du, qd, kd)
        if slots is not None:  # row sequence[index] rewritten with itself unless a first slot
            keep = _sequence_row(d_initial, slots, index)
            d_initial = lax.dynamic_update_index_in_dim(
                d_initial, jnp.where(slots.first[index], dS_start, keep), slots.sequence[index], 0)
        return (dS_start, d_initial), (dS, du)

    num_chunks = d_out.shape[2]
    xs = tuple(map(_chunks_first, (f.kr, f.W, f.gt, f.b, f.qd, f.kd, dU_out, d_out)))
    if slots is None:
        init = (d_final_state, None)
    else:
        init = (vary_like(jnp.zeros_like(d_final_state[:1]), d_out),
                vary_like(d_final_state, d_out))
    (dS0, d_initial), (dS_after, du) = lax.scan(
        step, init, xs + (jnp.arange(num_chunks),), reverse=True, unroll=unroll)
    return _chunks_back(dS_after), _chunks_back(du), dS0 if slots is None else d_initial


def _value_gradient(W, kr, dU_out, dS_after):
    """du = W^T dU, dU = Mqk^T dout + kr dS_{c+1}^T (step 3; dU_out = Mqk^T dout)."""
    return _dot("...cr,...cv->...rv", W, dU_out + _dot("...rk,...vk->...rv", kr, dS_after))


def _state_gradient_step(dS_after, gt, d_out, b, du, qd, kd):
    """dS_c = dS_{c+1} Diag(gt) + [dout; -Diag(b) du]^T [qd; kd] (step 3's update)."""
    rows = jnp.concatenate([d_out, -(b[..., None] * du)], axis=-2)
    return dS_after * gt[..., None, :] + _dot(
        "...rv,...rk->...vk", rows, jnp.concatenate([qd, kd], axis=-2))


# ---------------------------------------------- 2. and 3. on the GPU: jax_kda/kernels/state_chain


def _chain_resets(N, C, marks=None, sequence=None, *, last=False):
    """reset [N, C] of the chain kernel: row 0 of init at each row's first chunk (batched: marks
    None; its last chunk with last=True, where the reverse chain starts), or sequence[c]'s row
    where marks[c] (the packed row's slots)."""
    if marks is None:
        start = C - 1 if last else 0
        return jnp.where(jnp.arange(C) == start, 0, -1).astype(jnp.int32)[None].repeat(N, 0)
    return jnp.where(marks, sequence, -1).astype(jnp.int32)[None]


def _per_row_init(x, slots: Slots | None):
    """Initial states [N, Ni, H, 128, 128] of the chain kernel: x [N, H, ...] one per batch row,
    or x [num_seqs, H, ...] for the packed row."""
    return x[:, None] if slots is None else x[None]


def chain_operands(f: ChunkFactors, v, d_out, state0, d_final_state,
                   slots: Slots | None = None) -> tuple[ChainOperands, ChainOperands]:
    """The chain kernel's operands of steps 2 and 3 (forward chain, reverse chain), the products
    associated this way round. The forward chain: with U = W Diag(b) (v - kd S^T),
    U^T kr = (v - kd S^T)^T Diag(b) W^T kr, so A = kd, Y = v, B = Diag(b) W^T kr, and Z is the
    residual. The reverse chain: with du = W^T (Mqk^T dout + kr dS^T) and
    -Diag(b) du^T kd = (-du)^T Diag(b) kd, A = W^T kr, Y = [-W^T Mqk^T dout; dout],
    B = [Diag(b) kd; qd], and Z[:16] is -du."""
    N, _, C = v.shape[:3]
    Wt_kr = _dot("...rc,...rk->...ck", f.W, f.kr)  # W^T kr
    dU_out = _dot("...rc,...rv->...cv", f.mqk, d_out)  # Mqk^T dout
    if slots is None:
        resets = _chain_resets(N, C), _chain_resets(N, C, last=True)
    else:
        resets = (_chain_resets(N, C, slots.first, slots.sequence),
                  _chain_resets(N, C, slots.last, slots.sequence))
    forward = ChainOperands(resets[0], _per_row_init(state0, slots), f.kd,
                            f.b[..., None] * Wt_kr, v)
    reverse = ChainOperands(
        resets[1], _per_row_init(d_final_state, slots), Wt_kr,
        jnp.concatenate([f.b[..., None] * f.kd, f.qd], axis=-2),
        jnp.concatenate([-_dot("...rc,...rv->...cv", f.W, dU_out), d_out], axis=-2))
    return forward, reverse


def chains_on_kernel(f: ChunkFactors, v, d_out, state0, d_final_state,
                     slots: Slots | None = None):
    """Steps 2 and 3 by the chain kernel on chain_operands, both chains in one launch: (states,
    residual, dS after each chunk, du, dS_0) as forward_states and reverse_state_gradients give
    them, in f32 with the products associated as chain_operands says. Then the gradient leaving
    each sequence's first chunk (one more step there)."""
    forward, reverse = chain_operands(f, v, d_out, state0, d_final_state, slots)
    (states, residual), (dS_after, minus_du) = _state_chain.state_chains(f.gt, forward, reverse)
    du = -minus_du
    if slots is None:
        return states, residual, dS_after, du, _state_gradient_leaving(f, d_out, dS_after, du, 0)
    num_seqs = d_final_state.shape[0]
    num_slots = slots.first.shape[0]
    # each sequence's first slot (num_slots for an empty sequence: it has none)
    first_slot = jnp.full(num_seqs, num_slots, jnp.int32).at[
        jnp.where(slots.first, slots.sequence, num_seqs)].set(
        jnp.arange(num_slots, dtype=jnp.int32), mode="drop")
    leaving = _state_gradient_leaving(f, d_out, dS_after, du,
                                      jnp.minimum(first_slot, num_slots - 1))
    has_slot = (first_slot < num_slots)[:, None, None, None]
    return (states, residual, dS_after, du,
            jnp.where(has_slot, jnp.moveaxis(leaving[0], 1, 0), d_final_state))


def _state_gradient_leaving(f: ChunkFactors, d_out, dS_after, du, chunk):
    """_state_gradient_step at chunk(s) `chunk`: [N, H, 128, 128] for an int,
    [N, H, len(chunk), 128, 128] for an array."""
    take = lambda x: jnp.take(x, chunk, axis=2)
    return _state_gradient_step(*map(take, (dS_after, f.gt, d_out, f.b, du, f.qd, f.kd)))


# ----------------------------------------------------------------------------- 4. chunk-parallel


class ChunkGradients(NamedTuple):
    """Step 4's results; leading axes [N, H, C]."""

    dqn: jax.Array  # [..., 16, 128] d q^
    dkn: jax.Array  # [..., 16, 128] d k^
    dv: jax.Array  # [..., 16, 128]
    dgamma: jax.Array  # [..., 16, 128] d gate (log2 units)
    db: jax.Array  # [..., 16]     d sigmoid(beta)


def chunk_gradients(f: ChunkFactors, d_out, states, residual, dS_after, du, *,
                    scale) -> ChunkGradients:
    """Step 4, all chunks at once (residual: v - P of step 2)."""
    U = _update_of(f, residual)
    dp = f.b[..., None] * du
    # [dqd; dkd] = [dout; -dp] S_c: one product, so each saved state is read once (and no other
    # product shares an operand with it: XLA's GPU dot merger would otherwise concatenate the
    # saved states with U^T to merge dout S_c with dout U^T)
    dqd_dkd = _dot("...rv,...vk->...rk", jnp.concatenate([d_out, -dp], axis=-2), states)
    dqd, dkd = dqd_dkd[..., :CHUNK, :], dqd_dkd[..., CHUNK:, :]
    dkr = _dot("...rv,...vk->...rk", U, dS_after)
    dgt = _dot("...vk,...vk->...k", states, dS_after)
    strict = _strict_lower()
    dL = jnp.where(strict, -_dot("...rv,...cv->...rc", du, U), 0.0)
    dA = f.b[..., None] * dL
    dmqk = jnp.where(~strict.T, _dot("...rv,...cv->...rc", d_out, U), 0.0)
    db = tree_sum(du * residual, -1) + tree_sum(dL * f.A, -1)
    dqL = _dot("...rc,...ck->...rk", dmqk, f.kiL)
    dkL = _dot("...rc,...ck->...rk", dA, f.kiL)
    dkiL = _dot("...rc,...rk->...ck", dA, f.kL) + _dot("...rc,...rk->...ck", dmqk, f.qL)
    dqn = np.float32(scale) * (f.e * dqd + f.rel * dqL)
    dkn = f.e * dkd + f.er * dkr + f.rel * dkL + f.irel * dkiL
    dG = (f.qd * dqd + f.kd * dkd - f.kr * dkr + f.qL * dqL + f.kL * dkL - f.kiL * dkiL) * _LN2
    last = (f.gt * dgt + tree_sum(f.kr * dkr, -2)) * _LN2
    dG = dG.at[..., -1, :].add(last)
    return ChunkGradients(dqn=dqn, dkn=dkn, dv=dp, dgamma=running_sum(dG, reverse=True), db=db)


# ----------------------------------------------------------------------------- 5. token-parallel


def _l2_normalize_vjp(xn, rho, dxn):
    """d x for x^ = x rho, rho = (|x|^2 + eps)^-1/2: rho (dx^ - x^ (x^ . dx^))."""
    return rho[..., None] * (dxn - xn * tree_sum(xn * dxn, -1)[..., None])


def _sigmoid_derivative(x):
    """sigmoid'(x) = sigmoid(x) sigmoid(-x): two values, finite for every x."""
    return jax.nn.sigmoid(x) * jax.nn.sigmoid(-x)


def _sum_row_tokens(x):
    """[N, H, C, 16, ...] -> [N, H, ...]: over the rows of a chunk, then the chunks (the tokens of
    one batch row; packed, N = 1: every token)."""
    return tree_sum(tree_sum(x, 3), 2)


def head_parameter_gradients(dA_log_rows, ddt_bias_rows):
    """(dA_log [H], ddt_bias [H, 128]) from their sums over each batch row's tokens ([B, H, 128]
    each, kda_prefill_vjp_f32(per_batch_row=True)): over the rows, then dA_log over the 128
    channels. Bitwise the gradients without per_batch_row, whichever devices held the rows."""
    return tree_sum(tree_sum(dA_log_rows, 0), -1), tree_sum(ddt_bias_rows, 0)


class Gradients(NamedTuple):
    """kda_prefill_vjp's result, in the primal inputs' shapes."""

    dq: jax.Array
    dk: jax.Array
    dv: jax.Array
    dg: jax.Array
    dbeta: jax.Array
    dA_log: jax.Array
    ddt_bias: jax.Array
    dinitial_state: jax.Array | None


def _chains(chains: str, unroll: int):
    """Steps 2 and 3 by `chains` (CHAINS): (states, residual, dS after each chunk, du, dS_0)."""
    def scan(f, v, d_out, state0, dS_final, slots):
        states, residual = forward_states(f, v, state0, unroll, slots)
        return (states, residual) + reverse_state_gradients(f, d_out, dS_final, unroll, slots)

    if chains == "auto":
        return lambda *args: lax.platform_dependent(*args, cuda=chains_on_kernel, default=scan)
    return {"scan": scan, "kernel": chains_on_kernel}[chains]


CHAINS = ("scan", "kernel", "auto")  # XLA scans, the GPU chain kernel, the kernel on CUDA


def kda_prefill_vjp_f32(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, d_out,
                        d_final_state, *, scale=None, lower_bound=-5.0, unroll=1,
                        chains="scan", per_batch_row=False) -> Gradients:
    """kda_prefill_vjp with every gradient in f32 (before the rounding to the primals' dtypes).

    per_batch_row: dA_log and ddt_bias as their sums over each batch row's tokens, [B, H, 128]
    each (head_parameter_gradients finishes the sums): what a device holding some of the rows
    computes, every other gradient being per row already."""
    group = head_groups.group_size(q.shape[2], v.shape[2])
    if group > 1:  # grouped value heads: the gradient of the call on q, k repeated ...
        grads = kda_prefill_vjp_f32(
            *(head_groups.repeat_qk(x, group) for x in (q, k)), v, g, beta, A_log, dt_bias,
            initial_state, cu_seqlens, d_out, d_final_state, scale=scale,
            lower_bound=lower_bound, unroll=unroll, chains=chains, per_batch_row=per_batch_row)
        # ... summed over each group of G value heads, a pairwise tree in a fixed order
        return grads._replace(dq=_sum_groups(grads.dq, group), dk=_sum_groups(grads.dk, group))
    B, T, H, D = q.shape
    if D != HEAD_DIM:
        raise ValueError(f"head dim must be {HEAD_DIM}, got {D}")
    scale = HEAD_DIM**-0.5 if scale is None else float(scale)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state_shape = (N, H, HEAD_DIM, HEAD_DIM)
    if d_out is not None and d_out.shape != q.shape:
        raise ValueError(f"d_out must have out's shape {q.shape}, got {d_out.shape}")
    if d_final_state is not None and d_final_state.shape != state_shape:
        raise ValueError(f"d_final_state must have the final state's shape {state_shape}, "
                         f"got {d_final_state.shape}")
    zero_state = vary_like(jnp.zeros(state_shape, jnp.float32), v)
    state0 = zero_state if initial_state is None else initial_state.astype(jnp.float32)
    dS_final = zero_state if d_final_state is None else d_final_state.astype(jnp.float32)
    A_log, dt_bias = A_log.astype(jnp.float32), dt_bias.astype(jnp.float32)
    if T == 0:
        zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
        rows = jnp.zeros((B, H, HEAD_DIM), jnp.float32)
        head_params = (rows, rows) if per_batch_row else (zeros(A_log), zeros(dt_bias))
        return Gradients(*map(zeros, (q, k, v, g, beta)), *head_params,
                         None if initial_state is None else dS_final)

    layout = chunk_layout(B, T, cu_seqlens)
    chunked = lambda x: to_chunks(x, layout)
    vc = chunked(v)
    d_outc = jnp.zeros_like(vc) if d_out is None else chunked(d_out)
    f = chunked_factors(layout, q, k, g, beta, A_log, dt_bias, scale=scale,
                        lower_bound=lower_bound)
    states, residual, dS_after, du, dS0 = _chains(chains, unroll)(f, vc, d_outc, state0,
                                                                  dS_final, layout.slots)
    grads = chunk_gradients(f, d_outc, states, residual, dS_after, du, scale=scale)

    valid = layout.valid[:, None, :, :, None]
    dx = jnp.where(valid, grads.dgamma * _gate_scale(lower_bound) * _sigmoid_derivative(f.x), 0.0)
    rate = jnp.exp(A_log)
    dg = dx * rate[:, None, None, None]
    dbeta = jnp.where(layout.valid[:, None], grads.db, 0.0) * _sigmoid_derivative(chunked(beta))
    unchunked = lambda x: _from_chunks(x, layout, T)
    dA_log, ddt_bias = _sum_row_tokens(dx * f.x), _sum_row_tokens(dg)
    if not per_batch_row:
        dA_log, ddt_bias = head_parameter_gradients(dA_log, ddt_bias)
    return Gradients(
        dq=unchunked(_l2_normalize_vjp(f.qn, f.q_rho, grads.dqn)),
        dk=unchunked(_l2_normalize_vjp(f.kn, f.k_rho, grads.dkn)),
        dv=unchunked(grads.dv), dg=unchunked(dg), dbeta=unchunked(dbeta),
        dA_log=dA_log, ddt_bias=ddt_bias,
        dinitial_state=None if initial_state is None else dS0)


def _sum_groups(x, group: int):
    """[B, T, Hk * G, 128] -> [B, T, Hk, 128]: the sum over each query/key head's G value heads
    (tree_sum: deterministic, the same order on every backend and run)."""
    B, T, H, D = x.shape
    return tree_sum(x.reshape(B, T, H // group, group, D), 3)


def kda_prefill_vjp(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, d_out,
                    d_final_state, *, scale=None, lower_bound=-5.0, unroll=1,
                    chains="scan") -> Gradients:
    """Gradients of the exact KDA prefill (the module docstring's algorithm).

    Args:
      q, k: [B, T, Hk, 128], v, g: [B, T, H, 128] (Hk = H, or grouped value heads: value head j
        reads query/key head j // (H // Hk), and dq, dk sum the G = H // Hk value heads' parts
        in a fixed pairwise order); beta: [B, T, H] logits; A_log [H]; dt_bias [H, 128];
        initial_state: [N, H, 128, 128] or None (zeros); cu_seqlens: None or int [N+1] with B == 1
        (values may be traced; clamped into [0, T] as in the forward): kda_prefill's inputs.
      d_out: cotangent of out [B, T, H, 128], or None (zero).
      d_final_state: cotangent of the final state [N, H, 128, 128], or None (zero).
      scale (default 128 ** -0.5), lower_bound: as kda_prefill. unroll: of both chunk scans.
      chains: how steps 2 and 3 run (CHAINS): "scan" (XLA, any platform), "kernel" (the GPU
        chain kernel, jax_kda/kernels/state_chain.py), "auto" (the kernel where lowered for
        CUDA, else the scans).
    Returns:
      Gradients(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state), each in its primal's
      dtype; dinitial_state is None without an initial state. Tokens covered by no sequence get 0.
    """
    grads = kda_prefill_vjp_f32(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                d_out, d_final_state, scale=scale, lower_bound=lower_bound,
                                unroll=unroll, chains=chains)
    return in_primal_dtypes(grads, (q, k, v, g, beta, A_log, dt_bias, initial_state))


def in_primal_dtypes(grads: Gradients, primals) -> Gradients:
    """f32 gradients rounded once to the dtypes of their primals (q, k, ..., initial_state)."""
    return Gradients(*(None if d is None else d.astype(x.dtype) for d, x in zip(grads, primals)))
