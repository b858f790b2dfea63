"""CPU checks of the fused decode kernel (jax_kda/kernels/decode.py).

1. The chunk step, run as the kernel's own trace-time helpers (lane_token_operands,
   _p_oq_u_out, _intermediate_state, _final_state and recurrence.copy_tile_rows_out) on
   kernel_sim.SimtValues: one Python thread per GPU thread, real warp collectives (ldmatrix,
   stmatrix, movmatrix, mma.m16n8k16 with the PTX ISA fragment layouts written out in
   kernel_sim), exact float64 arithmetic. Out, the final state (to the pool row, and to
   states[n, t-1]) and every per-token state must equal the plain matrix formulas of the module
   docstring (no rounding simulated: an index, layout or mask slip gives O(1) errors), for every
   warp, t = 1, 3, 16, bf16 and f32 destinations; nothing else in global memory is written.
2. The state copy in (bf16: cp.async into the swizzled tile; f32: two register halves rounded to
   bf16 RN) on the bit-level kernel_sim.Simt, with its barrier semantics.
3. The row masks of the per-token states keep exactly rows <= i.
4. Compilation of all sixteen specialisations for sm_90a, plain and for grouped value heads (and
   four for sm_100a): no local memory or spills, the expected PTX / SASS instructions;
   export_to_c argument order (the FFI handler codes against it).
"""

import re
import subprocess
import types

import numpy as np
import pytest
from c_export import wrapper_arguments

pytest.importorskip("cutlass")
dec = pytest.importorskip("jax_kda.kernels.decode")
from kernel_sim import (
    LANES,
    Simt,
    SimtValues,
    build_record,
    cuda_tool,
    f32_bits_to_bf16,
    single_cubin,
)

from jax_kda import contract
from jax_kda.kernels import recurrence as rec


class _FakeTensor:
    """What the helpers use of a cute.Tensor: iterator.toint() (the base address)."""

    def __init__(self, addr):
        self.iterator = types.SimpleNamespace(toint=lambda: addr)


# shared-memory layout of the emulated CTA (the kernel lets the allocator place these)
TILE, REC = 0, dec.STATE_TILE_BYTES
S_KI = REC + rec.RECORD_BYTES  # 128-byte aligned
GT_TAB = S_KI + 16 * 128 * 2
SMEM = GT_TAB + dec.GT_ROWS_BYTES


def _swizzled(tile):
    out = np.zeros(16 * 128)
    r, c = np.meshgrid(np.arange(16), np.arange(128), indexing="ij")
    out[r * 128 + ((c // 8) ^ (r % 8)) * 8 + c % 8] = tile
    return out


def _reference(S, kd, qd, ki, kr, gt, gt_rows, inv, mqk, v, b, t):
    """The module docstring's formulas, float64: out rows < t, final state, per-token states."""
    P = kd @ S.T
    u = (v - P) * b[:, None]
    u[t:] = 0.0
    U = inv @ u
    out = qd @ S.T + mqk @ U
    final = S * gt[None, :] + U.T @ kr
    states = []
    for i in range(t - 1):
        Ui = U.copy()
        Ui[i + 1 :] = 0.0
        kri = ki * gt_rows[i][None, :]
        kri[i + 1 :] = 0.0
        states.append(S * gt_rows[i][None, :] + Ui.T @ kri)
    return out[:t], final, states + [final]


SIM_CASES = [(t, dt, st) for t in (1, 3) for dt in ("bf16", "f32") for st in (False, True)] + [
    (16, "bf16", False),
    (16, "f32", False),
    (16, "bf16", True),
]


@pytest.mark.parametrize("t,state_dtype,intermediate", SIM_CASES)
def test_chunk_step_on_the_simt_emulator_is_the_matrix_math(t, state_dtype, intermediate,
                                                            monkeypatch):
    esz = rec.STATE_ELEM_BYTES[state_dtype]
    rng = np.random.default_rng(100 * t + 10 * esz + intermediate)
    _N, H, n, head, T = 3, 2, 1, 1, t
    S = rng.standard_normal((128, 128))
    kd, qd, ki = (rng.standard_normal((16, 128)) for _ in range(3))
    gt = rng.uniform(0.1, 1.0, 128)
    kr = ki * gt[None, :]
    gt_rows = rng.uniform(0.1, 1.0, (16, 128))
    inv = np.tril(rng.standard_normal((16, 16)))
    mqk = np.tril(rng.standard_normal((16, 16)))
    v = np.zeros((16, 128))
    v[:t] = rng.standard_normal((t, 128))
    logits = np.zeros(16)
    logits[:t] = rng.standard_normal(t)
    b = 1 / (1 + np.exp(-logits))

    sim = SimtValues(SMEM, dec.NUM_THREADS)
    sim.patch(monkeypatch, rec.ptx)
    v_idx, k_idx = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    sim.smem16[(TILE + rec.state_smem_offset(v_idx, k_idx)) // 2] = S
    mem, gt_mem = build_record(kd, qd, kr, gt, inv, mqk)
    sim.smem16[REC // 2 : REC // 2 + mem.size] = mem
    sim.smem32[(REC + rec.OFF_GT) // 4 : (REC + rec.OFF_GT) // 4 + 128] = gt_mem
    sim.smem16[S_KI // 2 : S_KI // 2 + 16 * 128] = _swizzled(ki)
    sim.smem32[GT_TAB // 4 : GT_TAB // 4 + 16 * 128] = gt_rows.reshape(-1)

    # global memory: [N, T, H, 128] token tensors, beta [N, T, H], pool row, states
    V_BASE, BETA_BASE, OUT_BASE = 1 << 20, 2 << 20, 3 << 20
    POOL, STATES = 4 << 20, 8 << 20
    row_bytes = H * 128 * 2
    tok_base = (n * T * H + head) * 128 * 2
    for r in range(t):
        for c in range(128):
            sim.g[V_BASE + tok_base + r * row_bytes + 2 * c] = v[r, c]
        sim.g[BETA_BASE + ((n * T + r) * H + head) * 2] = logits[r]
    states_stride = H * 128 * 128 * esz
    states_n = STATES + (n * T * H + head) * 128 * 128 * esz

    def body(tid):
        ln = dec.Lane(tid % 32, (tid // 32) * dec.WARP_COLS)
        io = dec.lane_token_operands(
            ln, _FakeTensor(V_BASE), _FakeTensor(BETA_BASE), _FakeTensor(OUT_BASE),
            tok_base, row_bytes, n, T, H, head, t,
        )
        step = dec._DecodeStep(ln, REC, TILE, io, t)
        ub = dec._p_oq_u_out(step)
        if intermediate:
            for i in range(t - 1):
                dec._intermediate_state(
                    step, ub, i, S_KI, GT_TAB, states_n + i * states_stride, esz
                )
            dec._final_state(step, ub, [POOL, states_n + (t - 1) * states_stride], esz)
        else:
            dec._final_state(step, ub, [POOL], esz)

    sim.run(body)
    want_out, want_final, want_states = _reference(
        S, kd, qd, ki, kr, gt, gt_rows, inv, mqk, v, b, t
    )
    got_out = np.array(
        [[sim.g[OUT_BASE + tok_base + r * row_bytes + 2 * c] for c in range(128)] for r in range(t)]
    )
    np.testing.assert_allclose(got_out, want_out, rtol=0, atol=1e-9)

    def read_state(base):
        return np.array(
            [[sim.g[base + (j * 128 + k) * esz] for k in range(128)] for j in range(128)]
        )

    np.testing.assert_allclose(read_state(POOL), want_final, rtol=0, atol=1e-9)
    written = {POOL + e * esz for e in range(128 * 128)}
    written |= {OUT_BASE + tok_base + r * row_bytes + 2 * c for r in range(t) for c in range(128)}
    if intermediate:
        for i in range(t):
            base = states_n + i * states_stride
            np.testing.assert_allclose(read_state(base), want_states[i], rtol=0, atol=1e-9)
            written |= {base + e * esz for e in range(128 * 128)}
    # every write lands inside an expected element, rows >= t of out untouched
    for a, nbytes in sim.global_writes:
        for off in range(0, nbytes, esz if nbytes in (8, 16) and a >= POOL else 2):
            assert a + off in written, (a, nbytes)


@pytest.mark.parametrize("state_dtype", ["bf16", "f32"])
def test_state_copy_in_fills_the_tile(state_dtype, monkeypatch):
    """_copy_state_bf16 (cp.async) / the two f32 halves (load, then round to bf16 RN and store):
    after a CTA barrier the swizzled tile holds the (rounded) state; only the pool row is read."""
    rng = np.random.default_rng(7)
    state = rng.standard_normal((128, 128)).astype(np.float32)
    state[0, :3] = [1 + 2**-8, 1 + 3 * 2**-8, -0.0]
    bits = np.array([f32_bits_to_bf16(x) for x in state.view(np.uint32).reshape(-1)]).reshape(
        128, 128
    )
    pool = bits.astype(np.uint16) if state_dtype == "bf16" else state
    sim = Simt(pool.nbytes + 1024, dec.STATE_TILE_BYTES, dec.NUM_THREADS)
    base = sim.place("pool", pool, 512)
    sim.patch(monkeypatch, rec.ptx)

    def body(tid):
        # the kernel's order, with its prepare phases A, B, C reduced to their barriers
        rec.ptx.cta_barrier()  # A
        if state_dtype == "bf16":
            dec._copy_state_bf16(tid, 0, base, range(dec.LATE_STEPS, dec.COPY_STEPS))
            early = dec._load_state_bf16_steps(tid, base, range(dec.LATE_STEPS))
            rec.ptx.cta_barrier()  # B
            dec._store_state_bf16_steps(tid, 0, early, range(dec.LATE_STEPS))
            rec.ptx.cp_async_wait(0)
        else:
            h1 = dec._load_state_f32_half(tid, base, 1)
            rec.ptx.cta_barrier()  # B
            dec._store_state_f32_half(tid, 0, h1, 1)
            h0 = dec._load_state_f32_half(tid, base, 0)
            dec._store_state_f32_half(tid, 0, h0, 0)
        rec.ptx.cta_barrier()  # C

    sim.run(body)
    v, k = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    got = sim.smem.view(np.uint16)[rec.state_smem_offset(v, k) // 2]
    np.testing.assert_array_equal(got, bits)
    units = [u for tid in range(dec.NUM_THREADS) for w in (0, 1)
             for u in dec._f32_half_units(tid, w)]
    assert sorted(units) == [(v, k) for v in range(128) for k in range(0, 128, 4)]


def test_per_token_row_masks_are_the_b_operand_rows():
    """B operand register 0 of lane (g, t) holds chunk rows 2t, 2t+1 (low, high half), register
    1 rows 2t+8, 2t+9 (ptx.py fragment layouts); the kr^T A operand pairs a[0], a[1] / a[2],
    a[3] hold the same rows; the masks of intermediate_masks keep exactly rows <= i."""
    for lane in range(32):
        t = lane % 4
        assert dec.row_masks(lane & 3) == (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)


def test_lane_terms_equal_the_reference_index_maps():
    """decode.Lane's bit-operation forms equal recurrence_common's maps for every lane, and the
    copy-in / copy-out address forms equal state_copy_unit + state_smem_offset."""
    for col_w in range(0, 128, dec.WARP_COLS):
        for lane in range(32):
            ln = dec.Lane(lane, col_w)
            assert ln.small_off == rec.ldmatrix_small_offset(lane)
            assert (ln.g, 2 * ln.t4) == (rec.acc_row(lane, 0), rec.acc_col(lane))
            for k in range(8):
                assert ln.a_off(k) == rec.ldmatrix_a_offset(lane, k)
                assert ln.krt_off(k) == rec.ldmatrix_krt_offset(lane, k)
                for pair in range(dec.N_TILES // 2):
                    q = dec.state_frag_q(k, pair)
                    want = rec.state_frag_offset(lane, q, col_w, dec.N_TILES)
                    assert ln.frag_off(k, pair) == want
    for tid in range(dec.NUM_THREADS):
        for which in (0, 1):
            units = dec._f32_half_units(tid, which)
            addrs = dec._f32_half_addresses(tid, 0, 0, which)
            for (v, k), (s_a, g_a) in zip(units, addrs):
                assert s_a == rec.state_smem_offset(v, k) and int(g_a) == (v * 128 + k) * 4
    for esz in (2, 4):
        for first in (0, 8, 32, 96):
            for lane in range(32):
                s_base, s_x, g_off = rec.copy_out_lane_terms(0, lane, first, esz)
                for i in range(8 * 128 * esz // 16 // 32):
                    v, k = rec.state_copy_unit(lane + 32 * i, esz)
                    s_a, g_a = rec.copy_out_addresses(s_base, s_x, int(g_off), i, esz)
                    assert s_a == rec.state_smem_offset(v + first, k)
                    assert g_a == ((v + first) * 128 + k) * esz


def test_state_fragment_instructions_cover_the_warp_once():
    for col_w in range(0, 128, dec.WARP_COLS):
        seen = set()
        for mt in range(8):
            for pair in range(dec.N_TILES // 2):
                q = dec.state_frag_q(mt, pair)
                regs = rec.state_frag_regs(q, dec.N_TILES)
                assert [(m[0], m[1] // 2) for m in regs] == [(mt, pair)] * 4
                seen |= set(regs)
                offs = rec.state_frag_offset(LANES, q, col_w, dec.N_TILES)
                rows = offs // 256
                assert ((rows >= col_w) & (rows < col_w + dec.WARP_COLS)).all()
        assert len(seen) == 8 * dec.N_TILES * 2


def test_shared_memory_layout():
    """The tile follows the inverse scratch of prepare's staging area and overlaps only the
    staging area's tail (normalised q, k and raw g, dead after phase B), which the register-path
    copy steps (rows 0 .. 8 LATE_STEPS - 1) and the f32 half 0 (rows 0..63), both stored after
    phase B, cover; four CTAs per SM fit (bf16 and f32 pools without per-token states)."""
    from jax_kda.kernels import prepare

    assert dec.TILE_OFFSET == prepare.RECORD_SMEM["stage"] + prepare.INVERSE_SCRATCH_BYTES
    assert dec.TILE_OFFSET % 128 == 0 and dec.SMEM_BYTES == dec.TILE_OFFSET + 32768
    overlap_rows = -(-(prepare.RECORD_SMEM_BYTES - dec.TILE_OFFSET) // 256)
    assert overlap_rows <= 8 * dec.LATE_STEPS <= 64
    for tid in range(dec.NUM_THREADS):
        assert {v for v, _ in dec._f32_half_units(tid, 0)} <= set(range(64))
    assert 4 * (dec.SMEM_BYTES + 1024) <= 228 * 1024
    # the inverse scratch of both variants fits before the tile
    assert 9 * 512 <= prepare.INVERSE_SCRATCH_BYTES and 6 * 512 <= prepare.INVERSE_SCRATCH_BYTES


def test_constructor_and_options():
    assert type(dec.KdaDecode("stable", "bf16")) is dec.KdaDecode
    k = dec.KdaDecode("neumann", "f32", intermediate=True)
    assert isinstance(k, dec.KdaDecodeStates) and k.state_elem_bytes == 4
    with pytest.raises(ValueError):
        dec.KdaDecode("exact")
    with pytest.raises(ValueError):
        dec.KdaDecode("stable", "f16")
    # with per-token states (the gt_i table): three CTAs per SM
    assert 3 * (dec.SMEM_BYTES + dec.GT_ROWS_BYTES + 1024) <= 228 * 1024


# ------------------------------------------------------------------------------------------
# Compilation (no GPU needed)
# ------------------------------------------------------------------------------------------
CASES = [
    (inv, dt, states, "sm_90a", grouped)
    for inv in ("stable", "neumann")
    for dt in ("bf16", "f32")
    for states in (False, True)
    for grouped in (False, True)
] + [("stable", "bf16", False, "sm_100a", False), ("neumann", "f32", True, "sm_100a", False),
     ("stable", "f32", True, "sm_100a", True), ("neumann", "bf16", False, "sm_100a", True)]


@pytest.mark.parametrize("inverse,state_dtype,intermediate,arch,grouped", CASES)
def test_compiles_without_spills(inverse, state_dtype, intermediate, arch, grouped, tmp_path):
    compiled = dec.compile_kernel(
        inverse, arch, state_dtype=state_dtype, intermediate=intermediate, grouped=grouped,
        dump_dir=str(tmp_path)
    )
    ptx = compiled.__ptx__
    # grouped value heads: G = H / Hk and the CTA's query/key head h / G, two integer divisions
    assert len(re.findall(r"\bdiv\.s32\b", ptx)) == (2 if grouped else 0)
    assert f".target {arch}" in ptx
    n_bf16_mma = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    # prepare: L (or KK) and Mqk 16 each (+ stable: 2 + 2 block MMAs); decode step: 64 (P, Oq)
    # + 4 (INV.u) + 4 (Mqk.U) + 32 (W); per-token states: 32 more (the loop body, once)
    want = 32 + (4 if inverse == "stable" else 0) + 104 + (32 if intermediate else 0)
    assert n_bf16_mma == want
    if inverse == "neumann":
        assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16") > 0
    # B operands of the step from the tile by ldmatrix; old state by ldmatrix.trans; new state
    # by stmatrix.trans (16 each per warp); kr^T (8) and, per token state, ki^T (8) + 16
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 16
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 24 + (
        24 if intermediate else 0
    )
    # u and U to B operands (8 + 8); per-token state stores: one per state register (64)
    assert ptx.count("movmatrix.sync.aligned.m8n8.trans.b16") == 16 + (64 if intermediate else 0)
    if state_dtype == "bf16":
        # rows 32..127 by cp.async (12 per thread), rows 0..31 through registers (4 per thread)
        assert ptx.count("cp.async.cg.shared.global") == dec.COPY_STEPS - dec.LATE_STEPS
    else:
        assert "cp.async.cg" not in ptx and "cvt.rn.bf16x2.f32" in ptx
        assert "st.global.v2.b32" in ptx or not intermediate
    assert ".local" not in ptx
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not available: PTX checked, cubin resource usage not checked")
    cubin = single_cubin(str(tmp_path))
    res = subprocess.run(
        [cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True
    )
    assert "LOCAL:0" in res.stdout and "STACK:0" in res.stdout, res.stdout
    usage = re.search(r"REG:(\d+) STACK:\d+ SHARED:\d+ LOCAL:\d+", res.stdout)
    print(f"decode {inverse} {state_dtype} states={intermediate} {arch}:", usage.group(0))
    # four CTAs of 128 threads per SM need <= 128 registers (three: <= 168)
    limit = 128 if (state_dtype == "bf16" and not intermediate) else 168
    assert int(usage.group(1)) <= limit, f"more than {limit} registers"
    sass = subprocess.run(
        [cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    if sass.strip():
        for op in ("HMMA.16816.F32.BF16", "LDSM.16.M88.4", "LDSM.16.MT88.4", "STSM.16.MT88.4",
                   "MOVM.16.MT88"):
            assert op in sass, op
        if state_dtype == "bf16":
            assert "LDGSTS.E.BYPASS" in sass  # cp.async.cg, 16 bytes
        assert "LDL" not in sass and "STL" not in sass


@pytest.mark.parametrize("intermediate", [False, True])
@pytest.mark.parametrize("grouped", [False, True])
def test_export_to_c_argument_order(intermediate, grouped, tmp_path):
    compiled = dec.compile_kernel("stable", "sm_90a", state_dtype="f32", intermediate=intermediate,
                                  grouped=grouped)
    prefix = (f"test_kda_decode_stable_f32{'_states' if intermediate else ''}"
              f"{'_grouped' if grouped else ''}_sm90a")
    names = wrapper_arguments(compiled, tmp_path, prefix)
    want = ["module", "mQ", "mK", "mV", "mG", "mBeta", "mALog", "mDtBias", "mStateIndices",
            "mPool", "mOut"] + (["mStates"] if intermediate else []) + [
        "scale", "lower_bound", "stream"]
    assert names == want


def test_specs_name_every_decode_variant():
    from jax_kda._aot import specs

    decode = [s for s in specs.all_specs(("sm_90a",)) if s.kernel == "decode"]
    assert sorted(s.prefix for s in decode) == sorted(
        f"jax_kda_decode_{inv}_{dt}{st}{gr}_sm90a"
        for inv in ("stable", "neumann") for dt in ("bf16", "f32") for st in ("", "_states")
        for gr in ("", "_grouped")
    )
    for s in decode:
        assert s.call == "decode"
        assert s.options == {"inverse": s.variant, "state_dtype": s.state_dtype,
                             "intermediate": s.intermediate, "grouped": s.grouped}
        assert s.grouped == s.prefix.endswith("_grouped_sm90a")
    assert contract.INVERSE_IDS["neumann"] == 1
