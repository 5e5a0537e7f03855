#include "core/block_allocator.h"

#include <vector>

#include "core/sequence_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BlockAllocator, DescendingOrderHandsOutTheTopFirst) {
  BlockAllocator a(10, BlockOrder::kDescending);
  std::vector<BlockId> got;
  ASSERT_TRUE(a.Allocate(3, &got).ok());
  EXPECT_THAT(got, ElementsAre(9, 8, 7));
  EXPECT_EQ(a.num_free(), 7);
}

TEST(BlockAllocator, AscendingOrderHandsOutZeroFirst) {
  BlockAllocator a(10, BlockOrder::kAscending);
  std::vector<BlockId> got;
  ASSERT_TRUE(a.Allocate(3, &got).ok());
  EXPECT_THAT(got, ElementsAre(0, 1, 2));
}

TEST(BlockAllocator, AllOrNothing) {
  BlockAllocator a(4, BlockOrder::kAscending);
  std::vector<BlockId> got;
  absl::Status s = a.Allocate(5, &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("1 blocks missing"));
  EXPECT_TRUE(got.empty());
  EXPECT_EQ(a.num_free(), 4);
}

TEST(BlockAllocator, FreedBlocksAreReusedLifoInTableOrder) {
  BlockAllocator a(10, BlockOrder::kDescending);
  std::vector<BlockId> t1, t2, t3;
  ASSERT_TRUE(a.Allocate(3, &t1).ok());  // 9 8 7
  ASSERT_TRUE(a.Allocate(2, &t2).ok());  // 6 5
  ASSERT_TRUE(a.Release(t1).ok());
  ASSERT_TRUE(a.Allocate(3, &t3).ok());
  EXPECT_THAT(t3, ElementsAre(9, 8, 7));  // the hot blocks, same order
  EXPECT_EQ(a.RefCount(9), 1);
}

TEST(BlockAllocator, DoubleReleaseIsAnErrorAndChangesNothing) {
  BlockAllocator a(4, BlockOrder::kAscending);
  std::vector<BlockId> t;
  ASSERT_TRUE(a.Allocate(2, &t).ok());
  ASSERT_TRUE(a.Release(t).ok());
  EXPECT_EQ(a.Release(t).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(a.num_free(), 4);
}

class SequenceManagerTest : public ::testing::Test {
 protected:
  BlockAllocator alloc_{20, BlockOrder::kDescending};
  SequenceManager seqs_{&alloc_, /*host=*/nullptr, /*block_size=*/4,
                        /*max_seq_len=*/64,
                        /*max_sequences=*/3};
};

TEST_F(SequenceManagerTest, CreatesAndGrows) {
  std::vector<SequenceGrowth> out;
  ASSERT_TRUE(seqs_.Allocate({{7, 5}, {8, 4}}, &out).ok());
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(out[0].created);
  EXPECT_THAT(out[0].new_blocks, ElementsAre(19, 18));
  EXPECT_THAT(out[1].new_blocks, ElementsAre(17));
  out.clear();
  ASSERT_TRUE(seqs_.Allocate({{7, 9}}, &out).ok());
  EXPECT_FALSE(out[0].created);
  EXPECT_THAT(out[0].new_blocks, ElementsAre(16));
  EXPECT_THAT(seqs_.Find(7)->blocks, ElementsAre(19, 18, 16));
}

TEST_F(SequenceManagerTest, RetryingTheSameCallChangesNothing) {
  std::vector<SequenceGrowth> out;
  ASSERT_TRUE(seqs_.Allocate({{7, 13}}, &out).ok());
  const int64_t free_after = alloc_.num_free();
  for (int i = 0; i < 3; ++i) {
    out.clear();
    ASSERT_TRUE(seqs_.Allocate({{7, 13}}, &out).ok());
    EXPECT_TRUE(out[0].new_blocks.empty());
    ASSERT_TRUE(seqs_.Allocate({{7, 2}}, &out).ok());  // never shrinks
  }
  EXPECT_EQ(alloc_.num_free(), free_after);
  EXPECT_EQ(seqs_.Find(7)->blocks.size(), 4u);
}

TEST_F(SequenceManagerTest, ShortageTakesNothingAndSaysHowMany) {
  std::vector<SequenceGrowth> out;
  ASSERT_TRUE(seqs_.Allocate({{1, 60}}, &out).ok());  // 15 of 20 blocks
  out.clear();
  absl::Status s = seqs_.Allocate({{1, 64}, {2, 24}}, &out);  // 1 + 6 > 5
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("need 7 blocks, 5 available: 2 blocks missing"));
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(seqs_.Find(2), nullptr);  // not created either
  EXPECT_EQ(seqs_.Find(1)->blocks.size(), 15u);
  EXPECT_EQ(alloc_.num_free(), 5);
}

TEST_F(SequenceManagerTest, RejectsBadRequestsBeforeChangingAnything) {
  std::vector<SequenceGrowth> out;
  EXPECT_EQ(seqs_.Allocate({{1, 4}, {1, 8}}, &out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(seqs_.Allocate({{1, 4}, {2, -1}}, &out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(seqs_.Allocate({{1, 4}, {2, 65}}, &out).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(seqs_.Allocate({{1, 1}, {2, 1}, {3, 1}, {4, 1}}, &out).code(),
            absl::StatusCode::kResourceExhausted);  // max_sequences 3
  EXPECT_EQ(seqs_.size(), 0);
  EXPECT_EQ(alloc_.num_free(), 20);
}

TEST_F(SequenceManagerTest, FreeReturnsBlocksAndReportsUnknown) {
  std::vector<SequenceGrowth> out;
  ASSERT_TRUE(seqs_.Allocate({{1, 8}}, &out).ok());
  int64_t freed = 0;
  std::vector<BatchId> batches;
  EXPECT_TRUE(seqs_.Free(1, &freed, &batches));
  EXPECT_EQ(freed, 2);
  EXPECT_FALSE(seqs_.Free(1, &freed, &batches));
  EXPECT_EQ(alloc_.num_free(), 20);
}

}  // namespace
}  // namespace kvstep
