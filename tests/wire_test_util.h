// Helpers shared by the tests that build kvstep.v1 messages: float32
// tensors to and from the wire.
#ifndef KVSTEP_TESTS_WIRE_TEST_UTIL_H_
#define KVSTEP_TESTS_WIRE_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvstep/v1/kvstep.pb.h"

namespace kvstep {

// A FLOAT32 tensor of `shape` holding v.
inline v1::Tensor FloatTensor(const std::vector<float>& v,
                              std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FLOAT32);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(
      std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  return t;
}

// A FLOAT32 tensor's values (its data, read as floats).
inline std::vector<float> FloatValues(const v1::Tensor& t) {
  std::vector<float> v(t.data().size() / 4);
  std::memcpy(v.data(), t.data().data(), t.data().size());
  return v;
}

}  // namespace kvstep

#endif  // KVSTEP_TESTS_WIRE_TEST_UTIL_H_
