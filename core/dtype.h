// Element types of kvstep tensors and their sizes.
//
// The numbering matches kvstep.v1.DType on the wire, so the service converts
// with a range check only. Thread-safe: plain values and pure functions.
#ifndef KVSTEP_CORE_DTYPE_H_
#define KVSTEP_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace kvstep {

enum class DType : int {
  kInvalid = 0,
  kInt32 = 1,
  kInt64 = 2,
  kFloat32 = 3,
  kFloat16 = 4,
  kBFloat16 = 5,
  kFp8E4M3 = 6,
  kFp8E5M2 = 7,
};

inline constexpr int kMaxDType = 7;

// Bytes per element; 0 for kInvalid.
size_t DTypeSize(DType dtype);

// "int32", "float16", ...; "invalid" for kInvalid.
absl::string_view DTypeName(DType dtype);

// Parses the names DTypeName returns (plus "fp16", "bf16", "fp32", "fp8",
// "fp8_e4m3", "fp8_e5m2"); kInvalid when unknown.
DType ParseDType(absl::string_view name);

inline bool IsIndexType(DType dtype) {
  return dtype == DType::kInt32 || dtype == DType::kInt64;
}

// Maps a C++ type to its DType.
template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::kInt32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::kInt64;
};
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kFloat32;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_DTYPE_H_
