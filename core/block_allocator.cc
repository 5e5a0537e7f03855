#include "core/block_allocator.h"

#include "absl/strings/str_format.h"

namespace kvstep {

absl::string_view BlockOrderName(BlockOrder order) {
  return order == BlockOrder::kDescending ? "descending" : "ascending";
}

BlockAllocator::BlockAllocator(int64_t num_blocks, BlockOrder order)
    : order_(order), ref_counts_(static_cast<size_t>(num_blocks), 0) {
  free_.reserve(static_cast<size_t>(num_blocks));
  // The stack pops from the back: push the first block to hand out last.
  for (int64_t i = 0; i < num_blocks; ++i) {
    free_.push_back(static_cast<BlockId>(
        order == BlockOrder::kDescending ? i : num_blocks - 1 - i));
  }
}

absl::Status BlockAllocator::Allocate(int64_t n, std::vector<BlockId>* out) {
  if (n < 0) return absl::InvalidArgumentError("negative block count");
  if (n > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("need %d blocks, %d free: %d blocks missing", n,
                        num_free(), n - num_free()));
  }
  for (int64_t i = 0; i < n; ++i) {
    const BlockId id = free_.back();
    free_.pop_back();
    ref_counts_[id] = 1;
    out->push_back(id);
  }
  return absl::OkStatus();
}

absl::Status BlockAllocator::Release(absl::Span<const BlockId> ids) {
  for (BlockId id : ids) {
    if (!IsValid(id) || ref_counts_[id] <= 0) {
      return absl::InternalError(
          absl::StrFormat("release of block %d, which is not allocated", id));
    }
  }
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    if (--ref_counts_[*it] == 0) free_.push_back(*it);
  }
  return absl::OkStatus();
}

}  // namespace kvstep
