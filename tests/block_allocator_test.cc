#include "core/block_allocator.h"

#include <random>
#include <set>
#include <vector>

#include "core/block_hash.h"
#include "core/sequence_manager.h"
#include "core/traffic.h"
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

TEST(BlockAllocator, RunsContinueTheirSequenceAndLeaveAGapAfterNewRuns) {
  BlockAllocator a(20, BlockOrder::kRuns);
  std::vector<BlockId> t1, t2, t3, t4;
  ASSERT_TRUE(a.Allocate(3, &t1).ok());
  EXPECT_THAT(t1, ElementsAre(0, 1, 2));
  // The cursor skips kRunGap ids (3, 4) after a new run.
  ASSERT_TRUE(a.Allocate(2, &t2).ok());
  EXPECT_THAT(t2, ElementsAre(5, 6));
  // Growing after block 2 takes 3, then 4; 5 is taken, so the rest comes
  // from the cursor (9, after 7 and 8 were left to t2's run).
  ASSERT_TRUE(a.Allocate(1, &t3, /*after=*/2).ok());
  EXPECT_THAT(t3, ElementsAre(3));
  ASSERT_TRUE(a.Allocate(2, &t4, /*after=*/3).ok());
  EXPECT_THAT(t4, ElementsAre(4, 9));
  EXPECT_EQ(a.num_free(), 12);
  EXPECT_TRUE(a.IsOnFreeList(7));
  EXPECT_FALSE(a.IsOnFreeList(9));
  EXPECT_EQ(BlockOrderName(a.order()), "runs");
}

TEST(BlockAllocator, RunsReuseFreedBlocksWhenTheCursorComesRound) {
  BlockAllocator a(8, BlockOrder::kRuns);
  std::vector<BlockId> t1, t2, t3;
  ASSERT_TRUE(a.Allocate(6, &t1).ok());         // 0..5; the gap 6, 7 wraps
  ASSERT_TRUE(a.Release({t1.data(), 3}).ok());  // 0, 1, 2
  ASSERT_TRUE(a.Allocate(4, &t2).ok());
  EXPECT_THAT(t2, ElementsAre(0, 1, 2, 6));
  EXPECT_EQ(a.num_free(), 1);
  // All or nothing, as the stack orders.
  absl::Status s = a.Allocate(2, &t3);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("1 blocks missing"));
  EXPECT_TRUE(t3.empty());
  EXPECT_EQ(a.num_free(), 1);
  ASSERT_TRUE(a.Allocate(1, &t3, /*after=*/6).ok());
  EXPECT_THAT(t3, ElementsAre(7));
  EXPECT_EQ(a.num_free(), 0);
}

// Frees `ids` of a pool of `n` blocks whose every block was taken in one
// allocation (so the cursor stands at 0 again).
BlockAllocator FullPoolWithHoles(int64_t n, const std::vector<BlockId>& ids) {
  BlockAllocator a(n, BlockOrder::kRuns);
  std::vector<BlockId> all;
  EXPECT_TRUE(a.Allocate(n, &all).ok());
  EXPECT_TRUE(a.Release(ids).ok());
  return a;
}

TEST(BlockAllocator, RunsStartWhereTheAllocationFitsWhole) {
  // Holes of 1, 2 and 6 blocks: 4 blocks go to the first hole that holds
  // them, not over the three holes the cursor meets first.
  BlockAllocator a = FullPoolWithHoles(40, {5, 10, 11, 20, 21, 22, 23, 24, 25});
  std::vector<BlockId> t;
  ASSERT_TRUE(a.Allocate(4, &t).ok());
  EXPECT_THAT(t, ElementsAre(20, 21, 22, 23));
  // A single block: the next free one after the cursor (24 and 25 are the
  // run's gap).
  t.clear();
  ASSERT_TRUE(a.Allocate(1, &t).ok());
  EXPECT_THAT(t, ElementsAre(5));
  // No hole holds 3: next-fit from the cursor, then the run goes on.
  t.clear();
  ASSERT_TRUE(a.Allocate(3, &t).ok());
  EXPECT_THAT(t, ElementsAre(10, 11, 24));

  // A hole across two words of the bitmap is found; one across the pool's
  // end is not a run.
  BlockAllocator b =
      FullPoolWithHoles(130, {0, 1, 60, 62, 63, 64, 65, 128, 129});
  t.clear();
  ASSERT_TRUE(b.Allocate(4, &t).ok());
  EXPECT_THAT(t, ElementsAre(62, 63, 64, 65));
  t.clear();
  ASSERT_TRUE(b.Allocate(4, &t).ok());  // 128, 129, 0, 1: no run of 4
  EXPECT_THAT(t, ElementsAre(128, 129, 0, 1));
  // More than kRunExtent blocks need only kRunExtent free in a row.
  std::vector<BlockId> holes;
  for (BlockId id = 0; id < 200; id += 2) holes.push_back(id);
  for (BlockId id = 300; id < 300 + BlockAllocator::kRunExtent; ++id) {
    holes.push_back(id);
  }
  BlockAllocator c = FullPoolWithHoles(400, holes);
  t.clear();
  ASSERT_TRUE(c.Allocate(20, &t).ok());
  EXPECT_EQ(t.front(), 300);
  EXPECT_EQ(t[BlockAllocator::kRunExtent - 1],
            300 + BlockAllocator::kRunExtent - 1);
}

// The extent search against a scan of the bitmap one id at a time, over
// random pools: an allocation's first block is the first id after the
// cursor (0) that starts min(n, kRunExtent) free blocks in a row, if any.
TEST(BlockAllocator, RunsExtentSearchMatchesAPlainScan) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = std::uniform_int_distribution<int64_t>(1, 300)(rng);
    const double p_free = std::uniform_real_distribution<double>(0.2, 0.9)(rng);
    std::vector<BlockId> holes;
    std::vector<bool> free(static_cast<size_t>(n));
    for (BlockId id = 0; id < n; ++id) {
      if (std::bernoulli_distribution(p_free)(rng)) {
        holes.push_back(id);
        free[static_cast<size_t>(id)] = true;
      }
    }
    if (holes.empty()) continue;
    BlockAllocator a = FullPoolWithHoles(n, holes);
    const int64_t want = std::uniform_int_distribution<int64_t>(
        1, static_cast<int64_t>(holes.size()))(rng);
    const int64_t len = std::min(want, BlockAllocator::kRunExtent);
    BlockId expect = holes.front();  // next-fit
    if (len >= 2) {
      for (BlockId id = 0; id + len <= n; ++id) {
        int64_t k = 0;
        while (k < len && free[static_cast<size_t>(id + k)]) ++k;
        if (k == len) {
          expect = id;
          break;
        }
      }
    }
    std::vector<BlockId> t;
    ASSERT_TRUE(a.Allocate(want, &t).ok());
    ASSERT_EQ(t.front(), expect)
        << "trial " << trial << ": pool " << n << ", " << want << " blocks";
  }
}

TEST(BlockAllocator, RunsEvictCachedBlocksWhenNoneAreFree) {
  BlockAllocator a(3, BlockOrder::kRuns);
  std::vector<BlockId> t, u;
  ASSERT_TRUE(a.Allocate(3, &t).ok());
  const std::vector<int64_t> tokens = {1, 2};
  const BlockHash h = HashBlock(std::nullopt, tokens, "");
  ASSERT_TRUE(a.Register(t[1], h, std::nullopt, tokens, ""));
  ASSERT_TRUE(a.Release(t).ok());  // 0 and 2 free, 1 cached
  EXPECT_EQ(a.num_free(), 2);
  EXPECT_EQ(a.num_evictable(), 1);
  ASSERT_TRUE(a.Allocate(3, &u).ok());
  EXPECT_EQ(a.num_available(), 0);
  EXPECT_FALSE(a.Lookup(h).has_value());  // evicted for the third block
  EXPECT_EQ(a.Release(u).code(), absl::StatusCode::kOk);
  EXPECT_EQ(a.num_free(), 3);
}

TEST(BlockAllocator, DoubleReleaseIsAnErrorAndChangesNothing) {
  BlockAllocator a(4, BlockOrder::kAscending);
  std::vector<BlockId> t;
  ASSERT_TRUE(a.Allocate(2, &t).ok());
  ASSERT_TRUE(a.Release(t).ok());
  EXPECT_EQ(a.Release(t).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(a.num_free(), 4);
}

// Pins hold back the reuse of released blocks, not their release: the
// free list and the prefix cache go on as without them, and an allocation
// after the pins go takes what it would have taken with none.
TEST(BlockAllocator, PinnedBlocksAreReleasedButNotReusedUntilUnpinned) {
  for (BlockOrder order :
       {BlockOrder::kDescending, BlockOrder::kAscending, BlockOrder::kRuns}) {
    BlockAllocator a(8, order), twin(8, order);  // twin: never pinned
    std::vector<BlockId> t, tt;
    ASSERT_TRUE(a.Allocate(3, &t).ok());
    ASSERT_TRUE(twin.Allocate(3, &tt).ok());
    ASSERT_EQ(t, tt);
    a.Pin({t[0], t[1], t[1], t[2]});  // repeats count
    EXPECT_EQ(a.PinCount(t[1]), 2);
    EXPECT_EQ(a.num_pinned_unowned(), 0);
    // Pinned and owned: allocation goes on.
    std::vector<BlockId> u, tu;
    ASSERT_TRUE(a.Allocate(1, &u).ok());
    ASSERT_TRUE(twin.Allocate(1, &tu).ok());
    ASSERT_TRUE(a.Release(t).ok());
    ASSERT_TRUE(twin.Release(tt).ok());
    EXPECT_EQ(a.num_pinned_unowned(), 3);
    EXPECT_EQ(a.num_free(), twin.num_free());  // released all the same
    std::vector<BlockId> v;
    const absl::Status s = a.Allocate(1, &v);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(s.message()), HasSubstr("3 released blocks"));
    EXPECT_TRUE(v.empty());
    EXPECT_EQ(a.num_free(), twin.num_free());  // nothing taken
    EXPECT_TRUE(a.Allocate(0, &v).ok());       // takes no block: no wait
    a.Unpin({t[0], t[1], t[2]});
    EXPECT_EQ(a.num_pinned_unowned(), 1);  // t[1]'s second pin
    EXPECT_EQ(a.Allocate(1, &v).code(), absl::StatusCode::kFailedPrecondition);
    a.Unpin({t[1]});
    EXPECT_EQ(a.num_pinned_unowned(), 0);
    std::vector<BlockId> tv;
    ASSERT_TRUE(a.Allocate(4, &v).ok());
    ASSERT_TRUE(twin.Allocate(4, &tv).ok());
    EXPECT_EQ(v, tv) << BlockOrderName(order);
  }
}

TEST(BlockAllocator, PinsOnFreeAndCachedBlocksHoldBackAllocation) {
  BlockAllocator a(4, BlockOrder::kAscending);
  std::vector<BlockId> t;
  ASSERT_TRUE(a.Allocate(2, &t).ok());
  const std::vector<int64_t> tokens = {1, 2};
  const BlockHash h = HashBlock(std::nullopt, tokens, "");
  ASSERT_TRUE(a.Register(t[0], h, std::nullopt, tokens, ""));
  ASSERT_TRUE(a.Release(t).ok());  // t[0] cached, t[1] free
  a.Pin({t[0], t[1]});             // as an explicit call's tables may
  EXPECT_EQ(a.num_pinned_unowned(), 2);
  std::vector<BlockId> v;
  EXPECT_EQ(a.Allocate(1, &v).code(), absl::StatusCode::kFailedPrecondition);
  // A prefix hit owns the cached block again: one unowned pin left.
  a.Acquire(*a.Lookup(h));
  EXPECT_EQ(a.num_pinned_unowned(), 1);
  a.Unpin({t[1]});
  EXPECT_EQ(a.num_pinned_unowned(), 0);
  ASSERT_TRUE(a.Allocate(1, &v).ok());
  // Unpinning an owned block leaves the count alone; releasing it after.
  a.Unpin({t[0]});
  EXPECT_EQ(a.num_pinned_unowned(), 0);
  ASSERT_TRUE(a.Release({t[0]}).ok());
  EXPECT_EQ(a.num_pinned_unowned(), 0);
  EXPECT_EQ(a.num_evictable(), 1);
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

// Sequences arriving with a prompt of `prompt` tokens, growing a token at
// a time for `decode` more and finishing, as in a server (Traffic, through
// a SequenceManager; a sequence that finds no block for its next token
// waits for the next step): the share of consecutive table entries that
// are adjacent ids. LIFO reuse scatters the tables within a few thousand
// steps; runs keep them together (BlockOrder::kRuns).
struct Lengths {
  int64_t lo, hi;
};
double AdjacencyUnderChurn(BlockOrder order, Lengths prompt = {256, 1536},
                           Lengths decode = {32, 512}, int64_t pool = 3000) {
  constexpr int64_t kBs = 16, kRunning = 16;
  BlockAllocator alloc(pool, order);
  SequenceManager seqs(&alloc, /*host=*/nullptr, kBs, /*max_seq_len=*/4096,
                       /*max_sequences=*/64);
  Traffic traffic(&seqs);
  std::mt19937_64 rng(7);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int step = 0; step < 6000; ++step) {
    while (static_cast<int64_t>(traffic.live().size()) < kRunning) {
      const int64_t tokens = uni(prompt.lo, prompt.hi);
      Traffic::Live* q = traffic.Admit(tokens);
      if (q == nullptr) break;
      q->target = tokens + uni(decode.lo, decode.hi);
      q->preemptible = false;
    }
    traffic.Step();
  }
  EXPECT_EQ(traffic.preempted(), 0);
  int64_t pairs = 0, adjacent = 0;
  std::set<BlockId> seen;
  for (const auto& [id, q] : traffic.live()) {
    const std::vector<BlockId>& t = traffic.Table(id);
    EXPECT_EQ(static_cast<int64_t>(t.size()), (q.tokens + kBs - 1) / kBs);
    for (BlockId b : t) {
      EXPECT_TRUE(seen.insert(b).second) << "block " << b << " twice";
    }
    CountAdjacent(t, &pairs, &adjacent);
  }
  EXPECT_EQ(alloc.num_free() + static_cast<int64_t>(seen.size()), pool);
  return pairs > 0 ? static_cast<double>(adjacent) / pairs : 0.0;
}

TEST(BlockOrderUnderChurn, RunsKeepTablesConsecutiveWhereLifoScattersThem) {
  const double lifo = AdjacencyUnderChurn(BlockOrder::kDescending);
  const double runs = AdjacencyUnderChurn(BlockOrder::kRuns);
  EXPECT_LT(lifo, 0.2);
  EXPECT_GT(runs, 0.9);
  RecordProperty("lifo_adjacent_percent", static_cast<int>(100 * lifo));
  RecordProperty("runs_adjacent_percent", static_cast<int>(100 * runs));
}

// Long decodes after short prompts: a run's sequence outgrows a fixed gap
// of kRunGap blocks again and again (72% of entries adjacent with it);
// the gap that grows with the table keeps 95%.
TEST(BlockOrderUnderChurn, RunsKeepLongDecodesConsecutive) {
  const Lengths prompt = {16, 128}, decode = {512, 2048};
  const double lifo =
      AdjacencyUnderChurn(BlockOrder::kDescending, prompt, decode);
  const double runs = AdjacencyUnderChurn(BlockOrder::kRuns, prompt, decode);
  EXPECT_LT(lifo, 0.2);
  EXPECT_GT(runs, 0.9);
  RecordProperty("lifo_adjacent_percent", static_cast<int>(100 * lifo));
  RecordProperty("runs_adjacent_percent", static_cast<int>(100 * runs));
}

// Prompts of up to 3,072 tokens in a pool they nearly fill: taken
// next-fit, a prompt is split over the holes the cursor meets (72% of
// entries adjacent without the search for room, kRunExtent); the search
// keeps 86%.
TEST(BlockOrderUnderChurn, RunsFindRoomForPromptsInANearlyFullPool) {
  const double runs = AdjacencyUnderChurn(BlockOrder::kRuns, {256, 3072},
                                          {32, 1024}, /*pool=*/2250);
  EXPECT_GT(runs, 0.8);
  RecordProperty("runs_adjacent_percent", static_cast<int>(100 * runs));
}

TEST(BlockAllocator, RunsGapGrowsWithTheTable) {
  BlockAllocator a(10000, BlockOrder::kRuns);
  std::vector<BlockId> t;
  ASSERT_TRUE(a.Allocate(4, &t, BlockAllocator::kNone,
                         /*table_blocks=*/10)
                  .ok());
  EXPECT_THAT(t, ElementsAre(0, 1, 2, 3));
  t.clear();
  ASSERT_TRUE(a.Allocate(1, &t, BlockAllocator::kNone, 100).ok());
  EXPECT_THAT(t, ElementsAre(14));  // after the 10 ids left to 0..3
  t.clear();
  ASSERT_TRUE(a.Allocate(1, &t).ok());  // after kMaxRunGap ids
  EXPECT_THAT(t, ElementsAre(15 + BlockAllocator::kMaxRunGap));
  t.clear();
  ASSERT_TRUE(a.Allocate(1, &t).ok());  // table_blocks 0: kRunGap
  EXPECT_THAT(t, ElementsAre(16 + BlockAllocator::kMaxRunGap +
                             BlockAllocator::kRunGap));
  // The sequence of block 3 grows into its gap, then past it.
  t.clear();
  ASSERT_TRUE(a.Allocate(11, &t, /*after=*/3, 21).ok());
  EXPECT_EQ(t.front(), 4);
  EXPECT_EQ(t[9], 13);
  EXPECT_EQ(t.back(),
            17 + BlockAllocator::kMaxRunGap + 2 * BlockAllocator::kRunGap);

  // The gap counts ids, free or not, and ends at the pool's end.
  BlockAllocator b(20, BlockOrder::kRuns);
  std::vector<BlockId> u;
  ASSERT_TRUE(b.Allocate(2, &u).ok());               // 0, 1; the cursor at 4
  ASSERT_TRUE(b.Allocate(1, &u, /*after=*/1).ok());  // 2, in the gap
  ASSERT_TRUE(b.Allocate(13, &u, BlockAllocator::kNone, 13).ok());
  EXPECT_EQ(u[3], 4);  // 4..16; the cursor at min(17 + 13, 20) = 0
  u.clear();
  ASSERT_TRUE(b.Allocate(1, &u).ok());
  EXPECT_THAT(u, ElementsAre(3));
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
