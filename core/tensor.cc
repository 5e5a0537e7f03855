#include "core/tensor.h"

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvstep {

std::string ShapeToString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape,
                                    absl::string_view what) {
  constexpr int64_t kMax = int64_t{1} << 62;
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t d = shape[i];
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: shape %s has a negative dimension %d", what,
                          ShapeToString(shape), i));
    }
    if (d != 0 && n > kMax / d) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: shape %s has too many elements", what, ShapeToString(shape)));
    }
    n *= d;
  }
  return n;
}

absl::StatusOr<Tensor> Tensor::Zeros(Device* device, DType dtype, Shape shape) {
  if (DTypeSize(dtype) == 0) {
    return absl::InvalidArgumentError("tensor: invalid dtype");
  }
  absl::StatusOr<int64_t> n = NumElements(shape, "tensor");
  if (!n.ok()) return n.status();
  if (*n > (int64_t{1} << 62) / static_cast<int64_t>(DTypeSize(dtype))) {
    return absl::InvalidArgumentError("tensor: too many bytes");
  }
  absl::StatusOr<std::shared_ptr<Allocation>> storage =
      device->Allocate(static_cast<size_t>(*n) * DTypeSize(dtype));
  if (!storage.ok()) return storage.status();
  return Tensor(*std::move(storage), dtype, std::move(shape), *n);
}

namespace {

// Whether num_bytes are exactly what `shape` of `dtype` holds; the error
// otherwise (FromHostBytes, WrapHostBytes).
absl::Status CheckHostBytes(DType dtype, absl::Span<const int64_t> shape,
                            size_t num_bytes, int64_t* numel) {
  absl::StatusOr<int64_t> n = NumElements(shape, "tensor");
  if (!n.ok()) return n.status();
  if (DTypeSize(dtype) == 0 ||
      static_cast<size_t>(*n) != num_bytes / DTypeSize(dtype) ||
      num_bytes % DTypeSize(dtype) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor: %s%s needs %d bytes, got %d", DTypeName(dtype),
        ShapeToString(shape),
        DTypeSize(dtype) == 0 ? 0 : *n * static_cast<int64_t>(DTypeSize(dtype)),
        num_bytes));
  }
  *numel = *n;
  return absl::OkStatus();
}

// Memory a WrapHostBytes tensor borrows: never freed here.
class BorrowedAllocation final : public Allocation {
 public:
  using Allocation::Allocation;
};

}  // namespace

absl::StatusOr<Tensor> Tensor::WrapHostBytes(DType dtype, Shape shape,
                                             void* bytes, size_t num_bytes) {
  int64_t n = 0;
  if (absl::Status s = CheckHostBytes(dtype, shape, num_bytes, &n); !s.ok()) {
    return s;
  }
  if (reinterpret_cast<uintptr_t>(bytes) % DTypeSize(dtype) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor: %s bytes at %p are not aligned to %d",
                        DTypeName(dtype), bytes, DTypeSize(dtype)));
  }
  return Tensor(
      std::make_shared<BorrowedAllocation>(CpuDevice(), bytes, num_bytes),
      dtype, std::move(shape), n);
}

absl::StatusOr<Tensor> Tensor::FromHostBytes(Device* device, DType dtype,
                                             Shape shape, const void* bytes,
                                             size_t num_bytes) {
  // Checked before allocating so a lying shape cannot make us allocate.
  int64_t n = 0;
  if (absl::Status s = CheckHostBytes(dtype, shape, num_bytes, &n); !s.ok()) {
    return s;
  }
  absl::StatusOr<Tensor> t = Zeros(device, dtype, std::move(shape));
  if (!t.ok()) return t.status();
  device->CopyFromHost(t->raw_data(), bytes, num_bytes);
  return t;
}

absl::StatusOr<Tensor> Tensor::Clone() const {
  if (!defined()) return Tensor();
  absl::StatusOr<Tensor> t = Zeros(device(), dtype_, shape_);
  if (!t.ok()) return t.status();
  device()->Copy(t->raw_data(), raw_data(), nbytes());
  return t;
}

std::string Tensor::DebugString() const {
  if (!defined()) return "undefined";
  return absl::StrCat(DTypeName(dtype_), ShapeToString(shape_));
}

}  // namespace kvstep
