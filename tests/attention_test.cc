// Paged attention against a plain fp64 reference computed from the logical
// K/V the test wrote (never from the cache's layout), over the grid of head
// sizes, block sizes, layouts, dtypes and GQA ratios; plus the element
// conversions and vLLM's raw cache layout.
#include "core/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "core/float_convert.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstep {
namespace {

using ::testing::HasSubstr;

TEST(FloatConvert, KnownEncodings) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);
  EXPECT_EQ(FloatToHalf(1.0f + 1.0f / 2048), 0x3c00);  // tie: to even
  EXPECT_EQ(FloatToHalf(1.0f + 3.0f / 2048), 0x3c02);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(FloatToBF16(1.0f), 0x3f80);
  EXPECT_EQ(BF16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToFp8E4M3(1.0f), 0x38);
  EXPECT_EQ(FloatToFp8E4M3(448.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(1000.0f), 0x7e);  // saturates at 448
  EXPECT_EQ(FloatToFp8E4M3(-1000.0f), 0xfe);
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(FloatToFp8E5M2(1.0f), 0x3c);
  EXPECT_EQ(Fp8E5M2ToFloat(0x7b), 57344.0f);
  EXPECT_EQ(FloatToFp8E5M2(1e9f), 0x7b);
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0xff)));
}

// The fp8 stores by bits give the codes of a search of the format's
// values: every float whose bits are a multiple of 61 (70 million, every
// exponent and sign), and every float of the format's range (exponents
// from below its smallest subnormal to above its largest value) whose low
// mantissa bits are one of the patterns a rounding decision turns on
// (exact ties, one either side, all ones). A run over every float of the
// 2^32 agreed when this was written (session 69).
TEST(FloatConvert, Fp8ByBitsMatchesTheSearch) {
  auto check = [](uint32_t u) {
    const float f = BitsFloat(u);
    ASSERT_EQ(FloatToFp8E4M3(f), FloatToFp8E4M3BySearch(f))
        << std::hex << "e4m3 of bits 0x" << u;
    ASSERT_EQ(FloatToFp8E5M2(f), FloatToFp8E5M2BySearch(f))
        << std::hex << "e5m2 of bits 0x" << u;
  };
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 61) {
    check(static_cast<uint32_t>(u));
    if (::testing::Test::HasFatalFailure()) return;
  }
  const uint32_t lows[] = {0, 1, 0x7ff, 0x800, 0x801, 0xfff};
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t exp = 127 - 30; exp <= 127 + 17; ++exp) {
      for (uint32_t top = 0; top < (1u << 11); ++top) {
        for (uint32_t low : lows) {
          check(sign | exp << 23 | top << 12 | low);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
}

// ReshapeAndCache's AVX-512 conversion into fp8 gives the scalar's codes
// (FloatToFp8E4M3 / E5M2 of the activation divided by the scale): fp32
// activations over a sample of every float and every rounding pattern, as
// above, at scale 1 and a scale that makes the division round; every fp16
// and bf16 value; runs whose length is not a multiple of 16.
TEST(FloatConvert, Fp8ByAvx512MatchesTheScalar) {
  const uint8_t probe_in[4] = {};
  uint8_t probe_out[2];
  if (!internal::ActivationsToFp8ForTest(DType::kFp8E4M3, DType::kBFloat16,
                                         probe_in, 2, 1.0f, probe_out)) {
    GTEST_SKIP() << "no AVX-512 here: ReshapeAndCache converts into fp8 by "
                    "the scalar code, which the test above covers";
  }
  auto check = [](DType act, const void* src, const float* values, int64_t n,
                  float scale) {
    std::vector<uint8_t> got(n + 1, 0xa5), want(n);
    for (DType cache : {DType::kFp8E4M3, DType::kFp8E5M2}) {
      ASSERT_TRUE(internal::ActivationsToFp8ForTest(cache, act, src, n, scale,
                                                    got.data()));
      for (int64_t i = 0; i < n; ++i) {
        want[i] = cache == DType::kFp8E4M3 ? FloatToFp8E4M3(values[i] / scale)
                                           : FloatToFp8E5M2(values[i] / scale);
      }
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[i], want[i])
            << DTypeName(cache) << " of " << DTypeName(act) << " bits 0x"
            << std::hex << FloatBits(values[i]) << std::dec << " / " << scale;
      }
      ASSERT_EQ(got[n], 0xa5) << "wrote past the end";
    }
  };
  // fp32: chunks of 4099 floats, each ending off a multiple of 16.
  std::vector<float> f;
  auto flush = [&](float scale) {
    check(DType::kFloat32, f.data(), f.data(), static_cast<int64_t>(f.size()),
          scale);
    f.clear();
  };
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 61) {
    f.push_back(BitsFloat(static_cast<uint32_t>(u)));
    if (f.size() == 4099) flush(1.0f);
    if (::testing::Test::HasFatalFailure()) return;
  }
  flush(1.0f);
  const uint32_t lows[] = {0, 1, 0x7ff, 0x800, 0x801, 0xfff};
  for (float scale : {1.0f, 0.37f}) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (uint32_t exp = 127 - 30; exp <= 127 + 17; ++exp) {
        for (uint32_t top = 0; top < (1u << 11); ++top) {
          for (uint32_t low : lows) {
            f.push_back(BitsFloat(sign | exp << 23 | top << 12 | low));
          }
        }
        flush(scale);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
  // Every fp16 and bf16 value, at three scales.
  std::vector<uint16_t> bits(1 << 16);
  std::vector<float> halves(1 << 16), bf16s(1 << 16);
  for (uint32_t h = 0; h < (1u << 16); ++h) {
    bits[h] = static_cast<uint16_t>(h);
    halves[h] = HalfToFloat(bits[h]);
    bf16s[h] = BF16ToFloat(bits[h]);
  }
  for (float scale : {1.0f, 0.37f, 3.0f}) {
    check(DType::kFloat16, bits.data(), halves.data(), 1 << 16, scale);
    check(DType::kBFloat16, bits.data(), bf16s.data(), 1 << 16, scale);
    check(DType::kFloat16, bits.data() + 5, halves.data() + 5, 27, scale);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(FloatConvert, RoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const float e4 = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
    if (std::isfinite(e4)) {
      EXPECT_EQ(Fp8E4M3ToFloat(FloatToFp8E4M3(e4)), e4) << c;
    }
    const float e5 = Fp8E5M2ToFloat(static_cast<uint8_t>(c));
    if (std::isfinite(e5)) {
      EXPECT_EQ(Fp8E5M2ToFloat(FloatToFp8E5M2(e5)), e5) << c;
    }
  }
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isfinite(f)) {
      ASSERT_EQ(HalfToFloat(FloatToHalf(f)), f) << h;
    }
  }
}

// The kernel's instruction-set builds this CPU runs (AVX-512, AVX2,
// portable): every test runs on each.
std::vector<AttentionParams::Isa> TestedIsas() {
  std::vector<AttentionParams::Isa> isas;
  for (auto isa : {AttentionParams::Isa::kAvx512, AttentionParams::Isa::kAvx2,
                   AttentionParams::Isa::kPortable}) {
    if (IsaSupported(isa)) isas.push_back(isa);
  }
  return isas;
}

// Says which builds the other tests cover here: a CPU without AVX-512
// (F, BW, VL, DQ, BF16) cannot run that build, and this test says so.
TEST(PagedAttention, Avx512BuildRunsHere) {
  if (!IsaSupported(AttentionParams::Isa::kAvx512)) {
    GTEST_SKIP() << "this CPU has no AVX-512 BF16: the AVX-512 kernel is "
                    "not tested on this machine";
  }
  EXPECT_EQ(BestIsa(), AttentionParams::Isa::kAvx512);
  EXPECT_EQ(TestedIsas().front(), AttentionParams::Isa::kAvx512);
}

// The softmax's exp in every instruction-set build: within FastExp's
// error of exp, exactly 0 at or below -87 and for NaN, and the same bits
// where the same arithmetic is used: AVX-512 (FastExpZ by VRNDSCALEPS and
// VSCALEFPS) and AVX2 (FastExp8 by integer exponents), both with FMAs,
// when clang builds them; the portable build and the scalar exp, both
// without. Over a sample of every 4099th non-positive float, the clamp at
// -87 and its neighbours, -Inf and NaN.
TEST(PagedAttention, VectorExpAgreesAcrossBuilds) {
  std::vector<float> x = {0.0f,
                          -0.0f,
                          -87.0f,
                          std::nextafter(-87.0f, 0.0f),
                          std::nextafter(-87.0f, -100.0f),
                          -86.5f,
                          -0.5f,
                          -20.0f,
                          -std::numeric_limits<float>::denorm_min(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()};
  for (uint64_t b = 0x80000000u; b <= 0xff800000u; b += 4099) {
    x.push_back(BitsFloat(static_cast<uint32_t>(b)));
  }
  while (x.size() % 16 != 0) x.push_back(-1.0f);
  const int64_t n = static_cast<int64_t>(x.size());
  std::map<AttentionParams::Isa, std::vector<float>> out;
  for (const auto isa : TestedIsas()) {
    std::vector<float>& o = out[isa];
    o.resize(x.size());
    internal::ExpForTest(isa, x.data(), n, o.data());
    for (size_t i = 0; i < x.size(); ++i) {
      if (!(x[i] > -87.0f)) {  // NaN too
        ASSERT_EQ(FloatBits(o[i]), 0u)
            << IsaName(isa) << " exp(" << x[i] << ")";
        continue;
      }
      const double want = std::exp(static_cast<double>(x[i]));
      // FastExp's bound: 2e-7 near 0, and the float rounding of x log2(e)
      // on top (measured up to 3.8e-6 at -86.4).
      ASSERT_NEAR(o[i], want, (3e-7 - 8e-8 * x[i]) * want)
          << IsaName(isa) << " exp(" << x[i] << ")";
    }
  }
  using Isa = AttentionParams::Isa;
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(FloatBits(out[Isa::kPortable][i]),
              FloatBits(internal::ScalarExpForTest(x[i])))
        << "portable exp(" << x[i] << ")";
#if defined(__clang__)
    // clang fuses a multiply and an add into an FMA only within one
    // expression, which both vector exps write alike; GCC fuses across
    // statements too (-ffp-contract=fast), differently in the two, so
    // there only the bound above holds.
    if (out.count(Isa::kAvx512) != 0 && out.count(Isa::kAvx2) != 0) {
      ASSERT_EQ(FloatBits(out[Isa::kAvx512][i]), FloatBits(out[Isa::kAvx2][i]))
          << "exp(" << x[i] << ")";
    }
#endif
  }
}

// The kernel's vector conversions (every instruction-set build) against
// the scalar decoders, over every fp16, bf16 and fp8 code.
TEST(FloatConvert, KernelConversionsMatchTheScalarDecoders) {
  std::vector<uint16_t> h(0x10000);
  for (uint32_t i = 0; i < 0x10000; ++i) h[i] = static_cast<uint16_t>(i);
  std::vector<uint8_t> b(256);
  for (int i = 0; i < 256; ++i) b[i] = static_cast<uint8_t>(i);
  auto same = [](float got, float want) {
    return std::isnan(want) ? std::isnan(got)
                            : FloatBits(got) == FloatBits(want);
  };
  for (auto isa : TestedIsas()) {
    std::vector<float> out(0x10000);
    internal::ConvertCacheElements(DType::kFloat16, h.data(), 0x10000, 1, isa,
                                   out.data());
    for (uint32_t i = 0; i < 0x10000; ++i) {
      ASSERT_TRUE(same(out[i], HalfToFloat(h[i]))) << "fp16 " << i;
    }
    internal::ConvertCacheElements(DType::kBFloat16, h.data(), 0x10000, 1, isa,
                                   out.data());
    for (uint32_t i = 0; i < 0x10000; ++i) {
      ASSERT_TRUE(same(out[i], BF16ToFloat(h[i]))) << "bf16 " << i;
    }
    for (float scale : {1.0f, 0.02f}) {
      internal::ConvertCacheElements(DType::kFp8E4M3, b.data(), 256, scale, isa,
                                     out.data());
      for (int i = 0; i < 256; ++i) {
        ASSERT_TRUE(same(out[i], Fp8E4M3ToFloat(b[i]) * scale)) << "e4m3 " << i;
      }
      internal::ConvertCacheElements(DType::kFp8E5M2, b.data(), 256, scale, isa,
                                     out.data());
      for (int i = 0; i < 256; ++i) {
        ASSERT_TRUE(same(out[i], Fp8E5M2ToFloat(b[i]) * scale)) << "e5m2 " << i;
      }
    }
  }
}

// The AVX-512 build reads fp16 keys and values by pairs, with integer ops
// that leave each half's bits as a float 2^112 times smaller: exact for
// every finite code (subnormals and -0 included), and Inf and NaN, which
// that would turn finite, are flagged wherever they sit among 32 halves.
TEST(FloatConvert, Avx512HalfPairsAreExactAndFlagInfAndNan) {
  if (!IsaSupported(AttentionParams::Isa::kAvx512)) {
    GTEST_SKIP() << "no AVX-512 on this CPU: the split is not built for it";
  }
  std::vector<uint16_t> finite, special;
  for (uint32_t i = 0; i < 0x10000; ++i) {
    ((i & 0x7c00) == 0x7c00 ? special : finite)
        .push_back(static_cast<uint16_t>(i));
  }
  ASSERT_EQ(special.size(), 2048u);
  finite.resize((finite.size() + 31) / 32 * 32, 0);
  std::vector<float> out(finite.size());
  EXPECT_TRUE(
      internal::SplitHalvesForTest(finite.data(), finite.size(), out.data()));
  for (size_t i = 0; i < finite.size(); ++i) {
    ASSERT_EQ(FloatBits(out[i]), FloatBits(HalfToFloat(finite[i])))
        << "fp16 " << finite[i];
  }
  std::vector<uint16_t> unit(32);
  for (size_t i = 0; i < special.size(); ++i) {
    std::fill(unit.begin(), unit.end(), FloatToHalf(-1.5f));
    unit[i % 32] = special[i];  // every position, even and odd
    EXPECT_FALSE(internal::SplitHalvesForTest(unit.data(), 32, out.data()))
        << "fp16 " << special[i] << " at " << i % 32;
  }
}

// The AMX passes take an fp16 element (query, key or value) as two bf16
// parts and an fp32 query element as three, whose sum is the element
// exactly: every finite fp16 code, and fp32 values of random mantissas
// over exponents -90 to 90 (below bf16's normal range a part would be
// flushed). Inf and NaN stay in the first part, the others 0.
// The fp8 VDPBF16PS pass's byte lookups (Fp8ToBf16Z) over every byte of
// both fp8 formats, each at every position of a 64-byte load: the bf16
// bits of the byte's exact value (subnormals included: a flushed or
// misplaced one would move a logit by far less than the attention tests
// resolve), NaN for NaN and Inf for Inf.
TEST(FloatConvert, Fp8BytesToBf16ExactlyForTheDotPass) {
  if (!Fp8DotSupported()) {
    GTEST_SKIP() << "this CPU lacks AVX-512 BF16 or VBMI: the fp8 keys take "
                    "the converting pass, which the other tests check";
  }
  for (DType dtype : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    SCOPED_TRACE(DTypeName(dtype));
    // Every byte at every position of a 64-byte load, over 64 shifts.
    for (int shift = 0; shift < 64; ++shift) {
      std::vector<uint8_t> src(256);
      for (int i = 0; i < 256; ++i) src[i] = static_cast<uint8_t>(i + shift);
      std::vector<uint16_t> out(256, 0x1234);
      ASSERT_TRUE(
          internal::Fp8ToBf16ForTest(dtype, src.data(), 256, out.data()));
      for (int i = 0; i < 256; ++i) {
        const float want = dtype == DType::kFp8E4M3 ? Fp8E4M3ToFloat(src[i])
                                                    : Fp8E5M2ToFloat(src[i]);
        const float got = BF16ToFloat(out[i]);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(got)) << "byte " << int{src[i]};
        } else {
          ASSERT_EQ(got, want) << "byte " << int{src[i]} << " at " << i;
          // Zero keeps its sign too.
          ASSERT_EQ(std::signbit(got), std::signbit(want)) << int{src[i]};
        }
      }
    }
  }
  const uint8_t bytes[64] = {};
  uint16_t out[64];
  EXPECT_FALSE(internal::Fp8ToBf16ForTest(DType::kBFloat16, bytes, 64, out));
}

TEST(FloatConvert, AmxPartsSumToTheElementExactly) {
  if (!IsaSupported(AttentionParams::Isa::kAvx512)) {
    GTEST_SKIP() << "no AVX-512 BF16 on this CPU: the split does not run here";
  }
  const auto check = [](DType dtype, const void* src, int64_t n,
                        const std::vector<double>& want) {
    std::vector<uint16_t> parts(3 * n);
    const int64_t np =
        internal::AmxQueryPartsForTest(dtype, src, n, parts.data());
    ASSERT_EQ(np, dtype == DType::kFloat16 ? 2 : 3);
    for (int64_t i = 0; i < n; ++i) {
      double sum = 0;
      for (int64_t p = 0; p < np; ++p) sum += BF16ToFloat(parts[p * n + i]);
      if (std::isfinite(want[i])) {
        ASSERT_EQ(sum, want[i]) << DTypeName(dtype) << " element " << i;
      } else {
        const float hi = BF16ToFloat(parts[i]);
        ASSERT_EQ(std::isnan(hi), std::isnan(want[i])) << i;
        if (!std::isnan(want[i])) {
          ASSERT_EQ(hi, want[i]) << i;
        }
        for (int64_t p = 1; p < np; ++p) ASSERT_EQ(parts[p * n + i], 0) << i;
      }
    }
  };
  std::vector<uint16_t> halves(0x10000);
  std::vector<double> want(halves.size());
  for (uint32_t i = 0; i < 0x10000; ++i) {
    halves[i] = static_cast<uint16_t>(i);
    want[i] = HalfToFloat(halves[i]);
  }
  check(DType::kFloat16, halves.data(), 0x10000, want);
  std::mt19937_64 rng(7);
  std::vector<float> floats(4096);
  want.resize(floats.size());
  for (size_t i = 0; i < floats.size(); ++i) {
    const float m = std::uniform_real_distribution<float>(1, 2)(rng);
    const int e = std::uniform_int_distribution<int>(-90, 90)(rng);
    floats[i] = std::ldexp(i % 2 ? -m : m, e);
    want[i] = floats[i];
  }
  floats[5] = want[5] = std::numeric_limits<float>::infinity();
  floats[6] = want[6] = std::nanf("");
  check(DType::kFloat32, floats.data(), 4096, want);
}

float Quantize(DType d, float v, float scale) {
  switch (d) {
    case DType::kFloat16:
      return HalfToFloat(FloatToHalf(v));
    case DType::kBFloat16:
      return BF16ToFloat(FloatToBF16(v));
    case DType::kFp8E4M3:
      return Fp8E4M3ToFloat(FloatToFp8E4M3(v / scale)) * scale;
    case DType::kFp8E5M2:
      return Fp8E5M2ToFloat(FloatToFp8E5M2(v / scale)) * scale;
    default:
      return v;
  }
}

Tensor Activations(DType d, Shape shape, const std::vector<float>& v) {
  Tensor t = *Tensor::Zeros(CpuDevice(), d, std::move(shape));
  for (size_t i = 0; i < v.size(); ++i) {
    if (d == DType::kFloat32) {
      t.data<float>()[i] = v[i];
    } else if (d == DType::kFloat16) {
      static_cast<uint16_t*>(t.raw_data())[i] = FloatToHalf(v[i]);
    } else {
      static_cast<uint16_t*>(t.raw_data())[i] = FloatToBF16(v[i]);
    }
  }
  return t;
}

float Act(const Tensor& t, int64_t i) {
  if (t.dtype() == DType::kFloat32) return t.data<float>()[i];
  const uint16_t v = static_cast<const uint16_t*>(t.raw_data())[i];
  return t.dtype() == DType::kFloat16 ? HalfToFloat(v) : BF16ToFloat(v);
}

// A cache of `layers` layers (vLLM layout unless `layout` says otherwise):
// num_blocks blocks of bs slots, kv KV heads of head size d, in `dtype`.
std::unique_ptr<KvCache> SmallCache(DType dtype, int64_t num_blocks, int64_t bs,
                                    int64_t kv, int64_t d, int64_t layers = 1,
                                    CacheLayout layout = CacheLayout::kVllm) {
  CacheConfig c;
  c.layout = layout;
  c.num_blocks = num_blocks;
  c.block_size = bs;
  c.num_layers = layers;
  c.num_kv_heads = kv;
  c.head_size = d;
  c.dtype = dtype;
  return *KvCache::Create(c, CpuDevice());
}

// A tensor's bytes, for tests that compare outputs bit for bit.
std::vector<uint8_t> TensorBytes(const Tensor& t) {
  const auto* b = static_cast<const uint8_t*>(t.raw_data());
  return std::vector<uint8_t>(b, b + t.nbytes());
}

// Fills a bf16 cache's keys and values (every layer) with values from
// [-1, 1).
void FillBf16Cache(KvCache& cache, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> uni(-1, 1);
  for (int64_t l = 0; l < cache.config().num_layers; ++l) {
    for (const Tensor* t : {&cache.key(l), &cache.value(l)}) {
      auto* raw = static_cast<uint16_t*>(t->raw_data());
      for (size_t i = 0; i < t->nbytes() / 2; ++i) {
        raw[i] = FloatToBF16(uni(rng));
      }
    }
  }
}

// One decode row of n tokens whose block table is `table`.
AttentionRows OneDecodeRow(int64_t n, std::vector<int64_t> table) {
  AttentionRows rows;
  rows.num_real = 1;
  rows.width = static_cast<int64_t>(table.size());
  rows.query_start = {0, 1};
  rows.seq_lens = {n};
  rows.block_tables = std::move(table);
  return rows;
}

// `batch` decode rows of `keys` tokens each; row r's table holds blocks
// r * width .. r * width + width - 1 (width: keys / bs, rounded up).
AttentionRows DecodeRows(int64_t batch, int64_t keys, int64_t bs) {
  AttentionRows rows;
  rows.num_real = batch;
  rows.width = (keys + bs - 1) / bs;
  for (int64_t r = 0; r <= batch; ++r) rows.query_start.push_back(r);
  rows.seq_lens.assign(batch, keys);
  rows.block_tables.resize(rows.width * batch);
  std::iota(rows.block_tables.begin(), rows.block_tables.end(), 0);
  return rows;
}

// Layer 0's keys and values of an fp8 e4m3 cache as random finite bytes
// (e4m3's NaN, 0x7f and 0xff, moved to its neighbour).
void FillFiniteE4m3(KvCache& cache, std::mt19937_64& rng) {
  for (const Tensor* t : {&cache.key(0), &cache.value(0)}) {
    auto* b = static_cast<uint8_t*>(t->raw_data());
    for (size_t i = 0; i < t->nbytes(); ++i) {
      b[i] = static_cast<uint8_t>(rng());
      if ((b[i] & 0x7f) == 0x7f) b[i] ^= 1;
    }
  }
}

// The slots of row r's seq_lens[r] positions, through its block table.
std::vector<int64_t> RowSlots(const AttentionRows& rows, int64_t r,
                              int64_t bs) {
  std::vector<int64_t> slots(rows.seq_lens[r]);
  for (int64_t p = 0; p < rows.seq_lens[r]; ++p) {
    slots[p] = rows.block_tables[r * rows.width + p / bs] * bs + p % bs;
  }
  return slots;
}

struct Case {
  int64_t head_size = 64, block_size = 16, heads = 4, kv_heads = 4;
  DType cache = DType::kFloat32, act = DType::kFloat32;
  CacheLayout layout = CacheLayout::kVllm;
  bool alibi = false;
  int64_t window = 0;
  int64_t context = 37;  // row 0's decode context
  // Row 1: a prefill chunk of prefill_tokens ending at prefill_context.
  int64_t prefill_context = 23, prefill_tokens = 5;
  uint64_t seed = 1;
  AttentionParams::Prefetch prefetch = AttentionParams::Prefetch::kAuto;
  AttentionParams::Bf16Keys bf16_keys = AttentionParams::Bf16Keys::kAuto;
  // Whether the cache's layers are flagged as possibly holding Inf or NaN
  // (KvCache::NoteNonFinite), so that the fp16 and fp8 passes check what
  // they read; the values stay finite either way.
  bool flagged = false;
  int64_t touch_min_bytes = AttentionParams().touch_min_bytes;
  int64_t touch_min_blocks = AttentionParams().touch_min_blocks;
  bool amx = true;       // AttentionParams::amx
  bool nhd_rows = true;  // AttentionParams::nhd_rows
  // AttentionParams::vllm_rows: true is kOn, so that the sweeps run the
  // row passes wherever the kernel's gates admit them on any CPU (what
  // kAuto takes on this one: VllmRowsAutoTakesThisCpusChoice); false kOff.
  bool vllm_rows = true;
  bool prefetch_l2 = true;  // AttentionParams::prefetch_l2
  // AttentionParams::fp8_dot: true is kOn, so that the sweeps run the fp8
  // VDPBF16PS passes wherever the CPU has them (what kAuto takes on this
  // one: Fp8DotAutoTakesThisCpusChoice); false kOff.
  bool fp8_dot = true;
  double scale = 0;  // AttentionParams::scale (0: 1 / sqrt(head_size))
  // 2: a pool of two threads, used for any call (parallel_min_bytes 0);
  // 1: the caller alone.
  int threads = 2;
};

Case Make(CacheLayout layout, DType cache, DType act, int64_t heads,
          int64_t kv_heads) {
  Case k;
  k.layout = layout;
  k.cache = cache;
  k.act = act;
  k.heads = heads;
  k.kv_heads = kv_heads;
  return k;
}

// The fp64 attention of query token qi's head h (of H heads over KV KV
// heads; query [tokens][H][D]) over keys [lo, pos] of a row whose K/V, as
// the cache stores them, are K and V [keys][KV][D], with ALiBi's slope
// where `slope` is given: adds the head's D outputs to out.
void ReferenceHead(const Tensor& query, int64_t qi, int64_t h, int64_t H,
                   int64_t KV, const std::vector<float>& K,
                   const std::vector<float>& V, int64_t lo, int64_t pos,
                   double scale, const float* slope, double* out) {
  const int64_t D = query.dim(2), kvh = h / (H / KV);
  std::vector<double> logit;
  for (int64_t j = lo; j <= pos; ++j) {
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) {
      dot += static_cast<double>(Act(query, (qi * H + h) * D + d)) *
             K[(j * KV + kvh) * D + d];
    }
    double l = scale * dot;
    if (slope != nullptr) l += *slope * static_cast<double>(j - pos);
    logit.push_back(l);
  }
  const double m = *std::max_element(logit.begin(), logit.end());
  double sum = 0;
  for (double& l : logit) sum += (l = std::exp(l - m));
  for (int64_t j = lo; j <= pos; ++j) {
    for (int64_t d = 0; d < D; ++d) {
      out[d] += logit[j - lo] / sum * V[(j * KV + kvh) * D + d];
    }
  }
}

// Builds a cache and a batch (two decode rows, one prefill chunk, one
// padding row), writes every cached position through ReshapeAndCache, and
// checks both kernels against the fp64 reference.
void Check(const Case& k) {
  SCOPED_TRACE(::testing::Message()
               << "head " << k.head_size << " block " << k.block_size
               << " heads " << k.heads << "/" << k.kv_heads << " cache "
               << DTypeName(k.cache) << " act " << DTypeName(k.act)
               << " layout " << CacheLayoutName(k.layout) << " alibi "
               << k.alibi << " window " << k.window << " prefetch "
               << PrefetchName(k.prefetch) << " bf16 keys "
               << static_cast<int>(k.bf16_keys));
  std::mt19937_64 rng(k.seed);
  std::uniform_real_distribution<float> uni(-1, 1);
  // Rows: decode, prefill chunk after a cached context, decode at a block
  // boundary, padding.
  const std::vector<int64_t> lens = {k.context, k.prefill_context,
                                     2 * k.block_size + 1, 1};
  const std::vector<int64_t> qlens = {1, k.prefill_tokens, 1, 1};
  const int64_t width =
      (*std::max_element(lens.begin(), lens.end()) + k.block_size - 1) /
          k.block_size +
      1;
  CacheConfig c;
  c.num_blocks = 3 * width + 4;
  c.block_size = k.block_size;
  c.num_layers = 2;
  c.num_kv_heads = k.kv_heads;
  c.head_size = k.head_size;
  c.dtype = k.cache;
  c.layout = k.layout;
  auto cache = *KvCache::Create(c, CpuDevice());
  // Unwritten slots hold NaN in every dtype: the output must not see them.
  for (int64_t l = 0; l < 2; ++l) {
    std::memset(cache->key(l).raw_data(), 0xff, cache->key(l).nbytes());
    std::memset(cache->value(l).raw_data(), 0xff, cache->value(l).nbytes());
    if (k.flagged) cache->NoteNonFinite(l);
  }
  const bool fp8 = k.cache == DType::kFp8E4M3 || k.cache == DType::kFp8E5M2;
  const float kscale = fp8 ? 0.02f : 1.0f, vscale = fp8 ? 0.03f : 1.0f;
  const int64_t layer = 1, D = k.head_size, H = k.heads, KV = k.kv_heads;

  AttentionRows rows;
  rows.num_real = 3;
  rows.width = width;
  rows.query_start = {0};
  for (int64_t q : qlens)
    rows.query_start.push_back(rows.query_start.back() + q);
  rows.seq_lens = lens;
  std::vector<int64_t> perm(c.num_blocks);
  for (int64_t i = 0; i < c.num_blocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  rows.block_tables.assign(4 * rows.width, 0);
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t j = 0; j < rows.width; ++j) {
      rows.block_tables[r * rows.width + j] = perm[r * rows.width + j];
    }
  }
  // Logical K/V of every cached position, quantized as the cache stores it.
  std::vector<std::vector<float>> K(3), V(3);
  for (int64_t r = 0; r < 3; ++r) {
    const int64_t n = lens[r] * KV * D;
    std::vector<float> kraw(n), vraw(n);
    for (float& x : kraw) x = uni(rng);
    for (float& x : vraw) x = uni(rng);
    const std::vector<int64_t> slots = RowSlots(rows, r, k.block_size);
    const Tensor kt = Activations(k.act, {lens[r], KV, D}, kraw);
    const Tensor vt = Activations(k.act, {lens[r], KV, D}, vraw);
    ASSERT_TRUE(
        ReshapeAndCache(*cache, layer, kt, vt, slots, kscale, vscale).ok());
    K[r].resize(n);
    V[r].resize(n);
    for (int64_t i = 0; i < n; ++i) {
      K[r][i] = Quantize(k.cache, Act(kt, i), kscale);
      V[r][i] = Quantize(k.cache, Act(vt, i), vscale);
    }
  }
  const int64_t T = rows.query_start.back();
  std::vector<float> qraw(T * H * D);
  for (float& x : qraw) x = uni(rng);
  const Tensor query = Activations(k.act, {T, H, D}, qraw);

  AttentionParams p;
  p.k_scale = kscale;
  p.v_scale = vscale;
  p.sliding_window = k.window;
  p.touch_min_bytes = k.touch_min_bytes;
  p.touch_min_blocks = k.touch_min_blocks;
  p.prefetch = k.prefetch;
  p.bf16_keys = k.bf16_keys;
  p.amx = k.amx;
  p.nhd_rows = k.nhd_rows;
  p.vllm_rows = k.vllm_rows ? AttentionParams::VllmRows::kOn
                            : AttentionParams::VllmRows::kOff;
  p.prefetch_l2 = k.prefetch_l2;
  p.fp8_dot =
      k.fp8_dot ? AttentionParams::Fp8Dot::kOn : AttentionParams::Fp8Dot::kOff;
  if (k.alibi) {
    for (int64_t h = 0; h < H; ++h)
      p.alibi_slopes.push_back(std::pow(2.0f, -(h + 1)));
  }
  p.scale = k.scale;
  const double scale =
      k.scale > 0 ? k.scale : 1.0 / std::sqrt(static_cast<double>(D));

  // The reference, in fp64.
  std::vector<double> ref(T * H * D, 0.0);
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t t = 0; t < qlens[r]; ++t) {
      const int64_t qi = rows.query_start[r] + t;
      const int64_t pos = lens[r] - qlens[r] + t;
      const int64_t lo =
          k.window > 0 ? std::max<int64_t>(0, pos - k.window + 1) : 0;
      for (int64_t h = 0; h < H; ++h) {
        ReferenceHead(query, qi, h, H, KV, K[r], V[r], lo, pos, scale,
                      k.alibi ? &p.alibi_slopes[h] : nullptr,
                      &ref[(qi * H + h) * D]);
      }
    }
  }

  ThreadPool pool(2);
  std::vector<std::pair<AttentionParams::Kernel, AttentionParams::Isa>> runs;
  for (auto isa : TestedIsas()) {
    for (auto kernel : {AttentionParams::Kernel::kSinglePass,
                        AttentionParams::Kernel::kPartitioned}) {
      runs.emplace_back(kernel, isa);
    }
  }
  for (auto [kernel, isa] : runs) {
    p.kernel = kernel;
    p.isa = isa;
    p.partition_size = 16;     // several partitions even for short contexts
    p.parallel_min_bytes = 0;  // both threads, however small the call
    Tensor out;
    absl::Status s = PagedAttention(*cache, layer, query, rows, p,
                                    k.threads == 2 ? &pool : nullptr, &out);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(out.dtype(), k.act);
    // vLLM's tolerances (atol 1e-3, rtol 1e-5; fp8 atol 1e-2) on the fp32
    // computation, plus half an ulp of the output dtype for fp16 and bf16
    // outputs: the kernel rounds its fp32 result once to that dtype.
    const double atol = fp8 ? 1e-2 : 1e-3;
    const double ulp = k.act == DType::kFloat16    ? std::ldexp(1.0, -10)
                       : k.act == DType::kBFloat16 ? std::ldexp(1.0, -7)
                                                   : 0.0;
    for (int64_t i = 0; i < T * H * D; ++i) {
      const double got = Act(out, i);
      ASSERT_TRUE(std::isfinite(got)) << "element " << i;
      const double want = i >= rows.query_start[3] * H * D ? 0.0 : ref[i];
      ASSERT_NEAR(got, want,
                  atol + 1e-5 * std::fabs(want) + ulp * std::fabs(want))
          << "element " << i << " kernel " << static_cast<int>(kernel)
          << " isa " << IsaName(isa);
    }
  }
}

TEST(PagedAttention, HeadSizesBlockSizesLayoutsFp32) {
  for (int64_t hs : {32, 64, 80, 96, 112, 120, 128, 192, 256}) {
    for (int64_t bs : {8, 16, 32}) {
      for (CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
        Case k;
        k.head_size = hs;
        k.block_size = bs;
        k.layout = layout;
        k.heads = 2;
        k.kv_heads = 2;
        k.seed = hs * 100 + bs;
        Check(k);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// bf16 in the NHD layout: head sizes in steps of 32 take the AVX-512
// passes that split each 32 dims into even and odd ones (whole 64-dim
// tiles and a 32-dim tail: 96, and 32 alone), the others widen (80, 112,
// 120); GQA 4 and MHA, whose tiles repeat heads.
TEST(PagedAttention, NhdBf16HeadSizes) {
  for (int64_t hs : {32, 64, 96, 192, 256, 80, 112, 120}) {
    for (int64_t bs : {16, 32}) {
      for (auto [heads, kv] : {std::pair<int64_t, int64_t>{8, 2}, {4, 4}}) {
        Case k = Make(CacheLayout::kNhd, DType::kBFloat16, DType::kBFloat16,
                      heads, kv);
        k.head_size = hs;
        k.block_size = bs;
        k.seed = hs * 100 + bs + heads;
        Check(k);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// A cache dtype and the activations' (query, key, value, output).
struct Dtypes {
  DType cache, act;
};

TEST(PagedAttention, DtypesAndGqaRatios) {
  const Dtypes dtypes[] = {{DType::kFloat32, DType::kFloat32},
                           {DType::kFloat16, DType::kFloat16},
                           {DType::kBFloat16, DType::kBFloat16},
                           {DType::kFp8E4M3, DType::kFloat16},
                           {DType::kFp8E5M2, DType::kBFloat16}};
  for (const Dtypes& d : dtypes) {
    for (auto [heads, kv] :
         {std::pair<int64_t, int64_t>{8, 8}, {8, 2}, {8, 1}}) {
      for (CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
        Case k = Make(layout, d.cache, d.act, heads, kv);
        k.head_size = 128;
        Check(k);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Every prefetch hint (the AVX-512 build's 16-lane passes take it; the
// other builds run the same cases) against the reference: a hint must
// change timing only. kT0 with and without the second prefetch into L2
// (prefetch_l2, which the 16-bit passes add to kT0), through decode rows
// and per-head items, whose prefetches two and three slices or sweeps
// ahead must stay within each row's blocks. And kAuto resolves to a hint,
// by this CPU, the cache dtype and the layout; the NHD layout and fp32 and
// fp8 caches take the vendor's (prefetcht0 on AMD, prefetcht1 elsewhere).
TEST(PagedAttention, EveryPrefetchHint) {
  const AttentionParams::Prefetch vendor =
      BestPrefetch(DType::kFloat32, CacheLayout::kVllm);
  for (const DType cache : {DType::kBFloat16, DType::kFloat16, DType::kFloat32,
                            DType::kFp8E4M3, DType::kFp8E5M2}) {
    for (const CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
      const AttentionParams::Prefetch best = BestPrefetch(cache, layout);
      EXPECT_NE(best, AttentionParams::Prefetch::kAuto);
      EXPECT_STRNE(PrefetchName(best),
                   PrefetchName(AttentionParams::Prefetch::kAuto));
      if (layout == CacheLayout::kNhd || DTypeSize(cache) != 2) {
        EXPECT_EQ(best, vendor) << DTypeName(cache);
      }
    }
  }
  const Dtypes dtypes[] = {{DType::kBFloat16, DType::kBFloat16},
                           {DType::kFloat16, DType::kFloat16},
                           {DType::kFloat32, DType::kFloat32}};
  for (auto hint :
       {AttentionParams::Prefetch::kNta, AttentionParams::Prefetch::kT0,
        AttentionParams::Prefetch::kT1}) {
    for (const Dtypes& d : dtypes) {
      for (const bool l2 : {true, false}) {
        for (const bool rows : {true, false}) {
          if (hint != AttentionParams::Prefetch::kT0 && !(l2 && rows)) {
            continue;
          }
          Case k = Make(CacheLayout::kVllm, d.cache, d.act, 8, 2);
          k.head_size = 128;
          k.context = 100;  // several sweeps and prefetches ahead
          k.prefetch = hint;
          k.prefetch_l2 = l2;
          k.vllm_rows = rows;
          if (rows) k.prefill_tokens = 1;  // every row decodes: row items
          SCOPED_TRACE(testing::Message() << "l2 " << l2 << " rows " << rows);
          Check(k);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// The 16-lane K passes' prefetch of the slice ahead, split among a block's
// tiles of 16 or 8 tokens (KeyTilePrefetchLines): whatever part of a block is
// in range, the tiles that run must name every line of each key chunk of the
// next slice exactly once (spread), or the first tile all of them (burst,
// fp32), and never a line outside the chunk. A gap would leave lines to be
// fetched on demand and an overlap prefetch twice: neither changes a
// result, so only this test sees it.
TEST(PagedAttention, KeyTilesPrefetchEveryLineOfTheNextSliceOnce) {
  for (const int64_t tile : {16, 8}) {
    for (const int64_t bs : {8, 16, 32}) {
      const int64_t lines = bs / 4;
      for (const bool burst : {false, true}) {
        for (int64_t t0 = 0; t0 < bs; ++t0) {
          for (int64_t t1 = t0 + 1; t1 <= bs; ++t1) {
            SCOPED_TRACE(testing::Message()
                         << "tile " << tile << " bs " << bs << " burst "
                         << burst << " tokens [" << t0 << ", " << t1 << ")");
            const int64_t first = t0 / tile * tile;
            std::vector<int> named(lines, 0);
            int tiles = 0;
            for (int64_t tb = first; tb < t1; tb += tile) {
              int64_t l0 = -1, l1 = -1;
              if (!internal::KeyTilePrefetchLinesForTest(bs, burst, tb, first,
                                                         t1, tile, &l0, &l1)) {
                continue;
              }
              ++tiles;
              ASSERT_GE(l0, 0);
              ASSERT_LE(l0, l1);
              ASSERT_LE(l1, lines);
              for (int64_t l = l0; l < l1; ++l) ++named[l];
            }
            EXPECT_EQ(named, std::vector<int>(lines, 1));
            if (burst) {
              EXPECT_EQ(tiles, 1);
            }
          }
        }
      }
    }
  }
}

// Both ways of the AVX-512 K pass with bf16 keys and a bf16 query
// (VDPBF16PS, or widened keys against the fp32 query; the other builds run
// the same cases) against the reference, at block sizes whose key tiles are
// 16 tokens (16) and 8 (8), with a partial last block; and kAuto resolves
// to one of them.
TEST(PagedAttention, Bf16KeysByDotProductsAndWidened) {
  EXPECT_NE(BestBf16Keys(), AttentionParams::Bf16Keys::kAuto);
  for (auto keys :
       {AttentionParams::Bf16Keys::kDot, AttentionParams::Bf16Keys::kWiden}) {
    for (int64_t bs : {8, 16}) {
      Case k =
          Make(CacheLayout::kVllm, DType::kBFloat16, DType::kBFloat16, 8, 2);
      k.head_size = 128;
      k.block_size = bs;
      k.context = 70;
      k.bf16_keys = keys;
      Check(k);
      if (HasFatalFailure()) return;
    }
  }
}

// Bf16KeysAutoByCallKind in one layout.
void Bf16KeysAutoByCallKindIn(CacheLayout layout) {
  const int64_t n = 300, D = 128, H = 8, KV = 2, bs = 16;
  const int64_t width = (n + bs - 1) / bs;
  auto cache = SmallCache(DType::kBFloat16, width + 1, bs, KV, D, 1, layout);
  std::mt19937_64 rng(39);
  std::uniform_real_distribution<float> uni(-1, 1);
  std::vector<float> kraw(n * KV * D), vraw(n * KV * D), qraw(40 * H * D);
  for (auto* v : {&kraw, &vraw, &qraw}) {
    for (float& x : *v) x = uni(rng);
  }
  std::vector<int64_t> table(width);
  std::iota(table.begin(), table.end(), 1);
  std::shuffle(table.begin(), table.end(), rng);
  AttentionRows rows = OneDecodeRow(n, table);
  ASSERT_TRUE(ReshapeAndCache(*cache, 0,
                              Activations(DType::kFloat32, {n, KV, D}, kraw),
                              Activations(DType::kFloat32, {n, KV, D}, vraw),
                              RowSlots(rows, 0, bs), 1, 1)
                  .ok());
  const bool nhd = layout == CacheLayout::kNhd;
  for (int64_t ntok : {1, 32, 40}) {
    SCOPED_TRACE(::testing::Message() << "query tokens " << ntok);
    rows.query_start = {0, ntok};
    const Tensor q = Activations(
        DType::kBFloat16, {ntok, H, D},
        std::vector<float>(qraw.begin(), qraw.begin() + ntok * H * D));
    // NHD chunks take kAuto's choice for chunks in rows of more than two
    // chunks' tokens (32) only, and are widened otherwise.
    const bool dot =
        ntok == 1 ? BestBf16Keys() == AttentionParams::Bf16Keys::kDot
                  : (!nhd || ntok > 32) && BestBf16Keys(/*chunks=*/true) ==
                                               AttentionParams::Bf16Keys::kDot;
    std::vector<uint8_t> out[3];
    const AttentionParams::Bf16Keys keys[3] = {
        AttentionParams::Bf16Keys::kAuto, AttentionParams::Bf16Keys::kDot,
        AttentionParams::Bf16Keys::kWiden};
    for (int k = 0; k < 3; ++k) {
      AttentionParams p;
      p.isa = AttentionParams::Isa::kAvx512;
      p.bf16_keys = keys[k];
      p.nhd_rows = false;  // NHD: every call by items per KV head
      // The FMA passes' choice: where the CPU has AMX, vLLM-layout bf16
      // prefill chunks take AMX tiles before either (tested on their own).
      p.amx = false;
      const int64_t before = internal::Bf16DotKeyPasses();
      Tensor o;
      ASSERT_TRUE(PagedAttention(*cache, 0, q, rows, p, nullptr, &o).ok());
      const bool by_dot = k == 1 || (k == 0 && dot);
      EXPECT_EQ(internal::Bf16DotKeyPasses() > before, by_dot) << "keys " << k;
      const auto* b = static_cast<const uint8_t*>(o.raw_data());
      out[k].assign(b, b + o.nbytes());
    }
    EXPECT_TRUE(out[0] == out[dot ? 1 : 2]);
  }
}

// kAuto takes BestBf16Keys' choice for decode rows and BestBf16Keys(true)'s
// for prefill chunks (VDPBF16PS on AMD, where the products bound the pass),
// in both layouts (NHD by items per KV head, for chunks of rows longer than
// two chunks only): the K passes by VDPBF16PS are counted, and kAuto's
// outputs are bit for bit those of the choice.
TEST(PagedAttention, Bf16KeysAutoByCallKind) {
  EXPECT_NE(BestBf16Keys(/*chunks=*/true), AttentionParams::Bf16Keys::kAuto);
  if (!IsaSupported(AttentionParams::Isa::kAvx512)) {
    GTEST_SKIP() << "no AVX-512 on this CPU: the bf16 key passes by "
                    "VDPBF16PS are part of the AVX-512 build";
  }
  for (CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
    SCOPED_TRACE(::testing::Message() << "layout " << CacheLayoutName(layout));
    Bf16KeysAutoByCallKindIn(layout);
    if (HasFatalFailure()) return;
  }
}

// The AVX-512 build's 16-lane tiles, both layouts (where the CPU has it;
// the other builds run the same cases): 16-bit, fp32 and fp8 caches with
// activations of the same or another dtype (bf16 keys against bf16
// queries both ways, VDPBF16PS and widened; against fp32 ones widened),
// block sizes whose key tiles are 8 tokens (8, 24) or 16 (16, 32) and
// whose value sweeps are 16-lane (16, 32) or 8-lane (8, 24), head sizes
// 128, 80 (five 16-dim chunks: a partial NHD value tile) and 64, and GQA
// groups of 4, 3, 2 and 1 (MHA; tiles repeating heads).
TEST(PagedAttention, WideTilesBlockSizesAndActivations) {
  // fp16 passes by pairs and fp8 ones, on a layer flagged as possibly
  // holding Inf or NaN, check the valid tokens only: the NaN in unwritten
  // slots must not send them to the converting redo.
  const int64_t redone = internal::ConvertingRedos();
  const Dtypes dtypes[] = {
      {DType::kBFloat16, DType::kBFloat16}, {DType::kBFloat16, DType::kFloat32},
      {DType::kFloat16, DType::kFloat16},   {DType::kFloat16, DType::kBFloat16},
      {DType::kFloat32, DType::kFloat16},   {DType::kFp8E4M3, DType::kBFloat16},
      {DType::kFp8E5M2, DType::kFloat32}};
  for (const Dtypes& d : dtypes) {
    for (int64_t bs : {8, 16, 24, 32}) {
      // GQA 4 and 3, and MHA and GQA 2, whose tiles repeat heads.
      for (auto [hs, heads, kv] :
           {std::tuple<int64_t, int64_t, int64_t>{128, 8, 2},
            {80, 6, 2},
            {128, 4, 4},
            {64, 4, 2}}) {
        for (CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
          // The fp16 and fp8 passes with and without their Inf/NaN check.
          const bool checks = d.cache == DType::kFloat16 ||
                              d.cache == DType::kFp8E4M3 ||
                              d.cache == DType::kFp8E5M2;
          const bool bf16_dot =
              d.cache == DType::kBFloat16 && d.act == DType::kBFloat16;
          for (bool flagged : {false, true}) {
            if (flagged && !checks) continue;
            for (auto keys : {AttentionParams::Bf16Keys::kWiden,
                              AttentionParams::Bf16Keys::kDot}) {
              if (keys == AttentionParams::Bf16Keys::kDot && !bf16_dot) {
                continue;
              }
              Case k = Make(layout, d.cache, d.act, heads, kv);
              k.block_size = bs;
              k.head_size = hs;
              k.context = 70;  // several blocks, the last one partial
              k.flagged = flagged;
              k.bf16_keys = keys;
              Check(k);
              if (HasFatalFailure()) return;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(internal::ConvertingRedos(), redone);
}

// An Inf or NaN written into an fp16 cache reaches the output as it would
// through a plain conversion (the AVX-512 passes by pairs would turn it
// finite, and redo the pass), and a query that the pairs' 2^112 would
// overflow is still exact. One row of 40 tokens, GQA 4, block sizes 16 (a
// two-block sweep, then a partial block), 32 and 8 (two sweeps and a single
// block, redone by the 8-wide pass), the odd value at a token of a whole
// block or of the partial one; decoding, or a prefill chunk of its last 3
// tokens (12 virtual heads, which unflagged would take the value tiles,
// which do not check).
TEST(PagedAttention, Fp16InfAndNanInTheCacheAndHugeQueries) {
  const int64_t D = 128, H = 8, KV = 2, G = H / KV, n = 40;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t bs : {16, 32, 8}) {
    for (int64_t tok : {5, 35}) {
      for (float odd : {inf, -inf, std::nanf(""), 0.0f}) {
        for (auto [key, nq] : {std::pair<bool, int64_t>{false, 1},
                               {true, 1},
                               {false, 3},
                               {true, 3}}) {
          if (odd == 0 && key) continue;  // the query case needs one run
          SCOPED_TRACE(::testing::Message()
                       << "block " << bs << " token " << tok << " value " << odd
                       << (key ? " key" : " value") << " query tokens " << nq);
          auto cache = SmallCache(DType::kFloat16, 8, bs, KV, D);
          std::memset(cache->key(0).raw_data(), 0xff, cache->key(0).nbytes());
          std::memset(cache->value(0).raw_data(), 0xff,
                      cache->value(0).nbytes());
          std::mt19937_64 rng(static_cast<uint64_t>(bs * 100 + tok));
          std::uniform_real_distribution<float> uni(-1, 1);
          std::vector<float> kraw(n * KV * D), vraw(n * KV * D),
              qraw(nq * H * D);
          for (auto* v : {&kraw, &vraw, &qraw}) {
            for (float& x : *v) x = HalfToFloat(FloatToHalf(uni(rng)));
          }
          // KV head 1, dim 3. odd == 0: instead, query head 0's dim 7 is
          // 2^20, 2^16.5 once scaled (its keys' dim 7 picks its token).
          if (odd != 0) {
            (key ? kraw : vraw)[(tok * KV + 1) * D + 3] = odd;
          } else {
            qraw[7] = 0x1p20f;
          }
          // nq 3: a prefill chunk of the last 3 tokens (12 virtual heads:
          // the value tiles' path where the layer is not flagged).
          AttentionRows rows = OneDecodeRow(n, {6, 2, 4, 0, 1, 3, 5, 7});
          rows.query_start = {0, nq};
          const std::vector<int64_t> slots = RowSlots(rows, 0, bs);
          ASSERT_TRUE(
              ReshapeAndCache(
                  *cache, 0, Activations(DType::kFloat32, {n, KV, D}, kraw),
                  Activations(DType::kFloat32, {n, KV, D}, vraw), slots, 1, 1)
                  .ok());
          const Tensor q = Activations(DType::kFloat32, {nq, H, D}, qraw);
          // What a converting kernel computes (FastExp's NaN and -inf
          // weights are 0, as std::exp's are for -inf).
          std::vector<double> ref(nq * H * D, 0.0);
          for (int64_t qh = 0; qh < nq * H; ++qh) {
            const int64_t g = qh % H / G, keys = n - nq + 1 + qh / H;
            std::vector<double> w(keys);
            for (int64_t j = 0; j < keys; ++j) {
              double dot = 0;
              for (int64_t d = 0; d < D; ++d) {
                dot += double{qraw[qh * D + d]} * kraw[(j * KV + g) * D + d];
              }
              w[j] = dot / std::sqrt(double{D});
            }
            double m = -inf;
            for (double l : w) m = std::isnan(l) ? m : std::max(m, l);
            double sum = 0;
            for (double& l : w) {
              l = std::isnan(l - m) ? 0.0 : std::exp(l - m);
              sum += l;
            }
            for (int64_t j = 0; j < keys; ++j) {
              for (int64_t d = 0; d < D; ++d) {
                ref[qh * D + d] += w[j] / sum * vraw[(j * KV + g) * D + d];
              }
            }
          }
          // The redo is the FMA passes' (amx false); AMX, where a prefill
          // chunk of the unflagged layer (the huge query) takes it, splits
          // the query and keys into bf16 parts without scaling.
          int64_t redone = 0;
          for (auto isa : TestedIsas()) {
            for (bool amx : {false, true}) {
              AttentionParams p;
              p.isa = isa;
              p.amx = amx;
              const int64_t before = internal::ConvertingRedos();
              Tensor out;
              ASSERT_TRUE(
                  PagedAttention(*cache, 0, q, rows, p, nullptr, &out).ok());
              if (!amx) redone += internal::ConvertingRedos() - before;
              for (int64_t i = 0; i < nq * H * D; ++i) {
                const double got = out.data<float>()[i];
                if (!std::isfinite(ref[i])) {
                  EXPECT_FALSE(std::isfinite(got))
                      << "element " << i << " isa " << IsaName(isa);
                } else {
                  ASSERT_NEAR(got, ref[i], 1e-3 + 1e-5 * std::fabs(ref[i]))
                      << "element " << i << " isa " << IsaName(isa) << " amx "
                      << amx;
                }
              }
            }
          }
          if (IsaSupported(AttentionParams::Isa::kAvx512)) {
            EXPECT_GT(redone, 0);
          }
        }
      }
    }
  }
}

// fp8 caches on the AVX-512 build's 16-lane passes, which read each byte's
// bits as a float's (or, LogitsFp8Dot, look up its bf16 value) and check
// the bytes of tokens in range for Inf and NaN themselves: against the
// portable build (which converts every element), with unwritten slots
// holding NaN bytes (which must not send a pass to the 8-wide redo), a NaN
// or Inf key or value byte at a token in range (which must), and an fp32
// or bf16 query that the converting pass's scaling by 2^56 or 2^60 would
// overflow (which must send that pass to the redo too, but not the
// VDPBF16PS one, which does not scale the query). fp32, bf16 and fp16
// queries (bf16 takes the VDPBF16PS passes where the CPU has VBMI, over
// every KV head of the row at once). One decode row of 40 tokens, GQA 4,
// block sizes 16 (16-token key tiles, 16-lane values) and 8 (two blocks a
// key tile, or 8-token tiles; values by VDPBF16PS, or 8-wide); the special
// byte at token 21 or 29, a whole block's in both.
TEST(PagedAttention, Fp8SpecialBytesUnwrittenSlotsAndHugeQueries) {
  if (!IsaSupported(AttentionParams::Isa::kAvx512)) {
    GTEST_SKIP() << "no AVX-512 on this CPU: the portable build is the only "
                    "fp8 path, and the other tests cover it";
  }
  const int64_t D = 128, H = 8, KV = 2, n = 40;
  enum class Odd { kNone, kKey, kValue, kQuery };
  for (DType dtype : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    for (DType act : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      const bool dot = Fp8DotSupported() && act == DType::kBFloat16;
      // NaN in both formats; e5m2's Inf (0x7c) too.
      const std::vector<uint8_t> specials =
          dtype == DType::kFp8E4M3 ? std::vector<uint8_t>{0x7f, 0xff}
                                   : std::vector<uint8_t>{0x7c, 0xfc, 0x7f};
      for (int64_t bs : {16, 8}) {
        for (Odd odd : {Odd::kNone, Odd::kKey, Odd::kValue, Odd::kQuery}) {
          for (uint8_t special : specials) {
            if ((odd == Odd::kNone || odd == Odd::kQuery) &&
                special != specials[0]) {
              continue;
            }
            // No fp16 query overflows the scaling (its largest, 65504,
            // times 2^60 is finite), and one near that size would only
            // measure how far fp32 sums of a 1e5 term and small ones drift
            // with their order.
            if (odd == Odd::kQuery && act == DType::kFloat16) continue;
            SCOPED_TRACE(::testing::Message()
                         << DTypeName(dtype) << " query " << DTypeName(act)
                         << " block " << bs << " odd " << static_cast<int>(odd)
                         << " byte " << static_cast<int>(special));
            const int64_t num_blocks = 2 * n / bs + 2;
            auto cache = SmallCache(dtype, num_blocks, bs, KV, D);
            std::memset(cache->key(0).raw_data(), 0xff, cache->key(0).nbytes());
            std::memset(cache->value(0).raw_data(), 0xff,
                        cache->value(0).nbytes());
            std::mt19937_64 rng(static_cast<uint64_t>(bs));
            std::uniform_real_distribution<float> uni(-1, 1);
            std::vector<float> kraw(n * KV * D), vraw(n * KV * D), qraw(H * D);
            for (auto* v : {&kraw, &vraw, &qraw}) {
              for (float& x : *v) x = uni(rng);
            }
            if (odd == Odd::kQuery) qraw[7] = 1e30f;
            std::vector<int64_t> table;
            for (int64_t b = 0; b < (n + bs - 1) / bs; ++b) {
              table.push_back(num_blocks - 1 - 2 * b);
            }
            const AttentionRows rows = OneDecodeRow(n, std::move(table));
            const std::vector<int64_t> slots = RowSlots(rows, 0, bs);
            ASSERT_TRUE(
                ReshapeAndCache(*cache, 0,
                                Activations(DType::kFloat32, {n, KV, D}, kraw),
                                Activations(DType::kFloat32, {n, KV, D}, vraw),
                                slots, 0.5f, 0.25f)
                    .ok());
            // Token 21, or 29 for the other special bytes (whole blocks'
            // in both block sizes; at block size 8 on one thread, the
            // first and the second block of a two-block key tile), KV
            // head 1, dim 19 (the second 16-dim chunk of keys).
            const int64_t tok = special == specials[0] ? 21 : 29;
            const int64_t b = rows.block_tables[tok / bs];
            if (odd == Odd::kKey) {
              static_cast<uint8_t*>(cache->key(0).raw_data())
                  [(((b * KV + 1) * (D / 16) + 19 / 16) * bs + tok % bs) * 16 +
                   19 % 16] = special;
            } else if (odd == Odd::kValue) {
              static_cast<uint8_t*>(
                  cache->value(0)
                      .raw_data())[((b * KV + 1) * D + 19) * bs + tok % bs] =
                  special;
            }
            // As a writer that stores bytes directly must (KvCache::
            // MayHoldNonFinite); in every case, so that the NaN of the
            // unwritten slots is checked for being skipped too.
            cache->NoteNonFinite(0);
            const Tensor q = Activations(act, {1, H, D}, qraw);
            Tensor outs[2];
            const int64_t before = internal::ConvertingRedos();
            const int64_t dots = internal::Fp8DotPasses();
            const int64_t row_passes = internal::VllmRowPasses();
            for (int k = 0; k < 2; ++k) {
              AttentionParams p;
              p.k_scale = 0.5f;
              p.v_scale = 0.25f;
              p.vllm_rows = AttentionParams::VllmRows::kOn;  // counted below
              p.fp8_dot = AttentionParams::Fp8Dot::kOn;      // wherever it runs
              p.isa = k == 0 ? AttentionParams::Isa::kAvx512
                             : AttentionParams::Isa::kPortable;
              ASSERT_TRUE(
                  PagedAttention(*cache, 0, q, rows, p, nullptr, &outs[k])
                      .ok());
            }
            // Values of block size 8 take the 8-wide pass unless by
            // VDPBF16PS.
            const bool redo = odd == Odd::kKey ||
                              (odd == Odd::kValue && (bs != 8 || dot)) ||
                              (odd == Odd::kQuery && !dot);
            if (redo) {
              EXPECT_GT(internal::ConvertingRedos(), before);
            } else {
              EXPECT_EQ(internal::ConvertingRedos(), before);
            }
            // The K pass of each KV head ran by VDPBF16PS (or began to, and
            // found a special key byte), and for a bf16 query its V pass
            // too. The row takes every KV head at once (vllm_rows): one K
            // pass, then a V pass per KV head; a special key byte sends
            // every head to its own item, whose K pass finds it again and
            // is redone by conversion.
            const bool dot_values = act == DType::kBFloat16;
            const bool row = dot;
            EXPECT_EQ(internal::Fp8DotPasses() - dots,
                      row   ? 1 + KV * (odd == Odd::kKey ? 2 : 1)
                      : dot ? KV * (dot_values ? 2 : 1)
                            : 0);
            EXPECT_EQ(internal::VllmRowPasses() - row_passes,
                      row && odd != Odd::kKey ? 1 : 0);
            // A bf16 query's V pass rounds the weights to bf16 there: an
            // output moves by up to 2^-9 of the largest |value| (1 here).
            const double wtol =
                act == DType::kBFloat16 ? std::ldexp(1.0, -9) : 0.0;
            // Both outputs are in the query's dtype, each rounded once from
            // fp32: one ulp of it on top.
            const double ulp = act == DType::kFloat16    ? std::ldexp(1.0, -10)
                               : act == DType::kBFloat16 ? std::ldexp(1.0, -7)
                                                         : 0.0;
            for (int64_t i = 0; i < H * D; ++i) {
              const float got = Act(outs[0], i);
              const float want = Act(outs[1], i);
              if (!std::isfinite(want)) {
                EXPECT_FALSE(std::isfinite(got)) << "element " << i;
              } else {
                ASSERT_NEAR(got, want,
                            1e-4 + wtol + (1e-4 + ulp) * std::fabs(want))
                    << "element " << i;
              }
            }
          }
        }
      }
    }
  }
}

// One row of n tokens in a fresh fp8 cache (k and v scales kFp8KScale and
// kFp8VScale) whose unwritten slots hold NaN bytes (flagged: on a layer
// flagged as possibly holding Inf or NaN), through a shuffled block table
// of twice the blocks it needs, its last ntok tokens a query chunk. Keys
// and values have magnitudes from 2^-14 up: fp8 values (over the scales)
// from subnormal to near the largest normal, the lookup tables' every
// region. Query elements in [-1, 1).
constexpr float kFp8KScale = 0.02f, kFp8VScale = 0.03f;
struct Fp8Row {
  std::unique_ptr<KvCache> cache;
  AttentionRows rows;
  std::vector<float> vraw, qraw;
};
Fp8Row MakeFp8Row(DType dtype, int64_t n, int64_t ntok, int64_t bs, int64_t H,
                  int64_t KV, int64_t D, bool flagged, uint64_t seed) {
  Fp8Row r;
  const int64_t width = (n + bs - 1) / bs;
  const int64_t num_blocks = 2 * width + 1;
  r.cache = SmallCache(dtype, num_blocks, bs, KV, D);
  std::memset(r.cache->key(0).raw_data(), 0xff, r.cache->key(0).nbytes());
  std::memset(r.cache->value(0).raw_data(), 0xff, r.cache->value(0).nbytes());
  if (flagged) r.cache->NoteNonFinite(0);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-1, 1);
  std::uniform_int_distribution<int> exp2(-14, 0);
  std::vector<float> kraw(n * KV * D);
  r.vraw.resize(n * KV * D);
  r.qraw.resize(ntok * H * D);
  for (auto* v : {&kraw, &r.vraw}) {
    for (float& x : *v) x = std::ldexp(uni(rng), exp2(rng));
  }
  for (float& x : r.qraw) x = uni(rng);
  std::vector<int64_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  perm.resize(width);
  r.rows = OneDecodeRow(n, perm);
  r.rows.query_start = {0, ntok};
  EXPECT_TRUE(ReshapeAndCache(*r.cache, 0,
                              Activations(DType::kFloat32, {n, KV, D}, kraw),
                              Activations(DType::kFloat32, {n, KV, D}, r.vraw),
                              RowSlots(r.rows, 0, bs), kFp8KScale, kFp8VScale)
                  .ok());
  return r;
}

// PagedAttention over r's row with query q and a sliding window: outs[0]
// by the VDPBF16PS passes (fp8_dot), outs[1] by the converting ones.
void RunFp8DotAndConverting(const Fp8Row& r, const Tensor& q, int64_t window,
                            Tensor outs[2]) {
  for (int k = 0; k < 2; ++k) {
    AttentionParams p;
    p.k_scale = kFp8KScale;
    p.v_scale = kFp8VScale;
    p.sliding_window = window;
    p.isa = AttentionParams::Isa::kAvx512;
    p.fp8_dot =
        k == 0 ? AttentionParams::Fp8Dot::kOn : AttentionParams::Fp8Dot::kOff;
    p.vllm_rows = AttentionParams::VllmRows::kOn;  // callers count row passes
    ASSERT_TRUE(
        PagedAttention(*r.cache, 0, q, r.rows, p, nullptr, &outs[k]).ok());
  }
}

// outs[0] against outs[1] (RunFp8DotAndConverting), elementwise: finite,
// and within 1e-6 + 1e-5 relative plus an ulp of the query dtype `act`,
// plus with dot_values (a bf16 query's V pass by VDPBF16PS, which rounds
// the weights to bf16) 2^-9 of the largest |value|.
void ExpectDotNearConverting(const Tensor outs[2], const Fp8Row& r, DType dtype,
                             DType act, bool dot_values) {
  double vmax = 0;
  for (float x : r.vraw) {
    vmax = std::max<double>(vmax, std::fabs(Quantize(dtype, x, kFp8VScale)));
  }
  const double wtol = dot_values ? std::ldexp(vmax, -9) : 0.0;
  const double ulp = act == DType::kFloat16    ? std::ldexp(1.0, -10)
                     : act == DType::kBFloat16 ? std::ldexp(1.0, -7)
                                               : 0.0;
  for (int64_t i = 0; i < outs[0].numel(); ++i) {
    const double got = Act(outs[0], i);
    const double want = Act(outs[1], i);
    ASSERT_TRUE(std::isfinite(got)) << "element " << i;
    ASSERT_NEAR(got, want, 1e-6 + wtol + (1e-5 + ulp) * std::fabs(want))
        << "element " << i;
  }
}

// The fp8 passes by VDPBF16PS (LogitsFp8Dot and ValuesFp8Dot, for bf16
// queries where the CPU has VBMI) against the
// converting ones (fp8_dot off), on the same cache and query. The K passes
// both take exact products and fp32 sums, so they differ by summation
// order and the converting pass's rounding of the scaled query only; the
// V pass by VDPBF16PS rounds the weights to bf16, which moves an output by
// at most 2^-9 of the largest |value|. Both bounds are far inside vLLM's
// fp8 tolerance, which a wrong lane, dim or byte would not be. Keys and
// values span fp8's subnormals up to its largest normals (the lookup
// tables' every region), unwritten slots hold NaN bytes, and the layer is
// flagged (so the passes check the bytes in range) or not. Decoding and a
// 5-token prefill chunk, a partial last block, block sizes 8, 16 and 32,
// head sizes 128, 80 and 64, GQA 4, 3 and MHA; fp16 and fp32 queries must
// not take the VDPBF16PS passes.
TEST(PagedAttention, Fp8ByDotProductsMatchTheConvertingPasses) {
  if (!IsaSupported(AttentionParams::Isa::kAvx512)) {
    GTEST_SKIP() << "no AVX-512 on this CPU: the fp8 VDPBF16PS pass is "
                    "part of the AVX-512 build";
  }
  const int64_t n = 70;
  for (DType dtype : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    for (DType act : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      for (int64_t bs : {8, 16, 32}) {
        for (auto [D, H, KV] :
             {std::tuple<int64_t, int64_t, int64_t>{128, 8, 2},
              {80, 6, 2},
              {64, 4, 4}}) {
          for (int64_t ntok : {1, 5}) {
            for (bool flagged : {false, true}) {
              SCOPED_TRACE(::testing::Message()
                           << DTypeName(dtype) << " query " << DTypeName(act)
                           << " block " << bs << " head " << D << " heads " << H
                           << "/" << KV << " tokens " << ntok << " flagged "
                           << flagged);
              const Fp8Row r =
                  MakeFp8Row(dtype, n, ntok, bs, H, KV, D, flagged,
                             static_cast<uint64_t>(bs * 1000 + D + ntok));
              const Tensor q = Activations(act, {ntok, H, D}, r.qraw);
              Tensor outs[2];
              const int64_t redos = internal::ConvertingRedos();
              const int64_t dots = internal::Fp8DotPasses();
              const int64_t row_passes = internal::VllmRowPasses();
              RunFp8DotAndConverting(r, q, 0, outs);
              if (HasFatalFailure()) return;
              EXPECT_EQ(internal::ConvertingRedos(), redos);
              const bool dot =
                  Fp8DotSupported() && act == DType::kBFloat16 && D % 16 == 0;
              // One K pass per KV head (decoding, or the chunk's tokens
              // together), and for a bf16 query one V pass; a decode row
              // takes every KV head in one K pass (vllm_rows), then a V
              // pass per KV head.
              const bool dot_values = act == DType::kBFloat16;
              const bool row = dot && dot_values && ntok == 1;
              EXPECT_EQ(internal::Fp8DotPasses() - dots,
                        row   ? 1 + KV
                        : dot ? KV * (dot_values ? 2 : 1)
                              : 0);
              EXPECT_EQ(internal::VllmRowPasses() - row_passes, row ? 1 : 0);
              ExpectDotNearConverting(outs, r, dtype, act, dot_values);
              if (HasFatalFailure()) return;
            }
          }
        }
      }
    }
  }
}

// Prefill chunks of fp8 caches with bf16 queries take their values through
// the 8-head value tiles by VDPBF16PS (ValuesTileFp8Z), over ranges of 16
// or 32 blocks; checked against the converting passes (fp8_dot off) to the
// bound above (the weights' rounding to bf16), which a wrong unit, lane,
// block or weight would break. 39 query tokens (chunks of 16, 16 and 7:
// tiles that repeat heads) after 562 cached ones (several ranges, a
// partial last block whose unwritten slots hold NaN bytes), GQA 4 and 3,
// block sizes 8, 16 and 32, with and without a window that starts each
// chunk's keys mid-block at every block size (a partial first block, whose
// weights before the window's first key lie outside the logits; 307 would
// start them on a multiple of 16).
TEST(PagedAttention, Fp8PrefillValueTilesMatchTheConvertingPasses) {
  if (!IsaSupported(AttentionParams::Isa::kAvx512) || !Fp8DotSupported()) {
    GTEST_SKIP() << "no AVX-512 BF16 and VBMI on this CPU: the fp8 "
                    "VDPBF16PS passes do not run";
  }
  const int64_t n = 601, ntok = 39, D = 128;
  for (DType dtype : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    for (int64_t bs : {8, 16, 32}) {
      for (auto [H, KV] : {std::pair<int64_t, int64_t>{8, 2}, {6, 2}}) {
        for (int64_t window : {0, 300}) {
          SCOPED_TRACE(::testing::Message()
                       << DTypeName(dtype) << " block " << bs << " heads " << H
                       << "/" << KV << " window " << window);
          const Fp8Row r =
              MakeFp8Row(dtype, n, ntok, bs, H, KV, D, false,
                         static_cast<uint64_t>(bs * 1000 + H + window));
          const Tensor q = Activations(DType::kBFloat16, {ntok, H, D}, r.qraw);
          Tensor outs[2];
          const int64_t dots = internal::Fp8DotPasses();
          RunFp8DotAndConverting(r, q, window, outs);
          if (HasFatalFailure()) return;
          // A K and a V pass per chunk and KV head.
          EXPECT_GE(internal::Fp8DotPasses() - dots, 2 * KV * 3);
          ExpectDotNearConverting(outs, r, dtype, DType::kBFloat16, true);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
  // A chunk of exactly 8 virtual heads (2 tokens, GQA 4): one head tile,
  // which stages nothing for others to read.
  for (int64_t bs : {8, 16, 32}) {
    SCOPED_TRACE(::testing::Message() << "2 tokens, block " << bs);
    const Fp8Row r = MakeFp8Row(DType::kFp8E4M3, n, 2, bs, 8, 2, D, false,
                                static_cast<uint64_t>(bs));
    const Tensor q = Activations(DType::kBFloat16, {2, 8, D}, r.qraw);
    Tensor outs[2];
    const int64_t dots = internal::Fp8DotPasses();
    RunFp8DotAndConverting(r, q, 0, outs);
    if (HasFatalFailure()) return;
    EXPECT_GE(internal::Fp8DotPasses() - dots, 2 * 2);
    ExpectDotNearConverting(outs, r, DType::kFp8E4M3, DType::kBFloat16, true);
    if (HasFatalFailure()) return;
  }
}

TEST(PagedAttention, AlibiAndSlidingWindow) {
  for (bool alibi : {false, true}) {
    for (int64_t window : {0, 1, 7, 20}) {
      Case k;
      k.heads = 4;
      k.kv_heads = 2;
      k.alibi = alibi;
      k.window = window;
      k.cache = DType::kBFloat16;
      k.act = DType::kBFloat16;
      Check(k);
      if (HasFatalFailure()) return;
    }
  }
}

// Long contexts (many blocks, several 512-token partitions), GQA groups
// that do not fill the kernel's register tiles (3 query heads per KV head),
// windows that start keys mid-block (and at odd offsets: bf16 key pairs),
// block sizes of 24 and 48 (48: the vLLM layout's element-wise path), and
// head sizes that are not a multiple of 8 (element-wise path).
TEST(PagedAttention, LongContextsOddGroupsAndShapes) {
  for (CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
    for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      Case k = Make(layout, d, d, 6, 2);
      k.head_size = 128;
      k.context = 1100;
      Check(k);
      if (HasFatalFailure()) return;
    }
    // 526 blocks of 8: items over 512 blocks touch their slices first
    // (Partial) with every CPU's default item gate, here in a small call
    // too; with a window of 4150 the keys start mid-block.
    for (int64_t window : {0, 4150}) {
      Case k = Make(layout, DType::kBFloat16, DType::kBFloat16, 8, 2);
      k.block_size = 8;
      k.context = 4200;
      k.window = window;
      k.touch_min_bytes = 0;
      Check(k);
      if (HasFatalFailure()) return;
    }
    // 37: keys start mid-block; the short items also with the slice touch
    // forced on, which this CPU's default may leave off.
    for (int64_t window : {0, 37}) {
      for (int64_t touch : {int64_t{-1}, int64_t{0}}) {
        Case k = Make(layout, DType::kBFloat16, DType::kBFloat16, 8, 2);
        k.context = 300;
        k.window = window;
        k.alibi = window > 0;
        k.touch_min_bytes = k.touch_min_blocks = touch;
        Check(k);
        if (HasFatalFailure()) return;
      }
    }
    for (int64_t bs : {24, 48}) {
      Case k = Make(layout, DType::kFloat32, DType::kFloat32, 3, 1);
      k.block_size = bs;
      k.context = 200;
      Check(k);
      if (HasFatalFailure()) return;
    }
    Case k = Make(layout, DType::kFloat32, DType::kFloat32, 2, 2);
    k.head_size = 20;  // vLLM: a multiple of x = 4 (fp32)
    k.block_size = 5;
    k.context = 60;
    k.window = 17;
    k.alibi = true;
    Check(k);
    if (HasFatalFailure()) return;
  }
}

// NHD rows read a whole token row at a time, over every KV head
// (AttentionParams::nhd_rows, the AVX-512 build): 16-bit, fp32 and fp8
// caches (fp8: head sizes in steps of 64, unflagged layers; keys by
// VDPBF16PS for a bf16 query where the CPU has VBMI),
// bf16 keys by VDPBF16PS (bf16 query, bf16_keys kDot) and split (fp32
// query, or bf16_keys kAuto), MQA, GQA 3 and 4 and MHA, head sizes 64, 80
// (16-dim tiles, no split) and 128, block sizes 8, 16 and 32. A context of 1100
// keys is three 512-key segments merged in turn (the single-pass kernel; the
// partitioned one's partitions are one segment each); a window of 600 leaves
// its first segment without keys; ALiBi; prefetcht1 (stream starts) but
// for MHA. Every case also without nhd_rows (an item per KV head). Rows of more
// query tokens than 128 virtual heads take an item per KV head, nhd_rows or
// not.
TEST(PagedAttention, NhdRowsOverEveryKvHead) {
  const bool avx512 = IsaSupported(AttentionParams::Isa::kAvx512);
  struct Shape {
    int64_t heads, kv_heads, head_size, block_size;
  };
  const Shape shapes[] = {
      {4, 1, 128, 16}, {8, 2, 64, 32}, {6, 2, 80, 8}, {2, 2, 128, 16}};
  for (const Shape& sh : shapes) {
    for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32,
                    DType::kFp8E4M3, DType::kFp8E5M2}) {
      const bool fp8 = DTypeSize(d) == 1;
      for (DType act : {fp8 ? DType::kBFloat16 : d, DType::kFloat32}) {
        for (bool rows : {true, false}) {
          Case k = Make(CacheLayout::kNhd, d, act, sh.heads, sh.kv_heads);
          k.head_size = sh.head_size;
          k.block_size = sh.block_size;
          k.context = 1100;
          k.window = sh.heads == 8 ? 600 : 0;
          k.alibi = sh.heads == 6;
          k.nhd_rows = rows;
          k.bf16_keys = sh.heads == 2 ? AttentionParams::Bf16Keys::kAuto
                                      : AttentionParams::Bf16Keys::kDot;
          // prefetcht1, with which 8- and 16-bit rows start the L2
          // streamer on the blocks ahead (StartRowStreams), on any CPU;
          // MHA this CPU's hint.
          k.prefetch = sh.heads == 2 ? AttentionParams::Prefetch::kAuto
                                     : AttentionParams::Prefetch::kT1;
          const int64_t before = internal::NhdRowPasses();
          const int64_t dots = internal::Fp8DotPasses();
          Check(k);
          if (HasFatalFailure()) return;
          // fp8 rows against a bf16 query by VDPBF16PS where the CPU has
          // VBMI (NhdFp8DotStep).
          if (fp8 && rows && sh.kv_heads > 1 && sh.head_size % 64 == 0 &&
              act == DType::kBFloat16) {
            EXPECT_EQ(internal::Fp8DotPasses() > dots, Fp8DotSupported());
          }
          // Of the TestedIsas' runs, the AVX-512 build's reads rows, with
          // nhd_rows and more than one KV head (MQA's one head a row is
          // the per-head item itself); fp8 in head sizes of 64 dims.
          EXPECT_EQ(internal::NhdRowPasses() > before,
                    avx512 && rows && sh.kv_heads > 1 &&
                        !(fp8 && sh.head_size % 64 != 0))
              << DTypeName(d) << " heads " << sh.heads;
        }
      }
    }
  }
  // fp8 on a layer flagged as possibly holding Inf or NaN: an item per KV
  // head, whose passes check what they read.
  for (DType d : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    Case k = Make(CacheLayout::kNhd, d, DType::kBFloat16, 8, 2);
    k.head_size = 128;
    k.context = 100;
    k.flagged = true;
    const int64_t before = internal::NhdRowPasses();
    Check(k);
    if (HasFatalFailure()) return;
    EXPECT_EQ(internal::NhdRowPasses(), before);
  }
  // 32 query heads: RowTokens is 4, and the prefill row has 5 tokens. The
  // call's rows are uneven (UnevenClaims): the decode rows are still read
  // over every KV head, the prefill row by an item per KV head.
  Case k = Make(CacheLayout::kNhd, DType::kBFloat16, DType::kBFloat16, 32, 8);
  k.head_size = 64;
  const int64_t before = internal::NhdRowPasses();
  const int64_t uneven = internal::UnevenClaimCalls();
  Check(k);
  if (HasFatalFailure()) return;
  EXPECT_EQ(internal::NhdRowPasses() > before, avx512);
  EXPECT_GT(internal::UnevenClaimCalls(), uneven);
  k.prefill_tokens = 4;
  Check(k);
  if (HasFatalFailure()) return;
  EXPECT_EQ(internal::NhdRowPasses() > before, avx512);
}

// KvCache::Create checks the geometry itself (the engine validates before
// it, other callers may not): the vLLM layout's key chunks of x = 16 / the
// element size cannot hold an fp8 head of 120 dims (7.5 chunks), and a
// writer would run past the tensor; the NHD layout can.
TEST(KvCache, CreateRejectsAGeometryTheLayoutCannotHold) {
  CacheConfig c;
  c.num_blocks = 4;
  c.num_layers = 1;
  c.num_kv_heads = 2;
  c.head_size = 120;
  c.dtype = DType::kFp8E4M3;
  c.layout = CacheLayout::kVllm;
  absl::StatusOr<std::unique_ptr<KvCache>> cache =
      KvCache::Create(c, CpuDevice());
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(cache.status().message()),
              HasSubstr("head_size 120"));
  c.head_size = 128;
  EXPECT_TRUE(KvCache::Create(c, CpuDevice()).ok());
  c.head_size = 120;
  c.layout = CacheLayout::kNhd;
  EXPECT_TRUE(KvCache::Create(c, CpuDevice()).ok());
  c.num_blocks = 0;
  EXPECT_EQ(KvCache::Create(c, CpuDevice()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// vLLM-layout decode rows read a block of every KV head at a time
// (AttentionParams::vllm_rows, the AVX-512 build): bf16 (keys by VDPBF16PS
// against a bf16 query, widened against an fp32 one), fp16 (split) and fp32
// caches; GQA 4 (head 64, block 32: two key tiles a block), GQA 3 (head 80:
// 10 chunks), GQA 8 (head 120: two head tiles a KV head), MHA (head 128),
// GQA 4 and 8 at block size 8 (8-token key tiles, one a block; on one
// thread 16-bit keys two blocks a tile, a partial block alone; fp32 values
// by the 8-wide pass; fp32 rows on one thread only: those shapes also run
// on one); fp8 caches (keys and values by VDPBF16PS: a bf16 query; an fp32
// query takes items); MQA takes an item per KV head. A batch of decode rows
// only (contexts 1100 and 23, a block boundary, padding); a window of 600 that
// starts keys mid-block; ALiBi. At 5000 keys, 16 heads over 4 KV heads
// (320 KB of logits a row): fp32 by rows, 16-bit caches an item per KV
// head (rows only up to 256 KB). At 9000 keys, 8 heads over 2: fp32 in two
// segments merged (single-pass kernel; the partitioned one's partitions
// are one each), 16-bit caches an item per KV head (288 KB).
// Every case also without vllm_rows. fp16 keys the split cannot take (Inf,
// NaN, huge queries) on this path: Fp16InfAndNanInTheCacheAndHugeQueries.
TEST(PagedAttention, VllmDecodeRowsOverEveryKvHead) {
  const bool avx512 = IsaSupported(AttentionParams::Isa::kAvx512);
  struct Shape {
    int64_t heads, kv_heads, head_size, block_size;
  };
  const Shape shapes[] = {{8, 2, 64, 32},  {6, 2, 80, 16}, {16, 2, 120, 16},
                          {2, 2, 128, 16}, {4, 1, 64, 16}, {8, 2, 64, 8},
                          {16, 2, 64, 8},  {16, 4, 64, 16}};
  for (const Shape& sh : shapes) {
    for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32,
                    DType::kFp8E4M3, DType::kFp8E5M2}) {
      const bool fp8 = d == DType::kFp8E4M3 || d == DType::kFp8E5M2;
      const DType own = fp8 ? DType::kBFloat16 : d;  // the usual query
      for (DType act : {own, DType::kFloat32}) {
        for (bool rows : {true, false}) {
          for (auto [context, threads] : {std::pair<int64_t, int>{1100, 2},
                                          {1100, 1},
                                          {5000, 2},
                                          {9000, 2}}) {
            // 5000 keys: 16 heads over 4 only; 9000: 8 over 2, block 32;
            // one thread: block 8 only.
            // fp8: 1100 keys (its rows share the gates with 16-bit
            // caches), head sizes in steps of its vLLM layout's x = 16,
            // rows only (the fp8 tests above check the per-head items),
            // and e5m2 with a bf16 query only (it differs from e4m3 in its
            // lookup tables).
            if ((context == 5000) != (sh.kv_heads == 4) ||
                (context == 9000 && (sh.block_size != 32 || act != own)) ||
                (threads == 1 && sh.block_size != 8) ||
                (fp8 && (context != 1100 || sh.head_size % 16 != 0 || !rows ||
                         (d == DType::kFp8E5M2 && act != own)))) {
              continue;
            }
            Case k = Make(CacheLayout::kVllm, d, act, sh.heads, sh.kv_heads);
            k.head_size = sh.head_size;
            k.block_size = sh.block_size;
            k.context = context;
            k.prefill_tokens = 1;  // every row decodes
            k.window = sh.heads == 16 ? 600 : 0;
            k.alibi = sh.heads == 6;
            k.vllm_rows = rows;
            k.bf16_keys = AttentionParams::Bf16Keys::kDot;
            k.threads = threads;
            const int64_t before = internal::VllmRowPasses();
            Check(k);
            if (HasFatalFailure()) return;
            // 16-bit: where the logits of every query head over the
            // longest row fit 256 KB, or 2 MiB in calls of at most 8 rows
            // (Check's batch has 3). Block size 8: fp32 on one thread only.
            const bool fit = sh.heads * context * 4 <= int64_t{2} << 20;
            // fp8: keys and values by VDPBF16PS only (a bf16 query, head
            // sizes in steps of 16).
            const bool block =
                fp8 ? sh.head_size % 16 == 0 && act == DType::kBFloat16 &&
                          Fp8DotSupported()
                    : sh.block_size % 16 == 0 ||
                          (sh.block_size == 8 &&
                           (d != DType::kFloat32 || threads == 1));
            EXPECT_EQ(internal::VllmRowPasses() > before,
                      avx512 && rows && sh.kv_heads > 1 && block &&
                          (d == DType::kFloat32 || fit))
                << DTypeName(d) << " heads " << sh.heads << " block "
                << sh.block_size << " context " << context << " threads "
                << threads;
          }
        }
      }
    }
  }
  // A prefill row in the batch (UnevenClaims): the decode rows are still
  // read over every KV head, the prefill row by an item per KV head.
  Case k = Make(CacheLayout::kVllm, DType::kBFloat16, DType::kBFloat16, 8, 2);
  const int64_t before = internal::VllmRowPasses();
  const int64_t uneven = internal::UnevenClaimCalls();
  Check(k);
  if (HasFatalFailure()) return;
  EXPECT_EQ(internal::VllmRowPasses() > before, avx512);
  EXPECT_GT(internal::UnevenClaimCalls(), uneven);
}

// Calls under parallel_min_bytes (4 MiB by default) of K/V run on the
// caller alone, pool or not; fp8 bytes count twice (a 16-bit element's
// arithmetic each). Decode rows of 8 KV heads x head 128 (zero caches:
// only who runs is checked): bf16 at 512 keys (2 MiB) and fp8 at 512 (1
// MiB, as 2) on the caller, fp8 at 1024 (2 MiB, as 4) and bf16 at 1024 on
// the pool.
TEST(PagedAttention, SmallCallsRunOnTheCallerFp8BytesCountTwice) {
  struct Call {
    DType dtype;
    int64_t keys;
    bool pool;
  };
  const Call calls[] = {{DType::kBFloat16, 512, false},
                        {DType::kFp8E4M3, 512, false},
                        {DType::kFp8E4M3, 1024, true},
                        {DType::kBFloat16, 1024, true}};
  ThreadPool pool(2);
  for (const Call& k : calls) {
    const int64_t bs = 16, width = k.keys / bs;
    auto cache = SmallCache(k.dtype, width, bs, 8, 128);
    AttentionRows rows;
    rows.num_real = 1;
    rows.width = width;
    rows.query_start = {0, 1};
    rows.seq_lens = {k.keys};
    rows.block_tables.resize(width);
    std::iota(rows.block_tables.begin(), rows.block_tables.end(), 0);
    const Tensor q =
        *Tensor::Zeros(CpuDevice(), DType::kBFloat16, {1, 32, 128});
    const int64_t jobs = pool.jobs();
    Tensor out;
    const absl::Status s =
        PagedAttention(*cache, 0, q, rows, AttentionParams(), &pool, &out);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(pool.jobs() > jobs, k.pool)
        << DTypeName(k.dtype) << ", " << k.keys << " keys";
  }
}

// Which 16-bit decode calls take rows over every KV head: logits of up to
// 256 KB a row in any call, up to 2 MiB in calls of at most 8 rows
// (AttentionParams::vllm_rows; timed in docs/attention.md, session 28) or
// on one thread (session 33), and any length where at least half of the
// neighbouring table entries (of each row's first 65) are consecutive ids
// (session 30). Tables: each row's own blocks cut into runs of consecutive
// ids whose lengths cycle through `runs`, the runs in reverse order (runs
// {2}: 32 of 64 sampled pairs consecutive; {2, 3, 1}: 31), all in order
// ({0}), or shuffled ({}). Two threads: a pool of two, used for any call.
TEST(PagedAttention, VllmRowsPast256KbOnlyForFewRowsOneThreadOrRuns) {
  const bool avx512 = IsaSupported(AttentionParams::Isa::kAvx512);
  struct Call {
    int64_t heads, keys, batch;
    std::vector<int64_t> runs;
    int threads;
    bool rows;
  };
  const Call calls[] = {
      {8, 8192, 9, {}, 2, true},          // 256 KB exactly: any batch
      {8, 8200, 8, {}, 2, true},          // past 256 KB, 8 rows
      {8, 8200, 9, {}, 2, false},         // past 256 KB, 9 rows
      {8, 8200, 9, {}, 1, true},          // the same on one thread
      {128, 4096, 1, {}, 1, true},        // 2 MiB exactly, one row
      {128, 4100, 1, {}, 1, false},       // past 2 MiB
      {128, 4100, 9, {}, 1, false},       // past 2 MiB, 9 rows
      {8, 8200, 9, {0}, 2, true},         // past 256 KB, 9 rows, in order
      {128, 4100, 1, {0}, 1, true},       // past 2 MiB, in order
      {8, 8200, 9, {2}, 2, true},         // half consecutive
      {8, 8200, 9, {2, 3, 1}, 2, false},  // just under half
  };
  ThreadPool pool(2);
  AttentionParams p;
  p.parallel_min_bytes = 0;
  p.vllm_rows = AttentionParams::VllmRows::kOn;  // the gates, on any CPU
  for (const Call& k : calls) {
    const int64_t bs = 16, width = (k.keys + bs - 1) / bs;
    // Zero K/V (KvCache::Create's): only which pass runs is checked.
    auto cache = SmallCache(DType::kBFloat16, width * k.batch, bs, 2, 64);
    AttentionRows rows;
    rows.num_real = k.batch;
    rows.width = width;
    for (int64_t r = 0; r <= k.batch; ++r) rows.query_start.push_back(r);
    rows.seq_lens.assign(k.batch, k.keys);
    rows.block_tables.resize(width * k.batch);
    std::mt19937_64 rng(5);
    for (int64_t r = 0; r < k.batch; ++r) {
      int64_t* t = &rows.block_tables[r * width];
      std::iota(t, t + width, r * width);
      if (k.runs.empty()) std::shuffle(t, t + width, rng);
      if (k.runs.empty() || k.runs[0] == 0) continue;
      std::vector<std::vector<int64_t>> cut;  // runs in ascending order
      for (int64_t j = 0, n = 0; j < width; ++n) {
        const int64_t len = k.runs[static_cast<size_t>(n) % k.runs.size()];
        cut.emplace_back();
        for (int64_t e = j; e < std::min(width, j + len); ++e) {
          cut.back().push_back(r * width + e);
        }
        j += len;
      }
      int64_t i = 0;
      for (auto run = cut.rbegin(); run != cut.rend(); ++run) {
        for (int64_t id : *run) t[i++] = id;
      }
    }
    const Tensor q =
        *Tensor::Zeros(CpuDevice(), DType::kBFloat16, {k.batch, k.heads, 64});
    const int64_t before = internal::VllmRowPasses();
    Tensor out;
    const absl::Status s = PagedAttention(
        *cache, 0, q, rows, p, k.threads == 2 ? &pool : nullptr, &out);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(internal::VllmRowPasses() > before, avx512 && k.rows)
        << k.heads << " heads, " << k.keys << " keys, " << k.batch
        << " rows, runs of " << (k.runs.empty() ? -1 : k.runs[0]) << ", "
        << k.threads << " threads";
  }
}

// kAuto (the default) takes the row passes where BestVllmRows says this
// CPU reads faster by them, under the same gates as kOn: a decode batch of
// 3 rows of 300 keys (8 heads over 2 KV heads, head 64, one thread; zero
// K/V: only which pass runs is checked) at block sizes 8 and 16, for every
// cache dtype (fp8 with a bf16 query, where its rows run by VDPBF16PS,
// which fp8_dot's kAuto takes where BestFp8Dot says so). Caches of 8- and
// 16-bit elements at block size 8 take the rows on every CPU measured (Zen
// 5 and the Intel Xeon of session 47), and kOff never.
TEST(PagedAttention, VllmRowsAutoTakesThisCpusChoice) {
  const bool avx512 = IsaSupported(AttentionParams::Isa::kAvx512);
  for (DType d :
       {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFp8E4M3}) {
    const bool fp8 = d == DType::kFp8E4M3;
    EXPECT_EQ(BestVllmRows(d, 8),
              d != DType::kFloat32 || BestVllmRows(DType::kFloat32, 16))
        << DTypeName(d);
    for (int64_t bs : {8, 16}) {
      for (auto v : {AttentionParams::VllmRows::kAuto,
                     AttentionParams::VllmRows::kOff}) {
        const int64_t keys = 300, batch = 3, width = (keys + bs - 1) / bs;
        auto cache = SmallCache(d, width * batch, bs, 2, 64);
        const AttentionRows rows = DecodeRows(batch, keys, bs);
        const Tensor q = *Tensor::Zeros(CpuDevice(), fp8 ? DType::kBFloat16 : d,
                                        {batch, 8, 64});
        AttentionParams p;
        p.vllm_rows = v;
        const int64_t before = internal::VllmRowPasses();
        Tensor out;
        ASSERT_TRUE(PagedAttention(*cache, 0, q, rows, p, nullptr, &out).ok());
        const bool can = avx512 && (!fp8 || BestFp8Dot(CacheLayout::kVllm, bs));
        EXPECT_EQ(
            internal::VllmRowPasses() > before,
            can && v == AttentionParams::VllmRows::kAuto && BestVllmRows(d, bs))
            << DTypeName(d) << " block " << bs << " "
            << (v == AttentionParams::VllmRows::kAuto ? "auto" : "off");
      }
    }
  }
}

// fp8_dot's kAuto (the default) takes the fp8 VDPBF16PS passes where
// BestFp8Dot says this CPU runs them faster, and then gives kOn's output
// bit for bit, elsewhere kOff's: decode batches of 3 rows of 300 keys over
// random finite e4m3 bytes (8 heads over 2 KV heads, head 64, a bf16
// query, one thread), both layouts, block sizes 8, 16 and 32. kOff never
// runs them; kOn wherever the CPU has them (every KV head's keys in NHD
// rows, keys and values in the vLLM layout). BestFp8Dot is the measured
// choice: on AMD (Zen 5, session 17) every shape, elsewhere (the Intel
// Xeon of session 59) only block size 8 in the vLLM layout, whose rows
// and key pairs are built on these passes.
TEST(PagedAttention, Fp8DotAutoTakesThisCpusChoice) {
  using D = AttentionParams::Fp8Dot;
  std::mt19937_64 rng(59);
  for (CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
    for (int64_t bs : {8, 16, 32}) {
      SCOPED_TRACE(::testing::Message()
                   << (layout == CacheLayout::kVllm ? "vllm" : "nhd")
                   << " block " << bs);
      EXPECT_EQ(
          BestFp8Dot(layout, bs),
          Fp8DotSupported() && (internal::AmdOrHygonCpu() ||
                                (layout == CacheLayout::kVllm && bs == 8)));
      const int64_t keys = 300, batch = 3, width = (keys + bs - 1) / bs;
      auto cache =
          SmallCache(DType::kFp8E4M3, width * batch, bs, 2, 64, 1, layout);
      FillFiniteE4m3(*cache, rng);
      AttentionRows rows = DecodeRows(batch, keys, bs);
      std::shuffle(rows.block_tables.begin(), rows.block_tables.end(), rng);
      std::vector<float> qraw(batch * 8 * 64);
      std::uniform_real_distribution<float> uni(-1, 1);
      for (float& x : qraw) x = uni(rng);
      const Tensor q = Activations(DType::kBFloat16, {batch, 8, 64}, qraw);
      Tensor outs[3];
      int64_t dots[3];
      const D modes[3] = {D::kAuto, D::kOn, D::kOff};
      for (int k = 0; k < 3; ++k) {
        AttentionParams p;
        p.fp8_dot = modes[k];
        p.k_scale = 0.5f;
        p.v_scale = 0.25f;
        const int64_t before = internal::Fp8DotPasses();
        ASSERT_TRUE(
            PagedAttention(*cache, 0, q, rows, p, nullptr, &outs[k]).ok());
        dots[k] = internal::Fp8DotPasses() - before;
      }
      const bool best = BestFp8Dot(layout, bs);
      EXPECT_EQ(dots[0] > 0, best);
      EXPECT_EQ(dots[1] > 0, Fp8DotSupported());
      EXPECT_EQ(dots[2], 0);
      const Tensor& same = outs[best ? 1 : 2];
      ASSERT_EQ(outs[0].nbytes(), same.nbytes());
      EXPECT_EQ(std::memcmp(outs[0].raw_data(), same.raw_data(), same.nbytes()),
                0);
    }
  }
}

// BestFp8DotScope (what GetServerInfo reports) says where kAuto's decode
// calls with a bf16 query run the fp8 VDPBF16PS passes: both layouts,
// block sizes 8 and 16, head sizes 64 and 96 (NHD takes them for keys at
// multiples of 64 only), one and two KV heads (NHD rows need two). A
// decode batch of 2 rows of 100 random finite e4m3 keys, 4 query heads a
// KV head; an fp16 query never runs them.
// ThisCpu reads CPUID once for the kernel's per-CPU choices and the
// bench's cpu line: on x86 a vendor and a family, and the vendor the
// choices key on (AmdOrHygonCpu) is the one it names.
TEST(PagedAttention, ThisCpuNamesTheVendorTheChoicesKeyOn) {
  const CpuIdentity& cpu = ThisCpu();
#if defined(__x86_64__)
  EXPECT_EQ(cpu.vendor.size(), 12u) << cpu.vendor;
  EXPECT_GT(cpu.family, 0u);
#endif
  EXPECT_EQ(internal::AmdOrHygonCpu(),
            cpu.vendor == "AuthenticAMD" || cpu.vendor == "HygonGenuine");
  EXPECT_EQ(&cpu, &ThisCpu());
}

TEST(PagedAttention, Fp8DotScopeSaysWhatRuns) {
  std::mt19937_64 rng(60);
  for (CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
    for (int64_t bs : {8, 16}) {
      for (int64_t head : {64, 96}) {
        for (int64_t kv : {1, 2}) {
          SCOPED_TRACE(::testing::Message()
                       << (layout == CacheLayout::kVllm ? "vllm" : "nhd")
                       << " block " << bs << " head " << head << " kv " << kv);
          const int64_t keys = 100, batch = 2, width = (keys + bs - 1) / bs;
          auto cache = SmallCache(DType::kFp8E4M3, width * batch, bs, kv, head,
                                  1, layout);
          FillFiniteE4m3(*cache, rng);
          const Fp8DotScope scope = BestFp8DotScope(cache->config());
          EXPECT_EQ(scope != Fp8DotScope::kNone,
                    BestFp8Dot(layout, bs) && (layout == CacheLayout::kVllm ||
                                               (head % 64 == 0 && kv >= 2)));
          EXPECT_EQ(scope == Fp8DotScope::kKeys,
                    scope != Fp8DotScope::kNone && layout == CacheLayout::kNhd);
          const AttentionRows rows = DecodeRows(batch, keys, bs);
          std::vector<float> qraw(batch * kv * 4 * head);
          std::uniform_real_distribution<float> uni(-1, 1);
          for (float& x : qraw) x = uni(rng);
          for (DType qd : {DType::kBFloat16, DType::kFloat16}) {
            const Tensor q = Activations(qd, {batch, kv * 4, head}, qraw);
            AttentionParams p;
            p.k_scale = 0.5f;
            Tensor out;
            const int64_t before = internal::Fp8DotPasses();
            ASSERT_TRUE(
                PagedAttention(*cache, 0, q, rows, p, nullptr, &out).ok());
            EXPECT_EQ(internal::Fp8DotPasses() > before,
                      qd == DType::kBFloat16 && scope != Fp8DotScope::kNone)
                << DTypeName(qd) << " query";
          }
        }
      }
    }
  }
}

// kAuto takes decode calls whose rows of 2 MiB of K/V a KV head or more
// (head 128: 4096 keys of a 16-bit cache, 2048 of fp32; keys within the
// sliding window) hold at least half the call's keys in 1024-key ranges
// where BestLongRowRanges says so (vLLM layout, 16-bit and fp32 caches,
// the AVX-512 build), on two threads only where whole rows a thread
// balance, longest first (two rows of equal length, or rows of 4100, 4100
// and 8200 keys; not three equal ones, nor a long and a short one), or
// where the call is one row, split between the threads (with a window
// too), and
// nothing else: not with a kernel asked for, not for fp8
// caches, the NHD layout or a prefill row, nor where the long rows hold
// under half the keys. The calls it takes match an fp64 reference
// (random K/V, unwritten slots NaN, shuffled tables), with and without a
// sliding window that starts a row's keys inside a range, and with the
// slice touch forced (the first eight calls).
TEST(PagedAttention, LongDecodeRowsAutoInKeyRanges) {
  const bool avx512 = IsaSupported(AttentionParams::Isa::kAvx512);
  struct Call {
    DType cache;
    std::vector<int64_t> lens;
    int threads;
    AttentionParams::Kernel kernel;
    CacheLayout layout;
    int64_t tokens;  // query tokens of row 0
    bool taken;      // where BestLongRowRanges and AVX-512
    int64_t window = 0;
  };
  const auto kAuto = AttentionParams::Kernel::kAuto;
  const auto kVllm = CacheLayout::kVllm;
  const Call calls[] = {
      {DType::kBFloat16, {4101, 100}, 1, kAuto, kVllm, 1, true},
      {DType::kFloat16, {4101, 100}, 1, kAuto, kVllm, 1, true},
      {DType::kFloat32, {2048, 2000}, 1, kAuto, kVllm, 1, true},
      {DType::kFloat32, {2047, 100}, 1, kAuto, kVllm, 1, false},
      {DType::kBFloat16, {4096, 4095, 100}, 1, kAuto, kVllm, 1, false},
      {DType::kBFloat16, {4095, 100}, 1, kAuto, kVllm, 1, false},
      {DType::kBFloat16, {6000, 100}, 1, kAuto, kVllm, 1, false, 4095},
      {DType::kBFloat16, {4101, 100}, 2, kAuto, kVllm, 1, false},
      {DType::kBFloat16, {4101, 4101}, 2, kAuto, kVllm, 1, true},
      {DType::kFloat16, {6000, 6000}, 2, kAuto, kVllm, 1, true, 4500},
      {DType::kBFloat16, {4101, 4101, 4101}, 2, kAuto, kVllm, 1, false},
      {DType::kBFloat16, {4100, 4100, 8200}, 2, kAuto, kVllm, 1, true},
      {DType::kBFloat16, {4500}, 2, kAuto, kVllm, 1, true},
      {DType::kFloat32, {6000}, 2, kAuto, kVllm, 1, true, 3500},
      {DType::kFloat32, {4500, 4096}, 1, kAuto, kVllm, 1, true, 2500},
      {DType::kBFloat16,
       {4101, 100},
       1,
       AttentionParams::Kernel::kSinglePass,
       kVllm,
       1,
       false},
      {DType::kFp8E4M3, {4101, 100}, 1, kAuto, kVllm, 1, false},
      {DType::kBFloat16, {4101, 100}, 1, kAuto, CacheLayout::kNhd, 1, false},
      {DType::kBFloat16, {4101, 100}, 1, kAuto, kVllm, 2, false},
  };
  const int64_t bs = 16, KV = 2, H = 8, D = 128;
  ThreadPool pool(2);
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> uni(-1, 1);
  for (const Call& k : calls) {
    const int64_t n = static_cast<int64_t>(k.lens.size());
    const int64_t width =
        (*std::max_element(k.lens.begin(), k.lens.end()) + bs - 1) / bs;
    auto cache = SmallCache(k.cache, width * n + 3, bs, KV, D, 1, k.layout);
    std::memset(cache->key(0).raw_data(), 0xff, cache->key(0).nbytes());
    std::memset(cache->value(0).raw_data(), 0xff, cache->value(0).nbytes());
    AttentionRows rows;
    rows.num_real = n;
    rows.width = width;
    rows.query_start = {0};
    for (int64_t r = 0; r < n; ++r) {
      rows.query_start.push_back(rows.query_start.back() +
                                 (r == 0 ? k.tokens : 1));
    }
    rows.seq_lens = k.lens;
    std::vector<int64_t> perm(width * n + 3);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    perm.resize(width * n);
    rows.block_tables = perm;
    // The cached K/V as stored (bf16, fp16, fp32 or fp8 of fp32 draws).
    std::vector<std::vector<float>> K(n), V(n);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t m = k.lens[r] * KV * D;
      std::vector<float> kraw(m), vraw(m);
      for (float& x : kraw) x = uni(rng);
      for (float& x : vraw) x = uni(rng);
      const Tensor kt = Activations(DType::kFloat32, {k.lens[r], KV, D}, kraw);
      const Tensor vt = Activations(DType::kFloat32, {k.lens[r], KV, D}, vraw);
      ASSERT_TRUE(
          ReshapeAndCache(*cache, 0, kt, vt, RowSlots(rows, r, bs), 1.0f, 1.0f)
              .ok());
      K[r].resize(m);
      V[r].resize(m);
      for (int64_t i = 0; i < m; ++i) {
        K[r][i] = Quantize(k.cache, kraw[i], 1.0f);
        V[r][i] = Quantize(k.cache, vraw[i], 1.0f);
      }
    }
    const int64_t T = rows.query_start.back();
    std::vector<float> qraw(T * H * D);
    for (float& x : qraw) x = uni(rng);
    // fp8 caches take a bf16 query (their VDPBF16PS passes); the others
    // an fp32 one, so that the output is not rounded again.
    const DType act =
        k.cache == DType::kFp8E4M3 ? DType::kBFloat16 : DType::kFloat32;
    const Tensor q = Activations(act, {T, H, D}, qraw);
    AttentionParams p;
    p.kernel = k.kernel;
    p.sliding_window = k.window;
    p.parallel_min_bytes = 0;  // the pool, where given, for any call
    if (&k - calls < 8) {      // ranges that touch their slices first
      p.touch_min_bytes = p.touch_min_blocks = 0;
    }
    const int64_t before = internal::LongRowRangeCalls();
    Tensor out;
    const absl::Status st = PagedAttention(
        *cache, 0, q, rows, p, k.threads == 2 ? &pool : nullptr, &out);
    ASSERT_TRUE(st.ok()) << st;
    const bool taken =
        avx512 && BestLongRowRanges(DType::kBFloat16, CacheLayout::kVllm) &&
        k.taken;
    EXPECT_EQ(internal::LongRowRangeCalls() - before, taken ? 1 : 0)
        << DTypeName(k.cache) << " " << CacheLayoutName(k.layout) << " rows "
        << n << " of " << k.lens[0] << " keys, " << k.threads << " threads";
    if (!k.taken) continue;
    // Row by row against fp64 (the last query token of each row).
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    for (int64_t r = 0; r < n; ++r) {
      const int64_t qi = rows.query_start[r + 1] - 1, len = k.lens[r];
      const int64_t first =
          k.window > 0 ? std::max<int64_t>(0, len - k.window) : 0;
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> want(D, 0.0);
        ReferenceHead(q, qi, h, H, KV, K[r], V[r], first, len - 1, scale,
                      nullptr, want.data());
        for (int64_t d = 0; d < D; ++d) {
          const double got = Act(out, (qi * H + h) * D + d);
          ASSERT_NEAR(got, want[d], 1e-3 + 1e-5 * std::fabs(want[d]))
              << DTypeName(k.cache) << " row " << r << " head " << h << " dim "
              << d;
        }
      }
    }
  }
}

// Prefill chunks of 16-bit and fp32 caches in the vLLM layout (the
// AVX-512 build's value tiles of 8 virtual heads over ranges of blocks;
// for 16-bit caches its AMX tiles where the CPU has AMX-BF16, and without
// them; the other builds run the same cases): 39 query tokens (chunks of
// 16, 16 and 7, so tiles that repeat heads, and AMX head groups padded to
// 16) after 601 cached ones (several ranges, and a partial last block
// whose unwritten slots hold NaN at every block size), GQA 4 and 3, block
// sizes 8 (never AMX), 16 and 32, with and
// without a window that starts keys mid-block (AMX key tiles of part of 16
// tokens); fp16 also on a layer flagged as possibly holding Inf or NaN
// (the pass by pairs with its check instead, never AMX). Then bf16 with
// head sizes 64 and 256 (2 and 8 AMX steps of 32 dims), and fp32 queries
// against bf16 and fp16 caches (AMX: 3 query parts).
TEST(PagedAttention, PrefillChunksValueTiles) {
  const Dtypes dtypes[] = {{DType::kBFloat16, DType::kBFloat16},
                           {DType::kFloat16, DType::kFloat16},
                           {DType::kFloat16, DType::kBFloat16},
                           {DType::kFloat32, DType::kFloat32}};
  for (const Dtypes& d : dtypes) {
    for (int64_t bs : {8, 16, 32}) {
      for (auto [heads, kv] : {std::pair<int64_t, int64_t>{8, 2}, {6, 2}}) {
        for (int64_t window : {0, 307}) {
          for (bool flagged : {false, true}) {
            for (bool amx : {true, false}) {
              if (flagged && (d.cache != DType::kFloat16 || !amx)) continue;
              Case k = Make(CacheLayout::kVllm, d.cache, d.act, heads, kv);
              k.head_size = 128;
              k.block_size = bs;
              k.prefill_context = 601;
              k.prefill_tokens = 39;
              k.window = window;
              k.flagged = flagged;
              k.amx = amx;
              k.seed = bs * 10 + heads + window;
              const int64_t before = internal::AmxPasses();
              Check(k);
              if (HasFatalFailure()) return;
              // Both passes of every chunk of 16 or more virtual heads.
              if (amx && !flagged && bs != 8 && d.cache != DType::kFloat32 &&
                  AmxSupported()) {
                EXPECT_GE(internal::AmxPasses() - before, 6);
              } else {
                EXPECT_EQ(internal::AmxPasses(), before);
              }
            }
          }
        }
      }
    }
  }
  // The fp32 query's outputs are fp32, checked to 1e-3 + 1e-5 of the value,
  // and a scale of 2 makes the softmax peaked: weights rounded to bf16 alone
  // (AMX's values without their lo parts) would miss by about 2^-9 of the
  // largest weight's value, as would an fp32 query or fp16 keys or values
  // without theirs.
  for (auto [hs, cache, act] : {std::tuple<int64_t, DType, DType>{
                                    64, DType::kBFloat16, DType::kBFloat16},
                                {256, DType::kBFloat16, DType::kBFloat16},
                                {128, DType::kBFloat16, DType::kFloat32},
                                {128, DType::kFloat16, DType::kFloat32}}) {
    Case k = Make(CacheLayout::kVllm, cache, act, 8, 2);
    k.head_size = hs;
    k.scale = act == DType::kFloat32 ? 2.0 : 0.0;
    k.prefill_context = 300;
    k.prefill_tokens = 20;
    k.window = 250;
    const int64_t before = internal::AmxPasses();
    Check(k);
    if (HasFatalFailure()) return;
    if (AmxSupported()) {
      EXPECT_GE(internal::AmxPasses() - before, 4);
    }
  }
  // The 16-bit tile of 4 heads x 4 units needs a block's units in fours:
  // head 120 at block size 8 has 30 and takes 8 heads x 2, head 80 (20)
  // takes 4 x 4. Head sizes that are not multiples of 16 also take
  // ReduceLanesZ's scalar tail, over lanes folded in pairs (FoldPairZ:
  // fp32 at every block size, 16-bit at 16 and 32; HAddZ: 16-bit at 8).
  for (int64_t hs : {120, 80}) {
    for (DType cache : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      for (int64_t bs : {8, 16, 32}) {
        Case k = Make(CacheLayout::kVllm, cache, cache, 8, 2);
        k.head_size = hs;
        k.block_size = bs;
        k.prefill_context = 300;
        k.prefill_tokens = 20;
        k.window = 250;
        k.amx = false;
        k.seed = hs + bs;
        Check(k);
        if (HasFatalFailure()) return;
      }
    }
  }
  // A chunk of exactly 8 virtual heads (2 tokens, GQA 4): fp32's one head
  // tile, which stages nothing for others to read.
  for (int64_t bs : {8, 16, 32}) {
    Case k = Make(CacheLayout::kVllm, DType::kFloat32, DType::kFloat32, 8, 2);
    k.head_size = 128;
    k.block_size = bs;
    k.prefill_context = 300;
    k.prefill_tokens = 2;
    k.seed = bs;
    Check(k);
    if (HasFatalFailure()) return;
  }
}

// KvCache::MayHoldNonFinite: clear on a new cache, set per layer by a
// ReshapeAndCache that stores an Inf or NaN (an input one, or an fp16
// overflow), never by finite stores, carried by CopyBlock, never cleared.
TEST(ReshapeAndCache, NonFiniteFlagPerLayer) {
  const float inf = std::numeric_limits<float>::infinity();
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                      DType::kFp8E4M3, DType::kFp8E5M2}) {
    // fp8 stores saturate Inf (only NaN stays non-finite); 1e6 overflows
    // fp16 to Inf.
    std::vector<float> odd_values = {std::nanf("")};
    if (dtype != DType::kFp8E4M3 && dtype != DType::kFp8E5M2) {
      odd_values.push_back(-inf);
    }
    if (dtype == DType::kFloat16) odd_values.push_back(1e6f);
    for (float odd : odd_values) {
      for (bool key : {false, true}) {
        SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " " << odd
                                          << (key ? " key" : " value"));
        auto cache = SmallCache(dtype, 4, 8, 2, 16, 3);
        auto other = SmallCache(dtype, 4, 8, 2, 16, 3);
        std::vector<float> k(32, 0.5f), v(32, -0.25f);
        const int64_t slots[] = {3, 12};
        const auto write = [&](int64_t layer) {
          return ReshapeAndCache(
              *cache, layer, Activations(DType::kFloat32, {2, 2, 16}, k),
              Activations(DType::kFloat32, {2, 2, 16}, v), slots, 1, 1);
        };
        for (int64_t l = 0; l < 3; ++l) ASSERT_TRUE(write(l).ok());
        for (int64_t l = 0; l < 3; ++l)
          EXPECT_FALSE(cache->MayHoldNonFinite(l));
        (key ? k : v)[21] = odd;  // the second token's
        ASSERT_TRUE(write(1).ok());
        EXPECT_FALSE(cache->MayHoldNonFinite(0));
        EXPECT_TRUE(cache->MayHoldNonFinite(1));
        EXPECT_FALSE(cache->MayHoldNonFinite(2));
        // Finite stores over it do not clear it.
        (key ? k : v)[21] = 1.0f;
        ASSERT_TRUE(write(1).ok());
        EXPECT_TRUE(cache->MayHoldNonFinite(1));
        KvCache::CopyBlock(*cache, 0, *other, 3);
        EXPECT_FALSE(other->MayHoldNonFinite(0));
        EXPECT_TRUE(other->MayHoldNonFinite(1));
        EXPECT_FALSE(other->MayHoldNonFinite(2));
        // NoteNonFinite says whether it set the flag (ReshapeAndCache logs
        // a warning the first time a layer gets it).
        EXPECT_FALSE(other->NoteNonFinite(1));
        EXPECT_TRUE(other->NoteNonFinite(2));
        EXPECT_TRUE(other->MayHoldNonFinite(2));
      }
    }
  }
}

// PagedAttention writes into a given output tensor of the query's dtype
// and shape (the service's shared memory) whatever it held before, with
// the bytes a new output gets; one of another shape is replaced, and a
// refused call leaves it untouched.
TEST(PagedAttention, WritesIntoAGivenOutput) {
  constexpr int64_t kKv = 2, kH = 4, kD = 32, kBs = 16, kN = 40;
  auto cache = SmallCache(DType::kFloat32, 4, kBs, kKv, kD);
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<float> uni(-1, 1);
  std::vector<float> k(kN * kKv * kD), v(k.size()), q(kH * kD);
  for (float& x : k) x = uni(rng);
  for (float& x : v) x = uni(rng);
  for (float& x : q) x = uni(rng);
  std::vector<int64_t> slots(kN);
  std::iota(slots.begin(), slots.end(), 0);
  ASSERT_TRUE(ReshapeAndCache(
                  *cache, 0, Activations(DType::kFloat32, {kN, kKv, kD}, k),
                  Activations(DType::kFloat32, {kN, kKv, kD}, v), slots, 1, 1)
                  .ok());
  const Tensor query = Activations(DType::kFloat32, {1, kH, kD}, q);
  const AttentionRows rows = OneDecodeRow(kN, {0, 1, 2});
  Tensor fresh;
  ASSERT_TRUE(PagedAttention(*cache, 0, query, rows, {}, nullptr, &fresh).ok());
  std::vector<float> place(kH * kD, std::nanf(""));
  Tensor given = *Tensor::WrapHostBytes(DType::kFloat32, {1, kH, kD},
                                        place.data(), place.size() * 4);
  ASSERT_TRUE(PagedAttention(*cache, 0, query, rows, {}, nullptr, &given).ok());
  EXPECT_EQ(given.raw_data(), place.data());
  EXPECT_EQ(std::memcmp(place.data(), fresh.raw_data(), fresh.nbytes()), 0);
  // Another shape: a new tensor, the place untouched.
  std::vector<float> small(kD, 7.0f);
  Tensor other = *Tensor::WrapHostBytes(DType::kFloat32, {1, 1, kD},
                                        small.data(), small.size() * 4);
  ASSERT_TRUE(PagedAttention(*cache, 0, query, rows, {}, nullptr, &other).ok());
  EXPECT_NE(other.raw_data(), small.data());
  EXPECT_EQ(small, std::vector<float>(kD, 7.0f));
  // A refused call (layer out of range) writes nothing.
  std::fill(place.begin(), place.end(), 3.0f);
  EXPECT_FALSE(
      PagedAttention(*cache, 5, query, rows, {}, nullptr, &given).ok());
  EXPECT_EQ(place, std::vector<float>(kH * kD, 3.0f));
}

// ReshapeAndCache stores row by row (a same-type row as its bits); the
// bytes it leaves must be the per-element loop's it replaced, for every
// cache dtype, layout, block size and activation dtype (key and value of
// different ones too), with slot -1 skipped, NaN, Inf, values past fp8's
// and fp16's range and fp16 subnormals among the inputs; and a store of a
// same-type non-finite row flags the layer.
TEST(ReshapeAndCache, RowStoresMatchTheElementLoop) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> uni(-2, 2);
  const float odd[] = {std::nanf(""), std::numeric_limits<float>::infinity(),
                       -1e6f,         3e-6f,
                       500.0f,        -0.0f};
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                      DType::kFp8E4M3, DType::kFp8E5M2}) {
    for (CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
      for (int64_t bs : {8, 16}) {
        for (DType kd : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
          for (DType vd :
               {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
            SCOPED_TRACE(::testing::Message()
                         << DTypeName(dtype) << " " << CacheLayoutName(layout)
                         << " bs " << bs << " key " << DTypeName(kd)
                         << " value " << DTypeName(vd));
            constexpr int64_t kKv = 2, kD = 80, kBlocks = 6, kT = 7;
            auto fast = SmallCache(dtype, kBlocks, bs, kKv, kD, 1, layout);
            auto ref = SmallCache(dtype, kBlocks, bs, kKv, kD, 1, layout);
            // The same garbage under both: what a skipped slot keeps.
            for (KvCache* c : {fast.get(), ref.get()}) {
              for (const Tensor* side : {&c->key(0), &c->value(0)}) {
                auto* p =
                    static_cast<uint8_t*>(const_cast<void*>(side->raw_data()));
                for (size_t i = 0; i < side->nbytes(); ++i) {
                  p[i] = static_cast<uint8_t>(i * 7 + 3);
                }
              }
            }
            std::vector<float> k(kT * kKv * kD), v(k.size());
            for (size_t i = 0; i < k.size(); ++i) {
              k[i] = i % 13 == 0 ? odd[i / 13 % 6] : uni(rng);
              v[i] = i % 11 == 0 ? odd[i / 11 % 6] : uni(rng);
            }
            const std::vector<int64_t> slots = {
                0, bs * 3 + 5, -1, bs - 1, bs * 5 + 2, 1, bs * 2};
            const Tensor kt = Activations(kd, {kT, kKv, kD}, k);
            const Tensor vt = Activations(vd, {kT, kKv, kD}, v);
            ASSERT_TRUE(
                ReshapeAndCache(*fast, 0, kt, vt, slots, 0.5f, 2.0f).ok());
            ASSERT_TRUE(internal::ReshapeAndCacheReference(*ref, 0, kt, vt,
                                                           slots, 0.5f, 2.0f)
                            .ok());
            for (bool key : {true, false}) {
              const Tensor& a = key ? fast->key(0) : fast->value(0);
              const Tensor& b = key ? ref->key(0) : ref->value(0);
              ASSERT_EQ(a.nbytes(), b.nbytes());
              const auto* pa = static_cast<const uint8_t*>(a.raw_data());
              const auto* pb = static_cast<const uint8_t*>(b.raw_data());
              const auto diff = std::mismatch(pa, pa + a.nbytes(), pb);
              EXPECT_EQ(diff.first, pa + a.nbytes())
                  << (key ? "key" : "value") << " cache byte "
                  << (diff.first - pa);
            }
            // NaN is among the inputs, and stays NaN in every dtype.
            EXPECT_TRUE(fast->MayHoldNonFinite(0));
          }
        }
      }
    }
  }
}

// An fp16 Inf stored directly into the cache bytes, as a writer other than
// ReshapeAndCache could: on an unflagged layer the AVX-512 passes by pairs
// do not check for it (and the output comes out finite: the hazard the
// flag's contract names); once NoteNonFinite flags the layer, they find it
// and redo the passes by conversion, and the output is not finite, as
// through the portable build.
TEST(PagedAttention, UnflaggedLayerSkipsTheInfNanCheck) {
  if (!IsaSupported(AttentionParams::Isa::kAvx512)) {
    GTEST_SKIP() << "no AVX-512 on this CPU: no pass reads fp16 by pairs";
  }
  const int64_t D = 128, H = 8, KV = 2, n = 40, bs = 16;
  auto cache = SmallCache(DType::kFloat16, 4, bs, KV, D);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> uni(-1, 1);
  std::vector<float> kraw(n * KV * D), vraw(n * KV * D), qraw(H * D);
  for (auto* v : {&kraw, &vraw, &qraw}) {
    for (float& x : *v) x = uni(rng);
  }
  const AttentionRows rows = OneDecodeRow(n, {2, 0, 3});
  const std::vector<int64_t> slots = RowSlots(rows, 0, bs);
  ASSERT_TRUE(ReshapeAndCache(
                  *cache, 0, Activations(DType::kFloat32, {n, KV, D}, kraw),
                  Activations(DType::kFloat32, {n, KV, D}, vraw), slots, 1, 1)
                  .ok());
  ASSERT_FALSE(cache->MayHoldNonFinite(0));
  // Value of token 5 (block 2, offset 5), KV head 1, dim 3: +Inf.
  static_cast<uint16_t*>(
      cache->value(0).raw_data())[((2 * KV + 1) * D + 3) * bs + 5] = 0x7c00;
  const Tensor q = Activations(DType::kFloat32, {1, H, D}, qraw);
  const auto run = [&](AttentionParams::Isa isa) {
    AttentionParams p;
    p.isa = isa;
    Tensor out;
    EXPECT_TRUE(PagedAttention(*cache, 0, q, rows, p, nullptr, &out).ok());
    // Query heads 4-7 read KV head 1; element 3 of each.
    return out.data<float>()[4 * D + 3];
  };
  EXPECT_FALSE(std::isfinite(run(AttentionParams::Isa::kPortable)));
  int64_t before = internal::ConvertingRedos();
  EXPECT_TRUE(std::isfinite(run(AttentionParams::Isa::kAvx512)));
  EXPECT_EQ(internal::ConvertingRedos(), before);
  cache->NoteNonFinite(0);
  before = internal::ConvertingRedos();
  EXPECT_FALSE(std::isfinite(run(AttentionParams::Isa::kAvx512)));
  EXPECT_GT(internal::ConvertingRedos(), before);
}

// The raw vLLM layout, written out independently of the kernel: key
// [blocks, kv_heads, head/x, block, x] and value [blocks, kv_heads, head,
// block].
TEST(ReshapeAndCache, VllmLayoutOffsets) {
  auto cache = SmallCache(DType::kFloat32, 4, 8, 2, 16);  // x = 4
  std::vector<float> k(32), v(32);                        // 2 heads x 16
  for (int i = 0; i < 32; ++i) {
    k[i] = 100 + i;
    v[i] = 200 + i;
  }
  const Tensor kt = Activations(DType::kFloat32, {1, 2, 16}, k);
  const Tensor vt = Activations(DType::kFloat32, {1, 2, 16}, v);
  const int64_t slot = 2 * 8 + 5;  // block 2, offset 5
  ASSERT_TRUE(ReshapeAndCache(*cache, 0, kt, vt, {&slot, 1}, 1, 1).ok());
  const float* kc = cache->key(0).data<float>();
  const float* vc = cache->value(0).data<float>();
  for (int h = 0; h < 2; ++h) {
    for (int d = 0; d < 16; ++d) {
      EXPECT_EQ(kc[(((2 * 2 + h) * 4 + d / 4) * 8 + 5) * 4 + d % 4],
                100 + h * 16 + d);
      EXPECT_EQ(vc[((2 * 2 + h) * 16 + d) * 8 + 5], 200 + h * 16 + d);
    }
  }
  // -1 is skipped; a slot outside the pool writes nothing.
  const int64_t bad[] = {-1};
  EXPECT_TRUE(ReshapeAndCache(*cache, 0, kt, vt, bad, 1, 1).ok());
  const int64_t outside[] = {32};
  absl::Status s = ReshapeAndCache(*cache, 0, kt, vt, outside, 1, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(s.message()), HasSubstr("slot_mapping[0] = 32"));
}

// Threads claim a row's KV heads together (they share its blocks), in
// claims that divide the items evenly among the threads, or that are many.
TEST(PagedAttention, ClaimSizeKeepsHeadsTogetherAndThreadsEven) {
  EXPECT_EQ(internal::ClaimSize(8, 8, 2), 4);      // batch 1: half a row each
  EXPECT_EQ(internal::ClaimSize(24, 8, 2), 6);     // 3 rows: 4 claims
  EXPECT_EQ(internal::ClaimSize(128, 8, 2), 8);    // a row per claim
  EXPECT_EQ(internal::ClaimSize(2048, 8, 16), 8);  // 256 claims
  EXPECT_EQ(internal::ClaimSize(96, 32, 2), 24);   // MHA, 3 rows: 4 claims
  EXPECT_EQ(internal::ClaimSize(6, 2, 2), 1);      // 3 claims of 2: uneven
  EXPECT_EQ(internal::ClaimSize(8, 8, 16), 1);     // more threads than items
  EXPECT_EQ(internal::ClaimSize(40, 8, 1), 8);     // one thread: whole rows
  EXPECT_EQ(internal::ClaimSize(5, 1, 2), 1);      // MQA
  for (int64_t threads : {1, 2, 3, 8}) {
    for (int64_t kvh : {1, 2, 4, 8, 32}) {
      for (int64_t rows = 1; rows <= 40; ++rows) {
        const int64_t n = rows * kvh, g = internal::ClaimSize(n, kvh, threads);
        ASSERT_GE(g, 1);
        ASSERT_LE(g, kvh);
        if (g == 1) continue;
        ASSERT_EQ(n % g, 0) << n << " " << g;
        ASSERT_TRUE((n / g) % threads == 0 || n / g >= 8 * threads)
            << n << " items, " << threads << " threads, claims of " << g;
      }
    }
  }
}

// A call whose rows differ in query tokens (a prefill chunk beside decode
// rows) is claimed by UnevenClaims: every (row, KV head, query token) once,
// heaviest claims first, and no thread left far behind when the threads
// take them as Run does (even-numbered threads from the heavy end, odd
// ones from the light end, each the next as it finishes one; simulated
// with a claim's time as its work). ClaimSize's whole-row claims put a
// 512-token chunk on one thread: 1.76x the two threads' time.
TEST(PagedAttention, UnevenClaimsCoverEveryItemOnceAndBalance) {
  struct Shape {
    std::vector<int64_t> tokens, lens;
    int64_t kvh, window, row_tokens;
  };
  const std::vector<int64_t> decode16(16, 1), lens16(16, 2048);
  auto cat = [](std::vector<int64_t> a, const std::vector<int64_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<Shape> shapes = {
      // A 512-token chunk, then 16 decode rows; per KV head and by rows.
      {cat({512}, decode16), cat({2048}, lens16), 8, 0, 0},
      {cat({512}, decode16), cat({2048}, lens16), 8, 0, 1},
      // One KV head (a tensor-parallel shard): the chunk is cut by tokens.
      {cat({512}, decode16), cat({2048}, lens16), 1, 0, 1},
      // Decode rows first, two chunks of other sizes, a sliding window.
      {{1, 1, 64, 1, 300, 1, 0}, {4000, 90, 600, 7, 900, 1, 5}, 4, 256, 0},
      // Short decode rows beside a 17-token chunk (two chunks, one token).
      {{1, 17, 1, 1}, {40, 17, 3, 100}, 2, 0, 1},
  };
  constexpr int64_t kChunk = 16;
  for (const Shape& sh : shapes) {
    AttentionRows rows;
    rows.num_real = static_cast<int64_t>(sh.tokens.size());
    rows.query_start = {0};
    for (int64_t t : sh.tokens) {
      rows.query_start.push_back(rows.query_start.back() + t);
    }
    rows.seq_lens = sh.lens;
    // Keys of row r's chunk from token qi: causal within the window.
    auto chunk_keys = [&](int64_t r, int64_t qi) {
      const int64_t qe = rows.query_start[r + 1];
      const int64_t ntok = std::min(kChunk, qe - qi);
      const int64_t pos0 = rows.seq_lens[r] - (qe - qi);
      const int64_t hi = pos0 + ntok;
      const int64_t lo =
          sh.window > 0 ? std::max<int64_t>(0, pos0 - sh.window + 1) : 0;
      return hi - lo;
    };
    for (int64_t threads : {1, 2, 3}) {
      SCOPED_TRACE(::testing::Message()
                   << sh.tokens.size() << " rows, " << sh.kvh << " KV heads, "
                   << threads << " threads, row_tokens " << sh.row_tokens);
      const std::vector<internal::ItemClaim> claims = internal::UnevenClaims(
          rows, sh.kvh, threads, kChunk, sh.row_tokens, chunk_keys);
      // Every (row, KV head, query token) exactly once; work as claimed.
      std::vector<int> seen(rows.query_start.back() * sh.kvh, 0);
      double all = 0, most = 0;
      for (size_t i = 0; i < claims.size(); ++i) {
        const internal::ItemClaim& c = claims[i];
        ASSERT_GE(c.row, 0);
        ASSERT_LT(c.row, rows.num_real);
        const int64_t qs = rows.query_start[c.row];
        const int64_t qe = rows.query_start[c.row + 1];
        ASSERT_TRUE(qs <= c.q0 && c.q0 < c.q1 && c.q1 <= qe);
        ASSERT_EQ((c.q0 - qs) % kChunk, 0) << "pieces start on a chunk";
        ASSERT_TRUE(0 <= c.h0 && c.h0 < c.h1 && c.h1 <= sh.kvh);
        EXPECT_EQ(c.whole, sh.row_tokens > 0 && qe - qs <= sh.row_tokens);
        if (c.whole) {
          EXPECT_TRUE(c.h0 == 0 && c.h1 == sh.kvh && c.q0 == qs && c.q1 == qe);
        }
        double w = 0;
        for (int64_t qi = c.q0; qi < c.q1; qi += kChunk) {
          w += static_cast<double>(std::min(kChunk, qe - qi) *
                                   chunk_keys(c.row, qi));
        }
        EXPECT_DOUBLE_EQ(c.work, w * static_cast<double>(c.h1 - c.h0));
        for (int64_t h = c.h0; h < c.h1; ++h) {
          for (int64_t q = c.q0; q < c.q1; ++q) ++seen[q * sh.kvh + h];
        }
        if (i > 0) {
          EXPECT_GE(claims[i - 1].work, c.work) << "heaviest first";
        }
        all += c.work;
        most = std::max(most, c.work);
      }
      for (size_t i = 0; i < seen.size(); ++i) {
        ASSERT_EQ(seen[i], 1)
            << "token " << i / sh.kvh << " head " << i % sh.kvh;
      }
      // Coarse: over a quarter of a thread's share of the call.
      for (const internal::ItemClaim& c : claims) {
        EXPECT_EQ(c.coarse, c.work * 4 * static_cast<double>(threads) > all);
      }
      // The threads as Run's claims from both ends run them.
      std::vector<double> load(threads, 0.0);
      size_t front = 0, back = claims.size();
      while (front < back) {
        const auto t = static_cast<size_t>(
            std::min_element(load.begin(), load.end()) - load.begin());
        load[t] += t % 2 == 0 || claims[front].coarse ? claims[front++].work
                                                      : claims[--back].work;
      }
      // Within 10% of an even split, or one claim's work (a row that
      // cannot be cut: a whole row, or one chunk of one head).
      const double finish = *std::max_element(load.begin(), load.end());
      EXPECT_LE(finish,
                std::max(1.10 * all / static_cast<double>(threads), most))
          << "claims " << claims.size();
    }
  }
}

// A prefill chunk and decode rows in one call give, bit for bit, what the
// two give in separate calls, on one thread and on two: UnevenClaims' claims
// (the chunk cut by KV head and by tokens, the decode rows over every KV
// head) run the kernel's own passes, each token's alone.
TEST(PagedAttention, MixedBatchMatchesItsPartsBitForBit) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> uni(-1, 1);
  for (CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
    SCOPED_TRACE(CacheLayoutName(layout));
    CacheConfig c;
    c.num_blocks = 400;
    c.block_size = 16;
    c.num_layers = 1;
    c.num_kv_heads = 2;
    c.head_size = 64;
    c.dtype = DType::kBFloat16;
    c.layout = layout;
    auto cache = *KvCache::Create(c, CpuDevice());
    FillBf16Cache(*cache, rng);
    // Row 0: a chunk of 300 query tokens ending at 900 keys; rows 1-5
    // decode rows of 40-1000 keys.
    const std::vector<int64_t> tokens = {300, 1, 1, 1, 1, 1};
    const std::vector<int64_t> lens = {900, 40, 1000, 333, 17, 640};
    const int64_t width = 63;
    std::vector<int64_t> perm(c.num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    auto make_rows = [&](int64_t r0, int64_t r1) {
      AttentionRows rows;
      rows.num_real = r1 - r0;
      rows.width = width;
      rows.query_start = {0};
      for (int64_t r = r0; r < r1; ++r) {
        rows.query_start.push_back(rows.query_start.back() + tokens[r]);
        rows.seq_lens.push_back(lens[r]);
        rows.block_tables.insert(rows.block_tables.end(),
                                 perm.begin() + r * width,
                                 perm.begin() + (r + 1) * width);
      }
      return rows;
    };
    const AttentionRows mixed = make_rows(0, 6), chunk = make_rows(0, 1),
                        decode = make_rows(1, 6);
    const int64_t T = mixed.query_start.back();
    std::vector<float> qraw(T * 8 * 64);
    for (float& x : qraw) x = uni(rng);
    const Tensor q = Activations(DType::kBFloat16, {T, 8, 64}, qraw);
    constexpr int64_t kChunkFloats = int64_t{300} * 8 * 64;
    const Tensor q_chunk = Activations(
        DType::kBFloat16, {300, 8, 64},
        std::vector<float>(qraw.begin(), qraw.begin() + kChunkFloats));
    const Tensor q_decode = Activations(
        DType::kBFloat16, {5, 8, 64},
        std::vector<float>(qraw.begin() + kChunkFloats, qraw.end()));
    AttentionParams p;
    p.parallel_min_bytes = 0;  // both threads, however small the call
    for (int threads : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << threads << " threads");
      ThreadPool pool(threads);
      Tensor out, out_chunk, out_decode;
      const int64_t before = internal::UnevenClaimCalls();
      ASSERT_TRUE(PagedAttention(*cache, 0, q, mixed, p, &pool, &out).ok());
      EXPECT_EQ(internal::UnevenClaimCalls(), before + 1);
      // The chunk alone has 2 items, fewer than twice the threads, which
      // kAuto takes by partitions (v2, other sums) on two threads.
      AttentionParams single = p;
      single.kernel = AttentionParams::Kernel::kSinglePass;
      ASSERT_TRUE(
          PagedAttention(*cache, 0, q_chunk, chunk, single, &pool, &out_chunk)
              .ok());
      ASSERT_TRUE(PagedAttention(*cache, 0, q_decode, decode, single, &pool,
                                 &out_decode)
                      .ok());
      EXPECT_EQ(internal::UnevenClaimCalls(), before + 1);
      std::vector<uint8_t> parts = TensorBytes(out_chunk);
      const std::vector<uint8_t> d = TensorBytes(out_decode);
      parts.insert(parts.end(), d.begin(), d.end());
      EXPECT_TRUE(TensorBytes(out) == parts);
    }
  }
}

// A prefill chunk of one KV head alone is one item: kAuto takes it by
// UnevenClaims' pieces (by chunks of query tokens) rather than by v2's
// partitions or on one thread, with the single pass's output bit for
// bit, on one thread and two; kPartitioned still takes v2 (no claims).
TEST(PagedAttention, FewPrefillItemsTakeClaimsNotPartitions) {
  std::mt19937_64 rng(12);
  std::uniform_real_distribution<float> uni(-1, 1);
  auto cache = SmallCache(DType::kBFloat16, 80, 16, 1, 64);
  FillBf16Cache(*cache, rng);
  AttentionRows rows;
  rows.num_real = 1;
  rows.width = 70;
  rows.query_start = {0, 200};
  rows.block_tables.resize(70);
  std::iota(rows.block_tables.begin(), rows.block_tables.end(), 5);
  std::shuffle(rows.block_tables.begin(), rows.block_tables.end(), rng);
  std::vector<float> qraw(size_t{200} * 4 * 64);
  for (float& x : qraw) x = uni(rng);
  const Tensor q = Activations(DType::kBFloat16, {200, 4, 64}, qraw);
  // 1100 keys: 3 partitions of 512 (v2 before); 300: one (one thread).
  for (auto [keys, threads] :
       {std::pair<int64_t, int>{1100, 1}, {1100, 2}, {300, 1}, {300, 2}}) {
    SCOPED_TRACE(::testing::Message()
                 << keys << " keys, " << threads << " threads");
    rows.seq_lens = {keys};
    ThreadPool pool(threads);
    AttentionParams p;
    p.parallel_min_bytes = 0;
    Tensor single, auto_out, v2;
    p.kernel = AttentionParams::Kernel::kSinglePass;
    ASSERT_TRUE(PagedAttention(*cache, 0, q, rows, p, &pool, &single).ok());
    const int64_t before = internal::UnevenClaimCalls();
    p.kernel = AttentionParams::Kernel::kAuto;
    ASSERT_TRUE(PagedAttention(*cache, 0, q, rows, p, &pool, &auto_out).ok());
    EXPECT_EQ(internal::UnevenClaimCalls(), before + 1);
    EXPECT_TRUE(TensorBytes(auto_out) == TensorBytes(single));
    p.kernel = AttentionParams::Kernel::kPartitioned;
    ASSERT_TRUE(PagedAttention(*cache, 0, q, rows, p, &pool, &v2).ok());
    EXPECT_EQ(internal::UnevenClaimCalls(), before + 1);
  }
}

// Each thread keeps its kernel scratch from call to call (ScratchLease):
// a call's output must not depend on what the thread ran before. A decode
// call (bf16, vLLM rows) is run on a thread's fresh scratch, then after a
// prefill chunk of another geometry (fp32, 3 query heads over 1, head 80,
// a longer context: bigger logits, other query layouts) on the same
// threads, bit for bit, on one thread and on two.
TEST(PagedAttention, KeptScratchLeavesNoTraceInTheNextCall) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> uni(-1, 1);
  auto fill = [&](KvCache& cache) {
    for (const Tensor* t : {&cache.key(0), &cache.value(0)}) {
      void* raw = t->raw_data();
      if (t->dtype() == DType::kFloat32) {
        for (size_t i = 0; i < t->nbytes() / 4; ++i) {
          static_cast<float*>(raw)[i] = uni(rng);
        }
      } else {
        for (size_t i = 0; i < t->nbytes() / 2; ++i) {
          static_cast<uint16_t*>(raw)[i] = FloatToBF16(uni(rng));
        }
      }
    }
  };
  auto random_tensor = [&](DType d, Shape shape) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = uni(rng);
    return Activations(d, std::move(shape), v);
  };
  // A: one decode row of 1100 keys, 8 query heads over 2, head 128.
  auto cache_a = SmallCache(DType::kBFloat16, 80, 16, 2, 128);
  fill(*cache_a);
  std::vector<int64_t> table_a(70);
  std::iota(table_a.begin(), table_a.end(), 5);
  std::shuffle(table_a.begin(), table_a.end(), rng);
  const AttentionRows rows_a = OneDecodeRow(1100, table_a);
  const Tensor q_a = random_tensor(DType::kBFloat16, {1, 8, 128});
  // B: a prefill chunk of 40 query tokens ending at 3000 keys.
  auto cache_b = SmallCache(DType::kFloat32, 200, 16, 1, 80);
  fill(*cache_b);
  AttentionRows rows_b;
  rows_b.num_real = 1;
  rows_b.width = 188;
  rows_b.query_start = {0, 40};
  rows_b.seq_lens = {3000};
  rows_b.block_tables.resize(188);
  std::iota(rows_b.block_tables.begin(), rows_b.block_tables.end(), 10);
  std::shuffle(rows_b.block_tables.begin(), rows_b.block_tables.end(), rng);
  const Tensor q_b = random_tensor(DType::kFloat32, {40, 3, 80});

  AttentionParams p;
  auto run = [&](const KvCache& cache, const Tensor& q,
                 const AttentionRows& rows, ThreadPool* pool) {
    Tensor out;
    const absl::Status s = PagedAttention(cache, 0, q, rows, p, pool, &out);
    EXPECT_TRUE(s.ok()) << s;
    return TensorBytes(out);
  };
  for (int threads : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << threads << " threads");
    // Fresh threads, hence fresh scratch, for the first of each call.
    std::vector<uint8_t> a_fresh, b_fresh;
    std::thread([&] {
      ThreadPool pool(threads);
      a_fresh = run(*cache_a, q_a, rows_a, &pool);
    }).join();
    std::thread([&] {
      ThreadPool pool(threads);
      b_fresh = run(*cache_b, q_b, rows_b, &pool);
    }).join();
    ThreadPool pool(threads);
    EXPECT_EQ(run(*cache_a, q_a, rows_a, &pool), a_fresh);
    EXPECT_EQ(run(*cache_b, q_b, rows_b, &pool), b_fresh);
    EXPECT_EQ(run(*cache_a, q_a, rows_a, &pool), a_fresh);
    EXPECT_EQ(run(*cache_b, q_b, rows_b, &pool), b_fresh);
  }
}

TEST(PagedAttention, ValidationNamesTheRow) {
  auto cache = SmallCache(DType::kFloat16, 4, 4, 2, 8);
  AttentionRows rows;
  rows.query_start = {0, 1, 2};
  rows.seq_lens = {3, 9};
  rows.width = 2;
  rows.block_tables = {0, 1, 2, 3};
  rows.num_real = 2;
  const Tensor q =
      Activations(DType::kFloat16, {2, 4, 8}, std::vector<float>(64, 0.1f));
  Tensor out;
  absl::Status s = PagedAttention(*cache, 0, q, rows, {}, nullptr, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("row 1: seq_len 9 needs 3 blocks"));
  rows.seq_lens = {3, 8};
  rows.block_tables[1] = 7;  // row 0 (3 tokens) never reads entry 1
  EXPECT_TRUE(PagedAttention(*cache, 0, q, rows, {}, nullptr, &out).ok());
  rows.block_tables[0] = 7;
  s = PagedAttention(*cache, 0, q, rows, {}, nullptr, &out);
  EXPECT_THAT(std::string(s.message()), HasSubstr("block_tables[0][0] = 7"));
  rows.block_tables[0] = 0;
  EXPECT_TRUE(PagedAttention(*cache, 0, q, rows, {}, nullptr, &out).ok());
  const Tensor q3 =
      Activations(DType::kFloat16, {2, 3, 8}, std::vector<float>(48, 0.1f));
  EXPECT_EQ(PagedAttention(*cache, 0, q3, rows, {}, nullptr, &out).code(),
            absl::StatusCode::kInvalidArgument);  // 3 heads, 2 KV heads
  AttentionParams p;
  p.alibi_slopes = {1, 2};
  EXPECT_EQ(PagedAttention(*cache, 0, q, rows, p, nullptr, &out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PagedAttention(*cache, 1, q, rows, {}, nullptr, &out).code(),
            absl::StatusCode::kOutOfRange);
  p = {};
  p.parallel_min_bytes = -1;
  s = PagedAttention(*cache, 0, q, rows, p, nullptr, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("parallel_min_bytes"));
  for (int64_t bad : {int64_t{-2}, std::numeric_limits<int64_t>::min()}) {
    p = {};
    p.touch_min_bytes = bad;
    s = PagedAttention(*cache, 0, q, rows, p, nullptr, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("touch_min_bytes"));
    p = {};
    p.touch_min_blocks = bad;
    s = PagedAttention(*cache, 0, q, rows, p, nullptr, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("touch_min_blocks"));
  }
}

}  // namespace
}  // namespace kvstep
