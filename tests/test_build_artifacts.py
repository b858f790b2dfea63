"""The installed FFI library: built for both architectures, tensor-core SASS, clean exports.

CPU-only (runs in CI). The kernel cubins are embedded as raw data by CuTe DSL's export_to_c, so
they are cut out of the library (jax_kda/_aot/cubin.py) and disassembled with cuobjdump from the
nvidia-cuda-cuobjdump wheel (test extra). A package built with JAX_KDA_BUILD_KERNELS=0 skips.
The specialisations expected are every one of jax_kda/_aot/specs.py.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from jax_kda import _ffi, contract
from jax_kda._aot import cubin, specs

pytestmark = pytest.mark.skipif(
    os.environ.get("JAX_KDA_BUILD_KERNELS") == "0",
    reason="reference-only build (JAX_KDA_BUILD_KERNELS=0): no FFI library to inspect",
)

HANDLER_SYMBOLS = {symbol for stages in _ffi._HANDLER_SYMBOLS.values()
                   for symbol in stages.values()}
INFO_SYMBOLS = {"jax_kda_ffi_kernels", "jax_kda_ffi_abi_version"}


@functools.cache
def library() -> pathlib.Path:
    path = _ffi.library_path()
    assert path is not None, f"FFI library not loadable: {_ffi.unavailable_reason()}"
    return path


def _wheel_tool(dist: str, name: str) -> str:
    """A CUDA tool from its PyPI wheel (installed under site-packages/nvidia/cu13/bin), or PATH."""
    try:
        for file in importlib.metadata.distribution(dist).files or ():
            if file.name == name:
                return str(file.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    found = shutil.which(name)
    assert found, f"{name} not found: install the test extra (pip install '.[test]')"
    return found


@functools.cache
def sass_by_cubin(tmp_dir: str) -> list[tuple[int, str]]:
    """(sm, SASS text) for every cubin embedded in the library."""
    cuobjdump = _wheel_tool("nvidia-cuda-cuobjdump", "cuobjdump")
    nvdisasm = _wheel_tool("nvidia-cuda-nvdisasm", "nvdisasm")
    env = dict(os.environ, PATH=f"{pathlib.Path(nvdisasm).parent}:{os.environ.get('PATH', '')}")
    result = []
    for i, image in enumerate(cubin.embedded_cubins(library().read_bytes())):
        path = pathlib.Path(tmp_dir, f"kernel{i}.cubin")
        path.write_bytes(image)
        sass = subprocess.run([cuobjdump, "-sass", str(path)], env=env, check=True,
                              capture_output=True, text=True).stdout
        result.append((cubin.cubin_sm(image), sass))
    return result


@pytest.fixture(scope="module")
def sass(tmp_path_factory):
    return sass_by_cubin(str(tmp_path_factory.mktemp("cubins")))


def test_library_is_installed_and_registered():
    assert library().name == _ffi.LIBRARY_NAME
    assert _ffi.kernels_available(), _ffi.unavailable_reason()


def expected_specs(archs=tuple(contract.ARCHS)) -> list[specs.Spec]:
    return specs.all_specs(archs)


def test_library_holds_every_specialisation_for_both_archs():
    expected = {s.prefix for s in expected_specs()}
    assert set(_ffi.built_kernels()) == expected


def test_baseline_recurrence_is_built_for_every_arch():
    names = set(_ffi.built_kernels())
    baseline = {f"jax_kda_recurrence_baseline_{arch.replace('_', '')}" for arch in contract.ARCHS}
    assert baseline <= names
    # ... registered in the recurrence table under block_v 0 (the generated X-macro list)
    lines = _aot_spec_lines()
    if lines is not None:
        for prefix in baseline:
            sm = prefix.removeprefix("jax_kda_recurrence_baseline_sm").removesuffix("a")
            assert f"JAX_KDA_RECURRENCE({prefix}, 0, {sm})" in lines


def _aot_spec_lines() -> list[str] | None:
    """kernels_specs.inc of the build next to the library (a build tree), if there is one."""
    path = library().parent / "aot" / "kernels_specs.inc"
    return path.read_text().splitlines() if path.is_file() else None


def test_one_cubin_per_specialisation_and_arch(sass):
    sms = sorted(sm for sm, _ in sass)
    per_arch = len(expected_specs(("sm_90a",)))
    assert sms == [90] * per_arch + [100] * per_arch
    for sm, text in sass:
        assert f"code for sm_{sm}a" in text, f"cubin for sm_{sm} is not arch-specific (sm_{sm}a)"


def _kernel_name(text: str) -> str:
    match = re.search(r"Function : (\S+)", text)
    assert match, "no kernel function in SASS"
    return match.group(1)


def test_sm90a_kernels_use_bf16_tensor_cores(sass):
    """Every forward kernel runs its products on bf16 tensor cores; the backward's chain kernel
    is f32 FMA arithmetic (jax_kda/kernels/state_chain.py) and has no MMA."""
    names = []
    for sm, text in sass:
        if sm != 90:
            continue
        names.append(_kernel_name(text))
        if "state_chain" in names[-1]:
            assert "HMMA" not in text and "FFMA" in text, names[-1]
            continue
        assert "HMMA.16816.F32.BF16" in text, f"no HMMA.16816.F32.BF16 in {_kernel_name(text)}"
    assert any("prepare" in n for n in names) and any("recurrence" in n for n in names)
    assert sum("state_chain" in n for n in names) == 1  # both chains in one kernel


def test_no_kernel_has_local_memory_spills(sass):
    """Every specialisation (prepare, the recurrences, the pool recurrences, both decodes): one
    kernel function each, none touching local memory."""
    for _, text in sass:
        spills = re.findall(r"\b(?:LDL|STL)(?:\.\w+)*\b", text)
        assert not spills, f"{_kernel_name(text)}: local memory traffic {sorted(set(spills))}"
    assert len(sass) == len(expected_specs())
    names = [_kernel_name(text) for _, text in sass]
    assert sum("decode" in n.lower() for n in names) == len(
        [s for s in expected_specs() if s.call in ("decode", "decode_fp32")])


def _dynamic_symbols(*flags: str) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils nm not available")
    out = subprocess.run([nm, "-D", *flags, str(library())], check=True, capture_output=True,
                         text=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def test_exports_exactly_the_handlers_and_info_functions():
    assert _dynamic_symbols("--defined-only") == HANDLER_SYMBOLS | INFO_SYMBOLS


def test_no_cuda_runtime_or_driver_needed_at_link_time():
    """cudart is linked statically (our shim), the driver is reached through cudart."""
    undefined = _dynamic_symbols("--undefined-only")
    assert not {s for s in undefined if s.startswith(("cu", "_cu"))}
    readelf = shutil.which("readelf")
    if readelf:
        dynamic = subprocess.run([readelf, "-d", str(library())], check=True,
                                 capture_output=True, text=True).stdout
        assert "libcudart" not in dynamic and "libcuda.so" not in dynamic


def test_abi_version_matches_python_side():
    import ctypes

    lib = ctypes.CDLL(str(library()))
    assert lib.jax_kda_ffi_abi_version() == contract.ABI_VERSION


def test_importing_the_package_does_not_need_cutlass():
    """CuTe DSL is a build-time dependency only: the GPU machine does not have it."""
    code = (
        "import sys, jax_kda\n"
        "from jax_kda import _ffi\n"
        "assert _ffi.kernels_available(), _ffi.unavailable_reason()\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'cuda'))\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
