#include "core/kv_cache.h"

#include <limits>

#include "absl/strings/str_format.h"

namespace kvstep {

absl::string_view CacheLayoutName(CacheLayout layout) {
  return layout == CacheLayout::kVllm ? "vllm" : "nhd";
}

bool ParseCacheLayout(absl::string_view name, CacheLayout* out) {
  if (name == "vllm") {
    *out = CacheLayout::kVllm;
  } else if (name == "nhd" || name == "flash") {
    *out = CacheLayout::kNhd;
  } else {
    return false;
  }
  return true;
}

absl::Status CacheConfig::Validate(int64_t max_bytes) const {
  auto positive = [](int64_t v, const char* name, int64_t max) -> absl::Status {
    if (v <= 0 || v > max) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s must be in [1, %d], got %d", name, max, v));
    }
    return absl::OkStatus();
  };
  constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();
  if (auto s = positive(num_blocks, "num_blocks", kI32); !s.ok()) return s;
  if (auto s = positive(block_size, "block_size", 1024); !s.ok()) return s;
  if (auto s = positive(num_layers, "num_layers", kMaxLayers); !s.ok()) {
    return s;
  }
  if (auto s = positive(num_kv_heads, "num_kv_heads", 4096); !s.ok()) return s;
  if (auto s = positive(head_size, "head_size", 4096); !s.ok()) return s;
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 &&
      dtype != DType::kBFloat16 && dtype != DType::kFp8E4M3 &&
      dtype != DType::kFp8E5M2) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache_dtype must be float32, float16, bfloat16, fp8_e4m3 or "
        "fp8_e5m2, got %s",
        DTypeName(dtype)));
  }
  if (layout != CacheLayout::kVllm && layout != CacheLayout::kNhd) {
    return absl::InvalidArgumentError("cache_layout must be vllm or nhd");
  }
  if (layout == CacheLayout::kVllm && head_size % vllm_x() != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "head_size %d must be a multiple of x=%d for the vllm layout with %s",
        head_size, vllm_x(), DTypeName(dtype)));
  }
  // Slots are block * block_size + offset and must fit int64 comfortably;
  // the per-layer byte count must fit size_t. Bounded by max_bytes first.
  const double total = static_cast<double>(bytes_per_block()) *
                       static_cast<double>(num_blocks) * num_layers * 2;
  if (total > static_cast<double>(max_bytes)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the cache would take %.0f bytes, more than the limit of %d (%s)",
        total, max_bytes, DebugString()));
  }
  return absl::OkStatus();
}

std::string CacheConfig::DebugString() const {
  return absl::StrFormat(
      "num_blocks=%d block_size=%d num_layers=%d num_kv_heads=%d "
      "head_size=%d dtype=%s layout=%s",
      num_blocks, block_size, num_layers, num_kv_heads, head_size,
      DTypeName(dtype), CacheLayoutName(layout));
}

void KvCache::CopyBlock(const KvCache& src, int64_t src_block,
                        const KvCache& dst, int64_t dst_block) {
  // The block is the outermost dimension of both layouts: its bytes are
  // contiguous.
  const size_t n = static_cast<size_t>(src.config_.bytes_per_block());
  for (int64_t l = 0; l < src.config_.num_layers; ++l) {
    // Set before the copy, so that the flag never lags the bytes.
    if (src.MayHoldNonFinite(l)) (void)dst.NoteNonFinite(l);
    for (const auto* pair : {&src.keys_, &src.values_}) {
      const bool is_key = pair == &src.keys_;
      const Tensor& from = (*pair)[l];
      const Tensor& to = is_key ? dst.keys_[l] : dst.values_[l];
      const char* s = static_cast<const char*>(from.raw_data()) + src_block * n;
      char* d = static_cast<char*>(to.raw_data()) + dst_block * n;
      if (from.device() == to.device()) {
        from.device()->Copy(d, s, n);
      } else if (from.device()->host_accessible()) {
        to.device()->CopyFromHost(d, s, n);
      } else {
        from.device()->CopyToHost(d, s, n);
      }
    }
  }
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(
    const CacheConfig& config, Device* device) {
  // The geometry (not the size: callers bound that, the engine by its
  // limits), so that no caller gets a cache whose shape drops dims (a head
  // size not a multiple of the vLLM layout's x) for writers to overrun.
  if (absl::Status s = config.Validate(std::numeric_limits<int64_t>::max());
      !s.ok()) {
    return s;
  }
  Shape key_shape, value_shape;
  if (config.layout == CacheLayout::kVllm) {
    const int64_t x = config.vllm_x();
    key_shape = {config.num_blocks, config.num_kv_heads, config.head_size / x,
                 config.block_size, x};
    value_shape = {config.num_blocks, config.num_kv_heads, config.head_size,
                   config.block_size};
  } else {
    key_shape = {config.num_blocks, config.block_size, config.num_kv_heads,
                 config.head_size};
    value_shape = key_shape;
  }
  std::vector<Tensor> keys, values;
  for (int64_t l = 0; l < config.num_layers; ++l) {
    absl::StatusOr<Tensor> k = Tensor::Zeros(device, config.dtype, key_shape);
    if (!k.ok()) return k.status();
    absl::StatusOr<Tensor> v = Tensor::Zeros(device, config.dtype, value_shape);
    if (!v.ok()) return v.status();
    keys.push_back(*std::move(k));
    values.push_back(*std::move(v));
  }
  return std::unique_ptr<KvCache>(
      new KvCache(config, std::move(keys), std::move(values)));
}

}  // namespace kvstep
