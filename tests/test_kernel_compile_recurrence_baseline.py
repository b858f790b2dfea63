"""CPU checks of the baseline recurrence kernel (jax_kda/kernels/recurrence_baseline.py).

1. Shared-memory layout maps: the swizzled state is a bijection onto its 32 KiB, every ldmatrix /
   stmatrix phase is bank-conflict free, the padded v / out rows are 16-byte aligned and the
   accumulator-layout accesses are conflict free, the smem regions do not overlap.
2. A numpy warp simulator (PTX ISA semantics of ldmatrix(.trans) / stmatrix.trans / movmatrix /
   mma.m16n8k16 written out here, independently of the kernel) runs every MMA warp of the CTA
   through several chunks with the state in simulated shared memory, driven by the kernel's own
   index maps, and must reproduce the plain matrix formulas (layout bugs give O(1) errors, so
   float64 without rounding is enough). It also checks that ldmatrix.trans of the shared state
   gives exactly recurrence.py's accumulator-layout state registers (the identity the bitwise
   equality of the two kernels rests on).
3. A randomised discrete-event model of the mbarrier protocol (full / empty ring, out staging
   handshake, tx byte counts, parity waits) for 0..9 chunks: no deadlock, no stage overwritten
   before it is released, every chunk read and stored from the right buffer.
4. Compilation for sm_90a and sm_100a: PTX and SASS contain the MMAs, ldmatrix/stmatrix, the
   bulk copies and the mbarrier operations, no local memory.
"""

import itertools
import os
import random
import subprocess
import time

import numpy as np
import pytest
from c_export import wrapper_arguments

pytest.importorskip("cutlass")
bl = pytest.importorskip("jax_kda.kernels.recurrence_baseline")
rec = pytest.importorskip("jax_kda.kernels.recurrence")
from kernel_sim import (
    LANES,
    build_record,
    cuda_tool,
    ldmatrix_x4,
    mat_of,
    mma_16816,
    movmatrix_trans,
    pack,
    single_cubin,
)


def stmatrix_x4_trans(mem, addrs, regs):
    """Inverse of ldmatrix_x4(trans=True): register i is the fragment of matrix i transposed."""
    for i in range(4):
        rows = mat_of(regs[i]).T
        for r, a in enumerate(addrs[8 * i : 8 * i + 8]):
            mem[a // 2 : a // 2 + 8] = rows[r]


def banks(byte_addrs, width):
    """Set of 4-byte banks touched by accesses of `width` bytes at byte_addrs."""
    out = []
    for a in np.atleast_1d(byte_addrs):
        out += [((int(a) + w) // 4) % 32 for w in range(0, width, 4)]
    return out


# ------------------------------------------------------------------------------------------
# Layout maps
# ------------------------------------------------------------------------------------------
def test_state_layout_is_a_bijection_onto_32k():
    v, k = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    offs = bl.state_smem_offset(v, k)
    assert offs.min() == 0 and offs.max() == bl.STATE_BYTES - 2
    assert (offs % 2 == 0).all()
    assert len(np.unique(offs)) == 128 * 128
    # 8 consecutive k of one row (one ldmatrix row) are one contiguous 16-byte granule
    for kg in range(16):
        first = bl.state_smem_offset(v[:, 0], 8 * kg)
        assert (first % 16 == 0).all()
        for e in range(8):
            np.testing.assert_array_equal(
                bl.state_smem_offset(v[:, 0], 8 * kg + e), first + 2 * e
            )


@pytest.mark.parametrize("warp", range(bl.NUM_MMA_WARPS))
def test_state_ldmatrix_addresses_and_banks(warp):
    """Per (k-block, n-tile pair): 32 distinct 16-byte row addresses inside the warp's rows, and
    each 8-lane phase (one 8x8 matrix) touches all 32 banks once."""
    col_w = warp * bl.WARP_COLS
    for kb in range(8):
        for pair in range(bl.N_TILES // 2):
            offs = bl.state_ldsm_offset(LANES, kb, col_w + 16 * pair)
            assert len(set(offs.tolist())) == 32 and (offs % 16 == 0).all()
            rows = offs // bl.STATE_ROW_BYTES
            assert ((rows >= col_w) & (rows < col_w + bl.WARP_COLS)).all()
            for m in range(4):
                assert sorted(banks(offs[8 * m : 8 * m + 8], 16)) == list(range(32))


def test_accumulator_layout_accesses_of_padded_rows_are_conflict_free():
    """v loads and out staging stores: lane -> (row acc_row, cols acc_col, +1), one 4-byte word;
    the 32 lanes of one instruction hit 32 distinct banks; rows are 16-byte aligned."""
    assert bl.ROW_PITCH % 16 == 0 and bl.ROW_PITCH >= 256
    for col0 in range(0, 128, 8):
        for half in range(2):
            offs = bl.row_offset(rec.acc_row(LANES, half), col0 + rec.acc_col(LANES))
            assert sorted(banks(offs, 4)) == list(range(32))
    r, c = np.meshgrid(np.arange(16), np.arange(128), indexing="ij")
    offs = bl.row_offset(r, c)
    assert len(np.unique(offs)) == 16 * 128 and offs.max() + 2 <= bl.OUT_TILE_BYTES


def test_smem_regions_are_disjoint_and_fit():
    assert bl.V_OFF == rec.RECORD_BYTES and bl.V_OFF % 16 == 0
    assert bl.BETA_OFF == bl.V_OFF + 16 * bl.ROW_PITCH
    assert bl.BETA_OFF + 32 <= bl.STAGE_BYTES and bl.STAGE_BYTES % 128 == 0
    regions = [(0, bl.BAR_BYTES), (bl.STATE_OFF, bl.STATE_OFF + bl.STATE_BYTES)]
    regions += [
        (bl.OUT_OFF + b * bl.OUT_TILE_BYTES, bl.OUT_OFF + (b + 1) * bl.OUT_TILE_BYTES)
        for b in range(bl.OUT_BUFS)
    ]
    regions += [
        (bl.RING_OFF + s * bl.STAGE_BYTES, bl.RING_OFF + (s + 1) * bl.STAGE_BYTES)
        for s in range(bl.STAGES)
    ]
    for (a0, a1), (b0, b1) in itertools.pairwise(regions):
        assert a1 <= b0 and b0 % 16 == 0
    assert regions[-1][1] == bl.SMEM_BYTES <= 227 * 1024
    assert bl.STAGES >= 2
    assert (bl.BAR_OUT_EMPTY + bl.OUT_BUFS) * 8 <= bl.BAR_BYTES


@pytest.mark.parametrize("warp", range(bl.NUM_MMA_WARPS))
def test_state_copy_covers_the_warps_rows_once(warp):
    col_w = warp * bl.WARP_COLS
    seen = set()
    for i in range(16):
        for lane in range(32):
            seen.add(bl.state_copy_granule(lane, i, col_w))
    assert seen == {(v, g) for v in range(col_w, col_w + 32) for g in range(16)}


# ------------------------------------------------------------------------------------------
# Fragment simulator: the CTA's four MMA warps over a few chunks, state in shared memory
# ------------------------------------------------------------------------------------------


def state_to_smem(S):
    smem = np.full(bl.STATE_BYTES // 2, np.nan)
    v, k = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    smem[bl.state_smem_offset(v, k) // 2] = S
    return smem


def smem_to_state(smem):
    v, k = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    return smem[bl.state_smem_offset(v, k) // 2]


def padded_tile(V):
    mem = np.full(16 * bl.ROW_PITCH // 2, np.nan)
    r, c = np.meshgrid(np.arange(16), np.arange(128), indexing="ij")
    mem[bl.row_offset(r, c) // 2] = V
    return mem


def simulate_cta(records, v_tiles, b_rows, S, n_valid_last):
    """All MMA warps of the CTA, in the kernel's order, on simulated shared memory. Stale rows
    of the last chunk's v tile are NaN (they must be masked to exactly 0). Returns (outs [chunks,
    16, 128] with NaN where nothing is stored, S_new [128, 128])."""
    n_chunks = len(records)
    zero = [np.zeros(32)] * 4
    smem = state_to_smem(S)
    outs = np.full((n_chunks, 16, 128), np.nan)
    for c in range(n_chunks):
        mem, gt_mem = records[c]
        n_valid = 16 if c < n_chunks - 1 else n_valid_last
        v_tile = v_tiles[c].copy()
        v_tile[n_valid:] = np.nan  # rows past the end are never copied: stale contents
        v_mem = padded_tile(v_tile)
        out_mem = np.full(bl.OUT_TILE_BYTES // 2, np.nan)
        for warp in range(bl.NUM_MMA_WARPS):
            col_w = warp * bl.WARP_COLS
            p = [zero] * bl.N_TILES
            o = [zero] * bl.N_TILES
            for kb in range(8):
                a_off = rec.ldmatrix_a_offset(LANES, kb)
                a_kd = ldmatrix_x4(mem, rec.OFF_KD + a_off)
                a_qd = ldmatrix_x4(mem, rec.OFF_QD + a_off)
                for pair in range(bl.N_TILES // 2):
                    bb = ldmatrix_x4(
                        smem, bl.state_ldsm_offset(LANES, kb, col_w + 16 * pair)
                    )
                    for e in range(2):
                        nt = 2 * pair + e
                        b = (bb[2 * e], bb[2 * e + 1])
                        p[nt] = mma_16816(a_kd, b, p[nt])
                        o[nt] = mma_16816(a_qd, b, o[nt])
            small = rec.ldmatrix_small_offset(LANES)
            a_inv = ldmatrix_x4(mem, rec.OFF_INV + small)
            a_mqk = ldmatrix_x4(mem, rec.OFF_MQK + small)
            ub = []
            for nt in range(bl.N_TILES):
                col = col_w + nt * 8 + rec.acc_col(LANES)
                u = []
                for half in range(2):
                    row = rec.acc_row(LANES, half)
                    e = bl.row_offset(row, col) // 2
                    v = pack(v_mem[e], v_mem[e + 1])
                    pp = pack(p[nt][2 * half], p[nt][2 * half + 1])
                    uu = (v - pp) * b_rows[c][row][:, None]
                    # the kernel's AND with the row mask: exactly 0, also for NaN
                    u.append(np.where((row < n_valid)[:, None], uu, 0.0))
                u_acc = mma_16816(
                    a_inv, (movmatrix_trans(u[0]), movmatrix_trans(u[1])), zero
                )
                big_u = (pack(u_acc[0], u_acc[1]), pack(u_acc[2], u_acc[3]))
                ub.append((movmatrix_trans(big_u[0]), movmatrix_trans(big_u[1])))
            for nt in range(bl.N_TILES):
                m_acc = mma_16816(a_mqk, ub[nt], zero)
                col = col_w + nt * 8 + rec.acc_col(LANES)
                for half in range(2):
                    row = rec.acc_row(LANES, half)
                    val = pack(o[nt][2 * half], o[nt][2 * half + 1])
                    val = val + pack(m_acc[2 * half], m_acc[2 * half + 1])
                    e = bl.row_offset(row, col) // 2
                    out_mem[e] = val[:, 0]
                    out_mem[e + 1] = val[:, 1]
            for mt in range(8):
                a_krt = ldmatrix_x4(
                    mem, rec.OFF_KR + rec.ldmatrix_krt_offset(LANES, mt), trans=True
                )
                gt_lo = gt_mem[mt * 16 + rec.acc_row(LANES, 0)]
                gt_hi = gt_mem[mt * 16 + rec.acc_row(LANES, 1)]
                for pair in range(bl.N_TILES // 2):
                    addr = bl.state_ldsm_offset(LANES, mt, col_w + 16 * pair)
                    old = ldmatrix_x4(smem, addr, trans=True)
                    new = []
                    for e in range(2):
                        w = mma_16816(a_krt, ub[2 * pair + e], zero)
                        new.append(old[2 * e] * gt_lo[:, None] + pack(w[0], w[1]))
                        new.append(old[2 * e + 1] * gt_hi[:, None] + pack(w[2], w[3]))
                    stmatrix_x4_trans(smem, addr, new)
        # the store warp: valid rows of the staging tile
        r, col = np.meshgrid(np.arange(n_valid), np.arange(128), indexing="ij")
        outs[c, :n_valid] = out_mem[bl.row_offset(r, col) // 2]
    return outs, smem_to_state(smem)


def reference_chunk(kd, qd, kr, gt, inv, mqk, S, V, b, n_valid):
    """docs/numerics.md section 5 for one chunk without rounding; S[j, k], V [16, 128]."""
    P = kd @ S.T
    u = (V - P) * b[:, None]
    u[n_valid:] = 0.0
    U = inv @ u
    out = qd @ S.T + mqk @ U
    S_new = S * gt[None, :] + U.T @ kr
    return out, S_new


def _random_chunk(rng):
    kd, qd, kr = (rng.standard_normal((16, 128)) for _ in range(3))
    gt = rng.uniform(0.1, 1.0, 128)
    inv = np.tril(rng.standard_normal((16, 16)))
    mqk = np.tril(rng.standard_normal((16, 16)))
    V = rng.standard_normal((16, 128))
    b = rng.uniform(0.0, 1.0, 16)
    return kd, qd, kr, gt, inv, mqk, V, b


@pytest.mark.parametrize("n_chunks,n_valid_last", [(1, 16), (1, 1), (3, 5), (2, 16)])
def test_fragment_simulator_matches_matrix_math(n_chunks, n_valid_last):
    rng = np.random.default_rng(n_chunks * 10 + n_valid_last)
    chunks = [_random_chunk(rng) for _ in range(n_chunks)]
    S = rng.standard_normal((128, 128))
    records = [build_record(*ch[:6]) for ch in chunks]
    outs, S_new = simulate_cta(
        records, [ch[6] for ch in chunks], [ch[7] for ch in chunks], S, n_valid_last
    )
    ref_outs = np.full_like(outs, np.nan)
    ref_S = S
    for c, (kd, qd, kr, gt, inv, mqk, V, b) in enumerate(chunks):
        n_valid = 16 if c < n_chunks - 1 else n_valid_last
        out, ref_S = reference_chunk(kd, qd, kr, gt, inv, mqk, ref_S, V, b, n_valid)
        ref_outs[c, :n_valid] = out[:n_valid]
    np.testing.assert_array_equal(np.isnan(outs), np.isnan(ref_outs))
    np.testing.assert_allclose(outs, ref_outs, rtol=0, atol=1e-8)
    np.testing.assert_allclose(S_new, ref_S, rtol=0, atol=1e-8)


@pytest.mark.parametrize("warp", range(bl.NUM_MMA_WARPS))
def test_shared_state_fragments_equal_column_split_registers(warp):
    """ldmatrix.trans of the shared state == recurrence.py's state registers (same packed pairs
    for the same lanes), and ldmatrix of it == movmatrix.trans of those registers (the B
    operand): the two kernels feed identical bits to identical instructions."""
    rng = np.random.default_rng(11 + warp)
    S = rng.standard_normal((128, 128))
    smem = state_to_smem(S)
    col_w = warp * bl.WARP_COLS
    for mt in range(8):
        for pair in range(bl.N_TILES // 2):
            addr = bl.state_ldsm_offset(LANES, mt, col_w + 16 * pair)
            acc = ldmatrix_x4(smem, addr, trans=True)
            bop = ldmatrix_x4(smem, addr)
            for e in range(2):
                nt = 2 * pair + e
                for half in range(2):
                    # recurrence.py's register state[mt, nt, half] of the same columns
                    k = mt * 16 + rec.acc_row(LANES, half)
                    j = col_w + nt * 8 + rec.acc_col(LANES)
                    reg = pack(S[j, k], S[j + 1, k])
                    np.testing.assert_array_equal(acc[2 * e + half], reg)
                    np.testing.assert_array_equal(
                        bop[2 * e + half], movmatrix_trans(reg)
                    )


def test_stmatrix_trans_round_trips():
    rng = np.random.default_rng(5)
    smem = state_to_smem(rng.standard_normal((128, 128)))
    addr = bl.state_ldsm_offset(LANES, 3, 48)
    regs = [rng.standard_normal((32, 2)) for _ in range(4)]
    before = smem.copy()
    stmatrix_x4_trans(smem, addr, regs)
    got = ldmatrix_x4(smem, addr, trans=True)
    for a, b in zip(got, regs):
        np.testing.assert_array_equal(a, b)
    changed = np.flatnonzero(before != smem)
    assert len(changed) <= 4 * 64  # only the 4 addressed 8x8 blocks


# ------------------------------------------------------------------------------------------
# mbarrier protocol model (random interleavings of the three roles and the async copies)
# ------------------------------------------------------------------------------------------
class _Bar:
    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _advance(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, n):
        self.pending -= n
        assert self.pending >= 0
        self._advance()

    def expect_tx(self, n):
        self.tx += n

    def complete_tx(self, n):
        assert self.tx >= n, "tx count would go negative"
        self.tx -= n
        self._advance()

    def test_wait(self, parity):
        """try_wait.parity: the phase of this parity is the one before the current one."""
        return (self.phase & 1) != parity


def _run_protocol(n_chunks, n_valid_last, seed):
    rnd = random.Random(seed)
    full = [_Bar(bl.FULL_COUNT) for _ in range(bl.STAGES)]
    empty = [_Bar(bl.EMPTY_COUNT) for _ in range(bl.STAGES)]
    out_full = [_Bar(bl.OUT_FULL_COUNT) for _ in range(bl.OUT_BUFS)]
    out_empty = [_Bar(bl.OUT_EMPTY_COUNT) for _ in range(bl.OUT_BUFS)]
    stage = [{"rec": None, "rows": {}, "beta": None} for _ in range(bl.STAGES)]
    out_buf = [{} for _ in range(bl.OUT_BUFS)]  # warp -> chunk
    reading = [False] * bl.OUT_BUFS  # a bulk store reads the tile
    events = []  # pending async copies: callables
    stored = []

    def n_valid(c):
        return 16 if c < n_chunks - 1 else n_valid_last

    def producer():
        for c in range(n_chunks):
            s, par = bl.ring_slot(c, bl.STAGES)
            while not empty[s].test_wait(par ^ 1):
                yield
            nv = n_valid(c)
            full[s].expect_tx(rec.RECORD_BYTES + nv * bl.ROW_BYTES)

            def land_rec(s=s, c=c):
                stage[s]["rec"] = c
                full[s].complete_tx(rec.RECORD_BYTES)

            events.append(land_rec)
            for r in range(nv):

                def land_row(s=s, c=c, r=r):
                    stage[s]["rows"][r] = c
                    full[s].complete_tx(bl.ROW_BYTES)

                events.append(land_row)
            stage[s]["beta"] = c
            full[s].arrive(32)
            yield
        for i in range(bl.STAGES):
            c = n_chunks + i
            if c >= bl.STAGES:
                s, par = bl.ring_slot(c, bl.STAGES)
                while not empty[s].test_wait(par ^ 1):
                    yield

    def check_stage(s, c):
        st = stage[s]
        assert st["rec"] == c and st["beta"] == c
        assert all(st["rows"].get(r) == c for r in range(n_valid(c)))

    def mma_warp(w):
        for c in range(n_chunks):
            s, par = bl.ring_slot(c, bl.STAGES)
            while not full[s].test_wait(par):
                yield
            check_stage(s, c)
            yield
            b, opar = bl.ring_slot(c, bl.OUT_BUFS)
            while not out_empty[b].test_wait(opar ^ 1):
                yield
            assert not reading[b], "staging tile overwritten while being stored"
            out_buf[b][w] = c
            out_full[b].arrive(32)
            yield
            check_stage(s, c)  # kr / gt still read by the state update
            empty[s].arrive(32)
            yield

    def store_warp():
        for c in range(n_chunks):
            b, par = bl.ring_slot(c, bl.OUT_BUFS)
            while not out_full[b].test_wait(par):
                yield
            assert out_buf[b] == {w: c for w in range(bl.NUM_MMA_WARPS)}
            reading[b] = True

            def read_done(b=b, c=c):
                assert out_buf[b] == {w: c for w in range(bl.NUM_MMA_WARPS)}
                reading[b] = False
                stored.append(c)

            events.append(read_done)
            while reading[b]:  # cp.async.bulk.wait_group.read 0
                yield
            out_empty[b].arrive(32)
            yield

    roles = [producer(), store_warp()] + [mma_warp(w) for w in range(bl.NUM_MMA_WARPS)]
    for _ in range(200000):
        if not roles and not events:
            break
        k = rnd.randrange(len(roles) + len(events))
        if k < len(roles):
            try:
                next(roles[k])
            except StopIteration:
                roles.pop(k)
        else:
            events.pop(k - len(roles))()
    else:
        raise AssertionError("deadlock (or livelock) in the mbarrier protocol")
    assert stored == list(range(n_chunks))


@pytest.mark.parametrize("n_chunks", range(10))
@pytest.mark.parametrize("n_valid_last", [1, 7, 16])
def test_mbarrier_protocol_random_interleavings(n_chunks, n_valid_last):
    for seed in range(30):
        _run_protocol(n_chunks, n_valid_last, seed * 1000 + n_chunks)


# ------------------------------------------------------------------------------------------
# Compilation (no GPU needed)
# ------------------------------------------------------------------------------------------


def test_rejects_unknown_arch():
    with pytest.raises(ValueError):
        bl.compile_kernel("sm_80")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compiles_with_mma_bulk_copies_mbarriers_and_no_spills(arch, tmp_path):
    t0 = time.time()
    compiled = bl.compile_kernel(arch, dump_dir=str(tmp_path))
    elapsed = time.time() - t0
    assert elapsed < 120, f"compile took {elapsed:.1f} s"
    ptx = compiled.__ptx__
    assert f".target {arch}" in ptx
    # per n-tile and chunk: 16 (P, Oq) + 1 (INV.u) + 1 (Mqk.U) + 8 (kr^T.U) MMAs; 4 n-tiles
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 26 * 4
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 8 * 2
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "cp.async.bulk.global.shared::cta.bulk_group" in ptx
    for op in (
        "mbarrier.init.shared::cta.b64",
        "mbarrier.expect_tx",
        "mbarrier.arrive.release.cta.shared::cta.b64",
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64",
        "fence.mbarrier_init.release.cluster",
        "fence.proxy.async.shared::cta",
    ):
        assert op in ptx, op
    assert ".local" not in ptx
    assert "fma.rn.ftz.f32" in ptx and "tanh.approx.f32" in ptx

    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not available: PTX checked, SASS not checked")
    cubin = single_cubin(str(tmp_path))
    res = subprocess.run(
        [cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True
    )
    assert "LOCAL:0" in res.stdout and "STACK:0" in res.stdout, res.stdout
    nvdisasm = cuda_tool("nvdisasm")
    env = dict(os.environ)
    if nvdisasm:
        env["PATH"] = f"{os.path.dirname(nvdisasm)}:{env.get('PATH', '')}"
    sass = subprocess.run(
        [cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True, env=env
    ).stdout
    if sass.strip():
        assert "HMMA.16816.F32.BF16" in sass
        assert "UBLKCP.S.G" in sass  # global -> shared bulk copy
        assert "UBLKCP.G.S" in sass  # shared -> global bulk copy
        assert "SYNCS.PHASECHK" in sass and "SYNCS.ARRIVE" in sass
        assert "LDSM" in sass and "STSM" in sass
        assert "LDL" not in sass and "STL" not in sass


def test_export_to_c_writes_header_and_object(tmp_path):
    """The AOT path: export_to_c on a GPU-less machine, the column-split recurrence's arguments
    in its order (one FFI handler launches both kernels)."""
    compiled = bl.compile_kernel("sm_90a")
    assert wrapper_arguments(compiled, tmp_path, "test_kda_recurrence_baseline_sm90a") == [
        "module", "mV", "mBeta", "mWorkspace", "mCuSeqlens", "mState0", "mOut", "mStateT",
        "stream"]


def test_protocol_model_detects_a_wrong_parity(monkeypatch):
    """The model is sensitive: with the wait parities flipped, a consumer passes its wait before
    the data landed (or a producer refills a stage still in use) and an assertion fires."""
    monkeypatch.setattr(bl, "ring_slot", lambda c, d: (c % d, ((c // d) & 1) ^ 1))
    with pytest.raises(AssertionError):
        for seed in range(30):
            _run_protocol(5, 16, seed)
