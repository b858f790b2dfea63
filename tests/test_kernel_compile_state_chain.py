"""CPU checks of the backward's chain kernel (jax_kda/kernels/state_chain.py): it compiles for
both architectures and both row counts without local memory, with the arithmetic its docstring
promises (f32 fma chains, P's sums halved over the lanes by shuffles, no tensor-core instructions), the exported
wrapper takes the operands in the handler's order, and the specs name both variants. Its
results: tests/test_gpu_backward.py."""

import re
import subprocess

import pytest
from c_export import wrapper_arguments

pytest.importorskip("cutlass")
chain = pytest.importorskip("jax_kda.kernels.state_chain")
from kernel_sim import cuda_tool, single_cubin

from jax_kda import contract


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("rows", contract.STATE_CHAIN_ROWS)
def test_compiles_without_local_memory(rows, arch, tmp_path):
    compiled = chain.compile_kernel(rows, arch, dump_dir=str(tmp_path))
    ptx = compiled.__ptx__
    assert ".local" not in ptx and "mma" not in ptx
    # per chunk and thread (4 value rows x 4 keys): 16 x 16 fmas for P and rows x 16 for the
    # update, unrolled once; P's 64 partial sums halved over the lanes in 32 + 16 + 8 + 4 + 2
    # shuffles
    assert ptx.count("fma.rn.ftz.f32") == 16 * 16 + rows * 16
    assert ptx.count("shfl.sync.bfly") == 62
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not available: PTX checked, cubin resource usage not checked")
    res = subprocess.run([cuobjdump, "-res-usage", single_cubin(str(tmp_path))],
                         capture_output=True, text=True, check=True)
    assert "LOCAL:0" in res.stdout and "STACK:0" in res.stdout, res.stdout
    usage = re.search(r"REG:(\d+)", res.stdout)
    assert int(usage.group(1)) <= 128, res.stdout  # no spill risk; 64-thread CTAs fit any count


def test_export_to_c_argument_order(tmp_path):
    names = wrapper_arguments(chain.compile_kernel(32, "sm_90a"), tmp_path,
                              "test_kda_state_chain_r32_sm90a")
    assert names == ["module", "mReset", "mInit", "mGamma", "mA", "mB", "mY", "mStates",
                     "stream"]


def test_specs_name_both_chains():
    from jax_kda._aot import specs

    found = [s for s in specs.all_specs(("sm_90a",)) if s.kernel == "state_chain"]
    assert [s.prefix for s in found] == [f"jax_kda_state_chain_r{r}_sm90a"
                                         for r in contract.STATE_CHAIN_ROWS]
    for s in found:
        assert s.call == "state_chain" and s.options == {"rows": s.variant}
        assert s.variant_id == s.variant


def test_rows_are_checked():
    with pytest.raises(ValueError, match="rows must be one of"):
        chain.KdaStateChain(24)
