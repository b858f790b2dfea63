"""CPU checks of the fp32 mode's prepare kernel (jax_kda/kernels/prepare_fp32.py): it compiles for
sm_90a and sm_100a, its PTX/SASS hold the instructions docs/fp32_mode.md's arithmetic relies on
(three MMA chains per product, f32 .ftz arithmetic, no bf16 arithmetic), with no local memory, the
shared memory and registers of eight CTAs per SM, the record's store forms, and a shared-memory
plan without overlapping live buffers. Needs nvidia-cutlass-dsl (build time only);
SASS checks also need cuobjdump (nvidia-cuda-cuobjdump wheel or a CUDA toolkit), and are skipped
without it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from c_export import wrapper_arguments

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from jax_kda import contract
from jax_kda.kernels import prepare_fp32

ARCHS = tuple(contract.ARCHS)
# 6 chains (hh, hl, lh of L and of Mqk) x 8 k-blocks x 2 n8 atoms of a 16x16 output
MMAS = 6 * 8 * 2
# an SM's shared memory (sm_90 and sm_100: 228 KB), of which each CTA also takes 1 KB reserved
# and the DSL's 1 KB of static shared memory
SM_SHARED_BYTES = 228 * 1024
CTAS_PER_SM = 7  # 7 x 128 threads x 72 registers fit the register file
# the record's stores: kd_hi, qd hi/lo, kr hi/lo as 4-byte bf16x2 stores (8 rows each, from the
# column-pair threads), gt as two 4-byte stores (half-1 threads), INV (2 per lane) and Mqk (2 per
# lane) as 16-byte stores
RECORD_B32_STORES = 5 * 8
GT_STORES = 2
RECORD_V4_STORES = 4


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in sys.path:
        cand = Path(root) / "nvidia" / "cu13" / "bin" / "cuobjdump"
        if cand.is_file():
            return str(cand)
    return None


_BUILD_SCRIPT = """
import sys
from jax_kda import contract
from jax_kda.kernels import prepare_fp32
out = sys.argv[1]
for arch in contract.ARCHS:
    for grouped in (False, True):
        c = prepare_fp32.compile_kernel(arch, grouped=grouped, dump_dir=out)
        open(f"{out}/{arch}_{grouped}.ptx", "w").write(c.__ptx__)
        open(f"{out}/{arch}_{grouped}.cubin", "wb").write(c.__cubin__)
        open(f"{out}/{arch}_{grouped}.mlir", "w").write(str(c.ir_module))
"""


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{(arch, grouped): (ptx text, cubin bytes, host IR text)} (grouped: the specialisation for
    q and k on fewer heads than the value heads).

    Built in a child process: the DSL fixes its artifact dump directory (the working directory)
    at import, so this keeps the dumps out of the checkout.
    """
    dump = tmp_path_factory.mktemp("prepare_fp32_dump")
    repo = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        CUTE_DSL_DUMP_DIR=str(dump),
        PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    )
    subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT, str(dump)],
        cwd=dump,
        env=env,
        check=True,
        timeout=600,
    )
    out = {}
    for arch in ARCHS:
        for grouped in (False, True):
            stem = dump / f"{arch}_{grouped}"
            out[(arch, grouped)] = (
                stem.with_suffix(".ptx").read_text(),
                stem.with_suffix(".cubin").read_bytes(),
                stem.with_suffix(".mlir").read_text(),
            )
    return out


KEYS = [(arch, grouped) for arch in ARCHS for grouped in (False, True)]


@pytest.mark.parametrize("arch,grouped", KEYS)
def test_ptx_targets_arch_and_uses_the_pinned_instructions(builds, arch, grouped):
    ptx, _, _ = builds[(arch, grouped)]
    assert f".target {arch}" in ptx
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == MMAS
    for instr in (
        "ex2.approx.ftz.f32",
        "rcp.approx.ftz.f32",  # ptx.sigmoid_exp2 (gates and betas)
        "rsqrt.approx.ftz.f32",
        "shfl.sync.bfly",
        "shfl.sync.idx",
        "fma.rn.ftz.f32",
        "cvt.rn.bf16.f32",
    ):
        assert instr in ptx, instr
    assert "tanh.approx" not in ptx  # the bf16 mode's sigmoid has no place here
    # bf16 -> f32 must be a bit shift: a cvt would flush subnormals under -ftz
    assert "cvt.f32.bf16" not in ptx
    # no intermediate is rounded by bf16 or f16 arithmetic in this mode
    assert not re.search(r"\b(add|sub|mul|fma)\.rn(\.ftz)?\.(bf16|f16)", ptx)
    # every non-approx f32 add/mul/fma is the fast-math .ftz form
    assert not re.search(r"\b(add|sub|mul|fma)(\.rn)?\.f32\b", ptx)
    # 16-byte global loads of q, k, g (two rows x three tensors a thread)
    assert len(re.findall(r"ld\.global(\.[a-z]+)*\.v4", ptx)) == 6


@pytest.mark.parametrize("arch,grouped", KEYS)
def test_ptx_record_store_forms(builds, arch, grouped):
    """The record goes straight to global memory: no staging of kd .. gt in shared memory."""
    ptx, _, _ = builds[(arch, grouped)]
    assert not re.search(r"st\.global(\.[a-z_:0-9]+)*\.(b|u)16", ptx)  # no 2-byte stores
    assert len(re.findall(r"st\.global(\.[a-z_:0-9]+)*\.v4", ptx)) == RECORD_V4_STORES
    assert len(re.findall(r"st\.global\.(b|f|u)32\b", ptx)) == RECORD_B32_STORES + GT_STORES
    # the Mqk staging is read back with two 16-byte shared loads per lane
    assert len(re.findall(r"ld\.shared\.v4", ptx)) == 2
    # four CTA barriers (after A, two inside B: raw rows read and G_7 handed on, gt handed back;
    # after B) and the launch asks for CTAS_PER_SM CTAs per SM
    assert len(re.findall(r"\bbar\.sync\b|barrier\.sync\b", ptx)) == 4
    assert re.search(rf"\.minnctapersm {CTAS_PER_SM}\b", ptx)


@pytest.mark.parametrize("arch,grouped", KEYS)
def test_no_local_memory_in_ptx(builds, arch, grouped):
    ptx, _, _ = builds[(arch, grouped)]
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
    assert ".local" not in ptx


@pytest.mark.parametrize("arch,grouped", KEYS)
def test_shared_memory_fits_the_ctas_per_sm(builds, arch, grouped):
    _, _, host_ir = builds[(arch, grouped)]
    # the launch's dynamic shared memory is the module's SMEM_BYTES
    assert re.search(rf"constant\({prepare_fp32.SMEM_BYTES} : i64\)", host_ir)
    assert prepare_fp32.CTAS_PER_SM == CTAS_PER_SM
    assert CTAS_PER_SM * (prepare_fp32.SMEM_BYTES + 2048) <= SM_SHARED_BYTES


def test_shared_memory_layout_sums_its_allocations():
    # operand tiles, row norms of q and k, b, phase B's per-column hand-over (L and the Mqk
    # staging live on dead operand tiles)
    assert prepare_fp32.SMEM_BYTES == 6 * 4096 + 32 * 4 + 16 * 4 + 128 * 4
    assert prepare_fp32.RECORD_BYTES == contract.FP32_RECORD_BYTES
    # INV and Mqk are 16 x 16 bf16 tiles, hi then lo, as the stores from registers assume
    rec = contract.FP32_RECORD
    assert rec["inv_lo"] - rec["inv_hi"] == prepare_fp32.INV_TILE_BYTES == 512
    assert rec["mqk_lo"] - rec["mqk_hi"] == prepare_fp32.MQK_TILE_BYTES == 512
    assert rec["mqk_lo"] + 512 == contract.FP32_RECORD_BYTES
    # warp 1 copies mqk hi + lo with two 16-byte granules per lane
    assert prepare_fp32.MQK_GRANULES == 2 * 32


def _phase_span(entry):
    phases = prepare_fp32.PHASES
    _, _, first, last, _ = entry
    return phases.index(first), phases.index(last)


def test_shared_memory_plan_has_no_overlapping_live_buffers():
    """Two buffers of SMEM_PLAN that share bytes are never live together: their phase spans are
    disjoint, and where the later one starts inside phase C (no CTA barrier in between, only the
    owning warp's __syncwarp) both belong to the same single warp."""
    plan = prepare_fp32.SMEM_PLAN
    phases = prepare_fp32.PHASES
    c_first = phases.index("C_PRODUCT")
    for name, (off, size, first, last, warps) in plan.items():
        assert size > 0 and off >= 0 and off % 16 == 0, name
        assert off + size <= prepare_fp32.SMEM_BYTES, name
        assert phases.index(first) <= phases.index(last), name
        if phases.index(last) >= c_first and warps is not None:
            assert set(warps) <= {0, 1}, name
    names = sorted(plan)
    overlaps = set()
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            oa, sa, *_, wa = plan[a]
            ob, sb, *_, wb = plan[b]
            if oa + sa <= ob or ob + sb <= oa:
                continue
            overlaps.add((a, b))
            (fa, la), (fb, lb) = _phase_span(plan[a]), _phase_span(plan[b])
            assert la < fb or lb < fa, (a, b)
            if min(la, lb) >= c_first:
                # no CTA barrier between them: the same single warp must own both
                assert wa is not None and wb is not None, (a, b)
                assert len(set(wa)) == 1 and set(wa) == set(wb), (a, b)
    # the aliasing the kernel relies on, and no other
    assert overlaps == {
        ("kl_hi", "raw_q"),
        ("l", "raw_q"),
        ("kl_lo", "raw_k"),
        ("ql_hi", "raw_g"),
        ("mqk_stage", "raw_g"),
        ("kl_hi", "l"),
        ("mqk_stage", "ql_hi"),
    }
    # the operand tiles themselves are disjoint and cover the 24,576 bytes
    tiles = [plan[n] for n in prepare_fp32.OPERANDS]
    assert sorted(t[0] for t in tiles) == [i * 4096 for i in range(6)]
    assert all(t[1] == 4096 for t in tiles)


@pytest.mark.parametrize("arch,grouped", KEYS)
def test_sass(builds, arch, grouped, tmp_path):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    _, cubin, _ = builds[(arch, grouped)]
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    path = tmp_path / "prepare_fp32.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run(
        [tool, "-sass", str(path)], capture_output=True, text=True, check=True
    ).stdout
    res = subprocess.run(
        [tool, "-res-usage", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert f"code for {arch}" in sass
    assert len(re.findall(r"HMMA\.16816\.F32\.BF16", sass)) == MMAS
    # the record's stores (see test_ptx_record_store_forms); nothing else is stored globally
    assert len(re.findall(r"\bSTG\.E(\.EF)?\.128\b", sass)) == RECORD_V4_STORES
    assert len(re.findall(r"\bSTG\.E(\.EF)?\s", sass)) == RECORD_B32_STORES + GT_STORES
    assert len(re.findall(r"\bSTG\b", sass)) == RECORD_B32_STORES + GT_STORES + RECORD_V4_STORES
    for op in ("MUFU.EX2", "MUFU.RCP", "MUFU.RSQ", "SHFL.BFLY", "SHFL.IDX"):
        assert op in sass, op
    assert not re.search(r"\b(LDL|STL)\b", sass)
    assert re.search(r"LOCAL:0\b", res), res
    assert re.search(r"STACK:0\b", res), res
    # CTAS_PER_SM CTAs of 128 threads per SM: at most 72 registers per thread
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    assert regs * prepare_fp32.NUM_THREADS * CTAS_PER_SM <= 65536, res


def test_grouped_heads_add_only_the_query_key_head_index(builds):
    """The grouped specialisation computes G = H / Hk and the CTA's query/key head h / G (two
    integer divisions, none in the plain kernel); the rest is the plain kernel's instructions."""
    for arch in ARCHS:
        plain, grouped = builds[(arch, False)][0], builds[(arch, True)][0]
        assert plain != grouped
        assert len(re.findall(r"\bdiv\.s32\b", plain)) == 0
        assert len(re.findall(r"\bdiv\.s32\b", grouped)) == 2
        for instr in ("mma.sync.aligned", "st.global", "ex2.approx", "cvt.rn.bf16x2.f32"):
            assert plain.count(instr) == grouped.count(instr), instr


def test_export_to_c_without_gpu(tmp_path):
    """compiled.export_to_c works here (no GPU), with KdaPrepare's argument list."""
    compiled = prepare_fp32.compile_kernel("sm_90a")
    assert wrapper_arguments(compiled, tmp_path, "kda_prepare_fp32_test") == [
        "module",
        "mQ",
        "mK",
        "mG",
        "mBeta",
        "mALog",
        "mDtBias",
        "mCuSeqlens",
        "mWorkspace",
        "scale",
        "lower_bound",
        "stream",
    ]


def test_compile_kernel_rejects_unknown_arch():
    with pytest.raises(ValueError):
        prepare_fp32.compile_kernel("sm_80")
