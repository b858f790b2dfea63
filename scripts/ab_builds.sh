#!/usr/bin/env bash
# Builds of jax_kda timed in alternating processes (A, B, A, B: two builds cannot share a
# process), with the same benchmark arguments, and their kernel results compared bit for bit.
#   BUILDS: the builds' names (default "A B"), each with its wheel in <name>_WHEEL (A_WHEEL,
#   B_WHEEL, ...); OUT: where results go; BENCH_ARGS: python -m jax_kda.bench
#   arguments (default: recurrence and total at T = 8192, 96..6 heads, both numerics modes);
#   ROUNDS (default 2); DUMP=1 also runs scripts/build_outputs.py dump --small with each build
#   and compares the first build's with each other's; BENCH_SCRIPT (a repository path, e.g.
#   benchmarks/prepare_bandwidth.py):
#   run that script with BENCH_ARGS and --out $OUT/<build><round>.json instead of the bench.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:?}"; mkdir -p "$OUT"
BENCH_ARGS="${BENCH_ARGS:---seqlen 8192 --heads 96,48,24,12,6 --numerics flashkda,fp32 --variants recurrence,total --block-v auto --total-block-v auto}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
read -ra BUILD_NAMES <<< "${BUILDS:-A B}"
FIRST="${BUILD_NAMES[0]}"
declare -A SITE
for b in "${BUILD_NAMES[@]}"; do
  wheel_var="${b}_WHEEL"; SITE[$b]=$(mktemp -d)
  python3 -m pip install -q --no-deps --no-index --target "${SITE[$b]}" "${!wheel_var}" || exit 3
done
if [[ "${DUMP:-0}" == 1 ]]; then
  for b in "${BUILD_NAMES[@]}"; do
    (cd /tmp && PYTHONPATH="${SITE[$b]}" timeout 300 python3 "$REPO/scripts/build_outputs.py" dump "$OUT/outputs_$b.npz" --small) > "$OUT/dump_$b.log" 2>&1
    echo "dump $b exit $?"
  done
  for b in "${BUILD_NAMES[@]:1}"; do
    python3 "$REPO/scripts/build_outputs.py" compare "$OUT/outputs_$FIRST.npz" "$OUT/outputs_$b.npz" | tee -a "$OUT/compare.txt"
    echo "compare $FIRST $b exit ${PIPESTATUS[0]}"
  done
  rm -f "$OUT"/outputs_*.npz
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for b in "${BUILD_NAMES[@]}"; do
    if [[ -n "${BENCH_SCRIPT:-}" ]]; then
      bench=("$REPO/$BENCH_SCRIPT" $BENCH_ARGS --out "$OUT/${b}${round}.json")
    else
      bench=(-m jax_kda.bench $BENCH_ARGS --out "$OUT" --tag "${b}${round}" --no-plot --no-progress)
    fi
    (cd /tmp && PYTHONPATH="${SITE[$b]}" timeout "${BENCH_TIMEOUT:-200}" python3 "${bench[@]}") \
      > "$OUT/bench_${b}${round}.log" 2>&1
    echo "bench $b round $round exit $?"
  done
done
