#include "core/float_convert.h"

#include <array>

namespace kvstep {
namespace {

// Sorted non-negative finite values of a format, for a binary search.
struct Fp8Table {
  std::array<float, 128> value{};
  std::array<uint8_t, 128> code{};
  int n = 0;
};

template <float (*Decode)(uint8_t)>
Fp8Table MakeTable() {
  Fp8Table t;
  for (int c = 0; c < 128; ++c) {  // non-negative codes ascend with value
    const float v = Decode(static_cast<uint8_t>(c));
    if (!std::isfinite(v)) break;
    t.value[t.n] = v;
    t.code[t.n] = static_cast<uint8_t>(c);
    ++t.n;
  }
  return t;
}

uint8_t Encode(const Fp8Table& t, float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= t.value[t.n - 1]) return sign | t.code[t.n - 1];  // saturate
  int lo = 0, hi = t.n - 1;  // value[lo] <= a < value[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    (t.value[mid] <= a ? lo : hi) = mid;
  }
  const float dl = a - t.value[lo], dh = t.value[hi] - a;
  const int pick = dl < dh ? lo : dh < dl ? hi : ((t.code[lo] & 1) ? hi : lo);
  return sign | t.code[pick];
}

}  // namespace

uint8_t FloatToFp8E4M3BySearch(float f) {
  static const Fp8Table t = MakeTable<Fp8E4M3ToFloat>();
  return Encode(t, f);
}

uint8_t FloatToFp8E5M2BySearch(float f) {
  static const Fp8Table t = MakeTable<Fp8E5M2ToFloat>();
  return Encode(t, f);  // NaN: 0x7f is a NaN in e5m2 too
}

}  // namespace kvstep
