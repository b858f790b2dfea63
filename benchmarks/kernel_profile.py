"""Where a training step's GPU time goes, kernel by kernel: jax.profiler's device trace of a few
steps (jax.grad of benchmarks/training_step.py's loss, or its value_and_grad), summed by kernel
name, per step.

    python benchmarks/kernel_profile.py --heads 12 --seqlen 8192 --variant backward [--hlo bwd.hlo]

Prints the kernels that take most of the time (name, launches per step, microseconds per step,
share of the step's kernel time) and writes every kernel's row to --out; --hlo writes the compiled
program's HLO text, where a fusion's name (with "." for its last "_") shows its ops and shapes.
Kernel time is the sum of the kernels' durations on the device, without the gaps between them;
XLA launches its fusions with programmatic dependent launch, so durations overlap and their sum
exceeds the step's wall time: read shares, not sums.
"""

from __future__ import annotations

import argparse
import collections
import glob
import tempfile

import jax
import numpy as np
from training_step import make_inputs, packed_cu_seqlens, variants, write_rows


def kernel_times(trace_dir: str) -> dict[str, list[int]]:
    """Durations (ns) of every kernel on the GPU planes of the trace in `trace_dir`, by name."""
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    times = collections.defaultdict(list)
    seen = []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        seen += [f"{plane.name}: {line.name}" for line in plane.lines]
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():  # not the per-op or per-module summaries
                continue
            print(f"counting {plane.name}: {line.name}")
            for event in line.events:
                times[event.name].append(event.duration_ns)
    if not times:
        print("no GPU stream events in the trace; its lines:", "; ".join(seen[:40]))
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--packed", type=int, default=1)
    p.add_argument("--variant", default="backward", help="a variant of training_step.py")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    p.add_argument("--hlo", default=None,
                   help="also write the compiled program's HLO text here (fusion names to ops)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.heads)
    x = make_inputs(rng, args.seqlen, args.heads, args.packed)
    weights = (jax.numpy.asarray(rng.standard_normal((1, args.seqlen, args.heads, 128)),
                                 jax.numpy.float32),
               jax.numpy.asarray(rng.standard_normal((args.packed, args.heads, 128, 128)),
                                 jax.numpy.float32))
    step = jax.jit(variants(weights, packed_cu_seqlens(args.seqlen, args.packed))[args.variant])
    jax.block_until_ready(step(x))
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(step.lower(x).compile().as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(args.steps):
                jax.block_until_ready(step(x))
        times = kernel_times(trace_dir)
    rows = sorted(({"kernel": name, "launches": len(ns) / args.steps,
                    "us_per_step": sum(ns) / args.steps / 1e3} for name, ns in times.items()),
                  key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"T={args.seqlen} H={args.heads} packed={args.packed} {args.variant}: "
          f"{total:.0f} us of kernels per step, {sum(r['launches'] for r in rows):.0f} launches")
    for r in rows[:args.top]:
        print(f"{r['us_per_step']:9.1f} us {100 * r['us_per_step'] / total:5.1f} % "
              f"x{r['launches']:<4.0f} {r['kernel'][:110]}")
    if args.out:
        write_rows(args.out, [dict(r, heads=args.heads, seqlen=args.seqlen, variant=args.variant)
                              for r in rows])


if __name__ == "__main__":
    main()
