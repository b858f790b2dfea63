// XLA FFI handler of the backward pass's serial chains (docs/kernel_abi.md):
//   jax_kda_state_chain_v2   reset, init, gamma, A, B, Y -> states
//                            (attribute rows: 16, the forward state recompute; 32, the reverse
//                            state-gradient chain; every operand f32 except reset, int32)
// Stages as in kda_ffi.cc: instantiate loads the specialisation on every device XLA already uses,
// initialize on the stream's device, execute only validates shapes and launches (CUDA-graph safe).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "handler_common.h"

namespace jax_kda {
namespace {

constexpr const char* kStateChain = "state_chain";

std::string CheckRows(int32_t rows) {
  std::string listed;
  if (OneOf(rows, kStateChainRows, &listed)) return {};
  return std::string(kStateChain) + ": attribute rows must be one of " + listed + ", got " +
         std::to_string(rows);
}

std::string RowsText(int rows) { return "rows=" + std::to_string(rows); }

ffi::Error StateChainInstantiate(int32_t rows) {
  JAX_KDA_RETURN_IF(CheckRows(rows));
  if (std::string e = LoadOnActiveDevices(StateChainSpecs(), {rows}); !e.empty()) {
    return Internal(e);
  }
  return ffi::Error::Success();
}

ffi::Error StateChainInitialize(cudaStream_t stream, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>,
                                ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                                ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                                ffi::Result<ffi::Buffer<ffi::F32>>, int32_t rows) {
  JAX_KDA_RETURN_IF(CheckRows(rows));
  const KernelSpec<StateChainArgs>* spec = nullptr;
  std::string e = Resolve(StateChainSpecs(), kStateChain, RowsText, rows, stream,
                          /*in_execute=*/false, &spec);
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

ffi::Error StateChainExecute(cudaStream_t stream, ffi::Buffer<ffi::S32> reset,
                             ffi::Buffer<ffi::F32> init, ffi::Buffer<ffi::F32> gamma,
                             ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                             ffi::Buffer<ffi::F32> y, ffi::Result<ffi::Buffer<ffi::F32>> states,
                             int32_t rows) {
  const char* call = kStateChain;
  JAX_KDA_RETURN_IF(CheckRows(rows));
  auto gamma_dims = gamma.dimensions();
  auto init_dims = init.dimensions();
  if (gamma_dims.size() != 4 || init_dims.size() != 4) {
    return ffi::Error::InvalidArgument(std::string("jax_kda: ") + call +
                                       ": gamma and init must have rank 4, got shapes " +
                                       DimsString(gamma_dims) + " and " + DimsString(init_dims));
  }
  const int64_t n = gamma_dims[0], h = gamma_dims[1], c = gamma_dims[2], ni = init_dims[0];
  StateChainArgs args;
  JAX_KDA_RETURN_IF(CheckOperand(call, "reset", reset, {n, c}, 2, &args.reset));
  JAX_KDA_RETURN_IF(CheckOperand(call, "init", init, {ni, h, kHeadDim, kHeadDim}, 2, &args.init));
  JAX_KDA_RETURN_IF(CheckOperand(call, "gamma", gamma, {n, h, c, kHeadDim}, 3, &args.gamma));
  JAX_KDA_RETURN_IF(CheckOperand(call, "A", a, {n, h, c, kChunk, kHeadDim}, 3, &args.a));
  JAX_KDA_RETURN_IF(CheckOperand(call, "B", b, {n, h, c, rows, kHeadDim}, 3, &args.b));
  JAX_KDA_RETURN_IF(CheckOperand(call, "Y", y, {n, h, c, rows, kHeadDim}, 3, &args.y));
  JAX_KDA_RETURN_IF(CheckOperand(call, "states (result)", *states,
                                 {n, h, c, kHeadDim, kHeadDim}, 3, &args.states));
  if (n == 0 || h == 0 || c == 0) return ffi::Error::Success();  // nothing to write
  args.stream = stream;
  const KernelSpec<StateChainArgs>* spec = nullptr;
  std::string e = Resolve(StateChainSpecs(), call, RowsText, rows, stream, /*in_execute=*/true,
                          &spec);
  if (e.empty()) e = spec->launch(args);
  if (!e.empty()) return Internal(e);
  return ffi::Error::Success();
}

auto StateChainInstantiateBinding() {
  return ffi::Ffi::BindInstantiate().Attr<int32_t>("rows");
}

template <ffi::ExecutionStage stage>
auto StateChainBinding() {
  return ffi::Ffi::Bind<stage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Arg<ffi::Buffer<ffi::S32>>()  // reset
      .template Arg<ffi::Buffer<ffi::F32>>()  // init
      .template Arg<ffi::Buffer<ffi::F32>>()  // gamma
      .template Arg<ffi::Buffer<ffi::F32>>()  // A
      .template Arg<ffi::Buffer<ffi::F32>>()  // B
      .template Arg<ffi::Buffer<ffi::F32>>()  // Y
      .template Ret<ffi::Buffer<ffi::F32>>()  // states
      .template Attr<int32_t>("rows");
}

}  // namespace
}  // namespace jax_kda

JAX_KDA_HANDLERS(JaxKdaStateChainV2, StateChain)
