"""CPU checks of the prepare kernel: it compiles for sm_90a and sm_100a (both
inverse variants, plain and for grouped value heads) and its PTX/SASS hold the
instructions the rounding of docs/numerics.md section 3 relies on, with no local
memory. Needs nvidia-cutlass-dsl (build time only); SASS checks also need cuobjdump
(nvidia-cuda-cuobjdump wheel or a CUDA toolkit), and are skipped without it.
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
from jax_kda.kernels import prepare, prepare_common


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
from jax_kda import contract
from jax_kda.kernels import prepare
out = sys.argv[1]
for inverse in prepare.INVERSES:
    for arch in contract.ARCHS:
        for grouped in (False, True):
            c = prepare.compile_kernel(inverse, arch, grouped=grouped, dump_dir=out)
            open(f"{out}/{inverse}_{arch}_{grouped}.ptx", "w").write(c.__ptx__)
            open(f"{out}/{inverse}_{arch}_{grouped}.cubin", "wb").write(c.__cubin__)
"""


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{(inverse, arch, grouped): (ptx text, cubin bytes)} for the eight specialisations (grouped:
    q and k on fewer heads than the value heads).

    Built in a child process: the DSL fixes its artifact dump directory (the
    working directory) at import, so this keeps the dumps out of the checkout.
    """
    dump = tmp_path_factory.mktemp("prepare_dump")
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
    for inverse in prepare.INVERSES:
        for arch in contract.ARCHS:
            for grouped in (False, True):
                stem = dump / f"{inverse}_{arch}_{grouped}"
                out[(inverse, arch, grouped)] = (
                    stem.with_suffix(".ptx").read_text(),
                    stem.with_suffix(".cubin").read_bytes(),
                )
    return out


KEYS = [(i, a, g) for i in prepare.INVERSES for a in contract.ARCHS for g in (False, True)]


@pytest.mark.parametrize("inverse,arch,grouped", KEYS)
def test_ptx_targets_arch_and_uses_the_pinned_instructions(builds, inverse, arch, grouped):
    ptx, _ = builds[(inverse, arch, grouped)]
    assert f".target {arch}" in ptx
    body = ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in body
    if inverse == "neumann":
        assert "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16" in body
        assert "mul.rn.f16" in body and "add.rn.f16" in body
    else:
        assert ".f16.f16.f16.f16" not in body
    for instr in (
        "ex2.approx.ftz.f32",
        "tanh.approx.f32",
        "rsqrt.approx.ftz.f32",
        "mul.rn.bf16",
        "shfl.sync.bfly",
        "cvt.rn.bf16.f32",
    ):
        assert instr in body, instr
    # bf16 -> f32 must be a bit shift: a cvt would flush subnormals under -ftz
    assert "cvt.f32.bf16" not in body
    # f16 math must not flush (FlashKDA's half ops keep subnormals)
    assert not re.search(r"\b(add|mul|fma|sub)\.(rn\.)?ftz\.f16", body)
    # every non-approx f32 add/mul/fma is the fast-math .ftz form
    assert not re.search(r"\b(add|mul|fma)(\.rn)?\.f32\b", body)
    # the chunk's inputs come by 16-byte cp.async (q, k: 4 per thread, g: 2, dt_bias: 1), not
    # through registers; the record leaves by 16-byte stores
    assert body.count("cp.async.cg.shared.global") >= 7
    assert "ld.global.v4" not in body and "st.global.v4" in body


@pytest.mark.parametrize("inverse,arch,grouped", KEYS)
def test_no_local_memory_in_ptx(builds, inverse, arch, grouped):
    ptx, _ = builds[(inverse, arch, grouped)]
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
    assert ".local" not in ptx


def test_variants_compile_to_different_code(builds):
    assert builds[("stable", "sm_90a", False)][0] != builds[("neumann", "sm_90a", False)][0]


@pytest.mark.parametrize("inverse,arch", [(i, a) for i in prepare.INVERSES for a in contract.ARCHS])
def test_grouped_heads_add_only_the_query_key_head_index(builds, inverse, arch):
    """The grouped specialisation computes G = H / Hk and the CTA's query/key head h / G (two
    integer divisions, none in the plain kernel) and is otherwise the same kernel: the same MMA,
    cp.async and store instructions."""
    plain, _ = builds[(inverse, arch, False)]
    grouped, _ = builds[(inverse, arch, True)]
    assert plain != grouped
    assert len(re.findall(r"\bdiv\.s32\b", plain)) == 0
    assert len(re.findall(r"\bdiv\.s32\b", grouped)) == 2
    for instr in ("mma.sync.aligned", "cp.async.cg.shared.global", "st.global", "ex2.approx"):
        assert plain.count(instr) == grouped.count(instr), instr


@pytest.mark.parametrize("inverse,arch,grouped", KEYS)
def test_sass(builds, inverse, arch, grouped, tmp_path):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    _, cubin = builds[(inverse, arch, grouped)]
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    path = tmp_path / "prepare.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run(
        [tool, "-sass", str(path)], capture_output=True, text=True, check=True
    ).stdout
    res = subprocess.run(
        [tool, "-res-usage", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "HMMA.16816.F32.BF16" in sass
    if inverse == "neumann":
        assert "HMMA.16816.F16" in sass
    for op in ("MUFU.EX2", "MUFU.TANH", "MUFU.RSQ", "SHFL.BFLY"):
        assert op in sass, op
    assert not re.search(r"\b(LDL|STL)\b", sass)
    # one memory round trip per chunk: every copy of the chunk's inputs is issued before the
    # first wait for them (ptxas would sink plain loads towards their uses, one trip after another)
    copies = [m.start() for m in re.finditer(r"LDGSTS", sass)]
    first_wait = re.search(r"\bDEPBAR\.LE\b", sass).start()
    assert len(copies) >= 7 and max(copies) < first_wait
    assert not re.search(r"LDG\.E\.128", sass)
    assert re.search(r"LOCAL:0\b", res), res
    assert re.search(r"STACK:0\b", res), res


@pytest.mark.parametrize("grouped", [False, True])
def test_export_to_c_without_gpu(tmp_path, grouped):
    """compiled.export_to_c works here (no GPU) once the DSL runtime libs are loaded; the grouped
    specialisation takes the same arguments, with as many dynamic dimensions per tensor (the
    handler fills both the same way)."""
    compiled = prepare.compile_kernel("stable", "sm_90a", grouped=grouped)
    prefix = f"kda_prepare_test_{grouped}"
    assert wrapper_arguments(compiled, tmp_path, prefix) == [
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
    header = (tmp_path / f"{prefix}.h").read_text()
    # q: dynamic T_total and heads (Hk when grouped), static 128; strides T_total's only
    q_struct = re.search(rf"typedef struct {{([^}}]*)}} {prefix}_Tensor_mQ_t;", header)
    assert q_struct and "dynamic_shapes[2]" in q_struct.group(1), header


def test_compile_kernel_rejects_unknown_names():
    with pytest.raises(ValueError):
        prepare.compile_kernel("stable", "sm_80")
    with pytest.raises(ValueError):
        prepare.KdaPrepare("exact")


@pytest.mark.filterwarnings("ignore:This static loop")
def test_swizzled_smem_layout_is_the_abi_formula():
    """The kernel's (16, 128) swizzled tile layout equals docs/kernel_abi.md's formula,
    evaluated by CuTe's own layout algebra at trace time."""
    import numpy as np

    from jax_kda.kernels import workspace_layout as wl

    got = np.full((16, 128), -1, np.int64)

    @cute.jit
    def trace():
        lay = prepare_common.swizzled_tile_layout()
        for r in cutlass.range_constexpr(16):
            for c in cutlass.range_constexpr(128):
                got[r, c] = cute.crd2idx((r, c), lay)

    cute.compile[cute.GPUArch("sm_90a")](trace)
    np.testing.assert_array_equal(got, wl.swizzle_index())


def test_accumulator_coordinates_are_row_col():
    """The kernel reads (r, c) of each accumulator element from partition_C of an identity
    tensor; for m16n8k16 x 2 (16x16) lane l owns rows l//4, l//4+8 and columns 2(l%4)+{0,1}
    (+8): the PTX fragment layout."""
    seen = {}

    @cute.jit
    def trace():
        tiled = prepare_common.tiled_mma_bf16()
        for lane in cutlass.range_constexpr(32):
            coords = tiled.get_slice(lane).partition_C(
                cute.make_identity_tensor((16, 16))
            )
            seen[lane] = sorted(
                tuple(int(x) for x in coords[i]) for i in range(cute.size(coords))
            )

    cute.compile[cute.GPUArch("sm_90a")](trace)
    for lane, got in seen.items():
        rows = (lane // 4, lane // 4 + 8)
        cols = (
            2 * (lane % 4),
            2 * (lane % 4) + 1,
            2 * (lane % 4) + 8,
            2 * (lane % 4) + 9,
        )
        assert got == sorted((r, c) for r in rows for c in cols), lane


def test_phase_b_word_offsets_are_the_record_swizzle():
    """Phase B addresses the swizzled tiles by hand (bf16x2 words at
    prepare_common.swizzled_byte_offset): it must be the layout the record format defines
    (workspace_layout.swizzle_index) for every column pair, and phase B's thread map (pair
    t % 64, rows 8 (t // 64) .. + 7) must cover each of the tile's words exactly once."""
    import numpy as np

    from jax_kda.kernels import workspace_layout

    want = 2 * workspace_layout.swizzle_index()
    seen = np.zeros((contract.CHUNK, contract.HEAD_DIM // 2), int)
    for t in range(prepare.NUM_THREADS):
        c0 = 2 * (t % 64)
        for r in range(8 * (t // 64), 8 * (t // 64) + 8):
            off = prepare_common.swizzled_byte_offset(r, c0)
            assert off == want[r, c0] and off + 2 == want[r, c0 + 1], (r, c0)
            seen[r, c0 // 2] += 1
    assert (seen == 1).all()
