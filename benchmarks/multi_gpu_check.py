"""Head-sharded KDA prefill on every visible GPU: bitwise check + timing per GPU count.

For each GPU count d in 1, 2, 4, ... up to the visible count: heads H = 12 * d_max (and 48 * d_max)
sharded over a mesh of d GPUs. Checks that the sharded result equals a single-GPU call on all
heads, bit for bit, and that the compiled HLO holds no collectives; then times the sharded call
(median of jitted chained runs) so per-GPU time can be read against the local head count. Writes
JSON to argv[1].
"""

from __future__ import annotations

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def inputs(rng, T, H):
    def bf16(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)

    return dict(q=bf16(1, T, H, 128), k=bf16(1, T, H, 128), v=bf16(1, T, H, 128),
                g=bf16(1, T, H, 128), beta=bf16(1, T, H),
                A_log=jnp.asarray(rng.uniform(-2, 1, H), jnp.float32),
                dt_bias=jnp.asarray(rng.standard_normal((H, 128)), jnp.float32))


def median_ms(fn, args, repeats=20):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main(out_path):
    results = [run_heads(per_gpu_heads) for per_gpu_heads in (12, 48)]
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def run_heads(per_gpu_heads):
    """H = per_gpu_heads x (most GPUs) heads, sharded over 1, 2, 4, ... GPUs."""
    gpus = jax.devices("gpu")
    counts = [d for d in (1, 2, 4, 8) if d <= len(gpus)]
    T = 8192
    H = per_gpu_heads * counts[-1]
    rng = np.random.default_rng(0)
    x = inputs(rng, T, H)
    x0 = jax.device_put(x, gpus[0])
    single = jax.jit(lambda a: jax_kda.kda_prefill(**a, backend="kernel", output_final_state=True))
    want = single(x0)
    results = {"gpu": gpus[0].device_kind, "T": T, "heads": H, "runs": []}
    single_ms = median_ms(single, (x0,))
    results["single_gpu_all_heads_ms"] = single_ms
    print(f"1 GPU, all {H} heads, plain call: {single_ms:.3f} ms")
    for d in counts:
        mesh = jax.make_mesh((d,), ("tp",), devices=gpus[:d])
        fn = jax.jit(functools.partial(jax_kda.kda_prefill_sharded, mesh=mesh, head_axis="tp",
                                       output_final_state=True, backend="kernel"))
        specs = jax_kda.sharding.head_specs("tp")
        names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")  # already head-sharded, as in TP
        args = [jax.device_put(x[k], jax.sharding.NamedSharding(mesh, specs[k])) for k in names]
        hlo = fn.lower(*args).compile().as_text()
        found = [c for c in COLLECTIVES if c in hlo]
        got = fn(*args)
        equal = all(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
                    for a, b in zip(got, want))
        ms = median_ms(fn, args)
        print(f"{d} GPU(s), {H // d} heads each: {ms:.3f} ms, bitwise equal to 1-GPU: {equal}, "
              f"collectives: {found or 'none'}")
        results["runs"].append({"gpus": d, "local_heads": H // d, "ms": ms, "bitwise_equal": equal,
                                "collectives": found})
        assert equal and not found
    return results


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "multi_gpu.json")
