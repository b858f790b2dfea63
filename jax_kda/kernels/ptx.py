"""Every inline-PTX wrapper the CuTe DSL kernels use, one instruction (or a tiny predicated group)
each, so that the rounding of every step and the instruction performing it are pinned whatever
the global fast-math options and whatever the optimiser would like to fuse (build time only: this
module needs nvidia-cutlass-dsl).

The numerics contract (docs/numerics.md, section 2 "Rounding notation") maps onto the helpers as
follows:

- ``bf16 -> f32``: :func:`bf16_to_f32`, :func:`bf16x2_lo_to_f32`, :func:`bf16x2_hi_to_f32` (exact
  bit shifts; a ``cvt`` under ``-ftz`` would flush subnormal bf16 inputs).
- ``bf16(x)``: :func:`f32_to_bf16` (``cvt.rn.bf16.f32``), ``f16(x)``: :func:`f32_to_f16`.
- bf16 ``a - b``, ``a * b``, ``a + b``: :func:`sub_bf16x2`, :func:`mul_bf16x2`, :func:`add_bf16x2`
  (``.rn.bf16x2`` on two pairs at once: one rounding of each exact result, subnormals kept).
- f32 arithmetic: :func:`fadd`, :func:`fmul`, :func:`ffma` (``.rn.ftz``, never contracted or
  re-associated).
- ``ex2``/``tanh``/``rsqrt``: the ``.approx`` MUFU forms; :func:`sigmoid` is
  ``0.5 * tanh.approx(0.5 x) + 0.5`` with the final step as one FMA (what nvcc --use_fast_math
  makes of FlashKDA's source).
- f16 arithmetic: :func:`f16_mul`, :func:`f16_add` (``.rn`` without ``.ftz``: FlashKDA's half
  ops keep subnormals).

Scalar helpers take and return CuTe DSL numeric scalars (Float32, BFloat16, Float16, Uint32).
Warp-level helpers (MMA, movmatrix, ldmatrix, memory) take and return Int32 registers holding
packed bf16x2 (low half = lower index) or Float32.

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
    (C as a K x N operand, K = the 16 rows). tests/kernel_sim.py checks this index algebra with
    a numpy simulator.
ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i, register i receives the 8x8
fragment of matrix i (with .trans: the fragment of its transpose).
"""

from __future__ import annotations

from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

LOG2E = 1.4426950408889634  # rounded to f32 (0x3FB8AA3B) where used


# ----------------------------------------------------------------------------------------------
# Inline-asm building blocks (private): operand conversion, one asm op, loads and stores ordered
# against the other memory asm, predication by idx < limit
# ----------------------------------------------------------------------------------------------
def _asm(ret_type, operands, text, constraints, loc, ip, *, side_effects=False):
    """One inline-asm op; `side_effects` for memory and barrier instructions."""
    return llvm.inline_asm(
        ret_type,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _f32(x, loc, ip):
    return Float32(x).ir_value(loc=loc, ip=ip)


def _i16(x, dtype, loc, ip):
    # NVVM inline asm takes 16-bit operands only as i16
    return llvm.bitcast(T.i16(), dtype(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)


def _from_i16(v, dtype, loc, ip):
    return dtype(llvm.bitcast(dtype.mlir_type, v, loc=loc, ip=ip))


def _i32(x, loc, ip):
    return Int32(x).ir_value(loc=loc, ip=ip)


def _i64(x, loc, ip):
    return Int64(x).ir_value(loc=loc, ip=ip)


def _unpack(struct_val, elem_type, n, wrap):
    return [wrap(llvm.extractvalue(elem_type, struct_val, [i])) for i in range(n)]


def _pred_lt_block(cond_ops, body):
    """`{ .reg .pred p; setp.lt.s32 p, <cond_ops>; <body> }`: body guarded by
    (or selecting on) p."""
    return "{\n\t.reg .pred p;\n\tsetp.lt.s32 p, " + cond_ops + ";\n\t" + body + "\n\t}"


def _f32_unary(text, x, loc, ip):
    """One one-operand f32 instruction `text` ("$0, $1" operands)."""
    return Float32(_asm(T.f32(), [_f32(x, loc, ip)], text, "=f,f", loc, ip))


def _f32_binary(text, a, b, loc, ip):
    """One two-operand f32 instruction `text` ("$0, $1, $2" operands)."""
    return Float32(
        _asm(T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip)], text, "=f,f,f", loc, ip)
    )


def _f32_to_16(text, x, dtype, loc, ip):
    """One f32 -> 16-bit float (`dtype`) conversion `text` ("$0, $1" operands)."""
    return _from_i16(
        _asm(T.i16(), [_f32(x, loc, ip)], text, "=h,f", loc, ip), dtype, loc, ip
    )


def _f16_binary(text, a, b, dtype, loc, ip):
    """One two-operand instruction `text` on 16-bit floats of `dtype` (bf16 or f16)."""
    operands = [_i16(a, dtype, loc, ip), _i16(b, dtype, loc, ip)]
    return _from_i16(_asm(T.i16(), operands, text, "=h,h,h", loc, ip), dtype, loc, ip)


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


def _cp_async_if(copy, smem_addr, gmem_addr, idx, limit, loc, ip):
    """`@p <copy> [smem], [gmem], <bytes>;` with p = idx < limit."""
    _store(
        [
            _i32(smem_addr, loc, ip),
            _i64(gmem_addr, loc, ip),
            _i32(idx, loc, ip),
            _i32(limit, loc, ip),
        ],
        _pred_lt_block("$3, $4", "@p " + copy.format("[$1], [$2]")),
        "r,l,r,r",
        loc,
        ip,
    )


# ----------------------------------------------------------------------------------------------
# Bit casts and exact widenings (no rounding, no flush)
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def f32_as_u32(x, *, loc=None, ip=None) -> Uint32:
    """Reinterpret the bits of an f32 as u32."""
    return Uint32(llvm.bitcast(T.i32(), _f32(x, loc, ip), loc=loc, ip=ip))


@dsl_user_op
def u32_as_f32(x, *, loc=None, ip=None) -> Float32:
    """Reinterpret the bits of a u32 as f32."""
    return Float32(
        llvm.bitcast(T.f32(), Uint32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    )


@dsl_user_op
def bf16x2_lo_to_f32(w, *, loc=None, ip=None) -> Float32:
    """Exact f32 value of the bf16 in the low half of a packed u32."""
    return u32_as_f32(Uint32(w) << Uint32(16), loc=loc, ip=ip)


@dsl_user_op
def bf16x2_hi_to_f32(w, *, loc=None, ip=None) -> Float32:
    """Exact f32 value of the bf16 in the high half of a packed u32."""
    return u32_as_f32(Uint32(w) & Uint32(0xFFFF0000), loc=loc, ip=ip)


@dsl_user_op
def bf16_to_f32(x, *, loc=None, ip=None) -> Float32:
    """Exact bf16 -> f32 by bit shift (no cvt, so no flush under -ftz)."""
    b16 = BFloat16(x).ir_value(loc=loc, ip=ip)
    i16 = llvm.bitcast(T.i16(), b16, loc=loc, ip=ip)
    i32 = llvm.zext(T.i32(), i16, loc=loc, ip=ip)
    return u32_as_f32(Uint32(i32) << Uint32(16), loc=loc, ip=ip)


@dsl_user_op
def f16_to_f32(x, *, loc=None, ip=None) -> Float32:
    """Exact f16 -> f32 (every f16, subnormals included, is an f32 normal)."""
    return Float32(
        _asm(
            T.f32(), [_i16(x, Float16, loc, ip)], "cvt.f32.f16 $0, $1;", "=f,h", loc, ip
        )
    )


@dsl_user_op
def bf16x2_lo_bits(w, *, loc=None, ip=None):
    """Bits of the exact f32 widening of the low bf16 of a packed pair (w << 16)."""
    return Int32(Uint32(w) << Uint32(16))


@dsl_user_op
def bf16x2_hi_bits(w, *, loc=None, ip=None):
    """Bits of the exact f32 widening of the high bf16 of a packed pair (w & 0xFFFF0000)."""
    return Int32(Uint32(w) & Uint32(0xFFFF0000))


# ----------------------------------------------------------------------------------------------
# Conversions that round, and packing into bf16x2 registers
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def f32_to_bf16(x, *, loc=None, ip=None) -> BFloat16:
    """bf16(x): round to nearest even."""
    return _f32_to_16("cvt.rn.bf16.f32 $0, $1;", x, BFloat16, loc, ip)


@dsl_user_op
def f32_to_f16(x, *, loc=None, ip=None) -> Float16:
    """f16(x): round to nearest even (subnormal results kept)."""
    return _f32_to_16("cvt.rn.f16.f32 $0, $1;", x, Float16, loc, ip)


@dsl_user_op
def pack_bf16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    """Round two f32 to bf16 (RN) and pack them, ``lo`` in the low half."""
    return Uint32(
        _asm(
            T.i32(),
            [_f32(hi, loc, ip), _f32(lo, loc, ip)],
            "cvt.rn.bf16x2.f32 $0, $1, $2;",
            "=r,f,f",
            loc,
            ip,
        )
    )


@dsl_user_op
def pack_bf16x2_i32(lo, hi, *, loc=None, ip=None):
    """pack_bf16x2 as an Int32 register (the type every fragment travels in)."""
    return Int32(pack_bf16x2(lo, hi, loc=loc, ip=ip))


@dsl_user_op
def pack_f32_bits_bf16x2(lo_bits, hi_bits, *, loc=None, ip=None):
    """bf16x2 of two f32 given as their bit patterns (Int32), each rounded to nearest even
    (cvt.rn.bf16x2.f32, no flush), `lo_bits` in the low half."""
    return _b32_op(
        [_i32(lo_bits, loc, ip), _i32(hi_bits, loc, ip)],
        "{\n\t.reg .f32 a, b;\n\tmov.b32 a, $1;\n\tmov.b32 b, $2;\n\t"
        "cvt.rn.bf16x2.f32 $0, b, a;\n\t}",
        "=r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def split_hi_lo_bf16x2(x0, x1, *, loc=None, ip=None):
    """split() of two f32 as two packed bf16x2 words (x0 in the low halves): hi = bf16(x) RN,
    lo = bf16(x - f32(hi)) RN, the subtraction exact (sub.rn.ftz: a subnormal difference is 0).
    Returns (hi, lo) as Int32."""
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [_f32(x0, loc, ip), _f32(x1, loc, ip)],
        "{\n\t.reg .b32 w0, w1;\n\t.reg .f32 h0, h1, d0, d1;\n\t"
        "cvt.rn.bf16x2.f32 $0, $3, $2;\n\t"
        "shl.b32 w0, $0, 16;\n\t"
        "and.b32 w1, $0, -65536;\n\t"
        "mov.b32 h0, w0;\n\t"
        "mov.b32 h1, w1;\n\t"
        "sub.rn.ftz.f32 d0, $2, h0;\n\t"
        "sub.rn.ftz.f32 d1, $3, h1;\n\t"
        "cvt.rn.bf16x2.f32 $1, d1, d0;\n\t}",
        "=r,=r,f,f",
        loc,
        ip,
    )
    return _unpack(res, T.i32(), 2, Int32)


# ----------------------------------------------------------------------------------------------
# f32 arithmetic with pinned rounding (.rn.ftz, never contracted)
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def fadd(a, b, *, loc=None, ip=None) -> Float32:
    """a + b (add.rn.ftz.f32), never fused into an FMA."""
    return _f32_binary("add.rn.ftz.f32 $0, $1, $2;", a, b, loc, ip)


@dsl_user_op
def fsub(a, b, *, loc=None, ip=None) -> Float32:
    """a - b (sub.rn.ftz.f32): the same operation as fadd(a, fneg(b)) bit for bit (IEEE defines
    a - b as a + (-b); .ftz flushes b or -b to a zero of the same sign either way), without the
    sign-flip instruction (the SASS FADD takes the negated operand)."""
    return _f32_binary("sub.rn.ftz.f32 $0, $1, $2;", a, b, loc, ip)


@dsl_user_op
def fmul(a, b, *, loc=None, ip=None) -> Float32:
    """a * b (mul.rn.ftz.f32), never fused into an FMA."""
    return _f32_binary("mul.rn.ftz.f32 $0, $1, $2;", a, b, loc, ip)


@dsl_user_op
def ffma(a, b, c, *, loc=None, ip=None) -> Float32:
    """fmaf(a, b, c) (fma.rn.ftz.f32)."""
    return Float32(
        _asm(
            T.f32(),
            [_f32(a, loc, ip), _f32(b, loc, ip), _f32(c, loc, ip)],
            "fma.rn.ftz.f32 $0, $1, $2, $3;",
            "=f,f,f,f",
            loc,
            ip,
        )
    )


@dsl_user_op
def fneg(a, *, loc=None, ip=None) -> Float32:
    """-a (exact sign flip; no flush)."""
    return u32_as_f32(
        f32_as_u32(a, loc=loc, ip=ip) ^ Uint32(0x80000000), loc=loc, ip=ip
    )


@dsl_user_op
def gate_scale_from_lower_bound(lower_bound, *, loc=None, ip=None) -> Float32:
    """f32(f64(lower_bound) * log2(e)), the host-side rounding FlashKDA uses."""
    return Float32(
        _asm(
            T.f32(),
            [_f32(lower_bound, loc, ip)],
            "{ .reg .f64 t; cvt.f64.f32 t, $1; mul.rn.f64 t, t, 0d3FF71547652B82FE; "
            "cvt.rn.f32.f64 $0, t; }",
            "=f,f",
            loc,
            ip,
        )
    )


# ----------------------------------------------------------------------------------------------
# Approximate functions (MUFU) and the sigmoids built on them
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def ex2_approx(x, *, loc=None, ip=None) -> Float32:
    """ex2.approx.ftz.f32."""
    return _f32_unary("ex2.approx.ftz.f32 $0, $1;", x, loc, ip)


@dsl_user_op
def tanh_approx(x, *, loc=None, ip=None) -> Float32:
    """tanh.approx.f32."""
    return _f32_unary("tanh.approx.f32 $0, $1;", x, loc, ip)


@dsl_user_op
def rsqrt_approx(x, *, loc=None, ip=None) -> Float32:
    """rsqrt.approx.ftz.f32."""
    return _f32_unary("rsqrt.approx.ftz.f32 $0, $1;", x, loc, ip)


@dsl_user_op
def rcp_approx(x, *, loc=None, ip=None) -> Float32:
    """rcp.approx.ftz.f32 (within 1 ulp)."""
    return _f32_unary("rcp.approx.ftz.f32 $0, $1;", x, loc, ip)


@dsl_user_op
def sigmoid(x, *, loc=None, ip=None) -> Float32:
    """sigmoid(x) of docs/numerics.md section 2: fma(tanh.approx(0.5 * x), 0.5, 0.5)."""
    t = tanh_approx(fmul(x, Float32(0.5), loc=loc, ip=ip), loc=loc, ip=ip)
    return ffma(t, Float32(0.5), Float32(0.5), loc=loc, ip=ip)


@dsl_user_op
def sigmoid_bf16x2_from_logit(beta_bits, *, loc=None, ip=None):
    """bf16(b) duplicated in both halves, b = 0.5 * tanh.approx(0.5 * f32(beta)) + 0.5
    (docs/numerics.md section 5, step 2).

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
def sigmoid_exp2(x, *, loc=None, ip=None) -> Float32:
    """sigmoid(x) = rcp(1 + ex2(-x log2 e)): relative error a few ulp for every x (the
    tanh.approx form's absolute error, ~2^-12, is most of sigmoid(x) itself for x << 0). The fp32
    numerics mode's gates and betas (docs/fp32_mode.md)."""
    e = ex2_approx(fmul(x, Float32(-LOG2E), loc=loc, ip=ip), loc=loc, ip=ip)
    return rcp_approx(fadd(e, Float32(1.0), loc=loc, ip=ip), loc=loc, ip=ip)


# ----------------------------------------------------------------------------------------------
# 16-bit float arithmetic: f16 scalars, bf16x2 pairs (.rn, subnormals kept)
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def f16_mul(a, b, *, loc=None, ip=None) -> Float16:
    """f16(a * b) (mul.rn.f16, no flush)."""
    return _f16_binary("mul.rn.f16 $0, $1, $2;", a, b, Float16, loc, ip)


@dsl_user_op
def f16_add(a, b, *, loc=None, ip=None) -> Float16:
    """f16(a + b) (add.rn.f16, no flush)."""
    return _f16_binary("add.rn.f16 $0, $1, $2;", a, b, Float16, loc, ip)


@dsl_user_op
def f16_neg(a, *, loc=None, ip=None) -> Float16:
    """-a for f16 (exact sign flip: -(+0) = -0, as FlashKDA's half negation)."""
    return _from_i16(
        _asm(T.i16(), [_i16(a, Float16, loc, ip)], "neg.f16 $0, $1;", "=h,h", loc, ip),
        Float16,
        loc,
        ip,
    )


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


# ----------------------------------------------------------------------------------------------
# Branch-free selection
# ----------------------------------------------------------------------------------------------
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
        _pred_lt_block("$1, $2", "selp.b32 $0, $3, $4, p;"),
        "=r,r,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def select_lt_f32(idx, limit, a, b, *, loc=None, ip=None) -> Float32:
    """idx < limit ? a : b for f32 values (signed compare, no branch, the bits as they are)."""
    return Float32(
        _asm(
            T.f32(),
            [_i32(idx, loc, ip), _i32(limit, loc, ip), _f32(a, loc, ip), _f32(b, loc, ip)],
            _pred_lt_block("$1, $2", "selp.f32 $0, $3, $4, p;"),
            "=f,r,r,f,f",
            loc,
            ip,
        )
    )


# ----------------------------------------------------------------------------------------------
# Matrix operations: tensor-core MMA, fragment transposes in registers, ldmatrix / stmatrix
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


@dsl_user_op
def movmatrix_trans_volatile(x, *, loc=None, ip=None):
    """movmatrix_trans that the compiler may neither merge with an equal one nor move across other
    memory / volatile asm (keeps a rarely taken block's work inside that block)."""
    return Int32(
        _asm(
            T.i32(),
            [_i32(x, loc, ip)],
            "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
            "=r,r,~{memory}",
            loc,
            ip,
            side_effects=True,
        )
    )


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
def stmatrix_x4_trans(smem_addr, regs, *, loc=None, ip=None):
    """Store four 8x8 fragments, each transposed (inverse of ldmatrix_x4_trans, same addressing)."""
    _store(
        [_i32(smem_addr, loc, ip)] + [_i32(r, loc, ip) for r in regs],
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$1], {$2, $3, $4, $5};",
        "r,r,r,r,r",
        loc,
        ip,
    )


# ----------------------------------------------------------------------------------------------
# Shared memory loads and stores (32-bit shared addresses)
# ----------------------------------------------------------------------------------------------
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
def ld_shared_f32_volatile(smem_addr, *, loc=None, ip=None):
    """ld.volatile.shared.f32: a re-read ptxas must not merge with an earlier load of the same
    address (which would keep the first value live in a register, or spilled, in between)."""
    return _load(
        Float32,
        T.f32(),
        _i32(smem_addr, loc, ip),
        "ld.volatile.shared.f32 $0, [$1];",
        "=f,r",
        loc,
        ip,
    )


@dsl_user_op
def ld_shared_u16_volatile(smem_addr, *, loc=None, ip=None):
    """ld_shared_u16 as a volatile load (see ld_shared_f32_volatile)."""
    return _load(
        Int32,
        T.i32(),
        _i32(smem_addr, loc, ip),
        "{\n\t.reg .b16 h;\n\tld.volatile.shared.b16 h, [$1];\n\tcvt.u32.u16 $0, h;\n\t}",
        "=r,r",
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
def ld_shared_v2(smem_addr, *, loc=None, ip=None):
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [_i32(smem_addr, loc, ip)],
        "ld.shared.v2.b32 {$0, $1}, [$2];",
        "=r,=r,r,~{memory}",
        loc,
        ip,
        side_effects=True,
    )
    return _unpack(res, T.i32(), 2, Int32)


@dsl_user_op
def ld_shared_v4(smem_addr, *, loc=None, ip=None):
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_i32(smem_addr, loc, ip)],
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r,~{memory}",
        loc,
        ip,
        side_effects=True,
    )
    return _unpack(res, T.i32(), 4, Int32)


@dsl_user_op
def ld_shared_v4_f32(smem_addr, *, loc=None, ip=None):
    """Four f32 from 16 bytes of shared memory (ordered against the other memory asm)."""
    res = _asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [_i32(smem_addr, loc, ip)],
        "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
        "=f,=f,=f,=f,r,~{memory}",
        loc,
        ip,
        side_effects=True,
    )
    return _unpack(res, T.f32(), 4, Float32)


@dsl_user_op
def st_shared_b32(smem_addr, value, *, loc=None, ip=None):
    _store(
        [_i32(smem_addr, loc, ip), _i32(value, loc, ip)],
        "st.shared.b32 [$1], $2;",
        "r,r",
        loc,
        ip,
    )


@dsl_user_op
def st_shared_u16(smem_addr, value, *, loc=None, ip=None):
    """Store the low 16 bits of value."""
    _store(
        [_i32(smem_addr, loc, ip), _i32(value, loc, ip)],
        "{\n\t.reg .b16 h;\n\tcvt.u16.u32 h, $2;\n\tst.shared.b16 [$1], h;\n\t}",
        "r,r",
        loc,
        ip,
    )


@dsl_user_op
def st_shared_v2(smem_addr, regs, *, loc=None, ip=None):
    _store(
        [_i32(smem_addr, loc, ip)] + [_i32(r, loc, ip) for r in regs],
        "st.shared.v2.b32 [$1], {$2, $3};",
        "r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def st_shared_v4(smem_addr, regs, *, loc=None, ip=None):
    _store(
        [_i32(smem_addr, loc, ip)] + [_i32(r, loc, ip) for r in regs],
        "st.shared.v4.b32 [$1], {$2, $3, $4, $5};",
        "r,r,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def st_shared_v4_f32(smem_addr, values, *, loc=None, ip=None):
    """Four f32 (their bits as they are) to 16 bytes of shared memory."""
    _store(
        [_i32(smem_addr, loc, ip)] + [_f32(x, loc, ip) for x in values],
        "st.shared.v4.f32 [$1], {$2, $3, $4, $5};",
        "r,f,f,f,f",
        loc,
        ip,
    )


# ----------------------------------------------------------------------------------------------
# Global memory loads and stores (64-bit generic addresses; loads on the coherent path, since
# state buffers may alias outputs)
# ----------------------------------------------------------------------------------------------
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
def ld_global_u16_if(gmem_addr, idx, limit, *, loc=None, ip=None):
    """Zero-extended *(u16*)addr if idx < limit, else 0 (no access)."""
    return Int32(
        _asm(
            T.i32(),
            [_i64(gmem_addr, loc, ip), _i32(idx, loc, ip), _i32(limit, loc, ip)],
            _pred_lt_block(
                "$2, $3",
                ".reg .b16 h;\n\tmov.b16 h, 0;\n\t@p ld.global.b16 h, [$1];\n\t"
                "cvt.u32.u16 $0, h;",
            ),
            "=r,l,r,r,~{memory}",
            loc,
            ip,
            side_effects=True,
        )
    )


@dsl_user_op
def ld_global_b32_if(gmem_addr, idx, limit, *, loc=None, ip=None):
    """*(u32*)addr if idx < limit, else 0 (no access); coherent path."""
    return Int32(
        _asm(
            T.i32(),
            [_i64(gmem_addr, loc, ip), _i32(idx, loc, ip), _i32(limit, loc, ip)],
            _pred_lt_block("$2, $3", "mov.b32 $0, 0;\n\t@p ld.global.b32 $0, [$1];"),
            "=r,l,r,r,~{memory}",
            loc,
            ip,
            side_effects=True,
        )
    )


@dsl_user_op
def ld_global_f32(gmem_addr, *, loc=None, ip=None):
    """*(f32*)addr, coherent path (the buffer may alias an output); the bits as loaded."""
    return _load(
        Float32, T.f32(), _i64(gmem_addr, loc, ip), "ld.global.b32 $0, [$1];", "=f,l", loc, ip
    )


@dsl_user_op
def ld_global_v4(gmem_addr, *, loc=None, ip=None):
    """16 bytes from global memory (coherent path: the state buffers may alias)."""
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_i64(gmem_addr, loc, ip)],
        "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l,~{memory}",
        loc,
        ip,
        side_effects=True,
    )
    return _unpack(res, T.i32(), 4, Int32)


@dsl_user_op
def st_global_b32(gmem_addr, value, *, loc=None, ip=None):
    """*(u32*)addr = value."""
    _store(
        [_i64(gmem_addr, loc, ip), _i32(value, loc, ip)],
        "st.global.b32 [$1], $2;",
        "l,r",
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
        _pred_lt_block("$3, $4", "@p st.global.b32 [$1], $2;"),
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


@dsl_user_op
def st_global_f32(gmem_addr, value, *, loc=None, ip=None):
    """*(f32*)addr = value (the bits as they are)."""
    _store(
        [_i64(gmem_addr, loc, ip), _f32(value, loc, ip)],
        "st.global.b32 [$1], $2;",
        "l,f",
        loc,
        ip,
    )


@dsl_user_op
def st_global_v4(gmem_addr, regs, *, loc=None, ip=None):
    _store(
        [_i64(gmem_addr, loc, ip)] + [_i32(r, loc, ip) for r in regs],
        "st.global.v4.b32 [$1], {$2, $3, $4, $5};",
        "l,r,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def st_global_f32x2_of_bf16x2_if(gmem_addr, value, idx, limit, *, loc=None, ip=None):
    """If idx < limit: the two bf16 of `value` widened exactly to f32, stored as 8 bytes (low half
    first). Every instruction of the group is predicated, so nothing issues work when off."""
    _store(
        [
            _i64(gmem_addr, loc, ip),
            _i32(value, loc, ip),
            _i32(idx, loc, ip),
            _i32(limit, loc, ip),
        ],
        _pred_lt_block(
            "$3, $4",
            ".reg .b32 lo, hi;\n\t@p shl.b32 lo, $2, 16;\n\t@p and.b32 hi, $2, -65536;\n\t"
            "@p st.global.v2.b32 [$1], {lo, hi};",
        ),
        "l,r,r,r",
        loc,
        ip,
    )


# ----------------------------------------------------------------------------------------------
# Asynchronous copies global -> shared (cp.async) and their commit groups
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def cp_async_16_if(smem_addr, gmem_addr, idx, limit, *, loc=None, ip=None):
    """16-byte global -> shared copy bypassing L1 (cp.async.cg), issued only if idx < limit."""
    _cp_async_if("cp.async.cg.shared.global {}, 16;", smem_addr, gmem_addr, idx, limit, loc, ip)


@dsl_user_op
def cp_async_4_if(smem_addr, gmem_addr, idx, limit, *, loc=None, ip=None):
    """4-byte global -> shared copy (cp.async.ca), issued only if idx < limit."""
    _cp_async_if("cp.async.ca.shared.global {}, 4;", smem_addr, gmem_addr, idx, limit, loc, ip)


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
def cp_async_commit(*, loc=None, ip=None):
    _store([], "cp.async.commit_group;", "", loc, ip)


@dsl_user_op
def cp_async_wait(pending: int, *, loc=None, ip=None):
    """Wait until at most `pending` (a Python int) committed cp.async groups are in flight."""
    _store([], f"cp.async.wait_group {int(pending)};", "", loc, ip)


# ----------------------------------------------------------------------------------------------
# Bulk copies and mbarriers (sm_90+; the baseline recurrence), async-proxy fences
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def mbar_init(bar, count, *, loc=None, ip=None):
    _store(
        [_i32(bar, loc, ip), _i32(count, loc, ip)],
        "mbarrier.init.shared::cta.b64 [$1], $2;",
        "r,r",
        loc,
        ip,
    )


@dsl_user_op
def fence_mbarrier_init(*, loc=None, ip=None):
    _store([], "fence.mbarrier_init.release.cluster;", "", loc, ip)


@dsl_user_op
def mbar_expect_tx_if(bar, nbytes, idx, limit, *, loc=None, ip=None):
    """mbarrier.expect_tx (no arrival) if idx < limit."""
    _store(
        [
            _i32(bar, loc, ip),
            _i32(nbytes, loc, ip),
            _i32(idx, loc, ip),
            _i32(limit, loc, ip),
        ],
        _pred_lt_block(
            "$3, $4", "@p mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [$1], $2;"
        ),
        "r,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def mbar_arrive(bar, *, loc=None, ip=None):
    """mbarrier.arrive (release, CTA scope) of this thread."""
    _store(
        [_i32(bar, loc, ip)],
        "{\n\t.reg .b64 st;\n\tmbarrier.arrive.release.cta.shared::cta.b64 st, [$1];\n\t}",
        "r",
        loc,
        ip,
    )


@dsl_user_op
def mbar_wait(bar, parity, *, loc=None, ip=None):
    """Spin until the phase of the given parity has completed (try_wait: acquire, CTA scope)."""
    _store(
        [_i32(bar, loc, ip), _i32(parity, loc, ip)],
        "{\n\t.reg .pred p;\n\tWAIT_AGAIN:\n\t"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [$1], $2;\n\t"
        "@!p bra WAIT_AGAIN;\n\t}",
        "r,r",
        loc,
        ip,
    )


@dsl_user_op
def bulk_g2s_if(smem, gmem, nbytes, bar, idx, limit, *, loc=None, ip=None):
    """1-D bulk copy global -> shared completing `nbytes` tx on mbarrier `bar`, if idx < limit."""
    _store(
        [
            _i32(smem, loc, ip),
            _i64(gmem, loc, ip),
            _i32(nbytes, loc, ip),
            _i32(bar, loc, ip),
            _i32(idx, loc, ip),
            _i32(limit, loc, ip),
        ],
        _pred_lt_block(
            "$5, $6",
            "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
            "[$1], [$2], $3, [$4];",
        ),
        "r,l,r,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def bulk_s2g_row_if(gmem, smem, nbytes, idx, limit, *, loc=None, ip=None):
    """1-D bulk copy shared -> global (if idx < limit), then commit this thread's bulk group and
    wait until its shared-memory source has been read (every lane: an empty group is fine)."""
    _store(
        [
            _i64(gmem, loc, ip),
            _i32(smem, loc, ip),
            _i32(nbytes, loc, ip),
            _i32(idx, loc, ip),
            _i32(limit, loc, ip),
        ],
        _pred_lt_block(
            "$4, $5",
            "@p cp.async.bulk.global.shared::cta.bulk_group [$1], [$2], $3;\n\t"
            "cp.async.bulk.commit_group;\n\t"
            "cp.async.bulk.wait_group.read 0;",
        ),
        "l,r,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def bulk_wait_all(*, loc=None, ip=None):
    """All of this thread's bulk groups complete (writes done)."""
    _store([], "cp.async.bulk.wait_group 0;", "", loc, ip)


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None):
    """Order this thread's generic-proxy shared stores before later async-proxy accesses."""
    _store([], "fence.proxy.async.shared::cta;", "", loc, ip)


# ----------------------------------------------------------------------------------------------
# Barriers and warp synchronisation
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def cta_barrier(*, loc=None, ip=None):
    _store([], "bar.sync 0;", "", loc, ip)


@dsl_user_op
def named_barrier_sync(bar_id, nthreads: int, *, loc=None, ip=None):
    """bar.sync bar_id, nthreads (bar_id a register, 1..15; nthreads a multiple of 32): waits
    until nthreads threads arrived; orders the shared accesses of the participants (what they
    stored before it is visible to all of them after it)."""
    _store([_i32(bar_id, loc, ip)], f"bar.sync $1, {int(nthreads)};", "r", loc, ip)


@dsl_user_op
def warp_sync(*, loc=None, ip=None):
    """bar.warp.sync over the full warp (also orders shared memory among its lanes)."""
    _store([], "bar.warp.sync -1;", "", loc, ip)
