// DispatchIndex: calls f(int32_t{}) or f(int64_t{}) for an index dtype, so
// kernels are written once as templates over the integer widths; and
// IndexValues, an index tensor's values as int64.
#ifndef KVSTEP_CORE_INDEX_DISPATCH_H_
#define KVSTEP_CORE_INDEX_DISPATCH_H_

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace kvstep {

// REQUIRES: IsIndexType(dtype).
template <typename F>
decltype(auto) DispatchIndex(DType dtype, F&& f) {
  if (dtype == DType::kInt32) return f(int32_t{});
  return f(int64_t{});
}

// Element i of an int32 or int64 tensor, widened to int64.
inline int64_t LoadIndex(const Tensor& t, int64_t i) {
  return DispatchIndex(t.dtype(), [&](auto tag) -> int64_t {
    return static_cast<int64_t>(t.data<decltype(tag)>()[i]);
  });
}

// Stores v at element i. REQUIRES: v fits the tensor's width.
inline void StoreIndex(const Tensor& t, int64_t i, int64_t v) {
  DispatchIndex(t.dtype(), [&](auto tag) {
    t.data<decltype(tag)>()[i] = static_cast<decltype(tag)>(v);
  });
}

// The values of an int32 or int64 tensor, widened to int64.
// REQUIRES: IsIndexType(t.dtype()) and t is host accessible.
inline std::vector<int64_t> IndexValues(const Tensor& t) {
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  DispatchIndex(t.dtype(), [&](auto tag) {
    const auto* p = t.data<decltype(tag)>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = p[i];
  });
  return v;
}

}  // namespace kvstep

#endif  // KVSTEP_CORE_INDEX_DISPATCH_H_
