#!/usr/bin/env bash
# Issue 3 item 7 on the GPU machine: build FlashKDA v1 there and compare jax_kda with it bitwise
# (benchmarks/compare_flashkda.py). FlashKDA's code never enters this repository: its sources travel
# in the git-ignored .external/, made from the public repositories:
#   git -C FlashKDA archive --prefix=FlashKDA/ 1ce47ea | gzip > .external/flashkda-1ce47ea.tar.gz
#   git -C cutlass archive --prefix=FlashKDA/cutlass/ <FlashKDA's submodule commit> include \
#       tools/util/include examples/common | gzip > .external/cutlass-<commit>-headers.tar.gz
#   FlashKDA 1ce47ea tests/torch_ref.py  -> .external/flashkda_torch_ref_1ce47ea.py (neumann mirror)
#   vLLM's FlashKDA fork 3b225bf tests/torch_ref.py -> .external/vllm_torch_ref_3b225bf.py (stable)
# Needs jax_kda importable (PYTHONPATH) and torch + nvcc on the machine.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
EXT="$REPO/.external"
OUT="${OUT:-$REPO/gpu_out}"; mkdir -p "$OUT"
work="${FLASHKDA_DIR:-/tmp/flashkda}"  # kept: h200_session.sh's bench stage imports the build from here
mkdir -p "$work"
tar xzf "$EXT"/flashkda-*.tar.gz -C "$work" && tar xzf "$EXT"/cutlass-*-headers.tar.gz -C "$work" || exit 5
mkdir -p "$work/bin" && printf '#!/bin/sh\nexit 0\n' > "$work/bin/git" && chmod +x "$work/bin/git"  # setup.py's submodule update
echo "== build FlashKDA ($(ls "$EXT"/flashkda-*.tar.gz | xargs -n1 basename)), nvcc: $(command -v nvcc || echo none)"
start=$SECONDS
(cd "$work/FlashKDA" && PATH="$work/bin:$PATH" FLASH_KDA_VERSION_SUFFIX="+1ce47ea" FLASH_KDA_CUDA_ARCHS="${FLASH_KDA_CUDA_ARCHS:-90a}" NVCC_THREADS=8 MAX_JOBS=8 \
  timeout "${FLASHKDA_BUILD_TIMEOUT:-300}" python3 setup.py -q build_ext --inplace > "$OUT/flashkda_build.log" 2>&1)
echo "FlashKDA build exit $? after $((SECONDS - start)) s"; tail -n 5 "$OUT/flashkda_build.log"
refs=()
[[ -f "$EXT/vllm_torch_ref_3b225bf.py" ]] && refs+=(--stable-ref "$EXT/vllm_torch_ref_3b225bf.py")
[[ -f "$EXT/flashkda_torch_ref_1ce47ea.py" ]] && refs+=(--neumann-ref "$EXT/flashkda_torch_ref_1ce47ea.py")
(cd /tmp && PYTHONPATH="$work/FlashKDA:${PYTHONPATH:-}" timeout "${PARITY_TIMEOUT:-240}" \
  python3 "$REPO/benchmarks/compare_flashkda.py" "${refs[@]}" --json "$OUT/flashkda_parity.json")
echo "parity exit $?"
