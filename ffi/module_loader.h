// Loads exported CuTe DSL modules into devices, with error checks at every step.
//
// We do not use the generated <prefix>_Kernel_Module_Load: it loops over an uninitialised device
// count when no GPU is present and only prints errors. Here the CUDA library (context independent)
// is loaded once per specialisation, and each device gets its kernel attributes set and its
// module made resident in its primary context, so no lazy load can happen inside a captured
// launch later.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <string>

namespace jax_kda {

constexpr int kMaxDevices = 64;

// Load state of one specialisation.
struct LoadState {
  cudaLibrary_t library = nullptr;
  std::array<std::atomic<bool>, kMaxDevices> ready{};
};

// One exported specialisation's loader entry points (from its export_to_c header).
struct ModuleEntry {
  const char* name;
  int variant;  // inverse id (prepare), block_v (recurrence), PoolVariant, DecodeVariant
  int sm;       // 90 (sm_90a objects) or 100 (sm_100a objects)
  void (*init)(void**);
  void (*load_to_device)(void**);
  LoadState* state;
};

// The device `stream` belongs to (XLA may call us from threads whose current device differs).
std::string StreamDevice(cudaStream_t stream, int* device);

// 90 or 100 for devices our objects run on; otherwise an error naming the device's sm.
std::string DeviceArch(int device, int* sm);

// Whether XLA already created the device's primary context (i.e. this process uses the device).
bool PrimaryContextActive(int device);

// Makes `entry` resident on `device`; idempotent and thread-safe. With `relax_capture` the
// thread's stream-capture mode is relaxed for the duration (legal: nothing is enqueued).
std::string EnsureLoaded(const ModuleEntry& entry, int device, bool relax_capture = false);

inline bool IsLoaded(const ModuleEntry& entry, int device) {
  return entry.state->ready[device].load(std::memory_order_acquire);
}

std::string CudaMessage(const std::string& what, cudaError_t err);

}  // namespace jax_kda
