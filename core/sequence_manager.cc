#include "core/sequence_manager.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"

namespace kvstep {

SequenceManager::SequenceManager(BlockAllocator* allocator, int64_t block_size,
                                 int64_t max_seq_len, int64_t max_sequences)
    : allocator_(allocator),
      block_size_(block_size),
      max_seq_len_(max_seq_len),
      max_sequences_(max_sequences) {}

absl::Status SequenceManager::Allocate(
    absl::Span<const SequenceRequest> requests,
    std::vector<SequenceGrowth>* out) {
  absl::flat_hash_set<SeqId> seen;
  seen.reserve(requests.size());
  int64_t needed = 0;
  int64_t created = 0;
  std::vector<int64_t> per_seq(requests.size(), 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    const SequenceRequest& r = requests[i];
    if (!seen.insert(r.seq_id).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sequences[%d]: seq %d appears more than once", i, r.seq_id));
    }
    if (r.num_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sequences[%d] (seq %d): num_tokens %d is negative",
                          i, r.seq_id, r.num_tokens));
    }
    if (r.num_tokens > max_seq_len_) {
      return absl::OutOfRangeError(absl::StrFormat(
          "sequences[%d] (seq %d): num_tokens %d exceeds max_seq_len %d", i,
          r.seq_id, r.num_tokens, max_seq_len_));
    }
    auto it = seqs_.find(r.seq_id);
    const int64_t have =
        it == seqs_.end() ? 0 : static_cast<int64_t>(it->second.blocks.size());
    if (it == seqs_.end()) ++created;
    per_seq[i] = std::max<int64_t>(0, BlocksFor(r.num_tokens) - have);
    needed += per_seq[i];
  }
  if (size() + created > max_sequences_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%d new sequences would exceed max_sequences %d (%d live)", created,
        max_sequences_, size()));
  }
  std::vector<BlockId> blocks;
  blocks.reserve(static_cast<size_t>(needed));
  if (absl::Status s = allocator_->Allocate(needed, &blocks); !s.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("AllocateBlocks: %s", s.message()));
  }
  out->reserve(out->size() + requests.size());
  size_t next = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    SequenceGrowth g;
    g.seq_id = requests[i].seq_id;
    auto [it, inserted] = seqs_.try_emplace(g.seq_id);
    g.created = inserted;
    for (int64_t j = 0; j < per_seq[i]; ++j) {
      it->second.blocks.push_back(blocks[next]);
      g.new_blocks.push_back(blocks[next]);
      ++next;
    }
    out->push_back(std::move(g));
  }
  return absl::OkStatus();
}

bool SequenceManager::Free(SeqId id, int64_t* blocks_freed,
                           std::vector<BatchId>* batches) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  // Release cannot fail for a table this manager built; a failure would be
  // a bookkeeping bug, and keeping the blocks is the safe side of it.
  if (allocator_->Release(it->second.blocks).ok()) {
    *blocks_freed += static_cast<int64_t>(it->second.blocks.size());
  }
  batches->insert(batches->end(), it->second.batches.begin(),
                  it->second.batches.end());
  seqs_.erase(it);
  return true;
}

Sequence* SequenceManager::Find(SeqId id) {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

}  // namespace kvstep
