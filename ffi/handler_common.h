// What every custom-call handler shares: error plumbing and finding (and loading) the kernel
// specialisation for a variant on the device of the call's stream.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "kernel_registry.h"
#include "module_loader.h"
#include "shape_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_kda {

#define JAX_KDA_RETURN_IF(expr)                                        \
  if (std::string _e = (expr); !_e.empty()) {                          \
    return ffi::Error::InvalidArgument(std::string("jax_kda: ") + _e); \
  }

inline ffi::Error Internal(const std::string& message) {
  return ffi::Error::Internal("jax_kda: " + message);
}

// The specialisation for (variant, arch of the stream's device), loaded on that device.
// `describe` names the variant in the error message, e.g. "block_v=32" (only built on error).
template <typename Args>
inline std::string Resolve(std::span<const KernelSpec<Args>> specs, const char* kernel,
                    std::string (*describe)(int), int variant, cudaStream_t stream,
                    bool in_execute, const KernelSpec<Args>** out) {
  int device = 0, sm = 0;
  if (std::string e = StreamDevice(stream, &device); !e.empty()) return e;
  if (std::string e = DeviceArch(device, &sm); !e.empty()) return e;
  for (const KernelSpec<Args>& spec : specs) {
    if (spec.module.variant != variant || spec.module.sm != sm) continue;
    *out = &spec;
    // In execute this is a last resort, reached only if XLA ran neither the instantiate nor the
    // initialize stage for this device (a command-buffer path may skip initialize): loading
    // enqueues nothing, so it is legal during capture once the capture mode is relaxed.
    return EnsureLoaded(spec.module, device, /*relax_capture=*/in_execute);
  }
  return std::string("this jax_kda build has no ") + kernel + " kernel for " + describe(variant) +
         " on sm_" + std::to_string(sm) + "a (rebuild the package with kernels enabled)";
}

// Instantiate stage: no stream and no buffers; load on every device this process already uses
// (never create contexts on other GPUs). Unsupported GPUs are left to execute to report.
template <typename Args>
inline std::string LoadOnActiveDevices(std::span<const KernelSpec<Args>> specs,
                                       std::initializer_list<int> variants) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return CudaMessage("cudaGetDeviceCount", err);
  for (int device = 0; device < count && device < kMaxDevices; ++device) {
    int sm = 0;
    if (!PrimaryContextActive(device) || !DeviceArch(device, &sm).empty()) continue;
    for (const KernelSpec<Args>& spec : specs) {
      if (spec.module.sm != sm) continue;
      for (int variant : variants) {
        if (spec.module.variant != variant) continue;
        if (std::string e = EnsureLoaded(spec.module, device); !e.empty()) return e;
      }
    }
  }
  return {};
}

// Whether `value` is one of `values`; `listed` (if given) gets them as "16, 32, 64".
inline bool OneOf(int32_t value, std::span<const int32_t> values, std::string* listed = nullptr) {
  bool found = false;
  for (int32_t v : values) {
    found = found || v == value;
    if (listed) *listed += (listed->empty() ? "" : ", ") + std::to_string(v);
  }
  return found;
}

inline std::string InverseText(int inverse) { return "inverse=" + std::to_string(inverse); }

// Names a PrepareVariant (kernel_registry.h) in error messages.
inline std::string PrepareText(int variant) {
  return InverseText(variant / 2) + (variant % 2 ? ", grouped q/k heads" : "");
}

// The gate attributes of the calls that run the prepare step (prepare, decode).
inline std::string CheckGateAttrs(const char* call, float scale, float lower_bound,
                                  int32_t inverse) {
  if (inverse != kInverseStable && inverse != kInverseNeumann) {
    return std::string(call) + ": attribute inverse must be " + std::to_string(kInverseStable) +
           " (stable) or " + std::to_string(kInverseNeumann) + " (neumann), got " +
           std::to_string(inverse);
  }
  if (!std::isfinite(scale)) return std::string(call) + ": attribute scale must be finite";
  if (!(lower_bound >= -5.0f && lower_bound < 0.0f)) {
    return std::string(call) + ": attribute lower_bound must lie in [-5, 0), got " +
           std::to_string(lower_bound);
  }
  return {};
}

}  // namespace jax_kda

// Exported symbols: the library is built with -fvisibility=hidden and a version script
// (exports.map), so each is declared visible before the XLA macro defines it.
#define JAX_KDA_EXPORT extern "C" __attribute__((visibility("default")))

// The three stage handlers of one custom call, exported as NAME{Instantiate,Initialize,Execute}
// from jax_kda::FN{Instantiate,Initialize,Execute} with the bindings FN##InstantiateBinding() and
// FN##Binding<stage>(); execute is command-buffer (CUDA graph) safe.
#define JAX_KDA_HANDLERS(NAME, FN)                                                          \
  JAX_KDA_EXPORT XLA_FFI_Error* NAME##Instantiate(XLA_FFI_CallFrame*);                      \
  JAX_KDA_EXPORT XLA_FFI_Error* NAME##Initialize(XLA_FFI_CallFrame*);                       \
  JAX_KDA_EXPORT XLA_FFI_Error* NAME##Execute(XLA_FFI_CallFrame*);                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME##Instantiate, jax_kda::FN##Instantiate,                \
                                jax_kda::FN##InstantiateBinding());                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                            \
      NAME##Initialize, jax_kda::FN##Initialize,                                            \
      jax_kda::FN##Binding<xla::ffi::ExecutionStage::kInitialize>());                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME##Execute, jax_kda::FN##Execute,                        \
                                jax_kda::FN##Binding<xla::ffi::ExecutionStage::kExecute>(), \
                                {xla::ffi::Traits::kCmdBufferCompatible});
