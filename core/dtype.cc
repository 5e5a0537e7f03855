#include "core/dtype.h"

namespace kvstep {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kInt32:
    case DType::kFloat32:
      return 4;
    case DType::kInt64:
      return 8;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      return 1;
    case DType::kInvalid:
      break;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFp8E4M3:
      return "fp8_e4m3";
    case DType::kFp8E5M2:
      return "fp8_e5m2";
    case DType::kInvalid:
      break;
  }
  return "invalid";
}

DType ParseDType(absl::string_view name) {
  for (int i = 1; i <= kMaxDType; ++i) {
    if (name == DTypeName(static_cast<DType>(i))) return static_cast<DType>(i);
  }
  if (name == "fp32") return DType::kFloat32;
  if (name == "fp16" || name == "half") return DType::kFloat16;
  if (name == "bf16") return DType::kBFloat16;
  if (name == "fp8" || name == "fp8_e4m3fn") return DType::kFp8E4M3;
  return DType::kInvalid;
}

}  // namespace kvstep
