// kvstep::BlockTables: a scheduler's copy of the server's block tables, kept
// from the replies that change them, so that a decode step's slot
// reservation can ask the server to leave the tables out
// (AllocateBlocksRequest.omit_appended_tables) and still know every table.
//
// Feed it every reply that changes a table: AllocateBlocks (Apply), a fork
// (ApplyFork) and a swap (ApplySwap, with the ids swapped). Forget a
// sequence after FreeSequences. An omitted table is the known one followed
// by new_block_ids; each reply's num_blocks is checked against the result,
// and a mismatch (a reply missed, or a sequence this copy never saw) is
// DATA_LOSS naming the sequence, with that sequence's table left as it was:
// ask again without omit_appended_tables to resynchronize it.
//
// Not thread-safe: one scheduler thread owns it.
#ifndef KVSTEP_CLIENT_BLOCK_TABLES_H_
#define KVSTEP_CLIENT_BLOCK_TABLES_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvstep/v1/kvstep.pb.h"

namespace kvstep {

class BlockTables {
 public:
  // Every sequence of the reply; stops at the first that does not add up
  // (the ones before it are applied).
  absl::Status Apply(const v1::AllocateBlocksResponse& reply);
  absl::Status ApplyFork(const v1::ForkSequenceResponse& reply);
  // The copies map each block of the swapped sequences to its new tier's;
  // `seq_ids` are the ids the SwapOut or SwapIn call named. NOT_FOUND for an
  // id this copy does not know, before anything changes.
  absl::Status ApplySwap(const v1::SwapResponse& reply,
                         absl::Span<const uint64_t> seq_ids);
  void Forget(absl::Span<const uint64_t> seq_ids);

  // The table of `seq_id`; nullptr when unknown.
  const std::vector<int64_t>* Find(uint64_t seq_id) const;
  size_t size() const { return tables_.size(); }
  // Whether `row`, a batch's block_tables row, is the table of `seq_id`
  // padded with zeros to the batch's width (false when unknown).
  bool MatchesRow(uint64_t seq_id, absl::Span<const int64_t> row) const;

 private:
  absl::Status ApplyOne(const v1::SequenceBlocks& s);
  absl::Status ApplyAll(
      const google::protobuf::RepeatedPtrField<v1::SequenceBlocks>& all);

  absl::flat_hash_map<uint64_t, std::vector<int64_t>> tables_;
};

}  // namespace kvstep

#endif  // KVSTEP_CLIENT_BLOCK_TABLES_H_
