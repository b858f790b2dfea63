#!/usr/bin/env bash
# Nsight Compute on one kernel of a KDA prefill at T = 8192, both numerics modes (NUMERICS): the
# details page and the SASS with its per-instruction stall samples. KERNEL picks which:
#   recurrence (default): HEADS heads (default 6), per column split in SPLITS (default 16);
#                         launch, occupancy, scheduler, warp-state and source-counter sections
#   prepare:              HEADS heads (default 96); the same plus the memory-workload analysis
# Expects the wheel installed on PYTHONPATH; writes into $OUT.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
KERNEL="${KERNEL:-recurrence}"
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats
          --section WarpStateStats --section SourceCounters)
case $KERNEL in
  recurrence) HEADS="${HEADS:-6}"; splits="${SPLITS:-16}"; regex=Recurrence; limit=150
    details=(); summary="Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall" ;;
  prepare) HEADS="${HEADS:-96}"; splits=auto; regex=Prepare; limit=200
    sections+=(--section MemoryWorkloadAnalysis); details=(--print-details all)
    summary="Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Lsu Wavefronts|Registers Per|Achieved Occupancy|No Eligible|Warp Cycles Per Issued|Executed Ipc A" ;;
  *) echo "KERNEL must be recurrence or prepare, got $KERNEL" >&2; exit 2 ;;
esac
for split in $splits; do
  for numerics in ${NUMERICS:-fp32 flashkda}; do
    if [[ $KERNEL == prepare ]]; then tag="ncu_prepare_${numerics}_h${HEADS}"; else tag="ncu_${numerics}_h${HEADS}_bv${split}"; fi
    # PROFILE_SPLIT empty: the launch heuristic's column split (prepare has none)
    (cd /tmp && PROFILE_HEADS=$HEADS PROFILE_NUMERICS=$numerics PROFILE_SPLIT="${split/auto/}" \
      timeout $limit ncu --clock-control none -k regex:$regex -c 1 "${sections[@]}" \
      --import-source no -f -o "$OUT/$tag" python3 "$REPO/scripts/profile_case.py") > "$OUT/$tag.log" 2>&1
    ncu --import "$OUT/$tag.ncu-rep" --page details "${details[@]}" > "$OUT/$tag.txt" 2>&1
    ncu --import "$OUT/$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/${tag}_sass.csv" 2>&1
    rm -f "$OUT/$tag.ncu-rep"
    echo "== $tag"; grep -E "$summary" "$OUT/$tag.txt" | head -20
  done
done
