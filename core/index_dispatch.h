// DispatchIndex: calls f(int32_t{}) or f(int64_t{}) for an index dtype, so
// kernels are written once as templates over the integer widths.
#ifndef KVSTEP_CORE_INDEX_DISPATCH_H_
#define KVSTEP_CORE_INDEX_DISPATCH_H_

#include <cstdint>

#include "core/dtype.h"

namespace kvstep {

// REQUIRES: IsIndexType(dtype).
template <typename F>
decltype(auto) DispatchIndex(DType dtype, F&& f) {
  if (dtype == DType::kInt32) return f(int32_t{});
  return f(int64_t{});
}

}  // namespace kvstep

#endif  // KVSTEP_CORE_INDEX_DISPATCH_H_
