"""CPU checks of the column-split recurrence kernel (jax_kda/kernels/recurrence.py).

1. A numpy warp simulator: the PTX ISA semantics of ldmatrix / movmatrix / mma.m16n8k16 are
   written out here independently; the kernel's own lane index maps (imported from the kernel
   module) drive them through several chunks of docs/numerics.md section 5 in the kernel's
   software-pipelined order (P(c+1) built k-tile by k-tile from the freshly updated state
   registers), for every warp of every block_v, and the result must equal the plain matrix
   formulas. This catches fragment-layout and column-ownership bugs without a GPU (no rounding
   is simulated: a layout bug gives O(1) errors, so float64 is enough).
2. Compilation for sm_90a (every block_v) and sm_100a: the PTX holds the expected number of
   mma.sync m16n8k16 bf16 and movmatrix instructions, the cubin has no local memory (no spills),
   SASS (when cuobjdump is available) has HMMA.16816.F32.BF16 and MOVM, compile time is small;
   export_to_c works without a GPU.
3. The serving variant (KdaRecurrence(serving=True), state pools): the swizzled shared state
   tile's fragment maps give exactly the state registers (ldmatrix.trans) and their B operands
   (ldmatrix), conflict free; the pool state load / store and the checkpoint store, run as the
   kernel's own trace-time helpers on kernel_sim.Simt (one Python thread per GPU thread, real
   barriers and warp collectives), move every value of the slice to the right place and nothing
   anywhere else (f32 pools: bf16 rounding on entry, exact widening on exit); the checkpoint
   schedule; compilation of all eight pool specialisations (no spills, expected instructions).
"""

import re
import subprocess
import time

import numpy as np
import pytest
from c_export import wrapper_arguments

pytest.importorskip("cutlass")
rec = pytest.importorskip("jax_kda.kernels.recurrence")
from kernel_sim import (
    LANES,
    Simt,
    build_record,
    conflict_free,
    cuda_tool,
    f32_bits_to_bf16,
    frag_of,
    ldmatrix_x4,
    mma_16816,
    movmatrix_trans,
    pack,
    single_cubin,
    stmatrix_x4_trans,
)

from jax_kda import contract
from jax_kda.kernels import recurrence_common as common

# ------------------------------------------------------------------------------------------
# One warp over a few chunks, in the kernel's software-pipelined order, driven by its index maps
# ------------------------------------------------------------------------------------------


def _p_oq_chain(mem, state, n_tiles, kd_off=rec.OFF_KD, qd_off=rec.OFF_QD):
    """Prologue: P = kd . S^T, Oq = qd . S^T from the state registers, k-blocks ascending."""
    reg = rec.state_reg
    zero = [np.zeros(32)] * 4
    p = [zero] * n_tiles
    o = [zero] * n_tiles
    for kb in range(8):
        off = rec.ldmatrix_a_offset(LANES, kb)
        a_kd = ldmatrix_x4(mem, kd_off + off)
        a_qd = ldmatrix_x4(mem, qd_off + off)
        for nt in range(n_tiles):
            b = (
                movmatrix_trans(state[reg(kb, nt, 0, n_tiles)]),
                movmatrix_trans(state[reg(kb, nt, 1, n_tiles)]),
            )
            p[nt] = mma_16816(a_kd, b, p[nt])
            o[nt] = mma_16816(a_qd, b, o[nt])
    return p, o


def simulate_warp(records, v_tiles, b_rows, S, n_valid_last, n_tiles, warp, block_v):
    """records: [(mem, gt)] per chunk; v_tiles: [16, block_v] per chunk (the CTA's columns);
    b_rows: [16] per chunk; S: [block_v, 128] state rows of the CTA's columns (S[j, k]).
    The last chunk has n_valid_last valid rows. Returns (outs [chunks, 16, block_v] with NaN
    where this warp wrote nothing, S_new [block_v, 128] with NaN outside this warp's columns)."""
    reg = rec.state_reg
    col_w = warp * 8 * n_tiles
    n_chunks = len(records)
    zero = [np.zeros(32)] * 4
    state = [None] * (16 * n_tiles)
    for mt in range(8):
        for nt in range(n_tiles):
            for half in range(2):
                k = mt * 16 + rec.acc_row(LANES, half)
                j = col_w + nt * 8 + rec.acc_col(LANES)
                state[reg(mt, nt, half, n_tiles)] = pack(S[j, k], S[j + 1, k])
    p_acc, o_acc = _p_oq_chain(records[0][0], state, n_tiles)
    outs = np.full((n_chunks, 16, block_v), np.nan)
    for c in range(n_chunks):
        mem, gt_mem = records[c]
        nxt = records[min(c + 1, n_chunks - 1)][0]
        n_valid = 16 if c < n_chunks - 1 else n_valid_last
        v_mem = v_tiles[c].reshape(-1)  # the stage's v tile, 16-bit elements
        small = rec.ldmatrix_small_offset(LANES)
        a_inv = ldmatrix_x4(mem, rec.OFF_INV + small)
        a_mqk = ldmatrix_x4(mem, rec.OFF_MQK + small)
        ub = []
        for nt in range(n_tiles):
            u = []
            for half in range(2):
                row = rec.acc_row(LANES, half)
                e = (
                    rec.v_smem_offset(row, col_w + nt * 8 + rec.acc_col(LANES), block_v)
                    // 2
                )
                v = pack(v_mem[e], v_mem[e + 1])
                p = pack(p_acc[nt][2 * half], p_acc[nt][2 * half + 1])
                uu = (v - p) * b_rows[c][row][:, None]
                u.append(np.where((row < n_valid)[:, None], uu, 0.0))
            u_acc = mma_16816(
                a_inv, (movmatrix_trans(u[0]), movmatrix_trans(u[1])), zero
            )
            big_u = (pack(u_acc[0], u_acc[1]), pack(u_acc[2], u_acc[3]))
            ub.append((movmatrix_trans(big_u[0]), movmatrix_trans(big_u[1])))
        for nt in range(n_tiles):
            m_acc = mma_16816(a_mqk, ub[nt], zero)
            for half in range(2):
                row = rec.acc_row(LANES, half)
                col = col_w + nt * 8 + rec.acc_col(LANES)
                o = pack(o_acc[nt][2 * half], o_acc[nt][2 * half + 1])
                o = o + pack(m_acc[2 * half], m_acc[2 * half + 1])
                ok = row < n_valid
                outs[c, row[ok], col[ok]] = o[ok, 0]
                outs[c, row[ok], col[ok] + 1] = o[ok, 1]
        p_new = [zero] * n_tiles
        o_new = [zero] * n_tiles
        for mt in range(8):
            a_krt = ldmatrix_x4(
                mem, rec.OFF_KR + rec.ldmatrix_krt_offset(LANES, mt), trans=True
            )
            gt_lo = gt_mem[mt * 16 + rec.acc_row(LANES, 0)]
            gt_hi = gt_mem[mt * 16 + rec.acc_row(LANES, 1)]
            a_off = rec.ldmatrix_a_offset(LANES, mt)
            a_kd = ldmatrix_x4(nxt, rec.OFF_KD + a_off)
            a_qd = ldmatrix_x4(nxt, rec.OFF_QD + a_off)
            for nt in range(n_tiles):
                w = mma_16816(a_krt, ub[nt], zero)
                i0, i1 = reg(mt, nt, 0, n_tiles), reg(mt, nt, 1, n_tiles)
                state[i0] = state[i0] * gt_lo[:, None] + pack(w[0], w[1])
                state[i1] = state[i1] * gt_hi[:, None] + pack(w[2], w[3])
                b = (movmatrix_trans(state[i0]), movmatrix_trans(state[i1]))
                p_new[nt] = mma_16816(a_kd, b, p_new[nt])
                o_new[nt] = mma_16816(a_qd, b, o_new[nt])
        p_acc, o_acc = p_new, o_new
    S_new = np.full_like(S, np.nan)
    for mt in range(8):
        for nt in range(n_tiles):
            for half in range(2):
                k = mt * 16 + rec.acc_row(LANES, half)
                j = col_w + nt * 8 + rec.acc_col(LANES)
                s = state[reg(mt, nt, half, n_tiles)]
                S_new[j, k] = s[:, 0]
                S_new[j + 1, k] = s[:, 1]
    return outs, S_new


def reference_chunk(kd, qd, kr, gt, inv, mqk, S, V, b, n_valid):
    """docs/numerics.md section 5 for one chunk without rounding; S[j, k], V [16, cols]."""
    P = kd @ S.T
    u = (V - P) * b[:, None]
    u[n_valid:] = 0.0
    U = inv @ u
    out = qd @ S.T + mqk @ U
    S_new = S * gt[None, :] + U.T @ kr
    return out, S_new


def _random_chunk(rng, cols):
    kd, qd, kr = (rng.standard_normal((16, 128)) for _ in range(3))
    gt = rng.uniform(0.1, 1.0, 128)
    inv = np.tril(rng.standard_normal((16, 16)))
    mqk = np.tril(rng.standard_normal((16, 16)))
    V = rng.standard_normal((16, cols))
    b = rng.uniform(0.0, 1.0, 16)
    return kd, qd, kr, gt, inv, mqk, V, b


def _run_case(rng, block_v, n_chunks, n_valid_last):
    """Every warp of a block_v CTA simulated over n_chunks; returns (outs, S_new, ref, ref_S)."""
    n_warps, n_tiles = rec.warp_split(block_v)
    chunks = [_random_chunk(rng, block_v) for _ in range(n_chunks)]
    S = rng.standard_normal((block_v, 128))
    records = [build_record(*ch[:6]) for ch in chunks]
    v_tiles = [ch[6] for ch in chunks]
    b_rows = [ch[7] for ch in chunks]
    outs = np.full((n_chunks, 16, block_v), np.nan)
    S_new = np.full_like(S, np.nan)
    for w in range(n_warps):
        o, s = simulate_warp(
            records, v_tiles, b_rows, S, n_valid_last, n_tiles, w, block_v
        )
        mine = ~np.isnan(s[:, 0])
        assert not (mine & ~np.isnan(S_new[:, 0])).any(), "two warps own one column"
        S_new[mine] = s[mine]
        written = ~np.isnan(o)
        outs[written] = o[written]
    ref_outs = np.full_like(outs, np.nan)
    ref_S = S
    for c, (kd, qd, kr, gt, inv, mqk, V, b) in enumerate(chunks):
        n_valid = 16 if c < n_chunks - 1 else n_valid_last
        out, ref_S = reference_chunk(kd, qd, kr, gt, inv, mqk, ref_S, V, b, n_valid)
        ref_outs[c, :n_valid] = out[:n_valid]
    return outs, S_new, ref_outs, ref_S


@pytest.mark.parametrize("block_v", contract.COLUMN_SPLITS)
@pytest.mark.parametrize("n_chunks,n_valid_last", [(1, 16), (1, 1), (3, 5)])
def test_fragment_simulator_matches_matrix_math(block_v, n_chunks, n_valid_last):
    rng = np.random.default_rng(block_v * 100 + n_chunks * 10 + n_valid_last)
    outs, S_new, ref_outs, ref_S = _run_case(rng, block_v, n_chunks, n_valid_last)
    # same NaN pattern: every valid row of every column written once, nothing past the end
    np.testing.assert_array_equal(np.isnan(outs), np.isnan(ref_outs))
    np.testing.assert_allclose(outs, ref_outs, rtol=0, atol=1e-8)
    np.testing.assert_allclose(S_new, ref_S, rtol=0, atol=1e-8)


def test_fragment_simulator_detects_a_missing_transpose():
    """The simulator is sensitive: feeding accumulator registers as a B operand without
    movmatrix gives a different product (so such a layout slip would be caught)."""
    rng = np.random.default_rng(7)
    kd, qd, kr, gt, inv, mqk, _, _ = _random_chunk(rng, 8)
    S = rng.standard_normal((8, 128))
    mem, _ = build_record(kd, qd, kr, gt, inv, mqk)
    state = [None] * 16
    for mt in range(8):
        for half in range(2):
            k = mt * 16 + rec.acc_row(LANES, half)
            j = rec.acc_col(LANES)
            state[rec.state_reg(mt, 0, half, 1)] = pack(S[j, k], S[j + 1, k])
    good, _ = _p_oq_chain(mem, state, 1)
    bad = [movmatrix_trans(x) for x in state]  # movmatrix twice == no transpose at all
    wrong, _ = _p_oq_chain(mem, bad, 1)
    g, t = LANES // 4, LANES % 4
    P = kd @ S.T
    np.testing.assert_allclose(good[0][0], P[g, 2 * t], atol=1e-9)
    assert np.abs(wrong[0][0] - P[g, 2 * t]).max() > 1e-3


def test_accumulator_to_b_operand_is_a_transpose():
    """movmatrix of the two packed accumulator halves of X (16 x 8) is the B operand of X."""
    rng = np.random.default_rng(3)
    X = rng.standard_normal((16, 8))
    g, t = LANES // 4, LANES % 4
    c = [X[g, 2 * t], X[g, 2 * t + 1], X[g + 8, 2 * t], X[g + 8, 2 * t + 1]]
    b = (movmatrix_trans(pack(c[0], c[1])), movmatrix_trans(pack(c[2], c[3])))
    eye = [
        frag_of(np.eye(8)),
        frag_of(np.zeros((8, 8))),
        frag_of(np.zeros((8, 8))),
        frag_of(np.eye(8)),
    ]
    d = mma_16816(eye, b, [np.zeros(32)] * 4)  # I_16 . X == X
    np.testing.assert_array_equal(np.stack(d), np.stack(c))


@pytest.mark.parametrize("n_tiles", [1, 2])
def test_carried_chunk_operands_split_back_in_load_order(n_tiles):
    """The flat register list carried across the loop back-edge (_chunk_operands order: v per
    n-tile and half, b per half, INV, Mqk, kr^T per k-tile, row mask per half) comes apart into
    exactly those pieces, every register used once."""
    n = rec._chunk_operand_count(n_tiles)
    v, b, inv, mqk, krt, row_mask = rec._split_operands(list(range(n)), n_tiles)
    assert [x for pair in v for x in pair] == list(range(2 * n_tiles))
    at = 2 * n_tiles
    assert b == [at, at + 1]
    assert inv == list(range(at + 2, at + 6))
    assert mqk == list(range(at + 6, at + 10))
    assert [x for frag in krt for x in frag] == list(range(at + 10, n - 2))
    assert len(krt) == 8 and all(len(frag) == 4 for frag in krt)
    assert row_mask == [n - 2, n - 1]


def test_ldmatrix_offsets_cover_the_swizzled_tile_once():
    """Per k-block, the 32 row addresses are distinct 16-byte granules of the right rows."""
    for kb in range(8):
        offs = rec.ldmatrix_a_offset(LANES, kb)
        assert (
            len(set(offs.tolist())) == 32
            and (offs % 16 == 0).all()
            and (offs < 4096).all()
        )
        offs = rec.ldmatrix_krt_offset(LANES, kb)
        assert (
            len(set(offs.tolist())) == 32
            and (offs % 16 == 0).all()
            and (offs < 4096).all()
        )
    offs = rec.ldmatrix_small_offset(LANES)
    assert sorted(offs.tolist()) == list(range(0, 512, 16))


# ------------------------------------------------------------------------------------------
# Compilation (no GPU needed)
# ------------------------------------------------------------------------------------------


CASES = [(bv, "sm_90a") for bv in contract.COLUMN_SPLITS] + [
    (32, "sm_100a"),
    (128, "sm_100a"),
]


@pytest.mark.parametrize("block_v,arch", CASES)
def test_compiles_with_mma_movmatrix_and_no_spills(block_v, arch, tmp_path):
    t0 = time.time()
    compiled = rec.compile_kernel(block_v, arch, dump_dir=str(tmp_path))
    elapsed = time.time() - t0
    assert elapsed < 120, f"compile took {elapsed:.1f} s"
    ptx = compiled.__ptx__
    _, n_tiles = rec.warp_split(block_v)
    assert f".target {arch}" in ptx
    # per n-tile: prologue P(0)/Oq(0) chains (16 MMAs, 16 state movmatrix); loop body (emitted
    # once): 1 (INV.u) + 1 (Mqk.U) + 8 (state update) + 16 (next chunk's P, Oq) MMAs and
    # 2 (u -> B) + 2 (U -> B) + 16 (state -> B) movmatrix.
    assert (
        ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 42 * n_tiles
    )
    assert ptx.count("movmatrix.sync.aligned.m8n8.trans.b16") == 36 * n_tiles
    assert ".local" not in ptx
    assert "fma.rn.ftz.f32" in ptx and "tanh.approx.f32" in ptx

    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip(
            "cuobjdump not available: PTX checked, cubin resource usage not checked"
        )
    cubin = single_cubin(str(tmp_path))
    res = subprocess.run(
        [cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True
    )
    assert "LOCAL:0" in res.stdout and "STACK:0" in res.stdout, res.stdout
    sass = subprocess.run(
        [cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    if sass.strip():
        assert "HMMA.16816.F32.BF16" in sass
        assert "MOVM.16.MT88" in sass
        assert "LDL" not in sass and "STL" not in sass


def test_export_to_c_writes_header_and_object(tmp_path):
    """The AOT path: export_to_c on a GPU-less machine; the FFI handler codes against this
    argument order."""
    compiled = rec.compile_kernel(32, "sm_90a")
    assert wrapper_arguments(compiled, tmp_path, "test_kda_recurrence_bv32_sm90a") == [
        "module", "mV", "mBeta", "mWorkspace", "mCuSeqlens", "mState0", "mOut", "mStateT",
        "stream"]


# ------------------------------------------------------------------------------------------
# The stage loader's address arithmetic, run on Python integers against a fake memory
# ------------------------------------------------------------------------------------------
class _FakeMachine:
    """Global memory as one bytearray (addresses = offsets), shared memory as another; the
    loader's memory helpers are replaced by versions that act on them and check bounds."""

    def __init__(self, gmem, arrays, smem_bytes):
        self.gmem = gmem
        self.arrays = arrays  # name -> (start, end) of each global array
        self.smem = bytearray(smem_bytes)
        self.sync_beta_copies = 0

    def _check(self, addr, size):
        assert any(s <= addr and addr + size <= e for s, e in self.arrays.values()), (
            f"global access [{addr}, {addr + size}) outside every array"
        )

    def cp_async_16_if(self, smem, gmem, idx, limit):
        smem, gmem = int(smem), int(gmem)
        if int(idx) < int(limit):
            self._check(gmem, 16)
            assert gmem % 16 == 0 and smem % 16 == 0
            self.smem[smem : smem + 16] = self.gmem[gmem : gmem + 16]

    def beta_to_shared_if(self, slot, elem_addr, async_ok, idx, limit):
        slot, elem_addr = int(slot), int(elem_addr)
        if int(idx) < int(limit):
            if int(async_ok):
                word = elem_addr & ~3
                self._check(word, 4)
                self.smem[slot : slot + 4] = self.gmem[word : word + 4]
            else:
                self.sync_beta_copies += 1
                self._check(elem_addr, 2)
                off = slot + (elem_addr & 2)
                self.smem[off : off + 2] = self.gmem[elem_addr : elem_addr + 2]

    def select_lt(self, idx, limit, a, b):
        return a if int(idx) < int(limit) else b

    def ld_shared_u16(self, addr):
        addr = int(addr)
        return int.from_bytes(self.smem[addr : addr + 2], "little")


@pytest.mark.parametrize("block_v", contract.COLUMN_SPLITS)
@pytest.mark.parametrize("beta_misalign", [0, 2])
@pytest.mark.parametrize("eos", [37, 30])
def test_stage_loader_copies_the_right_bytes(block_v, beta_misalign, eos, monkeypatch):
    from cutlass import Int32

    rng = np.random.default_rng(block_v + beta_misalign)
    # chunks of tokens 5..20 and 21..36 (eos = 37: the sequence ends at the arrays' last token;
    # eos = 30: the second chunk has 9 valid rows)
    t_total, heads, head = 37, 3, 2
    bos, slot0, n_slots = 5, 1, 6
    n_warps, _ = rec.warp_split(block_v)
    v_off, beta_off, stage_bytes = rec.stage_layout(block_v)
    slice_idx = 128 // block_v - 1
    v = rng.integers(0, 2**16, (t_total, heads, 128), dtype=np.uint16)
    beta = rng.integers(0, 2**16, (t_total, heads), dtype=np.uint16)
    ws = rng.integers(0, 256, (heads, n_slots, rec.RECORD_BYTES), dtype=np.uint8)
    v_base, ws_base = 64, 64 + v.nbytes + 64
    beta_base = ws_base + ws.nbytes + 64 + beta_misalign
    gmem = bytearray(beta_base + beta.nbytes + 64)
    gmem[v_base : v_base + v.nbytes] = v.tobytes()
    gmem[ws_base : ws_base + ws.nbytes] = ws.tobytes()
    gmem[beta_base : beta_base + beta.nbytes] = beta.tobytes()
    arrays = {
        "v": (v_base, v_base + v.nbytes),
        "ws": (ws_base, ws_base + ws.nbytes),
        "beta": (beta_base, beta_base + beta.nbytes),
    }
    fake = _FakeMachine(gmem, arrays, 2 * stage_bytes)
    for name in ("cp_async_16_if", "beta_to_shared_if", "select_lt", "ld_shared_u16"):
        monkeypatch.setattr(rec.ptx, name, getattr(fake, name))

    col_cta = slice_idx * block_v
    for chunk in range(2):
        stage = chunk * stage_bytes
        for tid in range(32 * n_warps):
            src = common.StageSources(
                ws_head=ws_base + head * n_slots * rec.RECORD_BYTES,
                slot0=slot0,
                v_col0=v_base + col_cta * 2,
                beta_base=beta_base,
                num_heads=heads,
                head=head,
                bos=bos,
                eos=eos,
                beta_elems=t_total * heads,
                tid=tid,
                nthreads=32 * n_warps,
                block_v=block_v,
                v_off=v_off,
                beta_off=beta_off,
            )
            rec._load_stage(src, Int32(chunk), stage)
        got = fake.smem[stage : stage + stage_bytes]
        assert bytes(got[: rec.RECORD_BYTES]) == ws[head, slot0 + chunk].tobytes()
        rows = np.arange(16) + bos + 16 * chunk
        n_valid = int((rows < eos).sum())
        v_tile = np.frombuffer(bytes(got[v_off:beta_off]), np.uint16).reshape(
            16, block_v
        )
        np.testing.assert_array_equal(
            v_tile[:n_valid], v[rows[:n_valid], head, col_cta : col_cta + block_v]
        )
        assert not v_tile[n_valid:].any(), "rows past the sequence end must not be read"
        for r in range(n_valid):
            bits = common.beta_bits(src, stage, Int32(bos + 16 * chunk), r)
            assert int(bits) == beta[rows[r], head], (chunk, r)
    # the last element of beta starts a 4-byte word only for an even array start: then (and
    # only then) the synchronous fallback must have been taken for it
    expected = 1 if (beta_misalign == 0 and eos == t_total) else 0
    assert fake.sync_beta_copies == expected


# ------------------------------------------------------------------------------------------
# Serving variant: shared-memory state tile, pool state I/O, checkpoints
# ------------------------------------------------------------------------------------------
def _tile_of(S):
    """A [rows, 128] state slice in the swizzled shared tile (16-bit slots, float64)."""
    rows = S.shape[0]
    mem = np.full(rows * 128, np.nan)
    v, k = np.meshgrid(np.arange(rows), np.arange(128), indexing="ij")
    mem[rec.state_smem_offset(v, k) // 2] = S
    return mem


@pytest.mark.parametrize("n_tiles", [1, 2, 4])
def test_state_tile_fragments_are_the_state_registers(n_tiles):
    """ldmatrix.trans at state_frag_offset gives the accumulator-layout registers
    state[mt, nt, half] = (S[j, k], S[j + 1, k]) that state_frag_regs names, plain ldmatrix their
    movmatrix.trans (the B operand), every register exactly once; each 8-lane phase is
    conflict free."""
    rng = np.random.default_rng(n_tiles)
    warps = 2
    S = rng.standard_normal((warps * 8 * n_tiles, 128))
    mem = _tile_of(S)
    for w in range(warps):
        col_w = w * 8 * n_tiles
        seen = set()
        for q in range(rec.state_frag_count(n_tiles)):
            offs = rec.state_frag_offset(LANES, q, col_w, n_tiles)
            assert len(set(offs.tolist())) == 32 and (offs % 16 == 0).all()
            for m in range(4):
                assert conflict_free(offs[8 * m : 8 * m + 8], 16)
            acc = ldmatrix_x4(mem, offs, trans=True)
            bop = ldmatrix_x4(mem, offs)
            for m, (mt, nt, half) in enumerate(rec.state_frag_regs(q, n_tiles)):
                seen.add((mt, nt, half))
                k = mt * 16 + rec.acc_row(LANES, half)
                j = col_w + nt * 8 + rec.acc_col(LANES)
                reg = pack(S[j, k], S[j + 1, k])
                np.testing.assert_array_equal(acc[m], reg)
                np.testing.assert_array_equal(bop[m], movmatrix_trans(reg))
        assert seen == {(mt, nt, h) for mt in range(8) for nt in range(n_tiles) for h in (0, 1)}


@pytest.mark.parametrize("n_tiles", [1, 2, 4])
def test_stmatrix_trans_of_the_registers_writes_the_tile(n_tiles):
    rng = np.random.default_rng(10 + n_tiles)
    S = rng.standard_normal((8 * n_tiles, 128))
    mem = np.full(8 * n_tiles * 128, np.nan)
    for q in range(rec.state_frag_count(n_tiles)):
        regs = []
        for mt, nt, half in rec.state_frag_regs(q, n_tiles):
            k = mt * 16 + rec.acc_row(LANES, half)
            j = nt * 8 + rec.acc_col(LANES)
            regs.append(pack(S[j, k], S[j + 1, k]))
        stmatrix_x4_trans(mem, rec.state_frag_offset(LANES, q, 0, n_tiles), regs)
    np.testing.assert_array_equal(mem, _tile_of(S))


def test_state_tile_offsets_are_a_bijection():
    v, k = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    offs = rec.state_smem_offset(v, k)
    assert sorted(offs.reshape(-1).tolist()) == list(range(0, 128 * 256, 2))


@pytest.mark.parametrize("esz", [2, 4])
@pytest.mark.parametrize("block_v", contract.COLUMN_SPLITS)
def test_state_copy_units_cover_the_slice_once_coalesced_and_conflict_free(esz, block_v):
    n_warps, n_tiles = rec.warp_split(block_v)
    n = 32 * n_warps
    units = block_v * 128 * esz // 16
    assert units % n == 0 and (8 * n_tiles * 128 * esz // 16) % 32 == 0
    # CTA-wide load order (_load_state_pool) and per-warp store order (_store_state_pool)
    for threads, count in ((n, units), (32, 8 * n_tiles * 128 * esz // 16)):
        seen = set()
        for i in range(count // threads):
            idx = np.arange(threads) + i * threads
            v, k = rec.state_copy_unit(idx, esz)
            gaddr = (v * 128 + k) * esz
            # consecutive lanes: consecutive 16-byte global units
            assert (np.diff(gaddr) == 16).all()
            saddr = rec.state_smem_offset(v, k)
            assert conflict_free(saddr, 16 if esz == 2 else 8)
            seen |= set(zip(v.tolist(), k.tolist()))
        per = 16 // esz
        rows = count * 16 // (128 * esz)
        assert seen == {(v, k) for v in range(rows) for k in range(0, 128, per)}


def _cta(block_v, tid, head=1, num_heads=3):
    n_warps, n_tiles = rec.warp_split(block_v)
    return common.Cta(
        n_tiles=n_tiles,
        block_v=block_v,
        nthreads=32 * n_warps,
        tid=tid,
        lane=tid % 32,
        col_w=(tid // 32) * 8 * n_tiles,
        col_cta=128 - block_v,  # the last slice
        head=head,
        num_heads=num_heads,
    )


def _bf16_bits_to_f32(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("state_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("block_v", contract.COLUMN_SPLITS)
def test_pool_state_load_and_store_round_trip_on_the_simt_emulator(
    state_dtype, block_v, monkeypatch
):
    """_load_state_pool then _store_state_pool, the kernel's own helpers, one Python thread per
    GPU thread: every thread's registers are the accumulator-layout state (bf16; an f32 pool
    rounded to nearest even on entry), and the slice written back is the bf16 state (widened
    exactly for f32); nothing outside the slice is read or written."""
    esz = rec.STATE_ELEM_BYTES[state_dtype]
    n_warps, n_tiles = rec.warp_split(block_v)
    nthreads = 32 * n_warps
    rng = np.random.default_rng(block_v + esz)
    rows, heads, head, row = 3, 3, 1, 2
    pool = rng.standard_normal((rows, heads, 128, 128)).astype(np.float32)
    pool[row, head, 0, :4] = [1 + 2**-8, 1 + 3 * 2**-8, 3e-39, -0.0]  # ties, a subnormal, -0
    if state_dtype == "bf16":
        bits = np.array([f32_bits_to_bf16(b) for b in pool.view(np.uint32).reshape(-1)])
        pool_mem = bits.astype(np.uint16).reshape(pool.shape)
    else:
        pool_mem = pool
    sim = Simt(2 * pool_mem.nbytes + 4096, rec.pool_smem_bytes(block_v) + 16, nthreads)
    base = sim.place("pool", pool_mem, 256)
    sim.patch(monkeypatch, rec.ptx)
    col_cta = 128 - block_v
    slice_addr = base + ((row * heads + head) * 128 * 128 + col_cta * 128) * esz
    tile = rec.LOOKAHEAD * rec.stage_layout(block_v)[2]
    states = {}

    def load(tid):
        state = [None] * (16 * n_tiles)
        rec._load_state_pool(_cta(block_v, tid, head, heads), state, tile, slice_addr, esz)
        states[tid] = state

    sim.run(load)
    src = pool[row, head]
    want_bits = np.array(
        [f32_bits_to_bf16(b) for b in src.view(np.uint32).reshape(-1)]
    ).reshape(128, 128)
    if state_dtype == "bf16":
        want_bits = pool_mem[row, head].astype(np.int64)
    for tid, state in states.items():
        lane, col_w = tid % 32, (tid // 32) * 8 * n_tiles
        for mt in range(8):
            for nt in range(n_tiles):
                for half in range(2):
                    k = mt * 16 + rec.acc_row(lane, half)
                    j = col_cta + col_w + nt * 8 + rec.acc_col(lane)
                    want = int(want_bits[j, k]) | (int(want_bits[j + 1, k]) << 16)
                    assert state[rec.state_reg(mt, nt, half, n_tiles)] == want
    before = sim.read("pool", pool_mem.dtype, pool_mem.shape)

    def store(tid):
        rec._store_state_pool(
            _cta(block_v, tid, head, heads), states[tid], 0, slice_addr, esz, lane=tid % 32
        )

    sim.run(store)
    after = sim.read("pool", pool_mem.dtype, pool_mem.shape)
    expect = before.copy()
    if state_dtype == "bf16":
        expect[row, head, col_cta:] = want_bits[col_cta:].astype(np.uint16)
    else:
        expect[row, head, col_cta:] = _bf16_bits_to_f32(want_bits[col_cta:])
    np.testing.assert_array_equal(after.view(np.uint8), expect.view(np.uint8))
    assert all(
        slice_addr <= a and a + n <= slice_addr + block_v * 128 * esz
        for a, n in sim.global_writes
    )


@pytest.mark.parametrize("state_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("block_v", [16, 64])
def test_checkpoint_store_writes_the_state_row(state_dtype, block_v, monkeypatch):
    """_store_checkpoint (kernel helper, Simt): checkpoints[row, head] rows of this CTA's slice
    get the registers' state (bf16, or widened), nothing else is written."""
    esz = rec.STATE_ELEM_BYTES[state_dtype]
    n_warps, n_tiles = rec.warp_split(block_v)
    nthreads = 32 * n_warps
    rng = np.random.default_rng(3 * block_v + esz)
    C, heads, head, row = 4, 3, 2, 1
    S = rng.integers(0, 2**16, (128, 128)).astype(np.int64)  # bf16 bit patterns
    dtype = np.uint16 if esz == 2 else np.uint32
    ck = np.zeros((C, heads, 128, 128), dtype)
    sim = Simt(ck.nbytes + 4096, 1024, nthreads)
    base = sim.place("ck", ck, 512)
    sim.patch(monkeypatch, rec.ptx)
    col_cta = 128 - block_v

    def body(tid):
        lane, col_w = tid % 32, (tid // 32) * 8 * n_tiles
        state = [None] * (16 * n_tiles)
        for mt in range(8):
            for nt in range(n_tiles):
                for half in range(2):
                    k = mt * 16 + rec.acc_row(lane, half)
                    j = col_cta + col_w + nt * 8 + rec.acc_col(lane)
                    state[rec.state_reg(mt, nt, half, n_tiles)] = int(S[j, k]) | (
                        int(S[j + 1, k]) << 16
                    )
        rec._store_checkpoint(_cta(block_v, tid, head, heads), state, base, row, esz)

    sim.run(body)
    got = sim.read("ck", dtype, ck.shape)
    want = ck.copy()
    want[row, head, col_cta:] = S[col_cta:] if esz == 2 else (S[col_cta:] << 16)
    np.testing.assert_array_equal(got, want)


def _checkpoints_written(num_chunks, n16, first_row, C):
    """The serving kernel's segment loop (kernel_pool), restated on Python ints: [(chunk after
    which the state is written, checkpoint row)]."""
    seg = max(n16 if n16 > 0 else num_chunks, 1)
    num_segs = (num_chunks - 1) // seg + 1 if num_chunks > 0 else 0
    out, ran = [], []
    for j in range(num_segs):
        c0 = j * seg
        c1 = min(c0 + seg, num_chunks)
        ran += list(range(c0, c1))
        row = first_row + j
        if c1 < num_chunks and 0 <= row < C:
            out.append((c1 - 1, row))
    assert ran == list(range(num_chunks)), "the segments must run every chunk once, in order"
    return out


@pytest.mark.parametrize("num_chunks", [0, 1, 2, 3, 7, 8, 9, 16])
@pytest.mark.parametrize("n16", [-1, 0, 1, 2, 3, 8, 2**31 - 1])
@pytest.mark.parametrize("first_row,C", [(0, 100), (5, 7), (-2, 100), (0, 0)])
def test_checkpoint_schedule_is_the_contract(num_chunks, n16, first_row, C):
    """After chunk c with (c + 1) % n16 == 0 and c + 1 < num_chunks, row offsets[seq] + (c + 1) //
    n16 - 1 if that is in [0, C); nothing for n16 <= 0."""
    want = [
        (c, first_row + (c + 1) // n16 - 1)
        for c in range(num_chunks)
        if n16 > 0 and (c + 1) % n16 == 0 and c + 1 < num_chunks
        and 0 <= first_row + (c + 1) // n16 - 1 < C
    ]
    assert _checkpoints_written(num_chunks, n16, first_row, C) == want


def test_serving_constructor_and_options():
    k = rec.KdaRecurrence(64, "f32", serving=True)
    assert isinstance(k, rec.KdaRecurrencePool) and k.state_elem_bytes == 4
    assert type(rec.KdaRecurrence(64)) is rec.KdaRecurrence
    with pytest.raises(ValueError):
        rec.KdaRecurrence(64, "f32")
    with pytest.raises(ValueError):
        rec.KdaRecurrence(64, "f16", serving=True)
    for bv in contract.COLUMN_SPLITS:
        _, _, stage = rec.stage_layout(bv)
        smem = rec.pool_smem_bytes(bv)
        assert smem >= rec.STAGES * stage and smem >= rec.LOOKAHEAD * stage + bv * 256
        assert smem % 16 == 0 and smem + 16 <= 227 * 1024


POOL_CASES = [(bv, dt, "sm_90a") for bv in contract.COLUMN_SPLITS for dt in ("bf16", "f32")] + [
    (128, "f32", "sm_100a"),
    (16, "bf16", "sm_100a"),
]


@pytest.mark.parametrize("block_v,state_dtype,arch", POOL_CASES)
def test_pool_variant_compiles_without_spills(block_v, state_dtype, arch, tmp_path):
    compiled = rec.compile_kernel(
        block_v, arch, state_dtype=state_dtype, serving=True, dump_dir=str(tmp_path)
    )
    ptx = compiled.__ptx__
    _, n_tiles = rec.warp_split(block_v)
    assert f".target {arch}" in ptx
    # the prefill kernel's 42 MMAs per n-tile (the chunk loop is emitted once); movmatrix: its 36
    # per n-tile and 16 per n-tile for the checkpoint store
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 42 * n_tiles
    assert ptx.count("movmatrix.sync.aligned.m8n8.trans.b16") == (36 + 16) * n_tiles
    # state through shared memory: 4 n_tiles ldmatrix.trans in, 4 n_tiles stmatrix.trans out
    # (plus kr^T: 8 per chunk-operand read, prologue and loop)
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 16 + 4 * n_tiles
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 4 * n_tiles
    state_bytes = block_v * 128 * (2 if state_dtype == "bf16" else 4)
    n_load = state_bytes // 16 // (32 * rec.warp_split(block_v)[0])
    assert ptx.count("ld.global.v4.b32") == n_load
    if state_dtype == "f32":
        assert "cvt.rn.bf16x2.f32" in ptx and "st.global.v2.b32" in ptx
    assert ".local" not in ptx
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not available: PTX checked, cubin resource usage not checked")
    cubin = single_cubin(str(tmp_path))
    res = subprocess.run(
        [cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True
    )
    assert "LOCAL:0" in res.stdout and "STACK:0" in res.stdout, res.stdout
    usage = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", res.stdout)
    print(f"pool bv{block_v} {state_dtype} {arch}:", usage.group(0) if usage else res.stdout)
    sass = subprocess.run(
        [cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    if sass.strip():
        for op in ("HMMA.16816.F32.BF16", "MOVM.16.MT88", "LDSM.16.MT88.4", "STSM.16.MT88.4"):
            assert op in sass, op
        assert "LDL" not in sass and "STL" not in sass


def test_pool_variant_export_to_c_argument_order(tmp_path):
    """The serving variant's exported wrapper: the FFI handler codes against this order."""
    compiled = rec.compile_kernel(32, "sm_90a", state_dtype="f32", serving=True)
    assert wrapper_arguments(compiled, tmp_path, "test_kda_recurrence_pool_f32_bv32_sm90a") == [
        "module",
        "mV",
        "mBeta",
        "mWorkspace",
        "mCuSeqlens",
        "mStateIndices",
        "mCheckpointOffsets",
        "mPool",
        "mOut",
        "mCheckpoints",
        "checkpoint_chunks",
        "stream",
    ]
