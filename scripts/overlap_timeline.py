"""Kernel timeline of the overlapped prefill on the GPU (CUPTI through torch.profiler, which records
every kernel of the process, JAX's included): for one case, the two separate calls and the fused
call one after the other and side by side; prints each kernel's start and end relative to the
call's first kernel (us). Needs torch with CUDA.

  python scripts/overlap_timeline.py [--heads 12] [--split 16] [--prepare-ctas 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import tempfile

import jax
import torch

from jax_kda.bench.cases import Case

_spec = importlib.util.spec_from_file_location(
    "overlap_schedule", pathlib.Path(__file__).parents[1] / "benchmarks" / "overlap_schedule.py")
schedule = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(schedule)


def kernels_of(fn, args, calls=3):
    """[(name, start us, end us)] of the last call's kernels (the others warm up)."""
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))
    path = pathlib.Path(tempfile.mkdtemp()) / "trace.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            jax.block_until_ready(jitted(*args))
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"]
              if e.get("cat") in ("kernel", "gpu_memset") and "dur" in e]
    events.sort(key=lambda e: e["ts"])
    per_call = len(events) // calls
    last = events[-per_call:]
    t0 = last[0]["ts"]
    return [(e["name"][:60], e["ts"] - t0, e["ts"] + e["dur"] - t0) for e in last]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--split", type=int, default=16)
    ap.add_argument("--prepare-ctas", type=int, default=4)
    args = ap.parse_args()
    operands = schedule.operands(Case((args.seqlen,), args.heads))
    for label, fn in (("two calls", schedule.two_calls(args.split)),
                      ("fused, one after the other", schedule.fused(args.split, 0)),
                      (f"fused, side by side ({args.prepare_ctas} prepare CTAs/SM)",
                       schedule.fused(args.split, args.prepare_ctas))):
        print(f"== T{args.seqlen} H{args.heads} bv{args.split}: {label}")
        for name, start, end in kernels_of(fn, operands):
            print(f"  {start:8.1f} .. {end:8.1f} us  ({end - start:7.1f})  {name}")


if __name__ == "__main__":
    main()
