// XLA FFI handlers for the prefill custom calls (docs/kernel_abi.md; serving_ffi.cc has the
// pool recurrence and the decode step):
//   jax_kda_prepare_v1          q, k, g, beta, A_log, dt_bias, cu_seqlens -> workspace
//                               (q, k on Hk heads, the rest on H, a multiple: grouped heads)
//   jax_kda_recurrence_v1       v, beta, workspace, cu_seqlens, state0   -> out, final_state
//                               (block_v 16/32/64/128: column split; 0: the baseline kernel)
//   jax_kda_prepare_fp32_v1     the same in the fp32 numerics mode: 23,040-byte records,
//   jax_kda_recurrence_fp32_v1  f32 states, column splits only
// The two modes' handlers are one template over the mode's facts (FlashKdaMode, Fp32Mode).
//
// Stages: instantiate (compile time) loads the chosen specialisation into every device XLA
// already uses; initialize (before each run, outside capture) makes sure the stream's device has
// it; execute only validates shapes and launches, so it is safe under CUDA-graph capture.
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>

#include "handler_common.h"

namespace jax_kda {
namespace {

// What differs between the numerics modes' prefill calls.
struct FlashKdaMode {  // the default: FlashKDA's bf16 arithmetic, bit for bit
  static constexpr const char* kPrepare = "prepare";
  static constexpr const char* kRecurrence = "recurrence";
  static constexpr int64_t kRecord = kRecordBytes;
  static constexpr ffi::DataType kState = ffi::BF16;
  static std::span<const KernelSpec<PrepareArgs>> Prepares() { return PrepareSpecs(); }
  static std::span<const KernelSpec<RecurrenceArgs>> Recurrences() { return RecurrenceSpecs(); }
};

struct Fp32Mode {  // the fp32 numerics mode (docs/fp32_mode.md)
  static constexpr const char* kPrepare = "prepare_fp32";
  static constexpr const char* kRecurrence = "recurrence_fp32";
  static constexpr int64_t kRecord = kFp32RecordBytes;
  static constexpr ffi::DataType kState = ffi::F32;
  static std::span<const KernelSpec<PrepareArgs>> Prepares() { return PrepareFp32Specs(); }
  static std::span<const KernelSpec<RecurrenceArgs>> Recurrences() {
    return RecurrenceFp32Specs();
  }
};

// ---------------------------------------------------------------------------------------------
// prepare

// The instantiate stage sees no buffers, so it loads both the plain and the grouped-heads
// specialisation of the inverse.
template <typename Mode>
ffi::Error PrepareInstantiateOf(float scale, float lower_bound, int32_t inverse) {
  JAX_KDA_RETURN_IF(CheckGateAttrs(Mode::kPrepare, scale, lower_bound, inverse));
  std::string e = LoadOnActiveDevices(
      Mode::Prepares(), {PrepareVariant(inverse, 0), PrepareVariant(inverse, 1)});
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

template <typename Mode>
ffi::Error PrepareInitializeOf(cudaStream_t stream, ffi::Buffer<ffi::BF16> q,
                             ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16> g,
                             ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                             ffi::Buffer<ffi::S32>, ffi::Result<ffi::Buffer<ffi::U8>>,
                             float scale, float lower_bound, int32_t inverse) {
  JAX_KDA_RETURN_IF(CheckGateAttrs(Mode::kPrepare, scale, lower_bound, inverse));
  const KernelSpec<PrepareArgs>* spec = nullptr;
  const int variant = PrepareVariant(inverse, HasGroupedHeads(q.dimensions(), g.dimensions(), 1));
  std::string e = Resolve(Mode::Prepares(), Mode::kPrepare, PrepareText, variant, stream,
                          /*in_execute=*/false, &spec);
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

template <typename Mode>
ffi::Error PrepareExecuteOf(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                          ffi::Buffer<ffi::BF16> g, ffi::Buffer<ffi::BF16> beta,
                          ffi::Buffer<ffi::F32> a_log, ffi::Buffer<ffi::F32> dt_bias,
                          ffi::Buffer<ffi::S32> cu_seqlens,
                          ffi::Result<ffi::Buffer<ffi::U8>> workspace, float scale,
                          float lower_bound, int32_t inverse) {
  const char* call = Mode::kPrepare;
  JAX_KDA_RETURN_IF(CheckGateAttrs(call, scale, lower_bound, inverse));
  // T_total and Hk from q; H (the value heads of g, beta, A_log, dt_bias and the workspace) from
  // g: a multiple of Hk
  int64_t t = 0, hk = 0, n = 0, h = 0;
  bool grouped = false;
  JAX_KDA_RETURN_IF(CheckProblem(call, q.dimensions(), cu_seqlens.dimensions(), &t, &hk, &n));
  JAX_KDA_RETURN_IF(CheckValueHeads(call, "g", g.dimensions(), 1, hk, &h, &grouped));
  const int64_t s = NumSlots(t, n);
  PrepareArgs a;
  JAX_KDA_RETURN_IF(CheckOperand(call, "q", q, {t, hk, kHeadDim}, 2, &a.q));
  JAX_KDA_RETURN_IF(CheckOperand(call, "k", k, {t, hk, kHeadDim}, 2, &a.k));
  JAX_KDA_RETURN_IF(CheckOperand(call, "g", g, {t, h, kHeadDim}, 2, &a.g));
  JAX_KDA_RETURN_IF(CheckOperand(call, "beta", beta, {t, h}, 2, &a.beta));
  JAX_KDA_RETURN_IF(CheckOperand(call, "A_log", a_log, {h}, 1, &a.a_log));
  JAX_KDA_RETURN_IF(CheckOperand(call, "dt_bias", dt_bias, {h, kHeadDim}, 1, &a.dt_bias));
  JAX_KDA_RETURN_IF(CheckOperand(call, "cu_seqlens", cu_seqlens, {n + 1}, 1, &a.cu_seqlens));
  JAX_KDA_RETURN_IF(CheckOperand(call, "workspace (result)", *workspace, {h, s, Mode::kRecord},
                                 2, &a.workspace));
  if (h == 0) return ffi::Error::Success();  // empty grid: nothing to write
  a.scale = scale;
  a.lower_bound = lower_bound;
  a.stream = stream;
  const KernelSpec<PrepareArgs>* spec = nullptr;
  std::string e = Resolve(Mode::Prepares(), call, PrepareText, PrepareVariant(inverse, grouped),
                          stream, /*in_execute=*/true, &spec);
  if (e.empty()) e = spec->launch(a);
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// recurrence

// block_v selects the recurrence kernel: one of kColumnSplits value columns per CTA (column
// split, grid (128 / block_v, H, N)) or kBaselineBlockV (the baseline kernel, grid (1, H, N)).
std::string CheckBlockV(int32_t block_v) {
  std::string splits;
  if (block_v == kBaselineBlockV || OneOf(block_v, kColumnSplits, &splits)) return {};
  return "recurrence: attribute block_v must be " + std::to_string(kBaselineBlockV) +
         " (baseline kernel) or one of " + splits + " (column split), got " +
         std::to_string(block_v);
}

std::string BlockVText(int block_v) {
  return block_v == kBaselineBlockV ? "baseline (block_v=0)"
                                    : "block_v=" + std::to_string(block_v);
}

template <typename Mode>
ffi::Error RecurrenceInstantiateOf(int32_t block_v) {
  JAX_KDA_RETURN_IF(CheckBlockV(block_v));
  if (std::string e = LoadOnActiveDevices(Mode::Recurrences(), {block_v}); !e.empty()) {
    return Internal(e);
  }
  return ffi::Error::Success();
}

template <typename Mode>
ffi::Error RecurrenceInitializeOf(cudaStream_t stream, ffi::Buffer<ffi::BF16>,
                                ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::U8>,
                                ffi::Buffer<ffi::S32>, ffi::Buffer<Mode::kState>,
                                ffi::Result<ffi::Buffer<ffi::BF16>>,
                                ffi::Result<ffi::Buffer<Mode::kState>>, int32_t block_v) {
  JAX_KDA_RETURN_IF(CheckBlockV(block_v));
  const KernelSpec<RecurrenceArgs>* spec = nullptr;
  std::string e = Resolve(Mode::Recurrences(), Mode::kRecurrence, BlockVText, block_v, stream,
                          /*in_execute=*/false, &spec);
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

template <typename Mode>
ffi::Error RecurrenceExecuteOf(cudaStream_t stream, ffi::Buffer<ffi::BF16> v,
                             ffi::Buffer<ffi::BF16> beta, ffi::Buffer<ffi::U8> workspace,
                             ffi::Buffer<ffi::S32> cu_seqlens, ffi::Buffer<Mode::kState> state0,
                             ffi::Result<ffi::Buffer<ffi::BF16>> out,
                             ffi::Result<ffi::Buffer<Mode::kState>> state_t, int32_t block_v) {
  const char* call = Mode::kRecurrence;
  JAX_KDA_RETURN_IF(CheckBlockV(block_v));
  int64_t t = 0, h = 0, n = 0;
  JAX_KDA_RETURN_IF(CheckProblem(call, v.dimensions(), cu_seqlens.dimensions(), &t, &h, &n));
  const int64_t s = NumSlots(t, n);
  RecurrenceArgs a;
  JAX_KDA_RETURN_IF(CheckOperand(call, "v", v, {t, h, kHeadDim}, 2, &a.v));
  JAX_KDA_RETURN_IF(CheckOperand(call, "beta", beta, {t, h}, 2, &a.beta));
  JAX_KDA_RETURN_IF(
      CheckOperand(call, "workspace", workspace, {h, s, Mode::kRecord}, 2, &a.workspace));
  JAX_KDA_RETURN_IF(CheckOperand(call, "cu_seqlens", cu_seqlens, {n + 1}, 1, &a.cu_seqlens));
  JAX_KDA_RETURN_IF(CheckOperand(call, "initial_state", state0, {n, h, kHeadDim, kHeadDim}, 2,
                                 &a.state0));
  JAX_KDA_RETURN_IF(CheckOperand(call, "out (result)", *out, {t, h, kHeadDim}, 2, &a.out));
  JAX_KDA_RETURN_IF(CheckOperand(call, "final_state (result)", *state_t,
                                 {n, h, kHeadDim, kHeadDim}, 2, &a.state_t));
  if (h == 0) return ffi::Error::Success();  // empty grid: nothing to write
  a.stream = stream;
  const KernelSpec<RecurrenceArgs>* spec = nullptr;
  std::string e = Resolve(Mode::Recurrences(), call, BlockVText, block_v, stream,
                          /*in_execute=*/true, &spec);
  if (e.empty()) e = spec->launch(a);
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Bindings: operand order and attribute names are docs/kernel_abi.md.

template <ffi::ExecutionStage stage>
auto PrepareBindingOf() {
  return ffi::Ffi::Bind<stage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()  // q
      .template Arg<ffi::Buffer<ffi::BF16>>()  // k
      .template Arg<ffi::Buffer<ffi::BF16>>()  // g
      .template Arg<ffi::Buffer<ffi::BF16>>()  // beta
      .template Arg<ffi::Buffer<ffi::F32>>()   // A_log
      .template Arg<ffi::Buffer<ffi::F32>>()   // dt_bias
      .template Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens
      .template Ret<ffi::Buffer<ffi::U8>>()    // workspace
      .template Attr<float>("scale")
      .template Attr<float>("lower_bound")
      .template Attr<int32_t>("inverse");
}

template <ffi::DataType state, ffi::ExecutionStage stage>
auto RecurrenceBindingOf() {
  return ffi::Ffi::Bind<stage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()  // v
      .template Arg<ffi::Buffer<ffi::BF16>>()  // beta
      .template Arg<ffi::Buffer<ffi::U8>>()    // workspace
      .template Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens
      .template Arg<ffi::Buffer<state>>()      // initial_state
      .template Ret<ffi::Buffer<ffi::BF16>>()  // out
      .template Ret<ffi::Buffer<state>>()      // final_state
      .template Attr<int32_t>("block_v");
}

// The instantiate stage sees attributes only (no buffers, no stream).
auto PrepareAttributes() {
  return ffi::Ffi::BindInstantiate()
      .Attr<float>("scale")
      .Attr<float>("lower_bound")
      .Attr<int32_t>("inverse");
}

auto RecurrenceAttributes() {
  return ffi::Ffi::BindInstantiate().Attr<int32_t>("block_v");
}

// One name per (mode, call) for JAX_KDA_HANDLERS, which pastes FN##Instantiate etc.
#define JAX_KDA_MODE_CALLS(FN, MODE, CALL, BINDING)                          \
  constexpr auto FN##Instantiate = CALL##InstantiateOf<MODE>;               \
  constexpr auto FN##Initialize = CALL##InitializeOf<MODE>;                 \
  constexpr auto FN##Execute = CALL##ExecuteOf<MODE>;                       \
  auto FN##InstantiateBinding() { return CALL##Attributes(); }              \
  template <ffi::ExecutionStage stage>                                      \
  auto FN##Binding() {                                                      \
    return BINDING;                                                         \
  }
JAX_KDA_MODE_CALLS(Prepare, FlashKdaMode, Prepare, PrepareBindingOf<stage>())
JAX_KDA_MODE_CALLS(Recurrence, FlashKdaMode, Recurrence,
                   (RecurrenceBindingOf<FlashKdaMode::kState, stage>()))
JAX_KDA_MODE_CALLS(PrepareFp32, Fp32Mode, Prepare, PrepareBindingOf<stage>())
JAX_KDA_MODE_CALLS(RecurrenceFp32, Fp32Mode, Recurrence,
                   (RecurrenceBindingOf<Fp32Mode::kState, stage>()))
#undef JAX_KDA_MODE_CALLS

}  // namespace
}  // namespace jax_kda

JAX_KDA_HANDLERS(JaxKdaPrepareV1, Prepare)
JAX_KDA_HANDLERS(JaxKdaRecurrenceV1, Recurrence)
JAX_KDA_HANDLERS(JaxKdaPrepareFp32V1, PrepareFp32)
JAX_KDA_HANDLERS(JaxKdaRecurrenceFp32V1, RecurrenceFp32)

// Which specialisations this library holds, as "name,name,..." (for tests and diagnostics).
JAX_KDA_EXPORT const char* jax_kda_ffi_kernels() {
  static const std::string names = [] {
    std::string s;
    auto add = [&s](const char* name) {
      if (!s.empty()) s.push_back(',');
      s.append(name);
    };
    for (const auto& spec : jax_kda::PrepareSpecs()) add(spec.module.name);
    for (const auto& spec : jax_kda::RecurrenceSpecs()) add(spec.module.name);
    for (const auto& spec : jax_kda::RecurrencePoolSpecs()) add(spec.module.name);
    for (const auto& spec : jax_kda::DecodeSpecs()) add(spec.module.name);
    for (const auto& spec : jax_kda::PrepareFp32Specs()) add(spec.module.name);
    for (const auto& spec : jax_kda::RecurrenceFp32Specs()) add(spec.module.name);
    for (const auto& spec : jax_kda::RecurrenceFp32PoolSpecs()) add(spec.module.name);
    for (const auto& spec : jax_kda::DecodeFp32Specs()) add(spec.module.name);
    for (const auto& spec : jax_kda::StateChainSpecs()) add(spec.module.name);
    return s;
  }();
  return names.c_str();
}

// Bumped whenever docs/kernel_abi.md changes incompatibly; _ffi.py refuses a mismatch.
JAX_KDA_EXPORT int jax_kda_ffi_abi_version() { return jax_kda::kAbiVersion; }
