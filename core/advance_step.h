// AdvanceStep: vLLM's advance_step_flashattn (and torch_npu's
// npu_advance_step_flashattn / aclnnAdvanceStep) on host tensors.
//
// After the sampler produced a token per real row, update the state tensors
// in place for the next decode step (SEMANTICS §2), optionally computing
// FlashInfer's paged-KV metadata (§3), or, given draft tokens and accepted
// counts, torch_npu's speculative V2 update (§4).
//
// Contract: every check runs before the first write, so an error leaves
// every tensor exactly as it was. Errors are INVALID_ARGUMENT (dtype, shape,
// count or malformed value) or OUT_OF_RANGE (a position past the block
// table, a block id outside the pool, a result that does not fit its integer
// width), or FAILED_PRECONDITION (a write into a block shared with another
// sequence), and name the field and the row. seq_lens, block_tables and
// slot_mapping may each be int32 or int64 and keep their width; the rest are
// int64. Thread-compatible: the caller owns the tensors.
#ifndef KVSTEP_CORE_ADVANCE_STEP_H_
#define KVSTEP_CORE_ADVANCE_STEP_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/tensor.h"

namespace kvstep {

// The tensors the op updates in place. block_tables is read only.
struct StepState {
  Tensor input_tokens;     // int64 [num_seqs]      (spec: [num_seqs, 1+k])
  Tensor input_positions;  // int64 [num_seqs]      (spec: [num_seqs, 1+k])
  Tensor seq_lens;         // int32/64 [num_seqs]
  Tensor slot_mapping;     // int32/64 [num_seqs]   (spec: [num_seqs, 1+k])
  Tensor block_tables;     // int32/64 [num_seqs, W]
};

struct AdvanceStepArgs {
  int64_t num_seqs = 0;     // rows, padding included
  int64_t num_queries = 0;  // real rows: 0 < num_queries <= num_seqs
  int64_t block_size = 0;
  // int64 [num_queries, 1]; speculative: [num_seqs, 1 + spec_num].
  Tensor sampled_token_ids;
  // Speculative mode when both are defined: int64 [num_seqs, spec_num] draft
  // tokens and int64 [num_seqs] accepted draft counts (0 .. spec_num).
  Tensor spec_token;
  Tensor accepted_num;

  // Block ids must be < num_blocks (the pool's size) when it is > 0; a
  // negative id is always an error.
  int64_t num_blocks = 0;
  // When not empty (one entry per real row): the blocks the row's sequence
  // really owns. A position needing a table entry at or past it is
  // OUT_OF_RANGE even when the padded table has a (zero) entry there.
  absl::Span<const int64_t> row_owned_blocks;
  // When not empty: each pool block's reference count (BlockAllocator's),
  // indexed by block id. A position in a block counted more than once is
  // shared with another sequence and FAILED_PRECONDITION (AllocateBlocks
  // copies it first). Looking up only the blocks a step writes keeps the
  // check at O(tokens written), whatever the rows' lengths.
  absl::Span<const int32_t> block_ref_counts;
  // When not empty: the sequence id of each real row, named in errors.
  absl::Span<const uint64_t> row_seq_ids;
};

// FlashInfer paged-KV metadata, int32 (SEMANTICS §3): for real row i with
// new seq_len L, last_page_len = (L-1) % block_size + 1 and bound =
// ceil(L / block_size); indptr is their prefix sum (padding rows add 0) and
// indices lists each row's first `bound` table entries.
struct FlashInferOutputs {
  Tensor paged_kv_indptr;         // [num_seqs + 1]
  Tensor paged_kv_indices;        // [indptr[num_seqs]]
  Tensor paged_kv_last_page_len;  // [num_seqs], 0 for padding rows
  Tensor block_table_bound;       // [num_seqs], 0 for padding rows
};

// Validates and applies one step. `flashinfer` may be null. REQUIRES: the
// tensors are host accessible.
absl::Status AdvanceStep(const AdvanceStepArgs& args, StepState* state,
                         FlashInferOutputs* flashinfer);

}  // namespace kvstep

#endif  // KVSTEP_CORE_ADVANCE_STEP_H_
