"""Where the time of a sequence-parallel fp32 prefill goes: each part timed alone, beside the whole
call and the serial fp32 prefill, in one process (jax_kda._sequence_parallel).

For one sequence of T tokens and H heads cut into n pieces: the prepare kernel over the pieces;
one recurrence pass over them at every column split (the plan runs three); the combine (both
methods, f32 and bf16x3 products); the whole kda_prefill(sequence_parallel=n)
and the serial one. Jit chains of dependent calls, medians (jax_kda.bench.timing).

  python benchmarks/sequence_parallel_parts.py --out sp_parts.json [--seqlen 32768,65536]
      [--heads 1,4,8] [--segments 8,16,32]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
from heuristic_grid import device_inputs  # beside this file

import jax_kda
from jax_kda import _ffi, _launch, _sequence_parallel, contract
from jax_kda.bench import timing

# the combine's products: f32 (the library's) and three bf16 MMAs (the kernels' own hi/lo
# arithmetic), timed for comparison
COMBINE_PRECISIONS = {"f32": jax.lax.Precision.HIGHEST,
                      "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3}


def timed(fn, args, feedback, repeats):
    # two calls per sample, no chain growth: a chain of tens of combines compiles for minutes
    t = timing.time_jax(fn, args, feedback, repeats=repeats, warmup=2, inner=2, min_chain_ms=0)
    return t.median_us


def parts(T, H, n, repeats):
    x = device_inputs(jax.random.key(T + H), 1, T, H)
    flat = {k: x[k][0] for k in ("q", "k", "v", "g", "beta")}
    cu = jnp.asarray([0, T], jnp.int32)
    length = _sequence_parallel.segment_length(T, n)
    capacity = _sequence_parallel.piece_capacity(num_seqs=1, total_tokens=T, varlen=False,
                                                 length=length)
    piece_cu = _sequence_parallel.pieces(cu, capacity=capacity, length=length)[0]
    row = {"T": T, "heads": H, "segments": n, "pieces": capacity,
           "auto_block_v": _launch.choose_block_v(num_seqs=capacity, heads=H, numerics="fp32")}

    def prepare(q, k, g, beta, A_log, dt_bias, piece_cu):
        return _ffi.prepare_call(q, k, g, beta, A_log, dt_bias, piece_cu, scale=128**-0.5,
                                 lower_bound=-5.0, inverse="stable", numerics="fp32")

    p_args = (flat["q"], flat["k"], flat["g"], flat["beta"], x["A_log"], x["dt_bias"], piece_cu)
    row["prepare_us"] = timed(prepare, p_args, lambda a, ws: a, repeats)
    workspace = jax.block_until_ready(jax.jit(prepare)(*p_args))
    states = jnp.zeros((capacity, H, 128, 128), jnp.float32)
    for bv in contract.COLUMN_SPLITS:
        def recurrence(v, beta, ws, cu_, s, launch=bv):
            return _ffi.recurrence_call(v, beta, ws, cu_, s, launch=launch, alias_state=False,
                                        numerics="fp32")

        row[f"pass_bv{bv}_us"] = timed(recurrence, (flat["v"], flat["beta"], workspace, piece_cu,
                                                    states),
                                       lambda a, o: (*a[:4], o[1]), repeats)
    first = jnp.arange(capacity) == 0
    m = jnp.broadcast_to(jnp.eye(128, dtype=jnp.float32), states.shape) * 0.9
    e = 0.01 * jax.random.normal(jax.random.key(1), states.shape, jnp.float32)
    for method in _sequence_parallel.COMBINES:
        for name, precision in COMBINE_PRECISIONS.items():
            fn = functools.partial(_sequence_parallel.combine, method=method, precision=precision)
            row[f"combine_{method}_{name}_us"] = timed(fn, (first, m, e),
                                                       lambda a, out: (a[0], a[1], out), repeats)
    del workspace

    def total(segments):
        def fn(x_, s):
            out, final = jax_kda.kda_prefill(
                x_["q"], x_["k"], x_["v"], x_["g"], x_["beta"], x_["A_log"], x_["dt_bias"],
                initial_state=s, output_final_state=True, backend="kernel", numerics="fp32",
                sequence_parallel=segments)
            return out, final
        return timed(fn, (x, jnp.zeros((1, H, 128, 128), jnp.float32)),
                     lambda a, o: (a[0], o[1]), repeats)

    row["total_us"] = total(n)
    row["serial_us"] = total("off")
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", default="32768")
    p.add_argument("--heads", default="1,4,8")
    p.add_argument("--segments", default="8,16,32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="sp_parts.json")
    args = p.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]
    rows, started = [], time.time()
    for T in ints(args.seqlen):
        for H in ints(args.heads):
            for n in ints(args.segments):
                row = parts(T, H, n, args.repeats)
                rows.append(row)
                print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v)
                                  for k, v in row.items()}), f"[{time.time() - started:.0f} s]",
                      flush=True)
                with open(args.out, "w") as f:
                    json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__,
                               "sm_count": _launch.gpu_sm_count(),
                               "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                               "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
