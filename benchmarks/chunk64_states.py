"""The backward's forward state chain in 64-token steps instead of 16 (an experiment for a
tensor-core chain: 4x fewer serial steps, products of 64 rows), on the CPU: how close its states
come to the exact ones, against the 16-token chain's.

A 64-token step is the chain kernel's recurrence X' = X Diag(gamma) + (Y - A X^T)^T B with 64
rows, its operands built from the 16-token chunk factors of jax_kda.reference_backward with no
factor above 1: A = kd 2^(gates of the block's earlier sub-chunks), gamma the product of the four
gt, B = Diag(b) W^T kr with kr = k^ 2^(gates after the row to the block's end) and
W = (I + Diag(b) strict(K))^-1 over 64 rows, K's diagonal 16 x 16 blocks the sub-chunks' own
(anchor row 7) and its block (i, j), i > j, (kd_i Prod_{j<m<i} gt_m) kr_j^T. The states inside a
block are then the 16-token steps from its start (parallel over blocks). Both routes in f32, and
in products of three bf16 parts (benchmarks/chain_product_precision.py); the exact states from
jax_kda.oracle, token by token in float64.

  python benchmarks/chunk64_states.py [--T 1024] [--heads 2] [--regimes ...] [--out x.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda import oracle
from jax_kda import reference_backward as rb
from jax_kda._ffi import ChainOperands
from jax_kda.bench import gradients

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1] / "tests"),
                str(pathlib.Path(__file__).resolve().parent)]
from chain_product_precision import PRODUCTS  # noqa: E402
from state_chain_model import chain_model  # noqa: E402

SUB = 4  # 16-token sub-chunks per step
HI = jax.lax.Precision.HIGHEST


def _blocks(x):
    """[N, H, C, ...] -> [N, H, C / 4, 4, ...]."""
    return x.reshape(x.shape[:2] + (x.shape[2] // SUB, SUB) + x.shape[3:])


def step64_operands(f, v):
    """(gamma [N, H, C4, 128], A, B, Y [N, H, C4, 64, 128]) of the 64-token forward chain."""
    kd, kr, gt, b, Ad, vb = map(_blocks, (f.kd, f.kr, f.gt, f.b, f.A, v))
    ones = jnp.ones_like(gt[..., :1, :])
    before = jnp.cumprod(jnp.concatenate([ones, gt[..., :-1, :]], -2), -2)  # Prod_{m<i} gt_m
    after = jnp.cumprod(jnp.concatenate([gt[..., 1:, :], ones], -2)[..., ::-1, :], -2)[..., ::-1, :]
    A = kd * before[..., None, :]
    kr64 = kr * after[..., None, :]
    rows = []
    for i in range(SUB):
        row = []
        for j in range(SUB):
            if j < i:  # (kd_i Prod_{j<m<i} gt_m) kr_j^T
                between = functools.reduce(lambda x, m: x * gt[..., m, None, :],
                                           range(j + 1, i), kd[..., i, :, :])
                row.append(jnp.einsum("...rk,...ck->...rc", between, kr[..., j, :, :],
                                      precision=HI))
            elif j == i:
                row.append(Ad[..., i, :, :])
            else:
                row.append(jnp.zeros_like(Ad[..., i, :, :]))
        rows.append(jnp.concatenate(row, -1))
    K = jnp.concatenate(rows, -2)  # [.., 64, 64], strictly lower
    b64 = b.reshape(b.shape[:-2] + (64,))
    eye = jnp.eye(64, dtype=jnp.float32)
    W = jax.scipy.linalg.solve_triangular(eye + b64[..., :, None] * K, jnp.broadcast_to(
        eye, K.shape), lower=True)
    flat = lambda x: x.reshape(x.shape[:3] + (64, 128))
    B = b64[..., :, None] * jnp.einsum("...rc,...rk->...ck", W, flat(kr64), precision=HI)
    return jnp.prod(gt, -2), flat(A), B, flat(vb)


def chain_states(gamma, A, B, Y, state0, product):
    """States entering every step [N, H, C', 128, 128] from the kernel's model."""
    N, C = gamma.shape[0], gamma.shape[2]
    reset = jnp.where(jnp.arange(C) == 0, 0, -1).astype(jnp.int32)[None].repeat(N, 0)
    ops = ChainOperands(reset, state0[:, None], A, B, Y)
    return chain_model(gamma, ops, False, product)[0]


def states_64(f, v, state0, product):
    gamma, A, B, Y = step64_operands(f, v)
    S = chain_states(gamma, A, B, Y, state0, product)  # entering each block
    out = [S]
    fb, vb = (jax.tree.map(_blocks, f), _blocks(v))
    for i in range(SUB - 1):  # the 16-token steps inside the blocks, all blocks at once
        fi = jax.tree.map(lambda x: x[:, :, :, i], fb)
        U = rb.delta_update(fi, vb[:, :, :, i], S)[1]
        S = S * fi.gt[..., None, :] + product("...rv,...rk->...vk", U, fi.kr)
        out.append(S)
    return jnp.stack(out, 3).reshape(S.shape[:2] + (-1,) + S.shape[3:])


def states_16(f, v, state0, product):
    zeros = jnp.zeros_like(v)  # no cotangents: the reverse chain's operands go unused
    forward = rb.chain_operands(f, v, zeros, state0, jnp.zeros_like(state0))[0]
    return chain_states(f.gt, forward.A, forward.B, forward.Y, state0, product)


def state_errors(f, v, state0, product, want):
    """Relative RMSE against `want` of the states from 16-token and from 64-token steps."""
    return [gradients.rel_rmse(jax.jit(route, static_argnums=3)(f, v, state0, product), want)
            for route in (states_16, states_64)]


def chunk_factors(case, T):
    """(16-token chunk factors, chunked v) of a batched case (reference_backward's step 1)."""
    q, k, v, g, beta, A_log, dt_bias, _ = case.primals
    layout = rb.chunk_layout(1, T, None)
    f = rb.chunked_factors(layout, q, k, g, beta, A_log, dt_bias, scale=gradients.SCALE,
                           lower_bound=gradients.LOWER_BOUND)
    return f, rb.to_chunks(v, layout)


def exact_states(case, T):
    """float64 states entering every 16-token chunk [1, H, C, 128, 128]."""
    q, k, v, g, beta, A_log, dt_bias, state = case.primals
    S, out = np.asarray(state, np.float64), []
    for t in range(0, T, 16):
        out.append(S)
        part = lambda x: x[:, t:t + 16]
        S = oracle.kda_prefill_oracle(*map(part, (q, k, v, g, beta)), A_log, dt_bias,
                                      scale=gradients.SCALE, lower_bound=gradients.LOWER_BOUND,
                                      initial_state=S)[1]
    return np.stack(out, 2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--regimes", default=",".join(gradients.GRADIENT_REGIMES))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    print("| regime | products | 16-token steps | 64-token steps |\n|---|---|---|---|")
    for regime in args.regimes.split(","):
        case = gradients.make_case(rng, args.T, args.heads, regime)
        f, v = chunk_factors(case, args.T)
        want = exact_states(case, args.T)
        for name in ("f32", "bf16x3"):
            errors = state_errors(f, v, case.primals[7], PRODUCTS[name], want)
            rows.append({"regime": regime, "products": name, "T": args.T, "heads": args.heads,
                         "steps16": errors[0], "steps64": errors[1]})
            print(f"| {regime} | {name} | {errors[0]:.2e} | {errors[1]:.2e} |", flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"meta": {"jax": jax.__version__, "device": str(jax.devices()[0])},
                       "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
