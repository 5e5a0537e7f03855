// SequenceManager: the block manager of a scheduler (vLLM, TGI, TRT-LLM) as
// a library: sequence id -> block table, with sharing, copy-on-write,
// prefix caching and a host tier (SEMANTICS §8).
//
// A sequence is created by its first allocation and lives until freed.
//   * Allocate grows sequences so each can hold its requested tokens; a
//     request for fewer tokens than a sequence holds is a no-op (retry-safe).
//     A new sequence that carries its prompt reuses the longest chain of
//     cached full blocks (at most prompt_len - 1 tokens). Blocks in a
//     sequence's write range [computed tokens, requested tokens) that are
//     shared are copied first (copy-on-write), reported as BlockCopy pairs
//     that the caller must copy bytes for before anything writes there.
//     All-or-nothing over the whole request.
//   * Fork shares the parent's blocks (reference counts).
//   * Full blocks are registered in the prefix cache as their tokens become
//     known (RegisterFullBlocks), as vLLM v1 does when they are scheduled.
//   * SwapOut / SwapIn move whole sequences between the device and host
//     tiers; the caller copies the bytes of the returned pairs.
// Not thread-safe: the Engine serializes use.
#ifndef KVSTEP_CORE_SEQUENCE_MANAGER_H_
#define KVSTEP_CORE_SEQUENCE_MANAGER_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/block_allocator.h"
#include "core/block_hash.h"

namespace kvstep {

using SeqId = uint64_t;
using BatchId = uint64_t;
// A client session (0: none). Sequences and batches created in a session
// belong to it and go when it ends or lapses (Engine::OpenSession).
using SessionId = uint64_t;

struct Sequence {
  // The block table: device block ids, or host block ids while swapped.
  std::vector<BlockId> blocks;
  // seq_len of the latest step planned for the sequence (CreateBatch or
  // AdvanceStep), or the prefix-hit tokens at creation: the tokens whose K/V
  // are in, or are being written to, the cache. A batch row may claim at
  // most this many cached tokens.
  int64_t num_tokens = 0;
  // Token ids by position, as far as known (the prompt may run ahead of
  // num_tokens).
  std::vector<int64_t> tokens;
  // Hash chain of the first hashes.size() full blocks.
  std::vector<BlockHash> hashes;
  std::string extra_key;  // adapter id and cache salt, in every block hash
  int64_t prefix_hit_tokens = 0;
  bool swapped = false;
  // The session that created the sequence; only its calls may touch it.
  SessionId session = 0;
  // Live batches with a row on this sequence (each at most once).
  absl::InlinedVector<BatchId, 2> batches;

  void LeaveBatch(BatchId id) {
    batches.erase(std::remove(batches.begin(), batches.end(), id),
                  batches.end());
  }
};

struct SequenceRequest {
  SequenceRequest() = default;
  SequenceRequest(SeqId id, int64_t tokens) : seq_id(id), num_tokens(tokens) {}

  SeqId seq_id = 0;
  int64_t num_tokens = 0;  // context + new tokens + look-ahead
  // For a new sequence: its prompt, for prefix-cache lookup, and the extra
  // hash keys. For an existing one they must match what it was created with
  // (so a retried call is accepted) or be empty.
  std::vector<int64_t> prompt_token_ids;
  std::string extra_key;
};

struct BlockCopy {
  BlockId src = 0;
  BlockId dst = 0;
};

struct SequenceGrowth {
  SeqId seq_id = 0;
  std::vector<BlockId> new_blocks;
  bool created = false;
  // Tokens already computed thanks to prefix-cache hits (new sequences;
  // the creation-time value again on a retry).
  int64_t computed_tokens = 0;
  // Copy-on-write: copy src to dst (all layers, K and V) before use.
  std::vector<BlockCopy> copies;
};

struct SwapResult {
  std::vector<BlockCopy> copies;  // from the old tier to the new one
};

class SequenceManager {
 public:
  // REQUIRES: block_size > 0; the allocators outlive this. `host` may be
  // null (no host tier).
  SequenceManager(BlockAllocator* device, BlockAllocator* host,
                  int64_t block_size, int64_t max_seq_len,
                  int64_t max_sequences);

  // See the class comment. Checks first, then changes: INVALID_ARGUMENT for
  // a repeated id, negative count or mismatched prompt, OUT_OF_RANGE past
  // max_seq_len, FAILED_PRECONDITION for a swapped-out sequence,
  // RESOURCE_EXHAUSTED for too many sequences or too few blocks (saying how
  // many were missing); on error nothing changes.
  absl::Status Allocate(absl::Span<const SequenceRequest> requests,
                        std::vector<SequenceGrowth>* out);

  // Blocks the requests would still need (no change): for admission.
  // `*never` is set when a request can never fit this pool; `*fresh` (if
  // not null), how many of them Allocate would take from the allocator
  // (the rest are prefix hits on cached blocks).
  absl::Status BlocksNeeded(absl::Span<const SequenceRequest> requests,
                            int64_t* needed, bool* never,
                            int64_t* fresh = nullptr) const;

  // The child shares every block holding the parent's num_tokens tokens.
  absl::Status Fork(SeqId parent, SeqId child);

  // Frees the sequence and returns its blocks; false if unknown. `batches`
  // receives the live batches that had a row on it.
  bool Free(SeqId id, int64_t* blocks_freed, std::vector<BatchId>* batches);

  // Records `tokens` at positions first, first+1, ... (dropping what was
  // known from `first` on) and registers every full block below `upto`
  // tokens. Blocks whose content may change (from position `first` on)
  // lose their registration first.
  void RecordTokens(Sequence* seq, int64_t first,
                    absl::Span<const int64_t> tokens, int64_t upto);

  // Forgets every sequence's hash chain (after the prefix cache was reset):
  // full blocks are registered again from the sequence's next step on.
  void ClearHashes() {
    for (auto& [id, seq] : seqs_) seq.hashes.clear();
  }

  // Moves whole sequences to the host tier and back. FAILED_PRECONDITION
  // without a host tier or for a sequence in the wrong tier, NOT_FOUND for
  // an unknown id, RESOURCE_EXHAUSTED when the target tier is short.
  absl::Status SwapOut(absl::Span<const SeqId> ids, SwapResult* out);
  absl::Status SwapIn(absl::Span<const SeqId> ids, SwapResult* out);

  // The first table entry in [first, last) (clipped to the table) whose
  // block another sequence shares, or -1. A position in such a block must
  // not be written until AllocateBlocks copies it. Costs the entries asked
  // about, not the table's length.
  int64_t FirstSharedBlock(const Sequence& seq, int64_t first,
                           int64_t last) const;

  Sequence* Find(SeqId id);
  const Sequence* Find(SeqId id) const;
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

  // Prefix-cache lookups since start: prompt tokens asked about, and hit.
  int64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }

 private:
  struct Plan;
  absl::Status MakePlan(absl::Span<const SequenceRequest> requests,
                        Plan* plan) const;
  void RegisterFullBlocks(Sequence* seq, int64_t upto);
  absl::Status Swap(absl::Span<const SeqId> ids, bool out, SwapResult* res);

  BlockAllocator* const device_;
  BlockAllocator* const host_;
  const int64_t block_size_;
  const int64_t max_seq_len_;
  const int64_t max_sequences_;
  absl::flat_hash_map<SeqId, Sequence> seqs_;
  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_SEQUENCE_MANAGER_H_
