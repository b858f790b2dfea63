#!/usr/bin/env bash
# Nsight Compute on the prepare kernels of both numerics modes (T = 8192, HEADS heads, default 96):
# throughput breakdown (L1 data pipe, L2, DRAM), warp states, source counters with the SASS.
# Expects the wheel installed on PYTHONPATH; writes into $OUT.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
HEADS="${HEADS:-96}"
for numerics in ${NUMERICS:-fp32 flashkda}; do
  tag="ncu_prepare_${numerics}_h${HEADS}"
  (cd /tmp && PROFILE_HEADS=$HEADS PROFILE_NUMERICS=$numerics timeout 200 \
    ncu --clock-control none -k regex:Prepare -c 1 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section SchedulerStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SourceCounters --import-source no -f -o "$OUT/$tag" \
    python3 "$REPO/scripts/profile_case.py") > "$OUT/$tag.log" 2>&1
  ncu --import "$OUT/$tag.ncu-rep" --page details --print-details all > "$OUT/$tag.txt" 2>&1
  ncu --import "$OUT/$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/${tag}_sass.csv" 2>&1
  rm -f "$OUT/$tag.ncu-rep"
  echo "== $tag"; grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Lsu Wavefronts|Registers Per|Achieved Occupancy|No Eligible|Warp Cycles Per Issued|Executed Ipc A" "$OUT/$tag.txt" | head -20
done
