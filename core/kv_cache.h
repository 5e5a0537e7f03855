// KvCache: the bytes of the paged KV cache, one K and one V tensor per layer.
//
// Geometry is fixed at construction (CacheConfig). Block `b` of layer `l`
// holds block_size token slots of every KV head; the layout decides where a
// (slot, head, dim) element lives (SEMANTICS §6). The cache does not know who
// owns which block: that is BlockAllocator's job. Thread-safety: the tensors
// are shared; the Engine decides who may write them.
#ifndef KVSTEP_CORE_KV_CACHE_H_
#define KVSTEP_CORE_KV_CACHE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace kvstep {

enum class CacheLayout {
  // key [num_blocks, kv_heads, head_size/x, block_size, x], x = 16/elem size;
  // value [num_blocks, kv_heads, head_size, block_size].
  kVllm = 1,
  // key and value [num_blocks, block_size, kv_heads, head_size].
  kNhd = 2,
};

absl::string_view CacheLayoutName(CacheLayout layout);
// "vllm" or "nhd"; nullopt-like false return when unknown.
bool ParseCacheLayout(absl::string_view name, CacheLayout* out);

struct CacheConfig {
  int64_t num_blocks = 2048;
  int64_t block_size = 16;
  int64_t num_layers = 4;
  int64_t num_kv_heads = 8;
  int64_t head_size = 128;
  DType dtype = DType::kFloat16;
  CacheLayout layout = CacheLayout::kVllm;

  // The most layers Validate accepts.
  static constexpr int64_t kMaxLayers = 1024;

  // Checks the geometry: positive sizes, a float cache dtype, head_size
  // divisible by x for the vLLM layout, block ids fitting int32, and the
  // whole cache under `max_bytes`. INVALID_ARGUMENT naming the field.
  absl::Status Validate(int64_t max_bytes) const;

  // Elements of one block of one layer's K (or V).
  int64_t elements_per_block() const {
    return block_size * num_kv_heads * head_size;
  }
  int64_t bytes_per_block() const {
    return elements_per_block() * static_cast<int64_t>(DTypeSize(dtype));
  }
  // Both K and V of every layer.
  int64_t total_bytes() const {
    return bytes_per_block() * num_blocks * num_layers * 2;
  }
  // x of the vLLM key layout.
  int64_t vllm_x() const { return 16 / static_cast<int64_t>(DTypeSize(dtype)); }

  std::string DebugString() const;
};

class KvCache {
 public:
  // Allocates (and pre-touches) every layer's K and V on `device`.
  // INVALID_ARGUMENT where config.Validate finds the geometry wrong (the
  // size is the caller's to bound).
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(
      const CacheConfig& config, Device* device);

  const CacheConfig& config() const { return config_; }

  // Copies block `src_block` of `src` (K and V of every layer, whole-block
  // bytes) to block `dst_block` of `dst`. The two caches may be different
  // tiers; their geometry other than num_blocks must match.
  static void CopyBlock(const KvCache& src, int64_t src_block,
                        const KvCache& dst, int64_t dst_block);
  const Tensor& key(int64_t layer) const { return keys_[layer]; }
  const Tensor& value(int64_t layer) const { return values_[layer]; }

  // Whether a written slot of layer `layer`'s K or V may hold an Inf or
  // NaN. The flag starts clear (the cache is created zeroed; the bytes of
  // slots nobody wrote are never read as values), ReshapeAndCache sets it
  // when it stores one, CopyBlock carries it to the destination's layer,
  // and nothing clears it. It exists for speed: the AVX-512 kernels for
  // fp16 and fp8 caches read those bytes as floats of another bias, which
  // turns an Inf or NaN finite, and check every element they read only on
  // a layer whose flag is set (without the check, warm fp16 calls take
  // 0.89-0.94x the time, cold ones 0.99x; docs/attention.md). A writer that
  // stores into the tensors directly (a test, a future shared-memory writer)
  // must call NoteNonFinite for any layer it may have stored an Inf or NaN in,
  // or such a value may reach the output finite instead of as IEEE arithmetic
  // gives it.
  bool MayHoldNonFinite(int64_t layer) const {
    return nonfinite_[layer].load(std::memory_order_acquire);
  }
  // Sets the flag; true if this call set it (it was clear).
  bool NoteNonFinite(int64_t layer) const {
    return !nonfinite_[layer].exchange(true, std::memory_order_acq_rel);
  }

 private:
  KvCache(const CacheConfig& config, std::vector<Tensor> keys,
          std::vector<Tensor> values)
      : config_(config),
        keys_(std::move(keys)),
        values_(std::move(values)),
        nonfinite_(new std::atomic<bool>[config.num_layers]) {
    for (int64_t l = 0; l < config.num_layers; ++l) nonfinite_[l] = false;
  }

  const CacheConfig config_;
  std::vector<Tensor> keys_;
  std::vector<Tensor> values_;
  // Per layer (see MayHoldNonFinite). Mutable state behind a const cache,
  // like the tensors' bytes: the writers hold the cache by const reference.
  const std::unique_ptr<std::atomic<bool>[]> nonfinite_;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_KV_CACHE_H_
