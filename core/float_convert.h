// Scalar conversions between float and the cache element types: IEEE
// half, bfloat16 (round to nearest even), and fp8 e4m3fn / e5m2 with the
// saturating store of SEMANTICS §7 (store = saturate(x / scale)). Thread-
// safe: pure functions and immutable tables.
#ifndef KVSTEP_CORE_FLOAT_CONVERT_H_
#define KVSTEP_CORE_FLOAT_CONVERT_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvstep {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float BF16ToFloat(uint16_t h) { return BitsFloat(uint32_t{h} << 16); }
inline uint16_t FloatToBF16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffff) > 0x7f800000)
    return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -f : f;
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000 | (man << 13));
  return BitsFloat(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00;
  if (a >= 65520.0f) return sign | 0x7c00;  // rounds to infinity
  if (a < 6.103515625e-05f) {               // subnormal half: 2^-14
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  uint32_t v = FloatBits(a);
  v += 0xfff + ((v >> 13) & 1);  // round to nearest even at bit 13
  return sign | static_cast<uint16_t>(((v >> 13) - (112 << 10)) & 0x7fff);
}

// fp8 e4m3fn: bias 7, no infinities, 0x7f/0xff are NaN, max 448.
inline float Fp8E4M3ToFloat(uint8_t v) {
  const bool neg = v & 0x80;
  const int exp = (v >> 3) & 0xf;
  const int man = v & 7;
  float f;
  if (exp == 15 && man == 7) return NAN;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -9);  // man/8 * 2^-6
  } else {
    f = std::ldexp(1.0f + man / 8.0f, exp - 7);
  }
  return neg ? -f : f;
}
// fp8 e5m2: bias 15, IEEE-like; max finite 57344.
inline float Fp8E5M2ToFloat(uint8_t v) {
  return HalfToFloat(static_cast<uint16_t>(uint16_t{v} << 8));
}

// The fp8 formats FloatToFp8Bits encodes: kMan mantissa bits, exponent
// bias kBias, largest finite code kMaxCode (e4m3fn: 448; e5m2: 57344).
struct Fp8E4M3Format {
  static constexpr int kMan = 3, kBias = 7;
  static constexpr uint8_t kMaxCode = 0x7e;
};
struct Fp8E5M2Format {
  static constexpr int kMan = 2, kBias = 15;
  static constexpr uint8_t kMaxCode = 0x7b;
};

// float to fp8 Format, rounded to the nearest value (ties to the even
// code), saturated at the largest finite one (Inf too), NaN to 0x7f, by
// the float's bits. The same codes as a search of the format's sorted
// values (FloatToFp8E4M3BySearch, the tests' reference), at a fraction of
// the time (ReshapeAndCache into fp8 caches).
template <typename Format>
inline uint8_t FloatToFp8Bits(float f) {
  constexpr int kMan = Format::kMan, kBias = Format::kBias;
  const uint32_t u = FloatBits(f);
  const uint32_t a = u & 0x7fffffff;
  if (a > 0x7f800000) return 0x7f;  // NaN, unsigned as the search gives it
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  // The format's smallest normal, 2^(1 - kBias): below it the codes are
  // multiples of 2^(1 - kBias - kMan), which nearbyint rounds to even.
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - kBias) << 23;
  if (a < kMinNormal) {
    constexpr float kScale = static_cast<float>(1u << (kBias - 1 + kMan));
    return sign | static_cast<uint8_t>(std::nearbyint(BitsFloat(a) * kScale));
  }
  // Round the mantissa to kMan bits, to even, carrying into the exponent.
  constexpr int kDrop = 23 - kMan;
  const uint32_t r = a + ((1u << (kDrop - 1)) - 1) + ((a >> kDrop) & 1);
  const uint32_t code =
      (r >> kDrop) - (static_cast<uint32_t>(127 - kBias) << kMan);
  return sign | static_cast<uint8_t>(code > Format::kMaxCode ? Format::kMaxCode
                                                             : code);
}
inline uint8_t FloatToFp8E4M3(float f) {
  return FloatToFp8Bits<Fp8E4M3Format>(f);
}
inline uint8_t FloatToFp8E5M2(float f) {
  return FloatToFp8Bits<Fp8E5M2Format>(f);
}
// The same conversions by a binary search of the format's values: the
// reference FloatToFp8E4M3 and FloatToFp8E5M2 are tested against.
uint8_t FloatToFp8E4M3BySearch(float f);
uint8_t FloatToFp8E5M2BySearch(float f);

}  // namespace kvstep

#endif  // KVSTEP_CORE_FLOAT_CONVERT_H_
