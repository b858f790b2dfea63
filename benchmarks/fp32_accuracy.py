"""Accuracy of both numerics modes' GPU kernels (and of jax-linear-attention, when importable)
against the float64 oracle: relative RMSE of all outputs and of all final-state entries.

Three parts, one JSON:
  regimes  T = 8192, 6 heads, every gate regime x input law of docs/fp32_mode.md section 4;
  growth   one sequence of 1 head, T = 131072, the error of each prefix 2K / 8K / 32K / 128K
           (the oracle runs once, segment by segment);
  packed   T_total = 32768, 2 heads, cu_seqlens with empty and length-1 sequences, f32 initial
           states.

  python benchmarks/fp32_accuracy.py --out fp32_accuracy.json [--parts regimes,growth,packed]
      [--sequence-parallel 16,...]   # also the fp32 mode cut into that many segments ("fp32:sp=16")
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda
from jax_kda import oracle
from jax_kda.bench import regimes

MODES = ["flashkda", "fp32"]  # --sequence-parallel appends "fp32:sp=n" modes
PACKED_CU = [0, 0, 4999, 4999, 20000, 20001, 32768]
PREFIXES = (2048, 8192, 32768, 131072)
LOWER_BOUND = -5.0


def rel_rmse(got, want) -> float:
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def kernel(mode, a, **extra):
    """(out, final state) of the kernels in one numerics mode (f32 final state in both); "fp32:
    sp=n" is the fp32 mode with sequence_parallel=n."""
    mode, _, segments = mode.partition(":sp=")
    split = int(segments) if segments else "off"
    state = extra.pop("initial_state", None)
    if state is None:
        N = a["q"].shape[0] if "cu_seqlens" not in extra else len(extra["cu_seqlens"]) - 1
        state = jnp.zeros((N, a["q"].shape[2], 128, 128), jnp.float32)
    return jax.jit(lambda a, s, extra: jax_kda.kda_prefill(
        **a, **extra, initial_state=s, output_final_state=True, backend="kernel",
        numerics=mode, sequence_parallel=split))(a, state, extra)


def jla_kernel(a):
    """jax-linear-attention's kda on the same inputs (gates applied as it expects), or None."""
    try:
        from jax_kda.bench import jla_compare
        module = jla_compare._kda_module()
    except Exception as err:  # noqa: BLE001 - jla is optional
        print(f"  jla skipped: {err}")
        return None
    x = dict(a, state=jnp.zeros((a["q"].shape[0], a["q"].shape[2], 128, 128), jnp.float32))
    q, k, v, g, beta, state = jla_compare.convert_inputs(x, lower_bound=LOWER_BOUND)
    out, final = jax.jit(lambda *args: module.kda(
        *args[:5], scale=128**-0.5, initial_state=args[5], output_final_state=True,
        use_qk_l2norm=True))(q, k, v, g, beta, state)
    return out, jnp.swapaxes(final, -1, -2)  # jla's [B, H, K, V] -> [N, H, V, K]


def oracle_of(a, **extra):
    return oracle.kda_prefill_oracle(**{k: np.asarray(v.astype(jnp.float32)) for k, v in a.items()},
                                     **extra)


def part_regimes(rng):
    rows = []
    for regime in ("strong", "fla", "keep32", "slow"):
        for law in regimes.LAWS:
            a = regimes.make_inputs(rng, 8192, 6, regime, law)
            want_out, want_state = oracle_of(a)
            row = {"regime": regime, "law": law, "T": 8192, "heads": 6,
                   "bf16_rounding_of_exact_out": rel_rmse(jnp.asarray(want_out, jnp.bfloat16),
                                                          want_out)}
            results = {mode: kernel(mode, a) for mode in MODES}
            jla = jla_kernel(a)
            if jla is not None:
                results["jla"] = jla
            for name, (out, state) in results.items():
                row[name] = {"out": rel_rmse(out, want_out), "state": rel_rmse(state, want_state)}
            rows.append(row)
            print("  regimes", json.dumps(row), flush=True)
    return rows


def part_growth(rng):
    rows = []
    for regime in ("fla", "keep32", "slow"):
        a = regimes.make_inputs(rng, PREFIXES[-1], 1, regime, "normal")
        # the oracle once over the whole sequence, segment by segment, keeping each prefix's state
        outs, states, state, start = [], {}, None, 0
        for end in PREFIXES:
            seg = {k: (v[:, start:end] if v.ndim >= 3 else v) for k, v in a.items()}
            out, state = oracle.kda_prefill_oracle(
                **{k: np.asarray(v.astype(jnp.float32)) for k, v in seg.items()},
                initial_state=state)
            outs.append(out)
            states[end] = state
            start = end
        want_out = np.concatenate(outs, axis=1)
        for end in PREFIXES:
            prefix = {k: (v[:, :end] if v.ndim >= 3 else v) for k, v in a.items()}
            row = {"regime": regime, "law": "normal", "T": end, "heads": 1}
            for mode in MODES:
                out, state = kernel(mode, prefix)
                row[mode] = {"out": rel_rmse(out, want_out[:, :end]),
                             "state": rel_rmse(state, states[end]),
                             "out_last_2048": rel_rmse(out[:, -2048:], want_out[:, end - 2048:end])}
            rows.append(row)
            print("  growth", json.dumps(row), flush=True)
    return rows


def part_packed(rng):
    rows = []
    for regime in ("keep32", "slow"):
        for law in regimes.LAWS:
            a = regimes.make_inputs(rng, PACKED_CU[-1], 2, regime, law)
            N = len(PACKED_CU) - 1
            state0 = jnp.asarray(rng.standard_normal((N, 2, 128, 128)) * 0.1, jnp.float32)
            cu = jnp.asarray(PACKED_CU, jnp.int32)
            want_out, want_state = oracle_of(a, initial_state=np.asarray(state0),
                                             cu_seqlens=np.asarray(PACKED_CU))
            row = {"regime": regime, "law": law, "cu_seqlens": PACKED_CU, "heads": 2}
            for mode in MODES:
                out, state = kernel(mode, a, cu_seqlens=cu, initial_state=state0)
                empty_kept = bool(np.array_equal(np.asarray(state)[[0, 2]],
                                                 np.asarray(state0)[[0, 2]]))
                row[mode] = {"out": rel_rmse(out, want_out), "state": rel_rmse(state, want_state),
                             "empty_sequences_keep_their_f32_state": empty_kept}
            rows.append(row)
            print("  packed", json.dumps(row), flush=True)
    return rows


PARTS = {"regimes": part_regimes, "growth": part_growth, "packed": part_packed}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="fp32_accuracy.json")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequence-parallel", default="", metavar="N1,N2,...")
    args = p.parse_args()
    MODES.extend(f"fp32:sp={int(n)}" for n in args.sequence_parallel.split(",") if n)
    rng = np.random.default_rng(args.seed)
    result = {"device": str(jax.devices()[0]), "jax": jax.__version__,
              "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    for name in args.parts.split(","):
        started = time.time()
        result[name] = PARTS[name](rng)
        print(f"{name}: {time.time() - started:.0f} s", flush=True)
        with open(args.out, "w") as f:  # after every part: a timeout keeps what was measured
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
