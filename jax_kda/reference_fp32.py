"""Pure-JAX chunkwise KDA prefill in the opt-in "fp32" numerics mode (docs/fp32_mode.md).

bf16 inputs and outputs, everything between them at close to f32 precision: the state is f32 for the
whole sequence, prepare keeps every intermediate in f32, and every tensor-core product of two f32
matrices is written as the bf16 MMAs the kernels issue on hi + lo pairs
(x_hi = bf16(x), x_lo = bf16(x - x_hi)). This module is the readable definition of that arithmetic,
the way reference.py is for the bf16 ("flashkda") mode; it shares reference.py's helpers (gate,
L2 norm, ex2/sigmoid/rsqrt emulation, fmaf, the forward substitution, the chunk layout).

* `prepare_reference_fp32`: kernel 1 -> `Fp32Workspace` (kd, qd, kr, INV, Mqk as hi/lo pairs,
  gt f32).
* `recurrence_reference_fp32`: kernel 2, a `lax.scan` over chunks with an f32 state.
* `kda_prefill_reference_fp32`: the whole prefill, batched or packed, like `kda_prefill_reference`.

Which products use which of the three hi/lo terms (`PRODUCT_TERMS`) was chosen by measurement
against the float64 oracle (docs/fp32_mode.md has the table): the B operands made in registers (the
state, u, U) are always split; of the workspace operands only kd is a single bf16 (P = kd . S^T
needs only the state's lo).

Emulation notes (what differs from the GPU, as in reference.py):
* MMAs are f32 dots at precision HIGHEST on the bf16 values the MMAs see; products of two bf16 are
  exact in f32, so only the order of the f32 additions inside a dot differs from the tensor core.
  The terms of one product are separate accumulations summed as hh + (hl + lh).
* ex2.approx.ftz, tanh.approx, rsqrt.approx: reference.py's emulations (last-bit differences).
* Subnormals: the kernels compute with .ftz f32 arithmetic; this module flushes explicitly where a
  result can be subnormal (decayed keys and queries, lo parts, the state), so it does not depend on
  the backend's mode. Unlike the bf16 mode no value whose subnormal bits matter is ever formed: the
  intra-chunk products L and Mqk use keys and queries decayed relative to row 7's cumulative gate,
  whose factors stay within 2^+-58 (instead of 2^+-115 for 2^G_r and 2^-G_r).
* Narrowing conversions pass an optimization barrier (reference._narrow) so XLA cannot drop them.

Inverse: one f32 forward substitution over the whole 16x16 (I + L); no bf16 step, so the
"stable"/"neumann" distinction of the bf16 mode does not exist here and only "stable" is accepted.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import reference as ref
from ._manual_axes import vary_like
from .checkpoints import checkpoint_capacity
from .contract import CHUNK, HEAD_DIM

_F32_MIN_NORMAL = np.float32(2.0**-126)
_REF_ROW = 7  # row whose cumulative gate L and Mqk's operands are decayed relative to
INVERSE_VARIANTS_FP32 = ("stable",)

# Terms of each MMA product a.b: "hh" = a_hi.b_hi, "hl" = a_hi.b_lo, "lh" = a_lo.b_hi ("ll" and
# "tf32" exist for measurements only). A is the first operand named, B the second. Measured choice
# (docs/fp32_mode.md): P = kd . S^T does without kd's lo (its error is corrected by the delta rule:
# the next update writes v - P into the state); it keeps the state's lo, without which a last-bit
# difference in S (another f32 summation order) flips bf16(S) and moves the final state by ~1e-3.
# Every other product needs all three terms (INV.u with a bf16 INV fails on near-collinear keys
# with b ~ 1; Oq, Mqk.U, kr^T.U feed the output or the state directly). Prepare's L and Mqk: all
# three (cheap there).
PRODUCT_TERMS = {
    "L": ("hh", "hl", "lh"),  # prepare: kL . kiL^T (keys decayed relative to row 7)
    "Mqk": ("hh", "hl", "lh"),  # prepare: qL . kiL^T
    "P": ("hh", "hl"),  # recurrence: kd . S^T     (serial chain)
    "Oq": ("hh", "hl", "lh"),  # recurrence: qd . S^T
    "U": ("hh", "hl", "lh"),  # recurrence: INV . u      (serial chain)
    "out": ("hh", "hl", "lh"),  # recurrence: Mqk . U
    "W": ("hh", "hl", "lh"),  # recurrence: kr^T . U    (serial chain)
}
# Which workspace operand is the A side of which recurrence product: its lo is stored only if used.
_A_OPERAND_OF = {"kd": ("P",), "qd": ("Oq",), "kr": ("W",), "inv": ("U",), "mqk": ("out",)}
_ACTIVE_TERMS = dict(PRODUCT_TERMS)


@contextlib.contextmanager
def _product_terms(**overrides):
    """Measurement hook: other term sets for some products (read at trace time: jit inside)."""
    global _ACTIVE_TERMS
    saved = _ACTIVE_TERMS
    _ACTIVE_TERMS = {**saved, **overrides}
    try:
        yield
    finally:
        _ACTIVE_TERMS = saved


class HiLo(NamedTuple):
    """An f32 matrix as the two bf16 operands the MMAs see: x ~ hi + lo (16 significant bits).

    In the workspace, lo is None where no product uses it (the record does not hold it).
    """

    hi: jax.Array  # bf16, bf16(x)
    lo: jax.Array | None  # bf16, bf16(x - hi)


class Fp32Workspace(NamedTuple):
    """What prepare hands to the recurrence for each (chunk, head) in fp32 mode; leading axes `...`.

    With the default PRODUCT_TERMS, kd carries only hi (the record layout in docs/fp32_mode.md).
    """

    kd: HiLo  # [..., 16, 128]  k * 2^G_r                (lo: None)
    qd: HiLo  # [..., 16, 128]  q * 2^G_r * scale
    kr: HiLo  # [..., 16, 128]  k * 2^(G_15 - G_r)
    gt: jax.Array  # f32 [..., 128]  2^G_15
    inv: HiLo  # [..., 16, 16]  (I + L)^-1
    mqk: HiLo  # [..., 16, 16]  causal (diagonal included) q * scale . k, decayed 2^(G_r - G_c)


# ----------------------------------------------------------------------------- arithmetic helpers


def _f32(x):
    return x.astype(jnp.float32)


def _ftz(x):
    """.ftz semantics: subnormal f32 results become zero (of the same sign, as on the GPU)."""
    return jnp.where(jnp.abs(x) < _F32_MIN_NORMAL, x * np.float32(0.0), x)


def split_hi_lo(x) -> HiLo:
    """x (f32) -> (bf16(x), bf16(x - bf16(x))). The subtraction is exact; lo is rounded once."""
    x = _f32(x)
    hi = ref._narrow(x, jnp.bfloat16)
    lo = ref._narrow(_ftz(x - _f32(hi)), jnp.bfloat16)
    return HiLo(hi, lo)


def _workspace_operand(name, x) -> HiLo:
    """x split for the record: lo kept only if a product that takes `name` as A uses an "l."
    term."""
    pair = split_hi_lo(x)
    terms = [t for product in _A_OPERAND_OF[name] for t in _ACTIVE_TERMS[product]]
    needs_lo = any(t[0] == "l" or t == "tf32" for t in terms)
    return pair if needs_lo else HiLo(pair.hi, None)


def _value(x: HiLo):
    """hi + lo in f32 (hi alone where lo is absent)."""
    return _f32(x.hi) if x.lo is None else _f32(x.hi) + _f32(x.lo)


def _tf32(x):
    """cvt.rna.tf32.f32: round to 10 explicit mantissa bits, ties away from zero (measurements)."""
    bits = lax.bitcast_convert_type(_f32(x), jnp.uint32)
    bits = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _term(spec, a: HiLo, b: HiLo, term):
    """One MMA chain of a product: e.g. "hl" = a_hi . b_lo, exact bf16 products summed in f32."""
    if term == "tf32":
        return ref._dot(spec, _tf32(_value(a)), _tf32(_value(b)))
    pick = {"h": lambda x: x.hi, "l": lambda x: x.lo}
    return ref._dot(spec, pick[term[0]](a), pick[term[1]](b))


def _key_half(x: HiLo, half: int) -> HiLo:
    """The half of x's last (key) axis that k-blocks 4 * half .. 4 * half + 3 cover."""
    cut = slice(half * (HEAD_DIM // 2), (half + 1) * (HEAD_DIM // 2))
    return HiLo(*(None if part is None else part[..., cut] for part in x))


def key_halves_product(name, spec, a: HiLo, b: HiLo):
    """A product over the 128 keys (P, Oq) as the kernels sum it: one mma_product per half of
    the keys (k-blocks 0-3 and 4-7, each term its own chain), then half 0 + half 1. This is what
    lets a kernel give the two halves to two warps (or two accumulator chains of one warp)."""
    return mma_product(name, spec, _key_half(a, 0), _key_half(b, 0)) + mma_product(
        name, spec, _key_half(a, 1), _key_half(b, 1))


def mma_product(name, spec, a: HiLo, b: HiLo):
    """The f32 result of product `name` (a PRODUCT_TERMS key) from its terms, summed hh + (hl + lh).

    Each term is its own f32-accumulating chain of MMAs (k-blocks ascending in the kernel); the
    small terms are added first, then the large one, in this fixed order.
    """
    first, *small = [_term(spec, a, b, t) for t in _ACTIVE_TERMS[name]]
    if not small:
        return first
    rest = small[0]
    for t in small[1:]:
        rest = rest + t
    return first + rest


# ----------------------------------------------------------------------------- kernel 1: prepare


@jax.custom_jvp
def sigmoid_exp2(x):
    """The fp32 mode's sigmoid, 1 / (1 + 2^(-x log2 e)) in f32 (ptx.sigmoid_exp2: ex2.approx and
    rcp.approx, relative error a few ulp everywhere). The bf16 mode's tanh.approx form has an
    absolute error of ~2^-12, which for x << 0 (slowly decaying gates: sigmoid(-8) = 3.4e-4) is a
    large part of the value itself.

    Its derivative is sigmoid(x) sigmoid(-x) (`_sigmoid_exp2_jvp`): autodiff of the formula gives
    -1 / (1 + inf)^2 * inf = NaN where 2^(-x log2 e) overflows (x < -88.7, channels that never
    forget), which made the gate gradients NaN."""
    x = _f32(x)
    return 1.0 / (1.0 + jnp.exp2(x * np.float32(-ref._LOG2E)))


@sigmoid_exp2.defjvp
def _sigmoid_exp2_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    s = sigmoid_exp2(x)
    return s, _f32(dx) * (s * sigmoid_exp2(-_f32(x)))  # two finite values, never 0 * inf


def _decays(G):
    """Per-element decay factors from the cumulative gates G [..., 16, 128], all f32.

    Returns (e, ei, gt, up, down): e = 2^G_r, ei = 2^-G_r, gt = 2^G_15 [..., 128], and the factors
    relative to row 7, up = 2^-G_7 and down = 2^G_7 [..., 1, 128] (G_r - G_7 lies within +-58, so
    e * up and ei * down are far from under- or overflow).
    """
    e = ref.ex2_ftz(G)
    ei = ref.ex2_ftz(-G)
    gt = ref.ex2_ftz(G[..., -1, :])
    anchor = G[..., _REF_ROW:_REF_ROW + 1, :]
    return e, ei, gt, ref.ex2_ftz(-anchor), ref.ex2_ftz(anchor)


def _normalized(x, rows):
    """L2-normalised rows in f32 (reference.py's summation order, no rounding); invalid rows 0."""
    x = jnp.where(rows, x, jnp.zeros((), x.dtype))
    return _f32(x) * ref.l2_inverse_norm(x)[..., None]


def prepare_reference_fp32(q, k, g, beta, A_log, dt_bias, *, scale, lower_bound,
                           valid=None) -> Fp32Workspace:
    """Kernel 1 in fp32 mode on chunked inputs (shapes as reference.prepare_reference).

    Args:
      q, k, g: bf16 [..., 16, 128] (g is the raw gate). beta: bf16 [..., 16] logits.
      A_log: f32, broadcastable to `...`. dt_bias: f32, broadcastable to [..., 128].
      scale, lower_bound: floats. valid: bool [..., 16] or None (all rows valid); invalid rows are
      zero tokens.
    """
    if valid is None:
        valid = jnp.ones(q.shape[:-1], dtype=bool)
    rows = valid[..., None]
    qn, kn = _normalized(q, rows), _normalized(k, rows)
    G = ref.gate_cumsum(g, A_log, dt_bias, lower_bound, valid, sigmoid=sigmoid_exp2)
    e, ei, gt, up, down = _decays(G)
    scale = jnp.float32(scale)

    qd = _ftz(_ftz(qn * e) * scale)
    kd = _ftz(kn * e)
    kr = _ftz(kn * (ei * gt[..., None, :]))
    rel = e * up  # 2^(G_r - G_7)
    kl = kn * rel
    ql = (qn * rel) * scale
    kil = split_hi_lo(kn * (ei * down))  # k 2^(G_7 - G_r)

    strict = ref._strict_lower(CHUNK)
    b = sigmoid_exp2(beta)
    lmat = mma_product("L", "...rd,...cd->...rc", split_hi_lo(kl), kil)
    lmat = jnp.where(strict, lmat, 0.0) * b[..., :, None]
    mqk = mma_product("Mqk", "...rd,...cd->...rc", split_hi_lo(ql), kil)
    mqk = jnp.where(~strict.T, mqk, 0.0)
    inv = ref.forward_substitution_inverse(lmat)
    return Fp32Workspace(_workspace_operand("kd", kd), _workspace_operand("qd", qd),
                         _workspace_operand("kr", kr), gt, _workspace_operand("inv", inv),
                         _workspace_operand("mqk", mqk))


# ----------------------------------------------------------------------------- kernel 2: recurrence


def _chunk_step(state, ws: Fp32Workspace, v, beta):
    """Kernel 2 on one chunk in fp32 mode. state f32 [..., 128 (v), 128 (k)]; returns
    (state', out)."""
    s = split_hi_lo(state)
    p = key_halves_product("P", "...rk,...vk->...rv", ws.kd, s)
    oq = key_halves_product("Oq", "...rk,...vk->...rv", ws.qd, s)
    b = sigmoid_exp2(beta)
    u = split_hi_lo((_f32(v) - p) * b[..., :, None])
    big_u = split_hi_lo(mma_product("U", "...rc,...cv->...rv", ws.inv, u))
    out = ref._narrow(oq + mma_product("out", "...rc,...cv->...rv", ws.mqk, big_u), jnp.bfloat16)
    w = mma_product("W", "...rk,...rv->...vk", ws.kr, big_u)
    new_state = _ftz(ref.fma_f32(state, ws.gt[..., None, :], w))
    return new_state, out


def recurrence_reference_fp32(ws: Fp32Workspace, v, beta, initial_state, checkpoint_chunks=None):
    """Kernel 2 in fp32 mode: the chunk recurrence, serial over the chunk axis, state f32
    throughout.

    Args:
      ws: Fp32Workspace with leading axes [..., C] (C chunks, in order).
      v: bf16 [..., C, 16, 128] (zero on rows past the sequence end).
      beta: bf16 [..., C, 16] logits.
      initial_state: [..., 128, 128] V-major (state[..., v, k]), bf16 (widened) or f32 (read as
        is).
      checkpoint_chunks: None, or n: also return the state after every n chunks.
    Returns:
      out bf16 [..., C, 16, 128] and the final state f32 [..., 128, 128]; with checkpoint_chunks
      also the states after chunks n, 2n, ... (f32 [..., C // n, 128, 128]).
    """
    def chunks_first(field):  # matrices are [..., C, rows, cols], gt is [..., C, 128]
        if isinstance(field, HiLo):
            return HiLo(*(None if x is None else jnp.moveaxis(x, -3, 0) for x in field))
        return jnp.moveaxis(field, -2, 0)

    ws_first = Fp32Workspace(*(chunks_first(f) for f in ws))
    xs = (ws_first, jnp.moveaxis(v, -3, 0), jnp.moveaxis(beta, -2, 0))

    def step(state, x):
        return _chunk_step(state, *x)

    return ref.scan_chunks(step, _f32(initial_state), xs, v.shape[-3], checkpoint_chunks)


# ----------------------------------------------------------------------------- whole prefill


def kda_prefill_reference_fp32(q, k, v, g, beta, A_log, dt_bias, *, scale, lower_bound,
                               initial_state=None, cu_seqlens=None, inverse="stable",
                               checkpoint_every=None, checkpoint_offsets=None,
                               checkpoint_rows=None):
    """KDA prefill, chunkwise, in fp32 mode (conventions of reference.kda_prefill_reference).

    Args:
      q, k, v, g: bf16 [B, T, H, 128]. beta: bf16 [B, T, H] (logits).
      A_log: f32 [H]. dt_bias: f32 [H, 128]. scale, lower_bound: Python floats.
      initial_state: [N, H, 128, 128] (state[n, h, v, k]): f32 is read without rounding, bf16 is
        widened; None means zeros.
      cu_seqlens: None (each batch row is one sequence, N = B) or int32 [N+1] with B == 1; values
        may be traced, and are clamped as in the bf16 mode.
      inverse: only "stable" (fp32 mode has a single f32 inverse; the argument exists so both modes
        share a signature).
      checkpoint_every, checkpoint_offsets, checkpoint_rows: as reference.kda_prefill_reference.
    Returns:
      out bf16 [B, T, H, 128] (tokens covered by no sequence are 0) and final_state f32
      [N, H, 128, 128]; with checkpoint_every also the checkpoints f32 [capacity, H, 128, 128].
      A caller that wants bf16 states rounds these once.
    """
    if inverse not in INVERSE_VARIANTS_FP32:
        raise ValueError(
            f"fp32 numerics support inverse in {INVERSE_VARIANTS_FP32}, got {inverse!r}")
    B, T, H, D = q.shape
    if D != HEAD_DIM:
        raise ValueError(f"head dim must be {HEAD_DIM}, got {D}")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        state0 = vary_like(jnp.zeros((N, H, D, D), jnp.float32), v)
    else:
        state0 = _f32(initial_state)
    chunks = None if checkpoint_every is None else checkpoint_every // CHUNK
    if T == 0:
        out = jnp.zeros(q.shape, jnp.bfloat16)
        if checkpoint_every is None:
            return out, state0
        return out, state0, jnp.zeros((0, H, D, D), jnp.float32)
    A_log = _f32(A_log)
    dt_bias = _f32(dt_bias)

    def run_chunks(q, k, v, g, beta, valid):
        ws = prepare_reference_fp32(q, k, g, beta, A_log[None, :, None], dt_bias[None, :, None, :],
                                    scale=scale, lower_bound=lower_bound, valid=valid)
        return recurrence_reference_fp32(ws, v, beta, state0, chunks)

    out, lengths, final_state, *states = ref.chunked_prefill(run_chunks, q, k, v, g, beta,
                                                             cu_seqlens)
    if checkpoint_every is None:
        return out, final_state
    capacity = (checkpoint_capacity(B, T, cu_seqlens is not None, checkpoint_every)
                if checkpoint_rows is None else checkpoint_rows)
    return out, final_state, ref.pack_checkpoints(states[0], lengths, checkpoint_every, capacity,
                                                   checkpoint_offsets)
