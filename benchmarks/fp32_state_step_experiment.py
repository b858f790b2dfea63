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

--form record: the same step with today's record operands only (no x' operands), the decay across
the boundary applied to the state instead, and both chunks' state updates kept (so the state at
every chunk boundary exists, for pieces and prefix states):
  S_dec = S * gt_a (per key, split like S);  P_b = kd_b . S_dec^T + A_ba . U_a;
  out_b = bf16(qd_b . S_dec^T + (B_ba . U_a + Mqk_b . U_b));
  S_a = fmaf(S, gt_a, kr_a^T . U_a),  S' = fmaf(S_a, gt_b, kr_b^T . U_b).

  python benchmarks/fp32_state_step_experiment.py [--seqlen 2048] [--heads 2] [--out FILE.json]
      [--regimes fla,keep32,slow] [--laws normal] [--a-terms three | kd_hi]
      [--form predecayed | record]
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
A_TERMS = ("three", "kd_hi")
# the pair step: with pre-decayed cross-boundary operands and one state update, or on today's
# record operands with the decay applied to the state and both chunks' updates (module docstring)
FORMS = ("predecayed", "record")


def _pair_workspace(q, k, g, beta, A_log, dt_bias, valid, a_terms="three"):
    """Today's record of every chunk (reference_fp32.prepare_reference_fp32) and the fields that
    cross a pair's boundary; chunks [..., 2P, 16, 128], chunk a = 2p, b = 2p + 1."""
    ws = r32.prepare_reference_fp32(q, k, g, beta, A_log, dt_bias, scale=SCALE,
                                    lower_bound=LOWER_BOUND, valid=valid)
    # the f32 operands the record was split from, for the pre-decayed ones
    rows = valid[..., None]
    qn, kn = r32._normalized(q, rows), r32._normalized(k, rows)
    G = ref.gate_cumsum(g, A_log, dt_bias, LOWER_BOUND, valid, sigmoid=r32.sigmoid_exp2)
    e, ei, gt, _, _ = r32._decays(G)
    b = r32.sigmoid_exp2(beta)

    def pick(x, chunk):  # chunk a (0) or b (1) of every pair; chunk axis -3 (tiles) or -2
        if isinstance(x, r32.HiLo):
            return r32.HiLo(*(None if p is None else pick(p, chunk) for p in x))
        axis = x.ndim - (3 if x.ndim == q.ndim else 2)
        return jax.lax.slice_in_dim(x, chunk, None, 2, axis)

    def a_(x):
        return pick(x, 0)

    def b_(x):
        return pick(x, 1)

    gt_a, gt_b = a_(gt)[..., None, :], b_(gt)[..., None, :]
    ftz, scale = r32._ftz, jnp.float32(SCALE)
    if a_terms == "three":
        a_ba = r32.mma_product("L", "...rd,...cd->...rc",
                               r32.split_hi_lo(ftz(b_(kn) * b_(e))), a_(ws.kr))
    else:
        with r32._product_terms(L=("hh", "hl")):
            a_ba = r32.mma_product("L", "...rd,...cd->...rc", b_(ws.kd), a_(ws.kr))
    return {
        "kd_a": a_(ws.kd), "qd_a": a_(ws.qd), "kr_b": b_(ws.kr),
        "kd_b": b_(ws.kd), "qd_b": b_(ws.qd), "kr_a": a_(ws.kr),
        "gt_a": gt_a[..., 0, :], "gt_b": gt_b[..., 0, :],
        "kd_b2": r32.HiLo(ref._narrow(ftz(b_(kn) * (b_(e) * gt_a)), jnp.bfloat16), None),
        "qd_b2": r32.split_hi_lo(ftz(ftz(b_(qn) * (b_(e) * gt_a)) * scale)),
        "kr_a2": r32.split_hi_lo(ftz(a_(kn) * (a_(ei) * (gt_a * gt_b)))),
        "A_ba": r32.split_hi_lo(a_ba),
        "B_ba": r32.split_hi_lo(r32.mma_product("Mqk", "...rd,...cd->...rc", b_(ws.qd),
                                                a_(ws.kr))),
        "inv_a": a_(ws.inv), "inv_b": b_(ws.inv), "mqk_a": a_(ws.mqk), "mqk_b": b_(ws.mqk),
        "gt2": (gt_a * gt_b)[..., 0, :], "b_a": a_(b), "b_b": b_(b),
    }


def _chunks_of_pair(ws, v_a, v_b, p_a, p_b2, oq_a, oq_b2):
    """Both forms from P_a, P_b' (P_b without A_ba . U_a), Oq_a, Oq_b': (U_a, U_b) split and
    (out_a, out_b)."""
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
    return big_ua, big_ub, (out_a, out_b)


def _p_oq(ws, a, b, s_a, s_b):
    """P and Oq of chunk a's operands on split state s_a, of b's on s_b (key halves)."""
    kp = r32.key_halves_product
    return (kp("P", "...rk,...vk->...rv", ws["kd_" + a], s_a),
            kp("P", "...rk,...vk->...rv", ws["kd_" + b], s_b),
            kp("Oq", "...rk,...vk->...rv", ws["qd_" + a], s_a),
            kp("Oq", "...rk,...vk->...rv", ws["qd_" + b], s_b))


def _pair_step(state, x):
    ws, v_a, v_b = x
    s = r32.split_hi_lo(state)
    big_ua, big_ub, outs = _chunks_of_pair(ws, v_a, v_b, *_p_oq(ws, "a", "b2", s, s))
    mm = r32.mma_product
    w = (mm("W", "...rk,...rv->...vk", ws["kr_a2"], big_ua)
         + mm("W", "...rk,...rv->...vk", ws["kr_b"], big_ub))
    return r32._ftz(ref.fma_f32(state, ws["gt2"][..., None, :], w)), outs


def _pair_step_on_record(state, x):
    """--form record: the pair step on today's record operands (module docstring)."""
    ws, v_a, v_b = x
    s = r32.split_hi_lo(state)
    s_dec = r32.split_hi_lo(r32._ftz(state * ws["gt_a"][..., None, :]))
    big_ua, big_ub, outs = _chunks_of_pair(ws, v_a, v_b, *_p_oq(ws, "a", "b", s, s_dec))
    mm = r32.mma_product
    w_a = mm("W", "...rk,...rv->...vk", ws["kr_a"], big_ua)
    state_a = r32._ftz(ref.fma_f32(state, ws["gt_a"][..., None, :], w_a))
    w_b = mm("W", "...rk,...rv->...vk", ws["kr_b"], big_ub)
    return r32._ftz(ref.fma_f32(state_a, ws["gt_b"][..., None, :], w_b)), outs


def prefill_pairs(q, k, v, g, beta, A_log, dt_bias, a_terms="three", form="predecayed"):
    """Batched prefill (no cu_seqlens), T a multiple of 32, zero initial state; a_terms: A_TERMS,
    form: FORMS."""
    B, T, H, D = q.shape
    assert T % (2 * CHUNK) == 0
    C = T // CHUNK

    def chunked(x):  # [B, T, H, ...] -> [B, H, C, 16, ...]
        return jnp.moveaxis(x.reshape((B, C, CHUNK) + x.shape[2:]), 3, 1)

    valid = jnp.ones((B, H, C, CHUNK), bool)
    ws = _pair_workspace(chunked(q), chunked(k), chunked(g), chunked(beta),
                         jnp.asarray(A_log, jnp.float32)[None, :, None],
                         jnp.asarray(dt_bias, jnp.float32)[None, :, None, :], valid, a_terms)
    vc = chunked(v)

    def first(x):  # pair axis (-3 for matrices / -2 for vectors) to the front
        if isinstance(x, r32.HiLo):
            return r32.HiLo(*(None if p is None else jnp.moveaxis(p, -3, 0) for p in x))
        return jnp.moveaxis(x, -2, 0)

    xs = ({n: first(f) for n, f in ws.items()}, jnp.moveaxis(vc[..., 0::2, :, :], -3, 0),
          jnp.moveaxis(vc[..., 1::2, :, :], -3, 0))
    state0 = jnp.zeros((B, H, D, D), jnp.float32)
    step = {"predecayed": _pair_step, "record": _pair_step_on_record}[form]
    final, (out_a, out_b) = jax.lax.scan(step, state0, xs)
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
    ap.add_argument("--a-terms", choices=A_TERMS, default="three")
    ap.add_argument("--form", choices=FORMS, default="predecayed")
    ap.add_argument("--out")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    serial = jax.jit(lambda a: r32.kda_prefill_reference_fp32(
        **a, scale=SCALE, lower_bound=LOWER_BOUND))
    pairs = jax.jit(lambda a: prefill_pairs(**a, a_terms=args.a_terms, form=args.form))
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
                       "a_terms": args.a_terms, "form": args.form, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
