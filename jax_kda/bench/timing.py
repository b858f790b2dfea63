"""Device-time measurement for JAX and torch callables.

JAX: one jitted program runs the op R times back to back (unrolled, so no loop control runs on
the device), each call's inputs made to depend on the previous call's outputs by a `feedback`
function (the final state becomes the next initial state; where an op takes no state, a small
input such as A_log gets `+ 0 * <one output element>`, a tiny fusion that XLA cannot fold). The
dependency stops XLA from merging identical calls (CSE) or dropping unused ones (DCE), and one
dispatch and one host synchronisation are shared by R calls. R grows until a chain takes at
least `min_chain_ms`, so the fixed cost of a launch is a small fraction of what is measured. A
sample is the wall time of one chain divided by R.

torch: R calls are captured into one CUDA graph; a sample is one replay timed with CUDA events,
divided by R. If capture fails (e.g. an op synchronises with the host), R eager calls between two
events are timed instead and the result says so.

Both are Samplers (compiled, chain length fixed, warmed up); `collect` takes a sampler's repeats
one after the other, `interleave` takes several samplers' repeats in turns, so that a slow drift
of the device (clocks, temperature) over a case reaches every variant alike.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

MAX_CHAIN = 512


@dataclasses.dataclass
class Timing:
    samples_us: list[float]  # per call, one per repetition
    inner: int  # calls per sample (R)
    method: str

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    def summary(self) -> dict:
        xs = sorted(self.samples_us)
        return {
            "median_us": self.median_us,
            "min_us": xs[0],
            "max_us": xs[-1],
            "mean_us": statistics.fmean(xs),
            "p20_us": _quantile(xs, 0.2),
            "p80_us": _quantile(xs, 0.8),
            "repeats": len(xs),
            "inner": self.inner,
            "timer": self.method,
            "samples_us": list(self.samples_us),
        }


def _quantile(sorted_xs, q):
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


@dataclasses.dataclass
class Sampler:
    """A timed program, compiled and warmed up: run() executes its `inner` calls once and returns
    the seconds they took."""

    run: Callable[[], float]
    inner: int
    method: str

    def sample_us(self) -> float:
        return self.run() / self.inner * 1e6


def collect(sampler: Sampler, repeats: int) -> Timing:
    return Timing([sampler.sample_us() for _ in range(repeats)], sampler.inner, sampler.method)


def interleave(samplers: list[Sampler], repeats: int) -> list[Timing]:
    """One sample of each sampler per round, `repeats` rounds (the order within a round fixed)."""
    samples: list[list[float]] = [[] for _ in samplers]
    for _ in range(repeats):
        for sampler, xs in zip(samplers, samples):
            xs.append(sampler.sample_us())
    return [Timing(xs, s.inner, f"{s.method}, interleaved with {len(samplers) - 1} other(s)")
            for s, xs in zip(samplers, samples)]


def chain_jax(fn, inner: int, feedback):
    """jit(args -> outputs of the last of `inner` calls of fn, call i+1 on
    feedback(args, outs_i))."""
    import jax

    def chained(*args):
        outs = None
        for _ in range(inner):
            outs = fn(*args)
            args = tuple(feedback(args, outs))
        return outs

    return jax.jit(chained)


def jax_sampler(fn, args, feedback, *, warmup: int, inner: int, min_chain_ms: float,
                compile_chain=chain_jax, carry=None, calls: str = "dependent calls") -> Sampler:
    """The jitted chain of `inner` calls (grown until one run takes min_chain_ms), compiled and
    warmed up. compile_chain(fn, inner, feedback) builds the program; carry(args, outputs), if
    given, updates the argument list in place after every run (a donated buffer's successor)."""
    import jax

    args = list(args)

    def run_once(compiled):
        start = time.perf_counter()
        outs = jax.block_until_ready(compiled(*args))
        elapsed = time.perf_counter() - start
        if carry is not None:
            carry(args, outs)
        return elapsed

    compiled = compile_chain(fn, inner, feedback)
    run_once(compiled)  # compile
    elapsed = run_once(compiled)
    while min_chain_ms > 0 and elapsed * 1e3 < min_chain_ms and inner < MAX_CHAIN:
        per_call = max(elapsed / inner, 1e-7)
        inner = min(MAX_CHAIN, max(2 * inner, int(1.2 * min_chain_ms * 1e-3 / per_call) + 1))
        compiled = compile_chain(fn, inner, feedback)
        run_once(compiled)
        elapsed = run_once(compiled)
    for _ in range(warmup):
        run_once(compiled)
    return Sampler(lambda: run_once(compiled), inner,
                   f"jit chain of {inner} {calls}, wall clock / {inner}")


def time_jax(fn, args, feedback, *, repeats: int, warmup: int, inner: int,
             min_chain_ms: float) -> Timing:
    return collect(jax_sampler(fn, args, feedback, warmup=warmup, inner=inner,
                               min_chain_ms=min_chain_ms), repeats)


def torch_sampler(fn, *, warmup: int, inner: int) -> Sampler:
    """fn() launches the op on the current CUDA stream: `inner` calls in one CUDA graph (eager if
    capture fails), warmed up, timed with CUDA events."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (and autotune) outside the graph
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        launch, method = graph.replay, f"CUDA graph of {inner} calls, CUDA events / {inner}"
        graph.replay()
    except Exception as err:  # noqa: BLE001 - any capture failure falls back to eager timing
        torch.cuda.synchronize()

        def launch():
            for _ in range(inner):
                fn()

        method = (f"eager, {inner} calls between CUDA events / {inner} "
                  f"(graph capture failed: {type(err).__name__}: {str(err)[:120]})")
    torch.cuda.synchronize()

    def run():
        start.record()
        launch()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3  # ms -> s

    return Sampler(run, inner, method)


def time_torch(fn, *, repeats: int, warmup: int, inner: int) -> Timing:
    """fn() launches the op on the current CUDA stream."""
    return collect(torch_sampler(fn, warmup=warmup, inner=inner), repeats)
