// BlockAllocator: which KV-cache blocks are free, and who holds the rest.
//
// Only block ids (0 .. num_blocks-1) and reference counts live here; the
// bytes are in KvCache. Allocation is all-or-nothing. The free list is a
// stack: freed blocks are reused last-in first-out, because a block freed a
// moment ago is still warm in the CPU cache. Its initial order is a
// documented choice (BlockOrder). Not thread-safe: the Engine serializes use.
#ifndef KVSTEP_CORE_BLOCK_ALLOCATOR_H_
#define KVSTEP_CORE_BLOCK_ALLOCATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvstep {

using BlockId = int32_t;

enum class BlockOrder {
  // vLLM v0's first block manager: the first allocation gets the highest id
  // (seed 003's block tables start 999, 998, ... in a 1000-block pool).
  kDescending,
  // Later vLLM block managers: the first allocation gets block 0.
  kAscending,
};

absl::string_view BlockOrderName(BlockOrder order);

class BlockAllocator {
 public:
  // REQUIRES: 0 < num_blocks <= INT32_MAX.
  BlockAllocator(int64_t num_blocks, BlockOrder order);

  int64_t num_blocks() const {
    return static_cast<int64_t>(ref_counts_.size());
  }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  BlockOrder order() const { return order_; }

  // Appends `n` newly owned blocks (reference count 1) to `out`, or, when
  // fewer than `n` are free, takes nothing and returns RESOURCE_EXHAUSTED
  // saying how many were missing.
  absl::Status Allocate(int64_t n, std::vector<BlockId>* out);

  // Drops one reference to each block; a block whose count reaches zero goes
  // back on the free list. Blocks are pushed in reverse order, so that
  // freeing a table and allocating the same number again yields the same
  // table. INTERNAL (and no change) if any id is not allocated.
  absl::Status Release(absl::Span<const BlockId> ids);

  int32_t RefCount(BlockId id) const { return ref_counts_[id]; }
  bool IsValid(int64_t id) const { return id >= 0 && id < num_blocks(); }

 private:
  const BlockOrder order_;
  std::vector<BlockId> free_;  // top of the stack is back()
  std::vector<int32_t> ref_counts_;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_BLOCK_ALLOCATOR_H_
