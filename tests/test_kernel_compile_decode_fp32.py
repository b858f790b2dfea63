"""CPU checks of the fp32 mode's fused decode kernel (jax_kda/kernels/decode_fp32.py).

1. The chunk step, run as the kernel's own trace-time helpers (lane_token_operands, p_oq_u,
   big_u, store_out, update_state, prefix_rows) for all eight warps on
   test_kernel_compile_recurrence_fp32's SimtF32 (real warp collectives and fragment layouts,
   every rounding of the fp32 mode emulated), from a record of reference_fp32's prepare and a
   pool row in the kernel's swizzled shared tile: out and the new pool row are bitwise that
   module's numpy model of one chunk, the model the fp32 recurrence kernel's chunk loop is
   checked against bitwise. So the step's fragment layouts, term orders and key halves are the
   prefill's. t = 1, 5, 16; f32 and bf16 pools. With intermediate states (each prefix's record
   put in place as the kernel rebuilds it), state i is bitwise the model's prefill on tokens
   0..i.
2. Address maps on Python integers: copy_units moves every 16-byte unit of the pool row once, to
   its swizzled place; StateTile's shared and pool addresses are state_tile_offset and [v, k] for
   every lane, register and tile; the fragment reads of one register index are conflict free.
3. Compilation for sm_90a and sm_100a: at most 128 registers (two CTAs per SM), no local
   memory, the MMA count, the named barriers of the prepare phases and one CTA barrier.
"""

import re
import subprocess

import numpy as np
import pytest

pytest.importorskip("cutlass")
dec32 = pytest.importorskip("jax_kda.kernels.decode_fp32")
from kernel_sim import cuda_tool, single_cubin
from test_kernel_compile_decode import _FakeTensor
from test_kernel_compile_recurrence_fp32 import (
    SimtF32,
    _bf16,
    _f64,
    _model,
    _place_stage,
    draw_tokens,
    records,
    to_bf16,
    to_f32,
)

from jax_kda.kernels import decode as dec
from jax_kda.kernels import ptx

D = 128


def _run_step(state_dtype, t, monkeypatch, seed, intermediate=False):
    """The step on the emulator for one (sequence, head), t tokens: returns (out [t, 128],
    pool row, states [t, 128, 128] or None) and the model's (out, final state, states)."""
    esz = 4 if state_dtype == "f32" else 2
    rng = np.random.default_rng(seed)
    tokens = draw_tokens(rng, 1)
    S0 = to_f32(rng.standard_normal((D, D)) * 0.3)
    if esz == 2:
        S0 = to_bf16(S0)  # a bf16 pool row, widened exactly
    v = to_bf16(rng.standard_normal((1, 16, D)))
    logits = _f64(_bf16(tokens["beta"]))

    def prefill_model(n_valid):
        """(out, final state) of the fp32 recurrence's model on tokens 0 .. n_valid - 1, with
        the record of a prefill on those tokens."""
        valid = np.arange(16)[None, :] < n_valid
        fields = records(tokens, valid)[1]
        out, state = _model(fields, logits, valid, S0, v, np.arange(D))
        return fields, out[0, :n_valid], (to_bf16(state) if esz == 2 else state)

    fields, want_out, want_state = prefill_model(t)
    want_states = [prefill_model(i + 1)[2] for i in range(t - 1)] + [want_state]
    prefix_fields = [prefill_model(i + 1)[0] for i in range(t - 1)]
    rec_off, _, smem_bytes = dec32.smem_layout(state_dtype)
    sim = SimtF32(smem_bytes, dec32.NUM_THREADS)
    sim.xchg_base = smem_bytes  # no exchange area: the step has no f32 vector stores
    sim.patch(monkeypatch, ptx)
    monkeypatch.setattr(ptx, "ld_shared_f32_volatile", sim.ld_shared_f32)
    monkeypatch.setattr(ptx, "ld_shared_u16_volatile", sim.ld_shared_u16)
    monkeypatch.setattr(ptx, "pack_bf16x2", lambda lo, hi: float(to_bf16(float(lo))))

    def st_global_u16(addr, value):
        with sim.lock:
            sim.global_writes.append((int(addr), 2))
        sim.g[int(addr)] = float(value)

    monkeypatch.setattr(ptx, "st_global_u16", st_global_u16)

    def place_record(w):  # (and, after it, a stage's v / beta slots the step never reads)
        _place_stage(sim, rec_off, w, 0, v[0], logits[0], 128, 0)

    place_record(fields)
    vv, kk = np.meshgrid(np.arange(D), np.arange(D), indexing="ij")
    offsets = dec32.state_tile_offset(vv, kk, esz)
    if esz == 4:
        sim.smem32[offsets // 4] = S0
    else:
        sim.smem16[offsets // 2] = S0
    # global memory: [N, t, H, 128] token tensors, beta [N, t, H]; the pool row; states [t]
    H, n, head = 2, 1, 1  # sequence n of three, value head `head` of H
    V_BASE, BETA_BASE, OUT_BASE, POOL, STATES = 1 << 20, 2 << 20, 3 << 20, 4 << 20, 8 << 20
    row_bytes = H * D * 2
    tok_base = (n * t * H + head) * D * 2
    for r in range(t):
        for c in range(D):
            sim.g[V_BASE + tok_base + r * row_bytes + 2 * c] = v[0, r, c]
        sim.g[BETA_BASE + ((n * t + r) * H + head) * 2] = logits[0, r]
    state_bytes = D * D * esz

    def body(tid):
        ln = dec.Lane(tid % 32, (tid // 32) * dec32.WARP_COLS)
        io = dec.lane_token_operands(
            ln, _FakeTensor(V_BASE), _FakeTensor(BETA_BASE), _FakeTensor(OUT_BASE),
            tok_base, row_bytes, n, t, H, head, t, dec32.N_TILES,
        )
        step = dec32.DecodeStepFp32(ln, rec_off, 0, io, t, esz)
        u_ops, oq = dec32.p_oq_u(step)
        ub = dec32.big_u(step, u_ops)
        dec32.store_out(step, ub, oq)
        final = [POOL] + ([STATES + (t - 1) * state_bytes] if intermediate else [])
        for mt in range(8):
            dec32.update_state(step, ub, mt, final)
        for i in range(t - 1 if intermediate else 0):  # the kernel's loop, a fake record build
            sim.cta_barrier()
            if tid == 0:
                place_record(prefix_fields[i])
            sim.cta_barrier()
            ub_i = dec32.big_u(step, dec32.prefix_rows(step, u_ops, i))
            for mt in range(8):
                dec32.update_state(step, ub_i, mt, [STATES + i * state_bytes])

    sim.run(body)
    out = np.array([[sim.g.get(OUT_BASE + tok_base + r * row_bytes + 2 * c, np.nan)
                     for c in range(D)] for r in range(t)])

    def state_at(base):
        return np.array([[sim.g.get(base + (j * D + k) * esz, np.nan) for k in range(D)]
                         for j in range(D)])

    pool = state_at(POOL)
    states = [state_at(STATES + i * state_bytes) for i in range(t)] if intermediate else None
    # nothing written twice, nothing outside out rows < t, the pool row and the states
    addrs = [a for a, _ in sim.global_writes]
    n_states = t if intermediate else 0
    assert len(addrs) == len(set(addrs)) == t * D // 2 + D * D * (1 + n_states)
    for a, nbytes in sim.global_writes:
        if a >= STATES:
            assert a < STATES + n_states * state_bytes and nbytes == esz
        elif a >= POOL:
            assert a < POOL + state_bytes and nbytes == esz
        else:
            r, c = divmod(a - OUT_BASE - tok_base, row_bytes)
            assert 0 <= r < t and c < D * 2 and nbytes == 4
    return (out, pool, states), (want_out, want_state, want_states)


@pytest.mark.parametrize("state_dtype,t", [("f32", 1), ("f32", 5), ("f32", 16), ("bf16", 5)])
def test_step_on_the_emulator_is_the_fp32_recurrence_model_bitwise(state_dtype, t, monkeypatch):
    seed = 31 * t + len(state_dtype)
    (out, pool, _), (want_out, want_state, _) = _run_step(state_dtype, t, monkeypatch, seed)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(pool, want_state)


@pytest.mark.parametrize("state_dtype,t", [("f32", 4), ("bf16", 9)])
def test_intermediate_states_are_the_prefix_prefills_model_bitwise(state_dtype, t, monkeypatch):
    """With each prefix's own record in place (the kernel rebuilds it with the prepare's
    phases), state i is bitwise the model's final state of a prefill on tokens 0..i (t = 9
    crosses the prepare's reference row 7, whose decay a shorter prefix does not share); out and
    the pool row are those of the plain step."""
    seed = 7 * t + len(state_dtype)
    got, want = _run_step(state_dtype, t, monkeypatch, seed, intermediate=True)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    for i in range(t):
        np.testing.assert_array_equal(got[2][i], want[2][i], err_msg=f"state {i}")


@pytest.mark.parametrize("state_dtype", ["f32", "bf16"])
def test_copy_units_fill_the_swizzled_tile_once(state_dtype):
    esz = 4 if state_dtype == "f32" else 2
    per = 16 // esz
    seen_smem, seen_global = set(), set()
    for tid in range(dec32.COPY_THREADS):
        for s_off, g_off in dec32.copy_units(tid, esz):
            v, k = divmod(g_off // esz, D)
            assert s_off == dec32.state_tile_offset(v, k, esz) and k % per == 0
            seen_smem.add(s_off)
            seen_global.add(g_off)
    assert seen_global == set(range(0, D * D * esz, 16))
    assert len(seen_smem) == D * D * esz // 16
    # consecutive copy threads read consecutive global units (coalesced)
    first = [dec32.copy_units(tid, esz)[0][1] for tid in range(dec32.COPY_THREADS)]
    assert first == list(range(0, 16 * dec32.COPY_THREADS, 16))


@pytest.mark.parametrize("state_dtype", ["f32", "bf16"])
def test_state_tile_addresses_are_the_layout(state_dtype):
    """StateTile (bit operations on lane terms, immediates) against state_tile_offset and a
    global state's [v, k]; a warp's reads of one register index hit 32 distinct banks or the
    same word."""
    esz = 4 if state_dtype == "f32" else 2
    for warp in range(dec32.NUM_WARPS):
        lanes = [dec.Lane(lane, warp * dec32.WARP_COLS) for lane in range(32)]
        tiles = [dec32.StateTile(ln, 0, esz) for ln in lanes]
        for mt in range(8):
            for nt in range(dec32.N_TILES):
                for i in range(4):
                    words = set()
                    for ln, st in zip(lanes, tiles):
                        v = ln.col_w + 8 * nt + 2 * ln.t4 + i % 2
                        k = 16 * mt + ln.g + 8 * (i // 2)
                        addr = st.shared_address(mt, nt, i)
                        assert addr == dec32.state_tile_offset(v, k, esz)
                        assert (int(st.lane_offset) + st.pool_offset(mt, nt, i)
                                == (v * D + k) * esz)
                        words.add(addr // 4)
                    assert len({w % 32 for w in words}) == len(words), (mt, nt, i)


@pytest.mark.parametrize("intermediate", [False, True])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("state_dtype", ["f32", "bf16"])
def test_compiles_for_two_ctas_per_sm(arch, state_dtype, intermediate, tmp_path):
    dec32.compile_kernel(arch, state_dtype=state_dtype, intermediate=intermediate,
                         dump_dir=str(tmp_path))
    cubin = single_cubin(tmp_path)
    usage = subprocess.run([cuda_tool("cuobjdump"), "-res-usage", cubin], capture_output=True,
                           text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    assert regs <= 128, usage
    sass = subprocess.run([cuda_tool("cuobjdump"), "-sass", cubin], capture_output=True,
                          text=True, check=True).stdout
    # no local memory (spills)
    assert "LOCAL:0" in usage and not re.search(r"\b(LDL|STL)\b", sass), usage
    # the step's MMAs per warp (P, Oq: 80; U, Mqk.U: 12; W: one k-tile's 6 in a loop that is not
    # unrolled) and the prepare's (L, Mqk: 96); the intermediate states' loop body: the prepare
    # again, U and one k-tile's W
    mmas = 80 + 12 + 6 + 96 + (96 + 6 + 6 if intermediate else 0)
    assert len(re.findall(r"HMMA\.16816\.F32\.BF16", sass)) == mmas
    # the prepare phases' four named barriers and the CTA barrier (and those of the loop body)
    assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x1, 0x80", sass)) == 4 * (1 + intermediate)
    assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x0 ", sass)) == 1 + 2 * intermediate
    _, _, smem = dec32.smem_layout(state_dtype)
    assert 2 * (smem + 1024) <= 228 * 1024
