#include "core/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/float_convert.h"
#include "core/log.h"

// The kernel's 8-float vector helpers are internal and always inlined, so
// no call crosses an ABI boundary with an AVX vector; the -Wpsabi warning
// about their by-value vectors in the portable build does not apply
// (clang takes GCC's diagnostic pragmas as its own).
#pragma GCC diagnostic ignored "-Wpsabi"

namespace kvstep {
namespace {

bool IsActivationType(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

// exp(x) for x <= 0 (logits minus their max), branch-free so that loops
// over it vectorize: 2^(x log2 e) split into 2^n * 2^f with a degree-6
// polynomial for 2^f on [-0.5, 0.5]; relative error ~2e-7 near 0, plus
// the float rounding of x log2(e): 1.6e-6 at -22, 3.8e-6 at -86 (weights
// that far below the max do not move a sum of at least 1). At or below -87
// (exp underflows there anyway), and for NaN, it returns exactly 0. The
// builds with FMAs (AVX2, AVX-512) round the polynomial differently from
// this one, by an ulp here and there, and GCC, which fuses across
// statements, differently again (VectorExpAgreesAcrossBuilds).
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
  static bool Finite(T v) { return std::isfinite(v); }
};
template <>
struct CacheElem<DType::kFloat16> {
  using T = uint16_t;
  static float Load(T v, float) { return HalfToFloatFast(v); }
  static T Store(float v, float) { return FloatToHalf(v); }
  static bool Finite(T v) { return (v & 0x7c00) != 0x7c00; }
};
template <>
struct CacheElem<DType::kBFloat16> {
  using T = uint16_t;
  static float Load(T v, float) { return BF16ToFloat(v); }
  static T Store(float v, float) { return FloatToBF16(v); }
  static bool Finite(T v) { return (v & 0x7f80) != 0x7f80; }
};
template <>
struct CacheElem<DType::kFp8E4M3> {
  using T = uint8_t;
  using Format =
      Fp8E4M3Format;  // ReshapeAndCache's vector stores (ActsToFp8Avx512)
  static float Load(T v, float s) { return Fp8E4M3ToFloat(v) * s; }
  static T Store(float v, float s) { return FloatToFp8E4M3(v / s); }
  static bool Finite(T v) { return (v & 0x7f) != 0x7f; }
};
template <>
struct CacheElem<DType::kFp8E5M2> {
  using T = uint8_t;
  using Format =
      Fp8E5M2Format;  // ReshapeAndCache's vector stores (ActsToFp8Avx512)
  static float Load(T v, float s) { return Fp8E5M2ToFloat(v) * s; }
  static T Store(float v, float s) { return FloatToFp8E5M2(v / s); }
  static bool Finite(T v) { return (v & 0x7c) != 0x7c; }
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

__attribute__((always_inline)) inline void Axpy(float* y, float a,
                                                const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// std::allocator's blocks, but starting on a cache line (64 bytes, one ZMM
// register). The kernel's 16-lane loads and stores of scratch rows (lanes,
// weights, query layouts: row strides of 64 bytes) would otherwise split
// across two lines each time: operator new aligns to 16 bytes.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  explicit LineAllocator(const LineAllocator<U>& /*other*/) {}
  T* allocate(size_t n) {
    return static_cast<T*>(
        ::operator new (n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t /*n*/) {
    ::operator delete (p, std::align_val_t{64});
  }
  template <typename U>
  bool operator==(const LineAllocator<U>& /*other*/) const {
    return true;
  }
  template <typename U>
  bool operator!=(const LineAllocator<U>& /*other*/) const {
    return false;
  }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

namespace amx {

// 16 consecutive tokens of a block for the AMX passes (below): p, their
// keys (amx::Logits: where chunk 0's rows start, chunks of 8 dims x the
// block's tokens) or values (amx::Values: token 0 of dim 0, dims of the
// block's tokens); the tokens [a, b) of the 16 that are in range, whose
// logits (and weights) are at row offset off + t.
struct Tile16 {
  const uint16_t* p;
  int64_t off, a, b;
  // Bit t set for the tokens t in [a, b).
  uint16_t InRange() const {
    return static_cast<uint16_t>(((1u << b) - 1) & ~((1u << a) - 1));
  }
};

// How many bf16 parts the AMX passes split a query element of dtype dt
// into, whose sum is the element exactly: bf16 1, fp16 2, fp32 3.
inline int64_t QueryParts(DType dt) {
  return dt == DType::kBFloat16 ? 1 : dt == DType::kFloat16 ? 2 : 3;
}

}  // namespace amx

// A thread's scratch, reused across its items and their chunks.
struct Scratch {
  LineVector<float> q;          // [virtual heads][head_size], scaled
  LineVector<float> q2;         // q laid out for the key tiles
  LineVector<uint16_t> qb;      // bf16 q (or its AMX parts), unscaled
  LineVector<float> logits;     // [virtual heads][keys, padded to 8]
  LineVector<float> lanes;      // vLLM values: [v][head_size][8 or 16]
  LineVector<float> weights;    // a partial block's weights, zero-padded;
                                // AMX: weight tiles and carried sums
  LineVector<float> m, s, acc;  // a chunk's results (Partial's outputs)
  LineVector<float> part;       // rows: a key segment's acc, m and s
  LineVector<float> running;    // long rows: each KV head's running acc, m, s
  // Prefill value tiles: a range's values in the order the head tiles
  // after the first read them (ValuesTile*'s staging).
  LineVector<float> staged;
  // Where the vLLM value passes' weights start in `logits` (vLLM rows:
  // KV head h's, after the logits of heads 0 .. h - 1); 0 otherwise.
  int64_t logits_off = 0;
  std::vector<amx::Tile16> tiles;  // a prefill chunk's, for AMX

  // Every vector empty (capacity kept), as a new Scratch: the kernel's
  // resizes then zero-fill them as they would a fresh one's.
  void Clear() {
    ForEachVector(*this, [](auto& v) { v.clear(); });
    logits_off = 0;
  }
  size_t CapacityBytes() const {
    size_t n = 0;
    ForEachVector(*this,
                  [&n](const auto& v) { n += v.capacity() * sizeof(v[0]); });
    return n;
  }

 private:
  // f(v) for every vector member (a member added above belongs here too).
  template <typename Self, typename F>
  static void ForEachVector(Self& self, F f) {
    f(self.q);
    f(self.q2);
    f(self.qb);
    f(self.logits);
    f(self.lanes);
    f(self.weights);
    f(self.m);
    f(self.s);
    f(self.acc);
    f(self.part);
    f(self.running);
    f(self.staged);
    f(self.tiles);
  }
};

// A thread's Scratch for one call's items: the thread's own, kept from
// call to call, emptied first (so the call sees what a new Scratch would
// give it). A scratch allocated and freed by every call (hundreds of KB
// for long rows) left it to the allocator whether the memory went back to
// the kernel at each free: in one measured state glibc shrank its heap
// after every call and grew it at the next (brk), so that every call
// flushed the TLB and faulted its scratch's pages in again (bf16 decode,
// 1024 keys, batch 1: 1.2-1.35x the time on this Zen 5 VM;
// docs/attention.md, session 28). A thread keeps at most kKeepBytes
// between calls: decode's scratch is smaller (a vLLM row's logits are at
// most 2 MiB, in calls of a few rows; a per-head item's 512 KB at 32k
// keys), and a server may call from many threads; a bigger one (a long
// prefill chunk's) is freed after its call, whose length makes the malloc
// negligible. A nested lease on the same thread (not expected) gets a
// scratch of its own.
class ScratchLease {
 public:
  static constexpr size_t kKeepBytes = size_t{4} << 20;

  ScratchLease() {
    if (!busy_) {
      busy_ = true;
      scratch_ = &kept_;
      scratch_->Clear();
    }
  }
  ~ScratchLease() {
    if (scratch_ != &kept_) return;
    if (kept_.CapacityBytes() > kKeepBytes) kept_ = Scratch();
    busy_ = false;
  }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;

  Scratch& get() { return *scratch_; }

 private:
  static thread_local Scratch kept_;
  static thread_local bool busy_;
  Scratch own_;
  Scratch* scratch_ = &own_;  // &kept_ when this lease holds the thread's
};
thread_local Scratch ScratchLease::kept_;
thread_local bool ScratchLease::busy_ = false;

// Passes over fp16 or fp8 keys or values that met an Inf or NaN (or a
// query too large for their scaling) and were redone by conversion
// (attention_kernel.inc: SplitHalvesZ, LogitsFp8Z, ValuesFp8Z), for tests:
// internal::ConvertingRedos.
std::atomic<int64_t> converting_redos{0};

// K and V passes of prefill chunks that ran on AMX, for tests:
// internal::AmxPasses.
std::atomic<int64_t> amx_passes{0};

// fp8 K and V passes begun on VDPBF16PS, for tests: internal::Fp8DotPasses.
std::atomic<int64_t> fp8_dot_passes{0};

// K passes of bf16 keys by VDPBF16PS (AttentionParams::bf16_keys), both
// layouts, for tests: internal::Bf16DotKeyPasses.
std::atomic<int64_t> bf16_dot_key_passes{0};

// NHD key segments read a whole row at a time (Attender::PartialRow), for
// tests: internal::NhdRowPasses.
std::atomic<int64_t> nhd_row_passes{0};

// vLLM-layout key segments read a whole row at a time (Attender::
// PartialRowVllm), for tests: internal::VllmRowPasses.
std::atomic<int64_t> vllm_row_passes{0};

// Calls kAuto took by long rows in kLongRowRange-key ranges (Run), for
// tests: internal::LongRowRangeCalls.
std::atomic<int64_t> long_row_range_calls{0};

// Calls that took UnevenClaims' claims (Run), for tests:
// internal::UnevenClaimCalls.
std::atomic<int64_t> uneven_claim_calls{0};

// ThisCpu's one reading of CPUID (attention.h).
CpuIdentity ReadCpuIdentity() {
  CpuIdentity id;
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) != 0) {
    char vendor[13] = {};
    std::memcpy(vendor, &ebx, 4);
    std::memcpy(vendor + 4, &edx, 4);
    std::memcpy(vendor + 8, &ecx, 4);
    id.vendor = vendor;
  }
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0) {
    const unsigned base_family = (eax >> 8) & 0xf;
    id.family =
        base_family == 15 ? base_family + ((eax >> 20) & 0xff) : base_family;
    id.model = (eax >> 4) & 0xf;
    if (base_family == 6 || base_family == 15) id.model |= (eax >> 12) & 0xf0;
  }
  unsigned top = 0;
  if (__get_cpuid(0x80000000u, &top, &ebx, &ecx, &edx) != 0 &&
      top >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      unsigned r[4] = {};
      __get_cpuid(0x80000002u + i, &r[0], &r[1], &r[2], &r[3]);
      std::memcpy(brand + size_t{16} * i, r, sizeof(r));
    }
    const std::string b = brand;
    const size_t first = b.find_first_not_of(' ');
    if (first != std::string::npos) {
      id.brand = b.substr(first, b.find_last_not_of(' ') - first + 1);
    }
  }
#endif
  return id;
}

// Whether this CPU's vendor is AMD (or Hygon, whose cores are AMD's Zen):
// the kernel's choices that were measured to differ by CPU (the prefetch
// hint and the slice touch; see AttentionParams) take the Zen 5 ones
// there.
bool AmdVendor() {
  static const bool amd =
      ThisCpu().vendor == "AuthenticAMD" || ThisCpu().vendor == "HygonGenuine";
  return amd;
}

// Whether CPUID reports an Intel family 6 model 207 (0xCF, Emerald
// Rapids), as the KVM guest of sessions 51 and 52 does; the Xeon guest
// of sessions 8 and 47-50 reported model 167.
bool IntelModel207() {
  static const bool is =
      !AmdVendor() && ThisCpu().family == 6 && ThisCpu().model == 207;
  return is;
}

// How a call over a `cache`-typed cache in `layout` prefetches K/V: kAuto
// resolved for this CPU (see AttentionParams::prefetch).
AttentionParams::Prefetch ResolvePrefetch(AttentionParams::Prefetch p,
                                          DType cache, CacheLayout layout) {
  if (p != AttentionParams::Prefetch::kAuto) return p;
  if (AmdVendor()) return AttentionParams::Prefetch::kT0;
  if (IntelModel207() && DTypeSize(cache) == 2 &&
      layout == CacheLayout::kVllm) {
    return AttentionParams::Prefetch::kT0;
  }
  return AttentionParams::Prefetch::kT1;
}

// Blocks ahead of its reads that LogitsZ prefetches 16-bit keys into L1,
// at block sizes 16 and 32, under `hint` (resolved): 1 with kT0 on Intel,
// 2 otherwise. On the Intel model-207 guest of session 53 (kT0 the
// default there, with prefetch_l2's second prefetch one block further),
// one block took 0.975-1.003x the time of two at block size 16 (4 KB
// ahead instead of 8; reversed order 1/1.002-1/1.031; bf16 and fp16,
// 1k-8k keys, batches 1-64, one and two threads; at a batch of 256, 17
// pairs, 1.015x and reversed 1/1.052) and 0.975-0.978x at
// block size 32 (8 KB instead of 16; reversed 1/1.025-1/1.028), where
// the L2 prefetch 2 or 3 blocks further instead of 1 took 1.008-1.028x.
// The Zen 5's 8 KB at block size 16 (session 16) stays.
int64_t KeyAheadBlocks16(AttentionParams::Prefetch hint) {
  return hint == AttentionParams::Prefetch::kT0 && !AmdVendor() ? 1 : 2;
}

// The slice touch's gates (AttentionParams::touch_min_bytes and
// touch_min_blocks), -1 resolved for this CPU.
int64_t ResolveTouchMinBytes(int64_t bytes) {
  if (bytes >= 0) return bytes;
  return AmdVendor() ? 0 : int64_t{512} << 20;
}
int64_t ResolveTouchMinBlocks(int64_t blocks) {
  if (blocks >= 0) return blocks;
  return AmdVendor() ? 0 : 128;
}

// Whether a call over a `cache`-typed cache of `block_size`-token blocks may
// read vLLM-layout decode rows over every KV head (AttentionParams::
// vllm_rows, kAuto resolved for this CPU; the kernel's gates still apply).
// Elsewhere than on AMD only 8- and 16-bit caches at block size 8, where a
// KV head's slice of a block is under a page (2 KB or less at head 128):
// the one shape the Intel Xeon of session 47 read faster by rows.
bool ResolveVllmRows(AttentionParams::VllmRows v, DType cache,
                     int64_t block_size) {
  switch (v) {
    case AttentionParams::VllmRows::kOn:
      return true;
    case AttentionParams::VllmRows::kOff:
      return false;
    default:
      return AmdVendor() || (DTypeSize(cache) <= 2 && block_size == 8);
  }
}

// How a call multiplies bf16 keys by a bf16 query: kAuto resolved for
// decode and short NHD rows' prefill chunks (kWiden on every CPU measured),
// or with `chunks` for vLLM-layout prefill chunks and NHD ones of rows of
// more than 32 query tokens (kDot on AMD, kWiden elsewhere; see
// AttentionParams::bf16_keys and Attender::NhdDotChunk).
AttentionParams::Bf16Keys ResolveBf16Keys(AttentionParams::Bf16Keys k,
                                          bool chunks = false) {
  if (k != AttentionParams::Bf16Keys::kAuto) return k;
  return chunks && AmdVendor() ? AttentionParams::Bf16Keys::kDot
                               : AttentionParams::Bf16Keys::kWiden;
}

// Whether the K tile of tokens [tb, tb + tile) of a block of bs tokens,
// whose tiles run over [first, t1) in steps of `tile` (first a multiple of
// it), prefetches the same key chunk of the slice ahead, and which of the
// chunk's lines (4 tokens a line) [*l0, *l1). Spread (burst false): each
// tile takes its own tokens' lines, the first also those before it and the
// last the rest, so that the tiles that run cover every line of the next
// slice once, even where the block has fewer tokens in range. At block
// size 32 (two tiles a block) the first tile's prefetch of the whole next
// slice (and with the L2 stream the one after) took 1.15-1.18x the time
// of the spread in 16-bit rows' K pass, 1.01-1.07x in per-head items',
// 1.06-1.08x on two threads (bf16 and fp16, session 35). Burst: the first
// tile takes every line, as fp32 keys keep doing (spread, their calls took
// 1.03-1.05x the time). One tile a block (block sizes 8 and 16): the same
// either way.
bool KeyTilePrefetchLines(int64_t bs, bool burst, int64_t tb, int64_t first,
                          int64_t t1, int64_t tile, int64_t* l0, int64_t* l1) {
  const int64_t lines = bs / 4;
  if (burst) {
    *l0 = 0;
    *l1 = lines;
    return tb == first;
  }
  *l0 = tb == first ? 0 : std::min(lines, tb / 4);
  *l1 = tb + tile >= t1 ? lines : std::min(lines, (tb + tile) / 4);
  return true;
}

// The kernel, once per instruction set (see core/attention_kernel.inc):
// each inclusion under a `target` applied to every function in it.
#if defined(__x86_64__) || defined(__i386__)
#define KVSTEP_ATTN_X86 1
#define KVSTEP_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define KVSTEP_TARGET_PUSH(t) \
  KVSTEP_PRAGMA(              \
      clang attribute push(__attribute__((target(t))), apply_to = function))
#define KVSTEP_TARGET_POP() KVSTEP_PRAGMA(clang attribute pop)
#else
#define KVSTEP_TARGET_PUSH(t) \
  KVSTEP_PRAGMA(GCC push_options) KVSTEP_PRAGMA(GCC target(t))
#define KVSTEP_TARGET_POP() KVSTEP_PRAGMA(GCC pop_options)
#endif

// Whether this CPU and OS run AMX-BF16, and the AVX-512 build plus
// AVX512-VBMI (defined below).
bool AmxUsable();
bool Fp8DotUsable();

// Whether a call over an fp8 cache in `layout` at `block_size` takes the
// VDPBF16PS passes (AttentionParams::fp8_dot, kAuto resolved for this
// CPU): never where the CPU lacks them; with kAuto on AMD always, elsewhere
// only in the vLLM layout at block size 8, whose decode rows and key tiles
// over two blocks are built on them (session 59; see AttentionParams::
// fp8_dot).
bool ResolveFp8Dot(AttentionParams::Fp8Dot d, CacheLayout layout,
                   int64_t block_size) {
  if (!Fp8DotUsable()) return false;
  switch (d) {
    case AttentionParams::Fp8Dot::kOn:
      return true;
    case AttentionParams::Fp8Dot::kOff:
      return false;
    default:
      return AmdVendor() || (layout == CacheLayout::kVllm && block_size == 8);
  }
}

// AMX for prefill chunks of 16-bit caches in the vLLM layout (Logits,
// Values). TDPBF16PS multiplies bf16 tiles exactly into fp32 sums (as
// VDPBF16PS; denormal inputs flushed, which no value of interest is). A
// number that bf16 does not hold goes in as a sum of bf16 parts, each part
// against each of the other side's: an fp16 element exactly as two (its 11
// significant bits as 8 + 3), an fp32 query element exactly as three (8 +
// 8 + 8, below bf16's normal range aside), an fp32 weight as two (to about
// 2^-17 of relative error, where a bf16 weight alone would carry 2^-9).
// Keys: 16 virtual heads' query rows (A) times a 16-token tile's keys (B,
// in the VNNI order: dim pairs x tokens), 32 dims a step. A prefill
// chunk's 64 virtual heads (16 tokens, GQA 4) cost the FMA passes 32 FMAs
// per 64 bytes of keys and head tile, re-splitting the keys for each of 16
// head tiles; here a bf16 block of 4 KB costs 128 permutes (the keys'
// transpose into B) and 16 tile products (fp16: 64, and its split).
// Values need no transpose (a dim's tokens are adjacent, as A wants them);
// the weights do, 48 permutes per 16 tokens and 16 heads.
namespace amx {

#define KVSTEP_AMX_TARGET \
  __attribute__((target(  \
      "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C tile c (0-3) into sums: tile numbers are immediates.
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void StoreSums(
    int64_t c, float (*sums)[16]) {
  switch (c) {
    case 0:
      _tile_stored(0, sums, 64);
      break;
    case 1:
      _tile_stored(1, sums, 64);
      break;
    case 2:
      _tile_stored(2, sums, 64);
      break;
    default:
      _tile_stored(3, sums, 64);
      break;
  }
}

// The 16 bf16s of half h (0: low, 1: high) of x, as floats.
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline __m512 Widen(__m512i x,
                                                                     int h) {
  const __m256i half =
      h == 0 ? _mm512_castsi512_si256(x) : _mm512_extracti64x4_epi64(x, 1);
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// a and b (16 floats each; a in the low half) as bf16 parts: *hi the
// nearest bf16s, *lo the nearest to what they leave (0 where a or b is not
// finite, so that those keep their value in hi alone); *a and *b become
// what hi + lo leaves.
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void Split(
    __m512* a, __m512* b, __m512i* hi, __m512i* lo) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __mmask16 fa = _mm512_cmp_ps_mask(_mm512_abs_ps(*a), inf, _CMP_LT_OQ);
  const __mmask16 fb = _mm512_cmp_ps_mask(_mm512_abs_ps(*b), inf, _CMP_LT_OQ);
  *hi = (__m512i)_mm512_cvtne2ps_pbh(*b, *a);
  *a = _mm512_maskz_sub_ps(fa, *a, Widen(*hi, 0));
  *b = _mm512_maskz_sub_ps(fb, *b, Widen(*hi, 1));
  *lo = (__m512i)_mm512_cvtne2ps_pbh(*b, *a);
  *a = _mm512_sub_ps(*a, Widen(*lo, 0));
  *b = _mm512_sub_ps(*b, Widen(*lo, 1));
}

// 32 fp16s (x) as their exact bf16 hi and lo parts, in the same order.
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void SplitHalves(
    __m512i x, __m512i* hi, __m512i* lo) {
  __m512 a = _mm512_cvtph_ps(_mm512_castsi512_si256(x));
  __m512 b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1));
  Split(&a, &b, hi, lo);
}

// n elements (a multiple of 32) of a query row of dtype dt (bf16, fp16 or
// fp32) as `parts` rows of bf16 (1, 2 and 3: QueryParts) whose sum is each
// element: part i at out + i * pstride.
KVSTEP_AMX_TARGET void SplitQuery(const void* src, DType dt, int64_t n,
                                  int64_t parts, int64_t pstride,
                                  uint16_t* out) {
  if (dt == DType::kBFloat16) {
    std::memcpy(out, src, n * sizeof(uint16_t));
    return;
  }
  for (int64_t j = 0; j < n; j += 32) {
    __m512 a, b;
    if (dt == DType::kFloat16) {
      const uint16_t* h = static_cast<const uint16_t*>(src) + j;
      a = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
      b = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16)));
    } else {
      const float* f = static_cast<const float*>(src) + j;
      a = _mm512_loadu_ps(f);
      b = _mm512_loadu_ps(f + 16);
    }
    __m512i hi, lo;
    Split(&a, &b, &hi, &lo);
    _mm512_storeu_si512(out + j, hi);
    if (parts > 1) _mm512_storeu_si512(out + pstride + j, lo);
    if (parts > 2) {
      Split(&a, &b, &hi, &lo);
      _mm512_storeu_si512(out + 2 * pstride + j, hi);
    }
  }
}

// A key chunk's 16 tokens x 8 dims (z: 4 tokens a register) into 4 rows of
// B: row r, lane n = dims 2r and 2r + 1 of token n.
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void KeyRows(
    const __m512i* z, uint32_t (*rows)[16]) {
  // Stage 1 takes tokens 0-7 (or 8-15) of two 4-token loads: pairs 0 and 1
  // (ia) or 2 and 3 (ib) in lanes 0-7 and 8-15; stage 2 joins the halves.
  const __m512i ia = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13,
                                       17, 21, 25, 29);
  const __m512i ib = _mm512_add_epi32(ia, _mm512_set1_epi32(2));
  const __m512i jlo =
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i jhi = _mm512_add_epi32(jlo, _mm512_set1_epi32(8));
  const __m512i a01 = _mm512_permutex2var_epi32(z[0], ia, z[1]);
  const __m512i b01 = _mm512_permutex2var_epi32(z[0], ib, z[1]);
  const __m512i a23 = _mm512_permutex2var_epi32(z[2], ia, z[3]);
  const __m512i b23 = _mm512_permutex2var_epi32(z[2], ib, z[3]);
  _mm512_store_si512(rows[0], _mm512_permutex2var_epi32(a01, jlo, a23));
  _mm512_store_si512(rows[1], _mm512_permutex2var_epi32(a01, jhi, a23));
  _mm512_store_si512(rows[2], _mm512_permutex2var_epi32(b01, jlo, b23));
  _mm512_store_si512(rows[3], _mm512_permutex2var_epi32(b01, jhi, b23));
}

// C tile kC += A tile kA x B tile kB. GCC's _tile_dpbf16ps is a macro that
// pastes its operands into the instruction's text ("%%tmm" #src2), so it
// takes literal tile numbers only; there the same instruction is written
// out, its operands in the macro's AT&T order (B, A, C).
template <int kC, int kA, int kB>
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void TileDp() {
  static_assert(kC >= 0 && kC < 8 && kA >= 0 && kA < 8 && kB >= 0 && kB < 8,
                "AMX has tiles 0-7");
#if defined(__clang__)
  _tile_dpbf16ps(kC, kA, kB);
#else
  __asm__ volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(kB), "i"(kA),
                   "i"(kC));
#endif
}

// C tiles 0 to ng - 1 += A (ng groups of 16 query rows from q, qs bytes
// from one row to the next, gs elements from one group to the next) times
// B tile kB; A alternates between tiles 4 and 6 so that one loads while the
// other multiplies.
template <int kB>
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void DotGroups(
    int64_t ng, const uint16_t* q, int64_t qs, int64_t gs) {
  _tile_loadd(4, q, qs);
  TileDp<0, 4, kB>();
  if (ng > 1) {
    _tile_loadd(6, q + gs, qs);
    TileDp<1, 6, kB>();
  }
  if (ng > 2) {
    _tile_loadd(4, q + 2 * gs, qs);
    TileDp<2, 4, kB>();
  }
  if (ng > 3) {
    _tile_loadd(6, q + 3 * gs, qs);
    TileDp<3, 6, kB>();
  }
}

// A key tile's B rows (bt: [key part][step of 32 dims][dim pair][token]):
// bf16 keys as they are, fp16 as their hi parts, then their lo parts.
// cstride: elements from one key chunk to the next.
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void KeyTiles(
    const Tile16& kt, int64_t cstride, bool f16, int64_t D,
    uint32_t (*bt)[8][16][16]) {
  for (int64_t c = 0; c < D / 8; ++c) {
    const uint16_t* p = kt.p + c * cstride;
    __m512i z[4];
    for (int64_t i = 0; i < 4; ++i) z[i] = _mm512_loadu_si512(p + 32 * i);
    if (f16) {
      __m512i lo[4];
      for (int i = 0; i < 4; ++i) SplitHalves(z[i], &z[i], &lo[i]);
      KeyRows(lo, &bt[1][c / 4][(c % 4) * 4]);
    }
    KeyRows(z, &bt[0][c / 4][(c % 4) * 4]);
  }
}

// logits[v * ln + off + t] = scale * (query row v . key t) for every tile's
// tokens [a, b) and v < nv. qb: the unscaled query as qparts bf16 parts
// (SplitQuery), each [nv rounded up to 16 rows (the extra ones zero)][D],
// qpart elements apart; cstride: elements from one key chunk to the next
// (8 x the block size); f16: the keys are fp16 (else bf16); D a multiple
// of 32, at most 256.
KVSTEP_AMX_TARGET void Logits(const Tile16* tiles, int64_t ntiles,
                              int64_t cstride, bool f16, const uint16_t* qb,
                              int64_t qparts, int64_t qpart, int64_t nv,
                              int64_t D, float scale, int64_t ln, float* lg) {
  // Tiles 0-3: the sums of four groups of 16 heads; 4 and 6: their query
  // rows (A); 5: keys (B).
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  const int64_t steps = D / 32, groups = (nv + 15) / 16;
  const int64_t kparts = f16 ? 2 : 1;
  // B rows of tiles k (bt[k % 2]) and k + 1: those of k + 1 are built
  // while k's products run, since a tile load of rows just stored waits for
  // the stores.
  alignas(64) uint32_t bt[2][2][8][16][16];
  alignas(64) float sums[16][16];
  KeyTiles(tiles[0], cstride, f16, D, bt[0]);
  for (int64_t k = 0; k < ntiles; ++k) {
    const Tile16& kt = tiles[k];
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
      const int64_t ng = std::min<int64_t>(4, groups - g0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      // B alternates between tiles 5 and 7, as A does in DotGroups.
      for (int64_t s = 0; s < steps; ++s) {
        for (int64_t j = 0; j < kparts; ++j) {
          const uint16_t* q = qb + g0 * 16 * D + s * 32;
          if ((s * kparts + j) % 2 == 0) {
            _tile_loadd(5, bt[k % 2][j][s], 64);
            for (int64_t i = 0; i < qparts; ++i) {
              DotGroups<5>(ng, q + i * qpart, D * 2, 16 * D);
            }
          } else {
            _tile_loadd(7, bt[k % 2][j][s], 64);
            for (int64_t i = 0; i < qparts; ++i) {
              DotGroups<7>(ng, q + i * qpart, D * 2, 16 * D);
            }
          }
        }
      }
      if (g0 == 0 && k + 1 < ntiles) {
        KeyTiles(tiles[k + 1], cstride, f16, D, bt[(k + 1) % 2]);
        // Tile k + 2's keys into L1 (256 bytes a chunk of 8 dims).
        if (k + 2 < ntiles) {
          for (int64_t c = 0; c < D / 8; ++c) {
            const char* p =
                reinterpret_cast<const char*>(tiles[k + 2].p + c * cstride);
            for (int l = 0; l < 256; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
          }
        }
      }
      for (int64_t g = 0; g < ng; ++g) {
        StoreSums(g, sums);
        const int64_t v0 = (g0 + g) * 16;
        for (int64_t i = 0; i < 16 && v0 + i < nv; ++i) {
          float* row = lg + (v0 + i) * ln + kt.off;
          if (kt.a == 0 && kt.b == 16) {
            _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_load_ps(sums[i]),
                                                _mm512_set1_ps(scale)));
          } else {
            for (int64_t t = kt.a; t < kt.b; ++t) row[t] = sums[i][t] * scale;
          }
        }
      }
    }
  }
  _tile_release();
}

// Rows z[i] of a [16][8] matrix of 32-bit elements, two rows a register
// (rows 2i and 2i + 1), into out[p][n] = element (n, p): 24 permutes.
KVSTEP_AMX_TARGET void Transpose16x8(const __m512i* z, uint32_t (*out)[16]) {
  // Stage 1: rows 4j..4j+3 (z[2j], z[2j+1]) into u[j][k], lane 4 pp + hh =
  // element (4j + hh, 4k + pp). Stage 2: u[2m][k] and u[2m + 1][k] into
  // v[m][k][q], lane 8 pp + hh = element (8m + hh, 4k + 2q + pp). Stage 3:
  // v[0][k][q] and v[1][k][q] into out[4k + 2q + pp], lane n = element (n,
  // 4k + 2q + pp).
  alignas(64) int32_t i1[2][16], i2[2][16], i3[2][16];
  for (int k = 0; k < 2; ++k) {
    for (int pp = 0; pp < 4; ++pp) {
      for (int hh = 0; hh < 4; ++hh) i1[k][pp * 4 + hh] = hh * 8 + 4 * k + pp;
    }
  }
  for (int q = 0; q < 2; ++q) {
    for (int pp = 0; pp < 2; ++pp) {
      for (int hh = 0; hh < 8; ++hh) {
        i2[q][pp * 8 + hh] = (hh < 4 ? 0 : 16) + (2 * q + pp) * 4 + hh % 4;
      }
    }
  }
  for (int pp = 0; pp < 2; ++pp) {
    for (int n = 0; n < 16; ++n) i3[pp][n] = (n < 8 ? 0 : 16) + pp * 8 + n % 8;
  }
  __m512i u[4][2];  // u[j][k]: rows 4j..4j+3, columns 4k..4k+3
  for (int64_t j = 0; j < 4; ++j) {
    for (int k = 0; k < 2; ++k) {
      u[j][k] = _mm512_permutex2var_epi32(z[2 * j], _mm512_load_si512(i1[k]),
                                          z[2 * j + 1]);
    }
  }
  __m512i v[2][2][2];  // v[m][k][q]: rows 8m..8m+7, columns 4k + 2q + 0/1
  for (int64_t m = 0; m < 2; ++m) {
    for (int k = 0; k < 2; ++k) {
      for (int q = 0; q < 2; ++q) {
        v[m][k][q] = _mm512_permutex2var_epi32(
            u[2 * m][k], _mm512_load_si512(i2[q]), u[2 * m + 1][k]);
      }
    }
  }
  for (int k = 0; k < 2; ++k) {
    for (int q = 0; q < 2; ++q) {
      for (int pp = 0; pp < 2; ++pp) {
        _mm512_store_si512(
            out[4 * k + 2 * q + pp],
            _mm512_permutex2var_epi32(v[0][k][q], _mm512_load_si512(i3[pp]),
                                      v[1][k][q]));
      }
    }
  }
}

// Head group g's weights for tile vt's tokens as B rows, each [token
// pair][head] (the VNNI order) of 16 words: their bf16 hi parts, then
// their lo parts (b[0, 256)), or with `dup` hi, hi, lo, lo (b[0, 512));
// weights of tokens outside [a, b) and of heads from nv on are 0.
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void WeightTiles(
    const float* lg, int64_t ln, int64_t nv, int64_t g, const Tile16& vt,
    bool dup, uint32_t* b) {
  const __mmask16 in = vt.InRange();
  __m512i hi[8], lo[8];
  for (int i = 0; i < 8; ++i) {
    // Low half: head 2i's 16 tokens (8 pairs); high half: head 2i + 1.
    __m512 w[2];
    for (int e = 0; e < 2; ++e) {
      const int64_t v = g * 16 + int64_t{2} * i + e;
      w[e] = v < nv ? _mm512_maskz_loadu_ps(in, lg + v * ln + vt.off)
                    : _mm512_setzero_ps();
    }
    Split(&w[0], &w[1], &hi[i], &lo[i]);
  }
  auto* rows = reinterpret_cast<uint32_t(*)[16]>(b);
  Transpose16x8(hi, rows);
  Transpose16x8(lo, rows + (dup ? 16 : 8));
  if (dup) {
    std::memcpy(rows + 8, rows, 8 * sizeof(rows[0]));
    std::memcpy(rows + 24, rows + 16, 8 * sizeof(rows[0]));
  }
}

// C tile c (0-3) from sums.
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void LoadSums(
    int64_t c, const float (*sums)[16]) {
  switch (c) {
    case 0:
      _tile_loadd(0, sums, 64);
      break;
    case 1:
      _tile_loadd(1, sums, 64);
      break;
    case 2:
      _tile_loadd(2, sums, 64);
      break;
    default:
      _tile_loadd(3, sums, 64);
      break;
  }
}

// Whether Values must stage tile vt (fp16: split; bf16: part of its 16
// tokens in range, the rest zeroed) rather than load it from the cache.
inline bool Staged(const Tile16& vt, bool f16) {
  return f16 || vt.a != 0 || vt.b != 16;
}

// Step i of a range of kn tiles (tile i % kn, dims 16 (i / kn) on), if
// Staged, into a[i % 2] as A rows of 64 bytes: fp16 the values' hi then
// their lo parts (32 bf16), bf16 the values as they are (16); slots outside
// [a, b) (which may be unwritten: NaN) zeroed.
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void StageValues(
    const Tile16* range, int64_t kn, int64_t i, int64_t bs, bool f16,
    uint16_t (*a)[16][32]) {
  const Tile16& vt = range[i % kn];
  if (!Staged(vt, f16)) return;
  const uint16_t* src = vt.p + i / kn * 16 * bs;
  uint16_t(*rows)[32] = a[i % 2];
  const __mmask16 in = vt.InRange();
  for (int m = 0; m < 16; m += 2) {
    const __m256i r0 = _mm256_maskz_loadu_epi16(in, src + m * bs);
    const __m256i r1 = _mm256_maskz_loadu_epi16(in, src + (m + 1) * bs);
    if (f16) {
      __m512i hi, lo;
      SplitHalves(_mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1), &hi,
                  &lo);
      _mm512_store_si512(rows[m],
                         _mm512_shuffle_i64x2(hi, lo, _MM_SHUFFLE(1, 0, 1, 0)));
      _mm512_store_si512(rows[m + 1],
                         _mm512_shuffle_i64x2(hi, lo, _MM_SHUFFLE(3, 2, 3, 2)));
    } else {
      _mm256_store_si256(reinterpret_cast<__m256i*>(rows[m]), r0);
      _mm256_store_si256(reinterpret_cast<__m256i*>(rows[m + 1]), r1);
    }
  }
}

// C tile c (0-3) += A tile kA x B tile kB.
template <int kA, int kB>
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void Product(
    int64_t c) {
  switch (c) {
    case 0:
      TileDp<0, kA, kB>();
      break;
    case 1:
      TileDp<1, kA, kB>();
      break;
    case 2:
      TileDp<2, kA, kB>();
      break;
    default:
      TileDp<3, kA, kB>();
      break;
  }
}

// Values' products of one tile of values (A tile kA) and its weights for
// ng head groups (w: 512 words a group, WeightTiles): B tile 6 the hi
// parts, 7 the lo parts (at w + lo).
template <int kA>
KVSTEP_AMX_TARGET __attribute__((always_inline)) inline void ValueProducts(
    int64_t ng, int64_t lo, const uint32_t* w) {
  for (int64_t g = 0; g < ng; ++g, w += 512) {
    _tile_loadd(6, w, 64);
    Product<kA, 6>(g);
    _tile_loadd(7, w + lo, 64);
    Product<kA, 7>(g);
  }
}

// Tiles a range of Values takes at a time: their values (64 KB of bf16 at
// head size 128) and weights (64 KB for 64 heads, fp16 128) stay in L2
// while each 16 dims of them are multiplied.
constexpr int64_t kValueRange = 16;

// acc_out[v * D + d] = sum over every tile's tokens t in [a, b) of
// weight(v, t) * value(t, d), v < nv: the weights (fp32, lg[v * ln + off +
// t]) as bf16 hi + lo parts, the values bf16 as they are or fp16 (f16) as
// their exact hi + lo parts. C tiles are 16 dims x 16 virtual heads, A the
// values of 16 dims (rows) x 16 tokens, B 16 tokens x 16 heads of the
// weights (in token pairs), one product for the weights' hi parts and one
// for their lo parts. bf16 values go in straight from the cache (vLLM
// layout: a dim's tokens are adjacent). An fp16 A row holds a tile's 16
// values' hi parts then their lo parts, against B rows of the weights'
// parts twice: a product takes 32 tokens as quickly as 16 (about 5 ns), so
// the lo x lo products come for free. Tiles go in ranges of kValueRange,
// each 16 dims' values read (and split) once for up to 64 heads, the sums
// carried from range to range in fp32. wb: scratch for 2048 words a tile
// of a range and 1024 per 16 dims; D a multiple of 16, at most 256.
KVSTEP_AMX_TARGET void Values(const Tile16* tiles, int64_t ntiles, int64_t bs,
                              bool f16, const float* lg, int64_t ln, int64_t nv,
                              int64_t D, uint32_t* wb, float* acc_out) {
  // Tiles 0-3: sums of 4 head groups; 4, 5: values (alternately, so that
  // one loads while the other's products run); 6, 7: weights, hi and lo.
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = t == 4 || t == 5 ? (f16 ? 64 : 32) : 64;
    cfg.rows[t] = t >= 6 && !f16 ? 8 : 16;
  }
  _tile_loadconfig(&cfg);
  const int64_t groups = (nv + 15) / 16, lo = f16 ? 256 : 128;
  // carry[d][g]: the sums of dims d * 16 + m (rows) for heads 16 g + n.
  auto* carry = reinterpret_cast<float(*)[4][16][16]>(wb + kValueRange * 2048);
  alignas(64) uint16_t a[2][16][32];
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, groups - g0);
    for (int64_t k0 = 0; k0 < ntiles; k0 += kValueRange) {
      const int64_t k1 = std::min(ntiles, k0 + kValueRange);
      for (int64_t k = k0; k < k1; ++k) {
        for (int64_t g = 0; g < ng; ++g) {
          WeightTiles(lg, ln, nv, g0 + g, tiles[k], f16,
                      wb + ((k - k0) * 4 + g) * 512);
        }
      }
      // The (16 dims, tile) pairs of the range in order, i = d * kn + k -
      // k0. A staged tile i is staged (a[i % 2]) while the products of
      // i - 1 run: a tile load of rows just stored waits for the stores.
      const int64_t kn = k1 - k0, n = D / 16 * kn;
      StageValues(tiles + k0, kn, 0, bs, f16, a);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t d = i / kn, k = k0 + i % kn;
        if (k == k0) {
          for (int64_t g = 0; g < ng; ++g) {
            if (k0 == 0) std::memset(carry[d][g], 0, sizeof(carry[d][g]));
            LoadSums(g, carry[d][g]);
          }
        }
        const Tile16& vt = tiles[k];
        const bool staged = Staged(vt, f16);
        const void* src = staged ? static_cast<const void*>(a[i % 2])
                                 : static_cast<const void*>(vt.p + d * 16 * bs);
        const int64_t stride = staged ? 64 : bs * 2;
        const uint32_t* w = wb + (k - k0) * 2048;
        if (i % 2 == 0) {
          _tile_loadd(4, src, stride);
          ValueProducts<4>(ng, lo, w);
        } else {
          _tile_loadd(5, src, stride);
          ValueProducts<5>(ng, lo, w);
        }
        if (i + 1 < n) StageValues(tiles + k0, kn, i + 1, bs, f16, a);
        // Step i + 2's values into L1: a tile load that misses stalls the
        // products queued behind it (bf16: 0.96x the time of a prefill
        // chunk, against 1.04x without).
        if (i + 2 < n) {
          const Tile16& next = tiles[k0 + (i + 2) % kn];
          const char* p =
              reinterpret_cast<const char*>(next.p + (i + 2) / kn * 16 * bs);
          for (int64_t l = 0; l < bs * 32; l += 64) {
            _mm_prefetch(p + l, _MM_HINT_T0);
          }
        }
        if (k == k1 - 1) {
          for (int64_t g = 0; g < ng; ++g) StoreSums(g, carry[d][g]);
        }
      }
    }
    for (int64_t d = 0; d < D / 16; ++d) {
      for (int64_t g = 0; g < ng; ++g) {
        // carry[d][g][m][n]: dim d * 16 + m, head (g0 + g) * 16 + n.
        for (int64_t n = 0; n < 16 && (g0 + g) * 16 + n < nv; ++n) {
          float* o = acc_out + ((g0 + g) * 16 + n) * D + d * 16;
          for (int m = 0; m < 16; ++m) o[m] = carry[d][g][m][n];
        }
      }
    }
  }
  _tile_release();
}

}  // namespace amx

// The head-size step of the NHD layout's rows over every KV head for fp8
// caches (Attender::RowTokens; other dtypes: 16): the step of their fp8
// key tiles, which take the keys by VDPBF16PS (NhdFp8Dot). BestFp8DotScope
// reads it too, so that what GetServerInfo reports follows the kernel.
constexpr int64_t kNhdFp8RowHeadStep = 64;

// The fp8 VDPBF16PS passes (LogitsFp8Dot, ValuesFp8Dot) add AVX512-VBMI
// (VPERMI2B) to the AVX-512 build's features, in their own functions only:
// those run where Fp8DotUsable, and the rest of the build also on CPUs
// without VBMI (Cooper Lake has AVX512-BF16 but not VBMI).
#define KVSTEP_FP8_DOT_TARGET                                               \
  __attribute__((                                                           \
      target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c," \
             "avx512vbmi")))
KVSTEP_TARGET_PUSH(
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#define KVSTEP_ATTN_NS avx512
#define KVSTEP_ATTN_F16C 1
#define KVSTEP_ATTN_AVX512 1
#include "core/attention_kernel.inc"  // NOLINT(build/include)
#undef KVSTEP_ATTN_AVX512
#undef KVSTEP_ATTN_F16C
#undef KVSTEP_ATTN_NS
KVSTEP_TARGET_POP()

KVSTEP_TARGET_PUSH("avx2,fma,f16c")
#define KVSTEP_ATTN_NS avx2
#define KVSTEP_ATTN_F16C 1
#include "core/attention_kernel.inc"  // NOLINT(build/include)
#undef KVSTEP_ATTN_F16C
#undef KVSTEP_ATTN_NS
KVSTEP_TARGET_POP()
#endif

#define KVSTEP_ATTN_NS portable
#include "core/attention_kernel.inc"  // NOLINT(build/include)
#undef KVSTEP_ATTN_NS

using Isa = AttentionParams::Isa;

template <typename T>
struct Tag {
  using type = T;
};

#ifdef KVSTEP_ATTN_X86
bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    // clang 14 has no "f16c" for __builtin_cpu_supports: CPUID.1:ECX[29].
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c =
        __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           f16c;
  }();
  return has;
}
bool HasAvx512() {
  static const bool has = [] {
    // clang 14 has no "avx512bf16" for __builtin_cpu_supports:
    // CPUID.(7,1):EAX[5]. The OS must also save the ZMM state (XCR0 bits
    // 5-7), which __builtin_cpu_supports("avx512f") checks.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool bf16 = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0 &&
                      (eax & (1u << 5)) != 0;
    return HasAvx2() && bf16 && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return has;
}
bool AmxUsable() {
  static const bool usable = [] {
    if (!HasAvx512()) return false;
    // CPUID.(7,0):EDX[22] AMX-BF16, [24] AMX-TILE; then the kernel's
    // permission for the tile data (ARCH_REQ_XCOMP_PERM, XTILEDATA = 18),
    // which Linux grants per process.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0 ||
        (edx & (1u << 22)) == 0 || (edx & (1u << 24)) == 0) {
      return false;
    }
#if defined(__linux__) && defined(__x86_64__)
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // NOLINT
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
    return false;
#endif
  }();
  return usable;
}
bool Fp8DotUsable() {
  static const bool usable = [] {
    // CPUID.(7,0):ECX[1] AVX512-VBMI.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return HasAvx512() &&
           __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) != 0 &&
           (ecx & (1u << 1)) != 0;
  }();
  return usable;
}
#else
bool HasAvx2() { return false; }
bool HasAvx512() { return false; }
bool AmxUsable() { return false; }
bool Fp8DotUsable() { return false; }
#endif

// The instruction set a request runs on: kBest resolved, else as asked
// (callers check IsaSupported first).
Isa Resolve(Isa isa) {
  if (isa != Isa::kBest) return isa;
  if (HasAvx512()) return Isa::kAvx512;
  if (HasAvx2()) return Isa::kAvx2;
  return Isa::kPortable;
}

std::string RowError(int64_t r, const std::string& what) {
  return absl::StrFormat("row %d: %s", r, what);
}

// How many consecutive (row, KV head) items a thread claims at a time, out
// of n with kvh KV heads a row, over `threads`: the most, up to a whole row,
// that divide n into claims whose count is a multiple of the threads (or
// at least 8 a thread, which balance anyway). A row's KV heads share its
// blocks, side by side in the vLLM layout. On two threads, calls took
// 0.68-1.09x the time of one item a claim, 0.7-0.9x in most cases
// (attention_bench A/B, cold caches, 21 of 23 cases faster, the slower two
// batch 1 at context 1024; docs/attention.md, session 7). Our guess at
// why: a core's hardware prefetcher runs on past its 4 KB slice into the
// next head's, wasted when the other core is the one that reads it.
int64_t ClaimSize(int64_t n, int64_t kvh, int64_t threads) {
  for (int64_t g = std::min(kvh, n); g > 1; --g) {
    if (n % g != 0) continue;
    const int64_t claims = n / g;
    if (claims % threads == 0 || claims >= 8 * threads) return g;
  }
  return 1;
}

// Run's long decode rows under kAuto (BestLongRowRanges): rows whose keys
// (within the sliding window) hold at least kLongRowBytes of K/V a KV head
// (4096 keys of a 16-bit cache at head size 128, 2048 of fp32), in ranges
// of kLongRowRange keys.
constexpr int64_t kLongRowBytes = int64_t{2} << 20;
constexpr int64_t kLongRowRange = 1024;

// Whether rows of `keys` keys each, claimed in that order by `threads`
// threads (each taking the next row as it finishes one), finish within
// kLongRowSlack of an even split of the keys: Run's long rows are whole
// rows a thread, which gained 3-11% on two threads where they balance
// (docs/attention.md, session 50) and would lose far more where one
// thread is left with a row the other has no match for (batch 1: half).
// Run offers the rows longest first, which balances where index order
// may not (rows of 8k, 8k and 16k keys on two threads: 1.0 against 1.5).
// Always true on one thread.
constexpr double kLongRowSlack = 1.02;
bool RowClaimsBalance(absl::Span<const int64_t> keys, int64_t threads) {
  if (threads <= 1) return true;
  std::vector<int64_t> load(static_cast<size_t>(threads), 0);
  int64_t all = 0;
  for (const int64_t k : keys) {
    *std::min_element(load.begin(), load.end()) += k;
    all += k;
  }
  const int64_t most = *std::max_element(load.begin(), load.end());
  return static_cast<double>(most) * static_cast<double>(threads) <=
         kLongRowSlack * static_cast<double>(all);
}

// The items Run's long rows split each row into: one, except for a call of
// one row on more than one thread, whose ranges are split between the
// threads (that row's claims cannot balance as a whole).
int64_t RowSpans(int64_t rows, int64_t threads) {
  return rows == 1 && threads > 1 ? threads : 1;
}

// UnevenClaims' share, the work a claim holds about (unless one chunk of
// one KV head, or a whole row, holds more): a kClaimsAThread-th of a
// thread's work (the call's over the threads). An 8th did as well from
// the front alone; from both ends the last claims before the ends meet
// are the imbalance, so they are kept small.
constexpr int64_t kClaimsAThread = 32;

// internal::UnevenClaims (see attention.h), for Run's calls whose rows hold
// different numbers of query tokens. ClaimSize's claims assume items of
// equal work: a prefill chunk's KV heads, claimed as a row, left one
// thread with the chunk and the other idle once the decode rows were done
// (a 512-token chunk at 2048 keys beside 16 decode rows, bf16, two
// threads: 1.76x the time of the two calls apart; docs/attention.md,
// session 71).
std::vector<internal::ItemClaim> UnevenClaimsOf(
    const AttentionRows& rows, int64_t kvh, int64_t threads, int64_t chunk,
    int64_t row_tokens,
    const std::function<int64_t(int64_t, int64_t)>& chunk_keys) {
  using internal::ItemClaim;
  // A KV head's work in each row: query tokens x keys, chunk by chunk.
  std::vector<double> head_work(static_cast<size_t>(rows.num_real), 0.0);
  double all = 0;
  auto chunk_work = [&](int64_t r, int64_t qi) {
    const int64_t qe = rows.query_start[r + 1];
    return static_cast<double>(std::min(chunk, qe - qi)) *
           static_cast<double>(chunk_keys(r, qi));
  };
  for (int64_t r = 0; r < rows.num_real; ++r) {
    for (int64_t qi = rows.query_start[r]; qi < rows.query_start[r + 1];
         qi += chunk) {
      head_work[r] += chunk_work(r, qi);
    }
    all += head_work[r] * static_cast<double>(kvh);
  }
  const double share =
      all / static_cast<double>(kClaimsAThread * std::max<int64_t>(1, threads));
  std::vector<ItemClaim> claims;
  for (int64_t r = 0; r < rows.num_real; ++r) {
    const int64_t qs = rows.query_start[r], qe = rows.query_start[r + 1];
    if (qs == qe) continue;
    const double w = head_work[r];
    if (row_tokens > 0 && qe - qs <= row_tokens) {
      claims.push_back({r, 0, kvh, qs, qe, true, w * static_cast<double>(kvh)});
      continue;
    }
    if (w <= share) {
      // The most KV heads (a divisor of kvh) within a share: decode rows
      // beside a prefill chunk keep a row's heads on one thread, as
      // ClaimSize does.
      int64_t g = 1;
      for (int64_t d = kvh; d > 1; --d) {
        if (kvh % d == 0 && static_cast<double>(d) * w <= share) {
          g = d;
          break;
        }
      }
      for (int64_t h = 0; h < kvh; h += g) {
        claims.push_back(
            {r, h, h + g, qs, qe, false, w * static_cast<double>(g)});
      }
      continue;
    }
    // Whole chunks from the row's first, up to a share each (at least one),
    // every KV head's.
    int64_t q0 = qs;
    double piece = 0;
    auto emit = [&](int64_t q1) {
      for (int64_t h = 0; h < kvh; ++h) {
        claims.push_back({r, h, h + 1, q0, q1, false, piece});
      }
    };
    for (int64_t qi = qs; qi < qe; qi += chunk) {
      const double cw = chunk_work(r, qi);
      if (qi > q0 && piece + cw > share) {
        emit(qi);
        q0 = qi;
        piece = 0;
      }
      piece += cw;
    }
    emit(qe);
  }
  // Heaviest first, equal ones in row order. Claims of more than a
  // quarter of each thread's work (rows that cannot be cut finer: a whole
  // row, one chunk of a KV head) are `coarse`: every thread takes those
  // first, heaviest first, where Run's claims from both ends would leave
  // them to one thread.
  std::stable_sort(
      claims.begin(), claims.end(),
      [](const ItemClaim& x, const ItemClaim& y) { return x.work > y.work; });
  const double coarse =
      all / static_cast<double>(4 * std::max<int64_t>(1, threads));
  for (ItemClaim& c : claims) c.coarse = c.work > coarse;
  return claims;
}

// Schedules the kernel A (an Attender) over (row, KV head) items, or over
// (row, KV head, partition) items plus a reduction.
template <typename A>
void Run(const KvCache& cache, int64_t layer, const Tensor& query,
         const AttentionRows& rows, const AttentionParams& p, ThreadPool* pool,
         Tensor* out) {
  const int64_t kvh = cache.config().num_kv_heads;
  const int64_t D = cache.config().head_size;
  const int64_t P = p.partition_size;
  int64_t max_len = 0;
  double pairs = 0;  // (query token, key) pairs, keys counted to seq_len
  for (int64_t r = 0; r < rows.num_real; ++r) {
    max_len = std::max(max_len, rows.seq_lens[r]);
    pairs += static_cast<double>(rows.seq_lens[r]) *
             static_cast<double>(rows.query_start[r + 1] - rows.query_start[r]);
  }
  const int64_t max_parts = (max_len + P - 1) / P;
  // Small calls run on the caller alone: a second thread wakes tens of us
  // late on this VM and then competes for the same memory, so under 4 MiB
  // of K/V two threads took longer than one (attention_bench, bf16, batch
  // 1, two threads, cold caches: context 128 2.5x and 512 1.8x the time of
  // the caller alone; 4 MiB and up about equal or ahead; see
  // docs/attention.md). The measure is K/V bytes times query tokens, so
  // that a prefill chunk, which does far more arithmetic per byte, goes
  // parallel sooner; fp8 bytes count twice, as a 16-bit element's work per
  // byte: fp8 decode of 1024 keys x 8 KV heads (2 MiB) on two threads took
  // 0.73x the time of the caller alone (best calls; session 37), where the
  // same bytes of bf16 (512 keys) took 1.8x.
  const int64_t esize = DTypeSize(cache.config().dtype);
  const double bytes = pairs * 2.0 * static_cast<double>(kvh * D) *
                       static_cast<double>(esize == 1 ? 2 : esize);
  if (bytes < static_cast<double>(p.parallel_min_bytes)) pool = nullptr;
  const int64_t threads = pool != nullptr ? pool->num_threads() : 1;
  const A a(cache, layer, query, rows, p, threads, out);
  const int64_t G = a.group();
  // Items are (row, KV head), or whole rows where the kernel reads all of
  // a row's KV heads at once (Attender::RowTokens: the NHD layout, rows of
  // few query tokens; the vLLM layout, decode rows); heads [h0, h1) of an
  // item's row.
  // Query tokens of the longest row, and of the shortest with any.
  int64_t max_tokens = 0, min_tokens = std::numeric_limits<int64_t>::max();
  for (int64_t r = 0; r < rows.num_real; ++r) {
    const int64_t n = rows.query_start[r + 1] - rows.query_start[r];
    max_tokens = std::max(max_tokens, n);
    if (n > 0) min_tokens = std::min(min_tokens, n);
  }
  const bool by_rows = a.RowTokens() > 0 && max_tokens <= a.RowTokens();
  const int64_t heads_per_item = by_rows ? kvh : 1;
  const int64_t items = rows.num_real * (kvh / heads_per_item);
  auto item_heads = [&](int64_t item, int64_t* r, int64_t* h0) {
    *r = item / (kvh / heads_per_item);
    *h0 = item % (kvh / heads_per_item) * heads_per_item;
  };
  // Auto: partition only when items are too few to keep the threads busy
  // and contexts are long enough to split. Measured with attention_bench
  // on 2 threads, batch 1, bf16 (docs/attention.md): one KV head, v2 takes
  // 0.53x v1's time; two, about equal; eight, v1 is as fast or faster,
  // since v2 adds a reduction pass. Row items on one thread have nothing
  // to balance: a batch of one row item (NHD or vLLM rows) took 0.92-0.93x
  // v2's time by v1 in the vLLM layout and 0.97-0.99x in NHD (bf16 and
  // fp32, 1024 keys; vLLM bf16 at 4096 keys 0.88x; session 23), and rows
  // bound their logits by segments.
  // Per-head items keep v2 there: their single pass holds the logits of a
  // whole row (an MQA prefill chunk at 32k keys: 16 tokens x 32 heads x 32k
  // floats, 64 MB), v2's 512-key partitions do not.
  // Long decode rows (A::LongRowRanges: the Intel Xeon's choice), where
  // rows of kLongRowBytes a KV head or more hold at least half the call's
  // keys and whole rows a thread balance (RowClaimsBalance), take each row
  // in kLongRowRange-key ranges, every KV head's range before the next
  // range (below). In a per-KV-head item the next head reads the slices
  // beside this head's, whose page translations (this VM's host maps
  // guest memory in 4 KB pages; one 64-byte page-table line covers a
  // block's 32 KB of slices) the single pass's 4 MB of K/V a head at 8192
  // 16-bit keys has pushed out of L2: walks that a call after a flush of
  // its lines, which leaves those lines cached, does without, taking
  // 0.926x the time at 8192 keys and 1.00x at 1024 (bf16, equal bytes;
  // session 49). The single pass took 1.03-1.12x the time of the ranges
  // at 8192 16-bit keys (batches 1-256, one and two threads), 1.05-1.12x
  // at 4096 and 8192 fp32 keys, 1.12-1.13x for 8-32 rows of 8k-16k keys
  // on two threads; at 4096 16-bit keys (2 MB a head) 0.98-1.02x, at 2048
  // fp32 keys 1.00x; ranges of 512 keys lost 2-4% to 1024
  // (docs/attention.md, session 50). Session 60 measured those again, call
  // by call on the Intel Xeon model 207: the ranges took 0.960-0.997x the
  // single pass's time at 4096 16-bit keys (one short run of 8 pairs at a
  // batch of 256: 1.012) and 0.979-0.994x at 2048 fp32 keys (batches
  // 1-256, one and two threads), so the gate went from 4 MiB a KV head to
  // 2 MiB; at 2048 16-bit keys (1 MiB) they took 0.995-1.007x, and the
  // gate stays above that.
  bool long_rows = p.kernel == AttentionParams::Kernel::kAuto &&
                   max_tokens == 1 && !by_rows && a.LongRowRanges();
  // Long rows' claim order: the rows by their keys, longest first, on
  // more than one thread (RowClaimsBalance); as they come on one.
  std::vector<int64_t> row_order;
  if (long_rows) {
    // A row's keys: its decode query's range (within the sliding window).
    std::vector<int64_t> keys(static_cast<size_t>(rows.num_real));
    int64_t long_keys = 0, all_keys = 0;
    for (int64_t r = 0; r < rows.num_real; ++r) {
      int64_t lo, hi;
      a.Range(rows.seq_lens[r] - 1, &lo, &hi);
      keys[r] = hi - lo;
      all_keys += keys[r];
      if (keys[r] * D * esize * 2 >= kLongRowBytes) long_keys += keys[r];
    }
    long_rows = long_keys > 0 && 2 * long_keys >= all_keys;
    if (long_rows) {
      row_order.resize(keys.size());
      std::iota(row_order.begin(), row_order.end(), 0);
      if (threads > 1) {
        std::stable_sort(
            row_order.begin(), row_order.end(),
            [&keys](int64_t x, int64_t y) { return keys[x] > keys[y]; });
      }
      std::vector<int64_t> claimed(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) claimed[i] = keys[row_order[i]];
      long_rows = RowSpans(rows.num_real, threads) > 1 ||
                  RowClaimsBalance(claimed, threads);
    }
  }
  // Calls with prefill rows (more than one query token; not read by rows)
  // of different sizes, or (kAuto) of fewer (row, KV head) items than
  // twice the threads, take UnevenClaims' claims: the rows' work (query tokens
  // x keys) in claims of about a 32nd of a thread's, by KV heads and by chunks,
  // rows of up to RowTokens query tokens (decode rows beside a chunk) as items
  // over every KV head, as in calls of such rows alone. ClaimSize's claims
  // assume rows of equal work (a 512-token chunk beside 16 decode rows on
  // two threads: 1.73-1.85x the time of the two calls apart), and v2's
  // partitions for few items (a 512-token chunk of one or two KV heads)
  // took 1.33-1.50x the time of the claims on one thread or two, and a
  // chunk of one KV head within one partition ran on one thread; calls of
  // equal prefill rows and enough items keep ClaimSize's (the claims took
  // 1.00-1.02x their time there; docs/attention.md, session 71).
  const bool few_items = items < int64_t{2} * threads;
  const bool by_claims =
      !by_rows && max_tokens > 1 &&
      p.kernel != AttentionParams::Kernel::kPartitioned &&
      (min_tokens < max_tokens ||
       (p.kernel == AttentionParams::Kernel::kAuto && few_items));
  const bool partitioned =
      p.kernel == AttentionParams::Kernel::kPartitioned ||
      (p.kernel == AttentionParams::Kernel::kAuto && max_parts > 1 &&
       few_items && !(threads == 1 && by_rows) && !by_claims);
  auto run = [&](const std::function<void(int64_t)>& fn, int64_t n) {
    if (pool != nullptr) {
      pool->ParallelFor(n, fn);
    } else {
      for (int64_t i = 0; i < n; ++i) fn(i);
    }
  };
  constexpr int64_t kChunk = A::kChunk;
  // Virtual heads of one chunk of one item, for which Partial writes its
  // results (by rows: a row's every token, at most RowTokens).
  const int64_t item_heads_max =
      std::max((by_rows ? max_tokens : kChunk) * G * heads_per_item,
               by_claims ? a.RowTokens() * G * kvh : int64_t{0});
  // body(scratch, k) on `tasks` participating threads (k: the task), each
  // with a scratch reused across its items (a fresh one per item cost a
  // malloc and a memset of tens of KB each) and kept by the thread for its
  // next call (ScratchLease).
  auto on_threads = [&](int64_t tasks,
                        const std::function<void(Scratch&, int64_t)>& body) {
    run(
        [&](int64_t k) {
          ScratchLease lease;
          Scratch& scratch = lease.get();
          scratch.m.resize(item_heads_max);
          scratch.s.resize(item_heads_max);
          scratch.acc.resize(item_heads_max * D);
          body(scratch, k);
        },
        tasks);
  };
  // Items claimed from a counter, g consecutive ones at a time, so uneven
  // ones still balance.
  auto run_items = [&](const std::function<void(Scratch&, int64_t)>& fn,
                       int64_t n, int64_t g) {
    std::atomic<int64_t> next{0};
    on_threads(
        std::min(threads, (n + g - 1) / g), [&](Scratch& scratch, int64_t) {
          for (int64_t i = next.fetch_add(g); i < n; i = next.fetch_add(g)) {
            for (int64_t j = i; j < std::min(n, i + g); ++j) {
              fn(scratch, j);
            }
          }
        });
  };
  if (long_rows) {
    // Each row in kLongRowRange-key ranges, every KV head's range in
    // turn before the next range, each range's results merged into the
    // head's running ones as they come (Attender::Merge, as the rows' key
    // segments are): the partitioned kernel's order without its
    // partitions' buffer and reduction, so a call keeps a row's running
    // results (kvh x G x (head_size + 2) floats) whatever its size. Items
    // are whole rows.
    long_row_range_calls.fetch_add(1, std::memory_order_relaxed);
    // One row on more threads (RowSpans): its ranges in `spans` runs of
    // consecutive ranges, an item each, whose results the last to finish
    // merges in span order.
    const int64_t spans = RowSpans(rows.num_real, threads);
    const int64_t per = kvh * G * (D + 2);  // a row's running acc, m, s
    std::vector<float> span_results(spans > 1 ? spans * per : 0);
    std::vector<uint8_t> span_used(spans, 0);
    std::atomic<int64_t> spans_left{spans};
    run_items(
        [&](Scratch& scratch, int64_t i) {
          const int64_t r = row_order[i / spans], j = i % spans;
          const int64_t qi = rows.query_start[r], qe = rows.query_start[r + 1];
          float* run_acc;  // [kvh][G][D], then m, s
          if (spans > 1) {
            run_acc = &span_results[j * per];
          } else {
            scratch.running.resize(per);
            run_acc = scratch.running.data();
          }
          float* run_m = run_acc + kvh * G * D;
          float* run_s = run_m + kvh * G;
          int64_t ntok = 0, pos0 = 0, lo = 0, hi = 0;
          if (qi < qe) a.Chunk(r, qi, qe, &ntok, &pos0, &lo, &hi);
          // Span j's ranges of the row's n (aligned to kLongRowRange keys).
          const int64_t first = lo / kLongRowRange;
          const int64_t n = hi > lo ? (hi - 1) / kLongRowRange - first + 1 : 0;
          const int64_t a0 =
              std::max(lo, (first + j * n / spans) * kLongRowRange);
          const int64_t b0 =
              std::min(hi, (first + (j + 1) * n / spans) * kLongRowRange);
          for (int64_t k0 = a0; k0 < b0;) {
            const int64_t k1 =
                std::min(b0, (k0 / kLongRowRange + 1) * kLongRowRange);
            for (int64_t h = 0; h < kvh; ++h) {
              if (k0 == a0) {
                a.PartialHeads(scratch, r, h, h + 1, qi, ntok, pos0, k0, k1,
                               run_m + h * G, run_s + h * G,
                               run_acc + h * G * D, hi - lo);
              } else {
                a.PartialHeads(scratch, r, h, h + 1, qi, ntok, pos0, k0, k1,
                               scratch.m.data(), scratch.s.data(),
                               scratch.acc.data(), hi - lo);
                a.Merge(G, scratch.m.data(), scratch.s.data(),
                        scratch.acc.data(), run_m + h * G, run_s + h * G,
                        run_acc + h * G * D);
              }
            }
            k0 = k1;
          }
          if (spans > 1) {
            span_used[j] = a0 < b0;
            // acq_rel: the other spans' results and flags before the last
            // one's reads.
            if (spans_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
            int64_t base = -1;
            for (int64_t t = 0; t < spans; ++t) {
              if (!span_used[t]) continue;
              if (base < 0) {
                base = t;
                continue;
              }
              // Every KV head at once: acc, m and s run over [kvh][G].
              const float* acc2 = &span_results[t * per];
              float* acc = &span_results[base * per];
              a.Merge(kvh * G, acc2 + kvh * G * D, acc2 + kvh * G * (D + 1),
                      acc2, acc + kvh * G * D, acc + kvh * G * (D + 1), acc);
            }
            if (base < 0) return;  // no query token
            run_acc = &span_results[base * per];
            run_s = run_acc + kvh * G * (D + 1);
          } else if (a0 >= b0) {
            return;  // no query token
          }
          for (int64_t h = 0; h < kvh; ++h) {
            a.Store(qi, h, run_acc + h * G * D, run_s + h * G);
          }
        },
        rows.num_real * spans, 1);
    return;
  }
  // KV heads [h0, h1) of row r (one head, or every head of a row item)
  // over its query tokens [q0, q1), whole chunks from the row's first.
  auto item = [&](Scratch& scratch, int64_t r, int64_t h0, int64_t h1,
                  int64_t q0, int64_t q1) {
    const int64_t qe = rows.query_start[r + 1];
    for (int64_t qi = q0; qi < q1; qi += kChunk) {
      int64_t ntok, pos0, lo, hi;
      a.Chunk(r, qi, qe, &ntok, &pos0, &lo, &hi);
      a.PartialHeads(scratch, r, h0, h1, qi, ntok, pos0, lo, hi,
                     scratch.m.data(), scratch.s.data(), scratch.acc.data());
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t k = 0; k < ntok; ++k) {
          const int64_t v = ((h - h0) * ntok + k) * G;
          a.Store(qi + k, h, &scratch.acc[v * D], &scratch.s[v]);
        }
      }
    }
  };
  if (by_claims) {
    uneven_claim_calls.fetch_add(1, std::memory_order_relaxed);
    const std::vector<internal::ItemClaim> claims = UnevenClaimsOf(
        rows, kvh, threads, kChunk, a.RowTokens(), [&](int64_t r, int64_t qi) {
          int64_t ntok, pos0, lo, hi;
          a.Chunk(r, qi, rows.query_start[r + 1], &ntok, &pos0, &lo, &hi);
          return hi - lo;
        });
    // Claimed from both ends of the list, heaviest first by even-numbered
    // threads and lightest first by odd ones (after the coarse claims,
    // which every thread takes from the front), until the ends meet: a
    // chunk's arithmetic on one core then runs beside decode rows' reads
    // on the other, where from the front alone both cores took the chunk
    // and then both the rows (two threads, a chunk of 16-512 tokens beside
    // 16-64 decode rows: 0.84-0.98x the time of the two calls apart,
    // against 0.99-1.01x; docs/attention.md, session 71). The ends: front
    // in the low 32 bits, back in the high (claims are at most the query
    // tokens times the KV heads, far under 2^32 for any query that fits
    // in memory).
    const auto n = static_cast<uint64_t>(claims.size());
    std::atomic<uint64_t> ends{n << 32};
    auto claim = [&ends, &claims](bool from_back) -> int64_t {
      uint64_t e = ends.load(std::memory_order_relaxed);
      for (;;) {
        const uint64_t front = e & 0xffffffffu, back = e >> 32;
        if (front >= back) return -1;
        const bool b = from_back && !claims[front].coarse;
        const uint64_t next =
            b ? (back - 1) << 32 | front : back << 32 | (front + 1);
        if (ends.compare_exchange_weak(e, next, std::memory_order_relaxed)) {
          return static_cast<int64_t>(b ? back - 1 : front);
        }
      }
    };
    on_threads(std::min<int64_t>(threads, static_cast<int64_t>(n)),
               [&](Scratch& scratch, int64_t k) {
                 const bool from_back = k % 2 == 1;
                 for (int64_t i = claim(from_back); i >= 0;
                      i = claim(from_back)) {
                   const internal::ItemClaim& c = claims[i];
                   if (c.whole) {
                     item(scratch, c.row, 0, kvh, c.q0, c.q1);
                     continue;
                   }
                   for (int64_t h = c.h0; h < c.h1; ++h) {
                     item(scratch, c.row, h, h + 1, c.q0, c.q1);
                   }
                 }
               });
    return;
  }
  if (!partitioned) {
    run_items(
        [&](Scratch& scratch, int64_t i) {
          int64_t r, h0;
          item_heads(i, &r, &h0);
          item(scratch, r, h0, h0 + heads_per_item, rows.query_start[r],
               rows.query_start[r + 1]);
        },
        items, by_rows ? 1 : ClaimSize(items, kvh, threads));
    return;
  }
  // Partitioned: item (row, heads, partition) computes partial results
  // for every query token of the row, which are then reduced: for decode
  // rows by whichever thread finishes a row's last partition, at once; for
  // rows with more query tokens by a second pass over (token, KV head),
  // which spreads their larger reduction over the threads. That pass, a
  // second fork and join, took one-row decode calls on two threads
  // 1.011-1.024x the time at 1024 keys (bf16, fp16, fp32: 4-8 MiB), 1.007x
  // at 2048 (bf16) and 1.000x at 4096 (docs/attention.md, session 26).
  // Read only where `used` says a partition wrote it: not zeroed.
  const int64_t T = rows.query_start[rows.num_real];
  const int64_t stride = G * (D + 2);  // partitions' floats: m, s, acc a head
  const std::unique_ptr<float[]> partial(
      new float[static_cast<size_t>(T * kvh * max_parts * stride)]);
  std::vector<uint8_t> used(static_cast<size_t>(T * kvh * max_parts), 0);
  // Token qi's results for KV head h from its partitions; acc [G * D],
  // denom and M [G] are the caller's scratch.
  auto reduce = [&](int64_t qi, int64_t h, float* acc, float* denom, float* M) {
    std::fill(acc, acc + G * D, 0.0f);
    std::fill(denom, denom + G, 0.0f);
    std::fill(M, M + G, -std::numeric_limits<float>::infinity());
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
    a.Store(qi, h, acc, denom);
  };
  const bool fold = max_tokens == 1;
  // fold: partitions of item i not yet finished. Its last one reduces the
  // item's results; acq_rel orders the other partitions' writes of
  // `partial` and `used` before that thread's reads.
  std::unique_ptr<std::atomic<int64_t>[]> left;
  if (fold) {
    left.reset(new std::atomic<int64_t>[static_cast<size_t>(items)]);
    for (int64_t i = 0; i < items; ++i) {
      left[i].store(max_parts, std::memory_order_relaxed);
    }
  }
  // Work items run partition-major within a row: partition p of each of
  // the row's KV-head items in turn, then partition p + 1. On the Intel
  // Xeon of session 47 v2 calls took 0.93-0.97x the time of head-major
  // order (bf16, 8192 x 16 and 4096 x 16, one thread), two threads at
  // batch 1 (4k-8k keys) 0.91-1.01x (docs/attention.md). Our guess at
  // why, not measured: a block's slices of every KV head lie in one 32 KB
  // run, whose page translations (where the host maps guest memory in 4
  // KB pages, one 64-byte line of its page table holds 8 pages') the next
  // head's partition finds cached; head-major, a row of one head apart,
  // they are walked again from memory. The results are the same either
  // way: each partition computes the same, and the reduction takes them
  // in partition order.
  const int64_t per_row = kvh / heads_per_item;  // items of a row
  run_items(
      [&](Scratch& scratch, int64_t w) {
        const int64_t row = w / (per_row * max_parts);
        const int64_t rem = w % (per_row * max_parts);
        const int64_t part = rem / per_row;
        const int64_t item = row * per_row + rem % per_row;
        int64_t r, h0;
        item_heads(item, &r, &h0);
        const int64_t qs = rows.query_start[r], qe = rows.query_start[r + 1];
        float* m = scratch.m.data();
        float* s = scratch.s.data();
        float* acc = scratch.acc.data();
        for (int64_t qi = qs; qi < qe; qi += kChunk) {
          int64_t ntok, pos0, lo, hi;
          a.Chunk(r, qi, qe, &ntok, &pos0, &lo, &hi);
          lo = std::max(lo, part * P);
          hi = std::min(hi, (part + 1) * P);
          if (lo >= hi) continue;
          a.PartialHeads(scratch, r, h0, h0 + heads_per_item, qi, ntok, pos0,
                         lo, hi, m, s, acc);
          for (int64_t k = 0; k < ntok; ++k) {
            int64_t own_lo, own_hi;
            a.Range(pos0 + k, &own_lo, &own_hi);
            if (std::max(own_lo, lo) >= std::min(own_hi, hi)) continue;
            for (int64_t h = h0; h < h0 + heads_per_item; ++h) {
              const int64_t v = ((h - h0) * ntok + k) * G;
              const int64_t slot = ((qi + k) * kvh + h) * max_parts + part;
              float* buf = &partial[slot * stride];
              std::copy(&m[v], &m[v] + G, buf);
              std::copy(&s[v], &s[v] + G, buf + G);
              std::copy(&acc[v * D], &acc[v * D] + G * D, buf + 2 * G);
              used[slot] = 1;
            }
          }
        }
        if (fold && left[item].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          // scratch.acc holds item_heads_max * D >= G * D floats, and m, s
          // G each; this item's partials are already copied out of them.
          for (int64_t qi = qs; qi < qe; ++qi) {
            for (int64_t h = h0; h < h0 + heads_per_item; ++h) {
              reduce(qi, h, acc, s, m);
            }
          }
        }
      },
      items * max_parts, 1);
  if (fold) return;
  run(
      [&](int64_t item) {  // item = (token, kv head)
        std::vector<float> acc(G * D), denom(G), M(G);
        reduce(item / kvh, item % kvh, acc.data(), denom.data(), M.data());
      },
      T * kvh);
}

}  // namespace

// One activation of type kAct (float32, float16 or bfloat16 bits).
template <DType kAct>
inline float LoadActAs(const void* p, int64_t i) {
  if constexpr (kAct == DType::kFloat16) {
    return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
  } else if constexpr (kAct == DType::kBFloat16) {
    return BF16ToFloat(static_cast<const uint16_t*>(p)[i]);
  } else {
    return static_cast<const float*>(p)[i];
  }
}

#ifdef KVSTEP_ATTN_X86
// FloatToHalf over n floats by F16C (callers check HasAvx2, which needs
// it), with the same bits: both round to nearest even, subnormals and
// overflow to Inf included, and NaN is then made FloatToHalf's (sign |
// 0x7e00) where F16C keeps a truncated payload. ReshapeAndCache of fp32
// activations into an fp16 cache takes 0.15-0.16x the time of its
// per-element loop with it (bench/reshape_and_cache_bench).
__attribute__((target("avx,f16c"))) void FloatsToHalvesF16c(const float* src,
                                                            int64_t n,
                                                            uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h =
        _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = FloatToHalf(src[i]);
  for (i = 0; i < n; ++i) {
    if ((out[i] & 0x7fff) > 0x7c00) out[i] = (out[i] & 0x8000) | 0x7e00;
  }
}

// FloatToFp8Bits<Format>(x / scale) of n activations x of type kAct from
// src[i0] by AVX-512 (callers check HasAvx512), with the
// same bits: the scalar's steps on 16 lanes, the division and the
// subnormals' scaling and round to nearest even included (both IEEE, in the
// default rounding mode). fp16 activations widen by F16C, which quiets a
// signalling NaN where HalfToFloat keeps it; either NaN gives 0x7f. A
// 64-token decode step into an fp8 cache took 6x the time of one into
// fp16 with the scalar conversion, 1.7x with this
// (bench/reshape_and_cache_bench).
template <typename Format, DType kAct>
__attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl"))) void
ActsToFp8Avx512(const void* src, int64_t i0, int64_t n, float scale,
                uint8_t* out) {
  constexpr int kMan = Format::kMan, kBias = Format::kBias;
  constexpr int kDrop = 23 - kMan;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - kBias) << 23;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 sub_scale =
      _mm512_set1_ps(static_cast<float>(1u << (kBias - 1 + kMan)));
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m =
        n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    __m512 x;
    if constexpr (kAct == DType::kFloat32) {
      x = _mm512_maskz_loadu_ps(m, static_cast<const float*>(src) + i0 + i);
    } else {
      const __m256i h = _mm256_maskz_loadu_epi16(
          m, static_cast<const uint16_t*>(src) + i0 + i);
      if constexpr (kAct == DType::kFloat16) {
        x = _mm512_cvtph_ps(h);
      } else {
        x = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
    }
    const __m512i u = _mm512_castps_si512(_mm512_div_ps(x, vscale));
    const __m512i a = _mm512_and_si512(u, abs_mask);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
    const __mmask16 sub =
        _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(kMinNormal));
    const __m512i small = _mm512_cvt_roundps_epi32(
        _mm512_mul_ps(_mm512_castsi512_ps(a), sub_scale),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i r = _mm512_add_epi32(
        _mm512_add_epi32(a, _mm512_set1_epi32((1 << (kDrop - 1)) - 1)),
        _mm512_and_si512(_mm512_srli_epi32(a, kDrop), _mm512_set1_epi32(1)));
    __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(r, kDrop),
                                    _mm512_set1_epi32((127 - kBias) << kMan));
    code = _mm512_min_epu32(code, _mm512_set1_epi32(Format::kMaxCode));
    code = _mm512_mask_mov_epi32(code, sub, small);
    code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(u, 24),
                                                  _mm512_set1_epi32(0x80)));
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7f));
    _mm512_mask_cvtepi32_storeu_epi8(out + i, m, code);
  }
}
#endif

// n activations of type kAct from src[i0] as cache elements into out;
// false if one is not finite there. Where the activation and the cache
// have the same 16- or 32-bit type, the bits are copied (a round trip
// through float would give the same bits, signalling NaNs aside, which
// it would quiet).
template <typename Elem, DType kAct>
bool ConvertRow(const void* src, int64_t i0, int64_t n, float scale,
                typename Elem::T* out) {
  using T = typename Elem::T;
  constexpr bool kSame = std::is_same_v<Elem, CacheElem<kAct>>;
  // fp32 into fp16: F16C where the CPU has it (only that instantiation
  // names the half-typed call).
  constexpr bool kToHalf = std::is_same_v<Elem, CacheElem<DType::kFloat16>> &&
                           kAct == DType::kFloat32;
  constexpr bool kToFp8 = sizeof(T) == 1;
  if constexpr (kSame) {
    std::memcpy(out, static_cast<const T*>(src) + i0, n * sizeof(T));
  } else {
    bool converted = false;
#ifdef KVSTEP_ATTN_X86
    if constexpr (kToHalf) {
      if (HasAvx2()) {
        FloatsToHalvesF16c(static_cast<const float*>(src) + i0, n, out);
        converted = true;
      }
    }
    if constexpr (kToFp8) {
      if (HasAvx512()) {
        ActsToFp8Avx512<typename Elem::Format, kAct>(src, i0, n, scale, out);
        converted = true;
      }
    }
#endif
    if (!converted) {
      for (int64_t i = 0; i < n; ++i) {
        out[i] = Elem::Store(LoadActAs<kAct>(src, i0 + i), scale);
      }
    }
  }
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite &= Elem::Finite(out[i]);
  return finite;
}

// f(std::integral_constant<DType, d>()) for activation dtype d: float16,
// bfloat16, or else float32 (callers have checked IsActivationType).
template <typename F>
decltype(auto) DispatchActivation(DType d, F&& f) {
  switch (d) {
    case DType::kFloat16:
      return f(std::integral_constant<DType, DType::kFloat16>());
    case DType::kBFloat16:
      return f(std::integral_constant<DType, DType::kBFloat16>());
    default:
      return f(std::integral_constant<DType, DType::kFloat32>());
  }
}

// The store loop of ReshapeAndCache for keys (`keys`) or values, after its
// checks: each token's row converted once, then written in the layout's
// order (whole rows for NHD; for vLLM's, x-element chunks of a key and one
// element every block_size of a value). `reference`: the per-element loop
// this replaced (every element converted and placed by the index
// functions), kept for the test that both store the same bytes. Returns
// whether every element stored is finite.
template <typename Elem, DType kAct>
bool StoreSide(const Geometry& g, typename Elem::T* cache, const void* src,
               absl::Span<const int64_t> slots, float scale, bool keys,
               bool reference) {
  using T = typename Elem::T;
  const int64_t H = g.heads, D = g.d, bs = g.bs;
  bool finite = true;
  if (reference) {
    for (int64_t t = 0; t < static_cast<int64_t>(slots.size()); ++t) {
      if (slots[t] < 0) continue;
      const int64_t b = slots[t] / bs, o = slots[t] % bs;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < D; ++d) {
          const T e =
              Elem::Store(LoadActAs<kAct>(src, (t * H + h) * D + d), scale);
          cache[keys ? g.KeyIndex(b, h, d, o) : g.ValueIndex(b, h, d, o)] = e;
          finite = finite && Elem::Finite(e);
        }
      }
    }
    return finite;
  }
  std::vector<T> row(static_cast<size_t>(D));
  for (int64_t t = 0; t < static_cast<int64_t>(slots.size()); ++t) {
    if (slots[t] < 0) continue;
    const int64_t b = slots[t] / bs, o = slots[t] % bs;
    for (int64_t h = 0; h < H; ++h) {
      finite &=
          ConvertRow<Elem, kAct>(src, (t * H + h) * D, D, scale, row.data());
      if (!g.vllm) {
        std::memcpy(cache + g.KeyIndex(b, h, 0, o), row.data(), D * sizeof(T));
      } else if (keys) {
        // [D / x][bs][x] for this block and head.
        T* dst = cache + g.KeyIndex(b, h, 0, o);
        for (int64_t j = 0; j < D / g.x; ++j) {
          std::memcpy(dst + j * bs * g.x, row.data() + j * g.x,
                      g.x * sizeof(T));
        }
      } else {
        // [D][bs] for this block and head.
        T* dst = cache + g.ValueIndex(b, h, 0, o);
        for (int64_t d = 0; d < D; ++d) dst[d * bs] = row[d];
      }
    }
  }
  return finite;
}

bool StoreKeysAndValues(const CacheConfig& c, void* key_cache,
                        void* value_cache, const Tensor& key,
                        const Tensor& value, absl::Span<const int64_t> slots,
                        float k_scale, float v_scale, bool reference) {
  const Geometry g = GeometryOf(c);
  return DispatchCache(c.dtype, [&](auto elem) {
    using Elem = decltype(elem);
    using T = typename Elem::T;
    auto side = [&](void* cache, const Tensor& src, float scale, bool keys) {
      return DispatchActivation(src.dtype(), [&](auto act) {
        return StoreSide<Elem, decltype(act)::value>(g, static_cast<T*>(cache),
                                                     src.raw_data(), slots,
                                                     scale, keys, reference);
      });
    };
    const bool k = side(key_cache, key, k_scale, /*keys=*/true);
    const bool v = side(value_cache, value, v_scale, /*keys=*/false);
    return k && v;
  });
}

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
  const bool finite = StoreKeysAndValues(
      c, cache.key(layer).raw_data(), cache.value(layer).raw_data(), key, value,
      slots, k_scale, v_scale, /*reference=*/false);
  // A model that emits Inf or NaN keys or values is worth an operator's
  // look; the attention over them stays IEEE (see MayHoldNonFinite).
  if (!finite && cache.NoteNonFinite(layer)) {
    KVSTEP_LOG(kWarning,
               "layer %d: an Inf or NaN key or value was stored in the KV "
               "cache; attention over it gives Inf or NaN, and fp16/fp8 "
               "attention on this layer now checks every element it reads",
               layer);
  }
  return absl::OkStatus();
}

const CpuIdentity& ThisCpu() {
  static const CpuIdentity id = ReadCpuIdentity();
  return id;
}

bool IsaSupported(AttentionParams::Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return HasAvx512();
    case Isa::kAvx2:
      return HasAvx2();
    default:
      return true;
  }
}

AttentionParams::Isa BestIsa() { return Resolve(Isa::kBest); }

bool AmxSupported() { return AmxUsable(); }
bool Fp8DotSupported() { return Fp8DotUsable(); }
bool BestFp8Dot(CacheLayout layout, int64_t block_size) {
  return ResolveFp8Dot(AttentionParams::Fp8Dot::kAuto, layout, block_size);
}
Fp8DotScope BestFp8DotScope(const CacheConfig& c) {
  if (DTypeSize(c.dtype) != 1 || !BestFp8Dot(c.layout, c.block_size)) {
    return Fp8DotScope::kNone;
  }
  // The shapes the passes take: Attender's LogitsFp8Dot and ValuesFp8Dot
  // in the vLLM layout (head sizes in steps of 16, which every fp8 cache
  // of that layout has: CacheConfig's x), RowTokens and NhdFp8Dot in NHD
  // (rows over every KV head, at kNhdFp8RowHeadStep; a cache of one KV
  // head is read per KV head: Attender::PartialHeads hands it to Partial).
  if (c.layout == CacheLayout::kVllm) return Fp8DotScope::kKeysAndValues;
  return c.head_size % kNhdFp8RowHeadStep == 0 && c.num_kv_heads >= 2
             ? Fp8DotScope::kKeys
             : Fp8DotScope::kNone;
}

const char* IsaName(AttentionParams::Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "AVX-512 (F, BW, VL, DQ, BF16)";
    case Isa::kAvx2:
      return "AVX2+FMA+F16C";
    case Isa::kPortable:
      return "portable x86-64";
    default:
      return "best";
  }
}

AttentionParams::Prefetch BestPrefetch(DType cache, CacheLayout layout) {
  return ResolvePrefetch(AttentionParams::Prefetch::kAuto, cache, layout);
}

const char* PrefetchName(AttentionParams::Prefetch prefetch) {
  switch (prefetch) {
    case AttentionParams::Prefetch::kNta:
      return "prefetchnta";
    case AttentionParams::Prefetch::kT0:
      return "prefetcht0";
    case AttentionParams::Prefetch::kT1:
      return "prefetcht1";
    default:
      return "auto";
  }
}

AttentionParams::Bf16Keys BestBf16Keys(bool chunks) {
  return ResolveBf16Keys(AttentionParams::Bf16Keys::kAuto, chunks);
}

bool BestLongRowRanges(DType cache, CacheLayout layout) {
  return BestIsa() == AttentionParams::Isa::kAvx512 &&
         layout == CacheLayout::kVllm && DTypeSize(cache) >= 2 && !AmdVendor();
}

bool BestVllmRows(DType cache, int64_t block_size) {
  return ResolveVllmRows(AttentionParams::VllmRows::kAuto, cache, block_size);
}

bool ParsePrefetch(absl::string_view name, AttentionParams::Prefetch* out) {
  using P = AttentionParams::Prefetch;
  static constexpr std::pair<absl::string_view, P> kNames[] = {
      {"auto", P::kAuto}, {"nta", P::kNta}, {"t0", P::kT0}, {"t1", P::kT1}};
  for (const auto& [n, p] : kNames) {
    if (name == n) {
      *out = p;
      return true;
    }
  }
  return false;
}

namespace internal {

absl::Status ReshapeAndCacheReference(const KvCache& cache, int64_t layer,
                                      const Tensor& key, const Tensor& value,
                                      absl::Span<const int64_t> slots,
                                      float k_scale, float v_scale) {
  // The same checks first (ReshapeAndCache with nothing to store).
  if (absl::Status s = ReshapeAndCache(cache, layer, key, value,
                                       std::vector<int64_t>(slots.size(), -1),
                                       k_scale, v_scale);
      !s.ok()) {
    return s;
  }
  for (int64_t s : slots) {
    if (s < -1 || s >= cache.config().num_blocks * cache.config().block_size) {
      return absl::OutOfRangeError("slot outside the pool");
    }
  }
  StoreKeysAndValues(cache.config(), cache.key(layer).raw_data(),
                     cache.value(layer).raw_data(), key, value, slots, k_scale,
                     v_scale, /*reference=*/true);
  return absl::OkStatus();
}
void ConvertCacheElements(DType dtype, const void* src, int64_t n, float scale,
                          AttentionParams::Isa isa, float* out) {
  DispatchCache(dtype, [&](auto elem) {
    using Elem = decltype(elem);
    switch (IsaSupported(isa) ? Resolve(isa) : Isa::kPortable) {
#ifdef KVSTEP_ATTN_X86
      case Isa::kAvx512:
        avx512::ConvertRow<Elem>(src, n, scale, out);
        return;
      case Isa::kAvx2:
        avx2::ConvertRow<Elem>(src, n, scale, out);
        return;
#endif
      default:
        portable::ConvertRow<Elem>(src, n, scale, out);
    }
  });
}

int64_t ConvertingRedos() { return converting_redos.load(); }

int64_t AmxPasses() { return amx_passes.load(); }
int64_t Fp8DotPasses() { return fp8_dot_passes.load(); }
int64_t Bf16DotKeyPasses() { return bf16_dot_key_passes.load(); }
int64_t NhdRowPasses() { return nhd_row_passes.load(); }
int64_t VllmRowPasses() { return vllm_row_passes.load(); }
int64_t LongRowRangeCalls() { return long_row_range_calls.load(); }
int64_t UnevenClaimCalls() { return uneven_claim_calls.load(); }
bool AmdOrHygonCpu() { return AmdVendor(); }

int64_t ClaimSize(int64_t n, int64_t kvh, int64_t threads) {
  return kvstep::ClaimSize(n, kvh, threads);
}

std::vector<ItemClaim> UnevenClaims(
    const AttentionRows& rows, int64_t kvh, int64_t threads, int64_t chunk,
    int64_t row_tokens,
    const std::function<int64_t(int64_t, int64_t)>& chunk_keys) {
  return UnevenClaimsOf(rows, kvh, threads, chunk, row_tokens, chunk_keys);
}

void ExpForTest(AttentionParams::Isa isa, const float* x, int64_t n,
                float* out) {
  switch (Resolve(isa)) {
#ifdef KVSTEP_ATTN_X86
    case Isa::kAvx512:
      avx512::ExpRow(x, n, out);
      return;
    case Isa::kAvx2:
      avx2::ExpRow(x, n, out);
      return;
#endif
    default:
      portable::ExpRow(x, n, out);
  }
}

float ScalarExpForTest(float x) { return FastExp(x); }

bool KeyTilePrefetchLinesForTest(int64_t bs, bool burst, int64_t tb,
                                 int64_t first, int64_t t1, int64_t tile,
                                 int64_t* l0, int64_t* l1) {
  return KeyTilePrefetchLines(bs, burst, tb, first, t1, tile, l0, l1);
}

bool SplitHalvesForTest(const uint16_t* src, int64_t n, float* out) {
#ifdef KVSTEP_ATTN_X86
  if (IsaSupported(Isa::kAvx512)) return avx512::SplitHalfRow(src, n, out);
#endif
  std::abort();  // the test checks IsaSupported(kAvx512) first
}

bool Fp8ToBf16ForTest(DType dtype, const uint8_t* src, int64_t n,
                      uint16_t* out) {
#ifdef KVSTEP_ATTN_X86
  if (!Fp8DotUsable()) return false;
  if (dtype == DType::kFp8E4M3) {
    avx512::Fp8Bf16Row<CacheElem<DType::kFp8E4M3>>(src, n, out);
    return true;
  }
  if (dtype == DType::kFp8E5M2) {
    avx512::Fp8Bf16Row<CacheElem<DType::kFp8E5M2>>(src, n, out);
    return true;
  }
#endif
  return false;
}

bool ActivationsToFp8ForTest(DType cache, DType act, const void* src, int64_t n,
                             float scale, uint8_t* out) {
  // ConvertRow, as ReshapeAndCache calls it, where it takes the AVX-512
  // path.
  if (!HasAvx512() || !IsActivationType(act) ||
      (cache != DType::kFp8E4M3 && cache != DType::kFp8E5M2)) {
    return false;
  }
  DispatchCache(cache, [&](auto elem) {
    using Elem = decltype(elem);
    if constexpr (sizeof(typename Elem::T) == 1) {
      DispatchActivation(act, [&](auto a) {
        ConvertRow<Elem, decltype(a)::value>(src, 0, n, scale, out);
      });
    }
  });
  return true;
}

int64_t AmxQueryPartsForTest(DType dtype, const void* src, int64_t n,
                             uint16_t* out) {
  const int64_t parts = amx::QueryParts(dtype);
#ifdef KVSTEP_ATTN_X86
  // The split takes AVX-512 BF16 (VCVTNE2PS2BF16), not the tiles, so it is
  // checked on every CPU the AVX-512 build runs on, AMX or not.
  if (IsaSupported(Isa::kAvx512)) {
    amx::SplitQuery(src, dtype, n, parts, n, out);
    return parts;
  }
#endif
  std::abort();  // the test checks IsaSupported(kAvx512) first
}
}  // namespace internal

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
  if (p.parallel_min_bytes < 0) {
    return absl::InvalidArgumentError("parallel_min_bytes must be >= 0");
  }
  if (p.touch_min_bytes < -1 || p.touch_min_blocks < -1) {
    return absl::InvalidArgumentError(
        "touch_min_bytes and touch_min_blocks must be >= 0, or -1 for this "
        "CPU's default");
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
  if (!IsaSupported(params.isa)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "this CPU has no %s; use Isa::kBest", IsaName(params.isa)));
  }
  if (out->defined() && out->dtype() == query.dtype() &&
      out->shape() == query.shape() && out->device()->host_accessible()) {
    // The caller's place (shared memory for the service): zero-filled as a
    // new tensor would be, since rows without keys are left as they are.
    std::memset(out->raw_data(), 0, out->nbytes());
  } else {
    absl::StatusOr<Tensor> o =
        Tensor::Zeros(CpuDevice(), query.dtype(), query.shape());
    if (!o.ok()) return o.status();
    *out = *std::move(o);
  }
  const bool vllm = c.layout == CacheLayout::kVllm;
  const Isa isa = Resolve(params.isa);
  DispatchCache(c.dtype, [&](auto elem) {
    using Elem = decltype(elem);
    auto run = [&](auto tag) {
      using A = typename decltype(tag)::type;
      Run<A>(cache, layer, query, rows, params, pool, out);
    };
    switch (isa) {
#ifdef KVSTEP_ATTN_X86
      case Isa::kAvx512:
        vllm ? run(Tag<avx512::Attender<Elem, true>>())
             : run(Tag<avx512::Attender<Elem, false>>());
        return;
      case Isa::kAvx2:
        vllm ? run(Tag<avx2::Attender<Elem, true>>())
             : run(Tag<avx2::Attender<Elem, false>>());
        return;
#endif
      default:
        vllm ? run(Tag<portable::Attender<Elem, true>>())
             : run(Tag<portable::Attender<Elem, false>>());
    }
  });
  return absl::OkStatus();
}

}  // namespace kvstep
