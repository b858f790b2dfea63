// Shape, range and alignment checks of the custom-call operands against docs/kernel_abi.md.
// The exported host code trusts its arguments completely (it does not even check the
// divisibility it was compiled for), so every operand is checked here before a launch.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "kernel_args.h"
#include "kernel_contract.h"  // generated from jax_kda/contract.py: kHeadDim, kChunk, ...
#include "xla/ffi/api/ffi.h"

namespace jax_kda {

constexpr int64_t kMaxDim = INT32_MAX;  // the kernels take int32 sizes
constexpr size_t kMaxRank = sizeof(DenseTensor::dims) / sizeof(DenseTensor::dims[0]);

inline std::string DimsString(xla::ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline std::string DimsString(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  size_t i = 0;
  for (int64_t d : dims) s += (i++ ? ", " : "") + std::to_string(d);
  return s + "]";
}

// Checks `buffer` against `expected` and describes it as a DenseTensor whose first
// `num_dynamic` dimensions are symbolic in the compiled kernels; the trailing ones are the
// static head dimension (128) or record size (13824). Returns "" or the complaint.
template <typename B>
std::string CheckOperand(const char* call, const char* name, const B& buffer,
                         std::initializer_list<int64_t> expected, int num_dynamic,
                         DenseTensor* out) {
  auto dims = buffer.dimensions();
  bool ok = dims.size() == expected.size() && dims.size() <= kMaxRank;
  size_t i = 0;
  for (int64_t e : expected) {
    if (!ok) break;
    ok = dims[i++] == e;
  }
  if (!ok) {
    return std::string(call) + ": operand " + name + " has shape " + DimsString(dims) +
           ", expected " + DimsString(expected);
  }
  out->data = buffer.untyped_data();
  out->rank = static_cast<int>(dims.size());
  for (int r = 0; r < out->rank; ++r) {
    out->dims[r] = dims[r];
    out->dynamic[r] = r < num_dynamic;
    if (dims[r] > kMaxDim) {
      return std::string(call) + ": operand " + name + " dimension " + std::to_string(r) +
             " is " + std::to_string(dims[r]) + ", above the int32 range of the kernels";
    }
  }
  if (out->data != nullptr && reinterpret_cast<uintptr_t>(out->data) % 16 != 0) {
    return std::string(call) + ": operand " + name + " is not 16-byte aligned";
  }
  return {};
}

// Workspace chunk slots: ceil(T_total / 16) + N.
inline int64_t NumSlots(int64_t total_tokens, int64_t num_seqs) {
  return (total_tokens + kChunk - 1) / kChunk + num_seqs;
}

// T_total and H come from the first token operand, N from cu_seqlens; all else must agree.
inline std::string CheckProblem(const char* call, xla::ffi::Span<const int64_t> token_dims,
                                xla::ffi::Span<const int64_t> cu_dims, int64_t* t, int64_t* h,
                                int64_t* n) {
  if (token_dims.size() != 3 || token_dims[2] != kHeadDim) {
    return std::string(call) + ": expected [T_total, H, 128] for the token operands, got " +
           DimsString(token_dims);
  }
  if (cu_dims.size() != 1 || cu_dims[0] < 2) {
    return std::string(call) + ": cu_seqlens must be int32 [N+1] with N >= 1, got shape " +
           DimsString(cu_dims);
  }
  *t = token_dims[0];
  *h = token_dims[1];
  *n = cu_dims[0] - 1;
  return {};
}

// Grouped value heads (docs/kernel_abi.md): q and k carry Hk = qk_heads heads, the other
// head-carrying operands H heads, a positive multiple of Hk (H = Hk: not grouped). Reads H from
// axis `axis` of operand `name` (`dims`) into *h; *grouped (if given) says whether H != Hk.
inline std::string CheckValueHeads(const char* call, const char* name,
                                   xla::ffi::Span<const int64_t> dims, size_t axis,
                                   int64_t qk_heads, int64_t* h, bool* grouped) {
  if (dims.size() <= axis) {
    return std::string(call) + ": operand " + name + " has shape " + DimsString(dims) +
           ", expected its heads on axis " + std::to_string(axis);
  }
  *h = dims[axis];
  const bool ok = qk_heads == 0 ? *h == 0 : (*h > 0 && *h % qk_heads == 0);
  if (!ok) {
    return std::string(call) + ": operand " + name + " has " + std::to_string(*h) +
           " heads, which must be a positive multiple of the " + std::to_string(qk_heads) +
           " heads of q and k (grouped value heads)";
  }
  if (grouped != nullptr) *grouped = *h != qk_heads;
  return {};
}

// Whether a call's q (`q_dims`) has fewer heads than `value_dims`, both on axis `axis`: which
// specialisation the initialize stage loads (execute checks the shapes).
inline bool HasGroupedHeads(xla::ffi::Span<const int64_t> q_dims,
                            xla::ffi::Span<const int64_t> value_dims, size_t axis) {
  return q_dims.size() > axis && value_dims.size() > axis && q_dims[axis] != value_dims[axis];
}

}  // namespace jax_kda
