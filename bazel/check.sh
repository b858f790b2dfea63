#!/usr/bin/env bash
# Builds libjax_kda_ffi.so with Bazel (Debian's bazel-bootstrap, offline) and checks the result:
# it loads through jax_kda._ffi, registers both custom calls, and holds every kernel
# specialisation of jax_kda/_aot/specs.py with one cubin each for the right architecture.
#
#   bazel/check.sh            # CI: installs bazel-bootstrap if missing
#
# Environment:
#   JAX_KDA_PYTHON   interpreter with the kernel build packages (default: .venv/bin/python, else
#                    python3); the packages of ffi/build_backend.py are installed into it if its
#                    jax_kda/_aot/toolchain.py check fails.
#   JAX_KDA_AOT_DIR  prebuilt kernel objects (default: build/py3-none-linux_x86_64/aot when
#                    `pip install .` left them there; else, or with JAX_KDA_AOT_DIR=none, Bazel
#                    compiles them with CuTe DSL, which must then be installed in JAX_KDA_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
start=$(date +%s)

if ! command -v bazel >/dev/null 2>&1; then
  echo "bazel/check.sh: installing Debian's bazel-bootstrap"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq bazel-bootstrap >/dev/null
fi
echo "bazel/check.sh: bazel $(dpkg-query -W -f '${Version}' bazel-bootstrap 2>/dev/null || bazel --version)"

python=${JAX_KDA_PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=$root/.venv/bin/python; else python=$(command -v python3); fi
fi
if ! "$python" jax_kda/_aot/toolchain.py >/dev/null 2>&1; then
  echo "bazel/check.sh: installing the kernel build packages into $python"
  mapfile -t requires < <(cd ffi && "$python" -c \
    'import ast, pathlib; t = pathlib.Path("build_backend.py").read_text(); m = ast.parse(t)
for n in ast.walk(m):
    if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "KERNEL_BUILD_REQUIRES":
        print("\n".join(ast.literal_eval(n.value)))')
  "$python" -m pip install --disable-pip-version-check -q "${requires[@]}"
fi
"$python" jax_kda/_aot/toolchain.py >/dev/null
export JAX_KDA_PYTHON=$python

if [ "${JAX_KDA_AOT_DIR:-}" = none ]; then
  unset JAX_KDA_AOT_DIR
elif [ -z "${JAX_KDA_AOT_DIR:-}" ] && [ -f build/py3-none-linux_x86_64/aot/kernels_specs.inc ]; then
  export JAX_KDA_AOT_DIR=$root/build/py3-none-linux_x86_64/aot
fi
echo "bazel/check.sh: kernel objects from ${JAX_KDA_AOT_DIR:-a fresh AOT build inside Bazel}"

# No convenience symlinks (bazel-bin, ...) in the source tree; ask Bazel where the output is.
flags=(--symlink_prefix=/)
# Re-run the repository rules: the prebuilt objects or the Python environment may have changed.
bazel sync --only=jax_kda_toolchain --only=jax_kda_aot
bazel build "${flags[@]}" //:libjax_kda_ffi.so
lib="$(bazel info "${flags[@]}" bazel-bin)/libjax_kda_ffi.so"
echo "bazel/check.sh: built $lib"

JAX_KDA_FFI_LIBRARY=$lib PYTHONPATH=$root "$python" - <<'PY'
import os
import pathlib

from jax_kda import _ffi
from jax_kda._aot import cubin, specs

lib = pathlib.Path(os.environ["JAX_KDA_FFI_LIBRARY"])
assert _ffi.kernels_available(), f"the Bazel-built library does not load: {_ffi.unavailable_reason()}"
assert _ffi.library_path().resolve() == lib.resolve(), (_ffi.library_path(), lib)
built = sorted(_ffi.built_kernels())
aot_dir = os.environ.get("JAX_KDA_AOT_DIR")
listed = pathlib.Path(aot_dir, "kernels_specs.inc").read_text() if aot_dir else None
wanted = sorted(s.prefix for s in specs.all_specs() if listed is None or f"({s.prefix}," in listed)
assert built == wanted, f"kernels in the library {built} != specialisations {wanted}"
sms = sorted(cubin.cubin_sm(image) for image in cubin.embedded_cubins(lib.read_bytes()))
want_sms = sorted(int(p.rsplit("_sm", 1)[1].rstrip("a")) for p in wanted)
assert sms == want_sms, f"embedded cubins for sm {sms}, expected {want_sms}"
print(f"bazel/check.sh: OK: {len(built)} kernel specialisations, cubins for sm {sorted(set(sms))}, "
      "both custom calls registered")
PY
echo "bazel/check.sh: done in $(( $(date +%s) - start )) s"
