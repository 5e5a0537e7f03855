// Block manager speed on one thread: raw allocate/release, a sequence's
// allocate+free through the SequenceManager, fork, and prefix-cache lookup.
// items_per_second counts blocks. The second argument of the first two and
// of BM_NearlyFullPool: 0 the LIFO stack (BlockOrder::kAscending), 1 runs
// (BlockOrder::kRuns). BM_EngineStepReservation: a decode step's slot
// reservation for a batch through the Engine (AllocateBlocks of every row,
// lock and checks included), with and without its tables in the result.
// Run: build/bench/block_manager_bench
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/block_allocator.h"
#include "core/engine.h"
#include "core/sequence_manager.h"

namespace kvstep {
namespace {

constexpr int64_t kBlocks = 1 << 16;
constexpr int64_t kBs = 16;

BlockOrder OrderArg(const benchmark::State& state) {
  return state.range(1) != 0 ? BlockOrder::kRuns : BlockOrder::kAscending;
}

void BM_AllocatorAllocateRelease(benchmark::State& state) {
  BlockAllocator a(kBlocks, OrderArg(state));
  const int64_t n = state.range(0);
  std::vector<BlockId> ids;
  ids.reserve(n);
  for (auto _ : state) {
    ids.clear();
    (void)a.Allocate(n, &ids);
    (void)a.Release(ids);
  }
  state.SetItemsProcessed(state.iterations() * n * 2);  // one op each way
}
BENCHMARK(BM_AllocatorAllocateRelease)->ArgsProduct({{1, 16, 256}, {0, 1}});

// Takes every block of `a`'s empty pool, then releases every `stride`-th
// one (ids 0, stride, 2 * stride, ...), so that the free blocks are spread
// evenly over the pool.
void FreeEvery(BlockAllocator* a, int64_t stride) {
  std::vector<BlockId> all;
  (void)a->Allocate(a->num_blocks(), &all);
  for (BlockId b : all) {
    if (b % stride == 0) (void)a->Release({&b, 1});
  }
}

// One block at a time after another (a decoding sequence's growth) in a
// pool with `free` free blocks spread evenly over it, the rest owned: runs
// cannot continue the run (the next id is owned), so each allocation
// searches from the cursor, the worst case for BlockOrder::kRuns.
void BM_NearlyFullPool(benchmark::State& state) {
  BlockAllocator a(kBlocks, OrderArg(state));
  const int64_t free = state.range(0);
  FreeEvery(&a, kBlocks / free);
  std::vector<BlockId> one;
  for (auto _ : state) {
    one.clear();
    (void)a.Allocate(1, &one, /*after=*/1);
    (void)a.Release(one);
  }
  if (a.num_free() != free) state.SkipWithError("lost a block");
  state.SetItemsProcessed(state.iterations() * 2);
}
BENCHMARK(BM_NearlyFullPool)->ArgsProduct({{1, 64, 4096}, {0, 1}});

// Allocations of `n` blocks (a prompt) in a pool whose every other block
// is free: BlockOrder::kRuns searches kExtentSearchWords words of its
// bitmap for room for min(n, kRunExtent) blocks in a row, finds none, and
// takes them one by one from the cursor: its worst case for a prompt.
void BM_ScatteredPool(benchmark::State& state) {
  BlockAllocator a(kBlocks, OrderArg(state));
  const int64_t n = state.range(0);
  FreeEvery(&a, 2);
  std::vector<BlockId> ids;
  for (auto _ : state) {
    ids.clear();
    (void)a.Allocate(n, &ids);
    (void)a.Release(ids);
  }
  if (a.num_free() != kBlocks / 2) state.SkipWithError("lost a block");
  state.SetItemsProcessed(state.iterations() * n * 2);
}
BENCHMARK(BM_ScatteredPool)->ArgsProduct({{2, 16, 256}, {0, 1}});

void BM_SequenceAllocateFree(benchmark::State& state) {
  BlockAllocator a(kBlocks, OrderArg(state));
  SequenceManager m(&a, nullptr, kBs, 1 << 20, 1 << 20);
  const int64_t blocks = state.range(0);
  std::vector<SequenceGrowth> out;
  std::vector<BatchId> batches;
  SeqId id = 0;
  for (auto _ : state) {
    out.clear();
    (void)m.Allocate({{++id, blocks * kBs}}, &out);
    int64_t freed = 0;
    m.Free(id, &freed, &batches);
  }
  state.SetItemsProcessed(state.iterations() * blocks * 2);
}
BENCHMARK(BM_SequenceAllocateFree)->ArgsProduct({{1, 16, 256}, {0, 1}});

// Arguments: rows, tokens each row holds (allocated up front, so the
// reservation takes no block), and 1 to leave the tables out.
void BM_EngineStepReservation(benchmark::State& state) {
  const int64_t rows = state.range(0);
  const int64_t tokens = state.range(1);
  const bool omit = state.range(2) != 0;
  EngineOptions o;
  o.cache.num_blocks = rows * tokens / kBs + 16;
  o.cache.block_size = kBs;
  o.cache.num_layers = 1;
  o.cache.num_kv_heads = 1;
  o.cache.head_size = 8;
  std::unique_ptr<Engine> engine = *Engine::Create(o);
  std::vector<SequenceRequest> req(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    req[static_cast<size_t>(i)].seq_id = static_cast<SeqId>(i + 1);
    req[static_cast<size_t>(i)].num_tokens = tokens;
  }
  if (!engine->AllocateBlocks(req).ok()) {
    state.SkipWithError("AllocateBlocks failed");
    return;
  }
  // The rows hold no token yet, so asking for one is a step's reservation:
  // no block taken, one block's range checked for sharing.
  for (SequenceRequest& r : req) r.num_tokens = 1;
  for (auto _ : state) {
    benchmark::DoNotOptimize(engine->AllocateBlocks(req, {}, omit));
  }
  state.SetItemsProcessed(state.iterations() * rows);
}
BENCHMARK(BM_EngineStepReservation)
    ->ArgsProduct({{64, 256}, {1024, 8192}, {0, 1}});

void BM_Fork(benchmark::State& state) {
  BlockAllocator a(kBlocks, BlockOrder::kAscending);
  SequenceManager m(&a, nullptr, kBs, 1 << 20, 1 << 20);
  const int64_t blocks = state.range(0);
  std::vector<SequenceGrowth> out;
  SequenceRequest r;
  r.seq_id = 1;
  r.num_tokens = blocks * kBs;
  (void)m.Allocate({r}, &out);
  m.Find(1)->num_tokens = blocks * kBs;
  m.Find(1)->tokens.assign(blocks * kBs, 1);
  std::vector<BatchId> batches;
  for (auto _ : state) {
    (void)m.Fork(1, 2);
    int64_t freed = 0;
    m.Free(2, &freed, &batches);
  }
  state.SetItemsProcessed(state.iterations() * blocks);
}
BENCHMARK(BM_Fork)->Arg(16)->Arg(256);

// A new sequence whose whole prompt is cached: hash the chain, look up and
// acquire each block, then free. Per block: one 16-token hash, one lookup.
void BM_PrefixHit(benchmark::State& state) {
  BlockAllocator a(kBlocks, BlockOrder::kAscending);
  SequenceManager m(&a, nullptr, kBs, 1 << 20, 1 << 20);
  const int64_t blocks = state.range(0);
  std::vector<int64_t> prompt(blocks * kBs + 1);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 1000 + i;
  SequenceRequest r;
  r.seq_id = 1;
  r.num_tokens = static_cast<int64_t>(prompt.size());
  r.prompt_token_ids = prompt;
  std::vector<SequenceGrowth> out;
  (void)m.Allocate({r}, &out);
  m.RecordTokens(m.Find(1), 0, prompt, static_cast<int64_t>(prompt.size()));
  std::vector<BatchId> batches;
  SeqId id = 1;
  int64_t hit = 0;
  for (auto _ : state) {
    r.seq_id = ++id;
    out.clear();
    (void)m.Allocate({r}, &out);
    hit += out[0].computed_tokens;
    int64_t freed = 0;
    m.Free(id, &freed, &batches);
  }
  if (hit != static_cast<int64_t>(state.iterations()) * blocks * kBs) {
    state.SkipWithError("not every block was a hit");
  }
  state.SetItemsProcessed(state.iterations() * blocks);
}
BENCHMARK(BM_PrefixHit)->Arg(16)->Arg(256);

}  // namespace
}  // namespace kvstep
