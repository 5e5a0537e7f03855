// How fast one thread reads the paged cache's access pattern, with no
// attention arithmetic (or with the V pass's, as a model): the ceiling the
// kernel's "of read" is measured under. docs/attention.md (sessions 9, 20
// and 46) has the numbers this tool gave.
//
//   build/bench/slice_read_bench [--pool_mib=1024] [--passes=5]
//       [--streams_only] [--threads=1]
//
// Each line is the best of --passes cold passes over a pool from the CPU
// device (pre-touched, huge pages), a 256 MiB read of another buffer
// between passes, against a sequential read of the same pool in the same
// run:
//   seq              the pool in order (the STREAM-like baseline);
//   slices S KB      S KB slices in random order (4 KB: one KV head's
//                    slice of a block, bf16 or fp16, block 16, head 128);
//   windows N        4 KB pages in random order within 2 MB windows, N
//                    windows interleaved at a time (how much the region's
//                    locality, not the page's, matters);
//   rows ARITH       the bench's pattern: rows of 64 random 32 KB blocks (8
//                    KV heads x 4 KB), each row's 64 slices of one head,
//                    then the next head; ARITH none: sum the loads; one: the
//                    V pass's arithmetic per 64 bytes (split into even and
//                    odd halves, 4 heads x 2 FMAs into lanes in L1), one
//                    block at a time; pairs: the same on two blocks side by
//                    side, as PairSweepZ reads them.
//   rows pairs xH    (session 51) pairs' work on the slices of H KV heads
//                    of the same two blocks in turn (H x 4 KB runs, H lane
//                    sets of 16 KB), then the next two blocks: what a V
//                    pass over H heads at once would read at.
// These prefetch as the kernel did in session 9: prefetcht1 line by line
// about a block (4 KB) ahead, and the first 8 lines of the page 4 slices
// ahead.
//
// Then the "work" table (session 20): what a pass's work between its loads
// does to how fast one core gets random slices. Each pass reads 4 KB pages
// in one of four orders: `random` (the slices 4 KB order above), `rand32`
// (the slices 32 KB order: an NHD block's K or V rows over 8 KV heads, read
// whole; session 21), `seq` (the pool in order) and `warm` (48 pages, 192
// KB, over and over: the work's own speed, from L2); it prefetches as the
// vLLM layout's K pass does on AMD (prefetchnta line by line 8 KB ahead,
// plus the first 8 lines of the page 4 pages ahead), and does per 64-byte
// line:
//   none   sums the line (as the lines above);
//   nop    the same, plus one NOP;
//   fma    the widening K pass's bf16 work for 4 heads: a shift and a mask
//          split the line into even and odd halves, then 8 FMAs into 8
//          register accumulators;
//   dot    the VDPBF16PS K pass's: 4 VDPBF16PS into 8 accumulators (AVX512-
//          BF16 CPUs only).
//
// The work table also has a `win16` column (session 46): 4 KB pages in
// random order within 2 MB windows, 16 windows interleaved (as `windows
// 16` above), so that the random pages' reach over the pool, not their
// order, is what differs from `random`.
//
// Then the "lines" table (session 46): what one core gets from lines of
// random pages at all, with no prefetch and no work. `chase` is the
// latency of a dependent load (pointer chasing) through one line of each
// of 2048 random pages of the pool, with the pages' translations cold
// (after the flush read: 64K pages of another buffer) or warm (line 0 of
// each page loaded and flushed first); `burst L` the ns a line of loading
// 4096 lines at once, L consecutive lines of each of 4096 / L random
// pages, TLB cold or warm as for the chase, and "in flight" the lines
// that rate keeps in flight at the chase's latency of the same TLB state
// (Little's law).
//
// Then the "hints" table (session 63): the share of software prefetches
// that bring their line at all, by hint, for lines on random pages (one a
// page, or every line of a page in order), each line then loaded alone
// and timed (HintsTable).
//
// Then the "streams" table (session 25): random 32 KB runs (the vLLM
// layout's blocks over 8 KV heads, as the row K pass reads them) read one
// at a time or two side by side, 256 bytes of each in turn, each stream
// with its own prefetches (t0 and t1: prefetcht0 and prefetcht1 that many
// KB ahead; st: the first 8 lines of each 4 KB page that far ahead, by
// prefetcht1), with no work or the fma work per line; each row against
// sequential passes of the pool alternated with its own (session 28), so
// that both see the same moments of this VM. --streams_only prints the
// seq line and this table alone. --threads=N (with
// --streams_only) runs the seq line and the streams table on N threads,
// each over its own contiguous share of the pages or runs, timed as
// attention_bench times its N-thread read (thread start to last join):
// what N cores get from the pattern against what they get in order.
// Needs AVX-512F (the kernel's 16-lane passes do too).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#include <x86intrin.h>
#endif

#include "core/device.h"

namespace kvstep {
namespace {

#if defined(__x86_64__)

constexpr size_t kPage = 4096;
constexpr size_t kBlock = 32768;  // 8 KV heads x 4 KB
constexpr size_t kRowBlocks = 64;
constexpr size_t kLaneSetFloats = 4 * 1024;  // VSweep's lanes: 4 heads
constexpr size_t kMaxHeadSets = 8;           // lane sets of `rows pairs xH`

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A stream start: prefetcht1 of the first 8 lines of the page at p, which
// sets the core's L2 streamer on the rest of it.
__attribute__((target("avx512f"), always_inline)) inline void StartStream(
    const char* p) {
  for (ptrdiff_t l = 0; l < 8; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T1);
}

// Reads pages[0..n) in order, 64 bytes a load, with the kernel's
// prefetches; returns a checksum so that nothing is optimized away.
__attribute__((target("avx512f"))) uint64_t ReadPages(
    const std::vector<const char*>& pages) {
  const size_t n = pages.size();
  __m512i acc = _mm512_setzero_si512();
  for (size_t s = 0; s < n; ++s) {
    const char* b = pages[s];
    if (s + 4 < n) StartStream(pages[s + 4]);
    const char* next = s + 1 < n ? pages[s + 1] : b;
    for (size_t o = 0; o < kPage; o += 64) {
      _mm_prefetch(next + o, _MM_HINT_T1);
      acc = _mm512_add_epi64(acc, _mm512_load_si512(b + o));
    }
  }
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(acc));
}

// The V pass's arithmetic on `nb` (1 or 2) 4 KB slices side by side:
// per 64 bytes of each, an even/odd split and 4 heads x 2 FMAs into lanes
// that stay in L1. `next` are the slices to prefetch (as many).
template <int NB>
__attribute__((target("avx512f"), always_inline)) inline void VSweep(
    const char* const* cur, const char* const* next, float* lanes) {
  const __m512 w = _mm512_set1_ps(0.5f);
  for (ptrdiff_t u = 0; u < 64; ++u) {
    __m512 e[NB], o[NB];
    for (int k = 0; k < NB; ++k) {
      _mm_prefetch(next[k] + 64 * u, _MM_HINT_T1);
      const __m512i x = _mm512_load_si512(cur[k] + 64 * u);
      e[k] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      o[k] = _mm512_castsi512_ps(
          _mm512_and_si512(x, _mm512_set1_epi32(int32_t{-65536})));
    }
    for (int i = 0; i < 4; ++i) {
      float* q = lanes + ptrdiff_t{1024} * i + u * 16;
      __m512 a = _mm512_load_ps(q);
      for (int k = 0; k < NB; ++k) {
        a = _mm512_fmadd_ps(w, e[k], a);
        a = _mm512_fmadd_ps(w, o[k], a);
      }
      _mm512_store_ps(q, a);
    }
  }
}

// Pairs' work over `heads` KV heads (h0 on) of a row at once: VSweep<2> on
// head h0 + j's slices of blocks c and c + 1 into lane set j, for each
// head of the group, then the next two blocks; each sweep prefetches the
// slices read next (the group's next head, or its first head's next two
// blocks).
__attribute__((target("avx512f"))) void ReadRowHeads(const char* pool,
                                                     const size_t* row,
                                                     size_t h0, size_t heads,
                                                     float* lanes) {
  auto at = [&](size_t c, size_t h) {
    return pool + row[std::min(c, kRowBlocks - 1)] * kBlock + h * kPage;
  };
  for (size_t c = 0; c < kRowBlocks; c += 2) {
    // Stream starts 4 blocks ahead, as ReadRows.
    for (size_t k = c + 4; k < std::min(kRowBlocks, c + 6); ++k) {
      for (size_t j = 0; j < heads; ++j) StartStream(at(k, h0 + j));
    }
    for (size_t j = 0; j < heads; ++j) {
      const bool more = j + 1 < heads;
      const char* cur[2] = {at(c, h0 + j), at(c + 1, h0 + j)};
      const char* next[2] = {more ? at(c, h0 + j + 1) : at(c + 2, h0),
                             more ? at(c + 1, h0 + j + 1) : at(c + 3, h0)};
      VSweep<2>(cur, next, lanes + j * kLaneSetFloats);
    }
  }
}

// The bench's pattern over `order` (blocks, rows of kRowBlocks): arith 0
// sums the loads (ReadPages), 1 runs VSweep on one block at a time, 2 on
// two (ReadRowHeads over one head at a time), -H ReadRowHeads over each
// group of H heads (H <= kMaxHeadSets).
__attribute__((target("avx512f"))) uint64_t ReadRows(
    const char* pool, const std::vector<size_t>& order, int arith,
    float* lanes) {
  const size_t rows = order.size() / kRowBlocks;
  uint64_t sum = 0;
  std::vector<const char*> pages(kRowBlocks);
  for (size_t r = 0; r < rows; ++r) {
    const size_t* row = &order[r * kRowBlocks];
    if (arith < 0 || arith == 2) {
      const size_t heads = arith == 2 ? 1 : static_cast<size_t>(-arith);
      for (size_t h = 0; h < kBlock / kPage; h += heads) {
        ReadRowHeads(pool, row, h, heads, lanes);
      }
      continue;
    }
    for (size_t h = 0; h < kBlock / kPage; ++h) {
      for (size_t c = 0; c < kRowBlocks; ++c) {
        pages[c] = pool + row[c] * kBlock + h * kPage;
      }
      if (arith == 0) {
        sum += ReadPages(pages);
        continue;
      }
      for (size_t c = 0; c < kRowBlocks; ++c) {
        // Stream start 4 blocks ahead, then the sweep.
        if (c + 4 < kRowBlocks) StartStream(pages[c + 4]);
        const char* cur[1] = {pages[c]};
        const char* next[1] = {pages[std::min(c + 1, kRowBlocks - 1)]};
        VSweep<1>(cur, next, lanes);
      }
    }
  }
  return sum + static_cast<uint64_t>(lanes[0]);
}

// What WorkPass does per line (see the top of this file).
enum Work { kWorkNone, kWorkNop, kWorkFma, kWorkDot };

// kW's work on 64-byte lines, with the state a pass keeps from line to
// line: 8 float accumulators, 4 weights and an integer sum. kWorkDot
// issues VDPBF16PS by inline assembly, so that its callers need no
// AVX512-BF16 target (theirs check the CPU), into the accumulators of
// `slot` (0 or 1: two lines a step keep its 8 in registers).
template <int kW>
struct LineWork {
  __m512 acc[8];
  __m512 w[4];
  __m512i sum;

  __attribute__((target("avx512f"), always_inline)) LineWork() {
    for (__m512& a : acc) a = _mm512_setzero_ps();
    for (int i = 0; i < 4; ++i) w[i] = _mm512_set1_ps(0.25f * float(i + 1));
    sum = _mm512_setzero_si512();
  }

  __attribute__((target("avx512f"), always_inline)) void Line(__m512i x,
                                                              ptrdiff_t slot) {
    if constexpr (kW == kWorkNone || kW == kWorkNop) {
      sum = _mm512_add_epi64(sum, x);
      if constexpr (kW == kWorkNop) asm volatile("nop");
    } else if constexpr (kW == kWorkFma) {
      const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 od = _mm512_castsi512_ps(
          _mm512_and_si512(x, _mm512_set1_epi32(int32_t{-65536})));
      for (ptrdiff_t i = 0; i < 4; ++i) {
        acc[2 * i] = _mm512_fmadd_ps(w[i], e, acc[2 * i]);
        acc[2 * i + 1] = _mm512_fmadd_ps(w[i], od, acc[2 * i + 1]);
      }
    } else {
      for (ptrdiff_t i = 0; i < 4; ++i) {
        asm("vdpbf16ps %2, %1, %0"
            : "+v"(acc[4 * slot + i])
            : "v"(x), "v"(w[i]));
      }
    }
  }

  // A sum of everything, which keeps the loads alive.
  __attribute__((target("avx512f"), always_inline)) float Result() const {
    __m512 t = _mm512_setzero_ps();
    for (const __m512& a : acc) t = _mm512_add_ps(t, a);
    return _mm512_reduce_add_ps(t) +
           static_cast<float>(_mm512_reduce_add_epi64(sum));
  }
};

// One pass over `pages` (4 KB each) with the K pass's prefetch on AMD and
// kW's work per line (LineWork); returns a sum that keeps the loads alive.
template <int kW>
__attribute__((target("avx512f"))) float WorkPass(
    const std::vector<const char*>& pages) {
  constexpr ptrdiff_t kAheadPages = 2;  // 8 KB, line by line
  LineWork<kW> work;
  const size_t n = pages.size();
  for (size_t s = 0; s < n; ++s) {
    const char* b = pages[s];
    if (s + 4 < n) {
      for (ptrdiff_t l = 0; l < 8; ++l) {
        _mm_prefetch(pages[s + 4] + 64 * l, _MM_HINT_NTA);
      }
    }
    const char* ahead = s + kAheadPages < n ? pages[s + kAheadPages] : b;
    // Two lines a step, so that kWorkDot's 8 accumulators stay in
    // registers (4 heads x 2 lines).
    for (ptrdiff_t o = 0; o < ptrdiff_t{kPage}; o += 128) {
#pragma GCC unroll 2
      for (ptrdiff_t k = 0; k < 2; ++k) {
        _mm_prefetch(ahead + o + 64 * k, _MM_HINT_NTA);
        work.Line(_mm512_load_si512(b + o + 64 * k), k);
      }
    }
  }
  return work.Result();
}

// One pass over `runs` (32 KB each, in order), kS of them side by side:
// with kS 2, runs 2i and 2i + 1 are read 256 bytes of one, then 256 of the
// other. Each stream prefetches its own lines: prefetcht0 `t0` bytes and
// prefetcht1 `t1` bytes ahead of its reads, running on into its next run,
// and with `starts` > 0, at each 4 KB page, prefetcht1 of the first 8
// lines `starts` bytes ahead. kW's work per line, as WorkPass's
// (LineWork).
template <int kW, int kS>
__attribute__((target("avx512f"))) float RunsPass(
    const std::vector<const char*>& runs, ptrdiff_t t0, ptrdiff_t t1,
    ptrdiff_t starts) {
  constexpr auto kRun = static_cast<ptrdiff_t>(kBlock);
  LineWork<kW> work;
  const size_t n = runs.size() / kS * kS;
  // Stream k's byte `o` past the start of its run r (in its next run when
  // o is past the end; its own run at the end of the list).
  auto at = [&](size_t r, ptrdiff_t o) {
    if (o >= kRun && r + kS < n) return runs[r + kS] + (o - kRun);
    return runs[r] + std::min(o, kRun - 64);
  };
  for (size_t r = 0; r < n; r += kS) {
    for (ptrdiff_t o = 0; o < kRun; o += 256) {
      for (int k = 0; k < kS; ++k) {
        const char* b = runs[r + k] + o;
        if (starts > 0 && o % 4096 == 0) {
          for (ptrdiff_t l = 0; l < 512; l += 64) {
            _mm_prefetch(at(r + k, o + starts + l), _MM_HINT_T1);
          }
        }
        for (ptrdiff_t l = 0; l < 256; l += 64) {
          _mm_prefetch(at(r + k, o + t0 + l), _MM_HINT_T0);
          _mm_prefetch(at(r + k, o + t1 + l), _MM_HINT_T1);
        }
#pragma GCC unroll 4
        for (ptrdiff_t l = 0; l < 256; l += 64) {
          work.Line(_mm512_load_si512(b + l), l / 64 % 2);
        }
      }
    }
  }
  return work.Result();
}

struct Pool {
  std::shared_ptr<Allocation> mem;
  char* base = nullptr;
  size_t bytes = 0;
};

class Runner {
 public:
  Runner(size_t pool_bytes, int passes)
      : passes_(passes),
        flush_(*CpuDevice()->Allocate(size_t{256} << 20)),
        lanes_(*CpuDevice()->Allocate(sizeof(float) * kMaxHeadSets *
                                      kLaneSetFloats)) {
    pool_.mem = *CpuDevice()->Allocate(pool_bytes);
    pool_.base = static_cast<char*>(pool_.mem->data());
    pool_.bytes = pool_bytes / kBlock * kBlock;
    // 0x3f bytes: every bf16 pair and fp32 word of it a normal number (about
    // 0.75), so that the arithmetic patterns meet no denormals.
    std::memset(pool_.base, 0x3f, pool_.bytes);
  }

  // Best GB/s over the passes of fn (which reads the whole pool once).
  template <typename Fn>
  double Best(Fn fn) {
    return BestOn(1, [&](int) { return fn(); });
  }

  // The same with fn(k) on `threads` threads at once, k = 0..threads-1,
  // which together read the whole pool once (k = 0 on this thread).
  template <typename Fn>
  double BestOn(int threads, Fn fn) {
    double best = 0;
    for (int p = 0; p < passes_; ++p) best = std::max(best, Pass(threads, fn));
    return best;
  }

  // GB/s of one cold pass of fn(k) on `threads` threads, timed from the
  // first thread's start to the last one's join (as attention_bench times
  // its read baseline).
  template <typename Fn>
  double Pass(int threads, Fn fn) {
    std::vector<decltype(fn(0))> sums(static_cast<size_t>(threads));
    Flush();
    const double t0 = Now();
    std::vector<std::thread> ts;
    for (int k = 1; k < threads; ++k) {
      ts.emplace_back([&, k] { sums[static_cast<size_t>(k)] = fn(k); });
    }
    sums[0] = fn(0);
    for (std::thread& t : ts) t.join();
    const double dt = Now() - t0;
    for (auto f : sums) sink_ += static_cast<uint64_t>(f);
    return static_cast<double>(pool_.bytes) / dt / 1e9;
  }

  int passes() const { return passes_; }

  // The lines table's pages: n distinct random 4 KB pages of the pool in
  // random order (seeded by `seed`, so that each trial has its own).
  std::vector<char*> RandomPages(size_t n, uint64_t seed) const {
    std::mt19937_64 rng(seed);
    std::unordered_set<size_t> seen;
    std::vector<char*> pages;
    while (pages.size() < n) {
      const size_t i = rng() % (pool_.bytes / kPage);
      if (seen.insert(i).second) pages.push_back(pool_.base + i * kPage);
    }
    return pages;
  }

  // Readies lines for a lines-table trial: flushes them, reads the flush
  // buffer (which leaves the TLB without the pool's translations) and,
  // with warm_tlb, loads line 0 of each page in `pages` and flushes it
  // again, so that only the translations are warm.
  __attribute__((target("avx512f"))) void ColdLines(
      const std::vector<char*>& lines, const std::vector<char*>& pages,
      bool warm_tlb) {
    for (char* l : lines) _mm_clflush(l);
    _mm_mfence();
    Flush();
    if (warm_tlb) {
      uint64_t s = 0;
      for (char* p : pages) s += *reinterpret_cast<volatile uint8_t*>(p);
      sink_ += s;
      for (char* p : pages) _mm_clflush(p);
    }
    _mm_mfence();
  }

  std::vector<const char*> Slices(size_t slice) const {
    std::vector<size_t> order(pool_.bytes / slice);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(1));
    std::vector<const char*> pages;
    for (size_t s : order) {
      for (size_t o = 0; o < slice; o += kPage) {
        pages.push_back(pool_.base + s * slice + o);
      }
    }
    return pages;
  }

  // 4 KB pages random within 2 MB windows, `w` windows interleaved.
  std::vector<const char*> Windows(size_t w) const {
    constexpr size_t kWin = size_t{2} << 20, kPer = kWin / kPage;
    std::mt19937_64 rng(1);
    std::vector<size_t> wins(pool_.bytes / kWin);
    std::iota(wins.begin(), wins.end(), 0);
    std::shuffle(wins.begin(), wins.end(), rng);
    std::vector<const char*> pages;
    for (size_t g = 0; g < wins.size(); g += w) {
      std::vector<std::vector<size_t>> in;
      for (size_t j = g; j < std::min(wins.size(), g + w); ++j) {
        std::vector<size_t> v(kPer);
        std::iota(v.begin(), v.end(), wins[j] * kPer);
        std::shuffle(v.begin(), v.end(), rng);
        in.push_back(std::move(v));
      }
      for (size_t i = 0; i < kPer; ++i) {
        for (const auto& v : in) pages.push_back(pool_.base + v[i] * kPage);
      }
    }
    return pages;
  }

  std::vector<size_t> Blocks() const {
    std::vector<size_t> order(pool_.bytes / kBlock);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(1));
    order.resize(order.size() / kRowBlocks * kRowBlocks);
    return order;
  }

  const Pool& pool() const { return pool_; }
  float* lanes() { return static_cast<float*>(lanes_->data()); }

 private:
  __attribute__((target("avx512f"))) void Flush() {
    const char* f = static_cast<const char*>(flush_->data());
    __m512i acc = _mm512_setzero_si512();
    for (size_t i = 0; i < (size_t{256} << 20); i += 64) {
      acc = _mm512_add_epi64(acc, _mm512_load_si512(f + i));
    }
    sink_ += static_cast<uint64_t>(_mm512_reduce_add_epi64(acc));
  }

  int passes_;
  std::shared_ptr<Allocation> flush_, lanes_;
  Pool pool_;
  volatile uint64_t sink_ = 0;  // keeps the sums alive
};

// The lines table (see the top of this file): best of `passes` trials,
// each on its own random pages.
void LinesTable(Runner& run) {
  constexpr size_t kChasePages = 2048, kBurstLines = 4096;
  volatile uint64_t sink = 0;
  std::printf("\n%-10s %8s %10s %8s %10s\n", "lines", "TLB", "ns a line",
              "GB/s", "in flight");
  double chase[2] = {0, 0};  // TLB cold, warm: seconds a line
  for (bool warm : {false, true}) {
    double best = 1e30;
    for (int p = 0; p < run.passes(); ++p) {
      const std::vector<char*> pages =
          run.RandomPages(kChasePages, 100 + static_cast<uint64_t>(p));
      // Line 1 + i % 62 of each page: never line 0 (the TLB warm-up's).
      std::vector<char*> lines(pages.size());
      for (size_t i = 0; i < pages.size(); ++i) {
        lines[i] = pages[i] + 64 * (1 + i % 62);
      }
      // The trial's chain, then its lines flushed (written back) and the
      // TLB emptied of the stores' translations.
      for (size_t i = 0; i < lines.size(); ++i) {
        std::memcpy(lines[i], i + 1 < lines.size() ? &lines[i + 1] : &lines[0],
                    sizeof(char*));
      }
      run.ColdLines(lines, pages, warm);
      const double t0 = Now();
      const char* at = lines[0];
      for (size_t i = 0; i < lines.size(); ++i) {
        at = *reinterpret_cast<const char* const volatile*>(at);
      }
      best = std::min(best, (Now() - t0) / static_cast<double>(lines.size()));
      sink = sink + reinterpret_cast<uintptr_t>(at);
    }
    chase[warm ? 1 : 0] = best;
    std::printf("%-10s %8s %10.1f %8.2f\n", "chase", warm ? "warm" : "cold",
                best * 1e9, 64 / best / 1e9);
  }
  for (size_t per : {1, 8, 64}) {
    for (bool warm : {false, true}) {
      double best = 1e30;
      for (int p = 0; p < run.passes(); ++p) {
        const std::vector<char*> pages =
            run.RandomPages(kBurstLines / per, 300 + static_cast<uint64_t>(p));
        std::vector<char*> lines;
        for (char* pg : pages) {
          for (size_t l = 0; l < per; ++l) lines.push_back(pg + 64 * l);
        }
        run.ColdLines(lines, pages, warm);
        const double t0 = Now();
        uint64_t s = 0;
        for (char* l : lines) s += *reinterpret_cast<volatile uint8_t*>(l);
        best = std::min(best, (Now() - t0) / static_cast<double>(lines.size()));
        sink = sink + s;
      }
      std::printf("%-10s %8s %10.2f %8.2f %10.1f\n",
                  ("burst " + std::to_string(per)).c_str(),
                  warm ? "warm" : "cold", best * 1e9, 64 / best / 1e9,
                  chase[warm ? 1 : 0] / best);
    }
  }
  std::fflush(stdout);
}

// One load of line p alone, in TSC ticks (lfence on both sides, so that
// nothing else is in flight).
__attribute__((always_inline)) inline uint64_t TimedLoad(const char* p,
                                                         uint64_t* sink) {
  unsigned aux;
  _mm_lfence();
  const uint64_t a = __rdtscp(&aux);
  *sink += *reinterpret_cast<const volatile uint8_t*>(p);
  const uint64_t b = __rdtscp(&aux);
  _mm_lfence();
  return b - a;
}

// Prefetches p with hint k (0 prefetcht0, 1 prefetcht1, 2 prefetcht2, 3
// prefetchnta).
__attribute__((always_inline)) inline void PrefetchHint(const char* p, int k) {
  switch (k) {
    case 0:
      _mm_prefetch(p, _MM_HINT_T0);
      break;
    case 1:
      _mm_prefetch(p, _MM_HINT_T1);
      break;
    case 2:
      _mm_prefetch(p, _MM_HINT_T2);
      break;
    default:
      _mm_prefetch(p, _MM_HINT_NTA);
      break;
  }
}

// The hints table (session 63): which software prefetches bring their
// line at all. Each trial prefetches `n` lines back to back, TLB warm as
// the lines table's, either one line of each of n random pages ("1 a
// page", line 1 + i % 62) or every line of n / 64 random pages in order
// ("64 a page"); waits 50 us (some 300 DRAM latencies); then loads
// each line alone and counts it as landed if the load took under the
// midpoint of a cached line's and an unprefetched one's median times
// (both measured first, on the same kind of lines). "landed" is the share
// of lines that did, over 16 trials a case. Whether a prefetch lands is
// what the kernel's hints rest on: on the Zen 5 of session 63 prefetcht1
// and prefetcht2 mostly did not for a page's first line, so a stream of
// them into a new page loses that line, and one a page loses nearly all.
__attribute__((target("avx512f"))) void HintsTable(Runner& run) {
  constexpr int kTrials = 16;
  uint64_t sink = 0;
  // n lines of the kind a case reads, on fresh pages for each seed.
  auto make = [&](size_t n, size_t per_page, uint64_t seed) {
    const std::vector<char*> pages =
        run.RandomPages(per_page == 1 ? n : n / 64, seed);
    std::vector<char*> lines;
    for (size_t i = 0; i < pages.size(); ++i) {
      if (per_page == 1) {
        lines.push_back(pages[i] + 64 * (1 + i % 62));
      } else {
        for (size_t l = 0; l < 64; ++l) lines.push_back(pages[i] + 64 * l);
      }
    }
    return std::make_pair(pages, lines);
  };
  auto median = [](std::vector<uint64_t> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  // The two references: lines cold (not prefetched) and lines just loaded.
  std::vector<uint64_t> cold, cached;
  for (int t = 0; t < kTrials; ++t) {
    auto [pages, lines] = make(64, 1, 900 + static_cast<uint64_t>(t));
    run.ColdLines(lines, pages, /*warm_tlb=*/true);
    for (char* l : lines) cold.push_back(TimedLoad(l, &sink));
    for (char* l : lines) cached.push_back(TimedLoad(l, &sink));
  }
  const uint64_t cold_ticks = median(cold), cached_ticks = median(cached);
  const uint64_t cut = (cold_ticks + cached_ticks) / 2;
  std::printf(
      "\nhints: a cached line %llu ticks, an unprefetched one %llu; "
      "landed: under %llu\n",
      static_cast<unsigned long long>(cached_ticks),
      static_cast<unsigned long long>(cold_ticks),
      static_cast<unsigned long long>(cut));
  std::printf("%-12s %6s %6s %8s\n", "hint", "lines", "a page", "landed");
  const char* names[] = {"prefetcht0", "prefetcht1", "prefetcht2",
                         "prefetchnta"};
  const std::pair<size_t, size_t> cases[] = {
      {8, 1}, {64, 1}, {128, 1}, {256, 64}};
  for (int k = 0; k < 4; ++k) {
    for (const auto& [n, per_page] : cases) {
      size_t landed = 0, total = 0;
      for (int t = 0; t < kTrials; ++t) {
        auto [pages, lines] =
            make(n, per_page, 1000 + static_cast<uint64_t>(100 * k + t));
        run.ColdLines(lines, pages, /*warm_tlb=*/true);
        for (char* l : lines) PrefetchHint(l, k);
        const double until = Now() + 50e-6;
        while (Now() < until) {
        }
        for (char* l : lines) landed += TimedLoad(l, &sink) < cut ? 1 : 0;
        total += lines.size();
      }
      std::printf(
          "%-12s %6zu %6zu %7.0f%%\n", names[k], n, per_page,
          100.0 * static_cast<double>(landed) / static_cast<double>(total));
    }
  }
  std::fflush(stdout);
  volatile uint64_t keep = 0;
  keep = keep + sink;
}

int Main(int argc, char** argv) {
  int64_t pool_mib = 1024;
  int passes = 5;
  bool streams_only = false;
  int threads = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--pool_mib=", 0) == 0) {
      pool_mib = std::atoll(a.c_str() + 11);
    } else if (a.rfind("--passes=", 0) == 0) {
      passes = std::atoi(a.c_str() + 9);
    } else if (a == "--streams_only") {
      streams_only = true;
    } else if (a.rfind("--threads=", 0) == 0) {
      threads = std::atoi(a.c_str() + 10);
    } else {
      std::fprintf(stderr, "unknown flag %s (see the top of %s)\n", a.c_str(),
                   __FILE__);
      return 2;
    }
  }
  if (pool_mib < 64 || passes < 1) {
    std::fprintf(stderr, "--pool_mib must be >= 64 and --passes >= 1\n");
    return 2;
  }
  if (threads < 1 || threads > 64 || (threads > 1 && !streams_only)) {
    std::fprintf(stderr,
                 "--threads must be 1..64, and more than 1 only with "
                 "--streams_only\n");
    return 2;
  }
  if (!__builtin_cpu_supports("avx512f")) {
    std::fprintf(stderr, "this CPU has no AVX-512F\n");
    return 2;
  }
  Runner run(static_cast<size_t>(pool_mib) << 20, passes);
  std::printf("pool %ld MiB, %d thread%s, best of %d cold passes\n",
              static_cast<long>(pool_mib), threads, threads == 1 ? "" : "s",
              passes);
  std::printf("%-20s %8s %8s\n", "pattern", "GB/s", "of seq");
  std::vector<const char*> seq;
  for (size_t o = 0; o < run.pool().bytes; o += kPage) {
    seq.push_back(run.pool().base + o);
  }
  // Thread k's contiguous share of v (of a multiple of `unit` items).
  auto share = [threads](const std::vector<const char*>& v, int k,
                         size_t unit) {
    const size_t per = v.size() / unit / static_cast<size_t>(threads) * unit;
    return std::vector<const char*>(
        v.begin() + static_cast<ptrdiff_t>(per * k),
        v.begin() + static_cast<ptrdiff_t>(per * (k + 1)));
  };
  std::vector<std::vector<const char*>> seq_parts;
  seq_parts.reserve(static_cast<size_t>(threads));
  for (int k = 0; k < threads; ++k) seq_parts.push_back(share(seq, k, 1));
  // Thread k's share of a sequential pass of the pool.
  auto seq_pass = [&](int k) {
    return ReadPages(seq_parts[static_cast<size_t>(k)]);
  };
  const double base = run.BestOn(threads, seq_pass);
  auto line = [&](const std::string& name, double gbs) {
    std::printf("%-20s %8.2f %7.0f%%\n", name.c_str(), gbs, 100 * gbs / base);
    std::fflush(stdout);
  };
  line("seq", base);
  const std::vector<const char*> random32 = run.Slices(kBlock);
  if (!streams_only) {
    for (size_t kb : {4, 8, 16, 32}) {
      const std::vector<const char*> pages = run.Slices(kb * 1024);
      line("slices " + std::to_string(kb) + " KB",
           run.Best([&] { return ReadPages(pages); }));
    }
    for (size_t w : {1, 2, 4, 16, 512}) {
      const std::vector<const char*> pages = run.Windows(w);
      line("windows " + std::to_string(w),
           run.Best([&] { return ReadPages(pages); }));
    }
    const std::vector<size_t> blocks = run.Blocks();
    const std::pair<const char*, int> rows[] = {
        {"rows none", 0},      {"rows one", 1},       {"rows pairs", 2},
        {"rows pairs x2", -2}, {"rows pairs x4", -4}, {"rows pairs x8", -8}};
    for (const auto& [name, arith] : rows) {
      line(name, run.Best([&, arith = arith] {
        return ReadRows(run.pool().base, blocks, arith, run.lanes());
      }));
    }

    // The work table: GB/s of each order, "of seq" against the first line.
    const std::vector<const char*> random = run.Slices(kPage);
    std::vector<const char*> warm(seq.size());
    for (size_t i = 0; i < warm.size(); ++i) warm[i] = random[i % 48];
    const std::vector<const char*> win16 = run.Windows(16);
    std::printf("\n%-8s %8s %8s %8s %8s %8s %8s %8s %8s\n", "work", "random",
                "of seq", "rand32", "of seq", "win16", "of seq", "seq", "warm");
    auto work = [&](const char* name, auto pass) {
      const double r = run.Best([&] { return pass(random); });
      const double r32 = run.Best([&] { return pass(random32); });
      const double w16 = run.Best([&] { return pass(win16); });
      const double q = run.Best([&] { return pass(seq); });
      const double h = run.Best([&] { return pass(warm); });
      std::printf(
          "%-8s %8.2f %7.0f%% %8.2f %7.0f%% %8.2f %7.0f%% %8.2f %8.2f\n", name,
          r, 100 * r / base, r32, 100 * r32 / base, w16, 100 * w16 / base, q,
          h);
      std::fflush(stdout);
    };
    work("none", WorkPass<kWorkNone>);
    work("nop", WorkPass<kWorkNop>);
    work("fma", WorkPass<kWorkFma>);
    if (__builtin_cpu_supports("avx512bf16")) work("dot", WorkPass<kWorkDot>);
    LinesTable(run);
    HintsTable(run);
  }

  // The streams table (session 25): random 32 KB runs read one at a time
  // or two side by side, each stream prefetching t0 and t1 bytes ahead.
  std::vector<const char*> runs;
  for (size_t i = 0; i < random32.size(); i += 8) runs.push_back(random32[i]);
  std::vector<std::vector<const char*>> run_parts;
  run_parts.reserve(static_cast<size_t>(threads));
  for (int k = 0; k < threads; ++k) run_parts.push_back(share(runs, k, 2));
  std::printf("\n%-8s %-8s %6s %6s %6s %8s %8s %8s\n", "work", "streams",
              "t0 KB", "t1 KB", "st KB", "GB/s", "seq", "of seq");
  auto streams = [&](const char* name, int s, ptrdiff_t t0, ptrdiff_t t1,
                     ptrdiff_t st, auto pass) {
    // The pattern's passes alternate with sequential ones, so that each
    // row has its own baseline from the same seconds (the two-thread read
    // of this VM moves between about 45 and 90 GB/s from run to run).
    double g = 0, q = 0;
    for (int p = 0; p < run.passes(); ++p) {
      q = std::max(q, run.Pass(threads, seq_pass));
      g = std::max(g, run.Pass(threads, [&](int k) {
        return pass(run_parts[static_cast<size_t>(k)], t0, t1, st);
      }));
    }
    std::printf("%-8s %-8d %6td %6td %6td %8.2f %8.2f %7.0f%%\n", name, s,
                t0 / 1024, t1 / 1024, st / 1024, g, q, 100 * g / q);
    std::fflush(stdout);
  };
  for (ptrdiff_t st : {0, 16384}) {
    for (int w = 0; w < 2; ++w) {
      if (st > 0 && w == 0) continue;
      const char* name = w == 0 ? "none" : "fma";
      for (const auto& [t0, t1] :
           {std::pair<ptrdiff_t, ptrdiff_t>{4096, 8192}, {8192, 12288}}) {
        streams(name, 1, t0, t1, st,
                w == 0 ? RunsPass<kWorkNone, 1> : RunsPass<kWorkFma, 1>);
      }
      for (const auto& [t0, t1] :
           {std::pair<ptrdiff_t, ptrdiff_t>{2048, 4096}, {4096, 8192}}) {
        streams(name, 2, t0, t1, st,
                w == 0 ? RunsPass<kWorkNone, 2> : RunsPass<kWorkFma, 2>);
      }
    }
  }
  return 0;
}

#else

int Main(int, char**) {
  std::fprintf(stderr, "slice_read_bench needs an x86-64 CPU with AVX-512F\n");
  return 2;
}

#endif

}  // namespace
}  // namespace kvstep

int main(int argc, char** argv) { return kvstep::Main(argc, argv); }
