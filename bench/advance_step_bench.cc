// Core AdvanceStep speed: the kernel alone (explicit mode) and a server-held
// step through the Engine (lock, table checks, derived tensors), for batch
// sizes 1 to 1024. Run: build/bench/advance_step_bench
#include <algorithm>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/advance_step.h"
#include "core/engine.h"

namespace kvstep {
namespace {

Tensor Filled(DType dtype, const Shape& shape, int64_t value) {
  Tensor t = *Tensor::Zeros(CpuDevice(), dtype, shape);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DType::kInt32) {
      t.data<int32_t>()[i] = static_cast<int32_t>(value);
    } else {
      t.data<int64_t>()[i] = value;
    }
  }
  return t;
}

void BM_KernelExplicit(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int64_t width = 512;  // 8k tokens of 16
  AdvanceStepArgs args;
  args.num_seqs = args.num_queries = n;
  args.block_size = 16;
  args.num_blocks = 1 << 20;
  args.sampled_token_ids = Filled(DType::kInt64, {n, 1}, 7);
  StepState s;
  s.input_tokens = Filled(DType::kInt64, {n}, 0);
  s.input_positions = Filled(DType::kInt64, {n}, 0);
  s.seq_lens = Filled(DType::kInt32, {n}, 100);
  s.slot_mapping = Filled(DType::kInt64, {n}, 0);
  s.block_tables = Filled(DType::kInt32, {n, width}, 3);
  for (auto _ : state) {
    // Keep positions in range: rewind every 4096 steps.
    if (s.seq_lens.data<int32_t>()[0] > 8000) {
      for (int64_t i = 0; i < n; ++i) s.seq_lens.data<int32_t>()[i] = 100;
    }
    benchmark::DoNotOptimize(AdvanceStep(args, &s, nullptr));
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_KernelExplicit)->RangeMultiplier(4)->Range(1, 1024);

// Arguments: rows, and tokens allocated to each row up front (a
// scheduler that allocates ahead; a step's cost must not grow with it).
void BM_EngineServerHeld(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int64_t tokens = state.range(1);
  EngineOptions o;
  o.cache.num_blocks = std::max<int64_t>(int64_t{1} << 16, n * tokens / 16);
  o.cache.block_size = 16;
  o.cache.num_layers = 1;
  o.cache.num_kv_heads = 1;
  o.cache.head_size = 8;
  auto engine = *Engine::Create(o);
  std::vector<SequenceRequest> req;
  BatchSpec spec;
  for (int64_t i = 0; i < n; ++i) {
    req.push_back({static_cast<SeqId>(i), tokens});
    BatchRowSpec row;
    row.seq_id = static_cast<SeqId>(i);
    row.token_ids = {1};
    spec.rows.push_back(row);
  }
  (void)engine->AllocateBlocks(req);
  AdvanceInput in;
  in.sampled_token_ids = Filled(DType::kInt64, {n, 1}, 5);
  BatchId id = engine->CreateBatch(spec, {}, false)->batch_id;
  int64_t steps = 0;
  for (auto _ : state) {
    if (++steps == 1000) {  // stay inside the allocated tokens
      state.PauseTiming();
      id = engine->CreateBatch(spec, std::vector<BatchId>{id}, false)->batch_id;
      steps = 0;
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(engine->AdvanceStep(id, in, false, false));
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_EngineServerHeld)
    ->ArgsProduct({{1, 4, 16, 64, 256, 1024}, {1024}})
    ->Args({64, 8192})
    ->Args({256, 8192});

}  // namespace
}  // namespace kvstep
