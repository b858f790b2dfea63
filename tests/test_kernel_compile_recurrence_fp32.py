"""CPU checks of the fp32-mode column-split recurrence kernel (jax_kda/kernels/recurrence_fp32.py).

1. The chunk loop, run as the kernel's own trace-time helpers (_load_state, _prologue,
   _chunk_step, _store_state) on an f32-arithmetic variant of kernel_sim.SimtValues: one
   Python thread per GPU thread, real warp collectives (ldmatrix, movmatrix, mma.m16n8k16 with
   the PTX ISA fragment layouts of kernel_sim), bf16 roundings, the hi/lo splits and .ftz f32
   arithmetic emulated in numpy (an MMA: the exact 16-term dot plus C, rounded once to f32).
   * Against a numpy model of the same arithmetic written as matrices (split, 16-wide k-blocks
     ascending, mma_product's term order, P and Oq as two key halves of 64 summed half 0 +
     half 1): bitwise, for every warp of every block_v and warp layout (the k-split warp pairs
     of block_v 16 / 32 with their shared-memory exchange and named barriers, the in-warp key
     halves of 64 / 128 and of the k_split=1 knob), a partial last chunk (rows past the end hold
     garbage v) and more chunks than ring stages. So the fragment layouts, column and key-half
     ownership, the term sums' order and the k-block order are the model's, and every block_v
     gives the same bits. The exchange is checked for races with vector clocks over the barriers
     (CTA and named): a missing or misplaced barrier fails whatever the thread timing.
   * The model against jax_kda.reference_fp32 (the mode's definition, key halves included;
     XLA's summation order inside the dots): outputs nearly all bit-equal, final state within
     ~1e-6 relative RMSE, while dropping any one lo term moves them by ~1e-3 (the check is
     sensitive to it).
2. The stage loader copies the 23,040-byte record, v rows and beta logits (a fake memory with
   bounds checks), nothing past the sequence end.
3. Compilation of every block_v for sm_90a and sm_100a: the expected MMA / movmatrix counts in the
   PTX, no local memory (cuobjdump -res-usage, no LDL / STL in SASS), at most 255 registers.
"""

import re
import subprocess
import types

import numpy as np
import pytest
from c_export import wrapper_arguments

pytest.importorskip("cutlass")
fp32 = pytest.importorskip("jax_kda.kernels.recurrence_fp32")
from kernel_sim import Pair, SimtValues, cuda_tool, single_cubin

from jax_kda import contract
from jax_kda.kernels import recurrence as rec
from jax_kda.kernels import recurrence_common as common

F32_MIN_NORMAL = 2.0**-126


# ------------------------------------------------------------------------------------------
# f32 / bf16 arithmetic on Python floats and numpy arrays
# ------------------------------------------------------------------------------------------
def to_f32(x):
    """Round to f32 (float64 arrays or scalars in, float64 out), then flush subnormals (.ftz)."""
    y = np.asarray(x, np.float64).astype(np.float32).astype(np.float64)
    return np.where(np.abs(y) < F32_MIN_NORMAL, 0.0 * y, y)


def to_bf16(x):
    """Round an f32 value to bf16, nearest even (subnormals kept, as cvt.rn.bf16x2.f32)."""
    bits = np.asarray(x, np.float64).astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return (r.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def split(x):
    """recurrence_fp32's split: (bf16(x), bf16(x - bf16(x))), the difference exact, .ftz."""
    hi = to_bf16(x)
    return hi, to_bf16(to_f32(np.asarray(x, np.float64) - hi))


def fma(a, b, c):
    return to_f32(np.asarray(a, np.float64) * b + c)


def sigmoid(x):
    """ptx.sigmoid_exp2: rcp(1 + ex2(-x log2 e)), each step rounded to f32."""
    e = np.exp2(to_f32(np.asarray(x, np.float64) * to_f32(-np.log2(np.e))))
    return to_f32(1.0 / to_f32(to_f32(e) + 1.0))


class SimtF32(SimtValues):
    """SimtValues with the fp32 mode's arithmetic: packed registers hold bf16 values (Pair),
    f32 registers floats, every rounding of the kernel's wrappers emulated (to_f32 / to_bf16);
    an MMA is the exact dot plus C, rounded once to f32."""

    PATCHED = SimtValues.PATCHED + (
        "split_hi_lo_bf16x2",
        "fadd",
        "fsub",
        "fmul",
        "sigmoid_exp2",
        "ld_shared_u16",
        "ld_shared_b32",
        "ld_global_f32",
        "st_global_f32",
        "named_barrier_sync",
        "st_shared_v4_f32",
        "ld_shared_v4_f32",
    )

    def __init__(self, smem_bytes, nthreads):
        super().__init__(smem_bytes, nthreads)
        # The warp pairs' exchange (4-byte f32 words by byte address), checked for races with
        # vector clocks: a barrier instance joins its participants' clocks; every read must be
        # ordered after the write it reads (RAW), every write after the previous write and the
        # reads of the value it replaces (WAW, WAR), whatever the timing of the threads.
        self.xmem = {}
        self.xlast_write = {}  # address -> (tid, its clock)
        self.xreads = {}  # address -> {tid: clock} since the last write
        self.vc = [{t: 1} for t in range(nthreads)]
        self.named = {}  # bar id -> {"tids": arrived, "gen": instances completed, "count"}
        self.named_cv = self.threading.Condition()
        self.named_log = []  # (bar id, sorted warps of the completed instance)

    def _join(self, tids):
        joined = {}
        for t in tids:
            for u, c in self.vc[t].items():
                joined[u] = max(joined.get(u, 0), c)
        for t in tids:
            self.vc[t] = dict(joined)
            self.vc[t][t] += 1

    def _flush_all(self):  # the CTA barrier (all threads)
        self._join(range(self.nthreads))

    def _ordered(self, tid, other, clock):
        return other == tid or self.vc[tid].get(other, 0) >= clock

    def named_barrier_sync(self, bar_id, nthreads):
        bar_id, tid = int(bar_id), self.local.tid
        assert 1 <= bar_id < 16 and nthreads % 32 == 0
        with self.named_cv:
            st = self.named.setdefault(bar_id, {"tids": [], "gen": 0, "count": nthreads})
            assert st["count"] == nthreads, "one barrier id, two thread counts"
            st["tids"].append(tid)
            gen = st["gen"]
            if len(st["tids"]) == nthreads:
                warps = sorted({t // 32 for t in st["tids"]})
                assert len(warps) * 32 == nthreads, warps
                self.named_log.append((bar_id, tuple(warps)))
                with self.lock:
                    self._join(st["tids"])
                st["tids"], st["gen"] = [], gen + 1
                self.named_cv.notify_all()
            else:
                while st["gen"] == gen:
                    if self.cta_bar.broken:
                        raise self.threading.BrokenBarrierError
                    self.named_cv.wait(timeout=0.2)

    def st_shared_v4_f32(self, addr, values):
        a, tid = self._s(addr, 16), self.local.tid
        assert a >= self.xchg_base, "exchange stores only behind the ring"
        with self.lock:
            for i, x in enumerate(values):
                w = self.xlast_write.get(a + 4 * i)
                assert w is None or self._ordered(tid, *w), f"WAW race at {a + 4 * i}"
                for u, c in self.xreads.get(a + 4 * i, {}).items():
                    assert self._ordered(tid, u, c), f"WAR race at {a + 4 * i}"
                self.xmem[a + 4 * i] = float(x)
                self.xlast_write[a + 4 * i] = (tid, self.vc[tid][tid])
                self.xreads[a + 4 * i] = {}

    def ld_shared_v4_f32(self, addr):
        a, tid = self._s(addr, 16), self.local.tid
        out = []
        with self.lock:
            for i in range(4):
                w = self.xlast_write.get(a + 4 * i)
                assert w is not None and self._ordered(tid, *w), f"RAW race at {a + 4 * i}"
                self.xreads[a + 4 * i][tid] = self.vc[tid][tid]
                out.append(self.xmem[a + 4 * i])
        return out

    def mma_bf16_16816(self, a, b, c):
        d = super().mma_bf16_16816(a, b, c)
        return [float(to_f32(x)) for x in d]

    def pack_bf16x2_i32(self, lo, hi):
        return Pair(to_bf16(float(lo)), to_bf16(float(hi)))

    def split_hi_lo_bf16x2(self, x0, x1):
        (h0, l0), (h1, l1) = split(float(x0)), split(float(x1))
        return Pair(h0, h1), Pair(l0, l1)

    def fadd(self, a, b):
        return float(to_f32(float(a) + float(b)))

    def fsub(self, a, b):
        return float(to_f32(float(a) - float(b)))

    def fmul(self, a, b):
        return float(to_f32(float(a) * float(b)))

    def ffma(self, a, b, c):
        return float(fma(float(a), float(b), float(c)))

    def sigmoid_exp2(self, x):
        return float(sigmoid(float(x)))

    def bf16x2_lo_to_f32(self, w):
        return w.lo if isinstance(w, Pair) else float(w)

    def ld_shared_u16(self, addr):  # the beta logit, as a value
        return float(self.smem16[self._s(addr, 2) // 2])

    def ld_shared_b32(self, addr):
        a = self._s(addr, 4) // 2
        return Pair(self.smem16[a], self.smem16[a + 1])

    def ld_global_f32(self, addr):
        return self.g[int(addr)]

    def st_global_f32(self, addr, value):
        a = int(addr)
        assert a % 4 == 0
        with self.lock:
            self.global_writes.append((a, 4))
        self.g[a] = float(value)


# ------------------------------------------------------------------------------------------
# Inputs: a realistic fp32 workspace from the reference prepare, the numpy model
# ------------------------------------------------------------------------------------------
def _workspace(rng, n_chunks, n_valid_last):
    """prepare_reference_fp32 on random chunked tokens (gates of the "fla" kind); returns the
    workspace fields as float64 numpy arrays [C, ...], beta logits [C, 16] and the valid rows."""
    valid = np.ones((n_chunks, 16), bool)
    valid[-1, n_valid_last:] = False
    tokens = draw_tokens(rng, n_chunks)
    ws, fields = records(tokens, valid)
    return ws, fields, _f64(_bf16(tokens["beta"])), valid


def draw_tokens(rng, n_chunks):
    """Random inputs of n_chunks chunks: q, k, g [C, 16, 128], beta [C, 16], A_log, dt_bias."""
    q, k, g = (rng.standard_normal((n_chunks, 16, 128)).astype(np.float32) for _ in range(3))
    beta = rng.standard_normal((n_chunks, 16)).astype(np.float32)
    A_log = np.log(rng.uniform(1, 16, ())).astype(np.float32)
    dt_bias = rng.standard_normal(128).astype(np.float32)
    return {"q": q, "k": k, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias}


def _bf16(x):
    jnp = pytest.importorskip("jax.numpy")
    return jnp.asarray(x, jnp.bfloat16)


def _f64(x):
    jnp = pytest.importorskip("jax.numpy")
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def records(tokens, valid):
    """(workspace, its fields as float64 numpy arrays [C, ...]) of prepare_reference_fp32 on
    draw_tokens' inputs with the rows of `valid` [C, 16] valid."""
    jnp = pytest.importorskip("jax.numpy")
    from jax_kda import reference_fp32

    ws = reference_fp32.prepare_reference_fp32(
        _bf16(tokens["q"]), _bf16(tokens["k"]), _bf16(tokens["g"]), _bf16(tokens["beta"]),
        jnp.asarray(tokens["A_log"]), jnp.asarray(tokens["dt_bias"]),
        scale=128**-0.5, lower_bound=-5.0, valid=jnp.asarray(valid),
    )
    fields = {
        "kd_hi": _f64(ws.kd.hi), "qd_hi": _f64(ws.qd.hi), "qd_lo": _f64(ws.qd.lo),
        "kr_hi": _f64(ws.kr.hi), "kr_lo": _f64(ws.kr.lo), "gt": _f64(ws.gt),
        "inv_hi": _f64(ws.inv.hi), "inv_lo": _f64(ws.inv.lo), "mqk_hi": _f64(ws.mqk.hi),
        "mqk_lo": _f64(ws.mqk.lo),
    }
    return ws, fields


def _mma_chain(a_blocks, b_blocks):
    """One term's chain: acc = f32(exact(A_kb . B_kb) + acc) over k-blocks ascending, from 0."""
    acc = 0.0
    for a, b in zip(a_blocks, b_blocks):
        acc = to_f32(a @ b + acc)
    return acc


def _kblocks(x, axis):
    blocks = range(x.shape[axis] // 16)
    return [np.take(x, np.arange(16 * i, 16 * i + 16), axis=axis) for i in blocks]


def _product(a_hi, a_lo, b_hi, b_lo):
    """a . b (a [M, K], b [K, N]) with mma_product's terms: hh + hl (a_lo None) or
    hh + (hl + lh)."""
    def chain(a, b):
        return _mma_chain(_kblocks(a, 1), _kblocks(b, 0))

    if a_lo is None:
        return to_f32(chain(a_hi, b_hi) + chain(a_hi, b_lo))
    return to_f32(chain(a_hi, b_hi) + to_f32(chain(a_hi, b_lo) + chain(a_lo, b_hi)))


def _key_halves_product(a_hi, a_lo, b_hi, b_lo):
    """A product over the 128 keys (a [M, 128], b [128, N]) as two halves: _product over keys
    0..63 and 64..127 (k-blocks 0-3, 4-7, each term its own chain from zero), then half 0 +
    half 1."""
    def half(x, h, axis):
        return None if x is None else np.take(x, np.arange(64 * h, 64 * h + 64), axis=axis)

    p0, p1 = (_product(half(a_hi, h, 1), half(a_lo, h, 1), half(b_hi, h, 0), half(b_lo, h, 0))
              for h in range(2))
    return to_f32(p0 + p1)


def model_chunk(S, w, c, v, b, n_valid):
    """The kernel's arithmetic for one chunk as matrices. S f32 [cols (v), 128 (k)]; w the
    workspace fields; v [16, cols] (values past n_valid ignored); b [16] f32. Returns (S', out)."""
    s_hi, s_lo = split(S)
    P = _key_halves_product(w["kd_hi"][c], None, s_hi.T, s_lo.T)
    Oq = _key_halves_product(w["qd_hi"][c], w["qd_lo"][c], s_hi.T, s_lo.T)
    u = to_f32(to_f32(v - P) * b[:, None])
    u[n_valid:] = 0.0
    u_hi, u_lo = split(u)
    U = _product(w["inv_hi"][c], w["inv_lo"][c], u_hi, u_lo)
    U_hi, U_lo = split(U)
    out = to_bf16(to_f32(Oq + _product(w["mqk_hi"][c], w["mqk_lo"][c], U_hi, U_lo)))
    W = np.concatenate(  # per 16-row k-tile: W^T[k, j] = kr^T . U
        [
            _product(w["kr_hi"][c][:, 16 * mt:16 * mt + 16].T,
                     w["kr_lo"][c][:, 16 * mt:16 * mt + 16].T, U_hi, U_lo)
            for mt in range(8)
        ]
    )
    return fma(S, w["gt"][c][None, :], W.T), out


# ------------------------------------------------------------------------------------------
# One CTA on the emulator
# ------------------------------------------------------------------------------------------
T_SHIFT = 37  # bos: the sequence starts inside the token arrays
HEADS, HEAD = 2, 1
S0_BASE, ST_BASE, OUT_BASE = 1 << 20, 2 << 20, 4 << 20


def _place_stage(sim, stage, fields, c, v_tile, logits, block_v, row_tok0):
    """Chunk c's record, v tile and beta logits in the value arrays of the emulated ring stage."""
    v_off, beta_off, _ = fp32.stage_layout(block_v)
    r, col = np.meshgrid(np.arange(16), np.arange(128), indexing="ij")
    swz = r * 128 + ((col // 8) ^ (r % 8)) * 8 + col % 8
    for name in ("kd_hi", "qd_hi", "kr_hi", "qd_lo", "kr_lo"):
        sim.smem16[(stage + contract.FP32_RECORD[name]) // 2 + swz] = fields[name][c]
    for name in ("inv_hi", "inv_lo", "mqk_hi", "mqk_lo"):
        at = (stage + contract.FP32_RECORD[name]) // 2
        sim.smem16[at : at + 256] = fields[name][c].reshape(-1)
    at = (stage + contract.FP32_RECORD["gt"]) // 4
    sim.smem32[at : at + 128] = fields["gt"][c]
    sim.smem16[(stage + v_off) // 2 : (stage + v_off) // 2 + 16 * block_v] = v_tile.reshape(-1)
    for row in range(16):
        elem = (row_tok0 + row) * HEADS + HEAD
        sim.smem16[(stage + beta_off + 4 * row + ((2 * elem) & 2)) // 2] = logits[row]


def _cta(block_v, n_tiles, k_split, tid, n_chunks, eos):
    n_warps, n_tiles, k_split = fp32.warp_layout(block_v, n_tiles, k_split)
    lane = tid % 32
    col_cta = 128 - block_v  # the last slice
    _, _, stage_bytes = fp32.stage_layout(block_v)
    row_bytes = HEADS * 128 * 2
    cta = common.Cta(
        n_tiles=n_tiles, block_v=block_v, stage_bytes=stage_bytes, nthreads=32 * n_warps,
        tid=tid, lane=lane, t2=rec.acc_col(lane), head=HEAD, seq=0, num_heads=HEADS,
        bos=T_SHIFT, eos=eos, num_chunks=n_chunks, last_chunk=n_chunks - 1, col_cta=col_cta,
        col_w=None, src=types.SimpleNamespace(
            v_off=fp32.stage_layout(block_v)[0], beta_off=fp32.stage_layout(block_v)[1],
            block_v=block_v, eos=eos, beta_base=0, num_heads=HEADS, head=HEAD),
        out_row_bytes=row_bytes, out_lane=None,
    )
    return fp32.warp_role(cta, n_warps, k_split, tid // 32, OUT_BASE + HEAD * 128 * 2,
                          fp32.STAGES * stage_bytes)


def run_cta(block_v, n_tiles, k_split, S0, fields, v_rows, logits, n_chunks, n_valid_last,
            monkeypatch, drop_named_barriers=False):
    """The kernel's chunk loop for the last column slice on SimtF32. S0 [128, 128] (v, k);
    v_rows [C, 16, 128] (garbage past the end: the kernel must mask it). Returns (out [C, 16,
    block_v], NaN where nothing was written; final state slice [block_v, 128]; the emulator)."""
    n_warps, n_tiles, k_split = fp32.warp_layout(block_v, n_tiles, k_split)
    _, _, stage_bytes = fp32.stage_layout(block_v)
    col_cta = 128 - block_v
    eos = T_SHIFT + 16 * (n_chunks - 1) + n_valid_last
    sim = SimtF32(fp32.smem_bytes(block_v, n_tiles, k_split), 32 * n_warps)
    sim.xchg_base = fp32.STAGES * stage_bytes
    sim.patch(monkeypatch, fp32.ptx)
    if drop_named_barriers:  # the race check's own test
        monkeypatch.setattr(fp32.ptx, "named_barrier_sync", lambda bar_id, nthreads: None)
    for j in range(128):
        for k in range(128):
            sim.g[S0_BASE + (j * 128 + k) * 4] = float(S0[j, k])

    def place(chunk, stage):
        chunk = int(chunk)
        _place_stage(sim, stage, fields, chunk, v_rows[chunk][:, col_cta:], logits[chunk],
                     block_v, T_SHIFT + 16 * chunk)

    # the stage loader (checked on its own below) becomes a direct write by thread 0: a refill
    # happens after the barrier that frees its stage, so no thread still reads it
    def fake_load_stage(src, chunk, stage):
        if src.tid == 0:
            place(chunk, stage)

    monkeypatch.setattr(fp32, "_load_stage", fake_load_stage)

    def body(tid):
        cta = _cta(block_v, n_tiles, k_split, tid, n_chunks, eos)
        cta.src.tid = tid
        state = [None] * (4 * cta.k_tiles * n_tiles)
        regs = fp32._LoopRegs(
            acc=[None] * (4 * fp32.CHAINS * n_tiles),
            part=[None] * (8 * n_tiles) if k_split == 1 else None,
            ints=[None] * fp32._chain_int_count(n_tiles),
            floats=[None] * fp32.CHAIN_FLOATS,
            n_ints=fp32._chain_int_count(n_tiles),
            zero_f=0.0,
        )
        fp32._load_state(cta, state, S0_BASE)
        fp32._prologue_loads(cta, 0)
        fp32._prologue(cta, 0, state, regs)
        for c in range(n_chunks):
            fp32._chunk_step(cta, 0, state, regs, c)
        fp32._store_state(cta, state, ST_BASE)

    sim.run(body)
    out = np.full((n_chunks, 16, block_v), np.nan)
    for c in range(n_chunks):
        for r in range(16):
            for col in range(block_v):
                tok = T_SHIFT + 16 * c + r
                a = OUT_BASE + (tok * HEADS * 128 + HEAD * 128 + col_cta + col) * 2
                out[c, r, col] = sim.g.get(a, np.nan)
    final = np.array([[sim.g[ST_BASE + (j * 128 + k) * 4] for k in range(128)]
                      for j in range(col_cta, 128)])
    # nothing but this slice's state rows and out elements of valid rows was written
    for a, nbytes in sim.global_writes:
        if a >= OUT_BASE:
            tok, rest = divmod((a - OUT_BASE) // 2, HEADS * 128)
            assert T_SHIFT <= tok < eos and rest // 128 == HEAD and rest % 128 >= col_cta
        else:
            assert ST_BASE + col_cta * 512 <= a < ST_BASE + 128 * 512 and nbytes == 4
    # every out element and state element written exactly once
    outs = [a for a, _ in sim.global_writes if a >= OUT_BASE]
    states = [a for a, _ in sim.global_writes if a < OUT_BASE]
    assert len(outs) == len(set(outs)) and len(states) == len(set(states)) == block_v * 128
    return out, final, sim


def _inputs(rng, n_chunks, n_valid_last):
    ws, fields, logits, valid = _workspace(rng, n_chunks, n_valid_last)
    S0 = to_f32(rng.standard_normal((128, 128)) * 0.3)
    v = to_bf16(rng.standard_normal((n_chunks, 16, 128)))
    # rows past the end: stale ring data, which may even be NaN (never-written shared memory)
    stale = to_bf16(rng.standard_normal(((~valid).sum(), 128)) * 100)
    stale[::2] = np.nan
    v[~valid] = stale
    return ws, fields, logits, valid, S0, v


def _model(fields, logits, valid, S0, v, cols):
    S = S0[cols]
    outs = []
    for c in range(v.shape[0]):
        S, out = model_chunk(S, fields, c, v[c][:, cols], sigmoid(logits[c]), int(valid[c].sum()))
        outs.append(out)
    return np.stack(outs), S


# (block_v, n-tiles per warp, k-split (None, None: the default layout), chunks, valid rows of
# the last chunk)
CASES = [(16, None, None, 1, 16), (16, None, None, 6, 5), (32, None, None, 2, 1),
         (64, None, None, 1, 9), (128, None, None, 2, 16), (32, 2, None, 2, 7),
         (16, 1, 1, 5, 3)]


@pytest.mark.parametrize("block_v,n_tiles,k_split,n_chunks,n_valid_last", CASES)
def test_chunk_loop_on_the_emulator_is_the_model_bitwise(block_v, n_tiles, k_split, n_chunks,
                                                         n_valid_last, monkeypatch):
    rng = np.random.default_rng(1000 * block_v + 10 * n_chunks + n_valid_last)
    _, fields, logits, valid, S0, v = _inputs(rng, n_chunks, n_valid_last)
    out, final, sim = run_cta(block_v, n_tiles, k_split, S0, fields, v, logits, n_chunks,
                              n_valid_last, monkeypatch)
    n_warps, _, ks = fp32.warp_layout(block_v, n_tiles, k_split)
    if ks == 2:  # two named-barrier instances (P, Oq) per chunk and pair, each of that pair only
        n_pairs = n_warps // 2
        want = {(1 + p, (2 * p, 2 * p + 1)) for p in range(n_pairs)}
        want |= {(1 + n_pairs + p, (2 * p, 2 * p + 1)) for p in range(n_pairs)}
        assert set(sim.named_log) == want
        assert len(sim.named_log) == 2 * n_pairs * n_chunks
    else:
        assert not sim.named_log
    cols = np.arange(128 - block_v, 128)
    want_out, want_final = _model(fields, logits, valid, S0, v, cols)
    want_out[~valid] = np.nan  # rows past the end are not written
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(final, want_final)


def test_emulator_catches_a_missing_pair_barrier(monkeypatch):
    """Without the named barriers, the partner's P half is read unordered with its write."""
    rng = np.random.default_rng(7)
    _, fields, logits, _valid, S0, v = _inputs(rng, 1, 16)
    with pytest.raises(AssertionError, match="RAW race"):
        run_cta(16, None, None, S0, fields, v, logits, 1, 16, monkeypatch,
                drop_named_barriers=True)


def _rel_rmse(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref**2))


def test_model_is_the_reference_up_to_summation_order(monkeypatch):
    """The numpy model (= the kernel's arithmetic, bitwise, above) against
    recurrence_reference_fp32:
    nearly every output bit-equal, the final state at the f32 level; the same check fails when
    any one lo term is dropped from the model (so it would catch a missing or swapped term)."""
    jnp = pytest.importorskip("jax.numpy")
    from jax_kda import reference_fp32

    rng = np.random.default_rng(5)
    n_chunks = 24
    ws, fields, logits, valid, S0, v = _inputs(rng, n_chunks, 16)
    v_ref = jnp.asarray(np.where(valid[..., None], v, 0.0), jnp.bfloat16)
    ref_out, ref_state = reference_fp32.recurrence_reference_fp32(
        ws, v_ref, jnp.asarray(logits, jnp.bfloat16), jnp.asarray(S0, jnp.float32))
    ref_out = np.asarray(jnp.asarray(ref_out, jnp.float32), np.float64)
    ref_state = np.asarray(ref_state, np.float64)
    cols = np.arange(128)
    out, state = _model(fields, logits, valid, S0, v, cols)
    assert np.mean(out == ref_out) > 0.97
    assert _rel_rmse(state, ref_state) < 2e-6
    assert _rel_rmse(out, ref_out) < 2e-4
    for lo in ("qd_lo", "kr_lo", "inv_lo", "mqk_lo"):
        reduced = dict(fields, **{lo: np.zeros_like(fields[lo])})
        out_r, state_r = _model(reduced, logits, valid, S0, v, cols)
        assert _rel_rmse(state_r, ref_state) > 2e-5 or _rel_rmse(out_r, ref_out) > 5e-4, lo


# ------------------------------------------------------------------------------------------
# The stage loader's address arithmetic on Python integers against a fake memory
# ------------------------------------------------------------------------------------------
class _FakeMemory:
    """Global memory as one bytearray (addresses = offsets), shared memory as another; the
    loader's memory wrappers act on them and check bounds."""

    def __init__(self, gmem, arrays, smem_bytes):
        self.gmem, self.arrays, self.smem = gmem, arrays, bytearray(smem_bytes)

    def _check(self, addr, size):
        assert any(s <= addr and addr + size <= e for s, e in self.arrays.values()), addr

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
                self._check(elem_addr, 2)
                off = slot + (elem_addr & 2)
                self.smem[off : off + 2] = self.gmem[elem_addr : elem_addr + 2]

    def select_lt(self, idx, limit, a, b):
        return a if int(idx) < int(limit) else b

    def ld_shared_u16(self, addr):
        return int.from_bytes(self.smem[int(addr) : int(addr) + 2], "little")


@pytest.mark.parametrize("block_v", contract.COLUMN_SPLITS)
@pytest.mark.parametrize("eos", [37, 30])
def test_stage_loader_copies_the_record_v_and_beta(block_v, eos, monkeypatch):
    from cutlass import Int32

    rng = np.random.default_rng(block_v + eos)
    t_total, heads, head = 37, 3, 2
    bos, slot0, n_slots = 5, 1, 4
    n_warps, _, _ = fp32.warp_layout(block_v)
    v_off, beta_off, stage_bytes = fp32.stage_layout(block_v)
    col_cta = 128 - block_v
    v = rng.integers(0, 2**16, (t_total, heads, 128), dtype=np.uint16)
    beta = rng.integers(0, 2**16, (t_total, heads), dtype=np.uint16)
    ws = rng.integers(0, 256, (heads, n_slots, contract.FP32_RECORD_BYTES), dtype=np.uint8)
    v_base, ws_base = 64, 64 + v.nbytes + 64
    beta_base = ws_base + ws.nbytes + 64 + 2
    gmem = bytearray(beta_base + beta.nbytes + 64)
    gmem[v_base : v_base + v.nbytes] = v.tobytes()
    gmem[ws_base : ws_base + ws.nbytes] = ws.tobytes()
    gmem[beta_base : beta_base + beta.nbytes] = beta.tobytes()
    arrays = {"v": (v_base, v_base + v.nbytes), "ws": (ws_base, ws_base + ws.nbytes),
              "beta": (beta_base, beta_base + beta.nbytes)}
    fake = _FakeMemory(gmem, arrays, 2 * stage_bytes)
    for name in ("cp_async_16_if", "beta_to_shared_if", "select_lt", "ld_shared_u16"):
        monkeypatch.setattr(fp32.ptx, name, getattr(fake, name))
    for chunk in range(2):
        stage = chunk * stage_bytes
        for tid in range(32 * n_warps):
            src = common.StageSources(
                ws_head=ws_base + head * n_slots * contract.FP32_RECORD_BYTES, slot0=slot0,
                v_col0=v_base + col_cta * 2, beta_base=beta_base, num_heads=heads, head=head,
                bos=bos, eos=eos, beta_elems=t_total * heads, tid=tid, nthreads=32 * n_warps,
                block_v=block_v, v_off=v_off, beta_off=beta_off,
            )
            fp32._load_stage(src, Int32(chunk), stage)
        got = fake.smem[stage : stage + stage_bytes]
        assert bytes(got[: contract.FP32_RECORD_BYTES]) == ws[head, slot0 + chunk].tobytes()
        rows = np.arange(16) + bos + 16 * chunk
        n_valid = int((rows < eos).sum())
        v_tile = np.frombuffer(bytes(got[v_off:beta_off]), np.uint16).reshape(16, block_v)
        np.testing.assert_array_equal(v_tile[:n_valid], v[rows[:n_valid], head, col_cta:])
        assert not v_tile[n_valid:].any(), "rows past the sequence end must not be read"
        for r in range(n_valid):
            bits = common.beta_bits(src, stage, Int32(bos + 16 * chunk), r)
            assert int(bits) == beta[rows[r], head], (chunk, r)


# ------------------------------------------------------------------------------------------
# Layout facts and compilation (no GPU needed)
# ------------------------------------------------------------------------------------------
def test_record_offsets_and_stage_layout():
    assert common.FP32_RECORD_BYTES == 23040
    assert fp32.GRANULES * 16 == 23040
    for name, off in contract.FP32_RECORD.items():
        assert getattr(common, "OFF32_" + name.upper()) == off and off % 512 == 0
    for bv in contract.COLUMN_SPLITS:
        v_off, beta_off, stage = fp32.stage_layout(bv)
        assert v_off == 23040 and beta_off == v_off + 32 * bv and stage % 128 == 0
        assert stage >= beta_off + 64 and fp32.smem_bytes(bv) <= 227 * 1024
    assert fp32.stage_layout(16)[2] == 23680


LAYOUTS = [(bv, None, None) for bv in contract.COLUMN_SPLITS]
LAYOUTS += [(16, 2, None), (32, 2, None), (64, 2, None), (16, 1, 1), (32, 1, 1)]


@pytest.mark.parametrize("block_v,n_tiles,k_split", LAYOUTS)
def test_state_registers_cover_the_slice_once(block_v, n_tiles, k_split):
    """Every (value column, key) of the CTA's slice is held by exactly one register of one lane
    of one warp (warp_role: columns by pair, keys by half)."""
    n_warps, nt_count, ks = fp32.warp_layout(block_v, n_tiles, k_split)
    seen = []
    for warp in range(n_warps):
        for lane in range(32):
            cta = common.Cta(n_tiles=nt_count, col_cta=0, t2=rec.acc_col(lane), lane=lane, eos=99)
            fp32.warp_role(cta, n_warps, ks, warp, 0, 1 << 20)
            regs = set()
            for mt in range(8 // ks):
                for nt in range(nt_count):
                    for i in range(4):
                        k = 16 * (cta.kbase + mt) + rec.acc_row(lane, i // 2)
                        j = cta.col_w + 8 * nt + rec.acc_col(lane) + i % 2
                        seen.append((j, k))
                        regs.add(fp32.state_index(mt, nt, i, nt_count))
            assert regs == set(range(4 * (8 // ks) * nt_count))
    assert sorted(seen) == [(j, k) for j in range(block_v) for k in range(128)]


def test_key_half_address_shifts():
    """A warp of key half 1 reads k-block / k-tile 4 + j of the swizzled tiles and gt at the
    stage address + kshift / + gshift with the offsets of j (warp_role)."""
    cta = common.Cta(n_tiles=1, col_cta=0, t2=0, lane=0, eos=1)
    fp32.warp_role(cta, 4, 2, 3, 0, 0)
    assert (cta.kbase, cta.kshift, cta.gshift) == (4, 128, 256)
    for lane in range(32):
        for j in range(4):
            assert common.ldmatrix_a_offset(lane, 4 + j) == 128 + common.ldmatrix_a_offset(lane, j)
            assert common.ldmatrix_krt_offset(lane, 4 + j) == 128 + common.ldmatrix_krt_offset(
                lane, j)
            for half in range(2):
                r = rec.acc_row(lane, half)
                assert ((4 + j) * 16 + r) * 4 == 256 + (j * 16 + r) * 4


def test_warp_layout():
    assert [fp32.warp_layout(bv) for bv in contract.COLUMN_SPLITS] == [
        (4, 1, 2), (8, 1, 2), (8, 1, 1), (8, 2, 1)]
    assert [fp32.warp_split(bv) for bv in contract.COLUMN_SPLITS] == [(4, 1), (8, 1), (8, 1),
                                                                       (8, 2)]
    assert fp32.warp_layout(64, 2) == (4, 2, 1) and fp32.warp_layout(16, 2) == (1, 2, 1)
    assert fp32.warp_layout(16, 1, 1) == (2, 1, 1) and fp32.warp_layout(32, 1) == (8, 1, 2)
    assert fp32.warp_layout(16, k_split=2) == (4, 1, 2)
    for bad in ((8, None, None), (128, 1, None), (64, 4, None), (16, 3, None), (64, 1, 2),
                (128, None, 2), (16, 2, 2), (32, 1, 3)):
        with pytest.raises(ValueError):
            fp32.warp_layout(*bad)
    assert fp32.xchg_bytes(16) == 2 * 2048 and fp32.xchg_bytes(32) == 4 * 2048
    assert fp32.xchg_bytes(64) == fp32.xchg_bytes(128) == fp32.xchg_bytes(16, 1, 1) == 0


# every default split on both targets, and the other two-n-tile splits (the benchmark knob)
COMPILE_CASES = [
    (bv, None, None, arch) for arch in ("sm_90a", "sm_100a") for bv in contract.COLUMN_SPLITS
]
COMPILE_CASES += [(bv, 2, None, "sm_90a") for bv in (16, 32, 64)]
COMPILE_CASES += [(bv, 1, 1, "sm_90a") for bv in (16, 32)]


@pytest.mark.parametrize("block_v,n_tiles,k_split,arch", COMPILE_CASES)
def test_compiles_without_local_memory(block_v, n_tiles, k_split, arch, tmp_path):
    compiled = fp32.compile_kernel(block_v, arch, n_tiles=n_tiles, k_split=k_split,
                                   dump_dir=str(tmp_path))
    ptx = compiled.__ptx__
    _, n_tiles, k_split = fp32.warp_layout(block_v, n_tiles, k_split)
    kt = 8 // k_split  # k-tiles per warp
    assert f".target {arch}" in ptx
    # per n-tile: prologue P(0) / Oq(0), 5 chains x kt k-blocks (2 kt movmatrix of S hi/lo);
    # loop body (emitted once): U 3 + Mqk.U 3 + W kt x 3 + P / Oq 5 kt MMAs; movmatrix: u 4,
    # U 4, state 4 kt. kt = 8: 110 MMAs, 72 movmatrix; kt = 4 (k-split): 58, 40.
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == (
        (13 * kt + 6) * n_tiles)
    assert ptx.count("movmatrix.sync.aligned.m8n8.trans.b16") == (8 * kt + 8) * n_tiles
    # k-split: the pair's two named barriers per chunk (P and Oq exchange); the P and Oq partials
    # stored and read once each per chunk
    assert len(re.findall(r"bar\.sync\s+%r\d+,\s*64;", ptx)) == (2 if k_split == 2 else 0)
    assert ptx.count("st.shared.v4.f32") == ptx.count("ld.shared.v4.f32") == (
        2 if k_split == 2 else 0)
    assert ".local" not in ptx
    assert "sub.rn.ftz.f32" in ptx and "fma.rn.ftz.f32" in ptx and "rcp.approx.ftz.f32" in ptx
    assert "tanh.approx.f32" not in ptx  # the fp32 mode's sigmoid is ptx.sigmoid_exp2
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not available: PTX checked, cubin resource usage not checked")
    cubin = single_cubin(str(tmp_path))
    res = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True,
                         check=True).stdout
    assert "LOCAL:0" in res and "STACK:0" in res, res
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    assert regs <= 255
    print(f"fp32 recurrence bv{block_v} x{n_tiles} k{k_split} {arch}: REG {regs}")
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                          check=True).stdout
    if sass.strip():
        for op in ("HMMA.16816.F32.BF16", "MOVM.16.MT88", "LDSM.16.MT88.4"):
            assert op in sass, op
        assert "LDL" not in sass and "STL" not in sass


def test_export_to_c_argument_order(tmp_path):
    """The exported wrapper's arguments: the FFI handler codes against this order."""
    compiled = fp32.compile_kernel(32, "sm_90a")
    assert wrapper_arguments(compiled, tmp_path, "test_kda_recurrence_fp32_bv32_sm90a") == [
        "module", "mV", "mBeta", "mWorkspace", "mCuSeqlens", "mState0", "mOut", "mStateT",
        "stream"]


POOL_CASES = [(bv, dt, "sm_90a") for bv in contract.COLUMN_SPLITS for dt in ("bf16", "f32")]
POOL_CASES += [(bv, "f32", "sm_100a") for bv in (16, 128)]


@pytest.mark.parametrize("block_v,state_dtype,arch", POOL_CASES)
def test_pool_variant_compiles_with_the_prefill_chunk_loop(block_v, state_dtype, arch, tmp_path):
    """KdaRecurrenceFp32Pool: the prefill kernel's MMAs and movmatrix once each in its chunk
    loop (the loop is emitted once; the checkpoint and pool stores add none), the pool row read
    and written with the pool's element size, no local memory."""
    compiled = fp32.compile_kernel(block_v, arch, state_dtype=state_dtype, serving=True,
                                   dump_dir=str(tmp_path))
    ptx = compiled.__ptx__
    _, n_tiles, k_split = fp32.warp_layout(block_v)
    kt = 8 // k_split
    assert f".target {arch}" in ptx
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == (
        (13 * kt + 6) * n_tiles)
    assert ptx.count("movmatrix.sync.aligned.m8n8.trans.b16") == (8 * kt + 8) * n_tiles
    # state elements (4 per k-tile and n-tile): loaded once (pool), stored twice (checkpoint,
    # pool), 4 / 2 bytes each; besides them the 4-byte stores are the out pairs (2 per n-tile)
    elems = 4 * kt * n_tiles
    if state_dtype == "f32":
        assert ptx.count("st.global.b32") == 2 * elems + 2 * n_tiles
        assert ptx.count("ld.global.b16") == ptx.count("st.global.b16") == 0
    else:
        assert ptx.count("ld.global.b16") == elems and ptx.count("st.global.b16") == 2 * elems
        assert ptx.count("st.global.b32") == 2 * n_tiles
    assert ".local" not in ptx
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not available: PTX checked, cubin resource usage not checked")
    res = subprocess.run([cuobjdump, "-res-usage", single_cubin(str(tmp_path))],
                         capture_output=True, text=True, check=True).stdout
    assert "LOCAL:0" in res and "STACK:0" in res, res
    print(f"fp32 pool recurrence bv{block_v} {state_dtype} {arch}: "
          f"REG {re.search(r'REG:(\d+)', res).group(1)}")


def test_pool_variant_export_to_c_argument_order(tmp_path):
    """The operands of the bf16 mode's pool recurrence (the handler shares their checks)."""
    compiled = fp32.compile_kernel(16, "sm_90a", state_dtype="f32", serving=True)
    assert wrapper_arguments(compiled, tmp_path, "test_kda_recurrence_fp32_pool_sm90a") == [
        "module", "mV", "mBeta", "mWorkspace", "mCuSeqlens", "mStateIndices",
        "mCheckpointOffsets", "mPool", "mOut", "mCheckpoints", "checkpoint_chunks", "stream"]
