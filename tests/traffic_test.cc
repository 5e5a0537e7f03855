#include "core/traffic.h"

#include <random>
#include <vector>

#include "core/block_allocator.h"
#include "core/sequence_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstep {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(Traffic, GrowsATokenAStepAndFreesAtItsTarget) {
  BlockAllocator alloc(10, BlockOrder::kAscending);
  Traffic traffic(&alloc, /*block_size=*/4, /*pass_length=*/true);
  SeqId id = 0;
  Traffic::Live* q = traffic.Admit(3, &id);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(id, 1);
  EXPECT_EQ(q->tokens, 3);
  EXPECT_EQ(q->target, 3);
  q->target = 6;
  EXPECT_THAT(traffic.Table(1), ElementsAre(0));
  EXPECT_EQ(traffic.Step(), 1);  // 4 tokens: still one block
  EXPECT_THAT(traffic.Table(1), ElementsAre(0));
  EXPECT_EQ(traffic.Step(), 1);  // 5: a second
  EXPECT_THAT(traffic.Table(1), ElementsAre(0, 1));
  EXPECT_EQ(alloc.num_free(), 8);
  EXPECT_EQ(traffic.Step(), 1);  // 6: at its target, finished
  EXPECT_THAT(traffic.live(), IsEmpty());
  EXPECT_EQ(alloc.num_free(), 10);
  EXPECT_EQ(traffic.Step(), 0);
}

TEST(Traffic, AdmitsOnlyWhatFitsAndNumbersInOrderOfArrival) {
  BlockAllocator alloc(4, BlockOrder::kAscending);
  Traffic traffic(&alloc, 4, true);
  ASSERT_NE(traffic.Admit(12), nullptr);  // 3 blocks
  SeqId id = 0;
  EXPECT_EQ(traffic.Admit(8, &id), nullptr);  // 2 more: 1 free
  EXPECT_EQ(id, 0);
  EXPECT_EQ(alloc.num_free(), 1);
  ASSERT_NE(traffic.Admit(4, &id), nullptr);
  EXPECT_EQ(id, 2);  // the refused one took no id
  EXPECT_EQ(traffic.live().size(), 2u);
}

TEST(Traffic, PreemptsOrWaitsWhenThePoolIsFull) {
  BlockAllocator alloc(2, BlockOrder::kAscending);
  Traffic traffic(&alloc, 4, true);
  Traffic::Live* a = traffic.Admit(4);  // id 1, full block
  Traffic::Live* b = traffic.Admit(4);  // id 2
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  a->target = b->target = 8;
  a->preemptible = false;        // waits; b is preempted
  EXPECT_EQ(traffic.Step(), 0);  // a finds no block and waits, b goes
  EXPECT_EQ(traffic.preempted(), 1);
  ASSERT_EQ(traffic.live().size(), 1u);
  EXPECT_EQ(traffic.live().at(1).tokens, 4);
  EXPECT_EQ(traffic.Step(), 1);  // b's block is free now
  EXPECT_THAT(traffic.Table(1), ElementsAre(0, 1));
  a->stays = true;
  for (int i = 0; i < 5; ++i) traffic.Step();
  EXPECT_EQ(traffic.live().at(1).tokens, 8);  // stays at its target
  EXPECT_EQ(alloc.num_free(), 0);
}

// The header's promise: through a SequenceManager and straight from an
// allocator passing the table lengths, the same traffic gets the same ids
// (kRuns, whose gaps read the lengths); without the lengths, other ids.
TEST(Traffic, ManagerAndAllocatorHandOutTheSameTables) {
  constexpr int64_t kBs = 16, kPool = 500;
  auto run = [&](int model) {
    BlockAllocator alloc(kPool, BlockOrder::kRuns);
    SequenceManager seqs(&alloc, nullptr, kBs, /*max_seq_len=*/4096,
                         /*max_sequences=*/64);
    Traffic manager(&seqs);
    Traffic direct(&alloc, kBs, /*pass_length=*/model == 1);
    Traffic& t = model == 0 ? manager : direct;
    std::mt19937_64 rng(3);
    auto uni = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    std::vector<BlockId> tables;
    for (int step = 0; step < 3000; ++step) {
      while (t.live().size() < 12) {
        const int64_t prompt = uni(16, 512);
        Traffic::Live* q = t.Admit(prompt);
        if (q == nullptr) break;
        q->target = prompt + uni(16, 1024);
      }
      t.Step();
    }
    for (const auto& [id, q] : t.live()) {
      EXPECT_EQ(static_cast<int64_t>(t.Table(id).size()),
                (q.tokens + kBs - 1) / kBs);
      tables.insert(tables.end(), t.Table(id).begin(), t.Table(id).end());
    }
    EXPECT_GT(t.preempted(), 0);  // the pool ran full, as intended
    return tables;
  };
  const std::vector<BlockId> manager = run(0), lengths = run(1), none = run(2);
  EXPECT_FALSE(manager.empty());
  EXPECT_EQ(manager, lengths);
  EXPECT_NE(manager, none);
}

// A refusal other than for want of blocks is the simulation's own setup:
// it stops the run rather than look like a full pool.
TEST(TrafficDeathTest, AbortsOnARequestTheManagerRejects) {
  BlockAllocator alloc(100, BlockOrder::kAscending);
  SequenceManager seqs(&alloc, nullptr, 16, /*max_seq_len=*/64,
                       /*max_sequences=*/4);
  Traffic traffic(&seqs);
  EXPECT_DEATH(traffic.Admit(65), "Traffic: OUT_OF_RANGE");
}

TEST(Traffic, CountAdjacent) {
  int64_t pairs = 0, consecutive = 0;
  const std::vector<BlockId> t = {4, 5, 6, 9, 8, 9};
  CountAdjacent(t, &pairs, &consecutive);
  EXPECT_EQ(pairs, 5);
  EXPECT_EQ(consecutive, 3);  // 4-5, 5-6, 8-9
  CountAdjacent({}, &pairs, &consecutive);
  CountAdjacent(std::vector<BlockId>{7}, &pairs, &consecutive);
  EXPECT_EQ(pairs, 5);
}

}  // namespace
}  // namespace kvstep
