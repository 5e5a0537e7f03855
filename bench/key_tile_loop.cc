// How fast one core runs the fp16 prefill key tile's instructions with
// every operand in L1 or L2, against an FMA loop of the same run: whether
// the kernel's key pass (LogitsZ<4, false, true>, about 84% of the FMA peak
// in its chunk loop) is held by its instruction mix, its loads or its tiles.
// docs/attention.md (session 44) has the numbers this tool gave.
//
//   build/bench/key_tile_loop [--rounds=5]
//
// Each line is the best of --rounds runs of about 0.1 s, the variants
// interleaved, in GFLOP/s and as a share of the FMA loop's best:
//   fma       16 accumulators, 2 FMAs each a step, nothing else (the peak);
//   mix       the chunk loop's steps back to back (4 key loads of 32 fp16,
//             each split into even and odd halves by SplitHalvesZ's 5
//             integer ops, 8 query loads, 32 FMAs into 16 accumulators),
//             the accumulators never reset, one head tile's queries (8 KB);
//   tile      as the kernel runs them: tiles of 16 steps (a head of 128
//             dims) for 4 heads x 16 tokens, each from zeroed accumulators,
//             ending in the shuffle sums to 16 logits a head and 16 stores
//             of 4; a chunk's 64 virtual heads' queries (128 KB, from L2)
//             and one 4 KB block of keys;
//   tile_q1   the same over two head tiles' queries (16 KB, L1);
//   tile64    tile with 64 steps a tile (the 16 chunks four times): a
//             quarter of the tile starts, sums and stores.
// The values are arbitrary finite numbers: only the time is measured. The
// loops over heads and loads are unrolled by pragma, as the kernel's are:
// without it clang kept the accumulators on the stack between tiles. Code
// placement moves these lines by several points between builds of the
// same source (docs/attention.md, session 44), so compare lines of one
// build only.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvstep {
namespace {

#if defined(__x86_64__)

constexpr int64_t kChunks = 16;  // 8-dim chunks of a 128-dim head
constexpr int64_t kHeads = 64;   // virtual heads of a GQA 4 chunk of 16 tokens
constexpr double kFlopsPerStep = 32.0 * 32;  // 32 FMAs of 16 lanes

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Buffers {
  alignas(64) uint16_t keys[kChunks * 128];          // one 4 KB block
  alignas(64) float queries[kHeads * kChunks * 32];  // 128 KB
  alignas(64) float logits[4 * kHeads * 16];         // 4 tiles' rows
};

// The even and odd halves of 32 fp16 as floats times 2^-112, as the
// kernel's SplitHalvesZ makes them (there the query carries the 2^112).
typedef uint32_t UZ __attribute__((vector_size(64)));
typedef int32_t IZ __attribute__((vector_size(64)));

__attribute__((target("avx512f"), always_inline)) inline void Split(
    __m512i u, __m512* even, __m512* odd) {
  // Vector extensions, not _mm512_slli_epi32, whose GCC 12 header warns of
  // an uninitialized operand at -O2.
  const IZ keep = IZ{} - 0x70002000;  // 0x8fffe000
  const IZ x = reinterpret_cast<IZ>(u);
  const IZ lo = reinterpret_cast<IZ>(reinterpret_cast<UZ>(x) << 16);
  *even = reinterpret_cast<__m512>((lo >> 3) & keep);
  *odd = reinterpret_cast<__m512>((x >> 3) & keep);
}

__attribute__((target("avx512f"), always_inline)) inline void Zero(
    __m512 (&acc)[4][4]) {
#pragma GCC unroll 4
  for (auto& row : acc) {
#pragma GCC unroll 4
    for (auto& x : row) x = _mm512_setzero_ps();
  }
}

// One step of the chunk loop: chunk dx of a block's 16 tokens (4 loads
// of 4 tokens x 8 dims, split) against chunk dx of 4 heads' queries from
// q (a head's 16 chunks of 32 floats each), into acc[head][load].
__attribute__((target("avx512f"), always_inline)) inline void Step(
    const uint16_t* keys, const float* q, int64_t dx, __m512 (&acc)[4][4]) {
  __m512 ke[4], ko[4];
#pragma GCC unroll 4
  for (int64_t j = 0; j < 4; ++j) {
    Split(_mm512_load_si512(keys + dx * 128 + 32 * j), &ke[j], &ko[j]);
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < 4; ++i) {
    const float* qi = q + (i * kChunks + dx) * 32;
    const __m512 qe = _mm512_load_ps(qi), qo = _mm512_load_ps(qi + 16);
#pragma GCC unroll 4
    for (int64_t j = 0; j < 4; ++j) {
      acc[i][j] = _mm512_fmadd_ps(qe, ke[j], acc[i][j]);
      acc[i][j] = _mm512_fmadd_ps(qo, ko[j], acc[i][j]);
    }
  }
}

__attribute__((target("avx512f"))) float Fma(int64_t steps) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.9999f), b = _mm512_set1_ps(1e-4f);
  for (int64_t s = 0; s < steps; ++s) {
    for (int r = 0; r < 2; ++r) {
      for (auto& x : acc) x = _mm512_fmadd_ps(x, a, b);
    }
  }
  float sum = 0;
  for (auto& x : acc) sum += _mm512_reduce_add_ps(x);
  return sum;
}

__attribute__((target("avx512f"))) float Mix(const Buffers& b, int64_t steps) {
  __m512 acc[4][4];
  Zero(acc);
  for (int64_t s = 0; s < steps; ++s) {
    // One head tile's queries (8 KB), as tile_q1's.
    Step(b.keys, b.queries, s % kChunks, acc);
  }
  float sum = 0;
#pragma GCC unroll 4
  for (auto& row : acc) {
#pragma GCC unroll 4
    for (auto& x : row) sum += _mm512_reduce_add_ps(x);
  }
  return sum;
}

// Sums of each 4-lane group of a, b, c, d into one vector, lane 4 i + g
// from the i-th argument's group g (the kernel's QuadSums, by shuffles).
__attribute__((target("avx512f"), always_inline)) inline __m512 QuadSums(
    __m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88),
                                  _mm512_shuffle_ps(a, b, 0xdd));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(c, d, 0x88),
                                  _mm512_shuffle_ps(c, d, 0xdd));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x88),
                                 _mm512_shuffle_ps(ab, cd, 0xdd));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
      s);
}

// kTileSteps steps a tile (16: a head of 128 dims; more repeat its chunks).
template <bool kAllHeads, int64_t kTileSteps = kChunks>
__attribute__((target("avx512f"))) float Tiles(Buffers& b, int64_t tiles) {
  __m512 sink = _mm512_setzero_ps();
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t v0 = (kAllHeads ? t % (kHeads / 4) : t % 2) * 4;
    __m512 acc[4][4];
    Zero(acc);
    for (int64_t step = 0; step < kTileSteps; ++step) {
      Step(b.keys, b.queries + v0 * kChunks * 32, step % kChunks, acc);
    }
    float* lg = b.logits + (t % 4) * kHeads * 16;
#pragma GCC unroll 4
    for (int64_t j = 0; j < 4; ++j) {
      const __m512 r = QuadSums(acc[0][j], acc[1][j], acc[2][j], acc[3][j]);
      float lanes[16];
      _mm512_storeu_ps(lanes, r);
#pragma GCC unroll 4
      for (int64_t i = 0; i < 4; ++i) {
        std::memcpy(lg + (v0 + i) * 16 + 4 * j, lanes + 4 * i,
                    4 * sizeof(float));
      }
      sink = _mm512_add_ps(sink, r);
    }
  }
  return _mm512_reduce_add_ps(sink);
}

int Main(int argc, char** argv) {
  int rounds = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--rounds=", 0) == 0) {
      rounds = std::atoi(a.c_str() + 9);
    } else {
      std::fprintf(stderr, "unknown flag %s (see the top of %s)\n", a.c_str(),
                   __FILE__);
      return 2;
    }
  }
  if (rounds < 1) {
    std::fprintf(stderr, "--rounds must be >= 1\n");
    return 2;
  }
  if (!__builtin_cpu_supports("avx512f")) {
    std::fprintf(stderr, "key_tile_loop needs an x86-64 CPU with AVX-512F\n");
    return 2;
  }
  auto b = std::make_unique<Buffers>();
  for (size_t i = 0; i < std::size(b->keys); ++i) {
    b->keys[i] = static_cast<uint16_t>(0x3c00 + i % 7);  // 1.0 and up
  }
  for (size_t i = 0; i < std::size(b->queries); ++i) {
    b->queries[i] = 1e-3f * static_cast<float>(i % 11);
  }
  // About 0.1 s each at 200 GFLOP/s.
  constexpr int64_t kSteps = 20'000'000;
  constexpr int64_t kTiles = kSteps / kChunks;
  // The variants, in the order of the switch below.
  const char* const names[] = {"fma", "mix", "tile", "tile_q1", "tile64"};
  constexpr size_t kVariants = std::size(names);
  double best[kVariants] = {};
  float sink = 0;
  for (int r = 0; r < rounds; ++r) {
    for (size_t v = 0; v < kVariants; ++v) {
      const double t0 = Now();
      switch (v) {
        case 0:
          sink += Fma(kSteps);
          break;
        case 1:
          sink += Mix(*b, kSteps);
          break;
        case 2:
          sink += Tiles<true>(*b, kTiles);
          break;
        case 3:
          sink += Tiles<false>(*b, kTiles);
          break;
        default:
          sink += Tiles<true, 64>(*b, kTiles / 4);
          break;
      }
      best[v] = std::max(best[v], kSteps * kFlopsPerStep / (Now() - t0) / 1e9);
    }
  }
  std::printf("best of %d rounds (checksum %g)\n", rounds, sink);
  for (size_t v = 0; v < kVariants; ++v) {
    std::printf("%-8s %7.1f GFLOP/s  %4.0f%% of fma\n", names[v], best[v],
                100 * best[v] / best[0]);
  }
  return 0;
}

#else

int Main(int, char**) {
  std::fprintf(stderr, "key_tile_loop needs an x86-64 CPU with AVX-512F\n");
  return 2;
}

#endif

}  // namespace
}  // namespace kvstep

int main(int argc, char** argv) { return kvstep::Main(argc, argv); }
