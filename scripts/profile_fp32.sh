#!/usr/bin/env bash
# Nsight Compute on the fp32 recurrence (and the flashkda one beside it) at T = 8192: launch and
# warp-state sections, and the SASS of both with its stall samples, per column split given in SPLITS.
# Expects the wheel installed on PYTHONPATH; writes into $OUT.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
HEADS="${HEADS:-6}"
for split in ${SPLITS:-16}; do
  for numerics in fp32 flashkda; do
    tag="ncu_${numerics}_h${HEADS}_bv${split}"
    (cd /tmp && PROFILE_HEADS=$HEADS PROFILE_NUMERICS=$numerics PROFILE_SPLIT=$split timeout 150 \
      ncu --clock-control none -k regex:Recurrence -c 1 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section SchedulerStats --section WarpStateStats \
      --section SourceCounters --import-source no -f -o "$OUT/$tag" \
      python3 "$REPO/scripts/profile_case.py") > "$OUT/$tag.log" 2>&1
    ncu --import "$OUT/$tag.ncu-rep" --page details > "$OUT/$tag.txt" 2>&1
    ncu --import "$OUT/$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/${tag}_sass.csv" 2>&1
    rm -f "$OUT/$tag.ncu-rep"
    echo "== $tag"; grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall" "$OUT/$tag.txt" | head -20
  done
done
