#!/usr/bin/env bash
# Everything a GPU machine runs in one go: GPU tests, a compute-sanitizer pass on a small shape,
# then the benchmark with fla alongside. Expects the built wheel in .whl/ (scripts/gpu_roundtrip.sh
# build) and optional peer wheels and sources in .external/ (both git-ignored).
#   STAGES: any of "smoke serving checkpoints tests sanitizer bench multigpu profile grid parity"
#           (default: tests sanitizer bench)
#   WHEEL_DIR: where the built wheel is (default .whl)
#   SANITIZER_CASE: the script the sanitizer stage runs (default sanitizer_case.py; the fp32
#           mode's: sanitizer_case_fp32.py; the backward's chain kernel alone:
#           sanitizer_case_chain.py; gradients through the kernels: sanitizer_case_backward.py,
#           which compute-sanitizer 2025.3.1 does not get through, see below)
#   SANITIZER_TOOLS: compute-sanitizer tools of that stage (default "memcheck racecheck")
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_out}"; mkdir -p "$OUT"
STAGES="${STAGES:-tests sanitizer bench}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false  # subprocess tests need GPU memory too
if ls "$REPO"/.external/*.whl >/dev/null 2>&1; then  # fla (pure Python) for --compare fla
  python3 -m pip install -q --no-deps --no-index --target /tmp/fla "$REPO"/.external/*.whl && export PYTHONPATH=/tmp/fla
fi
# the built wheel, installed once for the stages below (gpu_roundtrip.sh installs its own copy)
export WHEEL_DIR="${WHEEL_DIR:-$REPO/.whl}"
site=$(mktemp -d); python3 -m pip install -q --no-deps --no-index --target "$site" "$WHEEL_DIR"/jax_kda-*.whl || exit 3
for stage in $STAGES; do
  case $stage in
    smoke)  # seconds-long baseline-kernel check; on a hang the test stage leaves those tests out
      echo "== baseline recurrence smoke test"
      (cd /tmp && PYTHONPATH="$site:${PYTHONPATH:-}" timeout 120 python3 "$REPO/scripts/baseline_smoke.py")
      rc=$?; echo "smoke exit $rc"
      if [[ $rc == 124 ]]; then export PYTEST_ARGS="${PYTEST_ARGS:-} -k not(baseline)"; echo "HUNG: baseline tests deselected"; fi ;;
    serving)  # seconds-long bitwise check of the serving kernels against the prefill kernels
      echo "== serving smoke test"
      (cd /tmp && PYTHONPATH="$site:${PYTHONPATH:-}" timeout 240 python3 "$REPO/scripts/serving_smoke.py")
      echo "serving smoke exit $?" ;;
    checkpoints)  # what checkpoint_every costs at T = 8192, 12 heads, n = 64
      echo "== checkpoint cost"
      (cd /tmp && PYTHONPATH="$site:${PYTHONPATH:-}" timeout 120 python3 "$REPO/benchmarks/checkpoint_cost.py" --out "$OUT/checkpoint_cost.json")
      echo "checkpoint cost exit $?" ;;
    tests) GPU_TEST_TIMEOUT="${GPU_TEST_TIMEOUT:-330}" bash "$REPO/scripts/gpu_roundtrip.sh" gpu tests ;;
    sanitizer)
      # XLA's GEMM autotuning would run every candidate kernel under the tool (the backward's
      # case then outlasts any limit); SIGKILL, as the tool may outlive a SIGTERM; the log goes
      # to a file, so no pipe waits on a process left behind. Every kernel is checked: with
      # --kernel-name, compute-sanitizer 2025.3.1 crashes (SIGSEGV) at the program's end, and it
      # crashes on sanitizer_case_backward.py (while XLA compiles a gradient program)
      # (benchmarks/results/h200-20261204-sanitizer-backward.log)
      for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
        echo "== compute-sanitizer $tool"
        (cd /tmp && PYTHONPATH="$site:${PYTHONPATH:-}" XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
          timeout -s KILL ${SANITIZER_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 9 \
          python3 "$REPO/scripts/${SANITIZER_CASE:-sanitizer_case.py}") > "$OUT/sanitizer_$tool.log" 2>&1
        rc=$?; tail -n 25 "$OUT/sanitizer_$tool.log"
        echo "compute-sanitizer $tool exit $rc"
      done ;;
    multigpu)
      echo "== multi-GPU sharded check"
      (cd /tmp && PYTHONPATH="$site:${PYTHONPATH:-}" timeout 240 python3 "$REPO/benchmarks/multi_gpu_check.py" "$OUT/multi_gpu.json")
      echo "multi-GPU exit $?" ;;
    profile)  # Nsight Compute on one recurrence launch: where the per-chunk cycles go
      echo "== ncu, recurrence, T=8192, 12 heads"
      (cd /tmp && PYTHONPATH="$site:${PYTHONPATH:-}" timeout 150 ncu --clock-control none -k regex:Recurrence -c 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
        --section WarpStateStats python3 "$REPO/scripts/profile_case.py") > "$OUT/ncu_recurrence.txt" 2>&1
      echo "ncu exit $?"; grep -E "Duration|Issue Slots|Eligible|Active Warps|Stall|No Eligible|Registers|Block Size|Grid Size" "$OUT/ncu_recurrence.txt" | head -40 ;;
    grid)  # block_v x heads x sequences, recurrence alone
      echo "== launch-heuristic grid"
      (cd /tmp && PYTHONPATH="$site:${PYTHONPATH:-}" timeout "${GRID_TIMEOUT:-360}" python3 "$REPO/benchmarks/heuristic_grid.py" \
        --out "$OUT/heuristic_grid.json" ${GRID_ARGS:-})
      echo "grid exit $?" ;;
    parity)  # bitwise against FlashKDA v1 and the stable torch_ref (sources in .external)
      PYTHONPATH="$site:${PYTHONPATH:-}" bash "$REPO/benchmarks/flashkda_parity.sh" ;;
    bench)
      if ls "${FLASHKDA_DIR:-/tmp/flashkda}"/FlashKDA/flash_kda_C*.so >/dev/null 2>&1; then  # built by the parity stage
        export PYTHONPATH="${FLASHKDA_DIR:-/tmp/flashkda}/FlashKDA${PYTHONPATH:+:$PYTHONPATH}"
      fi
      JAX_KDA_BENCH_ARGS="${JAX_KDA_BENCH_ARGS:---preset baselines --compare fla --out $OUT/bench --no-progress --no-plot}" \
        BENCH_TIMEOUT="${BENCH_TIMEOUT:-240}" bash "$REPO/scripts/gpu_roundtrip.sh" gpu bench ;;
  esac
done
