#include "core/sequence_manager.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"

namespace kvstep {

namespace {
constexpr size_t kMaxExtraKey = 1024;
}  // namespace

// What an Allocate would do, computed without changing anything.
struct SequenceManager::Plan {
  struct Item {
    bool create = false;
    std::vector<BlockId> hits;  // new sequence: reused cached blocks
    std::vector<BlockHash> hit_hashes;
    std::vector<int64_t> cow_index;  // existing: table entries to copy
    int64_t grow = 0;                // new blocks appended
  };
  std::vector<Item> items;
  int64_t needed = 0;  // fresh blocks to take from the pool
  int64_t created = 0;
  int64_t hit_evictable = 0;  // distinct hits now evictable (leave the pool)
};

SequenceManager::SequenceManager(BlockAllocator* device, BlockAllocator* host,
                                 int64_t block_size, int64_t max_seq_len,
                                 int64_t max_sequences)
    : device_(device),
      host_(host),
      block_size_(block_size),
      max_seq_len_(max_seq_len),
      max_sequences_(max_sequences) {}

absl::Status SequenceManager::MakePlan(
    absl::Span<const SequenceRequest> requests, Plan* plan) const {
  absl::flat_hash_set<SeqId> seen;
  absl::flat_hash_set<BlockId> evictable_hits;
  // Copy-on-write decrements planned so far, so that a parent and its child
  // in one request copy their shared block once, not twice.
  absl::flat_hash_map<BlockId, int32_t> planned_release;
  plan->items.resize(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const SequenceRequest& r = requests[i];
    Plan::Item& item = plan->items[i];
    // Small requests (the per-step common case) check duplicates by a scan
    // rather than paying for a hash set.
    const bool repeated =
        requests.size() <= 16
            ? std::any_of(requests.begin(), requests.begin() + i,
                          [&](const SequenceRequest& o) {
                            return o.seq_id == r.seq_id;
                          })
            : !seen.insert(r.seq_id).second;
    if (repeated) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sequences[%d]: seq %d appears more than once", i, r.seq_id));
    }
    if (r.num_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sequences[%d] (seq %d): num_tokens %d is negative",
                          i, r.seq_id, r.num_tokens));
    }
    if (r.num_tokens > max_seq_len_ ||
        static_cast<int64_t>(r.prompt_token_ids.size()) > max_seq_len_) {
      return absl::OutOfRangeError(absl::StrFormat(
          "sequences[%d] (seq %d): %d tokens exceed max_seq_len %d", i,
          r.seq_id, std::max<int64_t>(r.num_tokens, r.prompt_token_ids.size()),
          max_seq_len_));
    }
    if (r.extra_key.size() > kMaxExtraKey) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sequences[%d] (seq %d): the adapter id and cache salt exceed %d "
          "bytes",
          i, r.seq_id, kMaxExtraKey));
    }
    for (size_t j = 0; j < r.prompt_token_ids.size(); ++j) {
      if (r.prompt_token_ids[j] < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "sequences[%d] (seq %d): prompt_token_ids[%d] = %d is negative", i,
            r.seq_id, j, r.prompt_token_ids[j]));
      }
    }
    auto it = seqs_.find(r.seq_id);
    const int64_t want_blocks = BlocksFor(r.num_tokens);
    if (it != seqs_.end()) {
      const Sequence& s = it->second;
      if (s.swapped) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "sequences[%d]: seq %d is swapped out: SwapIn first", i, r.seq_id));
      }
      const bool prompt_ok =
          r.prompt_token_ids.empty() ||
          (r.prompt_token_ids.size() <= s.tokens.size() &&
           std::equal(r.prompt_token_ids.begin(), r.prompt_token_ids.end(),
                      s.tokens.begin()));
      if (!prompt_ok || (!r.extra_key.empty() && r.extra_key != s.extra_key)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "sequences[%d]: seq %d exists with other prompt tokens or extra "
            "keys (they are only taken when a sequence is created)",
            i, r.seq_id));
      }
      const int64_t have = static_cast<int64_t>(s.blocks.size());
      // The write range [num_tokens, requested): shared blocks there are
      // copied before anything writes into them.
      const int64_t first = s.num_tokens / block_size_;
      const int64_t last = std::min(have, want_blocks);
      for (int64_t c = first; c < last; ++c) {
        const BlockId b = s.blocks[c];
        if (device_->RefCount(b) <= 1) continue;  // the common case
        int32_t& released = planned_release[b];
        if (device_->RefCount(b) - released > 1) {
          item.cow_index.push_back(c);
          ++released;
        }
      }
      item.grow = std::max<int64_t>(0, want_blocks - have);
      plan->needed += item.grow + static_cast<int64_t>(item.cow_index.size());
      continue;
    }
    item.create = true;
    ++plan->created;
    // Prefix hits: the longest chain of cached full blocks, leaving the last
    // prompt token to be recomputed.
    const int64_t p = static_cast<int64_t>(r.prompt_token_ids.size());
    const int64_t max_hits = p > 0 ? (p - 1) / block_size_ : 0;
    std::optional<BlockHash> parent;
    for (int64_t c = 0; c < max_hits; ++c) {
      const BlockHash h = HashBlock(parent,
                                    absl::MakeConstSpan(r.prompt_token_ids)
                                        .subspan(c * block_size_, block_size_),
                                    r.extra_key);
      std::optional<BlockId> b = device_->Lookup(h);
      if (!b) break;
      item.hits.push_back(*b);
      item.hit_hashes.push_back(h);
      if (device_->RefCount(*b) == 0) evictable_hits.insert(*b);
      parent = h;
    }
    item.grow = std::max<int64_t>(
        0, want_blocks - static_cast<int64_t>(item.hits.size()));
    plan->needed += item.grow;
  }
  plan->hit_evictable = static_cast<int64_t>(evictable_hits.size());
  return absl::OkStatus();
}

absl::Status SequenceManager::BlocksNeeded(
    absl::Span<const SequenceRequest> requests, int64_t* needed, bool* never,
    int64_t* fresh) const {
  Plan plan;
  if (absl::Status s = MakePlan(requests, &plan); !s.ok()) return s;
  *needed = plan.needed + plan.hit_evictable;
  if (fresh != nullptr) *fresh = plan.needed;
  // A request that needs more than the whole pool can never be served.
  *never = plan.needed > device_->num_blocks();
  return absl::OkStatus();
}

absl::Status SequenceManager::Allocate(
    absl::Span<const SequenceRequest> requests,
    std::vector<SequenceGrowth>* out) {
  Plan plan;
  if (absl::Status s = MakePlan(requests, &plan); !s.ok()) return s;
  if (size() + plan.created > max_sequences_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%d new sequences would exceed max_sequences %d (%d live)",
        plan.created, max_sequences_, size()));
  }
  const int64_t available = device_->num_available() - plan.hit_evictable;
  if (plan.needed > available) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "AllocateBlocks: need %d blocks, %d available: %d blocks missing",
        plan.needed, available, plan.needed - available));
  }
  // Commit. Hits are acquired first so that the allocation below cannot
  // evict them.
  for (const Plan::Item& item : plan.items) {
    for (BlockId b : item.hits) device_->Acquire(b);
  }
  std::vector<BlockId> fresh;
  out->reserve(out->size() + requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const SequenceRequest& r = requests[i];
    const Plan::Item& item = plan.items[i];
    SequenceGrowth g;
    g.seq_id = r.seq_id;
    g.created = item.create;
    Sequence& s = seqs_[r.seq_id];
    // Each sequence's fresh blocks (its copies, then its growth) in one
    // allocation that follows the last block staying in its table, so
    // that BlockOrder::kRuns continues its run; the stack orders hand out
    // what one allocation of the whole plan would, in the same order.
    const std::vector<BlockId>& kept = item.create ? item.hits : s.blocks;
    const size_t keep = item.cow_index.empty()
                            ? kept.size()
                            : static_cast<size_t>(item.cow_index.front());
    fresh.clear();
    if (absl::Status st = device_->Allocate(
            static_cast<int64_t>(item.cow_index.size()) + item.grow, &fresh,
            keep > 0 ? kept[keep - 1] : BlockAllocator::kNone,
            static_cast<int64_t>(kept.size()) + item.grow);
        !st.ok()) {
      return st;  // unreachable: availability was checked above
    }
    size_t next = 0;
    if (item.create) {
      s.blocks = item.hits;
      s.hashes = item.hit_hashes;
      s.tokens = r.prompt_token_ids;
      s.extra_key = r.extra_key;
      s.num_tokens = static_cast<int64_t>(item.hits.size()) * block_size_;
      s.prefix_hit_tokens = s.num_tokens;
      if (!r.prompt_token_ids.empty()) {
        prefix_query_tokens_ += static_cast<int64_t>(r.prompt_token_ids.size());
        prefix_hit_tokens_ += s.num_tokens;
      }
    }
    for (int64_t c : item.cow_index) {
      const BlockId dst = fresh[next++];
      g.copies.push_back({s.blocks[c], dst});
      (void)device_->Release({&s.blocks[c], 1});  // still owned by others
      s.blocks[c] = dst;
    }
    for (int64_t j = 0; j < item.grow; ++j) {
      s.blocks.push_back(fresh[next]);
      g.new_blocks.push_back(fresh[next]);
      ++next;
    }
    g.computed_tokens = s.prefix_hit_tokens;
    out->push_back(std::move(g));
  }
  return absl::OkStatus();
}

absl::Status SequenceManager::Fork(SeqId parent, SeqId child) {
  auto it = seqs_.find(parent);
  if (it == seqs_.end()) {
    return absl::NotFoundError(
        absl::StrFormat("parent seq %d does not exist", parent));
  }
  if (it->second.swapped) {
    return absl::FailedPreconditionError(
        absl::StrFormat("parent seq %d is swapped out", parent));
  }
  if (seqs_.contains(child)) {
    return absl::AlreadyExistsError(
        absl::StrFormat("child seq %d already exists", child));
  }
  if (size() >= max_sequences_) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("max_sequences %d reached", max_sequences_));
  }
  const Sequence& p = it->second;
  Sequence c;
  const int64_t shared = std::min<int64_t>(
      BlocksFor(p.num_tokens), static_cast<int64_t>(p.blocks.size()));
  c.blocks.assign(p.blocks.begin(), p.blocks.begin() + shared);
  for (BlockId b : c.blocks) device_->Acquire(b);
  c.num_tokens = p.num_tokens;
  c.tokens.assign(p.tokens.begin(),
                  p.tokens.begin() +
                      std::min<int64_t>(p.num_tokens,
                                        static_cast<int64_t>(p.tokens.size())));
  c.hashes = p.hashes;
  c.extra_key = p.extra_key;
  seqs_.emplace(child, std::move(c));
  return absl::OkStatus();
}

bool SequenceManager::Free(SeqId id, int64_t* blocks_freed,
                           std::vector<BatchId>* batches) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  BlockAllocator* tier = it->second.swapped ? host_ : device_;
  // Release cannot fail for a table this manager built; a failure would be
  // a bookkeeping bug, and keeping the blocks is the safe side of it.
  if (tier->Release(it->second.blocks).ok()) {
    *blocks_freed += static_cast<int64_t>(it->second.blocks.size());
  }
  batches->insert(batches->end(), it->second.batches.begin(),
                  it->second.batches.end());
  seqs_.erase(it);
  return true;
}

void SequenceManager::RegisterFullBlocks(Sequence* seq, int64_t upto) {
  const int64_t full = std::min<int64_t>(
      {upto, static_cast<int64_t>(seq->tokens.size()),
       static_cast<int64_t>(seq->blocks.size()) * block_size_});
  for (int64_t c = static_cast<int64_t>(seq->hashes.size());
       (c + 1) * block_size_ <= full; ++c) {
    const std::optional<BlockHash> parent =
        c == 0 ? std::nullopt : std::optional<BlockHash>(seq->hashes[c - 1]);
    const auto tokens =
        absl::MakeConstSpan(seq->tokens).subspan(c * block_size_, block_size_);
    const BlockHash h = HashBlock(parent, tokens, seq->extra_key);
    device_->Register(seq->blocks[c], h, parent, tokens, seq->extra_key);
    seq->hashes.push_back(h);
  }
}

void SequenceManager::RecordTokens(Sequence* seq, int64_t first,
                                   absl::Span<const int64_t> tokens,
                                   int64_t upto) {
  // Blocks from `first` on may be rewritten: their hashes no longer hold.
  const int64_t keep = first / block_size_;
  if (static_cast<int64_t>(seq->hashes.size()) > keep) {
    for (int64_t c = keep; c < static_cast<int64_t>(seq->hashes.size()) &&
                           c < static_cast<int64_t>(seq->blocks.size());
         ++c) {
      const BlockId b = seq->blocks[c];
      if (device_->RefCount(b) == 1 && device_->HashOf(b) == seq->hashes[c]) {
        device_->Forget(b);
      }
    }
    seq->hashes.resize(keep);
  }
  // tokens.size() >= num_tokens >= first always holds (every planned token
  // is recorded), so nothing unknown is padded in here.
  seq->tokens.resize(static_cast<size_t>(first));
  seq->tokens.insert(seq->tokens.end(), tokens.begin(), tokens.end());
  RegisterFullBlocks(seq, upto);
}

int64_t SequenceManager::FirstSharedBlock(const Sequence& seq, int64_t first,
                                          int64_t last) const {
  last = std::min(last, static_cast<int64_t>(seq.blocks.size()));
  for (int64_t c = std::max<int64_t>(first, 0); c < last; ++c) {
    if (device_->RefCount(seq.blocks[static_cast<size_t>(c)]) > 1) return c;
  }
  return -1;
}

absl::Status SequenceManager::Swap(absl::Span<const SeqId> ids, bool out,
                                   SwapResult* res) {
  if (host_ == nullptr) {
    return absl::FailedPreconditionError(
        "no host tier: start the server with --num_host_blocks");
  }
  BlockAllocator* from = out ? device_ : host_;
  BlockAllocator* to = out ? host_ : device_;
  absl::flat_hash_set<SeqId> seen;
  // Distinct source blocks: a block shared by sequences swapped together
  // is copied once.
  std::vector<BlockId> sources;
  absl::flat_hash_map<BlockId, size_t> index;
  for (size_t i = 0; i < ids.size(); ++i) {
    const Sequence* s = Find(ids[i]);
    if (s == nullptr) {
      return absl::NotFoundError(
          absl::StrFormat("seq_ids[%d]: seq %d does not exist", i, ids[i]));
    }
    if (!seen.insert(ids[i]).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "seq_ids[%d]: seq %d appears more than once", i, ids[i]));
    }
    if (s->swapped == out) {
      return absl::FailedPreconditionError(
          absl::StrFormat("seq_ids[%d]: seq %d is already %s", i, ids[i],
                          out ? "swapped out" : "on the device"));
    }
    for (BlockId b : s->blocks) {
      if (index.emplace(b, sources.size()).second) sources.push_back(b);
    }
  }
  const int64_t n = static_cast<int64_t>(sources.size());
  if (n > to->num_available()) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s: need %d blocks, %d available: %d blocks missing",
                        out ? "SwapOut (host tier)" : "SwapIn", n,
                        to->num_available(), n - to->num_available()));
  }
  std::vector<BlockId> dst;
  if (absl::Status s = to->Allocate(n, &dst); !s.ok()) return s;
  // A sequence outside this call that shares a source block keeps its own
  // reference to it; the swapped ones move to the new block, shared alike.
  std::vector<int32_t> extra_refs(static_cast<size_t>(n), 0);
  for (SeqId id : ids) {
    Sequence* s = Find(id);
    (void)from->Release(s->blocks);
    for (BlockId& b : s->blocks) {
      const size_t k = index.at(b);
      if (extra_refs[k]++ > 0) to->Acquire(dst[k]);
      b = dst[k];
    }
    s->swapped = out;
    if (!out) {
      // Back on the device: make the full blocks findable again.
      s->hashes.clear();
      RegisterFullBlocks(s, s->num_tokens);
    }
  }
  for (int64_t k = 0; k < n; ++k) res->copies.push_back({sources[k], dst[k]});
  return absl::OkStatus();
}

absl::Status SequenceManager::SwapOut(absl::Span<const SeqId> ids,
                                      SwapResult* out) {
  return Swap(ids, /*out=*/true, out);
}

absl::Status SequenceManager::SwapIn(absl::Span<const SeqId> ids,
                                     SwapResult* out) {
  return Swap(ids, /*out=*/false, out);
}

Sequence* SequenceManager::Find(SeqId id) {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

const Sequence* SequenceManager::Find(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

}  // namespace kvstep
