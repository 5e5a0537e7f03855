// Decode attention throughput against memory bandwidth, in one run.
//
// For each (dtype, context, batch, threads): K+V bytes the kernel must read
// per second, next to a STREAM-like read bandwidth measured in rounds
// interleaved with the case's calls, at the same thread count (and, once at
// the start, read and copy bandwidth over a warm 1 GiB buffer). Geometry:
// 32 query heads over 8 KV heads (GQA 4; --kv_heads changes it), head 128,
// block 16 (--block_size=8|32 changes it), random block tables (--tables
// changes them); the pool is
// pre-touched and advised to use huge pages. The goal: >= 80% of read bandwidth
// for contexts of 1k and longer.
//
// The first line names the CPU ("cpu: <brand> (<vendor> family F model
// M), N CPUs"), the second the compiler ("build: clang 14.0.6");
// bench/grid_table.py prints them above its table and will not pool runs
// of two CPUs or two builds.
//
// Columns: "best GB/s" is the case's fastest call and "read GB/s" its
// fastest read round; "of read", the one against the other, is the goal's
// figure. "median of" is the median call's rate against the median read
// round's. Best against best favours short calls: the best of thousands
// of 0.1 ms calls finds quieter moments of this shared VM than the best of
// a few dozen 6 ms read rounds, so one-thread batch-1 cells read 0-13
// points lower by medians, where calls of batch 16 and more mostly agree
// within a few points either way (docs/attention.md, session 29). Medians,
// not means: a few slow read rounds moved a mean-based figure by tens of
// points in some cases. "calls" counts the case's timed calls: it runs
// rounds for --seconds and until it has made --min_calls calls (10 by
// default; a call takes about 80 ms a GB of K/V on one thread here).
//
//   build/bench/attention_bench [--full] [--seconds=0.3] [--min_calls=10]
//       [--layout=nhd]
//       [--no_baseline]
//       [--dtype=bfloat16|float16|float32|fp8_e4m3|fp8_e5m2]
//       [--context=N] [--batch=N] [--threads=N]
//       [--kernel=v1|v2] [--isa=avx512|avx2|portable] [--kv_heads=8]
//       [--block_size=16]
//       [--prefill=N] [--mixed=P] [--warm]
//       [--cold=layers|layers_flush|flush|lines]
//       [--vs=isa=avx2|kernel=v1|kernel=v2|...]
//       [--pool_mib=N]
//       [--tables=random|sorted|sequential|descending|runs|churn|churn_runs]
//       [--run_blocks=L] [--len_spread=F]
//       [--max_gb=2]
//       [--prefetch=auto|nta|t0|t1] [--flush_mib=N]
//       [--bf16_keys=auto|dot|widen] [--amx=on|off] [--fp8_dot=auto|on|off]
//       [--nhd_rows=on|off] [--vllm_rows=auto|on|off] [--prefetch_l2=on|off]
//       [--touch_min_mib=N] [--touch_min_blocks=N] [--partition_size=N]
//       [--pool_poll_us=N]
//       [--pool_idle_poll_us=N]
//       [--query=bfloat16|float16|float32]
// (the filters run one slice of the grid, e.g. under perf). --pool_mib
// draws the batch's blocks from a pool of at least N MiB, as in a server
// whose pool is far larger than one batch; by default the pool is the
// batch's blocks, so small batches read from a small region (a pool whose
// layers' calls read under 512 MiB a cycle flushes each call's lines after
// it, as --cold=layers_flush does, and says so in a "#" line). --query sets
// the query's dtype (by default the cache's; bf16 for fp8 caches).
// --max_gb caps the K/V bytes of a case (by default 2 GB, which keeps
// the full grid's run short and its memory within a small machine's):
// a case over it is not run, and a "#" line says so.
// --tables=sorted sorts each row's random blocks by address; --tables=
// sequential gives row r the pool's blocks r * w .. r * w + w - 1
// (w blocks a row) in order, as a fresh pool would to one growing
// sequence, instead of a random draw from the pool; --tables=descending
// the same blocks highest first, as kvstep's default allocator
// (BlockOrder::kDescending) hands them out; --tables=runs gives each row
// w consecutive blocks at a random place of the pool (rows in no order),
// as BlockOrder::kRuns keeps a sequence's blocks; with --run_blocks=L,
// runs of L blocks each at a random place instead (L - 1 of every L
// neighbouring entries consecutive). --tables=churn and churn_runs take
// the tables from kvstep's own block manager after traffic (ChurnTables),
// in its default order and in --block_order=runs; a "#" line gives each
// case's share of consecutive entries, and the pool is a quarter larger
// than the batch's blocks (--max_gb counts the batch's alone).
//
// --mixed=P times one step of chunked prefill against its parts
// (MeasureMixed): a row of P query tokens (the last P of its context)
// and then --batch decode rows in one call, against the same rows in two
// calls, the chunk's and the decode rows', on the same cache; it prints
// each one's best time and the median over rounds of the mixed call's time
// over the two's sum (not with --vs or --prefill).
//
// --len_spread=F (decode, 0 <= F < 1) gives row r seq_len ctx minus a
// random share of up to F of it (the same draw every run), as a server's
// batch of rows of different lengths; bytes are counted from the lengths.
//
// --touch_min_mib and --touch_min_blocks set AttentionParams' slice touch
// gates (by default this CPU's; 0 and 0 touch every item, a huge
// --touch_min_mib none).
//
// --pool_poll_us sets how long the calling thread polls for the pool's
// worker to finish before it sleeps (ThreadPool::set_finish_poll; by
// default kDefaultFinishPoll, 0 sleeps at once), --pool_idle_poll_us how
// long the worker polls for the next call (set_idle_poll; by default
// kDefaultIdlePoll). Cold calls follow each other back to back by default
// (--cold=layers); under --cold=layers_flush the caller flushes the last
// call's K/V lines between them (about 0.3 ms at 4 MiB of K/V, longer for
// bigger calls; with --cold=flush it also reads 32 MiB, 0.5-1 ms more),
// which an idle poll shorter than that does not bridge; each round's read
// pass (about 8 ms) is never bridged.
//
// --cold= says how a cold call's K/V leaves the caches (Options::ColdMode):
// by default (layers, since session 33) as in a decode step of a model
// whose layers' K/V exceed the caches many times over: the calls cycle over
// as many layers as make 1 GiB of K/V, and nothing is flushed, so a call
// finds the caches full of the other layers' K/V and its own lines, TLB
// entries and page-table lines gone; --cold=layers_flush as sessions 28-32
// measured, 96 MiB of layers, each layer's lines flushed after its call,
// which left free room in L3 and this VM's page-table lines there (one-
// thread calls, bf16 1024 x 1 and x 16, took 0.90-0.98x the time they
// took under layers, both before the kernel's row touch;
// docs/attention.md, session 33); --cold=flush as sessions 8-27 measured,
// the lines flushed and 32 MiB read before each call, which also leaves
// the kernel's code and scratch cold (session 28); --cold=lines (session
// 35) flushes the call's lines before it and nothing else, so that the
// call finds its data in DRAM but its pages' TLB entries (as many as the
// TLB holds) and page-table lines where the flush's own walks left them:
// against --cold=layers it tells what a call's page walks cost from what
// its data's placement costs (needs CLFLUSHOPT, and no --flush_mib).
//
// --vs=FLAG (any of --isa=, --kernel=, --prefetch=, --bf16_keys=, --amx=,
// --fp8_dot=, --nhd_rows=, --vllm_rows=, --prefetch_l2=, --touch_min_mib=,
// --touch_min_blocks=, --partition_size=,
// --pool_poll_us=, --pool_idle_poll_us=, --tables=) times a second
// configuration call by call against the first, in the same process and on the
// same cache: A, B, A, B, ... each after its own cache flush. It prints both
// best times and the median over pairs of B's time / A's, which resolves
// differences of a few percent that this shared VM's drift (5-10% from run to
// run) hides between two separate runs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "absl/status/statusor.h"
#include "core/attention.h"
#include "core/block_allocator.h"
#include "core/device.h"
#include "core/float_convert.h"
#include "core/kv_cache.h"
#include "core/sequence_manager.h"
#include "core/traffic.h"

namespace kvstep {
namespace {

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Seconds to run fn(0) .. fn(threads - 1) at once, fn(0) on the caller.
double TimeOnThreads(int threads, const std::function<void(int)>& fn) {
  const double t = Now();
  std::vector<std::thread> ts;
  for (int k = 1; k < threads; ++k) ts.emplace_back(fn, k);
  fn(0);
  for (std::thread& th : ts) th.join();
  return Now() - t;
}

// Sums of the 64-bit words in [p, p + n), n a multiple of 32 words: 8
// independent lanes (vectorized, so that memory and not add latency bounds
// it), 512-bit loads where the CPU has AVX-512 (on an Intel Xeon with AMX
// they read 5% faster than 128-bit ones).
uint64_t SumWords(const uint64_t* p, size_t n) {
  uint64_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (size_t i = 0; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) s[k] += p[i + k];
  }
  return std::accumulate(s, s + 8, uint64_t{0});
}
#if defined(__x86_64__)
__attribute__((target("avx512f"))) uint64_t SumWords512(const uint64_t* p,
                                                        size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 8));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 16));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 24));
  }
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(
      _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3))));
}
#endif

// STREAM-like bandwidth over a warm buffer, kept for the whole run so that
// each case can be compared with the read bandwidth of the same moment (a
// neighbour on this shared VM moves it by 25% or more within minutes). The
// buffer comes from the CPU device, as the pool does: pre-touched and on
// transparent huge pages. On 4 KB pages the same loop read 30% slower on an
// Intel Xeon with AMX (9.9 against 14.6 GB/s), which made the kernel's
// share look that much better than it was.
class Bandwidth {
 public:
  explicit Bandwidth(size_t bytes)
      : mem_(*CpuDevice()->Allocate(bytes / 256 * 256)),
        a_(static_cast<uint64_t*>(mem_->data())),
        n_(mem_->size() / 8) {
    for (size_t i = 0; i < n_; ++i) a_[i] = i;
  }

  // GB/s of reading the first `bytes` on `threads` threads (each its own
  // share), best of `reps`.
  double Read(int threads, size_t bytes, int reps) {
    const size_t n = std::min(bytes / 8, n_);
    double best = 0;
#if defined(__x86_64__)
    const bool wide = __builtin_cpu_supports("avx512f");
#else
    const bool wide = false;
#endif
    auto part = [&](size_t lo, size_t hi) {
#if defined(__x86_64__)
      if (wide) {
        sink_ += SumWords512(a_ + lo, hi - lo);
        return;
      }
#endif
      sink_ += SumWords(a_ + lo, hi - lo);
    };
    // Each thread's share a multiple of 32 words, as the sums want.
    const size_t chunk = n / threads / 32 * 32;
    for (int rep = 0; rep < reps; ++rep) {
      const double dt = TimeOnThreads(
          threads, [&](int k) { part(k * chunk, (k + 1) * chunk); });
      best = std::max(best, 8.0 * chunk * threads / dt / 1e9);
    }
    return best;
  }

  // GB/s of memcpy of the buffer on `threads` threads (each its own
  // share), counting bytes read plus bytes written as STREAM counts a copy
  // (issue #4 names "a STREAM-like copy" as the baseline; the goal's figure
  // is against the read, which this guest's one-thread copy matches:
  // docs/attention.md, session 67); best of 5.
  double Copy(int threads) {
    std::shared_ptr<Allocation> b = *CpuDevice()->Allocate(n_ * 8);
    auto* dst = static_cast<uint64_t*>(b->data());
    const size_t chunk = n_ / threads;
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
      const double dt = TimeOnThreads(threads, [&](int k) {
        std::memcpy(dst + k * chunk, a_ + k * chunk, chunk * 8);
      });
      best = std::max(best, 16.0 * chunk * threads / dt / 1e9);
      sink_ += dst[static_cast<size_t>(rep) * 12345 % (chunk * threads)];
    }
    return best;
  }

  ~Bandwidth() {
    if (sink_ == 42) std::printf(" ");  // keeps the sums alive
  }

 private:
  std::shared_ptr<Allocation> mem_;
  uint64_t* a_;
  size_t n_;
  std::atomic<uint64_t> sink_{0};
};

#if defined(__x86_64__)
// Twelve independent chains of 8-wide (16-wide) FMAs: more than latency x
// pipes, so the pipes, not a chain, bound it; returns a value to keep
// them alive.
__attribute__((target("avx2,fma"))) float FmaChains(int64_t n) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(0.001f);
  for (int64_t k = 0; k < n; ++k) {
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], x, y);
  }
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  return _mm256_cvtss_f32(s);
}
__attribute__((target("avx512f"))) float FmaChains512(int64_t n) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(0.001f);
  for (int64_t k = 0; k < n; ++k) {
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], x, y);
  }
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}
#endif

// GFLOP/s (2 per FMA lane) of FmaChains on `threads` threads at once,
// 16-wide where the kernel runs AVX-512, about 20 ms; 0 where there is no
// AVX2+FMA.
double FmaPeak(int threads, bool avx512) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    return 0;
  }
  constexpr int64_t kIters = 4 << 20;  // 48 Mi FMAs a thread
  std::vector<float> sums(threads);
  const double dt = TimeOnThreads(threads, [&](int k) {
    sums[k] = avx512 ? FmaChains512(kIters) : FmaChains(kIters);
  });
  if (std::accumulate(sums.begin(), sums.end(), 0.0f) == 42.0f) {
    std::printf(" ");  // keeps the chains alive
  }
  return (avx512 ? 32.0 : 16.0) * 12 * kIters * threads / dt / 1e9;
#else
  (void)threads;
  (void)avx512;
  return 0;
#endif
}

// Exits on a call that fails (a flag out of range, a path this CPU lacks):
// the timed calls repeat the checked one's arguments, and a failing call
// returns in microseconds, which would pass for a fast kernel.
void MustRun(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "PagedAttention failed: %s\n", s.ToString().c_str());
    std::exit(2);
  }
}

const char* KernelName(AttentionParams::Kernel k) {
  switch (k) {
    case AttentionParams::Kernel::kSinglePass:
      return "v1";
    case AttentionParams::Kernel::kPartitioned:
      return "v2";
    case AttentionParams::Kernel::kAuto:
      break;
  }
  return "auto";
}

// A prefetch hint in words; kAuto as what it resolves to here, by cache
// dtype where that differs.
std::string PrefetchWords(AttentionParams::Prefetch hint, CacheLayout layout) {
  if (hint != AttentionParams::Prefetch::kAuto) {
    return std::string(PrefetchName(hint)) + " prefetch";
  }
  const AttentionParams::Prefetch b16 = BestPrefetch(DType::kBFloat16, layout);
  const AttentionParams::Prefetch f32 = BestPrefetch(DType::kFloat32, layout);
  const AttentionParams::Prefetch f8 = BestPrefetch(DType::kFp8E4M3, layout);
  std::string words = std::string(PrefetchName(b16)) + " prefetch";
  if (f32 != b16 && f8 != b16 && f32 == f8) {
    words +=
        std::string(" (") + PrefetchName(f32) + " for fp32 and fp8 caches)";
  } else if (f32 != b16 || f8 != b16) {
    words += " (";
    if (f32 != b16) words += std::string(PrefetchName(f32)) + " for fp32";
    if (f32 != b16 && f8 != b16) words += ", ";
    if (f8 != b16) words += std::string(PrefetchName(f8)) + " for fp8";
    words += " caches)";
  }
  return words;
}

// How fp8 caches meet a bf16 query (AttentionParams::fp8_dot) in words.
// kAuto's choice (BestFp8Dot) is one for block sizes 16 and 32, and block
// size 8 in the vLLM layout may take the dot passes where they do not.
std::string Fp8DotWords(AttentionParams::Fp8Dot d, CacheLayout layout) {
  using D = AttentionParams::Fp8Dot;
  if (!kvstep::Fp8DotSupported() || d == D::kOff) return "";
  if (d == D::kOn || BestFp8Dot(layout, 16)) {
    return ", fp8 by VDPBF16PS (bf16 queries)";
  }
  return BestFp8Dot(layout, 8) ? ", fp8 by VDPBF16PS (bf16 queries) only at "
                                 "block size 8 (this CPU's choice)"
                               : "";
}

// A configuration in words, for the table headers.
std::string Describe(const AttentionParams& p, CacheLayout layout) {
  return std::string("kernel ") + KernelName(p.kernel) +
         (p.kernel == AttentionParams::Kernel::kAuto &&
                  BestLongRowRanges(DType::kBFloat16, CacheLayout::kVllm)
              ? " (decode of rows of 2 MiB of K/V a KV head and more in "
                "1024-key ranges)"
              : "") +
         ", " + IsaName(p.isa) + " instruction set, " +
         PrefetchWords(p.prefetch, layout) + ", bf16 keys " +
         (p.bf16_keys == AttentionParams::Bf16Keys::kDot ? "by VDPBF16PS"
          : p.bf16_keys == AttentionParams::Bf16Keys::kWiden
              ? "widened"
              : std::string(BestBf16Keys() == AttentionParams::Bf16Keys::kDot
                                ? "by VDPBF16PS"
                                : "widened") +
                    (BestBf16Keys(/*chunks=*/true) ==
                             AttentionParams::Bf16Keys::kDot
                         ? " (prefill chunks by VDPBF16PS: vLLM layout; NHD "
                           "in rows of more than 32 tokens)"
                         : "")) +
         (p.nhd_rows ? "" : ", NHD items per KV head") +
         (p.vllm_rows == AttentionParams::VllmRows::kOff
              ? ", vLLM decode items per KV head"
          : p.vllm_rows == AttentionParams::VllmRows::kOn ||
                  BestVllmRows(DType::kFloat32, 16)
              ? ""
              : ", vLLM decode rows over every KV head only for 8- and "
                "16-bit caches at block size 8 (this CPU's choice)") +
         (p.prefetch_l2 ? "" : ", no second prefetch into L2") +
         (p.amx && kvstep::AmxSupported()
              ? ", AMX for 16-bit prefill chunks (beyond the FMA peak)"
              : "") +
         Fp8DotWords(p.fp8_dot, layout) + ", slice touch " +
         (p.touch_min_bytes < 0 && p.touch_min_blocks < 0
              ? std::string("auto")
              : "from " + std::to_string(p.touch_min_bytes >> 20) +
                    " MiB calls, " + std::to_string(p.touch_min_blocks) +
                    "-block items (-1: auto)");
}

// --isa=..., --kernel=..., --prefetch=..., --bf16_keys=..., --amx=...,
// --fp8_dot=..., --nhd_rows=..., --vllm_rows=..., --prefetch_l2=...,
// --touch_min_mib=N, --touch_min_blocks=N and --partition_size=N (v2's
// keys a partition, 512 by default) into *p; false for any other flag.
bool ParseParamFlag(const std::string& a, AttentionParams* p) {
  using Isa = AttentionParams::Isa;
  using Kernel = AttentionParams::Kernel;
  if (a == "--portable" || a == "--isa=portable") {
    p->isa = Isa::kPortable;
  } else if (a == "--isa=avx2") {
    p->isa = Isa::kAvx2;
  } else if (a == "--isa=avx512") {
    p->isa = Isa::kAvx512;
  } else if (a == "--kernel=v1") {
    p->kernel = Kernel::kSinglePass;
  } else if (a == "--kernel=v2") {
    p->kernel = Kernel::kPartitioned;
  } else if (a == "--kernel=auto") {
    p->kernel = Kernel::kAuto;
  } else if (a.rfind("--prefetch=", 0) == 0 &&
             ParsePrefetch(a.substr(11), &p->prefetch)) {
  } else if (a == "--bf16_keys=dot") {
    p->bf16_keys = AttentionParams::Bf16Keys::kDot;
  } else if (a == "--bf16_keys=widen") {
    p->bf16_keys = AttentionParams::Bf16Keys::kWiden;
  } else if (a == "--bf16_keys=auto") {
    p->bf16_keys = AttentionParams::Bf16Keys::kAuto;
  } else if (a == "--amx=on" || a == "--amx=off") {
    p->amx = a == "--amx=on";
  } else if (a == "--fp8_dot=on") {
    p->fp8_dot = AttentionParams::Fp8Dot::kOn;
  } else if (a == "--fp8_dot=off") {
    p->fp8_dot = AttentionParams::Fp8Dot::kOff;
  } else if (a == "--fp8_dot=auto") {
    p->fp8_dot = AttentionParams::Fp8Dot::kAuto;
  } else if (a == "--nhd_rows=on" || a == "--nhd_rows=off") {
    p->nhd_rows = a == "--nhd_rows=on";
  } else if (a == "--vllm_rows=on") {
    p->vllm_rows = AttentionParams::VllmRows::kOn;
  } else if (a == "--vllm_rows=off") {
    p->vllm_rows = AttentionParams::VllmRows::kOff;
  } else if (a == "--vllm_rows=auto") {
    p->vllm_rows = AttentionParams::VllmRows::kAuto;
  } else if (a == "--prefetch_l2=on" || a == "--prefetch_l2=off") {
    p->prefetch_l2 = a == "--prefetch_l2=on";
  } else if (a.rfind("--touch_min_mib=", 0) == 0) {
    const int64_t mib = std::stoll(a.substr(16));  // < 0: auto
    p->touch_min_bytes = mib < 0 ? -1 : mib << 20;
  } else if (a.rfind("--touch_min_blocks=", 0) == 0) {
    p->touch_min_blocks = std::stoll(a.substr(19));
  } else if (a.rfind("--partition_size=", 0) == 0) {
    p->partition_size = std::max<int64_t>(1, std::stoll(a.substr(17)));
  } else {
    return false;
  }
  return true;
}

struct Result {
  double rate;  // mean over the run: GB/s (decode) or GFLOP/s (prefill)
  double us;    // mean per call
  double best_us;
  double best_rate;    // the best call's, as `rate`
  double baseline;     // best interleaved read GB/s or FMA GFLOP/s; 0 if none
  double median_rate;  // the median call's, as `rate`
  double baseline_median;  // the median round's, as `baseline`
  int64_t calls;           // timed calls
};

// The median of v (the upper one of an even count); 0 if v is empty.
double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

struct Options {
  kvstep::CacheLayout layout = kvstep::CacheLayout::kVllm;
  AttentionParams params;
  double seconds = 0.3;
  // Timed calls a case makes at least (--min_calls=), however long they
  // take, so that a case of 1 GB or more (about 80 ms a GB a call on one
  // thread, one call a round) is the best of ten calls against the best of
  // ten read passes, not of the three that 0.3 s held (session 58).
  int64_t min_calls = 10;
  int64_t kv_heads = 8;  // of 32 query heads
  // Tokens a block (--block_size=): 8, 16 or 32, the kernel's sizes; the
  // goal's grid is at 16, vLLM's default.
  int64_t block_size = 16;
  int64_t prefill = 0;  // query tokens per row; 0: decode (one)
  // --mixed=P: a chunked-prefill step, timed against its parts (MeasureMixed).
  int64_t mixed = 0;
  double len_spread = 0;  // decode rows' lengths over [ctx (1 - F), ctx]
  // The query's dtype (--query=); kInvalid: the cache's (bf16 for fp8).
  DType query = DType::kInvalid;
  // The pool's K+V size at least (MiB), the batch's blocks drawn at random
  // from all of it; 0: the batch's blocks only (--pool_mib=).
  int64_t pool_mib = 0;
  // How rows draw their blocks from the pool (--tables=): kRandom, a
  // random draw (a pool fragmented by frees); kSorted, the same draw with
  // each row's blocks in ascending order (what a kernel visiting blocks in
  // address order would read); kSequential, row r holds blocks r * w .. r *
  // w + w - 1 in order, as a fresh pool hands them to one growing sequence.
  // The gaps between them are the random pattern's cost, not the kernel's.
  // kDescending, row r holds blocks r * w + w - 1 .. r * w, highest
  // first: what kvstep's default allocator (BlockOrder::kDescending, a
  // LIFO free list) hands a fresh pool's prefills, and a freed table's
  // blocks again to the next allocation of the same size. kRuns, row r
  // holds w consecutive blocks from a random multiple of w: a sequence's
  // table as BlockOrder::kRuns keeps it at best, whole (under traffic
  // 90-100% of its neighbouring entries are consecutive ids in
  // bench/block_order_sim, 73-96% in kChurnRuns's tables).
  // kChurn and kChurnRuns: the tables kvstep's own block manager leaves
  // under traffic, in its default order (a LIFO stack) and in
  // BlockOrder::kRuns (ChurnTables); the pool is then a quarter larger
  // than the batch's blocks (or --pool_mib), room for the other sequences.
  enum class Tables {
    kRandom,
    kSorted,
    kSequential,
    kDescending,
    kRuns,
    kChurn,
    kChurnRuns
  };
  bool Churns() const {
    return tables == Tables::kChurn || tables == Tables::kChurnRuns ||
           (ab &&
            (vs_tables == Tables::kChurn || vs_tables == Tables::kChurnRuns));
  }
  Tables tables = Tables::kRandom;
  // kRuns: blocks a run (--run_blocks=; 0: a row's whole table).
  int64_t run_blocks = 0;
  Tables vs_tables = Tables::kRandom;  // B's, with --vs=tables=...
  // Cold: each call starts with the layer's K/V out of the caches, as in a
  // served model, where the other layers' K/V pass through L3 between two
  // calls for one layer (CacheFlusher). Warm (--warm): back-to-back calls,
  // so that working sets up to a few times the L3 partly hit it.
  bool cold = true;
  // How a cold call's K/V leaves the caches (--cold=):
  //   kLayers: as in a decode step of a model whose layers' K/V are many
  //     times the caches. The cache has as many layers as make
  //     kCycleBytes of K/V (at least one) and calls cycle over them, with
  //     nothing flushed: a call finds L3 full of the other layers' K/V,
  //     and its own lines, its pages' TLB entries and their page-table
  //     lines gone with that traffic, while the kernel's code and scratch
  //     and the thread pool stay where the previous layer's call left
  //     them.
  //   kLayersFlush: sessions 28-32's kLayers: kStepBytes of layers, each
  //     layer's lines flushed after its call (untimed, CLFLUSHOPT). That
  //     leaves L3 with room the next call fills without evicting anything,
  //     and nothing evicts the pool's page-table lines from it: on this
  //     VM, whose host maps guest memory in 4 KB pages, the walks of a
  //     call's random pages then hit L3 (session 33).
  //   kFlush: before each call its K/V lines are flushed, then 32 MiB read
  //     on 4 KB pages (sessions 8-27): every cache level and the TLB then
  //     hold that read, the code and scratch included, which a server's
  //     calls do not do (session 28: 1-3% of a small one-thread call's
  //     time, 5-12% of a two-thread batch-1 call's).
  //   kLines: before each call its K/V lines are flushed (CLFLUSHOPT) and
  //     nothing else: the flush walks every page of the call's blocks, so
  //     the call finds its data in DRAM and its pages' translations warm
  //     (session 35: the diagnostic that keeps page walks out of a call).
  enum class ColdMode { kLayers, kLayersFlush, kFlush, kLines };
  ColdMode cold_mode = ColdMode::kLayers;
  // Whether cold calls cycle over layers (kLayers or kLayersFlush, and not
  // --warm).
  bool CyclesLayers() const {
    return cold && (cold_mode == ColdMode::kLayers ||
                    cold_mode == ColdMode::kLayersFlush);
  }
  bool ab = false;  // --vs: time `vs` against `params` call by call
  AttentionParams vs;
  // The pool's polls (ThreadPool::set_finish_poll, set_idle_poll), for
  // `params` and for `vs`.
  struct Polls {
    std::chrono::microseconds finish = ThreadPool::kDefaultFinishPoll;
    std::chrono::microseconds idle = ThreadPool::kDefaultIdlePoll;
    void Apply(ThreadPool* pool) const {
      pool->set_finish_poll(finish);
      pool->set_idle_poll(idle);
    }
    std::string Describe() const {
      return "pool polls " + std::to_string(finish.count()) + " us (finish), " +
             std::to_string(idle.count()) + " us (idle)";
    }
  };
  Polls polls, vs_polls;
};

// Bytes of one interleaved read pass: large against the caches, and about
// 20 ms at this machine's single-thread bandwidth.
constexpr size_t kReadBytes = size_t{256} << 20;

// K/V bytes of the layers a cold case's calls cycle over (kLayers): 32
// times this Zen 5's 32 MiB L3, a 32-layer model's K/V at batch 8 and 1024
// keys (bf16, 8 KV heads, head 128). Without a flush, a layer's lines are
// gone from every cache when its turn comes again, its page-table lines
// too: a cycle of 2 GiB gave the same call times (session 33), and one of
// 96 MiB left some of each layer's lines in L3 (bf16 1024 x 1 took 0.85x
// the time).
constexpr int64_t kCycleBytes = int64_t{1} << 30;

// K/V bytes of the layers under kLayersFlush (sessions 28-32): three times
// the L3, so that a layer's pages are gone from the TLB when its turn
// comes again (its lines are flushed).
constexpr int64_t kStepBytes = int64_t{96} << 20;

// K/V bytes of the layers a cold case's calls cycle over.
int64_t CycleBytes(const Options& o) {
  return o.cold_mode == Options::ColdMode::kLayersFlush ? kStepBytes
                                                        : kCycleBytes;
}

// One case's cache (filled with small finite values), rows and query, and
// the work of one call: K+V bytes (decode), or FLOPs (prefill: each of the
// row's query tokens at position p multiplies p + 1 keys and values).
struct Setup {
  std::unique_ptr<KvCache> cache;
  int64_t layers = 1;      // the cache's: calls cycle over them (kLayers)
  int64_t next_layer = 0;  // the next call's
  // Whether cold calls over layers flush their lines after them:
  // kLayersFlush, or kLayers where a cycle's calls read under half of
  // kCycleBytes (a --pool_mib pool far larger than the batch's blocks,
  // whose few layers would leave a call's blocks in L3 for its next turn).
  bool flush_after = false;
  AttentionRows rows;
  AttentionRows vs_rows;  // --vs only: rows with B's tables (same cache)
  Tensor q;
  double work;
};

#if defined(__x86_64__)
__attribute__((target("clflushopt"))) void FlushLines(const char* p,
                                                      size_t bytes) {
  // GCC declares _mm_clflushopt(void*), clang (void const*); a flush
  // writes nothing the caller sees.
  for (size_t i = 0; i < bytes; i += 64) {
    _mm_clflushopt(const_cast<char*>(p + i));
  }
}
bool HasClflushopt() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) != 0 &&
         (ebx & (1u << 23)) != 0;
}
#endif

// "cpu: <brand> (<vendor> family F model M), N CPUs" (ThisCpu): the
// output's first line, so that a grid says which machine it measured
// (these sessions' VMs have moved between an AMD Zen 5 and Intel Xeons,
// whose figures differ by far) and grid_table.py can refuse to pool runs
// of two CPUs.
std::string CpuLine() {
  const CpuIdentity& cpu = ThisCpu();
  return "cpu: " + (cpu.brand.empty() ? "unknown" : cpu.brand) + " (" +
         (cpu.vendor.empty() ? "unknown" : cpu.vendor) + " family " +
         std::to_string(cpu.family) + " model " + std::to_string(cpu.model) +
         "), " + std::to_string(std::thread::hardware_concurrency()) + " CPUs";
}

// "build: <compiler> <version>": the output's second line. The kernel
// (core/attention.cc) is built by the same compiler as this tool, and
// GCC's build takes 0.97-1.12x clang's time (docs/attention.md, session
// 66), so grid_table.py will not pool runs of two builds either.
std::string BuildLine() {
#if defined(__clang__)
  std::string v = "clang " __clang_version__;
#elif defined(__GNUC__)
  std::string v = "gcc " __VERSION__;
#else
  std::string v = "unknown compiler";
#endif
  while (!v.empty() && v.back() == ' ') v.pop_back();
  return "build: " + v;
}

// Sends a case's K/V out of the caches. By default every line of its
// blocks, with CLFLUSHOPT, out of every level (64 MiB in about 2 ms on an
// Intel Xeon with AMX). With --cold=flush (sessions 8-27), before a call,
// then a read of 32 MiB on 4 KB pages, which empties L1, L2, the TLB and
// on this Zen 5 the L3 too: the kernel's code and scratch go with them,
// which a server's calls for other layers do not do (session 28). With
// read_mib > 0 (--flush_mib), or on a CPU without CLFLUSHOPT (then 96
// MiB), a read of that much alone, which leaves the case's data wherever a
// larger cache keeps it: on that Xeon, whose shared L3 is reported as 480
// MiB, batch 1 at context 1024 (4 MiB) ran at 82-85% of read after a 96
// MiB read, 79-80% after the line flush alone, 74-75% with the 32 MiB read
// after it, 65-66% after a 512 MiB read (docs/attention.md, session 8).
class CacheFlusher {
 public:
  explicit CacheFlusher(size_t read_mib) {
#if defined(__x86_64__)
    lines_ = read_mib == 0 && HasClflushopt();
#endif
    if (read_mib == 0) read_mib = lines_ ? 32 : 96;
    a_.assign(read_mib << 17, 1);
  }
  bool lines() const { return lines_; }
  size_t read_mib() const { return a_.size() >> 17; }

  // Flushes layer `layer`'s lines of the rows' blocks, then (`read`) reads
  // read_mib().
  void Flush(const KvCache& cache, const AttentionRows& rows, int64_t layer = 0,
             bool read = true) {
#if defined(__x86_64__)
    if (lines_) {
      const int64_t n = cache.config().num_blocks;
      for (const Tensor* t : {&cache.key(layer), &cache.value(layer)}) {
        const size_t block = t->nbytes() / static_cast<size_t>(n);
        const char* base = static_cast<const char*>(t->raw_data());
        for (int64_t b : rows.block_tables) {
          FlushLines(base + static_cast<size_t>(b) * block, block);
        }
      }
      _mm_sfence();
    }
#endif
    if (!read) return;
    uint64_t s = 0;
    for (size_t i = 0; i < a_.size(); i += 8) s += a_[i];  // a line each
    sink_ += s;
  }

 private:
  bool lines_ = false;
  std::vector<uint64_t> a_;  // on 4 KB pages: std::vector's are, here
  std::atomic<uint64_t> sink_{0};
};

const char* TablesName(Options::Tables t);

// Block tables as kvstep's block manager leaves them under traffic, from a
// SequenceManager over the case's pool of `num_blocks` blocks of 16 in
// `order`. First a history: sequences arrive with a prompt of 1..ctx
// tokens (admitted when it fits), grow a token a step for 1..ctx/2 tokens
// more and finish, at most batch * 3 / 2 (and at least 4) at a time; one
// that finds no block for its next token is preempted (freed whole, as
// vLLM's recompute preemption does). When the history has allocated three
// times the pool's tokens, the batch's own sequences arrive among the
// history's last ones (which are no longer replaced), prompts of 1..ctx
// tokens admitted as they fit, and grow a token a step to ctx; they are
// never preempted, and since the pool holds batch * ceil(ctx / 16) blocks
// at least, all of them get there. Their tables are the rows.
// `*adjacent` gets the share of the rows' neighbouring entries that are
// consecutive ids.
std::vector<int64_t> ChurnTables(int64_t num_blocks, int64_t batch, int64_t ctx,
                                 BlockOrder order, double* adjacent) {
  constexpr int64_t kBs = 16;
  BlockAllocator alloc(num_blocks, order);
  const int64_t history = std::max<int64_t>(4, batch * 3 / 2);
  SequenceManager seqs(&alloc, /*host=*/nullptr, kBs,
                       /*max_seq_len=*/ctx + ctx / 2 + 1,
                       /*max_sequences=*/history + batch);
  Traffic traffic(&seqs);
  std::mt19937_64 rng(1);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, std::max(lo, hi))(rng);
  };
  std::vector<SeqId> rows;
  int64_t allocated = 0;  // tokens, over the history
  const int64_t turnover = 3 * num_blocks * kBs;
  auto rows_at_ctx = [&] {
    int64_t n = 0;
    for (SeqId id : rows) n += traffic.live().at(id).tokens == ctx;
    return n;
  };
  for (int64_t step = 0; rows_at_ctx() < batch; ++step) {
    if (step > 100 * (turnover + ctx)) {
      std::fprintf(stderr, "--tables=churn: the batch never got its blocks\n");
      std::exit(2);
    }
    // The history's sequences are preempted when they find no block and
    // finish at their target; the batch's rows wait and stay.
    const bool rows_now = allocated >= turnover;
    while (rows_now ? static_cast<int64_t>(rows.size()) < batch
                    : static_cast<int64_t>(traffic.live().size()) < history) {
      const int64_t prompt = uni(1, ctx);
      SeqId id = 0;
      Traffic::Live* q = traffic.Admit(prompt, &id);
      if (q == nullptr) break;
      if (rows_now) {
        q->target = ctx;
        q->preemptible = false;
        q->stays = true;
        rows.push_back(id);
      } else {
        q->target = prompt + uni(1, ctx / 2);
      }
      allocated += prompt;
    }
    allocated += traffic.Step();
  }
  std::vector<int64_t> tables;
  int64_t pairs = 0, consecutive = 0;
  for (SeqId id : rows) {
    const std::vector<BlockId>& t = traffic.Table(id);
    tables.insert(tables.end(), t.begin(), t.end());
    CountAdjacent(t, &pairs, &consecutive);
  }
  *adjacent = pairs > 0 ? static_cast<double>(consecutive) / pairs : 0.0;
  return tables;
}

// ChurnTables, once per pool, batch, context and order in a process: a
// case's one- and two-thread runs (and every dtype's, where the pool's
// block count is the same) take the same tables, and a large case's
// traffic takes seconds to replay.
const std::vector<int64_t>& CachedChurnTables(int64_t num_blocks, int64_t batch,
                                              int64_t ctx, BlockOrder order,
                                              double* adjacent) {
  struct Tables {
    std::vector<int64_t> blocks;
    double adjacent;
  };
  static auto* cache =
      new std::map<std::tuple<int64_t, int64_t, int64_t, BlockOrder>, Tables>;
  auto [it, added] = cache->try_emplace({num_blocks, batch, ctx, order});
  if (added) {
    it->second.blocks =
        ChurnTables(num_blocks, batch, ctx, order, &it->second.adjacent);
  }
  *adjacent = it->second.adjacent;
  return it->second.blocks;
}

Setup MakeSetup(DType dtype, int64_t ctx, int64_t batch, const Options& o) {
  CacheConfig c;
  c.block_size = o.block_size;
  c.num_kv_heads = o.kv_heads;
  c.head_size = 128;
  c.dtype = dtype;
  c.layout = o.layout;
  const int64_t per_row = (ctx + c.block_size - 1) / c.block_size;
  const int64_t block_bytes =
      2 * c.block_size * c.num_kv_heads * c.head_size * DTypeSize(dtype);
  c.num_blocks = std::max(per_row * batch * (o.Churns() ? 5 : 4) / 4,
                          (o.pool_mib << 20) / block_bytes);
  const int64_t layer_bytes = c.num_blocks * block_bytes;
  // At most CacheConfig::kMaxLayers: the smallest cases (bf16 128 x 1,
  // 512 KB a layer) then cycle over 512 MiB, fp8 ones or fewer KV heads
  // over less, and a cycle that reads under half of CycleBytes flushes
  // each call's lines after it (flush_after), which says so below.
  c.num_layers =
      o.CyclesLayers()
          ? std::clamp<int64_t>((CycleBytes(o) + layer_bytes - 1) / layer_bytes,
                                1, CacheConfig::kMaxLayers)
          : 1;
  Setup st;
  st.layers = c.num_layers;
  const int64_t call_bytes = per_row * batch * block_bytes;
  st.flush_after =
      o.CyclesLayers() && (o.cold_mode == Options::ColdMode::kLayersFlush ||
                           c.num_layers * call_bytes < CycleBytes(o) / 2);
  if (st.flush_after && o.cold_mode == Options::ColdMode::kLayers) {
    std::printf(
        "# %s context %ld batch %ld: the calls of a cycle over the pool's "
        "layers (%ld) read %ld MiB, so each call's lines are flushed after "
        "it, as under --cold=layers_flush\n",
        std::string(DTypeName(dtype)).c_str(), static_cast<long>(ctx),
        static_cast<long>(batch), static_cast<long>(c.num_layers),
        static_cast<long>((c.num_layers * call_bytes) >> 20));
  }
  absl::StatusOr<std::unique_ptr<KvCache>> cache_or =
      KvCache::Create(c, CpuDevice());
  if (!cache_or.ok()) {
    std::fprintf(stderr, "%s context %ld batch %ld: %s\n",
                 std::string(DTypeName(dtype)).c_str(), static_cast<long>(ctx),
                 static_cast<long>(batch),
                 std::string(cache_or.status().message()).c_str());
    std::exit(2);
  }
  st.cache = *std::move(cache_or);
  KvCache& cache = *st.cache;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    std::memset(cache.key(l).raw_data(), 0x11, cache.key(l).nbytes());
    std::memset(cache.value(l).raw_data(), 0x11, cache.value(l).nbytes());
  }
  AttentionRows& rows = st.rows;
  rows.width = per_row;
  rows.num_real = batch;
  auto tables = [&](Options::Tables kind) {
    if (kind == Options::Tables::kChurn ||
        kind == Options::Tables::kChurnRuns) {
      double adjacent = 0;
      std::vector<int64_t> t = CachedChurnTables(c.num_blocks, batch, ctx,
                                                 kind == Options::Tables::kChurn
                                                     ? BlockOrder::kDescending
                                                     : BlockOrder::kRuns,
                                                 &adjacent);
      std::printf(
          "# %s tables, %s context %ld batch %ld: %.0f%% of "
          "neighbouring entries consecutive (pool of %ld blocks)\n",
          TablesName(kind), std::string(DTypeName(dtype)).c_str(),
          static_cast<long>(ctx), static_cast<long>(batch), 100 * adjacent,
          static_cast<long>(c.num_blocks));
      return t;
    }
    std::vector<int64_t> perm(c.num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    // kRuns replaces the draw with its own below.
    const bool drawn =
        kind == Options::Tables::kRandom || kind == Options::Tables::kSorted;
    if (drawn) std::shuffle(perm.begin(), perm.end(), std::mt19937_64(1));
    if (kind == Options::Tables::kRuns) {
      // Runs of `run` blocks at run-aligned places, in random order; each
      // row's runs follow one another (the last one cut short if `run`
      // does not divide it).
      const int64_t run = o.run_blocks > 0 ? o.run_blocks : per_row;
      const int64_t runs_a_row = (per_row + run - 1) / run;
      std::vector<int64_t> slot(c.num_blocks / run);
      std::iota(slot.begin(), slot.end(), 0);
      std::shuffle(slot.begin(), slot.end(), std::mt19937_64(1));
      if (static_cast<int64_t>(slot.size()) < runs_a_row * batch) {
        std::fprintf(stderr, "--run_blocks=%ld: the pool is too small\n",
                     static_cast<long>(run));
        std::exit(2);
      }
      for (int64_t r = 0; r < batch; ++r) {
        for (int64_t k = 0; k < per_row; ++k) {
          perm[r * per_row + k] =
              slot[r * runs_a_row + k / run] * run + k % run;
        }
      }
    }
    perm.resize(per_row * batch);
    if (kind == Options::Tables::kDescending) {
      for (int64_t r = 0; r < batch; ++r) {
        std::reverse(perm.begin() + r * per_row,
                     perm.begin() + (r + 1) * per_row);
      }
    }
    if (kind == Options::Tables::kSorted) {
      for (int64_t r = 0; r < batch; ++r) {
        std::sort(perm.begin() + r * per_row, perm.begin() + (r + 1) * per_row);
      }
    }
    return perm;
  };
  rows.block_tables = tables(o.tables);
  const int64_t nq = o.prefill > 0 ? std::min(o.prefill, ctx) : 1;
  for (int64_t r = 0; r <= batch; ++r) rows.query_start.push_back(r * nq);
  rows.seq_lens.assign(batch, ctx);
  if (o.prefill == 0 && o.len_spread > 0) {
    std::mt19937_64 len_rng(2);
    std::uniform_real_distribution<double> share(0.0, o.len_spread);
    for (int64_t& len : rows.seq_lens) {
      len = std::max<int64_t>(
          1, ctx - static_cast<int64_t>(share(len_rng) *
                                        static_cast<double>(ctx)));
    }
  }
  const double all_keys = static_cast<double>(
      std::accumulate(rows.seq_lens.begin(), rows.seq_lens.end(), int64_t{0}));
  if (o.ab) {
    st.vs_rows = rows;
    st.vs_rows.block_tables = tables(o.vs_tables);
  }
  // fp8 caches are read with bf16 queries (and outputs) by default.
  const DType act = o.query != DType::kInvalid ? o.query
                    : DTypeSize(dtype) == 1    ? DType::kBFloat16
                                               : dtype;
  st.q = *Tensor::Zeros(CpuDevice(), act, {batch * nq, 32, 128});
  std::memset(st.q.raw_data(), 0x11, st.q.nbytes());
  st.work = 2.0 * all_keys * c.num_kv_heads * c.head_size *
            static_cast<double>(DTypeSize(dtype));
  if (o.prefill > 0) {
    const double keys = static_cast<double>(nq) * ctx - nq * (nq - 1) / 2.0;
    st.work = batch * 32.0 * keys * 2 * c.head_size * 2;
  }
  return st;
}

// Times one call of p on rows, cold (o.cold) as o.cold_mode says: kFlush
// flushes and reads before the call, kLines only flushes, kLayers calls the
// next layer, kLayersFlush too and flushes its lines after the call (the
// flushes untimed). q: the query (by default st->q).
double TimedCall(Setup* st, const Options& o, CacheFlusher* flusher,
                 const AttentionRows& rows, const AttentionParams& p,
                 ThreadPool* pool, Tensor* out, const Tensor* q = nullptr) {
  const bool layers = o.CyclesLayers();
  const int64_t layer = layers ? st->next_layer : 0;
  if (o.cold && !layers) {
    flusher->Flush(*st->cache, rows, 0,
                   /*read=*/o.cold_mode != Options::ColdMode::kLines);
  }
  const double t = Now();
  (void)PagedAttention(*st->cache, layer, q != nullptr ? *q : st->q, rows, p,
                       pool, out);
  const double dt = Now() - t;
  if (layers) {
    // Without CLFLUSHOPT (kLayers only: kLayersFlush falls back to kFlush
    // then), a read of the flusher's buffer instead.
    if (st->flush_after) {
      flusher->Flush(*st->cache, rows, layer, /*read=*/!flusher->lines());
    }
    st->next_layer = (layer + 1) % st->layers;
  }
  return dt;
}

// Whether a case's cold calls find their lines flushed: by kFlush or kLines
// before each call, or after each (Setup::flush_after). Such calls do not leave
// their lines to the next calls' traffic, so the untimed first calls flush
// theirs too.
bool FlushesLines(const Options& o, const Setup& st) {
  return o.cold && (o.cold_mode == Options::ColdMode::kFlush ||
                    o.cold_mode == Options::ColdMode::kLines || st.flush_after);
}

// A case's first calls, untimed: one on layer 0 that must succeed, then,
// where cold calls cycle over several layers, one on every layer, so that
// timing starts in the steady state (the setup's fill of the layers left
// the last ones' lines in L3, where the first cycle's calls found them:
// under --no_baseline and --vs, whose first calls follow no read pass,
// bf16 1024 x 1's best calls took 0.87x the time of the others; session
// 33).
void WarmUp(Setup* st, const Options& o, CacheFlusher* flusher,
            const AttentionRows& rows, const AttentionParams& p,
            ThreadPool* pool, Tensor* out) {
  MustRun(PagedAttention(*st->cache, 0, st->q, rows, p, pool, out));
  if (!o.cold) return;
  if (!o.CyclesLayers() || st->layers == 1) {
    // kLayers' one layer of 1 GiB or more leaves its lines to its next
    // call's own traffic.
    if (FlushesLines(o, *st)) {
      flusher->Flush(*st->cache, rows, 0, /*read=*/!flusher->lines());
    }
    return;
  }
  for (int64_t l = 0; l < st->layers; ++l) {
    (void)TimedCall(st, o, flusher, rows, p, pool, out);
  }
}

Result Measure(DType dtype, int64_t ctx, int64_t batch, int threads,
               const Options& o, Bandwidth* bw, CacheFlusher* flusher) {
  const double seconds = o.seconds;
  Setup st = MakeSetup(dtype, ctx, batch, o);
  const AttentionRows& rows = st.rows;
  const double work = st.work;
  ThreadPool pool(threads);
  o.polls.Apply(&pool);
  const AttentionParams& p = o.params;
  Tensor out;
  WarmUp(&st, o, flusher, rows, p, &pool, &out);
  // Rounds of one read pass (at the same thread count) and then kernel
  // calls for about as long, so that the two see the same moments of this
  // shared VM: a neighbour moves both by 25% or more within seconds.
  double read = 0;
  std::vector<double> calls, rates;  // every call's time, round's rate
  const double start = Now();
  while (Now() - start < seconds ||
         calls.size() < static_cast<size_t>(o.min_calls)) {
    double round_s = 0.02;
    if (bw != nullptr) {
      const double t = Now();
      const bool avx512 = p.isa == kvstep::AttentionParams::Isa::kAvx512;
      const double rate = o.prefill > 0 ? FmaPeak(threads, avx512)
                                        : bw->Read(threads, kReadBytes, 1);
      read = std::max(read, rate);
      round_s = Now() - t;
      if (rate > 0) rates.push_back(rate);
    }
    const double round_start = Now();
    do {
      calls.push_back(TimedCall(&st, o, flusher, rows, p, &pool, &out));
    } while (Now() - round_start < round_s);
  }
  const double kernel_s = std::accumulate(calls.begin(), calls.end(), 0.0);
  const auto n = static_cast<double>(calls.size());
  const double median_s = Median(calls);
  const double best_s = *std::min_element(calls.begin(), calls.end());
  return {work * n / kernel_s / 1e9,
          kernel_s / n * 1e6,
          best_s * 1e6,
          best_s > 0 ? work / best_s / 1e9 : 0.0,
          read,
          median_s > 0 ? work / median_s / 1e9 : 0.0,
          Median(rates),
          static_cast<int64_t>(calls.size())};
}

// --pool_poll_us=N or --pool_idle_poll_us=N (N >= 0) into *polls; false
// for any other flag. A bad N ends the run.
bool ParsePollFlag(const std::string& a, Options::Polls* polls) {
  for (const auto& [flag, field] :
       {std::pair<std::string, std::chrono::microseconds*>{"--pool_poll_us=",
                                                           &polls->finish},
        {"--pool_idle_poll_us=", &polls->idle}}) {
    if (a.compare(0, flag.size(), flag) != 0) continue;
    char* end = nullptr;
    const long long us = std::strtoll(a.c_str() + flag.size(), &end, 10);
    if (end == a.c_str() + flag.size() || *end != '\0' || us < 0) {
      std::fprintf(stderr, "%s takes a whole number of us >= 0\n",
                   flag.c_str());
      std::exit(2);
    }
    *field = std::chrono::microseconds(us);
    return true;
  }
  return false;
}

// --tables=random|sorted|sequential|descending|runs|churn|churn_runs into
// *t; false for any
// other flag.
bool ParseTables(const std::string& a, Options::Tables* t) {
  using T = Options::Tables;
  for (const auto& [name, kind] :
       {std::pair<const char*, T>{"--tables=random", T::kRandom},
        {"--tables=sorted", T::kSorted},
        {"--tables=sequential", T::kSequential},
        {"--tables=descending", T::kDescending},
        {"--tables=runs", T::kRuns},
        {"--tables=churn", T::kChurn},
        {"--tables=churn_runs", T::kChurnRuns}}) {
    if (a == name) {
      *t = kind;
      return true;
    }
  }
  return false;
}

const char* TablesName(Options::Tables t) {
  switch (t) {
    case Options::Tables::kSorted:
      return "sorted random";
    case Options::Tables::kSequential:
      return "sequential";
    case Options::Tables::kDescending:
      return "descending";
    case Options::Tables::kRuns:
      return "runs";
    case Options::Tables::kChurn:
      return "churn (LIFO)";
    case Options::Tables::kChurnRuns:
      return "churn (runs)";
    case Options::Tables::kRandom:
      break;
  }
  return "random";
}

struct AbResult {
  double best_a_us, best_b_us;
  double median_ratio;  // over pairs (A, B) called back to back: B / A
  int pairs;
};

// Alternates calls with o.params (A) and o.vs (B) on one cache and query,
// each cold as o.cold_mode says (unless --warm), for about o.seconds.
AbResult MeasureAb(DType dtype, int64_t ctx, int64_t batch, int threads,
                   const Options& o, CacheFlusher* flusher) {
  Setup st = MakeSetup(dtype, ctx, batch, o);
  ThreadPool pool(threads);
  Tensor out;
  MustRun(PagedAttention(*st.cache, 0, st.q, st.vs_rows, o.vs, &pool, &out));
  WarmUp(&st, o, flusher, st.rows, o.params, &pool, &out);
  if (FlushesLines(o, st)) {
    // B's blocks where its tables differ from A's (--vs=tables=).
    for (int64_t l = 0; l < st.layers; ++l) {
      flusher->Flush(*st.cache, st.vs_rows, l, /*read=*/false);
    }
  }
  // Each call's polls are set before its flush, and an empty job follows,
  // so that the worker ends a job under them: its idle poll decides whether
  // it is still polling or asleep when the call starts, as if the calls
  // before it had had the same polls.
  auto call = [&](const AttentionParams& p, const Options::Polls& polls,
                  const AttentionRows& rows) {
    polls.Apply(&pool);
    pool.ParallelFor(pool.num_threads(), [](int64_t) {});
    return TimedCall(&st, o, flusher, rows, p, &pool, &out);
  };
  std::vector<double> ratios;
  double best_a = 1e30, best_b = 1e30;
  const double start = Now();
  while (Now() - start < o.seconds || ratios.size() < 5) {
    // Which one goes first alternates too, so that neither always follows
    // the flush's or the other call's cache state.
    const bool a_first = ratios.size() % 2 == 0;
    const double ta = a_first ? call(o.params, o.polls, st.rows) : 0;
    const double tb = call(o.vs, o.vs_polls, st.vs_rows);
    const double ta2 = a_first ? ta : call(o.params, o.polls, st.rows);
    best_a = std::min(best_a, ta2);
    best_b = std::min(best_b, tb);
    ratios.push_back(tb / ta2);
  }
  return {best_a * 1e6, best_b * 1e6, Median(ratios),
          static_cast<int>(ratios.size())};
}

struct MixedResult {
  double best_mixed_us, best_prefill_us, best_decode_us;
  double median_ratio;  // over rounds: mixed / (prefill + decode)
  int rounds;
};

// --mixed=P: one step of chunked prefill as vLLM's scheduler batches it
// (prefill rows first): a row of P query tokens, the last P of its `ctx`
// keys (causal), then `batch` decode rows of `ctx` keys, in one call,
// against the same two sets of rows in two calls (the prefill row alone,
// then the decode rows alone) on the same cache, blocks and queries.
// Rounds alternate which comes first; each call is cold as o.cold_mode
// says. A ratio over 1 is what batching the two costs: a thread left idle
// while the other finishes a long item, or a decode row denied the path
// it takes in a call of decode rows alone.
MixedResult MeasureMixed(DType dtype, int64_t ctx, int64_t batch, int threads,
                         const Options& o, CacheFlusher* flusher) {
  Options od = o;
  od.prefill = 0;
  Setup st = MakeSetup(dtype, ctx, batch + 1, od);
  const int64_t p = std::min(o.mixed, ctx);
  AttentionRows& mixed = st.rows;  // row 0 the prefill, 1 .. batch decode
  const int64_t w = mixed.width;
  mixed.seq_lens[0] = ctx;
  mixed.query_start.clear();
  mixed.query_start.push_back(0);
  for (int64_t r = 0; r <= batch; ++r) mixed.query_start.push_back(p + r);
  AttentionRows prefill, decode;
  prefill.width = decode.width = w;
  prefill.num_real = 1;
  prefill.query_start = {0, p};
  prefill.seq_lens = {ctx};
  prefill.block_tables.assign(mixed.block_tables.begin(),
                              mixed.block_tables.begin() + w);
  decode.num_real = batch;
  for (int64_t r = 0; r <= batch; ++r) decode.query_start.push_back(r);
  decode.seq_lens.assign(mixed.seq_lens.begin() + 1, mixed.seq_lens.end());
  decode.block_tables.assign(mixed.block_tables.begin() + w,
                             mixed.block_tables.end());
  const DType act = st.q.dtype();
  auto query = [&](int64_t tokens) {
    Tensor q = *Tensor::Zeros(CpuDevice(), act, {tokens, 32, 128});
    std::memset(q.raw_data(), 0x11, q.nbytes());
    return q;
  };
  st.q = query(p + batch);
  const Tensor q_prefill = query(p), q_decode = query(batch);
  ThreadPool pool(threads);
  o.polls.Apply(&pool);
  Tensor out_m, out_p, out_d;
  WarmUp(&st, o, flusher, mixed, o.params, &pool, &out_m);
  MustRun(PagedAttention(*st.cache, 0, q_prefill, prefill, o.params, &pool,
                         &out_p));
  MustRun(
      PagedAttention(*st.cache, 0, q_decode, decode, o.params, &pool, &out_d));
  if (FlushesLines(o, st)) {
    for (int64_t l = 0; l < st.layers; ++l) {
      flusher->Flush(*st.cache, mixed, l, /*read=*/false);
    }
  }
  std::vector<double> ratios;
  double best_m = 1e30, best_p = 1e30, best_d = 1e30;
  const double start = Now();
  while (Now() - start < o.seconds ||
         ratios.size() <
             static_cast<size_t>(std::max<int64_t>(5, o.min_calls))) {
    auto call_mixed = [&] {
      return TimedCall(&st, o, flusher, mixed, o.params, &pool, &out_m);
    };
    const bool mixed_first = ratios.size() % 2 == 0;
    const double tm = mixed_first ? call_mixed() : 0;
    const double tp = TimedCall(&st, o, flusher, prefill, o.params, &pool,
                                &out_p, &q_prefill);
    const double td =
        TimedCall(&st, o, flusher, decode, o.params, &pool, &out_d, &q_decode);
    const double tm2 = mixed_first ? tm : call_mixed();
    best_m = std::min(best_m, tm2);
    best_p = std::min(best_p, tp);
    best_d = std::min(best_d, td);
    ratios.push_back(tm2 / (tp + td));
  }
  return {best_m * 1e6, best_p * 1e6, best_d * 1e6, Median(ratios),
          static_cast<int>(ratios.size())};
}

}  // namespace
}  // namespace kvstep

int main(int argc, char** argv) {
  using kvstep::DType;
  bool full = false, baseline = true;
  kvstep::Options o;
  std::string only_dtype, vs_flag;
  int64_t only_ctx = 0, only_batch = 0, only_threads = 0, flush_mib = 0;
  double max_gb = 2;  // K/V bytes a case may take (the pool), in GB
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const size_t n = std::strlen(flag);
      return a.compare(0, n, flag) == 0 ? a.c_str() + n : nullptr;
    };
    if (a == "--full") {
      full = true;
    } else if (a == "--warm") {
      o.cold = false;
    } else if (a == "--cold=layers") {
      o.cold_mode = kvstep::Options::ColdMode::kLayers;
    } else if (a == "--cold=layers_flush") {
      o.cold_mode = kvstep::Options::ColdMode::kLayersFlush;
    } else if (a == "--cold=flush") {
      o.cold_mode = kvstep::Options::ColdMode::kFlush;
    } else if (a == "--cold=lines") {
      o.cold_mode = kvstep::Options::ColdMode::kLines;
    } else if (a == "--no_baseline") {
      baseline = false;
    } else if (kvstep::ParseParamFlag(a, &o.params) ||
               kvstep::ParsePollFlag(a, &o.polls) ||
               kvstep::ParseTables(a, &o.tables)) {
      // Taken by one of the parsers.
    } else if (const char* v = value("--vs=")) {
      vs_flag = std::string("--") + v;
    } else if (a == "--layout=nhd") {
      o.layout = kvstep::CacheLayout::kNhd;
    } else if (a == "--layout=vllm") {
      o.layout = kvstep::CacheLayout::kVllm;
    } else if (const char* v = value("--len_spread=")) {
      o.len_spread = std::clamp(std::atof(v), 0.0, 0.99);
    } else if (const char* v = value("--run_blocks=")) {
      o.run_blocks = std::max<int64_t>(0, std::atoll(v));
    } else if (const char* v = value("--pool_mib=")) {
      o.pool_mib = std::stoll(v);
      if (o.pool_mib < 0) {
        std::fprintf(stderr, "--pool_mib must be >= 0\n");
        return 2;
      }
    } else if (const char* v = value("--max_gb=")) {
      max_gb = std::stod(v);
      if (!(max_gb > 0)) {
        std::fprintf(stderr, "--max_gb must be > 0\n");
        return 2;
      }
    } else if (const char* v = value("--flush_mib=")) {
      flush_mib = std::stoll(v);
      if (flush_mib < 1) {
        std::fprintf(stderr, "--flush_mib must be at least 1\n");
        return 2;
      }
    } else if (const char* v = value("--block_size=")) {
      o.block_size = std::stoll(v);
      if (o.block_size != 8 && o.block_size != 16 && o.block_size != 32) {
        std::fprintf(stderr, "--block_size takes 8, 16 or 32\n");
        return 2;
      }
    } else if (const char* v = value("--kv_heads=")) {
      o.kv_heads = std::stoll(v);
      if (o.kv_heads < 1 || 32 % o.kv_heads != 0) {
        std::fprintf(stderr, "--kv_heads must divide 32\n");
        return 2;
      }
    } else if (const char* v = value("--prefill=")) {
      o.prefill = std::stoll(v);
      if (o.prefill < 1) {
        std::fprintf(stderr, "--prefill must be at least 1\n");
        return 2;
      }
    } else if (const char* v = value("--mixed=")) {
      o.mixed = std::stoll(v);
      if (o.mixed < 1) {
        std::fprintf(stderr, "--mixed must be at least 1\n");
        return 2;
      }
    } else if (const char* v = value("--seconds=")) {
      o.seconds = std::stod(v);
    } else if (const char* v = value("--min_calls=")) {
      o.min_calls = std::stoll(v);
      if (o.min_calls < 1) {
        std::fprintf(stderr, "--min_calls must be at least 1\n");
        return 2;
      }
    } else if (const char* v = value("--dtype=")) {
      only_dtype = v;
    } else if (const char* v = value("--query=")) {
      const std::string q = v;
      o.query = q == "float32"    ? DType::kFloat32
                : q == "float16"  ? DType::kFloat16
                : q == "bfloat16" ? DType::kBFloat16
                                  : DType::kInvalid;
      if (o.query == DType::kInvalid) {
        std::fprintf(stderr, "--query takes bfloat16, float16 or float32\n");
        return 2;
      }
    } else if (const char* v = value("--context=")) {
      only_ctx = std::stoll(v);
    } else if (const char* v = value("--batch=")) {
      only_batch = std::stoll(v);
    } else if (const char* v = value("--threads=")) {
      only_threads = std::stoll(v);
    } else {
      std::fprintf(stderr, "unknown flag %s (see the top of %s)\n", a.c_str(),
                   __FILE__);
      return 2;
    }
  }
  if (!vs_flag.empty()) {
    o.ab = true;
    o.vs = o.params;
    o.vs_polls = o.polls;
    o.vs_tables = o.tables;
    if (!kvstep::ParseTables(vs_flag, &o.vs_tables) &&
        !kvstep::ParsePollFlag(vs_flag, &o.vs_polls) &&
        !kvstep::ParseParamFlag(vs_flag, &o.vs)) {
      std::fprintf(stderr,
                   "--vs takes isa=..., kernel=..., prefetch=..., "
                   "bf16_keys=..., amx=..., fp8_dot=..., nhd_rows=..., "
                   "vllm_rows=..., prefetch_l2=..., "
                   "touch_min_mib=..., "
                   "touch_min_blocks=..., pool_poll_us=..., "
                   "pool_idle_poll_us=... or tables=..., not %s\n",
                   vs_flag.c_str() + 2);
      return 2;
    }
  }
  if (o.mixed > 0 && (o.ab || o.prefill > 0)) {
    std::fprintf(stderr, "--mixed takes neither --vs nor --prefill\n");
    return 2;
  }
  // ChurnTables simulates 16-token blocks.
  if (o.Churns() && o.block_size != 16) {
    std::fprintf(stderr, "--tables=churn and churn_runs take block 16 only\n");
    return 2;
  }
  for (kvstep::AttentionParams* p : {&o.params, &o.vs}) {
    if (!kvstep::IsaSupported(p->isa)) {
      std::fprintf(stderr, "this CPU has no %s\n", kvstep::IsaName(p->isa));
      return 2;
    }
    // The build kBest runs here, by name (the table header, the FMA peak's
    // width); the kernel dispatches to the same one.
    if (p->isa == kvstep::AttentionParams::Isa::kBest) {
      p->isa = kvstep::BestIsa();
    }
    // The prefetch hint and bf16_keys stay kAuto: the kernel resolves them
    // by the cache's dtype and by the call's rows (Describe names both).
  }
  kvstep::Bandwidth bw(baseline ? size_t{1} << 30 : 64 << 20);
  kvstep::CacheFlusher flusher(static_cast<size_t>(flush_mib));
  // Flushing a layer's lines after its call needs CLFLUSHOPT (and no
  // --flush_mib).
  if (!flusher.lines() &&
      o.cold_mode == kvstep::Options::ColdMode::kLayersFlush) {
    o.cold_mode = kvstep::Options::ColdMode::kFlush;
  }
  // kLines without CLFLUSHOPT would be a warm call: its point is lost.
  if (!flusher.lines() && o.cold_mode == kvstep::Options::ColdMode::kLines) {
    std::fprintf(stderr, "--cold=lines needs CLFLUSHOPT and no --flush_mib\n");
    return 2;
  }
  std::printf("%s\n", kvstep::CpuLine().c_str());
  std::printf("%s\n", kvstep::BuildLine().c_str());
  if (baseline) {
    const double read1 = bw.Read(1, size_t{1} << 30, 5);
    const double read2 = bw.Read(2, size_t{1} << 30, 5);
    std::printf(
        "baseline (1 GiB warm, best of 5): read %.1f GB/s (1 thread), %.1f "
        "GB/s (2 threads), copy %.1f GB/s (1 thread), %.1f GB/s (2 threads; "
        "read plus written bytes); each case's \"read\" is the best "
        "of 256 MiB read passes interleaved with its calls (same thread "
        "count), and \"of read\" is the kernel's best call against it; "
        "\"median of\" is the kernel's median call against those passes' "
        "median\n",
        read1, read2, bw.Copy(1), bw.Copy(2));
  }
  std::printf(
      "layout %s, %s, %s; 32 query heads over %ld KV heads, head 128, block "
      "%ld, %s block tables",
      o.layout == kvstep::CacheLayout::kVllm ? "vllm" : "nhd",
      kvstep::Describe(o.params, o.layout).c_str(), o.polls.Describe().c_str(),
      static_cast<long>(o.kv_heads), static_cast<long>(o.block_size),
      kvstep::TablesName(o.tables));
  if (o.run_blocks > 0) {
    std::printf(" (runs of %ld blocks)", static_cast<long>(o.run_blocks));
  }
  if (o.len_spread > 0 && o.prefill == 0) {
    std::printf(", decode rows' lengths over [%.2f, 1] of the context",
                1.0 - o.len_spread);
  }
  std::printf("; ");
  if (o.CyclesLayers() && o.cold_mode == kvstep::Options::ColdMode::kLayers) {
    std::printf(
        "cold caches as in a decode step (the case's K/V in as many layers as "
        "make %ld MiB, calls cycling over them, nothing flushed)\n",
        static_cast<long>(kvstep::kCycleBytes >> 20));
  } else if (o.CyclesLayers()) {
    std::printf(
        "cold caches as in sessions 28-32 (the case's K/V in as many layers "
        "as make %ld MiB, calls cycling over them, each layer's K/V lines "
        "flushed after its call, untimed)\n",
        static_cast<long>(kvstep::kStepBytes >> 20));
  } else if (o.cold && o.cold_mode == kvstep::Options::ColdMode::kLines) {
    std::printf(
        "cold caches (before each call, untimed: the case's K/V lines "
        "flushed, nothing else, so its pages' translations stay warm)\n");
  } else if (o.cold && flusher.lines()) {
    std::printf(
        "cold caches (before each call, untimed: the case's K/V lines "
        "flushed, then %ld MiB read)\n",
        static_cast<long>(flusher.read_mib()));
  } else if (o.cold) {
    std::printf("cold caches (%ld MiB read before each call, untimed)\n",
                static_cast<long>(flusher.read_mib()));
  } else {
    std::printf("warm caches (back-to-back calls)\n");
  }
  const bool pf = o.prefill > 0;
  if (pf) {
    std::printf(
        "prefill: each row's last %ld tokens, causal; GFLOP/s of attention "
        "against the best FMA GFLOP/s of rounds interleaved with the calls "
        "(same thread count)\n",
        static_cast<long>(o.prefill));
  }
  if (o.mixed > 0) {
    std::printf(
        "mixed: a row of %ld query tokens (the last of its context's, "
        "causal) and `batch` decode rows in one call, against the two in "
        "separate calls; \"M/(P+D)\" is the median over rounds of the mixed "
        "call's time / the sum of the two\n",
        static_cast<long>(o.mixed));
    std::printf("%-9s %7s %6s %8s %10s %10s %10s %7s %6s\n", "dtype", "context",
                "batch", "threads", "M best us", "P best us", "D best us",
                "M/(P+D)", "rounds");
  } else if (o.ab) {
    std::printf(
        "A/B: A = %s, %s, %s tables; B = %s, %s, %s tables; called "
        "alternately; \"B/A\" is the median over pairs of B's time / A's\n",
        kvstep::Describe(o.params, o.layout).c_str(),
        o.polls.Describe().c_str(), kvstep::TablesName(o.tables),
        kvstep::Describe(o.vs, o.layout).c_str(), o.vs_polls.Describe().c_str(),
        kvstep::TablesName(o.vs_tables));
    std::printf("%-9s %7s %6s %8s %10s %10s %7s %6s\n", "dtype", "context",
                "batch", "threads", "A best us", "B best us", "B/A", "pairs");
  } else {
    std::printf("%-9s %7s %6s %8s %10s %10s %9s %9s %9s %8s %9s %6s\n", "dtype",
                "context", "batch", "threads", "us/call", "best us",
                pf ? "mean GF/s" : "mean GB/s", pf ? "best GF/s" : "best GB/s",
                pf ? "FMA GF/s" : "read GB/s", pf ? "of FMA" : "of read",
                "median of", "calls");
  }
  const std::vector<int64_t> contexts =
      full ? std::vector<int64_t>{128, 512, 1024, 2048, 4096, 8192}
           : std::vector<int64_t>{128, 1024, 4096};
  const std::vector<int64_t> batches =
      full ? std::vector<int64_t>{1, 16, 64, 256} : std::vector<int64_t>{1, 16};
  for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32,
                  DType::kFp8E4M3, DType::kFp8E5M2}) {
    // fp8 caches (bf16 queries) only when asked for: the goal's grid is
    // the other three.
    if (only_dtype.empty() ? kvstep::DTypeSize(d) == 1
                           : only_dtype != kvstep::DTypeName(d)) {
      continue;
    }
    for (int64_t ctx : contexts) {
      if (only_ctx != 0) ctx = only_ctx;
      for (int64_t batch : batches) {
        if (only_batch != 0) batch = only_batch;
        // Keep each pool within --max_gb, and say which cases that skips.
        const double kv_gb =
            2.0 * batch * ctx * o.kv_heads * 128 * kvstep::DTypeSize(d) / 1e9;
        if (kv_gb > max_gb) {
          std::printf(
              "# %s context %ld batch %ld not run: %.2f GB of K/V, "
              "over --max_gb=%g\n",
              std::string(kvstep::DTypeName(d)).c_str(), static_cast<long>(ctx),
              static_cast<long>(batch), kv_gb, max_gb);
          std::fflush(stdout);
          if (only_batch != 0) break;
          continue;
        }
        for (int threads : {1, 2}) {
          if (only_threads != 0 && threads != only_threads) continue;
          if (o.mixed > 0) {
            const kvstep::MixedResult r =
                kvstep::MeasureMixed(d, ctx, batch, threads, o, &flusher);
            std::printf("%-9s %7ld %6ld %8d %10.1f %10.1f %10.1f %7.3f %6d\n",
                        std::string(kvstep::DTypeName(d)).c_str(),
                        static_cast<long>(ctx), static_cast<long>(batch),
                        threads, r.best_mixed_us, r.best_prefill_us,
                        r.best_decode_us, r.median_ratio, r.rounds);
            std::fflush(stdout);
            continue;
          }
          if (o.ab) {
            const kvstep::AbResult r =
                kvstep::MeasureAb(d, ctx, batch, threads, o, &flusher);
            std::printf("%-9s %7ld %6ld %8d %10.1f %10.1f %7.3f %6d\n",
                        std::string(kvstep::DTypeName(d)).c_str(),
                        static_cast<long>(ctx), static_cast<long>(batch),
                        threads, r.best_a_us, r.best_b_us, r.median_ratio,
                        r.pairs);
            std::fflush(stdout);
            continue;
          }
          const kvstep::Result r = kvstep::Measure(
              d, ctx, batch, threads, o, baseline ? &bw : nullptr, &flusher);
          const double read = r.baseline;
          // Best against best, both from the same rounds.
          const double best_gbs = r.best_rate;
          std::printf(
              "%-9s %7ld %6ld %8d %10.1f %10.1f %9.2f %9.2f %9.2f %7.0f%% "
              "%8.0f%% %6ld\n",
              std::string(kvstep::DTypeName(d)).c_str(), static_cast<long>(ctx),
              static_cast<long>(batch), threads, r.us, r.best_us, r.rate,
              best_gbs, read, read > 0 ? 100.0 * best_gbs / read : 0.0,
              r.baseline_median > 0 ? 100.0 * r.median_rate / r.baseline_median
                                    : 0.0,
              static_cast<long>(r.calls));
          std::fflush(stdout);
        }
        if (only_batch != 0) break;
      }
      if (only_ctx != 0) break;
    }
  }
  return 0;
}
