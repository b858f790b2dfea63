"""The decode variants a benchmark can time on a DecodeCase, how they are timed, and the report of
achieved state bandwidth against the copy-rate floor.

Variants (each one decode step of N sequences x t tokens on a pool of P state rows, in the
variant's numerics mode):
  decode          jax_kda.kda_decode(state=pool, state_indices=, backend="kernel"): what a decode
                  step runs in that mode (flashkda: the fused decode kernel, one launch).
  decode_prefill  the same step through kda_prefill(initial_state=pool, state_indices=,
                  output_final_state=True, backend="kernel"): the prepare and the pool
                  recurrence kernels. Same bits as `decode`; for comparison.
  reference       kda_decode(backend="reference"): the pure-JAX path, which runs anywhere.
fla's fused_recurrent_kda_fwd (torch_compare) times the same step on a torch pool in place.

Timing, as a decode loop runs: R steps chained in one jitted program (jax_kda.bench.timing's
chain), each step's updated pool the next step's input; every custom call updates the pool in
place (aliased), the program's pool argument is donated, and each sample passes the pool that
the previous one returned, so no step and no sample copies the pool. The inputs other than the
pool are the same every step; where a kernel does not read the pool (the prepare kernel of
decode_prefill), A_log gets `+ 0 * <one pool element>` so that XLA cannot merge its R calls.

The floor of a step is the state it must move, N x H x 128 x 128 elements read once and written
once, at the copy rate (about 4.3 TB/s read + write on an H200): every row of the report shows the
achieved bandwidth, state bytes / median time.
"""

from __future__ import annotations

from . import timing
from .cases import DecodeCase
from .jax_variants import Variant, VariantUnavailable, kernels_status, zero_times

KINDS = ("decode", "decode_prefill")  # with "reference", which runs on both kinds of case
POOL = 7  # the pool among a step's arguments: q, k, v, g, beta, A_log, dt_bias, pool, idx
COPY_TB_S = 4.3  # H200 copy rate, read + write, TB/s


def decode_kernels_status() -> tuple[bool, str]:
    """(available, why not) for the fused decode kernel: the GPU kernels, and decode kernels
    among those built into the FFI library."""
    ok, why = kernels_status()
    if not ok:
        return ok, why
    from .. import _ffi

    if not any(name.startswith("jax_kda_decode_") for name in _ffi.built_kernels()):
        return False, "the FFI library holds no decode kernels (jax_kda_decode_*)"
    return True, ""


def _options(inverse: str, numerics: str) -> dict:
    return {"scale": 128**-0.5, "lower_bound": -5.0, "inverse": inverse, "numerics": numerics}


def decode_step(backend: str, inverse: str = "stable", numerics: str = "flashkda"):
    """fn(q, k, v, g, beta, A_log, dt_bias, pool, idx) -> (out, pool): one kda_decode step."""
    from .. import kda_decode

    def step(q, k, v, g, beta, A_log, dt_bias, pool, idx):
        return kda_decode(q, k, v, g, beta, A_log, dt_bias, state=pool, state_indices=idx,
                          backend=backend, **_options(inverse, numerics))

    return step


def prefill_step(backend: str, inverse: str = "stable", numerics: str = "flashkda"):
    """The same step through kda_prefill on the pool (B = N sequences of T = t tokens)."""
    from .. import kda_prefill

    def step(q, k, v, g, beta, A_log, dt_bias, pool, idx):
        return kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state=pool,
                           state_indices=idx, output_final_state=True, backend=backend,
                           **_options(inverse, numerics))

    return step


def _pool_feedback(args, outs):
    """The next step starts from this step's pool; everything else stays."""
    args = list(args)
    args[POOL] = outs[1]
    return tuple(args)


def _prefill_feedback(args, outs):
    """As _pool_feedback, and A_log depends on the pool: the prepare kernel reads no state, so
    its R identical calls would otherwise be merged into one."""
    q, k, v, g, beta, A_log, dt_bias, _, idx = args
    pool = outs[1]
    return q, k, v, g, beta, A_log + zero_times(pool), dt_bias, pool, idx


def _reference_feedback(args, outs):
    """As _pool_feedback, plus a dependency on every output element (XLA would otherwise drop
    the reference's output computation, which nothing else uses)."""
    import jax.numpy as jnp

    q, k, v, g, beta, A_log, dt_bias, _, idx = args
    out, pool = outs
    return (q, k, v, g, beta, A_log + 0.0 * jnp.sum(out.astype(jnp.float32)), dt_bias, pool,
            idx)


def build(variant: Variant, case: DecodeCase, x: dict, *, inverse: str):
    """(fn, args, feedback, info) for a decode variant on a decode case's (jax) inputs x, as
    jax_variants.build gives for prefill; args[POOL] is a copy of x["pool"] of the variant's
    own, which timing donates."""
    import jax.numpy as jnp

    mode = variant.numerics
    if variant.kind == "reference":
        fn, feedback = decode_step("reference", inverse, mode), _reference_feedback
    elif variant.kind == "decode":
        ok, why = decode_kernels_status()
        if not ok:
            raise VariantUnavailable(why)
        fn, feedback = decode_step("kernel", inverse, mode), _pool_feedback
    elif variant.kind == "decode_prefill":
        ok, why = kernels_status()
        if not ok:
            raise VariantUnavailable(why)
        fn, feedback = prefill_step("kernel", inverse, mode), _prefill_feedback
    else:
        raise ValueError(f"unknown decode variant kind {variant.kind!r}")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
            jnp.array(x["pool"], copy=True), x["state_indices"])
    return fn, args, feedback, {}


def chain(fn, inner: int, feedback):
    """timing.chain_jax's program of `inner` chained steps, with the pool argument donated."""
    import jax

    return jax.jit(timing.chain_jax(fn, inner, feedback), donate_argnums=(POOL,))


def decode_sampler(fn, args, feedback, *, warmup: int, inner: int,
                   min_chain_ms: float) -> timing.Sampler:
    """timing.jax_sampler for a step on a donated pool: each run of the chain takes the pool the
    previous run returned (the first run's pool is args[POOL], which it consumes)."""
    def next_pool(args, outs):
        args[POOL] = outs[1]

    return timing.jax_sampler(fn, args, feedback, warmup=warmup, inner=inner,
                              min_chain_ms=min_chain_ms, compile_chain=chain, carry=next_pool,
                              calls="dependent steps on a donated pool")


# --- the report -------------------------------------------------------------------------------

def add_floors(results: list[dict], copy_tb_s: float = COPY_TB_S) -> None:
    """On every decode row (one with state_bytes): floor_us = state bytes / the copy rate;
    and where timed, achieved_tb_s = state bytes / median and of_copy_rate = floor / median."""
    for r in results:
        if "state_bytes" not in r:
            continue
        r["copy_tb_s"] = copy_tb_s
        r["floor_us"] = r["state_bytes"] / (copy_tb_s * 1e12) * 1e6
        if r.get("status") == "ok" and r.get("median_us", 0) > 0:
            r["achieved_tb_s"] = r["state_bytes"] / r["median_us"] * 1e-6
            r["of_copy_rate"] = r["floor_us"] / r["median_us"]


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] != "ok":
        return r["status"]
    text = f"{r['median_us']:.1f}"
    if r.get("ratio_vs_baseline") is not None:
        text += f" ({r['ratio_vs_baseline']:.2f}x)"
    if r.get("achieved_tb_s") is not None:
        bw = r["achieved_tb_s"]
        text += f" {bw:.2f} TB/s" if bw >= 0.01 else f" {bw:.1e} TB/s"
    return text


def format_table(cases: list[dict], variants: list[str], results: list[dict], baseline,
                 copy_tb_s: float = COPY_TB_S) -> str:
    """Decode cases as rows: the state a step moves, its floor, and per variant the median us
    per step (speedup vs the baseline) and the achieved state bandwidth."""
    by_key = {(r["case"], r["variant"]): r for r in results}
    headers = ["case", "state MB", "floor us"] + variants
    rows = []
    for c in cases:
        floor = c["state_bytes"] / (copy_tb_s * 1e12) * 1e6
        rows.append([c["name"], f"{c['state_bytes'] / 1e6:.1f}", f"{floor:.1f}"]
                    + [_cell(by_key.get((c["name"], v))) for v in variants])
    widths = [max(len(row[i]) for row in [headers] + rows) for i in range(len(headers))]

    def line(cells):
        return "  ".join(cell.rjust(w) if i else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]
    note = "decode: median us per step"
    if baseline:
        note += f"; (Nx) = {baseline} time / this time, > 1 is faster"
    note += (f"; TB/s = state bytes read + written / median; floor = state bytes / "
             f"{copy_tb_s:g} TB/s")
    out.append(note)
    names = {c["name"] for c in cases}
    problems = [r for r in results if r["status"] != "ok" and r["case"] in names]
    for reason in sorted({r.get("error") or r["status"] for r in problems}):
        which = sorted({r["variant"] for r in problems
                        if (r.get("error") or r["status"]) == reason})
        out.append(f"not timed ({', '.join(which)}): {reason}")
    return "\n".join(out)
