#include "core/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_format.h"
#include "core/float_convert.h"

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
  static float Load(T v, float) { return HalfToFloat(v); }
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
inline float Dot(const float* a, const float* b, int64_t n) {
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

inline void Axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// One work item's scratch, reused across items on a thread.
struct Scratch {
  std::vector<float> q, logits, tile, acc;
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

  // Attention of token `qi` (position `pos`) of row `r`, heads of KV head
  // `h`, over keys [lo, hi). Writes the unnormalized accumulator and the
  // max logit / exp-sum per query head into the scratch-owned outputs.
  void Partial(Scratch& s, int64_t r, int64_t h, int64_t qi, int64_t pos,
               int64_t lo, int64_t hi, float* m_out, float* s_out,
               float* acc_out) const {
    const int64_t D = c_.head_size, bs = c_.block_size, G = group_;
    const int64_t n = hi - lo;
    s.q.resize(G * D);
    s.logits.resize(G * std::max<int64_t>(n, 1));
    s.tile.resize(bs * D);
    const DType qd = q_.dtype();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t base = (qi * heads_ + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) {
        s.q[g * D + d] = LoadAct(qd, q_.raw_data(), base + d) * scale_;
      }
    }
    const int64_t* table = &rows_.block_tables[r * rows_.width];
    // Pass 1: logits, one K block at a time.
    for (int64_t c = lo / bs; c * bs < hi; ++c) {
      const int64_t t0 = std::max(lo, c * bs) - c * bs;
      const int64_t t1 = std::min(hi, (c + 1) * bs) - c * bs;
      LoadKeys(table[c], h, t0, t1, s.tile.data());
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t j = c * bs + t;
        for (int64_t g = 0; g < G; ++g) {
          float l = Dot(&s.q[g * D], &s.tile[t * D], D);
          if (!p_.alibi_slopes.empty()) {
            l += p_.alibi_slopes[h * G + g] * static_cast<float>(j - pos);
          }
          s.logits[g * n + (j - lo)] = l;
        }
      }
    }
    // Softmax numerators per query head (exact: max subtracted).
    for (int64_t g = 0; g < G; ++g) {
      float* l = &s.logits[g * n];
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) m = std::max(m, l[j]);
      float sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        l[j] = std::exp(l[j] - m);
        sum += l[j];
      }
      m_out[g] = m;
      s_out[g] = sum;
    }
    // Pass 2: weighted values, one V block at a time.
    std::fill(acc_out, acc_out + G * D, 0.0f);
    for (int64_t c = lo / bs; c * bs < hi; ++c) {
      const int64_t t0 = std::max(lo, c * bs) - c * bs;
      const int64_t t1 = std::min(hi, (c + 1) * bs) - c * bs;
      LoadValues(table[c], h, t0, t1, s.tile.data());
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t j = c * bs + t;
        for (int64_t g = 0; g < G; ++g) {
          Axpy(&acc_out[g * D], s.logits[g * n + (j - lo)], &s.tile[t * D], D);
        }
      }
    }
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

 private:
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
  // busy and contexts are long enough to split (measured, see docs/).
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
  thread_local Scratch scratch;
  if (!partitioned) {
    run(
        [&](int64_t item) {
          const int64_t r = item / kvh, h = item % kvh;
          const int64_t qs = rows.query_start[r], qe = rows.query_start[r + 1];
          std::vector<float> m(G), s(G), acc(G * D);
          for (int64_t qi = qs; qi < qe; ++qi) {
            const int64_t pos = rows.seq_lens[r] - (qe - qi);
            int64_t lo, hi;
            a.Range(pos, &lo, &hi);
            a.Partial(scratch, r, h, qi, pos, lo, hi, m.data(), s.data(),
                      acc.data());
            a.Store(qi, h, acc.data(), s.data());
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
        for (int64_t qi = qs; qi < qe; ++qi) {
          const int64_t pos = rows.seq_lens[r] - (qe - qi);
          int64_t lo, hi;
          a.Range(pos, &lo, &hi);
          lo = std::max(lo, part * P);
          hi = std::min(hi, (part + 1) * P);
          if (lo >= hi) continue;
          const int64_t slot = (qi * kvh + h) * max_parts + part;
          float* buf = &partial[slot * stride];
          a.Partial(scratch, r, h, qi, pos, lo, hi, buf, buf + G, buf + 2 * G);
          used[slot] = 1;
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
