// The host code that CuTe DSL's export_to_c emits calls eight CUDA entry points under
// underscore-prefixed names. We provide them here, forwarding to the CUDA runtime that is
// linked statically into libjax_kda_ffi.so, so the library needs no libcudart at run time.
#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>

#define JAX_KDA_SHIM extern "C" __attribute__((visibility("hidden")))

JAX_KDA_SHIM cudaError_t _cudaLaunchKernelEx(const cudaLaunchConfig_t* config, const void* func,
                                             void** args) {
  return cudaLaunchKernelExC(config, func, args);
}

JAX_KDA_SHIM cudaError_t _cudaLibraryLoadData(cudaLibrary_t* library, const void* code,
                                              cudaJitOption* jit_options, void** jit_values,
                                              unsigned int num_jit, cudaLibraryOption* lib_options,
                                              void** lib_values, unsigned int num_lib) {
  return cudaLibraryLoadData(library, code, jit_options, jit_values, num_jit, lib_options,
                             lib_values, num_lib);
}

JAX_KDA_SHIM cudaError_t _cudaLibraryGetKernel(cudaKernel_t* kernel, cudaLibrary_t library,
                                               const char* name) {
  return cudaLibraryGetKernel(kernel, library, name);
}

JAX_KDA_SHIM cudaError_t _cudaGetDevice(int* device) { return cudaGetDevice(device); }

JAX_KDA_SHIM cudaError_t _cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  return cudaDeviceGetAttribute(value, attr, device);
}

JAX_KDA_SHIM cudaError_t _cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr,
                                               int value) {
  return cudaFuncSetAttribute(func, attr, value);
}

JAX_KDA_SHIM cudaError_t _cudaKernelSetAttributeForDevice(cudaKernel_t kernel,
                                                          cudaFuncAttribute attr, int value,
                                                          int device) {
  return cudaKernelSetAttributeForDevice(kernel, attr, value, device);
}

// cuKernelGetAttribute is a driver entry point; fetch it through the runtime so that we never
// link libcuda directly (the driver is whatever the GPU machine has).
namespace {
using CuKernelGetAttributeFn = CUresult (*)(int*, CUfunction_attribute, CUkernel, CUdevice);
CuKernelGetAttributeFn ResolveCuKernelGetAttribute() {
  static CuKernelGetAttributeFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuKernelGetAttribute", &ptr, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      return static_cast<CuKernelGetAttributeFn>(nullptr);
    }
    return reinterpret_cast<CuKernelGetAttributeFn>(ptr);
  }();
  return fn;
}
}  // namespace

JAX_KDA_SHIM CUresult _cuKernelGetAttribute(int* value, CUfunction_attribute attr,
                                            CUkernel kernel, CUdevice device) {
  CuKernelGetAttributeFn fn = ResolveCuKernelGetAttribute();
  if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;
  return fn(value, attr, kernel, device);
}
