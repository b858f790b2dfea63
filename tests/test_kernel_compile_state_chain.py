"""CPU checks of the backward's chain kernel (jax_kda/kernels/state_chain.py, both chains in one
launch): it compiles for both architectures without local memory and with the shared memory its
docstring states, with the arithmetic it promises (f32 fma chains, P's sums halved over the lanes
by shuffles, no tensor-core instructions), the exported wrapper takes the operands in the
handler's order, and the specs name one specialisation per architecture. Its results:
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
    assert ".local" not in ptx and "mma" not in ptx
    # per chunk and thread (4 value rows x 4 keys): 16 x 16 fmas for P, 16 x 16 for the update's
    # first 16 rows and 16 x 16 for the reverse chain's other 16, unrolled once; P's 64 partial
    # sums halved over the lanes in 32 + 16 + 8 + 4 + 2 shuffles
    assert ptx.count("fma.rn.ftz.f32") == 3 * 16 * 16
    assert ptx.count("shfl.sync.bfly") == 62
    assert chain.SMEM_BYTES == 52_736  # four CTAs fit an SM
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not available: PTX checked, cubin resource usage not checked")
    res = subprocess.run([cuobjdump, "-res-usage", single_cubin(str(tmp_path))],
                         capture_output=True, text=True, check=True)
    assert "LOCAL:0" in res.stdout and "STACK:0" in res.stdout, res.stdout
    usage = re.search(r"REG:(\d+)", res.stdout)
    assert int(usage.group(1)) <= 128, res.stdout  # registers allow eight CTAs of 64 threads


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
