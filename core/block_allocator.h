// BlockAllocator: the state of every KV-cache block of one pool (tier).
//
// Each block is exactly one of:
//   * free: on the free list, holding nothing anyone may read;
//   * cached: unreferenced, but its content is registered under a block
//     hash (prefix caching), kept reusable until evicted least recently
//     used first;
//   * owned: reference count >= 1 (shared by forks and prefix hits), with
//     or without a registered hash.
// Allocation is all-or-nothing and takes free blocks first, then evicts
// cached ones. The free list is a stack: freed blocks are reused last-in
// first-out, because a block freed a moment ago is still warm in the CPU
// cache; its initial order is a documented choice (BlockOrder). Changes to
// the set of cached hashes are reported as KvEvents to the sink.
//
// Not thread-safe: the Engine serializes use.
#ifndef KVSTEP_CORE_BLOCK_ALLOCATOR_H_
#define KVSTEP_CORE_BLOCK_ALLOCATOR_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/block_hash.h"
#include "core/kv_events.h"

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
  // REQUIRES: 0 < num_blocks <= INT32_MAX. `sink` (may be empty) receives
  // the cache events.
  BlockAllocator(int64_t num_blocks, BlockOrder order,
                 std::function<void(KvEvent)> sink = nullptr);

  int64_t num_blocks() const {
    return static_cast<int64_t>(ref_counts_.size());
  }
  BlockOrder order() const { return order_; }
  // On the free list.
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  // Cached and unreferenced: reusable by a prefix hit, or evictable.
  int64_t num_evictable() const { return num_evictable_; }
  // What an allocation can take: free + evictable.
  int64_t num_available() const { return num_free() + num_evictable_; }
  // Blocks with a registered hash (owned or not).
  int64_t num_cached() const { return static_cast<int64_t>(by_hash_.size()); }

  // Appends `n` newly owned blocks (reference count 1, no hash) to `out`,
  // evicting cached blocks when the free list runs short; or, when fewer
  // than `n` are available, takes nothing and returns RESOURCE_EXHAUSTED
  // saying how many were missing.
  absl::Status Allocate(int64_t n, std::vector<BlockId>* out);

  // Drops one reference to each block. A block whose count reaches zero
  // becomes cached (if it has a hash) or free. Blocks are processed in
  // reverse order, so that freeing a table and allocating the same number
  // again yields the same table, and a sequence's first blocks, the most
  // shareable, are evicted last. INTERNAL (and no change) if any id is not
  // owned.
  absl::Status Release(absl::Span<const BlockId> ids);

  // Takes one more reference to an owned or cached block.
  // REQUIRES: the block is owned or cached.
  void Acquire(BlockId id);

  // The block registered under `hash`, owned or cached.
  std::optional<BlockId> Lookup(const BlockHash& hash) const;
  // Registers an owned, full block's content under `hash` (emitting a
  // BlockStored event). A no-op returning false when the hash is already
  // registered (to this or another block: content is kept once) or the
  // block already has a hash. REQUIRES: the block is owned.
  bool Register(BlockId id, const BlockHash& hash,
                const std::optional<BlockHash>& parent,
                absl::Span<const int64_t> token_ids, absl::string_view extra);
  std::optional<BlockHash> HashOf(BlockId id) const;
  // Drops the block's registration, if any (emitting BlockRemoved): its
  // content is about to change. A cached, unreferenced block becomes free.
  void Forget(BlockId id);

  // Forgets every hash: cached blocks become free, owned blocks keep their
  // content but can no longer be hit. Emits AllBlocksCleared.
  void ResetPrefixCache();

  int32_t RefCount(BlockId id) const { return ref_counts_[id]; }
  bool IsValid(int64_t id) const { return id >= 0 && id < num_blocks(); }
  bool IsOnFreeList(BlockId id) const;

 private:
  static constexpr BlockId kNone = -1;
  void LruRemove(BlockId id);
  void LruPushBack(BlockId id);  // most recently used end
  void Unregister(BlockId id, bool emit);

  const BlockOrder order_;
  const std::function<void(KvEvent)> sink_;
  std::vector<BlockId> free_;  // top of the stack is back()
  std::vector<int32_t> ref_counts_;
  // Prefix cache: hash <-> block, and an intrusive LRU list of the cached,
  // unreferenced blocks (front: least recently used).
  absl::flat_hash_map<BlockHash, BlockId> by_hash_;
  std::vector<std::optional<BlockHash>> hash_of_;
  std::vector<BlockId> lru_prev_, lru_next_;
  std::vector<bool> in_lru_;
  BlockId lru_head_ = kNone, lru_tail_ = kNone;
  int64_t num_evictable_ = 0;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_BLOCK_ALLOCATOR_H_
