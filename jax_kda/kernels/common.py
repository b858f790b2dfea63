"""Device math helpers shared by the CuTe DSL kernels (build time only).

Every helper emits one fixed PTX instruction (inline asm or an exact bit
operation), so the rounding of each step is pinned regardless of the global
fast-math options and of what the optimiser would like to fuse. SPEC.md's
rounding notation maps onto them as follows:

- ``bf16 -> f32``: :func:`bf16_to_f32`, :func:`bf16x2_lo_to_f32`,
  :func:`bf16x2_hi_to_f32` (exact bit shifts; a ``cvt`` under ``-ftz`` would
  flush subnormal bf16 inputs).
- ``bf16(x)``: :func:`f32_to_bf16` (``cvt.rn.bf16.f32``), ``f16(x)``:
  :func:`f32_to_f16` (``cvt.rn.f16.f32``).
- "product of two bf16 values in bf16": :func:`bf16_mul` (``mul.rn.bf16``,
  one rounding of the exact product, subnormals kept).
- f32 arithmetic: :func:`fadd`, :func:`fmul`, :func:`ffma` (``.rn.ftz``, never
  contracted or re-associated).
- ``ex2``/``tanh``/``rsqrt``: the ``.approx`` MUFU forms; :func:`sigmoid` is
  ``0.5 * tanh.approx(0.5 x) + 0.5`` with the final step as one FMA (what
  nvcc --use_fast_math makes of FlashKDA's source).
- f16 arithmetic: :func:`f16_mul`, :func:`f16_add` (``.rn`` without ``.ftz``:
  FlashKDA's half ops keep subnormals).

All helpers take and return CuTe DSL numeric scalars (Float32, BFloat16,
Float16, Uint32). Import only at build time: this module needs
nvidia-cutlass-dsl.
"""

from __future__ import annotations

from cutlass import BFloat16, Float16, Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

LOG2E = 1.4426950408889634  # rounded to f32 (0x3FB8AA3B) where used


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


# ---------------------------------------------------------------- bit casts
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


# ---------------------------------------------------------------- roundings
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
def round_bf16(x, *, loc=None, ip=None) -> Float32:
    """f32 value of bf16(x)."""
    return bf16_to_f32(f32_to_bf16(x, loc=loc, ip=ip), loc=loc, ip=ip)


# ------------------------------------------------------ pinned f32 arithmetic
@dsl_user_op
def fadd(a, b, *, loc=None, ip=None) -> Float32:
    """a + b (add.rn.ftz.f32), never fused into an FMA."""
    return _f32_binary("add.rn.ftz.f32 $0, $1, $2;", a, b, loc, ip)


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


# ------------------------------------------------------ approximate functions
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
def sigmoid(x, *, loc=None, ip=None) -> Float32:
    """SPEC sigmoid: fma(tanh.approx(0.5 * x), 0.5, 0.5)."""
    t = tanh_approx(fmul(x, Float32(0.5), loc=loc, ip=ip), loc=loc, ip=ip)
    return ffma(t, Float32(0.5), Float32(0.5), loc=loc, ip=ip)


# ------------------------------------------------------ bf16 / f16 arithmetic
@dsl_user_op
def bf16_mul(a, b, *, loc=None, ip=None) -> BFloat16:
    """bf16(a * b) for bf16 a, b (mul.rn.bf16: one rounding, subnormals kept)."""
    return _f16_binary("mul.rn.bf16 $0, $1, $2;", a, b, BFloat16, loc, ip)


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


__all__ = [
    "LOG2E",
    "bf16_mul",
    "bf16_to_f32",
    "bf16x2_hi_to_f32",
    "bf16x2_lo_to_f32",
    "ex2_approx",
    "f16_add",
    "f16_mul",
    "f16_neg",
    "f16_to_f32",
    "f32_as_u32",
    "f32_to_bf16",
    "f32_to_f16",
    "fadd",
    "ffma",
    "fmul",
    "fneg",
    "gate_scale_from_lower_bound",
    "pack_bf16x2",
    "round_bf16",
    "rsqrt_approx",
    "sigmoid",
    "tanh_approx",
    "u32_as_f32",
]
