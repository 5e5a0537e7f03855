// How consecutive kvstep's block tables stay under traffic, by block order:
// the simulations behind BlockAllocator::RunGap's numbers (docs/
// attention.md, session 31).
//
//   build/bench/block_order_sim
//
// Each scenario runs Traffic (core/traffic.h) straight on a BlockAllocator
// over a pool of 16-token blocks, each sequence's growth in one allocation
// after its last block, as SequenceManager::Allocate makes them:
// up to `running` sequences at a time, each arriving with a prompt drawn
// from [prompt_lo, prompt_hi] tokens (admitted when its blocks are
// there), growing a token a step for [decode_lo, decode_hi] tokens more
// and finishing; a sequence that finds no block for its next token is
// preempted (freed whole). Over the second half of the steps, every 500
// steps, it takes the live tables' share of neighbouring entries that are
// consecutive ids, and the pool's fill, under the default order (LIFO),
// under kRuns with no table length passed, which leaves every gap at
// kRunGap blocks ("gap 2"), and under kRuns as SequenceManager calls it.
// One seed a scenario, so a few points either way are noise. At bbdb196
// (session 31's first step) the "gap 2" column is session 30's allocator.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "core/block_allocator.h"
#include "core/traffic.h"

namespace kvstep {
namespace {

struct Scenario {
  const char* name;
  int64_t pool, running, prompt_lo, prompt_hi, decode_lo, decode_hi;
  int steps;
};

struct Outcome {
  double consecutive, fill;
};

// `grown_gap`: pass each table's length to BlockAllocator::Allocate, as
// SequenceManager does, so that kRuns sizes its gaps by it (RunGap);
// false passes none, which leaves every gap at kRunGap blocks.
Outcome Run(const Scenario& s, BlockOrder order, bool grown_gap) {
  constexpr int64_t kBs = 16;
  BlockAllocator alloc(s.pool, order);
  Traffic traffic(&alloc, kBs, /*pass_length=*/grown_gap);
  std::mt19937_64 rng(7);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int64_t pairs = 0, consecutive = 0;
  double fill = 0;
  int samples = 0;
  for (int step = 0; step < s.steps; ++step) {
    while (static_cast<int64_t>(traffic.live().size()) < s.running) {
      const int64_t prompt = uni(s.prompt_lo, s.prompt_hi);
      Traffic::Live* q = traffic.Admit(prompt);
      if (q == nullptr) break;
      q->target = prompt + uni(s.decode_lo, s.decode_hi);
    }
    traffic.Step();
    if (step >= s.steps / 2 && step % 500 == 0) {
      for (const auto& [id, q] : traffic.live()) {
        CountAdjacent(traffic.Table(id), &pairs, &consecutive);
      }
      fill += 1.0 - static_cast<double>(alloc.num_free()) / s.pool;
      ++samples;
    }
  }
  return {pairs > 0 ? static_cast<double>(consecutive) / pairs : 0.0,
          samples > 0 ? fill / samples : 0.0};
}

}  // namespace
}  // namespace kvstep

int main() {
  using kvstep::BlockOrder;
  const kvstep::Scenario scenarios[] = {
      // The traffic of tests/block_allocator_test.cc's BlockOrderUnderChurn.
      {"test: 3000 / 16, p 256-1536, d 32-512", 3000, 16, 256, 1536, 32, 512,
       6000},
      {"test: 3000 / 16, p 16-128, d 512-2048", 3000, 16, 16, 128, 512, 2048,
       6000},
      // Session 30's simulation, three pool sizes.
      {"20000 / 64, p 256-3072, d 32-1024", 20000, 64, 256, 3072, 32, 1024,
       40000},
      {"12000 / 64, p 256-3072, d 32-1024", 12000, 64, 256, 3072, 32, 1024,
       40000},
      {"9000 / 64, p 256-3072, d 32-1024", 9000, 64, 256, 3072, 32, 1024,
       40000},
      // Long decodes after short prompts.
      {"20000 / 64, p 64-512, d 512-4096", 20000, 64, 64, 512, 512, 4096,
       40000},
      {"9000 / 64, p 64-512, d 512-4096", 9000, 64, 64, 512, 512, 4096, 40000},
      // Long rows.
      {"40000 / 32, p 1k-8k, d 1k-8k", 40000, 32, 1024, 8192, 1024, 8192,
       40000},
      {"20000 / 32, p 1k-8k, d 1k-8k", 20000, 32, 1024, 8192, 1024, 8192,
       40000},
  };
  std::printf("%-40s %6s %8s %6s %9s\n",
              "pool blocks / running, prompt, decoded", "LIFO", "gap 2", "runs",
              "runs fill");
  for (const kvstep::Scenario& s : scenarios) {
    const kvstep::Outcome lifo =
        kvstep::Run(s, BlockOrder::kDescending, /*grown_gap=*/true);
    const kvstep::Outcome fixed = kvstep::Run(s, BlockOrder::kRuns, false);
    const kvstep::Outcome runs = kvstep::Run(s, BlockOrder::kRuns, true);
    std::printf("%-40s %5.0f%% %7.0f%% %5.0f%% %8.0f%%\n", s.name,
                100 * lifo.consecutive, 100 * fixed.consecutive,
                100 * runs.consecutive, 100 * runs.fill);
    std::fflush(stdout);
  }
  return 0;
}
