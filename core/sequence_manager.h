// SequenceManager: sequence id -> block table and computed-token count.
//
// A sequence is created by its first allocation and lives until freed. Its
// block table only grows here (a request for fewer tokens than it holds is a
// no-op, which makes AllocateBlocks safe to retry). Allocation over several
// sequences is all-or-nothing. Not thread-safe: the Engine serializes use.
#ifndef KVSTEP_CORE_SEQUENCE_MANAGER_H_
#define KVSTEP_CORE_SEQUENCE_MANAGER_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/block_allocator.h"

namespace kvstep {

using SeqId = uint64_t;
using BatchId = uint64_t;

struct Sequence {
  std::vector<BlockId> blocks;  // the block table
  // seq_len of the latest step planned for the sequence (CreateBatch or
  // AdvanceStep): the tokens whose K/V are in, or are being written to, the
  // cache. A batch row may claim at most this many cached tokens.
  int64_t num_tokens = 0;
  // Live batches with a row on this sequence (each at most once).
  absl::InlinedVector<BatchId, 2> batches;
};

struct SequenceRequest {
  SeqId seq_id = 0;
  int64_t num_tokens = 0;  // context + new tokens + look-ahead
};

struct SequenceGrowth {
  SeqId seq_id = 0;
  std::vector<BlockId> new_blocks;
  bool created = false;
};

class SequenceManager {
 public:
  // REQUIRES: block_size > 0; allocator outlives this.
  SequenceManager(BlockAllocator* allocator, int64_t block_size,
                  int64_t max_seq_len, int64_t max_sequences);

  // Grows each sequence to hold its num_tokens (creating unknown ones) and
  // reports what was added, in request order. Checks first, then changes:
  // INVALID_ARGUMENT for a repeated id or negative count, OUT_OF_RANGE past
  // max_seq_len, RESOURCE_EXHAUSTED for too many sequences or too few free
  // blocks (saying how many were missing); on error nothing changes.
  absl::Status Allocate(absl::Span<const SequenceRequest> requests,
                        std::vector<SequenceGrowth>* out);

  // Frees the sequence and returns its blocks; false if unknown. `batches`
  // receives the live batches that had a row on it.
  bool Free(SeqId id, int64_t* blocks_freed, std::vector<BatchId>* batches);

  Sequence* Find(SeqId id);
  // Calls f(SeqId, const Sequence&) for every sequence, in no fixed order.
  template <typename F>
  void ForEach(F&& f) const {
    for (const auto& [id, seq] : seqs_) f(id, seq);
  }
  int64_t size() const { return static_cast<int64_t>(seqs_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t BlocksFor(int64_t num_tokens) const {
    return (num_tokens + block_size_ - 1) / block_size_;
  }

 private:
  BlockAllocator* const allocator_;
  const int64_t block_size_;
  const int64_t max_seq_len_;
  const int64_t max_sequences_;
  absl::flat_hash_map<SeqId, Sequence> seqs_;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_SEQUENCE_MANAGER_H_
