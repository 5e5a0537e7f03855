// ReshapeAndCache (the step's K/V into the paged cache) by its row stores
// against the per-element loop they replaced (internal::
// ReshapeAndCacheReference), in the same run:
//
//   build/bench/reshape_and_cache_bench [--benchmark_filter=...]
//
// Arguments: tokens, then 0 for a decode step's slots (each token in a
// random block, as a batch's rows) or 1 for a prefill's (consecutive).
// Geometry as the goal's grid: 8 KV heads of 128, block 16, vLLM layout,
// a pool of 4096 blocks (the step's blocks stay in L2/L3 between
// iterations, as the kernel then reads them).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/attention.h"
#include "core/device.h"
#include "core/kv_cache.h"
#include "core/tensor.h"

namespace kvstep {
namespace {

constexpr int64_t kKv = 8, kD = 128, kBs = 16, kBlocks = 4096;

template <bool kReference>
void BM_ReshapeAndCache(benchmark::State& state, DType act, DType cache_dtype,
                        CacheLayout layout) {
  const int64_t tokens = state.range(0);
  const bool prefill = state.range(1) != 0;
  CacheConfig c;
  c.num_blocks = kBlocks;
  c.block_size = kBs;
  c.num_layers = 1;
  c.num_kv_heads = kKv;
  c.head_size = kD;
  c.dtype = cache_dtype;
  c.layout = layout;
  std::unique_ptr<KvCache> cache = *KvCache::Create(c, CpuDevice());
  std::mt19937_64 rng(1);
  std::vector<int64_t> blocks(kBlocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  // Decode: token t in random block t, at offset t % 16; prefill: the
  // table's consecutive slots.
  std::vector<int64_t> slots;
  for (int64_t t = 0; t < tokens; ++t) {
    slots.push_back(prefill ? blocks[t / kBs] * kBs + t % kBs
                            : blocks[t % kBlocks] * kBs + t % kBs);
  }
  Tensor key = *Tensor::Zeros(CpuDevice(), act, {tokens, kKv, kD});
  Tensor value = *Tensor::Zeros(CpuDevice(), act, {tokens, kKv, kD});
  std::uniform_int_distribution<int> byte(0, 0x3b);  // finite in every dtype
  for (Tensor* t : {&key, &value}) {
    auto* p = static_cast<uint8_t*>(t->raw_data());
    for (size_t i = 0; i < t->nbytes(); ++i) {
      p[i] = static_cast<uint8_t>(byte(rng));
    }
  }
  for (auto _ : state) {
    const absl::Status s =
        kReference ? internal::ReshapeAndCacheReference(*cache, 0, key, value,
                                                        slots, 1.0f, 1.0f)
                   : ReshapeAndCache(*cache, 0, key, value, slots, 1.0f, 1.0f);
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      break;
    }
  }
  state.SetBytesProcessed(state.iterations() * 2 * key.nbytes());
}

// Each case by row stores and by the reference loop, side by side.
const bool kRegistered = [] {
  struct Case {
    const char* name;
    DType act, cache;
    CacheLayout layout;
  };
  for (const Case& c : {
           Case{"fp16_to_fp16_vllm", DType::kFloat16, DType::kFloat16,
                CacheLayout::kVllm},
           Case{"fp32_to_fp16_vllm", DType::kFloat32, DType::kFloat16,
                CacheLayout::kVllm},
           Case{"bf16_to_bf16_vllm", DType::kBFloat16, DType::kBFloat16,
                CacheLayout::kVllm},
           Case{"fp32_to_fp32_vllm", DType::kFloat32, DType::kFloat32,
                CacheLayout::kVllm},
           Case{"bf16_to_fp8_vllm", DType::kBFloat16, DType::kFp8E4M3,
                CacheLayout::kVllm},
           Case{"fp16_to_fp16_nhd", DType::kFloat16, DType::kFloat16,
                CacheLayout::kNhd},
       }) {
    for (bool reference : {false, true}) {
      benchmark::RegisterBenchmark(
          (std::string("BM_ReshapeAndCache/") + c.name +
           (reference ? "/reference" : "/rows"))
              .c_str(),
          [c, reference](benchmark::State& state) {
            if (reference) {
              BM_ReshapeAndCache<true>(state, c.act, c.cache, c.layout);
            } else {
              BM_ReshapeAndCache<false>(state, c.act, c.cache, c.layout);
            }
          })
          ->Args({64, 0})
          ->Args({256, 0})
          ->Args({975, 1});
    }
  }
  return true;
}();

}  // namespace
}  // namespace kvstep
