"""`python -m jax_kda.bench`: time jax_kda's kernels (and others) over a set of cases.

Examples:
  python -m jax_kda.bench                                  # the baseline cases on a GPU
  python -m jax_kda.bench --seqlen 8192 --heads 96,12,6 --compare fla --compare flashkda
  python -m jax_kda.bench --variants recurrence --block-v 32,64,128,auto --seqlen 8192 --heads 6
  python -m jax_kda.bench --block-v 16,32,baseline \
      --total-block-v baseline,auto                   # the baseline kernel too
  python -m jax_kda.bench --numerics flashkda,fp32 --compare jla  # both numerics modes, and jla
  python -m jax_kda.bench --preset long-context --numerics fp32 --variants total \
      --total-block-v auto --sequence-parallel 4,16     # serial vs sequence-parallel fp32
  python -m jax_kda.bench --variants reference --seqlen 64 --heads 2   # CPU, tiny
  python -m jax_kda.bench --preset decode --compare fla    # decode steps on a state pool, GPU
  python -m jax_kda.bench --decode 256,12,1 --state-dtype bf16 --pool-extra 64
  python -m jax_kda.bench --preset decode-tiny             # decode on a CPU, with the reference
  python -m jax_kda.bench --preset throughput --total-block-v auto,baseline --interleave
      # variants of a case timed in turns (one sample each per round): for small differences
  python -m jax_kda.bench --preset training --numerics flashkda,fp32 --compare jla-train \
      --compare fla-train   # forward ("total"), forward + backward ("train") and the backward
      # alone ("backward") of one loss, beside jla's and fla's forward + backward
      # (jax_kda/bench/training.py; fla autotunes its backward for minutes per new shape)

Decode cases (--preset decode, --decode N,H,t) time one decode step of N sequences x H heads, t
tokens each, on a state pool (bf16 or f32) picked by a permutation of its rows: `decode` (the
fused kernel through kda_decode), `decode_prefill` (the same step through kda_prefill on the
pool), `reference`, and with --compare fla fla's fused_recurrent_kda_fwd; each row shows the
achieved state bandwidth against the floor, the state read + written at --copy-tb-s.

With --numerics flashkda,fp32 the jax_kda variants (prepare, recurrence, total, reference) are
timed in each numerics mode of kda_prefill; the fp32 mode's are named with its tag (prepare:fp32,
total:fp32:bv=auto), the default mode's as before (total:bv=auto). --compare jla times
jax-linear-attention's Mosaic GPU kda (Hopper) through JAX, on batched and single-sequence cases.

Results (<tag>.json, .csv, .png) go to --out, by default $XDG_CACHE_HOME/jax_kda/bench
(~/.cache/jax_kda/bench when XDG_CACHE_HOME is not set), outside any source tree; the command
prints where. Give --out benchmarks/results to add a run to the repository's committed results.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import os
import platform
import re
import sys
import traceback
from pathlib import Path

from ..contract import NUMERICS
from . import cases as cases_mod
from . import decode_variants
from .jax_variants import (
    AUTO,
    BASELINE,
    FLASHKDA,
    KINDS,
    TRAINING_KINDS,
    Variant,
    VariantUnavailable,
    kernels_status,
)
from .progress import progress_bar
from .torch_compare import BUILDERS as TORCH_PEERS
from .torch_compare import COMPARE_CHOICES

PREFILL_KINDS = ("prepare", "recurrence", "total")  # the kernel variants of prefill cases
TRAINING_PRESET_KINDS = ("total",) + TRAINING_KINDS  # the training preset's default variants
# never on decode cases
PREFILL_ONLY = PREFILL_KINDS + TRAINING_KINDS + ("jla-train", "fla-train")
DEFAULT_BLOCK_V = "16,32,64,128,auto"
DEFAULT_TOTAL_BLOCK_V = "128,auto"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_kda.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("cases (default: the baselines preset with kernels, else 'tiny')")
    g.add_argument("--preset", choices=sorted(cases_mod.PRESETS),
                   help="a named set of cases; combined with the cases below if both are given")
    g.add_argument("--seqlen", help="comma-separated sequence lengths T, e.g. 8192,2048")
    g.add_argument("--heads", help="comma-separated head counts (default 96,48,24,12,6)")
    g.add_argument("--num-seqs", type=int, default=1,
                   help="sequences of length T per --seqlen case (default 1)")
    g.add_argument("--layout", choices=("varlen", "batched"), default="varlen",
                   help="how --num-seqs > 1 sequences are passed (default: packed with cu_seqlens)")
    g.add_argument("--varlen", action="append", default=[], metavar="L1,L2,...",
                   help="a packed variable-length case (repeatable), "
                   "e.g. 1300,547,2048,963,271,3063")
    g.add_argument("--decode", action="append", default=[], metavar="N,H[,t]",
                   help="a decode case (repeatable): N sequences x H heads, t tokens each "
                   "(default 1), once per --state-dtype")
    g.add_argument("--state-dtype", default="bf16,f32",
                   help="pool dtypes of the --decode cases (default bf16,f32)")
    g.add_argument("--pool-extra", type=int, default=0,
                   help="pool rows beyond N for the --decode cases (default 0: P = N)")
    g = p.add_argument_group("what to time")
    g.add_argument("--variants", help="comma-separated subset of "
                   f"{','.join(KINDS + decode_variants.KINDS)} (default: prepare,recurrence,total "
                   "for prefill cases and decode,decode_prefill for decode cases with kernels, "
                   "else reference)")
    g.add_argument("--block-v", default=DEFAULT_BLOCK_V,
                   help=f"block_v values for 'recurrence' (default {DEFAULT_BLOCK_V}; "
                   "128 = one CTA per head, auto = the launch heuristic, baseline = the baseline "
                   "recurrence kernel: one CTA per head, state in shared memory)")
    g.add_argument("--total-block-v", default=DEFAULT_TOTAL_BLOCK_V,
                   help=f"block_v values for 'total' (default {DEFAULT_TOTAL_BLOCK_V}; "
                   "also auto and baseline)")
    g.add_argument("--sequence-parallel", default="", metavar="N1,N2,...",
                   help="also time each fp32 'total' variant with kda_prefill(sequence_parallel=N) "
                   "for these segment counts or 'auto' (named ...:sp=N; the plain fp32 variants "
                   "run sequence_parallel='off')")
    g.add_argument("--numerics", default=FLASHKDA,
                   help=f"comma-separated numerics modes of kda_prefill, of {','.join(NUMERICS)} "
                   "(default flashkda): the jax_kda variants are timed once per mode, those of a "
                   "mode other than flashkda named with its tag (e.g. total:fp32:bv=auto); "
                   "decode cases time flashkda only")
    g.add_argument("--compare", action="append", default=[], choices=COMPARE_CHOICES,
                   help="also time fla's chunk_kda or FlashKDA through torch, or jla's Mosaic GPU "
                   "kda through JAX (repeatable; jla-train, fla-train: the peer's forward + "
                   "backward of the training loss); on decode cases fla is its "
                   "fused_recurrent_kda_fwd on the same pool")
    g.add_argument("--baseline", help="variant the ratios are relative to (default total:bv=128 "
                   "when timed, else the first variant; on decode cases decode, else the first), "
                   "e.g. total:bv=baseline for the baseline kernel")
    g.add_argument("--inverse", choices=("stable", "neumann"), default="stable")
    g = p.add_argument_group("timing")
    g.add_argument("--repeats", type=int, default=20,
                   help="samples per variant (median; default 20)")
    g.add_argument("--warmup", type=int, default=3, help="untimed runs after compilation")
    g.add_argument("--inner", type=int,
                   help="initial calls per JAX sample (default 4 on GPU, 1 on CPU)")
    g.add_argument("--min-chain-ms", type=float,
                   help="grow the calls per sample until one sample takes this long "
                   "(default 5 on GPU, 0 = off on CPU)")
    g.add_argument("--torch-inner", type=int, default=10, help="calls per CUDA graph for torch")
    g.add_argument("--interleave", action="store_true",
                   help="build every variant of a case first, then take their samples in turns "
                   "(one of each per round), so that a drift of the device reaches all alike")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--copy-tb-s", type=float, default=decode_variants.COPY_TB_S,
                   help="copy rate (read + write, TB/s) of the decode floor (default "
                   f"{decode_variants.COPY_TB_S}, an H200)")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=None,
                   help="output folder (default $XDG_CACHE_HOME/jax_kda/bench, else "
                   "~/.cache/jax_kda/bench)")
    g.add_argument("--tag", help="file name stem (default <device>-<UTC time>)")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--dry-run", action="store_true", help="list cases and variants, run nothing")
    return p


def default_out_dir() -> Path:
    """Where results go without --out: the user's cache folder, never the current directory
    (which is often a source checkout). $XDG_CACHE_HOME is used only when it is an absolute path,
    as the XDG base directory specification asks."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(cache) if cache and Path(cache).is_absolute() else Path.home() / ".cache"
    return base / "jax_kda" / "bench"


def _parse_block_v(text: str, what: str) -> list[int | str]:
    from ..contract import COLUMN_SPLITS as BLOCK_V_CHOICES

    values: list[int | str] = []
    for part in (s.strip() for s in text.split(",") if s.strip()):
        value: int | str = int(part) if part.isdigit() else part
        if value not in (AUTO, BASELINE, *BLOCK_V_CHOICES):
            raise ValueError(f"{what}: block_v must be one of {BLOCK_V_CHOICES}, {AUTO} or "
                             f"{BASELINE}, got {part}")
        values.append(value)
    return values


def _parse_numerics(text: str) -> list[str]:
    values = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [v for v in values if v not in NUMERICS]
    if bad or not values:
        raise ValueError(f"--numerics: expected a comma-separated subset of {','.join(NUMERICS)}, "
                         f"got {text!r}")
    return values


def _kind_variants(kind: str, args, numerics: str) -> list[Variant]:
    """One kind's variants in one numerics mode: a variant per --block-v / --total-block-v value
    for the recurrence and total kinds, one otherwise."""
    if kind == "recurrence":
        return [Variant(kind, bv, numerics) for bv in _parse_block_v(args.block_v, "--block-v")]
    if kind == "total":
        plain = [Variant(kind, bv, numerics)
                 for bv in _parse_block_v(args.total_block_v, "--total-block-v")]
        if numerics != "fp32":
            return plain
        counts = _parse_segments(args.sequence_parallel)
        return plain + [dataclasses.replace(v, segments=n) for v in plain for n in counts]
    return [Variant(kind, numerics=numerics)]


def _parse_segments(text: str) -> tuple[int | str, ...]:
    """--sequence-parallel: segment counts and "auto" (the plan), comma-separated."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    return tuple(w if w == "auto" else cases_mod.parse_int_list(w, "--sequence-parallel")[0]
                 for w in words)


def _variants(args, kernels_ok: bool, cases=()) -> list[Variant]:
    if args.variants:
        kinds = [s.strip() for s in args.variants.split(",") if s.strip()]
    elif args.preset == "training":
        kinds = list(TRAINING_PRESET_KINDS)
    elif not kernels_ok:
        kinds = ["reference"]
    else:
        kinds = []
        if any(c.kind == "prefill" for c in cases) or not cases:
            kinds += list(PREFILL_KINDS)
        if any(c.kind == "decode" for c in cases):
            kinds += list(decode_variants.KINDS)
    known = KINDS + decode_variants.KINDS
    unknown = [k for k in kinds if k not in known]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {known}")
    out: list[Variant] = []
    for numerics in _parse_numerics(args.numerics):  # each mode's variants in turn
        out += [v for kind in kinds for v in _kind_variants(kind, args, numerics)]
    out += [Variant(name) for name in dict.fromkeys(args.compare)]
    return list(dict.fromkeys(out))


def _cases(args, kernels_ok: bool):
    heads = cases_mod.parse_int_list(args.heads, "--heads") if args.heads else None
    seqlens = cases_mod.parse_int_list(args.seqlen, "--seqlen") if args.seqlen else ()
    varlens = [cases_mod.parse_int_list(v, "--varlen") for v in args.varlen]
    decodes = [cases_mod.parse_decode(d) for d in args.decode]
    preset = args.preset
    if not preset and not seqlens and not varlens and not decodes:
        preset = "baselines" if kernels_ok else "tiny"
    default_heads = cases_mod.BASELINE_HEADS if seqlens else (96,)
    return cases_mod.build_cases(preset=preset, seqlens=seqlens, heads=heads or default_heads,
                                 num_seqs=args.num_seqs, layout=args.layout, varlens=varlens,
                                 decodes=decodes,
                                 state_dtypes=cases_mod.parse_state_dtypes(args.state_dtype),
                                 pool_extra=args.pool_extra)


def _device_meta() -> dict:
    import jax

    import jax_kda

    dev = jax.devices()[0]
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device_kind": dev.device_kind, "platform": dev.platform,
        "device_count": jax.device_count(), "sm_count": getattr(dev, "core_count", None),
        "jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__")
        else None, "jax_kda": jax_kda.__version__, "python": platform.python_version(),
        "host": platform.node(), "argv": sys.argv[1:],
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def _applies(variant: Variant, case) -> bool:
    """Whether a (case, variant) pair is timed: the prefill kinds on prefill cases, the decode
    kinds on decode cases; reference and the peers on both (a peer without a decode path records
    why it was skipped), in every numerics mode asked for."""
    if variant.kind in PREFILL_ONLY:
        return case.kind == "prefill"
    if variant.kind in decode_variants.KINDS:
        return case.kind == "decode"
    return True


def _baselines(args, cases, variants) -> dict[str, str | None]:
    """The variant each kind of case is compared with: --baseline for both, else total:bv=128
    (prefill) and decode (decode cases) when timed, else the kind's first variant."""
    out = {}
    for kind, preferred in (("prefill", "total:bv=128"), ("decode", "decode")):
        if not any(c.kind == kind for c in cases):
            continue
        names = [v.name for v in variants if any(_applies(v, c) for c in cases if c.kind == kind)]
        out[kind] = args.baseline or (preferred if preferred in names else
                                      (names[0] if names else None))
    return out


def _row_numerics(variant: Variant) -> str | None:
    """The numerics mode of a results row: a jax_kda mode, None for the peers (not jax_kda's)."""
    return None if variant.kind in COMPARE_CHOICES else variant.numerics


def _compare_versions(peers) -> dict:
    from . import jla_compare, torch_compare

    found = torch_compare.versions() if set(peers) & set(TORCH_PEERS) else {}
    return found | ({"jla": jla_compare.version()} if {"jla", "jla-train"} & set(peers) else {})


def _sampler(variant, case, np_inputs, jax_inputs, args, timing_opts):
    """(timing.Sampler, info) for one variant on one case: compiled and warmed up, ready to time;
    raises VariantUnavailable where the variant cannot run."""
    from . import jax_variants, jla_compare, timing, torch_compare

    jax_opts = {"warmup": args.warmup, **timing_opts}
    if variant.kind in ("jla", "jla-train"):  # a JAX peer: timed as the jax_kda variants are
        build = jla_compare.build if variant.kind == "jla" else jla_compare.build_train
        fn, fn_args, feedback, info = build(case, jax_inputs)
        return timing.jax_sampler(fn, fn_args, feedback, **jax_opts), info
    if variant.kind in torch_compare.BUILDERS:
        fn, notes = torch_compare.BUILDERS[variant.kind](case, np_inputs)
        sampler = timing.torch_sampler(fn, warmup=args.warmup, inner=args.torch_inner)
        return sampler, ({"notes": notes} if notes else {})
    if case.kind == "decode":
        fn, fn_args, feedback, info = decode_variants.build(variant, case, jax_inputs,
                                                            inverse=args.inverse)
        return decode_variants.decode_sampler(fn, fn_args, feedback, **jax_opts), info
    fn, fn_args, feedback, info = jax_variants.build(variant, case, jax_inputs,
                                                     inverse=args.inverse)
    return timing.jax_sampler(fn, fn_args, feedback, **jax_opts), info


def _attempt(row: dict, step):
    """step()'s result, or None: a variant that cannot run is recorded in row as skipped, any
    other failure as an error (printed), and the benchmark goes on."""
    try:
        return step()
    except VariantUnavailable as why:
        row |= {"status": "skipped", "error": str(why)}
    except Exception as err:  # noqa: BLE001 - record, keep benchmarking the rest
        row |= {"status": "error", "error": f"{type(err).__name__}: {err}"}
        traceback.print_exc(file=sys.stderr)
    return None


def _measure_case(case, variants, np_inputs, jax_inputs, args, timing_opts):
    """Yields one row per variant. By default each variant's repeats are taken before the next
    variant is built; with --interleave every variant is built first and the repeats are taken
    in turns (timing.interleave), so that the variants' medians share the device's drift."""
    from . import timing

    rows = []
    for variant in variants:
        row = case.as_dict() | {"case": case.name, "variant": variant.name,
                                "kind": variant.kind, "numerics": _row_numerics(variant),
                                "block_v": variant.block_v}
        row.pop("name")
        rows.append(row)
    build = functools.partial(_sampler, case=case, np_inputs=np_inputs, jax_inputs=jax_inputs,
                              args=args, timing_opts=timing_opts)
    if not args.interleave:
        for variant, row in zip(variants, rows):
            built = _attempt(row, functools.partial(build, variant))
            if built:
                sampler, info = built
                row |= {"status": "ok"} | timing.collect(sampler, args.repeats).summary() | info
            yield row
        return
    built = [(row, _attempt(row, functools.partial(build, variant)))
             for variant, row in zip(variants, rows)]
    ready = [(row, sampler_info) for row, sampler_info in built if sampler_info]
    timings = timing.interleave([sampler for _, (sampler, _) in ready], args.repeats)
    for (row, (_, info)), t in zip(ready, timings):
        row |= {"status": "ok"} | t.summary() | info
    yield from rows


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    # leave GPU memory for the torch peers: JAX would otherwise preallocate 75% of it
    if set(args.compare) & set(TORCH_PEERS):
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from .inputs import make_inputs, to_jax
    from .report import add_ratios, format_table, write_csv, write_json, write_plot

    kernels_ok, kernels_why = kernels_status()
    on_gpu = jax.default_backend() == "gpu"
    try:
        cases = _cases(args, kernels_ok)
        variants = _variants(args, kernels_ok, cases)
    except ValueError as err:
        raise SystemExit(f"python -m jax_kda.bench: {err}") from None
    names = [v.name for v in variants]
    if args.baseline and args.baseline not in names:
        raise SystemExit(f"--baseline {args.baseline!r} is not among the variants {names}")
    baselines = _baselines(args, cases, variants)
    baseline = baselines.get("prefill", baselines.get("decode"))
    pairs = [(c, v) for c in cases for v in variants if _applies(v, c)]
    if not pairs:
        raise SystemExit(f"python -m jax_kda.bench: none of the variants {names} runs on these "
                         "cases (prefill kinds time prefill cases, decode kinds decode cases; "
                         "decode cases time the flashkda numerics only)")
    timing_opts = {"inner": args.inner or (4 if on_gpu else 1),
                   "min_chain_ms": args.min_chain_ms if args.min_chain_ms is not None
                   else (5.0 if on_gpu else 0.0)}

    print(f"jax_kda.bench: {len(cases)} cases x {len(variants)} variants on "
          f"{jax.devices()[0].device_kind}; kernels: "
          f"{'available' if kernels_ok else kernels_why}", flush=True)
    if args.dry_run:
        for c in cases:
            if c.kind == "decode":
                print(f"  case {c.name}: decode N={c.num_seqs} heads={c.heads} "
                      f"t={c.tokens_per_seq} pool_rows={c.pool_rows} state={c.state_dtype}")
            else:
                print(f"  case {c.name}: seq_lens={list(c.seq_lens)} heads={c.heads} "
                      f"layout={c.layout}")
        text = f"baseline {baseline}"
        if "decode" in baselines and "prefill" in baselines:
            text += f"; decode cases: {baselines['decode']}"
        print("  variants: " + ", ".join(names) + f" ({text})")
        for kind in ("prefill", "decode"):
            timed = [v.name for v in variants if any(_applies(v, c) for c in cases
                                                     if c.kind == kind)]
            if kind in baselines and len(baselines) > 1:
                print(f"  {kind} cases time: " + ", ".join(timed))
        print(f"  results would go to {(args.out or default_out_dir()).expanduser().absolute()}")
        return 0

    meta = _device_meta() | {
        "inverse": args.inverse, "baseline": baseline, "kernels_available": kernels_ok,
        **({"decode_baseline": baselines["decode"], "copy_tb_s": args.copy_tb_s}
           if "decode" in baselines else {}),
        "kernels_unavailable_reason": kernels_why or None, "repeats": args.repeats,
        "warmup": args.warmup, "seed": args.seed, "variants": names,
        "interleave": args.interleave,
        "numerics": _parse_numerics(args.numerics),
    }
    if args.compare:
        meta["compare_versions"] = _compare_versions(args.compare)

    out_dir = (args.out or default_out_dir()).expanduser().absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"{_slug(meta['device_kind'])}-{dt.datetime.now(dt.UTC):%Y%m%d-%H%M%S}"
    paths = {ext: out_dir / f"{tag}.{ext}" for ext in ("json", "csv", "png")}
    print(f"results go to {out_dir}{'' if args.out else ' (the default; --out to change)'}",
          flush=True)

    results = []
    bar = progress_bar(len(pairs), enabled=not args.no_progress)
    for done, case in enumerate(cases, start=1):
        np_inputs = make_inputs(case, seed=args.seed)
        jax_inputs = to_jax(np_inputs, case)
        case_variants = [v for c, v in pairs if c is case]
        if args.interleave:
            bar.set_description(f"{case.name} ({len(case_variants)} variants, interleaved)")
        for row in _measure_case(case, case_variants, np_inputs, jax_inputs, args, timing_opts):
            bar.set_description(f"{case.name} {row['variant']}")
            results.append(row)
            decode_variants.add_floors([row], args.copy_tb_s)
            bar.update(1)
            if args.no_progress:  # one line per measurement instead of the bar
                print(f"  {case.name:28s} {row['variant']:28s} "
                      + (f"{row['median_us']:10.1f} us" if "median_us" in row else row["status"])
                      + (f" {row['achieved_tb_s']:6.2f} TB/s" if "achieved_tb_s" in row else ""),
                      flush=True)
            # after every measurement, so that a run cut short by a time limit keeps all it measured
            write_json(paths["json"], meta, [c.as_dict() for c in cases[:done]], results)
        del jax_inputs
    bar.close()

    case_dicts = [c.as_dict() for c in cases]
    for kind, base in baselines.items():
        kind_names = {c.name for c in cases if c.kind == kind}
        add_ratios([r for r in results if r["case"] in kind_names], base)
        timed = [v.name for v in variants if any(_applies(v, c) for c in cases if c.kind == kind)]
        dicts = [d for d, c in zip(case_dicts, cases) if c.kind == kind]
        kind_results = [r for r in results if r["case"] in kind_names]
        if kind == "decode":
            print(decode_variants.format_table(dicts, timed, kind_results, base, args.copy_tb_s))
        else:
            print(format_table(dicts, timed, kind_results, base))

    write_json(paths["json"], meta, case_dicts, results)
    write_csv(paths["csv"], results)
    written = [paths["json"], paths["csv"]]
    if args.no_plot:
        pass
    else:
        what = " and ".join(k for k in ("prefill", "decode") if k in baselines)
        why_not = write_plot(paths["png"], case_dicts, names, results, baseline,
                             f"jax_kda {what} on {meta['device_kind']} ({meta['date_utc'][:10]})")
        if why_not:
            print(f"plot skipped: {why_not}")
        else:
            written.append(paths["png"])
    print("wrote " + ", ".join(str(p) for p in written))
    failed = [r for r in results if r["status"] == "error"]
    return 1 if failed else 0
