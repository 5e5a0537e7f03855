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
// cached ones. Which free blocks it takes is a documented choice
// (BlockOrder): a stack, whose freed blocks are reused last-in first-out
// because a block freed a moment ago is still warm in the CPU cache
// (kDescending, kAscending: its initial order), or runs of consecutive
// ids for each sequence (kRuns), which the attention kernel reads faster.
// Changes to the set of cached hashes are reported as KvEvents to the
// sink.
//
// Not thread-safe: the Engine serializes use.
#ifndef KVSTEP_CORE_BLOCK_ALLOCATOR_H_
#define KVSTEP_CORE_BLOCK_ALLOCATOR_H_

#include <algorithm>
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
  // No stack: each allocation continues its sequence's run (the blocks
  // after `after`, while free) and takes the rest from a cursor that moves
  // on through the pool in ascending ids: at the first place with room for
  // it (up to 16 blocks) free in a row, else at the next free block,
  // leaving free blocks after each new run for its sequence to grow into
  // (about as many as its table holds; BlockAllocator::RunGap). Freed
  // blocks wait for the cursor to come round. Under churn (sequences
  // arriving, growing a token at a time, finishing) a LIFO stack hands out
  // tables as random as any: 0-3% of consecutive entries adjacent, where
  // runs keep 98-100% with a third or more of the pool free and 90-95%
  // with a quarter to a tenth free (tests/block_allocator_test.cc,
  // bench/block_order_sim; docs/attention.md, sessions 30 and 31).
  // Consecutive blocks take the attention kernel 0.89-0.95x the time of
  // random ones (same place).
  kRuns,
};

absl::string_view BlockOrderName(BlockOrder order);

class BlockAllocator {
 public:
  static constexpr BlockId kNone = -1;

  // REQUIRES: 0 < num_blocks <= INT32_MAX. `sink` (may be empty) receives
  // the cache events.
  BlockAllocator(int64_t num_blocks, BlockOrder order,
                 std::function<void(KvEvent)> sink = nullptr);

  int64_t num_blocks() const {
    return static_cast<int64_t>(ref_counts_.size());
  }
  BlockOrder order() const { return order_; }
  // On the free list.
  int64_t num_free() const {
    return order_ == BlockOrder::kRuns ? num_free_runs_
                                       : static_cast<int64_t>(free_.size());
  }
  // Cached and unreferenced: reusable by a prefix hit, or evictable.
  int64_t num_evictable() const { return num_evictable_; }
  // What an allocation can take: free + evictable.
  int64_t num_available() const { return num_free() + num_evictable_; }
  // Blocks with a registered hash (owned or not).
  int64_t num_cached() const { return static_cast<int64_t>(by_hash_.size()); }

  // Appends `n` newly owned blocks (reference count 1, no hash) to `out`,
  // evicting cached blocks when the free list runs short; or, when fewer
  // than `n` are available, takes nothing and returns RESOURCE_EXHAUSTED
  // saying how many were missing. `after`: the block the new ones follow
  // in their sequence's table (kNone: none), which kRuns continues from;
  // `table_blocks`: the length of that table with the new blocks in, which
  // sizes the gap kRuns leaves after a new run (RunGap); the stack orders
  // ignore both. FAILED_PRECONDITION (and nothing taken) for n > 0 while a
  // pinned block is unowned (Pin).
  absl::Status Allocate(int64_t n, std::vector<BlockId>* out,
                        BlockId after = kNone, int64_t table_blocks = 0);

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

  // kRuns: where new runs start and what they leave to grow into.
  //
  // A new run starts at the first place after the cursor with room for
  // the rest of its allocation, up to kRunExtent blocks, free in a row;
  // only where the search finds none within kExtentSearchWords words of
  // the free bitmap (65,536 blocks; about 1 us when every other block is
  // free, block_manager_bench's BM_ScatteredPool) at the next free block.
  // Next-fit alone splits a prompt over every hole the cursor passes as
  // the pool fills.
  //
  // The cursor then moves on past the run's end and RunGap ids more,
  // free or not, which the run's sequence can grow into before the cursor
  // comes round: as many as the sequence's table then holds (a table
  // growing a block at a time starts a new run each time it doubles, as a
  // vector reallocates), at least kRunGap, at most kMaxRunGap.
  //
  // Session 30 took the rest next-fit and skipped the next 2 free blocks,
  // wherever they were. In simulations (bench/block_order_sim; at bbdb196
  // for the two steps before these rules; docs/attention.md, session 31;
  // live tables' share of consecutive entries), with prompts of 256-3072
  // tokens and 32-1024 more decoded, session 30's rules kept 95-96% of
  // entries consecutive with 59-67% of the pool free, 92% with a third
  // free and 67% at a tenth free; with 512-4096 decoded after prompts of
  // 64-512, 73% with two thirds free and 57% at a quarter free; for rows
  // of 2k-16k tokens 78-88%. These rules: 100%, 99%, 90%; 98%, 95%; 99%.
  // (A gap as long as the table alone: 98-100%, 98%, 67%; 98%, 83%. With
  // the search for room for 4 blocks: 85%, 87% in the two fullest pools;
  // 8: 90%, 89%; 16: 91%, 90%; 32: 88%, 89%; the whole allocation: 73%,
  // 89%. Then a gap of the next ids rather than the next free blocks:
  // 91%, 95%.)
  static constexpr int64_t kRunExtent = 16;
  static constexpr int64_t kExtentSearchWords = 1024;
  static constexpr int64_t kRunGap = 2;
  static constexpr int64_t kMaxRunGap = 32;
  static int64_t RunGap(int64_t table_blocks) {
    return std::clamp(table_blocks, kRunGap, kMaxRunGap);
  }

  // Pins: the blocks an attention call in flight reads outside the
  // Engine's lock (Engine::PagedAttention), counted per block, repeats
  // and all. A pin changes neither a block's state nor the free list's
  // order: a pinned block may still be released, and then becomes free or
  // cached as any other. What it holds back is its reuse. While any pinned
  // block is unowned (released since it was pinned, or free or cached
  // when pinned: the explicit mode's tables may name any block), Allocate
  // takes nothing and returns FAILED_PRECONDITION, and the Engine waits
  // for the pins to go before it allocates. Waiting rather than skipping
  // the pinned blocks keeps which blocks an allocation gets independent of
  // when attention calls run, so that sidecars fed the same calls keep the
  // same tables (tensor-parallel fan-out).
  // REQUIRES: every id valid (Pin), pinned (Unpin).
  void Pin(absl::Span<const BlockId> ids);
  void Unpin(absl::Span<const BlockId> ids);
  int32_t PinCount(BlockId id) const { return pins_[id]; }
  // Pinned blocks with no reference: while there are any, Allocate refuses.
  int64_t num_pinned_unowned() const { return num_pinned_unowned_; }

  int32_t RefCount(BlockId id) const { return ref_counts_[id]; }
  // Every block's RefCount, indexed by id; valid until the next call that
  // changes a count.
  absl::Span<const int32_t> ref_counts() const { return ref_counts_; }
  bool IsValid(int64_t id) const { return id >= 0 && id < num_blocks(); }
  bool IsOnFreeList(BlockId id) const;

 private:
  void PushFree(BlockId id);
  // kRuns: whether `id` is on the free list, and taking it off.
  bool RunsFree(BlockId id) const {
    return (free_bits_[static_cast<size_t>(id) / 64] >> (id % 64) & 1) != 0;
  }
  void TakeRunsFree(BlockId id);
  // kRuns: the first free block at or after `from`, wrapping round; kNone
  // if none is free.
  BlockId NextRunsFree(int64_t from) const;
  // kRuns: the first id at or after `from` (going round to the pool's start,
  // over at most kExtentSearchWords words of the bitmap) that starts `len`
  // free ids in a row, 2 <= len <= 64; kNone if none.
  BlockId FindRunsExtent(int64_t from, int64_t len) const;
  void LruRemove(BlockId id);
  void LruPushBack(BlockId id);  // most recently used end
  void Unregister(BlockId id, bool emit);

  const BlockOrder order_;
  const std::function<void(KvEvent)> sink_;
  std::vector<BlockId> free_;  // top of the stack is back(); not kRuns
  // kRuns: the free list as one bit per block, its count, and where the
  // next-fit search starts.
  std::vector<uint64_t> free_bits_;
  int64_t num_free_runs_ = 0;
  int64_t cursor_ = 0;
  std::vector<int32_t> ref_counts_;
  std::vector<int32_t> pins_;  // Pin
  int64_t num_pinned_unowned_ = 0;
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
