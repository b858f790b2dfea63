"""CPU checks of the backward's chain kernel (jax_kda/kernels/state_chain.py, both chains in one
launch): it compiles for both architectures without local memory and with the shared memory its
docstring states, with the arithmetic it promises (every product of f32 matrices as three TF32
MMAs on split operands), the exported wrapper takes the operands in the handler's order, and the specs name one specialisation per architecture. Its results:
tests/test_gpu_backward.py."""

import re
import subprocess

import pytest
from c_export import wrapper_arguments

pytest.importorskip("cutlass")
chain = pytest.importorskip("jax_kda.kernels.state_chain")
from kernel_sim import cuda_tool, single_cubin


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compiles_without_local_memory(arch, tmp_path):
    compiled = chain.compile_kernel(arch, dump_dir=str(tmp_path))
    ptx = compiled.__ptx__
    assert ".local" not in ptx and "fma.rn" not in ptx
    # per chunk and warp (16 value rows): P^T = X A^T over 16 key tiles x 2 r-tiles, the update
    # over 16 key tiles x 2 r-tiles and the reverse chain's 2 more; three MMAs each
    assert ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == 3 * 16 * 2 * 3
    # split() in the kernel: the state's 64 elements and Z^T's 8 (twice), integer rounding (A and
    # B arrive split); no emulated cvt.rna
    assert "cvt.rna" not in ptx and ptx.count("and.b32") >= 2 * (64 + 2 * 8)
    assert chain.SMEM_BYTES == 111_632  # two CTAs fit an SM
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not available: PTX checked, cubin resource usage not checked")
    res = subprocess.run([cuobjdump, "-res-usage", single_cubin(str(tmp_path))],
                         capture_output=True, text=True, check=True)
    assert "LOCAL:0" in res.stdout and "STACK:0" in res.stdout, res.stdout
    usage = re.search(r"REG:(\d+)", res.stdout)
    assert int(usage.group(1)) <= 255, res.stdout


def test_export_to_c_argument_order(tmp_path):
    names = wrapper_arguments(chain.compile_kernel("sm_90a"), tmp_path,
                              "test_kda_state_chain_sm90a")
    assert names == ["module", "mResetF", "mInitF", "mResetR", "mInitR", "mGamma", "mAF", "mBF",
                     "mYF", "mAR", "mBR", "mYR", "mStatesF", "mZF", "mStatesR", "mZR", "stream"]


def test_specs_name_one_specialisation_per_architecture():
    from jax_kda._aot import specs

    found = [s for s in specs.all_specs(("sm_90a", "sm_100a")) if s.kernel == "state_chain"]
    assert [s.prefix for s in found] == ["jax_kda_state_chain_sm90a", "jax_kda_state_chain_sm100a"]
    for s in found:
        assert s.call == "state_chain" and s.options == {} and s.variant_id == 0
