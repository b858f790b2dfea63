#!/usr/bin/env bash
# Issue 4's launch-heuristic measurement, ready for one GPU call (recurrence only, T = 8192):
# every block_v for heads 1..128 and N in {1, 2, 4, 8} sequences. One JSON per N under $OUT/grid;
# jax_kda/_launch.py should then pick the measured best (within noise) everywhere.
# Usage on the GPU machine (carry .whl): bash scripts/heuristic_grid.sh
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_out}"; mkdir -p "$OUT/grid"
site=$(mktemp -d); python3 -m pip install -q --no-deps --no-index --target "$site" "$REPO"/.whl/jax_kda-*.whl || exit 3
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
for n in 1 2 4 8; do
  (cd /tmp && timeout "${GRID_TIMEOUT:-140}" python3 -m jax_kda.bench --seqlen 8192 --num-seqs "$n" \
    --heads 1,2,4,6,8,12,16,24,32,48,64,96,128 --variants recurrence --block-v 16,32,64,128,auto \
    --repeats 5 --no-progress --no-plot --out "$OUT/grid" --tag "grid-n$n")
  rm -f "$OUT/grid/grid-n$n.csv"
done
