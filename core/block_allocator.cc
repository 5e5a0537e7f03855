#include "core/block_allocator.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace kvstep {

absl::string_view BlockOrderName(BlockOrder order) {
  switch (order) {
    case BlockOrder::kDescending:
      return "descending";
    case BlockOrder::kAscending:
      return "ascending";
    case BlockOrder::kRuns:
      return "runs";
  }
  return "ascending";
}

BlockAllocator::BlockAllocator(int64_t num_blocks, BlockOrder order,
                               std::function<void(KvEvent)> sink)
    : order_(order),
      sink_(std::move(sink)),
      ref_counts_(static_cast<size_t>(num_blocks), 0),
      pins_(static_cast<size_t>(num_blocks), 0),
      hash_of_(static_cast<size_t>(num_blocks)),
      lru_prev_(static_cast<size_t>(num_blocks), kNone),
      lru_next_(static_cast<size_t>(num_blocks), kNone),
      in_lru_(static_cast<size_t>(num_blocks), false) {
  if (order == BlockOrder::kRuns) {
    free_bits_.assign(static_cast<size_t>((num_blocks + 63) / 64), 0);
    for (int64_t i = 0; i < num_blocks; ++i) PushFree(static_cast<BlockId>(i));
    return;
  }
  free_.reserve(static_cast<size_t>(num_blocks));
  // The stack pops from the back: push the first block to hand out last.
  for (int64_t i = 0; i < num_blocks; ++i) {
    free_.push_back(static_cast<BlockId>(
        order == BlockOrder::kDescending ? i : num_blocks - 1 - i));
  }
}

void BlockAllocator::PushFree(BlockId id) {
  if (order_ != BlockOrder::kRuns) {
    free_.push_back(id);
    return;
  }
  free_bits_[static_cast<size_t>(id) / 64] |= uint64_t{1} << (id % 64);
  ++num_free_runs_;
}

void BlockAllocator::TakeRunsFree(BlockId id) {
  free_bits_[static_cast<size_t>(id) / 64] &= ~(uint64_t{1} << (id % 64));
  --num_free_runs_;
}

BlockId BlockAllocator::NextRunsFree(int64_t from) const {
  if (num_free_runs_ == 0) return kNone;
  const int64_t words = static_cast<int64_t>(free_bits_.size());
  // The rest of from's word, the words after it, then round from the
  // start to from's word again (whole, which covers its lower bits).
  int64_t w = from / 64;
  uint64_t bits =
      free_bits_[static_cast<size_t>(w)] & (~uint64_t{0} << (from % 64));
  for (int64_t k = 0; k <= words; ++k) {
    if (bits != 0) {
      return static_cast<BlockId>(w * 64 + __builtin_ctzll(bits));
    }
    if (++w == words) w = 0;
    bits = free_bits_[static_cast<size_t>(w)];
  }
  return kNone;  // unreachable while num_free_runs_ > 0
}

BlockId BlockAllocator::FindRunsExtent(int64_t from, int64_t len) const {
  using U128 = unsigned __int128;
  const int64_t words = static_cast<int64_t>(free_bits_.size());
  int64_t w = from / 64;
  // Starts before `from` count only when the search comes round.
  uint64_t allowed = ~uint64_t{0} << (from % 64);
  const int64_t limit = std::min(words + 1, kExtentSearchWords);
  for (int64_t k = 0; k < limit; ++k, allowed = ~uint64_t{0}) {
    const uint64_t bits = free_bits_[static_cast<size_t>(w)];
    // An extent may reach into the next word, but not past the pool's end.
    const uint64_t next =
        w + 1 < words ? free_bits_[static_cast<size_t>(w + 1)] : 0;
    const int64_t here = w;
    if (++w == words) w = 0;
    // Most words of a fragmented pool hold no two free ids in a row.
    if ((bits & (bits >> 1 | next << 63) & allowed) == 0) continue;
    // Bit j of `m` comes to mean that ids here * 64 + j .. + have - 1 are
    // all free, `have` doubling each step; stop once no start is left.
    U128 m = U128{next} << 64 | bits;
    uint64_t starts = bits & allowed;
    for (int64_t have = 1; starts != 0 && have < len;) {
      const int64_t step = std::min(have, len - have);
      m &= m >> step;
      have += step;
      starts = static_cast<uint64_t>(m) & allowed;
    }
    if (starts != 0) {
      return static_cast<BlockId>(here * 64 + __builtin_ctzll(starts));
    }
  }
  return kNone;
}

void BlockAllocator::LruRemove(BlockId id) {
  const BlockId p = lru_prev_[id], n = lru_next_[id];
  (p == kNone ? lru_head_ : lru_next_[p]) = n;
  (n == kNone ? lru_tail_ : lru_prev_[n]) = p;
  lru_prev_[id] = lru_next_[id] = kNone;
  in_lru_[id] = false;
  --num_evictable_;
}

void BlockAllocator::LruPushBack(BlockId id) {
  lru_prev_[id] = lru_tail_;
  lru_next_[id] = kNone;
  (lru_tail_ == kNone ? lru_head_ : lru_next_[lru_tail_]) = id;
  lru_tail_ = id;
  in_lru_[id] = true;
  ++num_evictable_;
}

void BlockAllocator::Unregister(BlockId id, bool emit) {
  const BlockHash h = *hash_of_[id];
  by_hash_.erase(h);
  hash_of_[id].reset();
  if (emit && sink_) {
    KvEvent e;
    e.type = KvEvent::Type::kBlockRemoved;
    e.block_hashes = {h};
    sink_(std::move(e));
  }
}

absl::Status BlockAllocator::Allocate(int64_t n, std::vector<BlockId>* out,
                                      BlockId after, int64_t table_blocks) {
  if (n < 0) return absl::InvalidArgumentError("negative block count");
  if (n > 0 && num_pinned_unowned_ > 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%d released blocks are still read by an attention call in flight",
        num_pinned_unowned_));
  }
  if (n > num_available()) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("need %d blocks, %d available: %d blocks missing", n,
                        num_available(), n - num_available()));
  }
  const bool runs = order_ == BlockOrder::kRuns;
  // kRuns: the next block of the run (after + 1, ...), taken while free.
  BlockId want = runs && IsValid(after) ? after + 1 : kNone;
  bool fresh_run = false;  // took a block at the cursor
  bool no_room = false;    // a FindRunsExtent found none
  for (int64_t i = 0; i < n; ++i) {
    BlockId id;
    if (runs && num_free_runs_ > 0) {
      if (IsValid(want) && RunsFree(want)) {
        id = want;
      } else {
        // A new run starts where it can hold the rest of the allocation
        // (up to kRunExtent blocks) whole, if the search finds such a
        // place; else at the next free block. No search follows one that
        // found no room, so the worst case (room nowhere) scans
        // kExtentSearchWords words once a call, not once a block; one that
        // finds room gives the run kRunExtent blocks (or the rest), so a
        // call searches about n / kRunExtent times at most.
        const int64_t len = std::min(n - i, kRunExtent);
        id = kNone;
        if (!no_room && len >= 2 && len <= num_free_runs_) {
          id = FindRunsExtent(cursor_, len);
          no_room = id == kNone;
        }
        if (id == kNone) id = NextRunsFree(cursor_);
        cursor_ = (id + 1) % num_blocks();
        fresh_run = true;
      }
      TakeRunsFree(id);
      want = id + 1;
    } else if (!runs && !free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      id = lru_head_;  // evict the least recently used cached block
      LruRemove(id);
      Unregister(id, /*emit=*/true);
    }
    ref_counts_[id] = 1;
    out->push_back(id);
  }
  if (fresh_run) {
    // Past the run's end and RunGap ids more (not past the pool's end:
    // a run does not go round).
    cursor_ = std::min<int64_t>(out->back() + 1 + RunGap(table_blocks),
                                num_blocks()) %
              num_blocks();
  }
  return absl::OkStatus();
}

absl::Status BlockAllocator::Release(absl::Span<const BlockId> ids) {
  for (BlockId id : ids) {
    if (!IsValid(id) || ref_counts_[id] <= 0) {
      return absl::InternalError(
          absl::StrFormat("release of block %d, which is not owned", id));
    }
  }
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    const BlockId id = *it;
    if (--ref_counts_[id] > 0) continue;
    if (pins_[id] > 0) ++num_pinned_unowned_;
    if (hash_of_[id].has_value()) {
      LruPushBack(id);
    } else {
      PushFree(id);
    }
  }
  return absl::OkStatus();
}

void BlockAllocator::Acquire(BlockId id) {
  if (ref_counts_[id] == 0) {
    if (in_lru_[id]) LruRemove(id);
    if (pins_[id] > 0) --num_pinned_unowned_;
  }
  ++ref_counts_[id];
}

void BlockAllocator::Pin(absl::Span<const BlockId> ids) {
  for (BlockId id : ids) {
    if (pins_[id]++ == 0 && ref_counts_[id] == 0) ++num_pinned_unowned_;
  }
}

void BlockAllocator::Unpin(absl::Span<const BlockId> ids) {
  for (BlockId id : ids) {
    if (--pins_[id] == 0 && ref_counts_[id] == 0) --num_pinned_unowned_;
  }
}

std::optional<BlockId> BlockAllocator::Lookup(const BlockHash& hash) const {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return std::nullopt;
  return it->second;
}

std::optional<BlockHash> BlockAllocator::HashOf(BlockId id) const {
  return hash_of_[id];
}

bool BlockAllocator::Register(BlockId id, const BlockHash& hash,
                              const std::optional<BlockHash>& parent,
                              absl::Span<const int64_t> token_ids,
                              absl::string_view extra) {
  if (hash_of_[id].has_value() || by_hash_.contains(hash)) return false;
  by_hash_[hash] = id;
  hash_of_[id] = hash;
  if (sink_) {
    KvEvent e;
    e.type = KvEvent::Type::kBlockStored;
    e.block_hashes = {hash};
    e.parent_hash = parent;
    e.token_ids.assign(token_ids.begin(), token_ids.end());
    e.block_size = static_cast<int64_t>(token_ids.size());
    e.extra_key = std::string(extra);
    sink_(std::move(e));
  }
  return true;
}

void BlockAllocator::Forget(BlockId id) {
  if (!hash_of_[id].has_value()) return;
  Unregister(id, /*emit=*/true);
  if (in_lru_[id]) {
    LruRemove(id);
    PushFree(id);
  }
}

void BlockAllocator::ResetPrefixCache() {
  while (lru_head_ != kNone) {
    const BlockId id = lru_head_;
    LruRemove(id);
    PushFree(id);
  }
  for (auto& h : hash_of_) h.reset();
  by_hash_.clear();
  if (sink_) {
    KvEvent e;
    e.type = KvEvent::Type::kAllBlocksCleared;
    sink_(std::move(e));
  }
}

bool BlockAllocator::IsOnFreeList(BlockId id) const {
  return ref_counts_[id] == 0 && !in_lru_[id];
}

}  // namespace kvstep
