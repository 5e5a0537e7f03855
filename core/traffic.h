// Traffic: a model of serving traffic over a block pool, for the
// simulations that measure what block tables look like after it
// (tests/block_allocator_test.cc's BlockOrderUnderChurn,
// bench/block_order_sim, attention_bench's --tables=churn and churn_runs).
// Sequences are admitted with a prompt when its blocks are there, grow a
// token a step towards a target length in order of arrival, and then
// finish (their blocks freed) or stay; one that finds no block for its
// next token is preempted (freed whole, as vLLM's recompute preemption
// does) or waits for the next step. The caller draws the lengths, so each
// simulation keeps its own random stream.
//
// The model allocates either through a SequenceManager (what a server's
// AllocateBlocks does) or straight from a BlockAllocator, where it can
// leave out the table lengths SequenceManager passes (which size kRuns's
// gaps; BlockAllocator::RunGap). Both make each growth one allocation
// after the table's last block, so with the lengths passed they hand out
// the same ids.
//
// Not used by the server. Not thread-safe; it borrows the manager or the
// allocator, which must outlive it and which nothing else may change while
// it runs.
#ifndef KVSTEP_CORE_TRAFFIC_H_
#define KVSTEP_CORE_TRAFFIC_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/block_allocator.h"
#include "core/sequence_manager.h"

namespace kvstep {

class Traffic {
 public:
  struct Live {
    int64_t tokens = 0;  // held
    int64_t target = 0;  // grows a token a step up to this
    // Finds no block for its next token: freed whole (true) or waits.
    bool preemptible = true;
    // At its target: stays (true) or finishes, freeing its blocks.
    bool stays = false;
    std::vector<BlockId> table;  // the allocator's model only
  };

  // Through `seqs` (its blocks of `seqs->block_size()` tokens).
  explicit Traffic(SequenceManager* seqs);
  // Straight from `alloc`, blocks of `block_size` (> 0) tokens. `pass_length`:
  // pass each table's length to BlockAllocator::Allocate, as
  // SequenceManager does; false passes none, which leaves every kRuns gap
  // at kRunGap blocks.
  Traffic(BlockAllocator* alloc, int64_t block_size, bool pass_length);

  Traffic(const Traffic&) = delete;
  Traffic& operator=(const Traffic&) = delete;

  // Admits a sequence of `prompt` tokens (> 0) if its blocks are there
  // (and, through a SequenceManager, its max_sequences allows): returns it,
  // with target = prompt, preemptible and not staying, for the caller to
  // set before the next Step; nullptr if it does not fit. `*id` gets its id
  // (1, 2, ... in order of arrival) if `id` is not null. A refusal for any
  // other reason, such as a prompt past max_seq_len, aborts the process, as
  // does a growth past it (at the latest when it takes a block).
  Live* Admit(int64_t prompt, SeqId* id = nullptr);

  // One step: each live sequence in order of arrival grows a token if it
  // is under its target (or is preempted, or waits), then finishes if it
  // is at its target and does not stay. Returns the tokens grown.
  int64_t Step();

  // The live sequences by id (= order of arrival).
  const std::map<SeqId, Live>& live() const { return live_; }
  // A live sequence's block table. REQUIRES: `id` is live.
  const std::vector<BlockId>& Table(SeqId id) const;
  // Sequences preempted so far.
  int64_t preempted() const { return preempted_; }

 private:
  // Grows `id`'s table to hold `tokens`, all or nothing: false if the
  // blocks (or, for a new sequence, max_sequences) are short; aborts on any
  // other error (Fits).
  bool Grow(SeqId id, Live* q, int64_t tokens);
  // True for OK, false for RESOURCE_EXHAUSTED; prints and aborts otherwise.
  static bool Fits(const absl::Status& st);
  void Drop(SeqId id, Live* q);

  SequenceManager* const seqs_ = nullptr;
  BlockAllocator* const alloc_ = nullptr;
  const int64_t block_size_;
  const bool pass_length_ = true;
  std::map<SeqId, Live> live_;
  SeqId next_ = 1;
  int64_t preempted_ = 0;
  std::vector<SequenceGrowth> out_;  // SequenceManager::Allocate's, reused
};

// Adds `table`'s neighbouring entries to *pairs and those that are
// consecutive ids (b, b + 1) to *consecutive.
void CountAdjacent(absl::Span<const BlockId> table, int64_t* pairs,
                   int64_t* consecutive);

}  // namespace kvstep

#endif  // KVSTEP_CORE_TRAFFIC_H_
