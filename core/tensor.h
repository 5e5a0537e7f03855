// Tensor: a dense, row-major n-d array of one DType in one Device's memory.
//
// A Tensor is a cheap handle: copies share the same bytes (like
// torch.Tensor), Clone() makes an independent copy. Shapes are validated on
// construction (no negative dims, no overflow), so numel() and nbytes() are
// always exact. Not thread-safe for writes: whoever shares a Tensor decides
// who writes it (the Engine guards its tensors with its mutex).
#ifndef KVSTEP_CORE_TENSOR_H_
#define KVSTEP_CORE_TENSOR_H_

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/device.h"
#include "core/dtype.h"

namespace kvstep {

using Shape = absl::InlinedVector<int64_t, 4>;

// "[2, 3]".
std::string ShapeToString(absl::Span<const int64_t> shape);

// Product of the dims. INVALID_ARGUMENT naming `what` for a negative dim or
// a product past 2^62.
absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape,
                                    absl::string_view what);

class Tensor {
 public:
  // An undefined tensor (defined() is false).
  Tensor() = default;

  // A zero-filled tensor on `device`.
  static absl::StatusOr<Tensor> Zeros(Device* device, DType dtype, Shape shape);
  // A tensor on `device` holding a copy of `bytes` host bytes, which must be
  // exactly numel * DTypeSize(dtype) long (INVALID_ARGUMENT otherwise).
  static absl::StatusOr<Tensor> FromHostBytes(Device* device, DType dtype,
                                              Shape shape, const void* bytes,
                                              size_t num_bytes);
  // A CPU tensor over `bytes` themselves, not a copy: the service's
  // zero-copy path for request tensors (TensorViewOfProto; each copy of a
  // prefill's activations costs a pass over tens of MB, in fresh pages at
  // a tenth of warm memory's speed), and for PagedAttention's inputs and
  // output in a client's shared memory. The caller keeps the bytes alive, and
  // decides who writes them, for as long as the tensor or any copy of it
  // lives. INVALID_ARGUMENT as FromHostBytes for a size that does not match
  // the shape, and for bytes not aligned to the element size.
  static absl::StatusOr<Tensor> WrapHostBytes(DType dtype, Shape shape,
                                              void* bytes, size_t num_bytes);
  // A 1-d or n-d tensor of T on the CPU device (for tests and tools).
  template <typename T>
  static Tensor FromValues(const Shape& shape, absl::Span<const T> values);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const {
    return static_cast<size_t>(numel_) * DTypeSize(dtype_);
  }
  Device* device() const { return storage_ ? storage_->device() : nullptr; }

  void* raw_data() const { return storage_ ? storage_->data() : nullptr; }
  // REQUIRES: dtype() == DTypeOf<T>::value and the device is host accessible.
  template <typename T>
  T* data() const {
    assert(DTypeOf<T>::value == dtype_);
    return static_cast<T*>(raw_data());
  }
  template <typename T>
  absl::Span<T> span() const {
    return absl::Span<T>(data<T>(), static_cast<size_t>(numel_));
  }

  // An independent copy on the same device.
  absl::StatusOr<Tensor> Clone() const;

  // "int64[4, 1]".
  std::string DebugString() const;

 private:
  Tensor(std::shared_ptr<Allocation> storage, DType dtype, Shape shape,
         int64_t numel)
      : storage_(std::move(storage)),
        dtype_(dtype),
        shape_(std::move(shape)),
        numel_(numel) {}

  std::shared_ptr<Allocation> storage_;
  DType dtype_ = DType::kInvalid;
  Shape shape_;
  int64_t numel_ = 0;
};

template <typename T>
Tensor Tensor::FromValues(const Shape& shape, absl::Span<const T> values) {
  auto t = FromHostBytes(CpuDevice(), DTypeOf<T>::value, shape, values.data(),
                         values.size() * sizeof(T));
  assert(t.ok());
  return *std::move(t);
}

}  // namespace kvstep

#endif  // KVSTEP_CORE_TENSOR_H_
