// Fills the tensor structs that CuTe DSL's export_to_c declares for each kernel argument.
//
// Each generated struct is { void* data; intXX_t dynamic_shapes[n]; [intYY_t dynamic_strides[m];] }
// holding only the dimensions and strides that were symbolic at compile time. Our kernels are
// compiled with compact row-major tensors whose dimensions are symbolic except the static head
// dimension (128) and the workspace record size (13824), see docs/kernel_abi.md. A stride is then
// symbolic exactly when some dimension after it is. The counts are checked against the struct so
// that a kernel compiled with a different convention is reported instead of launched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace jax_kda {

struct DenseTensor {
  void* data = nullptr;
  int rank = 0;
  int64_t dims[5] = {0, 0, 0, 0, 0};
  bool dynamic[5] = {false, false, false, false, false};  // symbolic in the compiled kernel
};

template <typename S>
concept HasDynamicStrides = requires(S s) { s.dynamic_strides[0]; };

// Returns an empty string on success, else what did not match.
template <typename S>
std::string FillTensorStruct(const DenseTensor& t, const char* name, S* out) {
  constexpr size_t kNumShapes = sizeof(out->dynamic_shapes) / sizeof(out->dynamic_shapes[0]);
  out->data = t.data;
  size_t shape_count = 0;
  for (int i = 0; i < t.rank; ++i) {
    if (!t.dynamic[i]) continue;
    if (shape_count < kNumShapes) {
      out->dynamic_shapes[shape_count] =
          static_cast<std::remove_reference_t<decltype(out->dynamic_shapes[0])>>(t.dims[i]);
    }
    ++shape_count;
  }
  if (shape_count != kNumShapes) {
    return std::string("kernel ABI mismatch for ") + name + ": the compiled kernel has " +
           std::to_string(kNumShapes) + " dynamic dimensions, the handler expects " +
           std::to_string(shape_count);
  }
  if constexpr (HasDynamicStrides<S>) {
    constexpr size_t kNumStrides = sizeof(out->dynamic_strides) / sizeof(out->dynamic_strides[0]);
    size_t stride_count = 0;
    for (int i = 0; i < t.rank; ++i) {
      int64_t stride = 1;
      bool dynamic_stride = false;
      for (int j = i + 1; j < t.rank; ++j) {
        stride *= t.dims[j];
        dynamic_stride = dynamic_stride || t.dynamic[j];
      }
      if (!dynamic_stride) continue;
      if (stride_count < kNumStrides) {
        out->dynamic_strides[stride_count] =
            static_cast<std::remove_reference_t<decltype(out->dynamic_strides[0])>>(stride);
      }
      ++stride_count;
    }
    if (stride_count != kNumStrides) {
      return std::string("kernel ABI mismatch for ") + name + ": the compiled kernel has " +
             std::to_string(kNumStrides) + " dynamic strides, the handler expects " +
             std::to_string(stride_count);
    }
  }
  return {};
}

}  // namespace jax_kda
