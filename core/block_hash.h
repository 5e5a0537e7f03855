// BlockHash: the identity of a full KV-cache block's content for prefix
// caching, chained over (parent block's hash, the block's token ids, extra
// keys such as the LoRA adapter and a cache salt).
//
// 128 bits from two independently seeded 64-bit mixing lanes, so accidental
// collisions (which would serve another prompt's KV) are negligible. The
// function is fixed and unseeded: the same tokens give the same hash in
// every process and across restarts, which KV-event consumers (routers)
// rely on. Thread-safe: pure functions.
#ifndef KVSTEP_CORE_BLOCK_HASH_H_
#define KVSTEP_CORE_BLOCK_HASH_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvstep {

struct BlockHash {
  uint64_t hi = 0;
  uint64_t lo = 0;

  friend bool operator==(const BlockHash& a, const BlockHash& b) {
    return a.hi == b.hi && a.lo == b.lo;
  }
  friend bool operator!=(const BlockHash& a, const BlockHash& b) {
    return !(a == b);
  }
  template <typename H>
  friend H AbslHashValue(H h, const BlockHash& b) {
    return H::combine(std::move(h), b.hi, b.lo);
  }
  // 32 hex digits.
  std::string ToHex() const;
};

// The hash of a block holding `tokens` after the block hashed `parent` (none
// for a sequence's first block), with `extra` mixed in.
BlockHash HashBlock(const std::optional<BlockHash>& parent,
                    absl::Span<const int64_t> tokens, absl::string_view extra);

}  // namespace kvstep

#endif  // KVSTEP_CORE_BLOCK_HASH_H_
