// The kernel specialisations linked into this library (generated list: kernels_specs.inc from
// jax_kda/_aot) and how to launch each: the handlers pick one by (variant, device arch).
#pragma once

#include <cuda_runtime.h>

#include <span>
#include <string>

#include "kernel_args.h"
#include "module_loader.h"

namespace jax_kda {

// Operands of one launch, in docs/kernel_abi.md order (shapes checked by the handlers).
struct PrepareArgs {
  DenseTensor q, k, g, beta, a_log, dt_bias, cu_seqlens, workspace;
  float scale = 0.f, lower_bound = 0.f;
  cudaStream_t stream = nullptr;
};

struct RecurrenceArgs {
  DenseTensor v, beta, workspace, cu_seqlens, state0, out, state_t;
  cudaStream_t stream = nullptr;
};

struct RecurrencePoolArgs {
  DenseTensor v, beta, workspace, cu_seqlens, state_indices, checkpoint_offsets, pool, out,
      checkpoints;
  int32_t checkpoint_chunks = 0;
  cudaStream_t stream = nullptr;
};

struct DecodeArgs {
  DenseTensor q, k, v, g, beta, a_log, dt_bias, state_indices, pool, out, states;
  float scale = 0.f, lower_bound = 0.f;
  cudaStream_t stream = nullptr;
};

// The backward pass's two state chains in one launch (jax_kda/kernels/state_chain.py): per chain
// (f: forward, r: reverse) reset (int32), init, A, B, Y and results states, z; gamma shared; f32.
struct StateChainArgs {
  DenseTensor reset_f, init_f, reset_r, init_r, gamma, a_f, b_f, y_f, a_r, b_r, y_r;
  DenseTensor states_f, z_f, states_r, z_r;
  cudaStream_t stream = nullptr;
};

template <typename Args>
struct KernelSpec {
  ModuleEntry module;
  std::string (*launch)(const Args&);  // "" on success, else what failed
};

// The `variant` key of the specialisations with several attributes (ModuleEntry::variant).
constexpr int PoolVariant(int block_v, int state_dtype) { return block_v * 2 + state_dtype; }
// The kernels that read q and k (prepare, decode) have a specialisation for grouped value heads
// (q, k on Hk heads, H a multiple of Hk: docs/kernel_abi.md), keyed apart by the low bit.
constexpr int GroupedVariant(int variant, int grouped) { return variant * 2 + grouped; }
constexpr int PrepareVariant(int inverse, int grouped) { return GroupedVariant(inverse, grouped); }
constexpr int DecodeVariant(int inverse, int state_dtype, int intermediate, int grouped) {
  return GroupedVariant((inverse * 2 + state_dtype) * 2 + intermediate, grouped);
}

std::span<const KernelSpec<PrepareArgs>> PrepareSpecs();
std::span<const KernelSpec<RecurrenceArgs>> RecurrenceSpecs();
std::span<const KernelSpec<RecurrencePoolArgs>> RecurrencePoolSpecs();
std::span<const KernelSpec<DecodeArgs>> DecodeSpecs();
// The fp32 numerics mode's prefill kernels: the same operands (23,040-byte records, f32 states).
std::span<const KernelSpec<PrepareArgs>> PrepareFp32Specs();
std::span<const KernelSpec<RecurrenceArgs>> RecurrenceFp32Specs();
// ... and its state-pool recurrence: the operands of RecurrencePoolSpecs' kernels.
std::span<const KernelSpec<RecurrencePoolArgs>> RecurrenceFp32PoolSpecs();
// ... and its fused decode: the operands of DecodeSpecs' kernels (keyed by DecodeVariant with
// inverse 0: the mode has one inverse).
std::span<const KernelSpec<DecodeArgs>> DecodeFp32Specs();
// The backward pass's state chains (one specialisation per architecture, variant 0).
std::span<const KernelSpec<StateChainArgs>> StateChainSpecs();

}  // namespace jax_kda
