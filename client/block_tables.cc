#include "client/block_tables.h"

#include <algorithm>
#include <cstddef>

#include "absl/strings/str_format.h"

namespace kvstep {

absl::Status BlockTables::ApplyOne(const v1::SequenceBlocks& s) {
  if (!s.block_table_omitted()) {
    tables_[s.seq_id()].assign(s.block_table().begin(), s.block_table().end());
    return absl::OkStatus();
  }
  auto it = tables_.find(s.seq_id());
  const int64_t known =
      it == tables_.end() ? -1 : static_cast<int64_t>(it->second.size());
  if (known < 0 || known + s.new_block_ids_size() != s.num_blocks()) {
    return absl::DataLossError(absl::StrFormat(
        "seq %d: the reply left its table out and appended %d blocks to a "
        "table of %d, but this copy %s: ask again without "
        "omit_appended_tables",
        s.seq_id(), s.new_block_ids_size(), s.num_blocks(),
        known < 0 ? "does not know the sequence"
                  : absl::StrFormat("has %d blocks", known)));
  }
  it->second.insert(it->second.end(), s.new_block_ids().begin(),
                    s.new_block_ids().end());
  return absl::OkStatus();
}

absl::Status BlockTables::ApplyAll(
    const google::protobuf::RepeatedPtrField<v1::SequenceBlocks>& all) {
  for (const v1::SequenceBlocks& s : all) {
    if (absl::Status st = ApplyOne(s); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status BlockTables::Apply(const v1::AllocateBlocksResponse& reply) {
  return ApplyAll(reply.sequences());
}

absl::Status BlockTables::ApplyFork(const v1::ForkSequenceResponse& reply) {
  return ApplyAll(reply.children());
}

absl::Status BlockTables::ApplySwap(const v1::SwapResponse& reply,
                                    absl::Span<const uint64_t> seq_ids) {
  for (uint64_t id : seq_ids) {
    if (!tables_.contains(id)) {
      return absl::NotFoundError(
          absl::StrFormat("seq %d: this copy does not know its table", id));
    }
  }
  // Blocks shared by sequences swapped together are copied once: one map.
  absl::flat_hash_map<int64_t, int64_t> moved;
  for (const v1::BlockCopy& c : reply.copies()) moved[c.src()] = c.dst();
  for (uint64_t id : seq_ids) {
    for (int64_t& b : tables_[id]) {
      auto m = moved.find(b);
      if (m != moved.end()) b = m->second;
    }
  }
  return absl::OkStatus();
}

void BlockTables::Forget(absl::Span<const uint64_t> seq_ids) {
  for (uint64_t id : seq_ids) tables_.erase(id);
}

bool BlockTables::MatchesRow(uint64_t seq_id,
                             absl::Span<const int64_t> row) const {
  const std::vector<int64_t>* known = Find(seq_id);
  return known != nullptr && known->size() <= row.size() &&
         std::equal(known->begin(), known->end(), row.begin()) &&
         std::all_of(row.begin() + static_cast<std::ptrdiff_t>(known->size()),
                     row.end(), [](int64_t e) { return e == 0; });
}

const std::vector<int64_t>* BlockTables::Find(uint64_t seq_id) const {
  auto it = tables_.find(seq_id);
  return it == tables_.end() ? nullptr : &it->second;
}

}  // namespace kvstep
