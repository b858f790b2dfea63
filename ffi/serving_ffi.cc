// XLA FFI handlers for the serving custom calls (docs/kernel_abi.md):
//   jax_kda_recurrence_pool_v1  v, beta, workspace, cu_seqlens, state_indices,
//                               checkpoint_offsets, pool, checkpoints -> out, pool, checkpoints
//                               (pool and checkpoints aliased: updated in place)
//   jax_kda_recurrence_fp32_pool_v1  the same operands in the fp32 numerics mode (23,040-byte
//                               records; the state kept in f32 between the pool's reads/writes)
//   jax_kda_decode_v1           q, k, v, g, beta, A_log, dt_bias, state_indices, pool
//                               -> out, pool (aliased), states (q, k on Hk heads, the rest on
//                               H, a multiple: grouped heads)
//   jax_kda_decode_fp32_v1      the same operands and attributes in the fp32 numerics mode
//                               (inverse 0: its one inverse)
// Pools and checkpoints are bf16 or f32: the buffer's dtype picks the specialisation. Stages as
// in kda_ffi.cc; the instantiate stage sees no buffers, so it loads both dtypes' modules.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "handler_common.h"

namespace jax_kda {
namespace {

std::string StateDtype(const char* call, const char* name, ffi::DataType type, int* id) {
  if (type == ffi::DataType::BF16) {
    *id = kStateBf16;
  } else if (type == ffi::DataType::F32) {
    *id = kStateF32;
  } else {
    return std::string(call) + ": operand " + name + " must be bf16 or f32";
  }
  return {};
}

// The pool (and checkpoint) results alias their operands: the kernels write through one pointer.
std::string CheckAliased(const char* call, const char* name, const ffi::AnyBuffer& operand,
                         const ffi::AnyBuffer& result) {
  if (operand.untyped_data() != result.untyped_data()) {
    return std::string(call) + ": result " + name +
           " must alias its operand (input_output_aliases)";
  }
  return {};
}

std::string DtypeText(int id) { return id == kStateF32 ? "f32" : "bf16"; }

// ---------------------------------------------------------------------------------------------
// recurrence on a state pool

std::string PoolText(int variant) {
  return "block_v=" + std::to_string(variant / 2) + ", " + DtypeText(variant % 2) + " pool";
}

// The two modes' pool recurrences: the same operands, their own kernels and record size.
struct FlashKdaPool {
  static constexpr const char* kCall = "recurrence_pool";
  static constexpr int64_t kRecord = kRecordBytes;
  static std::span<const KernelSpec<RecurrencePoolArgs>> Specs() { return RecurrencePoolSpecs(); }
};
struct Fp32Pool {
  static constexpr const char* kCall = "recurrence_fp32_pool";
  static constexpr int64_t kRecord = kFp32RecordBytes;
  static std::span<const KernelSpec<RecurrencePoolArgs>> Specs() {
    return RecurrenceFp32PoolSpecs();
  }
};

std::string CheckPoolAttrs(const char* call, int32_t block_v, int32_t checkpoint_chunks) {
  if (!OneOf(block_v, kColumnSplits)) {
    return std::string(call) + ": attribute block_v must be a column split, got " +
           std::to_string(block_v);
  }
  if (checkpoint_chunks < 0) {
    return std::string(call) + ": attribute checkpoint_chunks must be >= 0";
  }
  return {};
}

template <typename Mode>
ffi::Error PoolInstantiate(int32_t block_v, int32_t checkpoint_chunks) {
  JAX_KDA_RETURN_IF(CheckPoolAttrs(Mode::kCall, block_v, checkpoint_chunks));
  std::string e = LoadOnActiveDevices(
      Mode::Specs(), {PoolVariant(block_v, kStateBf16), PoolVariant(block_v, kStateF32)});
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

template <typename Mode>
ffi::Error PoolRun(bool execute, cudaStream_t stream, ffi::Buffer<ffi::BF16> v,
                             ffi::Buffer<ffi::BF16> beta, ffi::Buffer<ffi::U8> workspace,
                             ffi::Buffer<ffi::S32> cu_seqlens,
                             ffi::Buffer<ffi::S32> state_indices,
                             ffi::Buffer<ffi::S32> checkpoint_offsets, ffi::AnyBuffer pool,
                             ffi::AnyBuffer checkpoints, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                             ffi::Result<ffi::AnyBuffer> pool_out,
                             ffi::Result<ffi::AnyBuffer> checkpoints_out, int32_t block_v,
                             int32_t checkpoint_chunks) {
  const char* call = Mode::kCall;
  JAX_KDA_RETURN_IF(CheckPoolAttrs(call, block_v, checkpoint_chunks));
  int dtype = 0, ckpt_dtype = 0;
  JAX_KDA_RETURN_IF(StateDtype(call, "pool", pool.element_type(), &dtype));
  JAX_KDA_RETURN_IF(StateDtype(call, "checkpoints", checkpoints.element_type(), &ckpt_dtype));
  if (ckpt_dtype != dtype) {
    return Internal(std::string(call) + ": checkpoints and pool differ in dtype");
  }
  const int variant = PoolVariant(block_v, dtype);
  const KernelSpec<RecurrencePoolArgs>* spec = nullptr;
  if (!execute) {
    std::string e = Resolve(Mode::Specs(), call, PoolText, variant, stream,
                            /*in_execute=*/false, &spec);
    return e.empty() ? ffi::Error::Success() : Internal(e);
  }

  int64_t t = 0, h = 0, n = 0;
  JAX_KDA_RETURN_IF(CheckProblem(call, v.dimensions(), cu_seqlens.dimensions(), &t, &h, &n));
  const int64_t s = NumSlots(t, n);
  if (pool.dimensions().size() != 4 || checkpoints.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument(std::string("jax_kda: ") + call +
                                       ": pool and checkpoints are 4-D");
  }
  const int64_t p = pool.dimensions()[0], c = checkpoints.dimensions()[0];
  RecurrencePoolArgs a;
  JAX_KDA_RETURN_IF(CheckOperand(call, "v", v, {t, h, kHeadDim}, 2, &a.v));
  JAX_KDA_RETURN_IF(CheckOperand(call, "beta", beta, {t, h}, 2, &a.beta));
  JAX_KDA_RETURN_IF(
      CheckOperand(call, "workspace", workspace, {h, s, Mode::kRecord}, 2, &a.workspace));
  JAX_KDA_RETURN_IF(CheckOperand(call, "cu_seqlens", cu_seqlens, {n + 1}, 1, &a.cu_seqlens));
  JAX_KDA_RETURN_IF(
      CheckOperand(call, "state_indices", state_indices, {n}, 1, &a.state_indices));
  JAX_KDA_RETURN_IF(CheckOperand(call, "checkpoint_offsets", checkpoint_offsets, {n + 1}, 1,
                                 &a.checkpoint_offsets));
  DenseTensor unused;
  JAX_KDA_RETURN_IF(CheckOperand(call, "pool", pool, {p, h, kHeadDim, kHeadDim}, 2, &unused));
  JAX_KDA_RETURN_IF(CheckOperand(call, "pool (result)", *pool_out, {p, h, kHeadDim, kHeadDim},
                                 2, &a.pool));
  JAX_KDA_RETURN_IF(CheckAliased(call, "pool", pool, *pool_out));
  JAX_KDA_RETURN_IF(
      CheckOperand(call, "checkpoints", checkpoints, {c, h, kHeadDim, kHeadDim}, 2, &unused));
  JAX_KDA_RETURN_IF(CheckOperand(call, "checkpoints (result)", *checkpoints_out,
                                 {c, h, kHeadDim, kHeadDim}, 2, &a.checkpoints));
  JAX_KDA_RETURN_IF(CheckAliased(call, "checkpoints", checkpoints, *checkpoints_out));
  JAX_KDA_RETURN_IF(CheckOperand(call, "out (result)", *out, {t, h, kHeadDim}, 2, &a.out));
  if (h == 0) return ffi::Error::Success();  // empty grid: nothing to write
  a.checkpoint_chunks = checkpoint_chunks;
  a.stream = stream;
  std::string e = Resolve(Mode::Specs(), call, PoolText, variant, stream,
                          /*in_execute=*/true, &spec);
  if (e.empty()) e = spec->launch(a);
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

#define JAX_KDA_POOL_PARAMS                                                                 \
  cudaStream_t stream, ffi::Buffer<ffi::BF16> v, ffi::Buffer<ffi::BF16> beta,               \
      ffi::Buffer<ffi::U8> workspace, ffi::Buffer<ffi::S32> cu, ffi::Buffer<ffi::S32> indices, \
      ffi::Buffer<ffi::S32> offsets, ffi::AnyBuffer pool, ffi::AnyBuffer checkpoints,         \
      ffi::Result<ffi::Buffer<ffi::BF16>> out, ffi::Result<ffi::AnyBuffer> pool_out,          \
      ffi::Result<ffi::AnyBuffer> checkpoints_out, int32_t block_v, int32_t checkpoint_chunks
#define JAX_KDA_POOL_ARGS                                                                    \
  stream, v, beta, workspace, cu, indices, offsets, pool, checkpoints, out, pool_out,         \
      checkpoints_out, block_v, checkpoint_chunks

ffi::Error RecurrencePoolInstantiate(int32_t block_v, int32_t checkpoint_chunks) {
  return PoolInstantiate<FlashKdaPool>(block_v, checkpoint_chunks);
}
ffi::Error RecurrencePoolInitialize(JAX_KDA_POOL_PARAMS) {
  return PoolRun<FlashKdaPool>(false, JAX_KDA_POOL_ARGS);
}
ffi::Error RecurrencePoolExecute(JAX_KDA_POOL_PARAMS) {
  return PoolRun<FlashKdaPool>(true, JAX_KDA_POOL_ARGS);
}
ffi::Error RecurrenceFp32PoolInstantiate(int32_t block_v, int32_t checkpoint_chunks) {
  return PoolInstantiate<Fp32Pool>(block_v, checkpoint_chunks);
}
ffi::Error RecurrenceFp32PoolInitialize(JAX_KDA_POOL_PARAMS) {
  return PoolRun<Fp32Pool>(false, JAX_KDA_POOL_ARGS);
}
ffi::Error RecurrenceFp32PoolExecute(JAX_KDA_POOL_PARAMS) {
  return PoolRun<Fp32Pool>(true, JAX_KDA_POOL_ARGS);
}

template <ffi::ExecutionStage stage>
auto RecurrencePoolBinding() {
  return ffi::Ffi::Bind<stage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()  // v
      .template Arg<ffi::Buffer<ffi::BF16>>()  // beta
      .template Arg<ffi::Buffer<ffi::U8>>()    // workspace
      .template Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens
      .template Arg<ffi::Buffer<ffi::S32>>()   // state_indices
      .template Arg<ffi::Buffer<ffi::S32>>()   // checkpoint_offsets
      .template Arg<ffi::AnyBuffer>()          // pool
      .template Arg<ffi::AnyBuffer>()          // checkpoints
      .template Ret<ffi::Buffer<ffi::BF16>>()  // out
      .template Ret<ffi::AnyBuffer>()          // pool (aliased)
      .template Ret<ffi::AnyBuffer>()          // checkpoints (aliased)
      .template Attr<int32_t>("block_v")
      .template Attr<int32_t>("checkpoint_chunks");
}

auto RecurrencePoolInstantiateBinding() {
  return ffi::Ffi::BindInstantiate().Attr<int32_t>("block_v").Attr<int32_t>("checkpoint_chunks");
}

// The fp32 pool recurrence binds the same operands and attributes.
template <ffi::ExecutionStage stage>
auto RecurrenceFp32PoolBinding() {
  return RecurrencePoolBinding<stage>();
}
auto RecurrenceFp32PoolInstantiateBinding() { return RecurrencePoolInstantiateBinding(); }

// ---------------------------------------------------------------------------------------------
// decode

std::string DecodeText(int variant) {  // a DecodeVariant (kernel_registry.h)
  return InverseText(variant / 8) + ", " + DtypeText((variant / 4) % 2) + " pool" +
         ((variant / 2) % 2 ? ", intermediate states" : "") +
         (variant % 2 ? ", grouped q/k heads" : "");
}

// The two modes' decode calls: the same operands and attributes, their own kernels; the fp32
// mode's have one inverse (0).
struct FlashKdaDecode {
  static constexpr const char* kCall = "decode";
  static constexpr bool kOneInverse = false;
  static std::span<const KernelSpec<DecodeArgs>> Specs() { return DecodeSpecs(); }
};
struct Fp32Decode {
  static constexpr const char* kCall = "decode_fp32";
  static constexpr bool kOneInverse = true;
  static std::span<const KernelSpec<DecodeArgs>> Specs() { return DecodeFp32Specs(); }
};

template <typename Mode>
std::string CheckDecodeAttrs(float scale, float lower_bound, int32_t inverse,
                             int32_t intermediate) {
  const char* call = Mode::kCall;
  if (std::string e = CheckGateAttrs(call, scale, lower_bound, inverse); !e.empty()) return e;
  if (intermediate != 0 && intermediate != 1) {
    return std::string(call) + ": attribute intermediate must be 0 or 1";
  }
  if (Mode::kOneInverse && inverse != 0) {
    return std::string(call) + ": attribute inverse must be 0 (stable)";
  }
  return {};
}

template <typename Mode>
ffi::Error DecodeInstantiateIn(float scale, float lower_bound, int32_t inverse,
                               int32_t intermediate) {
  JAX_KDA_RETURN_IF(CheckDecodeAttrs<Mode>(scale, lower_bound, inverse, intermediate));
  // no buffers here: both pool dtypes, with and without grouped q/k heads
  std::string e = LoadOnActiveDevices(Mode::Specs(),
                                      {DecodeVariant(inverse, kStateBf16, intermediate, 0),
                                       DecodeVariant(inverse, kStateF32, intermediate, 0),
                                       DecodeVariant(inverse, kStateBf16, intermediate, 1),
                                       DecodeVariant(inverse, kStateF32, intermediate, 1)});
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

ffi::Error DecodeInstantiate(float scale, float lower_bound, int32_t inverse,
                             int32_t intermediate) {
  return DecodeInstantiateIn<FlashKdaDecode>(scale, lower_bound, inverse, intermediate);
}
ffi::Error DecodeFp32Instantiate(float scale, float lower_bound, int32_t inverse,
                                 int32_t intermediate) {
  return DecodeInstantiateIn<Fp32Decode>(scale, lower_bound, inverse, intermediate);
}

template <typename Mode>
ffi::Error DecodeRun(bool execute, cudaStream_t stream, ffi::Buffer<ffi::BF16> q,
                     ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::BF16> v, ffi::Buffer<ffi::BF16> g,
                     ffi::Buffer<ffi::BF16> beta, ffi::Buffer<ffi::F32> a_log,
                     ffi::Buffer<ffi::F32> dt_bias, ffi::Buffer<ffi::S32> state_indices,
                     ffi::AnyBuffer pool, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                     ffi::Result<ffi::AnyBuffer> pool_out, ffi::Result<ffi::AnyBuffer> states,
                     float scale, float lower_bound, int32_t inverse, int32_t intermediate) {
  const char* call = Mode::kCall;
  JAX_KDA_RETURN_IF(CheckDecodeAttrs<Mode>(scale, lower_bound, inverse, intermediate));
  int dtype = 0, states_dtype = 0;
  JAX_KDA_RETURN_IF(StateDtype(call, "pool", pool.element_type(), &dtype));
  JAX_KDA_RETURN_IF(StateDtype(call, "states (result)", states->element_type(), &states_dtype));
  if (states_dtype != dtype) {
    return Internal(std::string(call) + ": states and pool differ in dtype");
  }
  const bool grouped = HasGroupedHeads(q.dimensions(), v.dimensions(), 2);
  const int variant = DecodeVariant(inverse, dtype, intermediate, grouped);
  const KernelSpec<DecodeArgs>* spec = nullptr;
  if (!execute) {
    std::string e = Resolve(Mode::Specs(), call, DecodeText, variant, stream,
                            /*in_execute=*/false, &spec);
    return e.empty() ? ffi::Error::Success() : Internal(e);
  }

  auto q_dims = q.dimensions();
  if (q_dims.size() != 4 || q_dims[3] != kHeadDim) {
    return ffi::Error::InvalidArgument("jax_kda: " + std::string(call) +
                                       ": q must be [N, t, Hk, 128], got " + DimsString(q_dims));
  }
  // N, t and Hk from q; H (the heads of v, g, beta, A_log, dt_bias, the pool and the results)
  // from v: a multiple of Hk
  const int64_t n = q_dims[0], t = q_dims[1], hk = q_dims[2];
  int64_t h = 0;  // the variant above already knows whether Hk < H
  JAX_KDA_RETURN_IF(CheckValueHeads(call, "v", v.dimensions(), 2, hk, &h, nullptr));
  if (t < 1 || t > kMaxDecodeTokens) {
    return ffi::Error::InvalidArgument("jax_kda: " + std::string(call) + ": t must lie in [1, " +
                                       std::to_string(kMaxDecodeTokens) + "], got " +
                                       std::to_string(t));
  }
  if (pool.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("jax_kda: " + std::string(call) +
                                       ": pool must be [P, H, 128, 128]");
  }
  const int64_t p = pool.dimensions()[0];
  DecodeArgs a;
  JAX_KDA_RETURN_IF(CheckOperand(call, "q", q, {n, t, hk, kHeadDim}, 3, &a.q));
  JAX_KDA_RETURN_IF(CheckOperand(call, "k", k, {n, t, hk, kHeadDim}, 3, &a.k));
  JAX_KDA_RETURN_IF(CheckOperand(call, "v", v, {n, t, h, kHeadDim}, 3, &a.v));
  JAX_KDA_RETURN_IF(CheckOperand(call, "g", g, {n, t, h, kHeadDim}, 3, &a.g));
  JAX_KDA_RETURN_IF(CheckOperand(call, "beta", beta, {n, t, h}, 3, &a.beta));
  JAX_KDA_RETURN_IF(CheckOperand(call, "A_log", a_log, {h}, 1, &a.a_log));
  JAX_KDA_RETURN_IF(CheckOperand(call, "dt_bias", dt_bias, {h, kHeadDim}, 1, &a.dt_bias));
  JAX_KDA_RETURN_IF(
      CheckOperand(call, "state_indices", state_indices, {n}, 1, &a.state_indices));
  DenseTensor unused;
  JAX_KDA_RETURN_IF(CheckOperand(call, "pool", pool, {p, h, kHeadDim, kHeadDim}, 2, &unused));
  JAX_KDA_RETURN_IF(CheckOperand(call, "pool (result)", *pool_out, {p, h, kHeadDim, kHeadDim},
                                 2, &a.pool));
  JAX_KDA_RETURN_IF(CheckAliased(call, "pool", pool, *pool_out));
  JAX_KDA_RETURN_IF(CheckOperand(call, "out (result)", *out, {n, t, h, kHeadDim}, 3, &a.out));
  JAX_KDA_RETURN_IF(CheckOperand(call, "states (result)", *states,
                                 {intermediate ? n : 0, t, h, kHeadDim, kHeadDim}, 3, &a.states));
  if (h == 0 || n == 0) return ffi::Error::Success();  // empty grid: nothing to write
  a.scale = scale;
  a.lower_bound = lower_bound;
  a.stream = stream;
  std::string e = Resolve(Mode::Specs(), call, DecodeText, variant, stream,
                          /*in_execute=*/true, &spec);
  if (e.empty()) e = spec->launch(a);
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

#define JAX_KDA_DECODE_PARAMS                                                             \
  cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,                \
      ffi::Buffer<ffi::BF16> v, ffi::Buffer<ffi::BF16> g, ffi::Buffer<ffi::BF16> beta,    \
      ffi::Buffer<ffi::F32> a_log, ffi::Buffer<ffi::F32> dt_bias,                         \
      ffi::Buffer<ffi::S32> state_indices, ffi::AnyBuffer pool,                           \
      ffi::Result<ffi::Buffer<ffi::BF16>> out, ffi::Result<ffi::AnyBuffer> pool_out,      \
      ffi::Result<ffi::AnyBuffer> states, float scale, float lower_bound, int32_t inverse, \
      int32_t intermediate
#define JAX_KDA_DECODE_ARGS                                                             \
  stream, q, k, v, g, beta, a_log, dt_bias, state_indices, pool, out, pool_out, states, \
      scale, lower_bound, inverse, intermediate

ffi::Error DecodeInitialize(JAX_KDA_DECODE_PARAMS) {
  return DecodeRun<FlashKdaDecode>(false, JAX_KDA_DECODE_ARGS);
}
ffi::Error DecodeExecute(JAX_KDA_DECODE_PARAMS) {
  return DecodeRun<FlashKdaDecode>(true, JAX_KDA_DECODE_ARGS);
}
ffi::Error DecodeFp32Initialize(JAX_KDA_DECODE_PARAMS) {
  return DecodeRun<Fp32Decode>(false, JAX_KDA_DECODE_ARGS);
}
ffi::Error DecodeFp32Execute(JAX_KDA_DECODE_PARAMS) {
  return DecodeRun<Fp32Decode>(true, JAX_KDA_DECODE_ARGS);
}

template <ffi::ExecutionStage stage>
auto DecodeBinding() {
  return ffi::Ffi::Bind<stage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()  // q
      .template Arg<ffi::Buffer<ffi::BF16>>()  // k
      .template Arg<ffi::Buffer<ffi::BF16>>()  // v
      .template Arg<ffi::Buffer<ffi::BF16>>()  // g
      .template Arg<ffi::Buffer<ffi::BF16>>()  // beta
      .template Arg<ffi::Buffer<ffi::F32>>()   // A_log
      .template Arg<ffi::Buffer<ffi::F32>>()   // dt_bias
      .template Arg<ffi::Buffer<ffi::S32>>()   // state_indices
      .template Arg<ffi::AnyBuffer>()          // pool
      .template Ret<ffi::Buffer<ffi::BF16>>()  // out
      .template Ret<ffi::AnyBuffer>()          // pool (aliased)
      .template Ret<ffi::AnyBuffer>()          // states
      .template Attr<float>("scale")
      .template Attr<float>("lower_bound")
      .template Attr<int32_t>("inverse")
      .template Attr<int32_t>("intermediate");
}

// The fp32 decode binds the same operands and attributes.
template <ffi::ExecutionStage stage>
auto DecodeFp32Binding() {
  return DecodeBinding<stage>();
}

auto DecodeInstantiateBinding() {
  return ffi::Ffi::BindInstantiate()
      .Attr<float>("scale")
      .Attr<float>("lower_bound")
      .Attr<int32_t>("inverse")
      .Attr<int32_t>("intermediate");
}

auto DecodeFp32InstantiateBinding() { return DecodeInstantiateBinding(); }

}  // namespace
}  // namespace jax_kda

JAX_KDA_HANDLERS(JaxKdaRecurrencePoolV1, RecurrencePool)
JAX_KDA_HANDLERS(JaxKdaRecurrenceFp32PoolV1, RecurrenceFp32Pool)
JAX_KDA_HANDLERS(JaxKdaDecodeV1, Decode)
JAX_KDA_HANDLERS(JaxKdaDecodeFp32V1, DecodeFp32)
