"""Warp-level PTX building blocks for the register-resident recurrence, as inline asm.

Every helper emits exactly one PTX instruction (or a tiny predicated group), so the rounding and
the instruction that performs it are pinned: no compiler contraction or f32 promotion can change
a bit. Values travel as Int32 registers holding packed bf16x2 (low half = lower index) or Float32.
The scalar conversions and f32 arithmetic that prepare.py also uses (pack_bf16x2, the exact bf16
widenings, fma_ftz) come from common.py, so each instruction is written down once.

Fragment layouts of `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (PTX ISA, "Matrix
fragments for mma.m16n8k16 with floating point type"); lane = 0..31, g = lane // 4, t = lane % 4:
  A (16 x 16, row-major M x K), four .b32 registers of two bf16 each:
      a[0] = A[g    ][2t, 2t+1]      a[1] = A[g + 8][2t, 2t+1]
      a[2] = A[g    ][2t+8, 2t+9]    a[3] = A[g + 8][2t+8, 2t+9]
  B (16 x 8, K x N), two .b32 registers:
      b[0] = B[2t, 2t+1][g]          b[1] = B[2t+8, 2t+9][g]
  C/D (16 x 8, M x N), four f32:
      c[0], c[1] = C[g][2t], C[g][2t+1]      c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
An "8x8 fragment" of a matrix X (the ldmatrix/movmatrix convention) is one .b32 per lane holding
X[g][2t] (low half) and X[g][2t+1] (high half). Hence:
  * packed C rows (c0,c1) / (c2,c3) are the 8x8 fragments of the top / bottom 8 rows of C;
  * b[0] / b[1] are the 8x8 fragments of (B[0:8, :])^T / (B[8:16, :])^T;
  * so `movmatrix.trans` of the packed C halves gives exactly the B operand of the same matrix
    (C as a K x N operand, K = the 16 rows). tests/test_kernel_compile_recurrence.py checks this
    index algebra with a numpy simulator.
ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i, register i receives the 8x8
fragment of matrix i (with .trans: the fragment of its transpose).
"""

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from . import common
from .common import _asm, _f32


def _i32(x, loc, ip):
    return Int32(x).ir_value(loc=loc, ip=ip)


def _i64(x, loc, ip):
    return Int64(x).ir_value(loc=loc, ip=ip)


def _unpack(struct_val, elem_type, n, wrap):
    return [wrap(llvm.extractvalue(elem_type, struct_val, [i])) for i in range(n)]


def pred_lt_block(cond_ops, body):
    """`{ .reg .pred p; setp.lt.s32 p, <cond_ops>; <body> }`: body guarded by (or selecting on) p."""
    return "{\n\t.reg .pred p;\n\tsetp.lt.s32 p, " + cond_ops + ";\n\t" + body + "\n\t}"


def _b32_op(operands, text, constraints, loc, ip):
    """A register-only instruction (group) with one .b32 result, as an Int32."""
    return Int32(_asm(T.i32(), operands, text, constraints, loc, ip))


def _bf16x2_op(text, a, b, loc, ip):
    """A two-operand bf16x2 instruction `text` ("$0, $1, $2" operands)."""
    return _b32_op([_i32(a, loc, ip), _i32(b, loc, ip)], text, "=r,r,r", loc, ip)


def _load(wrap, ret_type, address, text, constraints, loc, ip):
    """A load (group) with one result, ordered against the other memory asm."""
    return wrap(
        _asm(
            ret_type,
            [address],
            text,
            constraints + ",~{memory}",
            loc,
            ip,
            side_effects=True,
        )
    )


def _store(operands, text, constraints, loc, ip):
    """A memory or barrier instruction group without a result. NVVM inline asm needs one, so it
    writes a dummy $0 and the operands start at $1."""
    _asm(
        T.i32(),
        operands,
        text + "\n\tmov.b32 $0, 0;",
        ",".join(c for c in ("=r", constraints, "~{memory}") if c),
        loc,
        ip,
        side_effects=True,
    )


def _ldmatrix_x4(text, smem_addr, loc, ip):
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_i32(smem_addr, loc, ip)],
        text,
        "=r,=r,=r,=r,r,~{memory}",
        loc,
        ip,
        side_effects=True,
    )
    return _unpack(res, T.i32(), 4, Int32)


# ----------------------------------------------------------------------------------------------
# Tensor core and register-only data movement
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def mma_bf16_16816(a, b, c, *, loc=None, ip=None):
    """D = A.B + C, m16n8k16, bf16 inputs, f32 accumulate. a: 4 Int32, b: 2 Int32, c: 4 Float32."""
    ops = [_i32(x, loc, ip) for x in a] + [_i32(x, loc, ip) for x in b]
    ops += [_f32(x, loc, ip) for x in c]
    res = _asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        ops,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        loc,
        ip,
    )
    return _unpack(res, T.f32(), 4, Float32)


@dsl_user_op
def movmatrix_trans(x, *, loc=None, ip=None):
    """8x8 fragment of X -> 8x8 fragment of X^T, inside registers (one warp, all lanes)."""
    return _b32_op(
        [_i32(x, loc, ip)],
        "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
        "=r,r",
        loc,
        ip,
    )


# ----------------------------------------------------------------------------------------------
# bf16 / f32 arithmetic with pinned rounding
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def pack_bf16x2(lo, hi, *, loc=None, ip=None):
    """common.pack_bf16x2 as an Int32 register (the type every fragment here travels in)."""
    return Int32(common.pack_bf16x2(lo, hi, loc=loc, ip=ip))


@dsl_user_op
def sub_bf16x2(a, b, *, loc=None, ip=None):
    """a - b per half, rounded once to bf16 (no flush)."""
    return _bf16x2_op("sub.rn.bf16x2 $0, $1, $2;", a, b, loc, ip)


@dsl_user_op
def mul_bf16x2(a, b, *, loc=None, ip=None):
    """a * b per half, rounded once to bf16 (no flush)."""
    return _bf16x2_op("mul.rn.bf16x2 $0, $1, $2;", a, b, loc, ip)


@dsl_user_op
def add_bf16x2(a, b, *, loc=None, ip=None):
    """a + b per half, rounded once to bf16 (no flush)."""
    return _bf16x2_op("add.rn.bf16x2 $0, $1, $2;", a, b, loc, ip)


# exact widening of the low / high bf16 of a packed pair (bit shift / mask, never flushes)
bf16_lo_to_f32 = common.bf16x2_lo_to_f32
bf16_hi_to_f32 = common.bf16x2_hi_to_f32

# fmaf(a, b, c) as nvcc --use_fast_math emits it (fma.rn.ftz.f32)
fma_ftz = common.ffma


@dsl_user_op
def sigmoid_bf16x2_from_logit(beta_bits, *, loc=None, ip=None):
    """bf16(b) duplicated in both halves, b = 0.5 * tanh.approx(0.5 * f32(beta)) + 0.5 (SPEC).

    beta_bits: the raw 16-bit bf16 logit in the low half of an Int32.
    """
    return _b32_op(
        [_i32(beta_bits, loc, ip)],
        "{\n\t.reg .f32 x, t, s;\n\t.reg .b32 w;\n\t"
        "shl.b32 w, $1, 16;\n\t"
        "mov.b32 x, w;\n\t"
        "mul.ftz.f32 x, x, 0f3F000000;\n\t"
        "tanh.approx.f32 t, x;\n\t"
        "fma.rn.ftz.f32 s, t, 0f3F000000, 0f3F000000;\n\t"
        "cvt.rn.bf16x2.f32 $0, s, s;\n\t}",
        "=r,r",
        loc,
        ip,
    )


@dsl_user_op
def select_lt(idx, limit, a, b, *, loc=None, ip=None):
    """idx < limit ? a : b (signed, no branch)."""
    return _b32_op(
        [
            _i32(idx, loc, ip),
            _i32(limit, loc, ip),
            _i32(a, loc, ip),
            _i32(b, loc, ip),
        ],
        pred_lt_block("$1, $2", "selp.b32 $0, $3, $4, p;"),
        "=r,r,r,r,r",
        loc,
        ip,
    )


# ----------------------------------------------------------------------------------------------
# Memory: shared (32-bit addresses) and global (64-bit generic addresses)
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def ldmatrix_x4(smem_addr, *, loc=None, ip=None):
    """Four 8x8 fragments; lane l supplies the address of row l % 8 of matrix l // 8."""
    return _ldmatrix_x4(
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];",
        smem_addr,
        loc,
        ip,
    )


@dsl_user_op
def ldmatrix_x4_trans(smem_addr, *, loc=None, ip=None):
    """Four 8x8 fragments of the transposed matrices (same addressing as ldmatrix_x4)."""
    return _ldmatrix_x4(
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
        smem_addr,
        loc,
        ip,
    )


@dsl_user_op
def ld_shared_f32(smem_addr, *, loc=None, ip=None):
    return _load(
        Float32,
        T.f32(),
        _i32(smem_addr, loc, ip),
        "ld.shared.f32 $0, [$1];",
        "=f,r",
        loc,
        ip,
    )


@dsl_user_op
def cp_async_16_if(smem_addr, gmem_addr, idx, limit, *, loc=None, ip=None):
    """16-byte global -> shared copy bypassing L1 (cp.async.cg), issued only if idx < limit."""
    _store(
        [
            _i32(smem_addr, loc, ip),
            _i64(gmem_addr, loc, ip),
            _i32(idx, loc, ip),
            _i32(limit, loc, ip),
        ],
        pred_lt_block("$3, $4", "@p cp.async.cg.shared.global [$1], [$2], 16;"),
        "r,l,r,r",
        loc,
        ip,
    )


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None):
    _store([], "cp.async.commit_group;", "", loc, ip)


@dsl_user_op
def cp_async_wait(pending: int, *, loc=None, ip=None):
    """Wait until at most `pending` (a Python int) committed cp.async groups are in flight."""
    _store([], f"cp.async.wait_group {int(pending)};", "", loc, ip)


@dsl_user_op
def beta_to_shared_if(slot_addr, elem_addr, async_ok, idx, limit, *, loc=None, ip=None):
    """Copy one bf16 (at elem_addr, 2-byte aligned) into the 4-byte shared slot, if idx < limit.

    It lands at byte (elem_addr & 2) of the slot. Normally the aligned 4-byte word holding it is
    copied asynchronously (cp.async.ca, completes with the chunk's group); where that word would
    reach past the end of the array (async_ok == 0) the element is copied synchronously instead.
    """
    _store(
        [
            _i32(slot_addr, loc, ip),
            _i64(elem_addr, loc, ip),
            _i32(async_ok, loc, ip),
            _i32(idx, loc, ip),
            _i32(limit, loc, ip),
        ],
        "{\n\t.reg .pred pv, pa, pn, p1, p2;\n\t.reg .b64 w, o;\n\t.reg .b32 o32, s2;\n\t"
        ".reg .b16 h;\n\t"
        "setp.lt.s32 pv, $4, $5;\n\t"
        "setp.ne.s32 pa, $3, 0;\n\t"
        "not.pred pn, pa;\n\t"
        "and.pred p1, pv, pa;\n\t"
        "and.pred p2, pv, pn;\n\t"
        "and.b64 w, $2, -4;\n\t"
        "@p1 cp.async.ca.shared.global [$1], [w], 4;\n\t"
        "and.b64 o, $2, 2;\n\t"
        "cvt.u32.u64 o32, o;\n\t"
        "add.u32 s2, $1, o32;\n\t"
        "@p2 ld.global.nc.b16 h, [$2];\n\t"
        "@p2 st.shared.b16 [s2], h;\n\t}",
        "r,l,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def ld_shared_b32(smem_addr, *, loc=None, ip=None):
    return _load(
        Int32,
        T.i32(),
        _i32(smem_addr, loc, ip),
        "ld.shared.b32 $0, [$1];",
        "=r,r",
        loc,
        ip,
    )


@dsl_user_op
def ld_shared_u16(smem_addr, *, loc=None, ip=None):
    """Zero-extended 16-bit shared load."""
    return _load(
        Int32,
        T.i32(),
        _i32(smem_addr, loc, ip),
        "{\n\t.reg .b16 h;\n\tld.shared.b16 h, [$1];\n\tcvt.u32.u16 $0, h;\n\t}",
        "=r,r",
        loc,
        ip,
    )


@dsl_user_op
def cta_barrier(*, loc=None, ip=None):
    _store([], "bar.sync 0;", "", loc, ip)


@dsl_user_op
def ld_global_u16(gmem_addr, *, loc=None, ip=None):
    """Zero-extended *(u16*)addr, coherent path (the buffer may alias an output)."""
    return _load(
        Int32,
        T.i32(),
        _i64(gmem_addr, loc, ip),
        "{\n\t.reg .b16 h;\n\tld.global.b16 h, [$1];\n\tcvt.u32.u16 $0, h;\n\t}",
        "=r,l",
        loc,
        ip,
    )


@dsl_user_op
def st_global_b32_if(gmem_addr, value, idx, limit, *, loc=None, ip=None):
    """*(u32*)addr = value if idx < limit."""
    _store(
        [
            _i64(gmem_addr, loc, ip),
            _i32(value, loc, ip),
            _i32(idx, loc, ip),
            _i32(limit, loc, ip),
        ],
        pred_lt_block("$3, $4", "@p st.global.b32 [$1], $2;"),
        "l,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def st_global_u16(gmem_addr, value, *, loc=None, ip=None):
    """Store the low 16 bits of value."""
    _store(
        [_i64(gmem_addr, loc, ip), _i32(value, loc, ip)],
        "{\n\t.reg .b16 h;\n\tcvt.u16.u32 h, $2;\n\tst.global.b16 [$1], h;\n\t}",
        "l,r",
        loc,
        ip,
    )
