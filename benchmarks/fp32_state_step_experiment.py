"""Accuracy of a proposed fp32-mode arithmetic with one state step per 32 tokens (two 16-token
chunks a, b; docs/perf_notes.md, "the fp32 recurrence's next lever"), against the float64 oracle
and beside today's fp32 mode (one step per 16 tokens), on the CPU with the pure-JAX pieces of
jax_kda.reference_fp32. Nothing here is used by the package: it answers, before any kernel is
written, whether the longer step keeps the mode's accuracy.

Per chunk pair, from the state S at the start of a (f32 everywhere, products as hi/lo MMAs with
reference_fp32's term sets; x' marks an operand decayed across the chunk boundary):
  P_a = kd_a . S^T;  P_b = kd_b' . S^T + A_ba . U_a,  kd_b' = k_b 2^(G_b + G_a,15),
                                                       A_ba = kd_b . kr_a^T (three terms);
  U_a = INV_a . u_a, u_b from P_b, U_b = INV_b . u_b;
  out_a = bf16(Oq_a + Mqk_a . U_a);  out_b = bf16(qd_b' . S^T + (B_ba . U_a + Mqk_b . U_b)),
                                                       B_ba = qd_b . kr_a^T;
  S' = fmaf(S, gt_a gt_b, kr_a'^T . U_a + kr_b^T . U_b),  kr_a' = k_a 2^(G_a,15 - G_a + G_b,15).

  python benchmarks/fp32_state_step_experiment.py [--seqlen 2048] [--heads 2] [--out FILE.json]
      [--regimes fla,keep32,slow] [--laws normal] [--a-terms three | kd_hi]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda import oracle
from jax_kda import reference as ref
from jax_kda import reference_fp32 as r32
from jax_kda.bench import regimes
from jax_kda.contract import CHUNK

LOWER_BOUND = -5.0
SCALE = 128**-0.5


# A_ba's terms: "three" (hh + (hl + lh) on kd_b and kr_a hi / lo) or "kd_hi" (hh + hl: kd_b's hi
# only, the way P = kd . S^T takes kd)
A_TERMS = "three"


def _a_ba(kd_b, kr_a):
    """A_ba = kd_b . kr_a^T (16 x 16, contraction over the 128 keys)."""
    if A_TERMS == "three":
        return r32.mma_product("L", "...rd,...cd->...rc", r32.split_hi_lo(kd_b),
                               r32.split_hi_lo(kr_a))
    with r32._product_terms(L=("hh", "hl")):
        return r32.mma_product("L", "...rd,...cd->...rc",
                               r32.HiLo(r32.split_hi_lo(kd_b).hi, None), r32.split_hi_lo(kr_a))


def _pair_workspace(q, k, g, beta, A_log, dt_bias, valid):
    """Per chunk (axis -3) today's f32 operands, then the pair fields; chunks [..., 2P, 16, 128]."""
    rows = valid[..., None]
    qn, kn = r32._normalized(q, rows), r32._normalized(k, rows)
    G = ref.gate_cumsum(g, A_log, dt_bias, LOWER_BOUND, valid, sigmoid=r32.sigmoid_exp2)
    e, ei, gt, up, down = r32._decays(G)
    scale = jnp.float32(SCALE)
    b = r32.sigmoid_exp2(beta)
    strict = ref._strict_lower(CHUNK)
    rel = e * up
    kil = r32.split_hi_lo(kn * (ei * down))
    lmat = r32.mma_product("L", "...rd,...cd->...rc", r32.split_hi_lo(kn * rel), kil)
    lmat = jnp.where(strict, lmat, 0.0) * b[..., :, None]
    mqk = r32.mma_product("Mqk", "...rd,...cd->...rc", r32.split_hi_lo((qn * rel) * scale), kil)
    mqk = jnp.where(~strict.T, mqk, 0.0)
    inv = ref.forward_substitution_inverse(lmat)

    def ab(x):
        return x[..., 0::2, :, :], x[..., 1::2, :, :]

    (qn_a, qn_b), (kn_a, kn_b), (e_a, e_b), (ei_a, ei_b) = ab(qn), ab(kn), ab(e), ab(ei)
    gt_a, gt_b = gt[..., 0::2, None, :], gt[..., 1::2, None, :]
    ftz = r32._ftz
    kr_a = ftz(kn_a * (ei_a * gt_a))  # relative to the boundary (today's kr_a)
    kd_b = ftz(kn_b * e_b)
    qd_b = ftz(ftz(qn_b * e_b) * scale)
    ws = {
        "kd_a": r32.HiLo(ref._narrow(ftz(kn_a * e_a), jnp.bfloat16), None),
        "qd_a": r32.split_hi_lo(ftz(ftz(qn_a * e_a) * scale)),
        "kd_b2": r32.HiLo(ref._narrow(ftz(kn_b * (e_b * gt_a)), jnp.bfloat16), None),
        "qd_b2": r32.split_hi_lo(ftz(ftz(qn_b * (e_b * gt_a)) * scale)),
        "kr_a2": r32.split_hi_lo(ftz(kn_a * (ei_a * (gt_a * gt_b)))),
        "kr_b": r32.split_hi_lo(ftz(kn_b * (ei_b * gt_b))),
        "A_ba": r32.split_hi_lo(_a_ba(kd_b, kr_a)),
        "B_ba": r32.split_hi_lo(r32.mma_product("Mqk", "...rd,...cd->...rc",
                                                r32.split_hi_lo(qd_b), r32.split_hi_lo(kr_a))),
        "inv_a": r32.split_hi_lo(inv[..., 0::2, :, :]), "inv_b": r32.split_hi_lo(inv[..., 1::2, :, :]),
        "mqk_a": r32.split_hi_lo(mqk[..., 0::2, :, :]), "mqk_b": r32.split_hi_lo(mqk[..., 1::2, :, :]),
        "gt2": (gt_a * gt_b)[..., 0, :],
        "b_a": b[..., 0::2, :], "b_b": b[..., 1::2, :],
    }
    return ws


def _pair_step(state, x):
    ws, v_a, v_b = x
    s = r32.split_hi_lo(state)
    kp = r32.key_halves_product
    p_a = kp("P", "...rk,...vk->...rv", ws["kd_a"], s)
    p_b2 = kp("P", "...rk,...vk->...rv", ws["kd_b2"], s)
    oq_a = kp("Oq", "...rk,...vk->...rv", ws["qd_a"], s)
    oq_b2 = kp("Oq", "...rk,...vk->...rv", ws["qd_b2"], s)
    mm = r32.mma_product
    u_a = r32.split_hi_lo((r32._f32(v_a) - p_a) * ws["b_a"][..., :, None])
    big_ua = r32.split_hi_lo(mm("U", "...rc,...cv->...rv", ws["inv_a"], u_a))
    p_b = p_b2 + mm("U", "...rc,...cv->...rv", ws["A_ba"], big_ua)
    u_b = r32.split_hi_lo((r32._f32(v_b) - p_b) * ws["b_b"][..., :, None])
    big_ub = r32.split_hi_lo(mm("U", "...rc,...cv->...rv", ws["inv_b"], u_b))
    out_a = ref._narrow(oq_a + mm("out", "...rc,...cv->...rv", ws["mqk_a"], big_ua), jnp.bfloat16)
    out_b = ref._narrow(oq_b2 + (mm("out", "...rc,...cv->...rv", ws["B_ba"], big_ua)
                                 + mm("out", "...rc,...cv->...rv", ws["mqk_b"], big_ub)),
                        jnp.bfloat16)
    w = (mm("W", "...rk,...rv->...vk", ws["kr_a2"], big_ua)
         + mm("W", "...rk,...rv->...vk", ws["kr_b"], big_ub))
    new_state = r32._ftz(ref.fma_f32(state, ws["gt2"][..., None, :], w))
    return new_state, (out_a, out_b)


def prefill_pairs(q, k, v, g, beta, A_log, dt_bias):
    """Batched prefill (no cu_seqlens), T a multiple of 32, zero initial state."""
    B, T, H, D = q.shape
    assert T % (2 * CHUNK) == 0
    C = T // CHUNK

    def chunked(x):  # [B, T, H, ...] -> [B, H, C, 16, ...]
        return jnp.moveaxis(x.reshape((B, C, CHUNK) + x.shape[2:]), 3, 1)

    valid = jnp.ones((B, H, C, CHUNK), bool)
    ws = _pair_workspace(chunked(q), chunked(k), chunked(g), chunked(beta),
                         jnp.asarray(A_log, jnp.float32)[None, :, None],
                         jnp.asarray(dt_bias, jnp.float32)[None, :, None, :], valid)
    vc = chunked(v)

    def first(x):  # pair axis (-3 for matrices / -2 for vectors) to the front
        if isinstance(x, r32.HiLo):
            return r32.HiLo(*(None if p is None else jnp.moveaxis(p, -3, 0) for p in x))
        return jnp.moveaxis(x, -2, 0)

    xs = ({n: first(f) for n, f in ws.items()}, jnp.moveaxis(vc[..., 0::2, :, :], -3, 0),
          jnp.moveaxis(vc[..., 1::2, :, :], -3, 0))
    state0 = jnp.zeros((B, H, D, D), jnp.float32)
    final, (out_a, out_b) = jax.lax.scan(_pair_step, state0, xs)
    out = jnp.stack([out_a, out_b], 1)  # [P, 2, B, H, 16, 128]
    out = jnp.moveaxis(out.reshape((C,) + out.shape[2:]), 0, 2)  # [B, H, C, 16, 128]
    return jnp.moveaxis(out, 1, 3).reshape(B, T, H, D), final


def rel_rmse(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--regimes", default=",".join(regimes.REGIMES))
    ap.add_argument("--laws", default=",".join(regimes.LAWS))
    ap.add_argument("--a-terms", choices=("three", "kd_hi"), default="three")
    ap.add_argument("--out")
    args = ap.parse_args()
    global A_TERMS
    A_TERMS = args.a_terms
    rng = np.random.default_rng(0)
    rows = []
    serial = jax.jit(lambda a: r32.kda_prefill_reference_fp32(
        **a, scale=SCALE, lower_bound=LOWER_BOUND))
    pairs = jax.jit(lambda a: prefill_pairs(**a))
    for regime in args.regimes.split(","):
        for law in args.laws.split(","):
            a = regimes.make_inputs(rng, args.seqlen, args.heads, regime, law)
            want_out, want_state = oracle.kda_prefill_oracle(
                **{n: np.asarray(x.astype(jnp.float32)) for n, x in a.items()},
                lower_bound=LOWER_BOUND)
            row = {"regime": regime, "law": law}
            for name, fn in (("fp32 (16-token step)", serial), ("32-token step", pairs)):
                out, state = fn(a)
                row[name] = {"out": rel_rmse(out, want_out), "state": rel_rmse(state, want_state)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"seqlen": args.seqlen, "heads": args.heads, "device": "cpu",
                       "a_terms": A_TERMS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
