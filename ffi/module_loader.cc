#include "module_loader.h"

#include "kernel_contract.h"

#include <mutex>
#include <vector>

namespace jax_kda {
namespace {

std::mutex g_load_mutex;
std::array<std::atomic<int>, kMaxDevices> g_device_sm{};  // 0 = not queried yet

// Driver entry points reached through the runtime, so the library never links libcuda.
template <typename Fn>
Fn DriverEntry(const char* name) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion(name, &ptr, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(ptr);
}

using CuKernelGetFunctionFn = int (*)(void** function, void* kernel);
using CuDeviceGetFn = int (*)(int* device, int ordinal);
using CuDevicePrimaryCtxGetStateFn = int (*)(int device, unsigned int* flags, int* active);

std::string LoadLocked(const ModuleEntry& entry, int device) {
  LoadState& state = *entry.state;
  cudaLibrary_t* library_ptr = &state.library;
  if (state.library == nullptr) {
    cudaError_t ret = cudaSuccess;
    struct {
      cudaLibrary_t** library;
      cudaError_t* ret;
    } init_args = {&library_ptr, &ret};
    entry.init(reinterpret_cast<void**>(&init_args));
    if (ret != cudaSuccess || state.library == nullptr) {
      state.library = nullptr;
      return CudaMessage(std::string("loading the cubin of ") + entry.name, ret);
    }
  }
  {
    cudaError_t ret = cudaSuccess;
    int32_t device_id = device;
    struct {
      cudaLibrary_t** library;
      int32_t* device_id;
      cudaError_t* ret;
    } load_args = {&library_ptr, &device_id, &ret};
    entry.load_to_device(reinterpret_cast<void**>(&load_args));
    if (ret != cudaSuccess) {
      return CudaMessage(
          std::string("preparing ") + entry.name + " for device " + std::to_string(device), ret);
    }
  }
  static CuKernelGetFunctionFn get_function =
      DriverEntry<CuKernelGetFunctionFn>("cuKernelGetFunction");
  if (get_function == nullptr) return "cuKernelGetFunction is not available from the driver";
  unsigned int count = 0;
  cudaError_t err = cudaLibraryGetKernelCount(&count, state.library);
  if (err != cudaSuccess) return CudaMessage("cudaLibraryGetKernelCount", err);
  std::vector<cudaKernel_t> kernels(count);
  err = cudaLibraryEnumerateKernels(kernels.data(), count, state.library);
  if (err != cudaSuccess) return CudaMessage("cudaLibraryEnumerateKernels", err);
  // cuKernelGetFunction loads the module into the current context: make the device's current.
  int previous = 0;
  err = cudaGetDevice(&previous);
  if (err != cudaSuccess) return CudaMessage("cudaGetDevice", err);
  err = cudaSetDevice(device);
  if (err != cudaSuccess) return CudaMessage("cudaSetDevice", err);
  std::string failure;
  for (unsigned int i = 0; i < count && failure.empty(); ++i) {
    void* function = nullptr;
    if (int result = get_function(&function, static_cast<void*>(kernels[i])); result != 0) {
      failure = std::string("loading ") + entry.name + " into device " + std::to_string(device) +
                ": cuKernelGetFunction returned " + std::to_string(result);
    }
  }
  cudaSetDevice(previous);
  if (!failure.empty()) return failure;
  state.ready[device].store(true, std::memory_order_release);
  return {};
}

}  // namespace

std::string CudaMessage(const std::string& what, cudaError_t err) {
  return what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

std::string StreamDevice(cudaStream_t /*stream*/, int* device) {
  // XLA runs a handler with the stream's device current. cudaStreamGetDevice would say the same,
  // but it is refused during stream capture and invalidates the CUDA graph being recorded
  // (cudaErrorStreamCaptureUnsupported, seen on the H200 with command buffers), while
  // cudaGetDevice enqueues nothing and is legal there.
  cudaError_t err = cudaGetDevice(device);
  if (err != cudaSuccess) return CudaMessage("cudaGetDevice", err);
  if (*device < 0 || *device >= kMaxDevices) {
    return "jax_kda supports device ordinals below " + std::to_string(kMaxDevices);
  }
  return {};
}

std::string DeviceArch(int device, int* sm) {
  int cached = g_device_sm[device].load(std::memory_order_acquire);
  if (cached == 0) {
    int major = 0, minor = 0;
    cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    }
    if (err != cudaSuccess) return CudaMessage("querying the compute capability", err);
    cached = major * 10 + minor;
    g_device_sm[device].store(cached, std::memory_order_release);
  }
  // The 'a' objects are not forward compatible: each runs on its own compute capability only.
  std::string built;
  for (int supported : kSupportedSms) {
    if (cached == supported) {
      *sm = cached;
      return {};
    }
    built += (built.empty() ? "sm_" : ", sm_") + std::to_string(supported) + "a";
  }
  return "jax_kda kernels are built for " + built + "; device " + std::to_string(device) +
         " is sm_" + std::to_string(cached) + ". Use backend=\"reference\" on this GPU.";
}

bool PrimaryContextActive(int ordinal) {
  static CuDeviceGetFn device_get = DriverEntry<CuDeviceGetFn>("cuDeviceGet");
  static CuDevicePrimaryCtxGetStateFn get_state =
      DriverEntry<CuDevicePrimaryCtxGetStateFn>("cuDevicePrimaryCtxGetState");
  if (device_get == nullptr || get_state == nullptr) return false;
  int device = 0, active = 0;
  unsigned int flags = 0;
  if (device_get(&device, ordinal) != 0) return false;
  if (get_state(device, &flags, &active) != 0) return false;
  return active != 0;
}

std::string EnsureLoaded(const ModuleEntry& entry, int device, bool relax_capture) {
  if (IsLoaded(entry, device)) return {};
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (relax_capture) {
    cudaError_t err = cudaThreadExchangeStreamCaptureMode(&mode);
    if (err != cudaSuccess) return CudaMessage("cudaThreadExchangeStreamCaptureMode", err);
  }
  std::string e;
  {
    std::lock_guard<std::mutex> lock(g_load_mutex);
    if (!IsLoaded(entry, device)) e = LoadLocked(entry, device);
  }
  if (relax_capture) cudaThreadExchangeStreamCaptureMode(&mode);
  return e;
}

}  // namespace jax_kda
