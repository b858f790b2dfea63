#!/usr/bin/env bash
# The GPU round trip in two halves, because the GPU machine has no CuTe DSL and no internet:
#
#   scripts/gpu_roundtrip.sh build   CPU machine: build the wheel (kernels compiled ahead of time
#                                    for sm_90a + sm_100a) into .whl/ (git-ignored, ~1-2 MB).
#   scripts/gpu_roundtrip.sh gpu [tests|bench]
#                                    GPU machine: install .whl/*.whl with --no-deps into a fresh
#                                    target dir, check the import resolves there, run
#                                    `pytest -m gpu` against it, then the benchmark if present
#                                    (or only one of the two).
#                                    Logs and results go to $OUT (default ./gpu_out).
#
# The GPU machine needs the source tree (for the tests) and .whl/ (git-ignored), then runs
#   bash scripts/gpu_roundtrip.sh gpu
# Knobs: PYTHON (build: interpreter, default .venv/bin/python or python3),
#   JAX_KDA_NO_BUILD_ISOLATION=1 (build with PYTHON's installed toolchain instead of fetching it),
#   GPU_TEST_TIMEOUT (s, default 400), BENCH_TIMEOUT (s, default 150),
#   JAX_KDA_BENCH_ARGS (default "--out $OUT/bench --no-progress"), PYTEST_ARGS (extra args).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WHEEL_DIR="${WHEEL_DIR:-$REPO/.whl}"  # override to keep several builds apart

build() {
  local py="${PYTHON:-}"
  if [[ -z "$py" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then py="$REPO/.venv/bin/python"; else py=python3; fi
  fi
  local flags=(--no-deps --wheel-dir "$WHEEL_DIR")
  [[ "${JAX_KDA_NO_BUILD_ISOLATION:-0}" == "1" ]] && flags+=(--no-build-isolation)
  rm -rf "$WHEEL_DIR" && mkdir -p "$WHEEL_DIR"
  local start=$SECONDS
  "$py" -m pip wheel "${flags[@]}" "$REPO" || { echo "wheel build failed"; exit 1; }
  echo "built in $((SECONDS - start)) s:"
  ls -l "$WHEEL_DIR"
  "$py" - "$WHEEL_DIR"/*.whl <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
lib = [n for n in names if n.endswith("libjax_kda_ffi.so")]
print("FFI library in wheel:", lib or "NONE (reference-only build)")
PY
}

gpu() {
  local what="${1:-all}"
  OUT="${OUT:-$REPO/gpu_out}"
  mkdir -p "$OUT"
  exec > >(tee "$OUT/roundtrip_${what}.log") 2>&1
  local status=0 wheel site run_dir
  echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  python3 --version
  python3 -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|jax-cuda|pytest|numpy|torch|flash|fla)" || true

  wheel="$(ls "$WHEEL_DIR"/jax_kda-*.whl 2>/dev/null | head -n 1)"
  if [[ -z "$wheel" ]]; then
    echo "no wheel in $WHEEL_DIR: run 'scripts/gpu_roundtrip.sh build' on a machine with the build toolchain first"
    exit 2
  fi
  site="$(mktemp -d)/site"
  run_dir="$(mktemp -d)"  # neutral cwd: the source tree's jax_kda must not shadow the wheel
  echo "== install $wheel -> $site"
  python3 -m pip install --no-deps --no-index --target "$site" "$wheel" || exit 3
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

  echo "== import check"
  (cd "$run_dir" && python3 - "$site" <<'PY') || exit 4
import sys, jax, jax_kda
from jax_kda import _ffi
site = sys.argv[1]
print("jax", jax.__version__, "devices", jax.devices())
print("jax_kda from", jax_kda.__file__)
print("library", _ffi.library_path(), "available", _ffi.kernels_available(), _ffi.unavailable_reason())
print("kernels", _ffi.built_kernels())
assert jax_kda.__file__.startswith(site), "jax_kda was not imported from the installed wheel"
assert _ffi.kernels_available(), "FFI library not usable"
PY

  local start=$SECONDS
  if [[ "$what" != bench ]]; then
    echo "== pytest -m gpu"
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
    (cd "$run_dir" && timeout "${GPU_TEST_TIMEOUT:-400}" python3 -m pytest "$REPO/tests" -m gpu \
        --rootdir "$REPO" --import-mode=importlib -p no:cacheprovider -rfEs -q \
        --junitxml "$OUT/gpu_junit.xml" ${PYTEST_ARGS:-})
    status=$?
    echo "pytest exit $status after $((SECONDS - start)) s"
  fi

  if [[ "$what" == tests ]]; then
    :
  elif (cd "$run_dir" && python3 -c "import jax_kda.bench" 2>/dev/null); then
    echo "== benchmark"
    start=$SECONDS
    # shellcheck disable=SC2086  # word splitting of the argument string is intended
    (cd "$run_dir" && timeout "${BENCH_TIMEOUT:-150}" python3 -m jax_kda.bench \
        ${JAX_KDA_BENCH_ARGS:---out "$OUT/bench" --no-progress})
    echo "benchmark exit $? after $((SECONDS - start)) s"
  else
    echo "== no benchmark module (jax_kda.bench) in the wheel; skipped"
  fi
  echo "== done: pytest status $status; logs in $OUT"
  exit "$status"
}

case "${1:-}" in
  build) build ;;
  gpu) gpu "${2:-all}" ;;
  *) echo "usage: $0 build | gpu [tests|bench]"; exit 64 ;;
esac
