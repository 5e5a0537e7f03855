// Batch: the state tensors of one serving step that the server keeps between
// calls (the first half of the two-phase API: validate and size once, then
// AdvanceStep every step).
//
// Create() validates the rows against their sequences and builds the tensors
// as vLLM's model runner does: tokens, positions and slots per query token
// (prefill rows first, then decode rows, then padding rows of one token
// each), and seq_lens, context_lens, query_start_loc, seq_start_loc and
// block_tables per row. Advance() applies SEMANTICS §2-§5, turning the batch
// into a decode batch after a step with prefill rows. Every mutation is
// all-or-nothing: a rejected call leaves the batch as it was.
//
// Not thread-safe: the Engine serializes use.
#ifndef KVSTEP_CORE_BATCH_H_
#define KVSTEP_CORE_BATCH_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/advance_step.h"
#include "core/block_allocator.h"
#include "core/sequence_manager.h"
#include "core/tensor.h"

namespace kvstep {

struct BatchRowSpec {
  SeqId seq_id = 0;
  std::vector<int64_t> token_ids;  // query tokens of this step
  int64_t num_cached_tokens = 0;   // context_len
  bool prefill = false;            // forced for rows with > 1 token
  bool skip_sampling =
      false;  // a prefill chunk that leaves the prompt unfinished
};

struct BatchSpec {
  std::vector<BatchRowSpec> rows;
  int64_t num_padding_rows = 0;
  int64_t block_table_width = 0;  // minimum width
  DType seq_lens_dtype = DType::kInt32;
  DType block_tables_dtype = DType::kInt32;
  DType slot_mapping_dtype = DType::kInt64;
};

// What Create() needs to know of each row's sequence (parallel to rows).
struct RowSequence {
  absl::Span<const BlockId> blocks;
  int64_t num_tokens = 0;
};

struct BatchLimits {
  int64_t num_blocks = 0;  // pool size, for slot-width checks
  int64_t block_size = 0;
  int64_t max_batch_rows = 0;    // padding included
  int64_t max_batch_tokens = 0;  // query tokens, padding included
  int64_t max_table_width = 0;
};

// The counters of vLLM's attention metadata.
struct BatchMeta {
  int64_t num_seqs = 0;     // rows, padding included
  int64_t num_queries = 0;  // real rows
  int64_t num_prefills = 0;
  int64_t num_prefill_tokens = 0;
  int64_t num_decode_tokens = 0;
  int64_t max_query_len = 0;
  int64_t max_prefill_seq_len = 0;
  int64_t max_decode_seq_len = 0;
};

// Tensors beyond the AdvanceStep state, all int32.
struct BatchTensors {
  StepState state;
  Tensor query_start_loc;  // [num_seqs + 1]
  Tensor seq_start_loc;    // [num_seqs + 1]
  Tensor context_lens;     // [num_seqs]
};

struct AdvanceInput {
  // The number of the step this call takes (1 for a new batch's first), for
  // exactly-once retries (Engine::AdvanceStep); 0: unchecked.
  int64_t step = 0;
  Tensor sampled_token_ids;
  Tensor spec_token;    // speculative mode when defined
  Tensor accepted_num;  // speculative mode when defined
};

class Batch {
 public:
  // Validates `spec` (rows[i] is on `seqs[i]`) and builds the tensors on
  // `device`. Errors name the row: INVALID_ARGUMENT for malformed rows,
  // FAILED_PRECONDITION when a row claims more cached tokens than its
  // sequence has computed, OUT_OF_RANGE when its sequence lacks the blocks
  // for the row or a limit is passed.
  static absl::StatusOr<std::unique_ptr<Batch>> Create(
      const BatchSpec& spec, absl::Span<const RowSequence> seqs,
      const BatchLimits& limits, Device* device);

  const BatchMeta& meta() const { return meta_; }
  const BatchTensors& tensors() const { return t_; }
  // One per real row.
  const std::vector<SeqId>& seq_ids() const { return seq_ids_; }
  int64_t step() const { return step_; }
  int64_t table_width() const { return t_.state.block_tables.dim(1); }

  // Mirrors a sequence's (grown) table into its row, up to the width.
  void SyncTableRow(int64_t row, absl::Span<const BlockId> blocks);
  // The row's sequence was freed: the batch can no longer advance.
  void MarkStale(int64_t row) { stale_[row] = true; }
  bool stale(int64_t row) const { return stale_[row]; }
  // FAILED_PRECONDITION naming the first stale real row, if any.
  absl::Status CheckLive() const;
  // Tokens per real row in the decode form (1, or 1 + spec_num).
  int64_t tokens_per_row() const { return q_; }
  int64_t RowOf(SeqId id) const;
  // The session that created the batch (0: none).
  SessionId session() const { return session_; }
  void set_session(SessionId s) { session_ = s; }

  // Advances one step (SEMANTICS §2-§5). owned_blocks[i] is the number of
  // blocks row i's sequence owns now; block_ref_counts is the pool's
  // reference count of each block (a step may not write a shared block).
  // A batch with prefill rows becomes a
  // decode batch of its sampled rows (in order) plus its padding rows.
  // FAILED_PRECONDITION for a stale row, a batch with no sampled row, or
  // speculative mode on a batch with prefill rows; otherwise as AdvanceStep.
  absl::Status Advance(const AdvanceInput& in,
                       absl::Span<const int64_t> owned_blocks,
                       absl::Span<const int32_t> block_ref_counts,
                       int64_t num_blocks, FlashInferOutputs* flashinfer);

  // An independent copy of the tensors (for returning them).
  absl::StatusOr<BatchTensors> CloneTensors() const;

 private:
  Batch() = default;

  // Recomputes query/seq start locations, context_lens and meta_ for a
  // decode batch with q tokens per real row.
  void RecomputeDecodeDerived(int64_t q);

  BatchTensors t_;
  BatchMeta meta_;
  std::vector<SeqId> seq_ids_;
  std::vector<bool> skip_sampling_;
  std::vector<bool> stale_;
  int64_t num_padding_rows_ = 0;
  int64_t block_size_ = 0;
  // True when every row holds q_ tokens and is sampled: AdvanceStep can run
  // in place.
  bool decode_form_ = false;
  int64_t q_ = 1;
  int64_t step_ = 0;
  SessionId session_ = 0;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_BATCH_H_
