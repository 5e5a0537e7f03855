// Helpers shared by kvstep's tests: building index tensors of either width
// from int64 values and reading them back.
#ifndef KVSTEP_TESTS_TEST_UTIL_H_
#define KVSTEP_TESTS_TEST_UTIL_H_

#include <cstdint>
#include <vector>

#include "core/index_dispatch.h"
#include "core/tensor.h"

namespace kvstep {
namespace testing_util {

inline Tensor MakeIndex(DType dtype, Shape shape,
                        const std::vector<int64_t>& values) {
  absl::StatusOr<Tensor> t = Tensor::Zeros(CpuDevice(), dtype, shape);
  DispatchIndex(dtype, [&](auto tag) {
    auto* p = t->data<decltype(tag)>();
    for (size_t i = 0; i < values.size(); ++i) {
      p[i] = static_cast<decltype(tag)>(values[i]);
    }
  });
  return *t;
}

inline Tensor I64(Shape shape, const std::vector<int64_t>& values) {
  return MakeIndex(DType::kInt64, std::move(shape), values);
}

inline std::vector<int64_t> Values(const Tensor& t) { return IndexValues(t); }

}  // namespace testing_util
}  // namespace kvstep

#endif  // KVSTEP_TESTS_TEST_UTIL_H_
