"""Pure-JAX chunkwise KDA prefill that mirrors the kernels' rounding steps (docs/numerics.md).

Runs anywhere (CPU included) under jit; it is the readable definition of the numerics the CuTe DSL
kernels implement. Structure follows the two kernels:

* `prepare_reference`: the prepare step (docs/numerics.md) on 16-token chunks -> `ChunkWorkspace`
  (kd, qd, kr, gt, inv, mqk).
* `recurrence_reference`: the recurrence (docs/numerics.md), a `lax.scan` over chunks, state kept
  in bf16 between chunks.
* `kda_prefill_reference`: the whole prefill on [B, T, H, 128] inputs, batched or packed
  (cu_seqlens).

Axis convention: every chunked array has arbitrary leading axes `...` (for the prefill they are
[N, H, C]: sequence, head, chunk), then the 16 chunk rows, then the 128 features. `gt` is
[..., 128], `inv` and `mqk` are [..., 16, 16], `beta` is [..., 16].

How the GPU's approximate or fused operations are emulated (XLA offers no exact equivalent):
* ex2.approx.ftz: 2^x as exp2 of the fraction times an exact power of two, results below 2^-126 in
  magnitude flushed to 0. XLA's exp2 is within about 1 ulp of 2^x; the GPU's is within about 2 ulp,
  so single exponentials may differ in the last bit (then bf16 rounding usually hides it).
* tanh.approx / rsqrt.approx: XLA's tanh and rsqrt (last-bit differences possible, as above).
* fmaf (stable inverse, state update): emulated exactly with error-free transformations (`fma_f32`);
  inputs go through an optimization barrier so XLA cannot contract parts of it into hardware FMAs.
* XLA contracts a*b+c into an FMA on CPU. Where the contract rounds a product before adding it
  (the gate before its running sum) the product is put behind an optimization barrier, so the sum
  is unfused.
* f32-accumulating MMAs: f32 dots at precision HIGHEST (bf16 x bf16 products are exact in f32; the
  order of the f32 additions inside a dot is XLA's, not the tensor core's).
* f16-accumulating MMAs (neumann): f32 dot of the 16-wide k-block plus the f16 accumulator, then one
  rounding to f16 (K = 16, so each MMA is a single k-block).

* Subnormals: XLA on CPU flushes them; the GPU keeps them. kd and qd are carried scaled by 2^64
  inside prepare so strongly decayed rows keep their (large) contribution to Mqk and L.
* The gate sum follows the contract literally (gate rounded to f32, then added), as the kernels
  do with pinned, unfused adds.

Inverse variants: "stable" (default) is accurate on near-collinear keys. "neumann" (FlashKDA v1) is
not: with 16 identical keys, no decay and b ~ 1, the f16 terms of its series (entries of L^8 reach
~3400, where f16 spacing is 2) cancel badly. In this emulation, which rounds each f16-accumulating
MMA once, INV stays finite but is off by > 0.5 for about 60% of random keys, and the outputs are
wrong by tens of percent (test: relative RMSE ~0.44 vs the oracle over 8 heads, stable ~0.009).
FlashKDA report NaN/Inf on the GPU, whose tensor cores may also overflow f16 inside an MMA.

Gradients pass through every rounding unchanged (straight-through), so the reference is
differentiable where the kernels are not.

Rows past the end of a sequence are zero tokens (q = k = v = 0, gate = 0, beta irrelevant). A chunk
made only of such rows leaves the state unchanged, which makes padding a sequence with whole empty
chunks exact; the packed (cu_seqlens) path relies on it.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._manual_axes import vary_like
from .checkpoints import checkpoint_capacity, checkpoint_counts
from .contract import CHUNK, HEAD_DIM, INVERSE_IDS

INVERSE_VARIANTS = tuple(INVERSE_IDS)

_LOG2E = np.float32(math.log2(math.e))
_HIGHEST = lax.Precision.HIGHEST
_F32_MIN_NORMAL = np.float32(2.0**-126)


class ChunkWorkspace(NamedTuple):
    """What prepare hands to the recurrence for each (chunk, head); leading axes `...`."""

    kd: jax.Array  # bf16 [..., 16, 128]  k * 2^G_r
    qd: jax.Array  # bf16 [..., 16, 128]  q * 2^G_r * scale
    kr: jax.Array  # bf16 [..., 16, 128]  k * 2^(G_15 - G_r)
    gt: jax.Array  # f32  [..., 128]      2^G_15, the chunk's total decay
    inv: jax.Array  # bf16 [..., 16, 16]  (I + L)^-1
    mqk: jax.Array  # bf16 [..., 16, 16]  causal (diagonal included) qd . ki^T


# ----------------------------------------------------------------------------- rounding helpers


def _f32(x):
    return x.astype(jnp.float32)


# Tests switch every bf16/f16 rounding off (`_rounding_disabled`) to check the chunk algebra alone
# against the float64 oracle. Read at trace time: jit a fresh function inside the context.
_ROUNDING = True


@contextlib.contextmanager
def _rounding_disabled():
    global _ROUNDING
    _ROUNDING = False
    try:
        yield
    finally:
        _ROUNDING = True


# XLA may drop a narrowing-then-widening convert pair as "excess precision" (the GPU compiler does
# with its default xla_allow_excess_precision=true), which would silently skip the rounding. A
# value that passes an optimization barrier in its narrow dtype keeps its rounding.
def _narrow(x, dtype):
    return lax.optimization_barrier(x.astype(dtype))


def _round_bf16(x):
    """Round an f32 array to bf16 and widen it back (the value the GPU keeps after bf16(x))."""
    return _narrow(x, jnp.bfloat16).astype(jnp.float32) if _ROUNDING else x


def _store_bf16(x):
    """bf16(x) where the GPU stores bf16 (outputs, state, workspace)."""
    return _narrow(x, jnp.bfloat16) if _ROUNDING else x.astype(jnp.float32)


def _round_f16(x):
    return _narrow(x, jnp.float16).astype(jnp.float32) if _ROUNDING else x


# XLA on CPU flushes subnormal f32 results (and inputs) to zero; the GPU's mul.f32, bf16 conversions
# and tensor cores keep them. kd and qd of strongly decayed rows (2^G_r near 2^-116, times a small
# q or k element and the scale) are bf16 subnormals whose products with ki (up to 2^116) matter, so
# prepare carries kd and qd multiplied by 2^64, where they are normal f32 numbers.
_SUB_SCALE_LOG2 = 64
_SUB_SCALE = np.float32(2.0**_SUB_SCALE_LOG2)
_SUB_UNSCALE = np.float32(2.0**-_SUB_SCALE_LOG2)
_BF16_MIN_NORMAL_SCALED = np.float32(2.0 ** (-126 + _SUB_SCALE_LOG2))
_BF16_SUB_ULP_LOG2_SCALED = -133 + _SUB_SCALE_LOG2  # bf16 subnormals are multiples of 2^-133


def _round_bf16_scaled(x_s):
    """bf16(x) for x = x_s * 2^-64, given and returned scaled by 2^64, subnormal grid included."""
    if not _ROUNDING:
        return x_s
    magic = np.float32(1.5 * 2.0 ** (_BF16_SUB_ULP_LOG2_SCALED + 23))
    on_grid = lax.optimization_barrier(x_s + magic) - magic  # RNE to a multiple of 2^-133 (scaled)
    on_grid = jnp.copysign(on_grid, x_s)  # a tiny negative value rounds to -0
    return jnp.where(jnp.abs(x_s) < _BF16_MIN_NORMAL_SCALED, on_grid, _round_bf16(x_s))


def _unscale_to_bf16(x_s):
    """The bf16 array holding x_s * 2^-64 (x_s already bf16-rounded), subnormals written bit by
    bit."""
    if not _ROUNDING:
        return x_s * _SUB_UNSCALE
    normal = (x_s * _SUB_UNSCALE).astype(jnp.bfloat16)
    steps = jnp.round(jnp.abs(x_s) * np.float32(2.0**-_BF16_SUB_ULP_LOG2_SCALED)).astype(jnp.uint32)
    sign = jnp.where(jnp.signbit(x_s), np.uint32(0x8000), np.uint32(0))
    subnormal = lax.bitcast_convert_type((sign | steps).astype(jnp.uint16), jnp.bfloat16)
    return jnp.where(jnp.abs(x_s) < _BF16_MIN_NORMAL_SCALED, subnormal, normal)


def _dot(spec, a, b):
    """f32-accumulating matrix product (inputs widened to f32 first: exact for bf16/f16)."""
    return jnp.einsum(spec, _f32(a), _f32(b), precision=_HIGHEST,
                      preferred_element_type=jnp.float32)


def _pow2_int(n):
    """2^n as f32 for integer-valued f32 n in [-126, 127], built from bits (exact)."""
    n = jnp.clip(n, -126, 127).astype(jnp.int32)
    return lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def ex2_ftz(x):
    """ex2.approx.ftz.f32: 2^x in f32, results below 2^-126 in magnitude flushed to zero."""
    x = _f32(x)
    x = jnp.clip(x, -300.0, 300.0)
    n = jnp.round(x)
    r = jnp.exp2(x - n)  # x - n is exact, in [-0.5, 0.5]
    half = jnp.floor(n * 0.5)
    y = r * _pow2_int(half) * _pow2_int(n - half)  # two factors: n may exceed one exponent's range
    return jnp.where(jnp.abs(y) < _F32_MIN_NORMAL, jnp.zeros_like(y), y)


def sigmoid_tanh(x):
    """The GPU sigmoid: 0.5 * tanh.approx(0.5 x) + 0.5 in f32."""
    x = _f32(x)
    return 0.5 * jnp.tanh(0.5 * x) + 0.5


def _two_sum(a, b):
    """s = RN(a + b) and the exact error e with s + e = a + b (Knuth)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def _split_hi_lo(x):
    """x = hi + lo exactly, each with at most 12 significant bits (a product of two is exact in
    f32)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    hi = lax.bitcast_convert_type(bits & np.uint32(0xFFFFF000), jnp.float32)
    return hi, x - hi


def _add_round_to_odd(a, b):
    """a + b rounded to odd: exact if representable, else the neighbour with an odd last bit."""
    z, e = _two_sum(a, b)
    bits = lax.bitcast_convert_type(z, jnp.int32)
    step = jnp.where((e > 0) == (z > 0), 1, -1).astype(jnp.int32)
    needs = (e != 0) & ((bits & 1) == 0)
    return jnp.where(needs, lax.bitcast_convert_type(bits + step, jnp.float32), z)


def fma_f32(a, b, c):
    """fmaf(a, b, c): a * b + c with one rounding, emulated exactly in f32 arithmetic.

    Dekker's product gives p = RN(a * b) and its exact error e from partial products of 12-bit
    halves (each exact in f32, so an FMA contraction of them by the compiler changes nothing); the
    three-term sum c + p + e is then rounded correctly with Boldo and Melquiond's rounding-to-odd
    algorithm. Exact unless partial products underflow (|a * b| below about 2^-100).
    """
    a, b, c = lax.optimization_barrier((_f32(a), _f32(b), _f32(c)))
    p = lax.optimization_barrier(a * b)  # keep RN(a * b) from being fused into the next line
    ah, al = _split_hi_lo(a)
    bh, bl = _split_hi_lo(b)
    e = (((ah * bh - p) + ah * bl) + al * bh) + al * bl
    th, tl = _two_sum(c, p)
    return th + _add_round_to_odd(tl, e)


# ----------------------------------------------------------------------------- kernel 1: prepare


def l2_inverse_norm(x):
    """1 / sqrt(|x|^2 + 1e-6) per row of [..., 128], f32, in prepare step 1's summation order.

    Shared with the fp32 mode (reference_fp32), which keeps x * inv in f32 instead of rounding it.
    """
    xf = _f32(x)
    sq = (xf * xf).reshape(xf.shape[:-1] + (16, 8))  # squares of bf16 values are exact in f32
    partial = sq[..., 0]
    for i in range(1, 8):  # each of the 16 lanes: sequential FMA over its 8 values
        partial = partial + sq[..., i]
    for width in (8, 4, 2, 1):  # xor butterfly: lane i adds lane i ^ width
        partial = partial[..., :width] + partial[..., width:]
    return lax.rsqrt(partial[..., 0] + np.float32(1e-6))


def l2_normalize_bf16(x):
    """Prepare step 1 (docs/numerics.md) on [..., 128]: per-row L2 normalisation, result bf16."""
    return _store_bf16(_f32(x) * l2_inverse_norm(x)[..., None])


def _strict_lower(n):
    r = np.arange(n)
    return r[:, None] > r[None, :]


def forward_substitution_inverse(lmat):
    """(I + L)^-1 in f32 for strictly lower-triangular L [..., n, n] (zero on and above the
    diagonal).

    Prepare step 6's in-place substitution (docs/numerics.md): column s ends up holding -L's
    eliminations, earlier columns get fmaf updates. The stable inverse runs it on its two 8x8
    blocks, the fp32 mode (reference_fp32) on the whole 16x16 matrix.
    """
    n = lmat.shape[-1]
    rows, cols = np.arange(n)[:, None], np.arange(n)[None, :]

    def step(s, inv):  # one rolled loop (the unrolled one takes seconds to compile at n = 16)
        below = rows > s
        r = -lax.dynamic_index_in_dim(inv, s, axis=-1, keepdims=True)  # [..., n, 1]: -inv[i][s]
        pivot = lax.dynamic_index_in_dim(inv, s, axis=-2, keepdims=True)  # [..., 1, n]: row s
        inv = jnp.where(below & (cols < s), fma_f32(r, pivot, inv), inv)
        return jnp.where(below & (cols == s), r, inv)

    inv = lax.fori_loop(0, n - 1, step, lmat)
    return inv + jnp.eye(n, dtype=jnp.float32)


def _stable_inverse(kd_s, ki, b):
    """Prepare step 6 (docs/numerics.md), "stable": blockwise f32 forward substitution + one bf16
    correction."""
    strict = _strict_lower(CHUNK)
    lmat = jnp.where(strict, _dot("...rd,...cd->...rc", kd_s, ki) * _SUB_UNSCALE, 0.0)
    lmat = lmat * b[..., :, None]

    half = CHUNK // 2
    # The two 8x8 diagonal blocks, side by side on a new axis: [..., 2, 8, 8].
    blocks = jnp.stack([lmat[..., :half, :half], lmat[..., half:, half:]], axis=-3)
    blocks_inv = _round_bf16(forward_substitution_inverse(blocks))
    a_inv, b_inv = blocks_inv[..., 0, :, :], blocks_inv[..., 1, :, :]

    # P = blockdiag(a_inv, b_inv), M = [[0, 0], [bf16(L21), 0]]: only the lower-left block of P.M
    # and of (-P.M).P is non-zero, and the zero blocks add exactly, so compute just that block.
    dc = _dot("...rc,...cd->...rd", b_inv, _round_bf16(lmat[..., half:, :half]))
    o = _dot("...rc,...cd->...rd", _round_bf16(-dc), a_inv)
    zeros = jnp.zeros_like(a_inv)
    top = jnp.concatenate([a_inv, zeros], axis=-1)
    bottom = jnp.concatenate([_round_bf16(o), b_inv], axis=-1)
    return _store_bf16(jnp.concatenate([top, bottom], axis=-2))


def _f16_mma(x, y):
    """mma.sync f16 x f16 with an f16 accumulator starting from zero (K = 16: one k-block)."""
    return _round_f16(_dot("...rc,...cd->...rd", x, y))


def _neumann_inverse(kd_s, ki, b):
    """Prepare step 6 (docs/numerics.md), "neumann" (FlashKDA v1): f16 products
    (I - L)(I + L^2)(I + L^4)(I + L^8)."""
    strict = _strict_lower(CHUNK)
    lmat = _round_f16(_dot("...rd,...cd->...rc", kd_s, ki) * _SUB_UNSCALE)
    lmat = jnp.where(strict, _round_f16(lmat * _round_f16(b)[..., :, None]), 0.0)
    inv = jnp.eye(CHUNK, dtype=jnp.float32) - lmat  # exact: diagonal of L is 0
    power = lmat
    for _ in range(3):
        power = _f16_mma(power, power)  # L^2, L^4, L^8
        # FlashKDA's order: the product INV.L^k from a zero accumulator, then a separate f16 add
        inv = _round_f16(inv + _f16_mma(inv, power))
    return _store_bf16(inv)


def gate_cumsum(g, A_log, dt_bias, lower_bound, valid, sigmoid=None):
    """Prepare step 2 (docs/numerics.md): G_r, the f32 running sum of the log2 gates,
    [..., 16, 128].

    gate = lower_bound log2(e) * sigmoid((g + dt_bias) * 2^(A_log log2 e)), 0 on invalid rows.
    Shared with the fp32 mode (reference_fp32), which passes its own sigmoid (default: the
    tanh.approx form, sigmoid_tanh).
    """
    sigmoid = sigmoid_tanh if sigmoid is None else sigmoid
    # Behind a barrier: where A_log / dt_bias are compile-time constants XLA would fold this math
    # with its constant evaluator, whose exp2 / tanh bits differ from compiled code.
    A_log, dt_bias = lax.optimization_barrier((_f32(A_log), _f32(dt_bias)))
    decay_rate = ex2_ftz(A_log * _LOG2E)[..., None, None]
    x = (_f32(g) + dt_bias[..., None, :]) * decay_rate
    # f32(f64(lower_bound) * log2(e)): the kernels form the gate scale in double precision
    gate_scale = np.float32(np.float64(np.float32(lower_bound)) * np.log2(np.e))
    gate = jnp.where(valid[..., None], gate_scale * sigmoid(x), 0.0)
    gate = lax.optimization_barrier(gate)  # the product is rounded before the running sum
    running = gate[..., 0, :]
    cumulative = [running]
    for r in range(1, CHUNK):  # sequential running sum over the rows
        running = running + gate[..., r, :]
        cumulative.append(running)
    return jnp.stack(cumulative, axis=-2)


def prepare_reference(q, k, g, beta, A_log, dt_bias, *, scale, lower_bound, inverse="stable",
                      valid=None) -> ChunkWorkspace:
    """the prepare step (docs/numerics.md) on chunked inputs.

    Args:
      q, k, g: bf16 [..., 16, 128] (g is the raw gate).
      beta: bf16 [..., 16] logits.
      A_log: f32, broadcastable to `...`. dt_bias: f32, broadcastable to [..., 128].
      scale, lower_bound: floats. inverse: "stable" or "neumann".
      valid: bool [..., 16] or None (all rows valid). Invalid rows are treated as zero tokens.
    """
    if inverse not in INVERSE_VARIANTS:
        raise ValueError(f"inverse must be one of {INVERSE_VARIANTS}, got {inverse!r}")
    if valid is None:
        valid = jnp.ones(q.shape[:-1], dtype=bool)
    rows = valid[..., None]
    qn = _f32(l2_normalize_bf16(jnp.where(rows, q, jnp.zeros((), q.dtype))))
    kn = _f32(l2_normalize_bf16(jnp.where(rows, k, jnp.zeros((), k.dtype))))

    G = gate_cumsum(g, A_log, dt_bias, lower_bound, valid)

    # Step 3: decayed keys and queries.
    e = _round_bf16(ex2_ftz(G))
    ei = _round_bf16(ex2_ftz(-G))
    gt = ex2_ftz(G[..., -1, :])
    e_s = e * _SUB_SCALE
    qd_s = _round_bf16_scaled(_round_bf16_scaled(qn * e_s) * _round_bf16(jnp.float32(scale)))
    kd_s = _round_bf16_scaled(kn * e_s)
    ki = _round_bf16(kn * ei)
    kr = _round_bf16(ki * _round_bf16(gt)[..., None, :])

    # Step 4: causal q.k^T (diagonal included).
    causal = ~_strict_lower(CHUNK).T
    mqk = _store_bf16(jnp.where(causal, _dot("...rd,...cd->...rc", qd_s, ki) * _SUB_UNSCALE, 0.0))

    # Steps 5-6.
    b = sigmoid_tanh(beta)
    inv = (_stable_inverse if inverse == "stable" else _neumann_inverse)(kd_s, ki, b)
    return ChunkWorkspace(_unscale_to_bf16(kd_s), _unscale_to_bf16(qd_s), _store_bf16(kr), gt, inv,
                          mqk)


# ----------------------------------------------------------------------------- kernel 2: recurrence


def _chunk_step(state, ws: ChunkWorkspace, v, beta):
    """the recurrence (docs/numerics.md) on one chunk. state bf16 [..., 128 (v), 128 (k)]; returns
    (state', out)."""
    s = _f32(state)
    p = _round_bf16(_dot("...rk,...vk->...rv", ws.kd, s))
    oq = _round_bf16(_dot("...rk,...vk->...rv", ws.qd, s))
    b = _round_bf16(sigmoid_tanh(beta))
    u = _round_bf16(_round_bf16(_f32(v) - p) * b[..., :, None])
    big_u = _round_bf16(_dot("...rc,...cv->...rv", ws.inv, u))
    out = _store_bf16(oq + _round_bf16(_dot("...rc,...cv->...rv", ws.mqk, big_u)))
    ku = _dot("...rk,...rv->...vk", ws.kr, big_u)
    new_state = _store_bf16(fma_f32(s, ws.gt[..., None, :], ku))
    return new_state, out


def recurrence_reference(ws: ChunkWorkspace, v, beta, initial_state, checkpoint_chunks=None):
    """the recurrence (docs/numerics.md): the chunk recurrence, serial over the chunk axis.

    Args:
      ws: ChunkWorkspace with leading axes [..., C] (C chunks, in order).
      v: bf16 [..., C, 16, 128] (zero on rows past the sequence end).
      beta: bf16 [..., C, 16] logits.
      initial_state: [..., 128, 128] V-major (state[..., v, k]); rounded to bf16 on entry.
      checkpoint_chunks: None, or n: also return the state after every n chunks.
    Returns:
      out bf16 [..., C, 16, 128] and the final state bf16 [..., 128, 128]; with checkpoint_chunks
      also the states after chunks n, 2n, ... (bf16 [..., C // n, 128, 128]).
    """
    chunks_first = ChunkWorkspace(
        kd=jnp.moveaxis(ws.kd, -3, 0), qd=jnp.moveaxis(ws.qd, -3, 0),
        kr=jnp.moveaxis(ws.kr, -3, 0), gt=jnp.moveaxis(ws.gt, -2, 0),
        inv=jnp.moveaxis(ws.inv, -3, 0), mqk=jnp.moveaxis(ws.mqk, -3, 0),
    )
    xs = (chunks_first, jnp.moveaxis(v, -3, 0), jnp.moveaxis(beta, -2, 0))

    def step(state, x):
        return _chunk_step(state, *x)

    return scan_chunks(step, _store_bf16(initial_state), xs, v.shape[-3], checkpoint_chunks)


def scan_chunks(step, state0, xs, num_chunks, checkpoint_chunks=None):
    """lax.scan of step(state, x) -> (state, out) over the chunk axis (axis 0 of every leaf of xs)
    -> (out [..., C, 16, 128], final state), and with checkpoint_chunks = n also the states after
    chunks n, 2n, ... ([..., C // n, 128, 128]); shared by both numerics modes' references."""
    if checkpoint_chunks is None:
        final_state, outs = lax.scan(step, state0, xs)
        return jnp.moveaxis(outs, 0, -3), final_state

    # Groups of n chunks, recording the state after each group, then the chunks left over.
    n = checkpoint_chunks
    groups = num_chunks // n
    head = jax.tree.map(lambda x: x[:groups * n].reshape((groups, n) + x.shape[1:]), xs)
    tail = jax.tree.map(lambda x: x[groups * n:], xs)

    def group(state, x):
        state, outs = lax.scan(step, state, x)
        return state, (outs, state)

    state, (outs, states) = lax.scan(group, state0, head)
    final_state, tail_outs = lax.scan(step, state, tail)
    outs = jnp.concatenate([outs.reshape((groups * n,) + outs.shape[2:]), tail_outs])
    return jnp.moveaxis(outs, 0, -3), final_state, jnp.moveaxis(states, 0, -3)


# ----------------------------------------------------------------------------- whole prefill


def _sequence_major(x):
    """[N, C, 16, H, ...] -> [N, H, C, 16, ...]."""
    return jnp.moveaxis(x, 3, 1)


def _prefill_chunked(q, k, v, g, beta, valid, A_log, dt_bias, state0, *, scale, lower_bound,
                     inverse, checkpoint_chunks):
    """Inputs already chunked as [N, H, C, 16, ...], invalid rows zero; returns (out, final
    state) and, with checkpoint_chunks, the states after every that many chunks."""
    ws = prepare_reference(
        q, k, g, beta, A_log[None, :, None], dt_bias[None, :, None, :],
        scale=scale, lower_bound=lower_bound, inverse=inverse, valid=valid,
    )
    return recurrence_reference(ws, v, beta, state0, checkpoint_chunks)


def pack_checkpoints(states, lengths, checkpoint_every, capacity, offsets=None):
    """states bf16 [N, H, K, 128, 128] after every checkpoint_every tokens of each sequence ->
    the packed checkpoint array [capacity, H, 128, 128] (jax_kda.checkpoints), zeros elsewhere.
    offsets: int32 [N+1] rows of each sequence's first checkpoint (default: packed in order)."""
    counts = checkpoint_counts(lengths, checkpoint_every)
    offsets = jnp.cumsum(counts) - counts if offsets is None else offsets[:-1]
    j = jnp.arange(states.shape[2])
    target = jnp.where(j[None] < counts[:, None], offsets[:, None] + j[None], capacity)  # [N, K]
    rows = jnp.moveaxis(states, 2, 1)  # [N, K, H, 128, 128]
    packed = jnp.zeros((capacity,) + rows.shape[2:], rows.dtype)
    return packed.at[target].set(rows, mode="drop")


def kda_prefill_reference(q, k, v, g, beta, A_log, dt_bias, *, scale, lower_bound,
                          initial_state=None, cu_seqlens=None, inverse="stable",
                          checkpoint_every=None, checkpoint_offsets=None,
                          checkpoint_rows=None):
    """KDA prefill, chunkwise, with the kernels' roundings.

    Args:
      q, k, v, g: bf16 [B, T, H, 128]. beta: bf16 [B, T, H] (logits).
      A_log: f32 [H]. dt_bias: f32 [H, 128]. scale, lower_bound: Python floats.
      initial_state: [N, H, 128, 128] (state[n, h, v, k]; rounded to bf16) or None (zeros).
      cu_seqlens: None (each batch row is one sequence, N = B) or int32 [N+1] with B == 1. Its
        values may be traced. They are clamped into [0, T]; end < start counts as an empty
        sequence. Cost is O(N * T): every sequence is padded to ceil(T / 16) chunks.
      inverse: "stable" or "neumann".
      checkpoint_every: None, or a multiple n of 16: also return each sequence's states after
        n, 2n, ... tokens strictly before its end, packed as jax_kda.checkpoints describes.
      checkpoint_offsets, checkpoint_rows: where the checkpoints go, when not packed in order
        into jax_kda.checkpoints' capacity (vmap folding keeps each element's rows apart).
    Returns:
      out bf16 [B, T, H, 128] (tokens covered by no sequence are 0) and final_state bf16
      [N, H, 128, 128]; with checkpoint_every also the checkpoints bf16 [capacity, H, 128, 128].
    """
    B, T, H, D = q.shape
    if D != HEAD_DIM:
        raise ValueError(f"head dim must be {HEAD_DIM}, got {D}")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        state0 = vary_like(_store_bf16(jnp.zeros((N, H, D, D))), v)
    else:
        state0 = _store_bf16(initial_state)
    if checkpoint_every is None:
        checkpoint_chunks = capacity = None
    else:
        checkpoint_chunks = checkpoint_every // CHUNK
        capacity = (checkpoint_capacity(B, T, cu_seqlens is not None, checkpoint_every)
                    if checkpoint_rows is None else checkpoint_rows)
    num_chunks = -(-T // CHUNK)
    if num_chunks == 0:
        out = jnp.zeros(q.shape, jnp.bfloat16)
        if checkpoint_every is None:
            return out, state0
        return out, state0, jnp.zeros((0, H, D, D), jnp.bfloat16)
    kwargs = {"scale": scale, "lower_bound": lower_bound, "inverse": inverse,
              "checkpoint_chunks": checkpoint_chunks}
    A_log = _f32(A_log)
    dt_bias = _f32(dt_bias)

    def run_chunks(q, k, v, g, beta, valid):
        return _prefill_chunked(q, k, v, g, beta, valid, A_log, dt_bias, state0, **kwargs)

    out, lengths, final_state, *states = chunked_prefill(run_chunks, q, k, v, g, beta, cu_seqlens)
    if checkpoint_every is None:
        return out, final_state
    return out, final_state, pack_checkpoints(states[0], lengths, checkpoint_every, capacity,
                                               checkpoint_offsets)


def chunked_prefill(run_chunks, q, k, v, g, beta, cu_seqlens):
    """Cut [B, T, H, ...] inputs (T > 0) into sequence chunks, run `run_chunks`, put its out back.

    The layout half of the prefill, shared by both numerics modes (this module and reference_fp32).
    run_chunks(q, k, v, g, beta, valid) gets [N, H, C, 16, ...] arrays whose rows past a sequence
    end are zero (valid False there) and returns (out [N, H, C, 16, 128], *rest). Without cu_seqlens
    each batch row is one sequence; with it (B == 1, values possibly traced) the values are clamped
    into [0, T], end < start counts as empty, and every sequence is padded to ceil(T / 16) chunks.
    Returns (out [B, T, H, 128] with tokens covered by no sequence 0, lengths int32 [N], *rest).
    """
    B, T, H, D = q.shape
    num_chunks = -(-T // CHUNK)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is None:
        pad = num_chunks * CHUNK - T

        def chunked(x):  # [B, T, H, ...] -> [B, H, C, 16, ...], zero rows appended
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            return _sequence_major(x.reshape((B, num_chunks, CHUNK) + x.shape[2:]))

        valid = jnp.broadcast_to((jnp.arange(num_chunks * CHUNK) < T).reshape(num_chunks, CHUNK),
                                 (B, H, num_chunks, CHUNK))
        out, *rest = run_chunks(
            chunked(q), chunked(k), chunked(v), chunked(g), chunked(beta), valid)
        out = jnp.moveaxis(out, 1, 3).reshape(B, num_chunks * CHUNK, H, D)[:, :T]
        lengths = jnp.full((B,), T, jnp.int32)
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs batch size 1, got {B}")
        cu = jnp.clip(cu_seqlens.astype(jnp.int32), 0, T)
        starts, ends = cu[:-1], cu[1:]
        lengths = jnp.maximum(ends - starts, 0)
        offsets = jnp.arange(num_chunks * CHUNK, dtype=jnp.int32).reshape(num_chunks, CHUNK)
        in_seq = offsets[None] < lengths[:, None, None]  # [N, C, 16]
        token = jnp.where(in_seq, starts[:, None, None] + offsets[None], 0)

        def gathered(x):  # [1, T, H, ...] -> [N, H, C, 16, ...], rows outside the sequence zero
            rows = x[0][token]
            mask = in_seq.reshape(in_seq.shape + (1,) * (rows.ndim - 3))
            return _sequence_major(jnp.where(mask, rows, jnp.zeros((), x.dtype)))

        valid = jnp.broadcast_to(in_seq[:, None], (N, H, num_chunks, CHUNK))
        out, *rest = run_chunks(
            gathered(q), gathered(k), gathered(v), gathered(g), gathered(beta), valid)
        out = jnp.moveaxis(out, 1, 3)  # [N, C, 16, H, D]
        target = jnp.where(in_seq, token, T)  # T is out of range: those rows are dropped
        out = jnp.zeros((T, H, D), out.dtype).at[target].set(out, mode="drop")[None]
    return out, lengths, *rest
