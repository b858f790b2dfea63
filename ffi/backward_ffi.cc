// XLA FFI handler of the backward pass's serial chains (docs/kernel_abi.md):
//   jax_kda_state_chains_v1   reset_f, init_f, reset_r, init_r, gamma, A_f, B_f, Y_f, A_r, B_r,
//                             Y_r -> states_f, z_f, states_r, z_r
//                             (both chains in one launch: f the forward state recompute, 16 rows
//                             per chunk; r the reverse state-gradient chain, 32; every operand
//                             f32 except the resets, int32)
// Stages as in kda_ffi.cc: instantiate loads the specialisation on every device XLA already uses,
// initialize on the stream's device, execute only validates shapes and launches (CUDA-graph safe).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "handler_common.h"

namespace jax_kda {
namespace {

constexpr const char* kStateChains = "state_chains";
constexpr int kVariant = 0;  // one specialisation per architecture

std::string NoVariantText(int) { return "the backward"; }

ffi::Error StateChainsInstantiate() {
  if (std::string e = LoadOnActiveDevices(StateChainSpecs(), {kVariant}); !e.empty()) {
    return Internal(e);
  }
  return ffi::Error::Success();
}

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

ffi::Error StateChainsInitialize(cudaStream_t stream, S32, F32, S32, F32, F32, F32, F32, F32, F32,
                                 F32, F32, F32Result, F32Result, F32Result, F32Result) {
  const KernelSpec<StateChainArgs>* spec = nullptr;
  std::string e = Resolve(StateChainSpecs(), kStateChains, NoVariantText, kVariant, stream,
                          /*in_execute=*/false, &spec);
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

ffi::Error StateChainsExecute(cudaStream_t stream, S32 reset_f, F32 init_f, S32 reset_r,
                              F32 init_r, F32 gamma, F32 a_f, F32 b_f, F32 y_f, F32 a_r, F32 b_r,
                              F32 y_r, F32Result states_f, F32Result z_f, F32Result states_r,
                              F32Result z_r) {
  const char* call = kStateChains;
  auto gamma_dims = gamma.dimensions();
  auto init_f_dims = init_f.dimensions();
  auto init_r_dims = init_r.dimensions();
  if (gamma_dims.size() != 4 || init_f_dims.size() != 4 || init_r_dims.size() != 4) {
    return ffi::Error::InvalidArgument(std::string("jax_kda: ") + call +
                                       ": gamma, init_f and init_r must have rank 4, got shapes " +
                                       DimsString(gamma_dims) + ", " + DimsString(init_f_dims) +
                                       " and " + DimsString(init_r_dims));
  }
  const int64_t n = gamma_dims[0], h = gamma_dims[1], c = gamma_dims[2];
  const int64_t d = kHeadDim, rf = kForwardChainRows, rr = kReverseChainRows;
  StateChainArgs args;
  JAX_KDA_RETURN_IF(CheckOperand(call, "reset_f", reset_f, {n, c}, 2, &args.reset_f));
  JAX_KDA_RETURN_IF(CheckOperand(call, "init_f", init_f, {init_f_dims[0], h, d, d}, 2,
                                 &args.init_f));
  JAX_KDA_RETURN_IF(CheckOperand(call, "reset_r", reset_r, {n, c}, 2, &args.reset_r));
  JAX_KDA_RETURN_IF(CheckOperand(call, "init_r", init_r, {init_r_dims[0], h, d, d}, 2,
                                 &args.init_r));
  JAX_KDA_RETURN_IF(CheckOperand(call, "gamma", gamma, {n, h, c, d}, 3, &args.gamma));
  JAX_KDA_RETURN_IF(CheckOperand(call, "A_f", a_f, {n, h, c, kChunk, d}, 3, &args.a_f));
  JAX_KDA_RETURN_IF(CheckOperand(call, "B_f", b_f, {n, h, c, rf, d}, 3, &args.b_f));
  JAX_KDA_RETURN_IF(CheckOperand(call, "Y_f", y_f, {n, h, c, rf, d}, 3, &args.y_f));
  JAX_KDA_RETURN_IF(CheckOperand(call, "A_r", a_r, {n, h, c, kChunk, d}, 3, &args.a_r));
  JAX_KDA_RETURN_IF(CheckOperand(call, "B_r", b_r, {n, h, c, rr, d}, 3, &args.b_r));
  JAX_KDA_RETURN_IF(CheckOperand(call, "Y_r", y_r, {n, h, c, rr, d}, 3, &args.y_r));
  JAX_KDA_RETURN_IF(CheckOperand(call, "states_f (result)", *states_f, {n, h, c, d, d}, 3,
                                 &args.states_f));
  JAX_KDA_RETURN_IF(CheckOperand(call, "z_f (result)", *z_f, {n, h, c, kChunk, d}, 3,
                                 &args.z_f));
  JAX_KDA_RETURN_IF(CheckOperand(call, "states_r (result)", *states_r, {n, h, c, d, d}, 3,
                                 &args.states_r));
  JAX_KDA_RETURN_IF(CheckOperand(call, "z_r (result)", *z_r, {n, h, c, kChunk, d}, 3,
                                 &args.z_r));
  if (n == 0 || h == 0 || c == 0) return ffi::Error::Success();  // nothing to write
  args.stream = stream;
  const KernelSpec<StateChainArgs>* spec = nullptr;
  std::string e = Resolve(StateChainSpecs(), call, NoVariantText, kVariant, stream,
                          /*in_execute=*/true, &spec);
  if (e.empty()) e = spec->launch(args);
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

auto StateChainsInstantiateBinding() { return ffi::Ffi::BindInstantiate(); }

template <ffi::ExecutionStage stage>
auto StateChainsBinding() {
  return ffi::Ffi::Bind<stage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Arg<S32>()        // reset_f
      .template Arg<F32>()        // init_f
      .template Arg<S32>()        // reset_r
      .template Arg<F32>()        // init_r
      .template Arg<F32>()        // gamma
      .template Arg<F32>()        // A_f
      .template Arg<F32>()        // B_f
      .template Arg<F32>()        // Y_f
      .template Arg<F32>()        // A_r
      .template Arg<F32>()        // B_r
      .template Arg<F32>()        // Y_r
      .template Ret<ffi::Buffer<ffi::F32>>()  // states_f
      .template Ret<ffi::Buffer<ffi::F32>>()  // z_f
      .template Ret<ffi::Buffer<ffi::F32>>()  // states_r
      .template Ret<ffi::Buffer<ffi::F32>>();  // z_r
}

}  // namespace
}  // namespace jax_kda

JAX_KDA_HANDLERS(JaxKdaStateChainsV1, StateChains)
