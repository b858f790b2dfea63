"""The C++ handlers' argument checks, called directly on CPU through a minimal fake XLA FFI API.

XLA itself is not involved: the test builds XLA_FFI_CallFrame structs with ctypes (layouts from
jaxlib 0.11.2's xla/ffi/api/c_api.h, FFI API 0.4) and calls the exported execute handlers. Every
rejected call must fail before any CUDA call, with a message naming the operand and both shapes;
a well-formed call gets past validation and fails only where it needs a GPU (here: none).
Data pointers are never dereferenced by the checks, so none are allocated.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest

from jax_kda import _ffi

pytestmark = pytest.mark.skipif(not _ffi.kernels_available(), reason="FFI library not built")

c_size, c_void = ctypes.c_size_t, ctypes.c_void_p
BF16, F32, S32, U8, S64 = 16, 11, 4, 6, 5  # XLA_FFI_DataType
ATTR_SCALAR, ARG_BUFFER, STAGE_EXECUTE = 3, 1, 3


class Buffer(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("ext", c_void), ("dtype", ctypes.c_int),
                ("data", c_void), ("rank", ctypes.c_int64),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class Span(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_char_p), ("len", c_size)]


class Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", c_void)]


class List(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [("struct_size", c_size), ("ext", c_void), ("size", ctypes.c_int64),
                ("types", ctypes.POINTER(ctypes.c_int)), ("items", ctypes.POINTER(c_void))]


class Attrs(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("ext", c_void), ("size", ctypes.c_int64),
                ("types", ctypes.POINTER(ctypes.c_int)),
                ("names", ctypes.POINTER(ctypes.POINTER(Span))), ("attrs", ctypes.POINTER(c_void))]


class ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("ext", c_void), ("major", ctypes.c_int),
                ("minor", ctypes.c_int)]


class Api(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("ext", c_void), ("version", ApiVersion),
                ("internal", c_void), ("functions", c_void * 40)]


class CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("ext", c_void), ("api", ctypes.POINTER(Api)),
                ("ctx", c_void), ("stage", ctypes.c_int), ("args", List), ("rets", List),
                ("attrs", Attrs), ("future", c_void)]


class ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("ext", c_void), ("message", ctypes.c_char_p),
                ("errc", ctypes.c_int)]


class StreamGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("ext", c_void), ("ctx", c_void), ("stream", c_void)]


_errors: list[str] = []
_ERROR_CREATE = ctypes.CFUNCTYPE(c_void, ctypes.POINTER(ErrorCreateArgs))(
    lambda args: _errors.append(args.contents.message.decode()) or len(_errors))
_STREAM_GET = ctypes.CFUNCTYPE(c_void, ctypes.POINTER(StreamGetArgs))(
    lambda args: setattr(args.contents, "stream", 0x5000) or None)  # a fake, never used on CPU


def _api() -> Api:
    api = Api(struct_size=ctypes.sizeof(Api),
              version=ApiVersion(ctypes.sizeof(ApiVersion), None, 0, 4))
    api.functions[0] = ctypes.cast(_ERROR_CREATE, c_void).value  # XLA_FFI_Error_Create
    api.functions[4] = ctypes.cast(_STREAM_GET, c_void).value  # XLA_FFI_Stream_Get
    return api


def _list(buffers, keep):
    types = (ctypes.c_int * len(buffers))(*[ARG_BUFFER] * len(buffers))
    items = (c_void * len(buffers))(*[ctypes.addressof(b) for b in buffers])
    keep += [types, items]
    return List(ctypes.sizeof(List), None, len(buffers), types, items)


def _buffer(dtype, dims, keep, address=0):
    array = (ctypes.c_int64 * len(dims))(*dims)
    buffer = Buffer(ctypes.sizeof(Buffer), None, dtype, address or None, len(dims), array)
    keep += [array, buffer]
    return buffer


def _attrs(values: dict, keep) -> Attrs:
    names = sorted(values)  # XLA passes attributes sorted by name
    spans, scalars = [], []
    ctypes_by_dtype = {S32: ctypes.c_int32, S64: ctypes.c_int64, F32: ctypes.c_float}
    for name in names:
        number, dtype = values[name]
        value = ctypes_by_dtype[dtype](number)
        keep.append(value)
        spans.append(Span(name.encode(), len(name)))
        scalars.append(Scalar(dtype, ctypes.cast(ctypes.pointer(value), c_void)))
    keep += [spans, scalars]
    n = len(names)
    span_ptrs = (ctypes.POINTER(Span) * n)(*[ctypes.pointer(s) for s in spans])
    attr_ptrs = (c_void * n)(*[ctypes.addressof(s) for s in scalars])
    types = (ctypes.c_int * n)(*[ATTR_SCALAR] * n)
    keep += [span_ptrs, attr_ptrs, types]
    return Attrs(ctypes.sizeof(Attrs), None, n, types, span_ptrs, attr_ptrs)


def _call(symbol, args, rets, attrs) -> str | None:
    """Calls an execute handler; returns the error message, or None on success."""
    keep: list = []
    api = _api()
    frame = CallFrame(api=ctypes.pointer(api), stage=STAGE_EXECUTE,
                      args=_list([_buffer(*a, keep) for a in args], keep),
                      rets=_list([_buffer(*r, keep) for r in rets], keep),
                      attrs=_attrs(attrs, keep))
    # XLA_FFI_CallFrame_STRUCT_SIZE
    frame.struct_size = CallFrame.attrs.offset + ctypes.sizeof(Attrs)
    handler = getattr(ctypes.CDLL(str(_ffi.library_path())), symbol)
    handler.restype = c_void
    _errors.clear()
    result = handler(ctypes.byref(frame))
    return _errors[-1] if result else None


def i32(v):
    return (v, S32)


def f32(v):
    return (v, F32)


T, H, N = 40, 2, 2
S = -(-T // 16) + N


def recurrence(v=(BF16, (T, H, 128)), beta=(BF16, (T, H)), ws=(U8, (H, S, 13824)),
               cu=(S32, (N + 1,)), s0=(BF16, (N, H, 128, 128)), out=(BF16, (T, H, 128)),
               st=(BF16, (N, H, 128, 128)), block_v=(32, S32)):
    return _call("JaxKdaRecurrenceV1Execute", [v, beta, ws, cu, s0], [out, st],
                 {"block_v": block_v})


def prepare(q=(BF16, (T, H, 128)), k=(BF16, (T, H, 128)), g=(BF16, (T, H, 128)),
            beta=(BF16, (T, H)), a_log=(F32, (H,)), dt_bias=(F32, (H, 128)), cu=(S32, (N + 1,)),
            ws=(U8, (H, S, 13824)),
            scale=(0.088, F32), lower_bound=(-5.0, F32), inverse=(0, S32)):
    return _call("JaxKdaPrepareV1Execute", [q, k, g, beta, a_log, dt_bias, cu], [ws],
                 {"scale": scale, "lower_bound": lower_bound, "inverse": inverse})


@pytest.mark.parametrize("change,message", [
    ({"ws": (U8, (H, S - 1, 13824))},
     f"recurrence: operand workspace has shape [2, {S - 1}, 13824], expected [2, {S}, 13824]"),
    ({"beta": (BF16, (T, H + 1))}, "recurrence: operand beta has shape [40, 3], expected [40, 2]"),
    ({"s0": (BF16, (N + 1, H, 128, 128))},
     "operand initial_state has shape [3, 2, 128, 128], expected [2, 2, 128, 128]"),
    ({"out": (BF16, (T, H, 64))},
     "operand out (result) has shape [40, 2, 64], expected [40, 2, 128]"),
    ({"st": (BF16, (N, H, 128, 64))}, "operand final_state (result) has shape"),
    ({"v": (BF16, (T, H, 64))},
     "expected [T_total, H, 128] for the token operands, got [40, 2, 64]"),
    ({"cu": (S32, (1,))}, "cu_seqlens must be int32 [N+1] with N >= 1"),
    ({"block_v": i32(48)},
     "block_v must be 0 (baseline kernel) or one of 16, 32, 64, 128 (column split), got 48"),
    ({"block_v": i32(7)},
     "block_v must be 0 (baseline kernel) or one of 16, 32, 64, 128 (column split), got 7"),
    ({"block_v": i32(-1)}, "got -1"),
])
def test_recurrence_rejects(change, message):
    error = recurrence(**change)
    assert error is not None and message in error, error


@pytest.mark.parametrize("change,message", [
    ({"k": (BF16, (T + 1, H, 128))},
     "prepare: operand k has shape [41, 2, 128], expected [40, 2, 128]"),
    ({"a_log": (F32, (H + 1,))}, "operand A_log has shape [3], expected [2]"),
    ({"dt_bias": (F32, (H,))}, "operand dt_bias has shape [2], expected [2, 128]"),
    ({"ws": (U8, (H, S + 1, 13824))}, "operand workspace (result) has shape"),
    ({"inverse": i32(2)}, "inverse must be 0 (stable) or 1 (neumann), got 2"),
    ({"lower_bound": f32(0.5)}, "lower_bound must lie in [-5, 0)"),
    ({"scale": f32(float("nan"))}, "scale must be finite"),
])
def test_prepare_rejects(change, message):
    error = prepare(**change)
    assert error is not None and message in error, error


def decode(q=(BF16, (N, 3, H, 128)), k=(BF16, (N, 3, H, 128)), v=(BF16, (N, 3, H, 128)),
           g=(BF16, (N, 3, H, 128)), beta=(BF16, (N, 3, H)), a_log=(F32, (H,)),
           dt_bias=(F32, (H, 128)), idx=(S32, (N,)), pool=(BF16, (4, H, 128, 128)),
           out=(BF16, (N, 3, H, 128)), pool_out=(BF16, (4, H, 128, 128)),
           states=(BF16, (0, 3, H, 128, 128))):
    return _call("JaxKdaDecodeV1Execute", [q, k, v, g, beta, a_log, dt_bias, idx, pool],
                 [out, pool_out, states], {"scale": f32(0.088), "lower_bound": f32(-5.0),
                                           "inverse": i32(0), "intermediate": i32(0)})


# Grouped value heads: q and k on Hk = 1 head, everything else on H = 2
HK = 1
GROUPED_PREPARE = {"q": (BF16, (T, HK, 128)), "k": (BF16, (T, HK, 128))}
GROUPED_DECODE = {"q": (BF16, (N, 3, HK, 128)), "k": (BF16, (N, 3, HK, 128))}


@pytest.mark.parametrize("call,change,message", [
    (prepare, {"q": (BF16, (T, 3, 128)), "k": (BF16, (T, 3, 128))},
     "prepare: operand g has 2 heads, which must be a positive multiple of the 3 heads of q and k"),
    (prepare, {**GROUPED_PREPARE, "k": (BF16, (T, H, 128))},
     "prepare: operand k has shape [40, 2, 128], expected [40, 1, 128]"),
    (prepare, {**GROUPED_PREPARE, "beta": (BF16, (T, HK))},
     "operand beta has shape [40, 1], expected [40, 2]"),
    (prepare, {**GROUPED_PREPARE, "ws": (U8, (HK, S, 13824))},
     "operand workspace (result) has shape [1, 5, 13824], expected [2, 5, 13824]"),
    (decode, {"q": (BF16, (N, 3, 3, 128)), "k": (BF16, (N, 3, 3, 128))},
     "decode: operand v has 2 heads, which must be a positive multiple of the 3 heads of q and k"),
    (decode, {**GROUPED_DECODE, "k": (BF16, (N, 3, H, 128))},
     "decode: operand k has shape [2, 3, 2, 128], expected [2, 3, 1, 128]"),
    (decode, {**GROUPED_DECODE, "out": (BF16, (N, 3, HK, 128))},
     "operand out (result) has shape [2, 3, 1, 128], expected [2, 3, 2, 128]"),
])
def test_grouped_heads_are_checked(call, change, message):
    error = call(**change)
    assert error is not None and message in error, error


def test_wrong_dtype_is_refused_by_the_binding():
    error = recurrence(v=(F32, (T, H, 128)))
    assert error is not None and "BF16" in error and "F32" in error, error


def test_64_bit_attribute_is_refused():
    """Why _ffi passes np.int32 / np.float32: a 64-bit attribute does not decode."""
    error = recurrence(block_v=(32, S64))
    assert error is not None and "expected S32 but got S64" in error, error


def test_sizes_beyond_int32_are_refused():
    big = 2**31
    s_big = -(-big // 16) + N
    error = recurrence(v=(BF16, (big, H, 128)), beta=(BF16, (big, H)), ws=(U8, (H, s_big, 13824)),
                       out=(BF16, (big, H, 128)))
    assert error is not None and "above the int32 range" in error, error


def test_misaligned_operand_is_refused():
    keep: list = []
    args = [(BF16, (T, H, 128), 0x1008), (BF16, (T, H)), (U8, (H, S, 13824)), (S32, (N + 1,)),
            (BF16, (N, H, 128, 128))]
    bufs = [_buffer(a[0], a[1], keep, a[2] if len(a) > 2 else 0) for a in args]
    api = _api()
    frame = CallFrame(api=ctypes.pointer(api), stage=STAGE_EXECUTE, args=_list(bufs, keep),
                      rets=_list([_buffer(BF16, (T, H, 128), keep),
                                  _buffer(BF16, (N, H, 128, 128), keep)], keep),
                      attrs=_attrs({"block_v": i32(32)}, keep))
    frame.struct_size = CallFrame.attrs.offset + ctypes.sizeof(Attrs)
    handler = ctypes.CDLL(str(_ffi.library_path())).JaxKdaRecurrenceV1Execute
    handler.restype = c_void
    _errors.clear()
    assert handler(ctypes.byref(frame))
    assert "operand v is not 16-byte aligned" in _errors[-1]


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None,
                    reason="a CUDA driver is present: a valid call would launch on null pointers")
@pytest.mark.parametrize("call", [
    recurrence, prepare,
    lambda: recurrence(block_v=i32(0)),  # 0 = the baseline kernel: a valid attribute value
    lambda: recurrence(block_v=i32(128)),
    lambda: prepare(**GROUPED_PREPARE),  # grouped value heads: q, k on fewer heads
    decode,
    lambda: decode(**GROUPED_DECODE),
], ids=["recurrence", "prepare", "recurrence_baseline", "recurrence_bv128", "prepare_grouped",
        "decode", "decode_grouped"])
def test_valid_call_passes_validation_and_stops_at_the_missing_gpu(call):
    error = call()
    assert error is not None and "cudaGetDevice" in error, error  # the first CUDA call


def test_empty_head_count_is_a_no_op():
    """H = 0: nothing to launch, so no CUDA call and no error (on any machine)."""
    assert recurrence(v=(BF16, (T, 0, 128)), beta=(BF16, (T, 0)), ws=(U8, (0, S, 13824)),
                      s0=(BF16, (N, 0, 128, 128)), out=(BF16, (T, 0, 128)),
                      st=(BF16, (N, 0, 128, 128))) is None
    np.testing.assert_equal(_errors, [])
