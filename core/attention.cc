#include "core/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_format.h"
#include "core/float_convert.h"

// The 8-float vector helpers below are internal and always inlined, so no
// call crosses an ABI boundary with an AVX vector; clang's -Wpsabi warning
// about their by-value vectors in non-AVX contexts does not apply.
#pragma clang diagnostic ignored "-Wpsabi"

namespace kvstep {
namespace {

bool IsActivationType(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

// Activation (query/key/value/out) element access.
inline float LoadAct(DType d, const void* p, int64_t i) {
  switch (d) {
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16:
      return BF16ToFloat(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

inline void StoreAct(DType d, void* p, int64_t i, float v) {
  switch (d) {
    case DType::kFloat16:
      static_cast<uint16_t*>(p)[i] = FloatToHalf(v);
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = FloatToBF16(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

// exp(x) for x <= 0 (logits minus their max), branch-free so that loops
// over it vectorize: 2^(x log2 e) split into 2^n * 2^f with a degree-6
// polynomial for 2^f on [-0.5, 0.5]; relative error ~2e-7. At or below
// -87 (exp underflows there anyway), and for NaN, it returns exactly 0.
__attribute__((always_inline)) inline float FastExp(float x) {
  // Masked keys (-inf) and NaN weigh exactly 0; this also keeps the int
  // conversion below in range.
  const bool zero = !(x > -87.0f);
  x = zero ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  // Round to nearest by the 1.5 * 2^23 trick (|t| < 2^22 here), which
  // vectorizes on any x86 where nearbyint needs SSE4.1.
  const float n = (t + 12582912.0f) - 12582912.0f;
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  const float r = p * BitsFloat(static_cast<uint32_t>(e < 1 ? 0 : e) << 23);
  return zero ? 0.0f : r;
}

// Branch-free half -> float, so that conversion loops vectorize: the
// exponent is rebased by a multiply by 2^112 (normals and subnormals alike);
// infinities and NaNs keep an all-ones exponent.
inline float HalfToFloatFast(uint16_t h) {
  const uint32_t em = h & 0x7fffu;
  const float mag = BitsFloat(em << 13) * 5.192296858534828e+33f;  // 2^112
  const uint32_t bits =
      em >= 0x7c00u ? (0x7f800000u | (em << 13)) : FloatBits(mag);
  return BitsFloat(bits | (uint32_t{h & 0x8000u} << 16));
}

// Cache element access, one instantiation per cache dtype.
template <DType kCache>
struct CacheElem;
template <>
struct CacheElem<DType::kFloat32> {
  using T = float;
  static float Load(T v, float) { return v; }
  static T Store(float v, float) { return v; }
};
template <>
struct CacheElem<DType::kFloat16> {
  using T = uint16_t;
  static float Load(T v, float) { return HalfToFloatFast(v); }
  static T Store(float v, float) { return FloatToHalf(v); }
};
template <>
struct CacheElem<DType::kBFloat16> {
  using T = uint16_t;
  static float Load(T v, float) { return BF16ToFloat(v); }
  static T Store(float v, float) { return FloatToBF16(v); }
};
template <>
struct CacheElem<DType::kFp8E4M3> {
  using T = uint8_t;
  static float Load(T v, float s) { return Fp8E4M3ToFloat(v) * s; }
  static T Store(float v, float s) { return FloatToFp8E4M3(v / s); }
};
template <>
struct CacheElem<DType::kFp8E5M2> {
  using T = uint8_t;
  static float Load(T v, float s) { return Fp8E5M2ToFloat(v) * s; }
  static T Store(float v, float s) { return FloatToFp8E5M2(v / s); }
};

// 8 floats as one vector (a ymm register inside the AVX2/AVX-512 wrappers,
// two xmm elsewhere), with explicit loads and stores.
typedef float F8 __attribute__((vector_size(32)));
__attribute__((always_inline)) inline F8 LoadF8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline void StoreF8(float* p, F8 v) {
  std::memcpy(p, &v, sizeof(v));
}

// 8 cache elements to floats. The generic version goes element by element;
// bf16 and fp16 widen as vectors.
template <typename Elem>
__attribute__((always_inline)) inline F8 Convert8(const typename Elem::T* src,
                                                  float scale) {
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = Elem::Load(src[i], scale);
  return LoadF8(f);
}

__attribute__((always_inline)) inline F8 HAdd(F8 a, F8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
// The sums of eight vectors, as one vector: r[i] = sum of v[i]'s lanes.
__attribute__((always_inline)) inline F8 TransposeSum(const F8* v) {
  const F8 a = HAdd(HAdd(v[0], v[1]), HAdd(v[2], v[3]));
  const F8 b = HAdd(HAdd(v[4], v[5]), HAdd(v[6], v[7]));
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
__attribute__((always_inline)) inline float HSum(F8 v) {
  float f[8];
  std::memcpy(f, &v, sizeof(f));
  return ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
}

typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

template <>
__attribute__((always_inline)) inline F8 Convert8<CacheElem<DType::kBFloat16>>(
    const uint16_t* src, float) {
  U16x8 h;
  std::memcpy(&h, src, sizeof(h));
  const U32x8 w = __builtin_convertvector(h, U32x8) << 16;
  F8 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

template <>
__attribute__((always_inline)) inline F8 Convert8<CacheElem<DType::kFloat16>>(
    const uint16_t* src, float) {
  U16x8 h;
  std::memcpy(&h, src, sizeof(h));
  const U32x8 w = __builtin_convertvector(h, U32x8);
  const U32x8 em = w & 0x7fffu;
  F8 mag;
  const U32x8 shifted = em << 13;
  std::memcpy(&mag, &shifted, sizeof(mag));
  mag *= 5.192296858534828e+33f;  // 2^112: rebases the exponent
  U32x8 bits;
  std::memcpy(&bits, &mag, sizeof(bits));
  const U32x8 special = em >= 0x7c00u;  // all ones where inf or NaN
  bits = (special & (0x7f800000u | shifted)) | (~special & bits);
  bits |= (w & 0x8000u) << 16;
  F8 f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename F>
decltype(auto) DispatchCache(DType d, F&& f) {
  switch (d) {
    case DType::kFloat16:
      return f(CacheElem<DType::kFloat16>());
    case DType::kBFloat16:
      return f(CacheElem<DType::kBFloat16>());
    case DType::kFp8E4M3:
      return f(CacheElem<DType::kFp8E4M3>());
    case DType::kFp8E5M2:
      return f(CacheElem<DType::kFp8E5M2>());
    default:
      return f(CacheElem<DType::kFloat32>());
  }
}

// Element offsets of (block, head, dim, token) in each layout.
struct Geometry {
  int64_t bs, heads, d, x;
  bool vllm;
  int64_t KeyIndex(int64_t b, int64_t h, int64_t dim, int64_t t) const {
    if (vllm)
      return (((b * heads + h) * (d / x) + dim / x) * bs + t) * x + dim % x;
    return ((b * bs + t) * heads + h) * d + dim;
  }
  int64_t ValueIndex(int64_t b, int64_t h, int64_t dim, int64_t t) const {
    if (vllm) return ((b * heads + h) * d + dim) * bs + t;
    return ((b * bs + t) * heads + h) * d + dim;
  }
};

Geometry GeometryOf(const CacheConfig& c) {
  return Geometry{c.block_size, c.num_kv_heads, c.head_size,
                  c.layout == CacheLayout::kVllm ? c.vllm_x() : 1,
                  c.layout == CacheLayout::kVllm};
}

// Independent accumulators let the compiler vectorize without reassociating
// a single float sum.
__attribute__((always_inline)) inline float Dot(const float* a, const float* b,
                                                int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  }
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  for (float v : acc) s += v;
  return s;
}

__attribute__((always_inline)) inline void Axpy(float* y, float a,
                                                const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// One work item's scratch, reused across items on a thread.
struct Scratch {
  std::vector<float> q, logits, tile, acc, lanes;
  // The current chunk: nv = tokens * group "virtual heads" (token-major);
  // token k of the chunk is at position pos0 + k.
  int64_t nv = 0;
  int64_t pos0 = 0;
};

template <typename Elem>
class Attender {
 public:
  using T = typename Elem::T;
  Attender(const KvCache& cache, int64_t layer, const Tensor& query,
           const AttentionRows& rows, const AttentionParams& p, Tensor* out)
      : c_(cache.config()),
        g_(GeometryOf(cache.config())),
        k_(static_cast<const T*>(cache.key(layer).raw_data())),
        v_(static_cast<const T*>(cache.value(layer).raw_data())),
        q_(query),
        rows_(rows),
        p_(p),
        out_(out),
        heads_(query.dim(1)),
        group_(query.dim(1) / cache.config().num_kv_heads),
        scale_(p.scale > 0
                   ? static_cast<float>(p.scale)
                   : 1.0f / std::sqrt(static_cast<float>(c_.head_size))) {}

  // Attention of `ntok` consecutive query tokens of row `r` (from token
  // index qi0, the first at position pos0), for the query heads of KV head
  // `h`, over keys [lo, hi) (each token also limited by causality and the
  // sliding window). Writes, per (token, query head), the max logit, the
  // exp-sum and the unnormalized weighted sum of values. The tokens share
  // each K/V block read: a prefill chunk reads its context once per chunk,
  // not once per token.
  void Partial(Scratch& s, int64_t r, int64_t h, int64_t qi0, int64_t ntok,
               int64_t pos0, int64_t lo, int64_t hi, float* m_out, float* s_out,
               float* acc_out) const {
    const int64_t D = c_.head_size, G = group_;
    const int64_t nv = ntok * G;
    const int64_t n = hi - lo;
    s.nv = nv;
    s.pos0 = pos0;
    s.q.resize(nv * D);
    s.logits.resize(nv * (n + 2 * c_.block_size));
    s.tile.resize(c_.block_size * D);
    // Lane accumulators serve only block sizes that are not a multiple of
    // 8 (values) and fp32 keys (x = 4); other paths accumulate in registers.
    const bool lanes = c_.block_size % 8 != 0 || c_.block_size > 32 ||
                       (g_.vllm && g_.x % 8 != 0);
    if (lanes) s.lanes.resize(nv * D * std::max<int64_t>(c_.block_size, g_.x));
    s.acc.resize(nv * c_.block_size);
    const DType qd = q_.dtype();
    for (int64_t k = 0; k < ntok; ++k) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t base = ((qi0 + k) * heads_ + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) {
          s.q[(k * G + g) * D + d] =
              LoadAct(qd, q_.raw_data(), base + d) * scale_;
        }
      }
    }
    kernel_(*this, s, r, h, pos0, lo, hi, m_out, s_out, acc_out);
  }

  // The body of Partial, always inlined into one wrapper per instruction
  // set (see Dispatch), so that the same loops are vectorized for AVX2 or
  // AVX-512 and chosen at run time.
  __attribute__((always_inline)) inline void Body(Scratch& s, int64_t r,
                                                  int64_t h, int64_t pos,
                                                  int64_t lo, int64_t hi,
                                                  float* m_out, float* s_out,
                                                  float* acc_out) const {
    const int64_t D = c_.head_size, bs = c_.block_size, G = s.nv;
    const int64_t n = hi - lo;
    const int64_t* table = &rows_.block_tables[r * rows_.width];
    (void)pos;  // per virtual head: s.pos0 + vh / group_
    // Pass 1: logits, one K block at a time.
    for (int64_t c = lo / bs; c * bs < hi; ++c) {
      const int64_t t0 = (lo > c * bs ? lo : c * bs) - c * bs;
      const int64_t t1 = (hi < (c + 1) * bs ? hi : (c + 1) * bs) - c * bs;
      if (c + 1 < (hi + bs - 1) / bs) Prefetch(table[c + 1], h);
      float* lg = &s.logits[0];
      if (g_.vllm) {
        KeyLogitsVllm(table[c], h, t0, t1, s, c * bs - lo, n);
      } else {
        LoadKeys(table[c], h, t0, t1, s.tile.data());
        for (int64_t t = t0; t < t1; ++t) {
          for (int64_t g = 0; g < G; ++g) {
            lg[g * n + (c * bs + t - lo)] = Dot(&s.q[g * D], &s.tile[t * D], D);
          }
        }
      }
      if (!p_.alibi_slopes.empty()) {
        for (int64_t g = 0; g < G; ++g) {
          const float slope = p_.alibi_slopes[h * group_ + g % group_];
          const int64_t pg = s.pos0 + g / group_;
          for (int64_t t = t0; t < t1; ++t) {
            lg[g * n + (c * bs + t - lo)] +=
                slope * static_cast<float>(c * bs + t - pg);
          }
        }
      }
    }
    // Each token sees only keys j <= its position (and inside its window):
    // the others are masked, and weigh exactly 0 after the softmax.
    for (int64_t g = 0; g < G; ++g) {
      const int64_t pg = s.pos0 + g / group_;
      const int64_t wlo =
          p_.sliding_window > 0 ? pg - p_.sliding_window + 1 : 0;
      float* l = &s.logits[g * n];
      for (int64_t j = 0; j < n; ++j) {
        if (lo + j > pg || lo + j < wlo) {
          l[j] = -std::numeric_limits<float>::infinity();
        }
      }
    }
    // Softmax numerators per query head (exact: max subtracted).
    for (int64_t g = 0; g < G; ++g) {
      float* l = &s.logits[g * n];
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) m = l[j] > m ? l[j] : m;
      float sum = 0;
      if (m == -std::numeric_limits<float>::infinity()) {
        // No key in range for this token (a partition before its window).
        for (int64_t j = 0; j < n; ++j) l[j] = 0.0f;
      } else {
        for (int64_t j = 0; j < n; ++j) {
          l[j] = FastExp(l[j] - m);
          sum += l[j];
        }
      }
      m_out[g] = m;
      s_out[g] = sum;
    }
    // Pass 2: weighted values, one V block at a time.
    if (g_.vllm) {
      ValuesVllm(table, h, lo, hi, s, acc_out);
      return;
    }
    for (int64_t i = 0; i < G * D; ++i) acc_out[i] = 0.0f;
    for (int64_t c = lo / bs; c * bs < hi; ++c) {
      const int64_t t0 = (lo > c * bs ? lo : c * bs) - c * bs;
      const int64_t t1 = (hi < (c + 1) * bs ? hi : (c + 1) * bs) - c * bs;
      LoadValues(table[c], h, t0, t1, s.tile.data());
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t j = c * bs + t;
        for (int64_t g = 0; g < G; ++g) {
          Axpy(&acc_out[g * D], s.logits[g * n + (j - lo)], &s.tile[t * D], D);
        }
      }
    }
  }

  // Query tokens per chunk: a prefill chunk's tokens share K/V reads.
  static constexpr int64_t kChunk = 16;

  // The chunk of row `r` starting at token qi (the row's tokens end at qe):
  // its token count, first position, and the union of its tokens' key
  // ranges.
  void Chunk(int64_t r, int64_t qi, int64_t qe, int64_t* ntok, int64_t* pos0,
             int64_t* lo, int64_t* hi) const {
    *ntok = std::min(kChunk, qe - qi);
    *pos0 = rows_.seq_lens[r] - (qe - qi);
    int64_t unused;
    Range(*pos0, lo, &unused);
    Range(*pos0 + *ntok - 1, &unused, hi);
  }

  // The key range of a query at `pos`.
  void Range(int64_t pos, int64_t* lo, int64_t* hi) const {
    *hi = pos + 1;
    *lo = p_.sliding_window > 0
              ? std::max<int64_t>(0, pos - p_.sliding_window + 1)
              : 0;
  }

  void Store(int64_t qi, int64_t h, const float* acc,
             const float* denom) const {
    const int64_t D = c_.head_size;
    for (int64_t g = 0; g < group_; ++g) {
      const int64_t base = (qi * heads_ + h * group_ + g) * D;
      const float inv = 1.0f / denom[g];
      for (int64_t d = 0; d < D; ++d) {
        StoreAct(out_->dtype(), out_->raw_data(), base + d,
                 acc[g * D + d] * inv);
      }
    }
  }

  int64_t group() const { return group_; }

  using KernelFn = void (*)(const Attender&, Scratch&, int64_t, int64_t,
                            int64_t, int64_t, int64_t, float*, float*, float*);
  static void BodyDefault(const Attender& a, Scratch& s, int64_t r, int64_t h,
                          int64_t pos, int64_t lo, int64_t hi, float* m,
                          float* sum, float* acc) {
    a.Body(s, r, h, pos, lo, hi, m, sum, acc);
  }
  __attribute__((target("avx2,fma,f16c"))) static void BodyAvx2(
      const Attender& a, Scratch& s, int64_t r, int64_t h, int64_t pos,
      int64_t lo, int64_t hi, float* m, float* sum, float* acc) {
    a.Body(s, r, h, pos, lo, hi, m, sum, acc);
  }
  __attribute__((
      target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"))) static void
  BodyAvx512(const Attender& a, Scratch& s, int64_t r, int64_t h, int64_t pos,
             int64_t lo, int64_t hi, float* m, float* sum, float* acc) {
    a.Body(s, r, h, pos, lo, hi, m, sum, acc);
  }
  // The widest instruction set this CPU has, checked once per call.
  static KernelFn Pick() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl")) {
      return BodyAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      return BodyAvx2;
    }
    return BodyDefault;
  }

 private:
  void Prefetch(int64_t block, int64_t h) const {
    const int64_t n = c_.bytes_per_block() / c_.num_kv_heads;  // one head
    const char* k =
        reinterpret_cast<const char*>(k_ + g_.KeyIndex(block, h, 0, 0));
    const char* v =
        reinterpret_cast<const char*>(v_ + g_.ValueIndex(block, h, 0, 0));
    if (!g_.vllm) return;  // NHD interleaves heads: the hardware prefetches
    for (int64_t i = 0; i < n; i += 64) {
      __builtin_prefetch(k + i);
      __builtin_prefetch(v + i);
    }
  }

  // vLLM key layout [D/x][bs][x]: for each token, x-wide lane sums of
  // q * k across the D/x chunks, then one horizontal sum per token. Writes
  // logits[g * n + off + t] for t in [t0, t1).
  __attribute__((always_inline)) inline void KeyLogitsVllm(
      int64_t block, int64_t h, int64_t t0, int64_t t1, Scratch& s, int64_t off,
      int64_t n) const {
    // x is 16 bytes of elements (the layout's definition), a compile-time
    // constant per cache type, so the lane loops below are single vectors.
    constexpr int64_t x = 16 / static_cast<int64_t>(sizeof(T));
    const int64_t D = c_.head_size, bs = c_.block_size, G = s.nv;
    const T* __restrict kb = k_ + g_.KeyIndex(block, h, 0, 0);
    const float* __restrict qs = s.q.data();
    if constexpr (x % 8 == 0) {
      // Per token, four query heads at a time: accumulators stay in
      // registers across the D/x chunks; one horizontal sum per head.
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          const int64_t ng = G - g0 < 4 ? G - g0 : 4;
          F8 acc[4] = {};
          for (int64_t dx = 0; dx < D / x; ++dx) {
            const T* src = kb + (dx * bs + t) * x;
            for (int64_t v8 = 0; v8 < x; v8 += 8) {
              const F8 kv = Convert8<Elem>(src + v8, p_.k_scale);
              for (int64_t i = 0; i < 4; ++i) {
                if (i < ng) {
                  acc[i] += LoadF8(&qs[(g0 + i) * D + dx * x + v8]) * kv;
                }
              }
            }
          }
          for (int64_t i = 0; i < ng; ++i) {
            s.logits[(g0 + i) * n + off + t] = HSum(acc[i]);
          }
        }
      }
      return;
    } else {
      float* __restrict lanes = s.lanes.data();  // [G][bs][x]
      for (int64_t i = 0; i < G * bs * x; ++i) lanes[i] = 0.0f;
      float kx[x];
      for (int64_t dx = 0; dx < D / x; ++dx) {
        for (int64_t t = t0; t < t1; ++t) {
          const T* src = kb + (dx * bs + t) * x;
          for (int64_t i = 0; i < x; ++i)
            kx[i] = Elem::Load(src[i], p_.k_scale);
          for (int64_t g = 0; g < G; ++g) {
            const float* q = &qs[g * D + dx * x];
            float* l = &lanes[(g * bs + t) * x];
            for (int64_t i = 0; i < x; ++i) l[i] += q[i] * kx[i];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t t = t0; t < t1; ++t) {
          const float* l = &lanes[(g * bs + t) * x];
          float sum = 0;
          for (int64_t i = 0; i < x; ++i) sum += l[i];
          s.logits[g * n + off + t] = sum;
        }
      }
    }
  }

  // vLLM value layout [D][bs]: per dimension, bs-wide lane sums of p * v
  // across all blocks, then one horizontal sum per (head, dimension).
  __attribute__((always_inline)) inline void ValuesVllm(const int64_t* table,
                                                        int64_t h, int64_t lo,
                                                        int64_t hi, Scratch& s,
                                                        float* acc_out) const {
    const int64_t D = c_.head_size, bs = c_.block_size, G = s.nv;
    const int64_t n = hi - lo;
    const bool direct = bs % 8 == 0 && bs <= 32;
    float* __restrict lanes = s.lanes.data();  // [G][D][bs], other sizes
    if (!direct) {
      for (int64_t i = 0; i < G * D * bs; ++i) lanes[i] = 0.0f;
    }
    for (int64_t i = 0; i < G * D; ++i) acc_out[i] = 0.0f;
    float* __restrict p = s.acc.data();   // [G][bs]: this block's weights
    float* __restrict v = s.tile.data();  // [bs]: one dimension of V
    for (int64_t c = lo / bs; c * bs < hi; ++c) {
      const int64_t t0 = (lo > c * bs ? lo : c * bs) - c * bs;
      const int64_t t1 = (hi < (c + 1) * bs ? hi : (c + 1) * bs) - c * bs;
      const T* vb = v_ + g_.ValueIndex(table[c], h, 0, 0);
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t t = 0; t < bs; ++t) {
          p[g * bs + t] =
              t >= t0 && t < t1 ? s.logits[g * n + c * bs + t - lo] : 0.0f;
        }
      }
      const bool full = t0 == 0 && t1 == bs;
      if (direct) {
        // Eight dimensions at a time: per head, the eight rows' products
        // p * v (bs/8 vectors each) reduce by a transpose-sum into one
        // vector of eight outputs, accumulated straight into acc_out.
        F8 vrow[8][4];
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
          for (int64_t k = 0; k < 8; ++k) {
            const T* src = vb + (d0 + k) * bs;
            for (int64_t t = 0; t < bs; t += 8) {
              if (full) {
                vrow[k][t / 8] = Convert8<Elem>(src + t, p_.v_scale);
              } else {
                // Slots outside [t0, t1) may be unwritten (NaN): never load.
                float f[8];
                for (int64_t i = 0; i < 8; ++i) {
                  f[i] = t + i >= t0 && t + i < t1
                             ? Elem::Load(src[t + i], p_.v_scale)
                             : 0.0f;
                }
                vrow[k][t / 8] = LoadF8(f);
              }
            }
          }
          for (int64_t g = 0; g < G; ++g) {
            F8 prod[8];
            for (int64_t k = 0; k < 8; ++k) {
              F8 sum = {};
              for (int64_t t = 0; t < bs; t += 8) {
                sum += LoadF8(&p[g * bs + t]) * vrow[k][t / 8];
              }
              prod[k] = sum;
            }
            float* o = &acc_out[g * D + d0];
            StoreF8(o, LoadF8(o) + TransposeSum(prod));
          }
        }
        continue;
      }
      for (int64_t d = 0; d < D; ++d) {
        const T* src = vb + d * bs;
        if (full) {
          for (int64_t t = 0; t < bs; ++t)
            v[t] = Elem::Load(src[t], p_.v_scale);
        } else {
          // Slots outside [t0, t1) may be unwritten (NaN): never load them.
          for (int64_t t = 0; t < bs; ++t) {
            v[t] = t >= t0 && t < t1 ? Elem::Load(src[t], p_.v_scale) : 0.0f;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* l = &lanes[(g * D + d) * bs];
          const float* pg = &p[g * bs];
          for (int64_t t = 0; t < bs; ++t) l[t] += pg[t] * v[t];
        }
      }
    }
    if (direct) return;  // accumulated straight into acc_out
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t d = 0; d < D; ++d) {
        const float* l = &lanes[(g * D + d) * bs];
        float sum = 0;
        for (int64_t t = 0; t < bs; ++t) sum += l[t];
        acc_out[g * D + d] += sum;
      }
    }
  }

  // tile[t * D + d] = K(block, h, d, t) for t in [t0, t1).
  void LoadKeys(int64_t block, int64_t h, int64_t t0, int64_t t1,
                float* tile) const {
    const int64_t D = c_.head_size;
    if (g_.vllm) {
      for (int64_t dx = 0; dx < D; dx += g_.x) {
        for (int64_t t = t0; t < t1; ++t) {
          const T* src = k_ + g_.KeyIndex(block, h, dx, t);
          for (int64_t i = 0; i < g_.x; ++i) {
            tile[t * D + dx + i] = Elem::Load(src[i], p_.k_scale);
          }
        }
      }
    } else {
      for (int64_t t = t0; t < t1; ++t) {
        const T* src = k_ + g_.KeyIndex(block, h, 0, t);
        for (int64_t d = 0; d < D; ++d)
          tile[t * D + d] = Elem::Load(src[d], p_.k_scale);
      }
    }
  }
  void LoadValues(int64_t block, int64_t h, int64_t t0, int64_t t1,
                  float* tile) const {
    const int64_t D = c_.head_size;
    if (g_.vllm) {
      for (int64_t d = 0; d < D; ++d) {
        const T* src = v_ + g_.ValueIndex(block, h, d, 0);
        for (int64_t t = t0; t < t1; ++t)
          tile[t * D + d] = Elem::Load(src[t], p_.v_scale);
      }
    } else {
      for (int64_t t = t0; t < t1; ++t) {
        const T* src = v_ + g_.ValueIndex(block, h, 0, t);
        for (int64_t d = 0; d < D; ++d)
          tile[t * D + d] = Elem::Load(src[d], p_.v_scale);
      }
    }
  }

  const CacheConfig& c_;
  const Geometry g_;
  const T* k_;
  const T* v_;
  const Tensor& q_;
  const AttentionRows& rows_;
  const AttentionParams& p_;
  Tensor* out_;
  const int64_t heads_;
  const int64_t group_;
  const float scale_;
  const KernelFn kernel_ = Pick();
};

std::string RowError(int64_t r, const std::string& what) {
  return absl::StrFormat("row %d: %s", r, what);
}

template <typename Elem>
void Run(const KvCache& cache, int64_t layer, const Tensor& query,
         const AttentionRows& rows, const AttentionParams& p, ThreadPool* pool,
         Tensor* out) {
  const Attender<Elem> a(cache, layer, query, rows, p, out);
  const int64_t kvh = cache.config().num_kv_heads;
  const int64_t D = cache.config().head_size;
  const int64_t G = a.group();
  const int64_t P = p.partition_size;
  int64_t max_len = 0;
  for (int64_t r = 0; r < rows.num_real; ++r)
    max_len = std::max(max_len, rows.seq_lens[r]);
  const int64_t max_parts = (max_len + P - 1) / P;
  // Auto: partition only when whole rows are too few to keep the threads
  // busy and contexts are long enough to split. A heuristic (vLLM's idea);
  // not yet tuned by measurement (docs/attention.md).
  const int threads = pool != nullptr ? pool->num_threads() : 1;
  const bool partitioned = p.kernel == AttentionParams::Kernel::kPartitioned ||
                           (p.kernel == AttentionParams::Kernel::kAuto &&
                            max_parts > 1 && rows.num_real * kvh < 2 * threads);
  auto run = [&](const std::function<void(int64_t)>& fn, int64_t n) {
    if (pool != nullptr) {
      pool->ParallelFor(n, fn);
    } else {
      for (int64_t i = 0; i < n; ++i) fn(i);
    }
  };
  constexpr int64_t kChunk = Attender<Elem>::kChunk;
  if (!partitioned) {
    run(
        [&](int64_t item) {
          const int64_t r = item / kvh, h = item % kvh;
          const int64_t qs = rows.query_start[r], qe = rows.query_start[r + 1];
          Scratch scratch;  // per item: no thread-local state to leak
          std::vector<float> m(kChunk * G), s(kChunk * G), acc(kChunk * G * D);
          for (int64_t qi = qs; qi < qe; qi += kChunk) {
            int64_t ntok, pos0, lo, hi;
            a.Chunk(r, qi, qe, &ntok, &pos0, &lo, &hi);
            a.Partial(scratch, r, h, qi, ntok, pos0, lo, hi, m.data(), s.data(),
                      acc.data());
            for (int64_t k = 0; k < ntok; ++k) {
              a.Store(qi + k, h, &acc[k * G * D], &s[k * G]);
            }
          }
        },
        rows.num_real * kvh);
    return;
  }
  // Partitioned: item (row, kv head, partition) computes partial results
  // for every query token of the row; a second pass reduces them.
  const int64_t T = rows.query_start[rows.num_real];
  const int64_t stride = G * (D + 2);  // m, s, acc per query head
  std::vector<float> partial(static_cast<size_t>(T * kvh * max_parts * stride));
  std::vector<uint8_t> used(static_cast<size_t>(T * kvh * max_parts), 0);
  run(
      [&](int64_t item) {
        const int64_t part = item % max_parts;
        const int64_t r = item / max_parts / kvh, h = (item / max_parts) % kvh;
        const int64_t qs = rows.query_start[r], qe = rows.query_start[r + 1];
        Scratch scratch;
        std::vector<float> m(kChunk * G), s(kChunk * G), acc(kChunk * G * D);
        for (int64_t qi = qs; qi < qe; qi += kChunk) {
          int64_t ntok, pos0, lo, hi;
          a.Chunk(r, qi, qe, &ntok, &pos0, &lo, &hi);
          lo = std::max(lo, part * P);
          hi = std::min(hi, (part + 1) * P);
          if (lo >= hi) continue;
          a.Partial(scratch, r, h, qi, ntok, pos0, lo, hi, m.data(), s.data(),
                    acc.data());
          for (int64_t k = 0; k < ntok; ++k) {
            int64_t own_lo, own_hi;
            a.Range(pos0 + k, &own_lo, &own_hi);
            if (std::max(own_lo, lo) >= std::min(own_hi, hi)) continue;
            const int64_t slot = ((qi + k) * kvh + h) * max_parts + part;
            float* buf = &partial[slot * stride];
            std::copy(&m[k * G], &m[k * G] + G, buf);
            std::copy(&s[k * G], &s[k * G] + G, buf + G);
            std::copy(&acc[k * G * D], &acc[k * G * D] + G * D, buf + 2 * G);
            used[slot] = 1;
          }
        }
      },
      rows.num_real * kvh * max_parts);
  run(
      [&](int64_t item) {  // item = (token, kv head)
        const int64_t qi = item / kvh, h = item % kvh;
        std::vector<float> acc(G * D, 0.0f), denom(G, 0.0f);
        std::vector<float> M(G, -std::numeric_limits<float>::infinity());
        for (int64_t part = 0; part < max_parts; ++part) {
          const int64_t slot = (qi * kvh + h) * max_parts + part;
          if (!used[slot]) continue;
          for (int64_t g = 0; g < G; ++g)
            M[g] = std::max(M[g], partial[slot * stride + g]);
        }
        for (int64_t part = 0; part < max_parts; ++part) {
          const int64_t slot = (qi * kvh + h) * max_parts + part;
          if (!used[slot]) continue;
          const float* buf = &partial[slot * stride];
          for (int64_t g = 0; g < G; ++g) {
            const float w = std::exp(buf[g] - M[g]);
            denom[g] += buf[G + g] * w;
            Axpy(&acc[g * D], w, &buf[2 * G + g * D], D);
          }
        }
        a.Store(qi, h, acc.data(), denom.data());
      },
      T * kvh);
}

}  // namespace

absl::Status ReshapeAndCache(const KvCache& cache, int64_t layer,
                             const Tensor& key, const Tensor& value,
                             absl::Span<const int64_t> slots, float k_scale,
                             float v_scale) {
  const CacheConfig& c = cache.config();
  if (layer < 0 || layer >= c.num_layers) {
    return absl::OutOfRangeError(
        absl::StrFormat("layer %d is outside [0, %d)", layer, c.num_layers));
  }
  const int64_t T = static_cast<int64_t>(slots.size());
  const Shape want = {T, c.num_kv_heads, c.head_size};
  for (const auto& [t, name] :
       {std::pair<const Tensor*, const char*>{&key, "key"},
        {&value, "value"}}) {
    if (!t->defined() || !IsActivationType(t->dtype()) || t->shape() != want) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s must be float32, float16 or bfloat16 with shape %s, got %s", name,
          ShapeToString(want), t->DebugString()));
    }
  }
  if (!(k_scale > 0) || !(v_scale > 0) || !std::isfinite(k_scale) ||
      !std::isfinite(v_scale)) {
    return absl::InvalidArgumentError(
        "k_scale and v_scale must be finite and > 0");
  }
  const int64_t num_slots = c.num_blocks * c.block_size;
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < -1 || slots[t] >= num_slots) {
      return absl::OutOfRangeError(absl::StrFormat(
          "slot_mapping[%d] = %d is outside the pool [0, %d) (or -1)", t,
          slots[t], num_slots));
    }
  }
  const Geometry g = GeometryOf(c);
  DispatchCache(c.dtype, [&](auto elem) {
    using Elem = decltype(elem);
    using T = typename Elem::T;
    T* kc = static_cast<T*>(cache.key(layer).raw_data());
    T* vc = static_cast<T*>(cache.value(layer).raw_data());
    for (int64_t t = 0; t < static_cast<int64_t>(slots.size()); ++t) {
      if (slots[t] < 0) continue;
      const int64_t b = slots[t] / c.block_size, o = slots[t] % c.block_size;
      for (int64_t h = 0; h < c.num_kv_heads; ++h) {
        const int64_t src = (t * c.num_kv_heads + h) * c.head_size;
        for (int64_t d = 0; d < c.head_size; ++d) {
          kc[g.KeyIndex(b, h, d, o)] = Elem::Store(
              LoadAct(key.dtype(), key.raw_data(), src + d), k_scale);
          vc[g.ValueIndex(b, h, d, o)] = Elem::Store(
              LoadAct(value.dtype(), value.raw_data(), src + d), v_scale);
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status ValidateAttention(const CacheConfig& c, const Tensor& query,
                               const AttentionRows& rows,
                               const AttentionParams& p) {
  if (!query.defined() || !IsActivationType(query.dtype()) ||
      query.rank() != 3 || query.dim(2) != c.head_size || query.dim(1) < 1 ||
      query.dim(1) % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "query must be float32, float16 or bfloat16 [num_tokens, num_heads, "
        "%d] with num_heads a multiple of num_kv_heads %d, got %s",
        c.head_size, c.num_kv_heads, query.DebugString()));
  }
  const int64_t n = static_cast<int64_t>(rows.seq_lens.size());
  if (static_cast<int64_t>(rows.query_start.size()) != n + 1 ||
      rows.query_start[0] != 0 || rows.query_start[n] != query.dim(0) ||
      rows.num_real < 0 || rows.num_real > n || rows.width < 1 ||
      static_cast<int64_t>(rows.block_tables.size()) != n * rows.width) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the batch has %d rows, %d query tokens and tables of width %d, which "
        "do not fit the query's %d tokens",
        n, rows.query_start.empty() ? -1 : rows.query_start.back(), rows.width,
        query.dim(0)));
  }
  for (int64_t r = 0; r < n; ++r) {
    const int64_t q = rows.query_start[r + 1] - rows.query_start[r];
    if (q < 0) {
      return absl::InvalidArgumentError(
          RowError(r, "query_start_loc decreases"));
    }
    if (r >= rows.num_real) continue;
    const int64_t len = rows.seq_lens[r];
    if (len < q || len > (int64_t{1} << 40)) {
      return absl::OutOfRangeError(RowError(
          r, absl::StrFormat("seq_len %d is shorter than its %d query tokens",
                             len, q)));
    }
    const int64_t need = (len + c.block_size - 1) / c.block_size;
    if (need > rows.width) {
      return absl::OutOfRangeError(RowError(
          r, absl::StrFormat("seq_len %d needs %d blocks, the table has %d",
                             len, need, rows.width)));
    }
    for (int64_t j = 0; j < need; ++j) {
      const int64_t b = rows.block_tables[r * rows.width + j];
      if (b < 0 || b >= c.num_blocks) {
        return absl::OutOfRangeError(RowError(
            r, absl::StrFormat("block_tables[%d][%d] = %d is not a block of "
                               "the pool [0, %d)",
                               r, j, b, c.num_blocks)));
      }
    }
  }
  if (!p.alibi_slopes.empty() &&
      static_cast<int64_t>(p.alibi_slopes.size()) != query.dim(1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("alibi_slopes has %d entries for %d query heads",
                        p.alibi_slopes.size(), query.dim(1)));
  }
  for (float s : p.alibi_slopes) {
    if (!std::isfinite(s)) {
      return absl::InvalidArgumentError("alibi_slopes must be finite");
    }
  }
  if (p.sliding_window < 0) {
    return absl::InvalidArgumentError("sliding_window must be >= 0");
  }
  if (!(p.scale >= 0) || !std::isfinite(p.scale)) {
    return absl::InvalidArgumentError("scale must be finite and >= 0");
  }
  if (!(p.k_scale > 0) || !(p.v_scale > 0) || !std::isfinite(p.k_scale) ||
      !std::isfinite(p.v_scale)) {
    return absl::InvalidArgumentError(
        "k_scale and v_scale must be finite and > 0");
  }
  if (p.partition_size < 1) {
    return absl::InvalidArgumentError("partition_size must be >= 1");
  }
  return absl::OkStatus();
}

absl::Status PagedAttention(const KvCache& cache, int64_t layer,
                            const Tensor& query, const AttentionRows& rows,
                            const AttentionParams& params, ThreadPool* pool,
                            Tensor* out) {
  const CacheConfig& c = cache.config();
  if (layer < 0 || layer >= c.num_layers) {
    return absl::OutOfRangeError(
        absl::StrFormat("layer %d is outside [0, %d)", layer, c.num_layers));
  }
  if (absl::Status s = ValidateAttention(c, query, rows, params); !s.ok()) {
    return s;
  }
  absl::StatusOr<Tensor> o =
      Tensor::Zeros(CpuDevice(), query.dtype(), query.shape());
  if (!o.ok()) return o.status();
  *out = *std::move(o);
  DispatchCache(c.dtype, [&](auto elem) {
    Run<decltype(elem)>(cache, layer, query, rows, params, pool, out);
  });
  return absl::OkStatus();
}

}  // namespace kvstep
