// Block manager tests (SEMANTICS §8): sharing, copy-on-write, prefix
// caching with eviction, admission, the host tier and KV events, plus a
// model-based random test that tracks what token every slot holds.
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "core/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace kvstep {
namespace {

using ::kvstep::testing_util::I64;
using ::kvstep::testing_util::Values;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kBs = 4;

std::unique_ptr<Engine> MakeEngine(int64_t num_blocks, int64_t host = 0,
                                   double watermark = 0.01,
                                   BlockOrder order = BlockOrder::kDescending) {
  EngineOptions o;
  o.block_order = order;
  o.cache.num_blocks = num_blocks;
  o.cache.block_size = kBs;
  o.cache.num_layers = 2;
  o.cache.num_kv_heads = 1;
  o.cache.head_size = 8;
  o.cache.dtype = DType::kFloat16;
  o.num_host_blocks = host;
  o.watermark = watermark;
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return *std::move(e);
}

// Fills every layer's K and V bytes of a block with `v`.
void FillBlock(const KvCache& c, int64_t block, uint8_t v) {
  const size_t n = static_cast<size_t>(c.config().bytes_per_block());
  for (int64_t l = 0; l < c.config().num_layers; ++l) {
    std::memset(static_cast<char*>(c.key(l).raw_data()) + block * n, v, n);
    std::memset(static_cast<char*>(c.value(l).raw_data()) + block * n, v + 1,
                n);
  }
}

bool BlockIs(const KvCache& c, int64_t block, uint8_t v) {
  const size_t n = static_cast<size_t>(c.config().bytes_per_block());
  for (int64_t l = 0; l < c.config().num_layers; ++l) {
    const auto* k =
        static_cast<const uint8_t*>(c.key(l).raw_data()) + block * n;
    const auto* val =
        static_cast<const uint8_t*>(c.value(l).raw_data()) + block * n;
    for (size_t i = 0; i < n; ++i) {
      if (k[i] != v || val[i] != static_cast<uint8_t>(v + 1)) return false;
    }
  }
  return true;
}

BatchRowSpec Row(SeqId id, std::vector<int64_t> tokens, int64_t cached) {
  BatchRowSpec r;
  r.seq_id = id;
  r.token_ids = std::move(tokens);
  r.num_cached_tokens = cached;
  return r;
}

std::vector<int64_t> Iota(int64_t n, int64_t from = 1) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

AdvanceInput Sampled(std::vector<int64_t> tokens) {
  AdvanceInput in;
  in.sampled_token_ids = I64({static_cast<int64_t>(tokens.size()), 1}, tokens);
  return in;
}

SequenceRequest Req(SeqId id, int64_t tokens, std::vector<int64_t> prompt = {},
                    std::string extra = "") {
  SequenceRequest r;
  r.seq_id = id;
  r.num_tokens = tokens;
  r.prompt_token_ids = std::move(prompt);
  r.extra_key = std::move(extra);
  return r;
}

// A fork shares the blocks its parent has filled, not those the parent
// allocated ahead; a step checks only the block it writes (its cost must
// not grow with the table), and a prefill chunk the blocks it covers.
TEST(Fork, BlocksAllocatedAheadStayTheParents) {
  auto e = MakeEngine(32);
  ASSERT_TRUE(e->AllocateBlocks({Req(1, 40)}).ok());  // 10 blocks ahead
  BatchSpec s;
  s.rows = {Row(1, Iota(5), 0)};
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, false);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(e->ForkSequence(1, std::vector<SeqId>{2}).ok());
  EXPECT_EQ(e->Stats().used_blocks, 10);
  // Position 5 is in entry 1, shared: refused, nothing changed.
  absl::StatusOr<AdvanceResult> r =
      e->AdvanceStep(b->batch_id, Sampled({9}), false, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("position 5 is in block 1 of the sequence, which is "
                        "shared"));
  // A chunk starting in shared entry 0 is refused, naming its position.
  BatchSpec chunk;
  chunk.rows = {Row(1, {3, 4}, 3)};
  absl::StatusOr<CreateBatchResult> c = e->CreateBatch(chunk, {}, false);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("position 3 is in block 0 of the sequence, which is "
                        "shared"));
  // The parent copies entry 1 only; entry 0 stays shared.
  absl::StatusOr<AllocateResult> a = e->AllocateBlocks({Req(1, 6)});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->sequences[0].copies.size(), 1u);
  EXPECT_EQ(e->Stats().used_blocks, 11);
  const std::vector<BlockId> table = a->sequences[0].block_table;
  ASSERT_EQ(table.size(), 10u);
  // The parent steps through the rest of its table.
  for (int64_t pos = 5; pos < 40; ++pos) {
    r = e->AdvanceStep(b->batch_id, Sampled({9}), true, false);
    ASSERT_TRUE(r.ok()) << "position " << pos << ": " << r.status();
    EXPECT_THAT(Values(r->snapshot.tensors.state.slot_mapping),
                ElementsAre(table[pos / kBs] * kBs + pos % kBs));
  }
  EXPECT_EQ(
      e->AdvanceStep(b->batch_id, Sampled({9}), false, false).status().code(),
      absl::StatusCode::kOutOfRange);  // past the 40 allocated
  // Chunks inside the parent's own blocks are fine.
  chunk.rows = {Row(1, {3, 4, 5, 6}, 4)};
  EXPECT_TRUE(e->CreateBatch(chunk, {}, false).ok());
  ASSERT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
}

TEST(Fork, SharesBlocksAndCopiesOnFirstWrite) {
  auto e = MakeEngine(16);
  ASSERT_TRUE(e->AllocateBlocks({Req(1, 8)}).ok());
  BatchSpec s;
  s.rows = {Row(1, Iota(5), 0)};  // 5 tokens: block 1 is partly filled
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, false);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(e->ForkSequence(1, std::vector<SeqId>{2}).ok());
  EXPECT_EQ(e->ForkSequence(1, std::vector<SeqId>{3, 2}).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(e->Info().num_sequences, 2);  // seq 3 was not created either
  EXPECT_EQ(e->ForkSequence(9, std::vector<SeqId>{3}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(e->Stats().used_blocks, 2);  // shared, not copied yet
  ASSERT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();

  // Parent and child both want to write position 5, in shared block 14.
  FillBlock(e->cache(), 14, 0x21);
  // The parent's live batch cannot advance into the shared block.
  absl::StatusOr<AdvanceResult> r =
      e->AdvanceStep(b->batch_id, Sampled({9}), false, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("row 0 (seq 1): position 5 is in block 1 of the "
                        "sequence, which is shared"));
  BatchSpec child;
  child.rows = {Row(2, {7}, 5)};
  EXPECT_EQ(e->CreateBatch(child, {}, false).status().code(),
            absl::StatusCode::kFailedPrecondition);

  // One AllocateBlocks for both: one copy, and the other keeps the block.
  absl::StatusOr<AllocateResult> a = e->AllocateBlocks({Req(1, 6), Req(2, 6)});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->sequences[0].copies.size(), 1u);
  EXPECT_EQ(a->sequences[0].copies[0].src, 14);
  const BlockId dst = a->sequences[0].copies[0].dst;
  EXPECT_TRUE(a->sequences[1].copies.empty());
  EXPECT_THAT(a->sequences[0].block_table, ElementsAre(15, dst));
  EXPECT_THAT(a->sequences[1].block_table, ElementsAre(15, 14));
  EXPECT_TRUE(BlockIs(e->cache(), dst, 0x21));  // bytes copied, all layers
  ASSERT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();

  // The batch's table now shows the copy; it advances into its own block.
  r = e->AdvanceStep(b->batch_id, Sampled({9}), true, false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(Values(r->snapshot.tensors.state.slot_mapping),
              ElementsAre(dst * kBs + 1));
  EXPECT_TRUE(e->CreateBatch(child, {}, false).ok());
  // Freeing the parent leaves the child's blocks alone.
  (void)e->FreeSequences(std::vector<SeqId>{1});
  ASSERT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
  EXPECT_EQ(e->Stats().used_blocks, 2);
}

TEST(PrefixCache, ReusesTheLongestCachedChain) {
  auto e = MakeEngine(32);
  const std::vector<int64_t> prompt = Iota(10);  // blocks [1-4][5-8][9,10]
  absl::StatusOr<AllocateResult> a =
      e->AllocateBlocks({Req(1, 11, prompt, "lora-a")});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->sequences[0].computed_tokens, 0);  // cold cache
  BatchSpec s;
  s.rows = {Row(1, prompt, 0)};
  ASSERT_TRUE(e->CreateBatch(s, {}, false).ok());
  EXPECT_EQ(e->Stats().cached_blocks, 2);  // the two full blocks

  // Same prompt and adapter: both full blocks are hit.
  a = e->AllocateBlocks({Req(2, 11, prompt, "lora-a")});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->sequences[0].computed_tokens, 8);
  EXPECT_THAT(a->sequences[0].block_table,
              ElementsAre(31, 30, a->sequences[0].new_blocks[0]));
  // The cached tokens can be claimed by a batch row.
  BatchSpec s2;
  s2.rows = {Row(2, {9, 10}, 8)};
  ASSERT_TRUE(e->CreateBatch(s2, {}, false).ok()) << "hit tokens usable";
  // A retry of the same call changes nothing and reports the same hits.
  a = e->AllocateBlocks({Req(2, 11, prompt, "lora-a")});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->sequences[0].computed_tokens, 8);
  EXPECT_TRUE(a->sequences[0].new_blocks.empty());

  // Another adapter: no hit. A prompt differing in block 2: one hit.
  a = e->AllocateBlocks({Req(3, 11, prompt, "lora-b")});
  EXPECT_EQ(a->sequences[0].computed_tokens, 0);
  std::vector<int64_t> other = prompt;
  other[6] = 99;
  a = e->AllocateBlocks({Req(4, 11, other, "lora-a")});
  EXPECT_EQ(a->sequences[0].computed_tokens, 4);
  // The last prompt token is always recomputed: an 8-token prompt hits one
  // block, not two.
  a = e->AllocateBlocks({Req(5, 9, Iota(8), "lora-a")});
  EXPECT_EQ(a->sequences[0].computed_tokens, 4);
  BlockStats st = e->Stats();
  EXPECT_EQ(st.prefix_query_tokens, 10 + 10 + 10 + 10 + 8);
  EXPECT_EQ(st.prefix_hit_tokens, 8 + 4 + 4);
  EXPECT_NEAR(st.prefix_hit_rate, 16.0 / 48, 1e-9);
  ASSERT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
  // A prompt that disagrees with an existing sequence's is refused.
  EXPECT_EQ(e->AllocateBlocks({Req(2, 11, other, "lora-a")}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PrefixCache, FreedBlocksStayCachedUntilEvictedLeastRecentlyUsedFirst) {
  auto e = MakeEngine(8);
  // Two sequences with different prompts fill 2 full blocks each.
  for (SeqId id : {1, 2}) {
    const std::vector<int64_t> p = Iota(8, 100 * id);
    ASSERT_TRUE(e->AllocateBlocks({Req(id, 9, p)}).ok());
    BatchSpec s;
    s.rows = {Row(id, p, 0)};
    absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, false);
    ASSERT_TRUE(b.ok()) << b.status();
    (void)e->ReleaseBatches(std::vector<BatchId>{b->batch_id});
  }
  (void)e->FreeSequences(std::vector<SeqId>{1});  // older
  (void)e->FreeSequences(std::vector<SeqId>{2});
  BlockStats st = e->Stats();
  EXPECT_EQ(st.evictable_blocks, 4);
  EXPECT_EQ(st.available_blocks, 8);
  EXPECT_EQ(st.used_blocks, 0);
  const int64_t events_before = e->next_event_seq_no();

  // Seq 1's prompt is still a hit after it was freed.
  absl::StatusOr<AllocateResult> a =
      e->AllocateBlocks({Req(3, 9, Iota(8, 100))});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->sequences[0].computed_tokens, 4);  // (8-1)/4 = 1 block
  // Taking 6 more blocks: 4 free (one was reused above... 8 - 3 owned = 5
  // available) and then the least recently used cached block is evicted:
  // seq 2's first... seq 1's second block was released before seq 2's.
  a = e->AllocateBlocks({Req(4, 20)});
  ASSERT_TRUE(a.ok()) << a.status();
  int64_t missed = 0;
  std::vector<KvEvent> ev =
      e->ReadEvents(events_before, 100, absl::ZeroDuration(), &missed);
  EXPECT_EQ(missed, 0);
  ASSERT_FALSE(ev.empty());
  for (const KvEvent& x : ev) {
    EXPECT_EQ(x.type, KvEvent::Type::kBlockRemoved);
  }
  ASSERT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
  // Shortage counts evictable blocks as available, and says what's missing.
  absl::StatusOr<AllocateResult> too_many = e->AllocateBlocks({Req(5, 40)});
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(too_many.status().message()),
              HasSubstr("blocks missing"));
}

TEST(PrefixCache, EventsDescribeStoredBlocksAndClears) {
  auto e = MakeEngine(16);
  const std::vector<int64_t> prompt = Iota(9);
  ASSERT_TRUE(e->AllocateBlocks({Req(1, 10, prompt, "salt")}).ok());
  BatchSpec s;
  s.rows = {Row(1, prompt, 0)};
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, false);
  ASSERT_TRUE(b.ok());
  int64_t missed = 0;
  std::vector<KvEvent> ev =
      e->ReadEvents(0, 100, absl::ZeroDuration(), &missed);
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].type, KvEvent::Type::kBlockStored);
  EXPECT_FALSE(ev[0].parent_hash.has_value());
  EXPECT_THAT(ev[0].token_ids, ElementsAre(1, 2, 3, 4));
  EXPECT_EQ(ev[0].extra_key, "salt");
  EXPECT_EQ(ev[1].parent_hash, ev[0].block_hashes[0]);
  EXPECT_THAT(ev[1].token_ids, ElementsAre(5, 6, 7, 8));
  EXPECT_EQ(ev[1].block_hashes[0],
            HashBlock(ev[0].block_hashes[0], ev[1].token_ids, "salt"));
  EXPECT_EQ(ev[1].seq_no, ev[0].seq_no + 1);

  // Decoding fills block 2: stored when its last token is scheduled.
  ASSERT_TRUE(e->AllocateBlocks({Req(1, 12)}).ok());
  for (int64_t t : {10, 11, 12}) {
    ASSERT_TRUE(e->AdvanceStep(b->batch_id, Sampled({t}), false, false).ok());
  }
  ev = e->ReadEvents(2, 100, absl::ZeroDuration(), &missed);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_THAT(ev[0].token_ids, ElementsAre(9, 10, 11, 12));

  e->ResetPrefixCache();
  ev = e->ReadEvents(3, 100, absl::ZeroDuration(), &missed);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, KvEvent::Type::kAllBlocksCleared);
  EXPECT_EQ(e->Stats().cached_blocks, 0);
  absl::StatusOr<AllocateResult> a =
      e->AllocateBlocks({Req(2, 10, prompt, "salt")});
  EXPECT_EQ(a->sequences[0].computed_tokens, 0);
  ASSERT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
}

TEST(EventLog, ReportsMissedEventsAndWaits) {
  EventLog log(3);
  for (int i = 0; i < 5; ++i) log.Append(KvEvent{});
  int64_t missed = 0;
  std::vector<KvEvent> ev = log.Read(0, 10, absl::ZeroDuration(), &missed);
  EXPECT_EQ(missed, 2);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0].seq_no, 2);
  const absl::Time t = absl::Now();
  ev = log.Read(5, 10, absl::Milliseconds(50), &missed);
  EXPECT_TRUE(ev.empty());
  EXPECT_GE(absl::Now() - t, absl::Milliseconds(40));
}

TEST(Admission, OkLaterNever) {
  auto e = MakeEngine(100, 0, /*watermark=*/0.1);  // 10 blocks of watermark
  int64_t needed = 0;
  EXPECT_EQ(*e->CanAllocate({Req(1, 40)}, &needed), Admission::kOk);
  EXPECT_EQ(needed, 10);
  ASSERT_TRUE(e->AllocateBlocks({Req(1, 4 * 85)}).ok());              // 15 left
  EXPECT_EQ(*e->CanAllocate({Req(2, 20)}, &needed), Admission::kOk);  // 5
  EXPECT_EQ(*e->CanAllocate({Req(2, 24)}, &needed), Admission::kLater);  // 6
  EXPECT_EQ(*e->CanAllocate({Req(2, 4 * 95)}, &needed), Admission::kNever);
  EXPECT_EQ(*e->CanAllocate({Req(2, 1 << 20)}, &needed), Admission::kNever);
  EXPECT_EQ(e->CanAllocate({Req(2, -1)}, &needed).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Stats().used_blocks, 85);  // nothing was allocated
}

TEST(HostTier, SwapOutAndInKeepTheBytes) {
  auto e = MakeEngine(8, /*host=*/4);
  ASSERT_TRUE(e->AllocateBlocks({Req(1, 7)}).ok());  // blocks 7, 6
  BatchSpec s;
  s.rows = {Row(1, Iota(6), 0)};
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, false);
  ASSERT_TRUE(b.ok());
  FillBlock(e->cache(), 7, 0x40);
  FillBlock(e->cache(), 6, 0x50);
  absl::StatusOr<SwapOutcome> out = e->SwapOut(std::vector<SeqId>{1});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->copies.size(), 2u);
  EXPECT_THAT(out->stale_batches, ElementsAre(b->batch_id));
  EXPECT_EQ(out->host_free_blocks, 2);
  ASSERT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
  // A swapped-out sequence can neither grow, nor be batched, nor advance.
  EXPECT_EQ(e->AllocateBlocks({Req(1, 8)}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(e->CreateBatch(s, {}, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      e->AdvanceStep(b->batch_id, Sampled({1}), false, false).status().code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(e->SwapOut(std::vector<SeqId>{1}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Fill the device meanwhile, then swap back in.
  ASSERT_TRUE(e->AllocateBlocks({Req(2, 8)}).ok());
  absl::StatusOr<SwapOutcome> in = e->SwapIn(std::vector<SeqId>{1});
  ASSERT_TRUE(in.ok()) << in.status();
  ASSERT_EQ(in->copies.size(), 2u);
  EXPECT_TRUE(BlockIs(e->cache(), in->copies[0].dst, 0x40));
  EXPECT_TRUE(BlockIs(e->cache(), in->copies[1].dst, 0x50));
  EXPECT_EQ(in->host_free_blocks, 4);
  ASSERT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
  // Its tokens are known, so a new batch can go on from the cache.
  BatchSpec again;
  again.rows = {Row(1, {7}, 6)};
  EXPECT_TRUE(e->CreateBatch(again, {}, false).ok());
  // Host shortage is all-or-nothing; no host tier at all is refused.
  ASSERT_TRUE(e->AllocateBlocks({Req(3, 20)}).ok() == false);
  auto no_host = MakeEngine(8);
  ASSERT_TRUE(no_host->AllocateBlocks({Req(1, 4)}).ok());
  EXPECT_EQ(no_host->SwapOut(std::vector<SeqId>{1}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(HostTier, ShortageChangesNothing) {
  auto e = MakeEngine(16, /*host=*/2);
  ASSERT_TRUE(e->AllocateBlocks({Req(1, 8), Req(2, 4)}).ok());
  absl::StatusOr<SwapOutcome> out = e->SwapOut(std::vector<SeqId>{1, 2});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(out.status().message()),
              HasSubstr("1 blocks missing"));
  EXPECT_EQ(e->Stats().used_blocks, 3);
  EXPECT_EQ(e->Stats().host_free_blocks, 2);
  ASSERT_TRUE(e->CheckInvariants().ok());
}

// The model: what token every (tier, block, offset) holds, driven by the
// slots each step reports. After every operation the engine's invariants
// are audited, every prefix hit must serve exactly the prompt's tokens, and
// no write may land in a block another live sequence holds.
class BlockManagerModel : public ::testing::TestWithParam<BlockOrder> {};

TEST_P(BlockManagerModel, RandomOperationsAgainstAModel) {
  auto e = MakeEngine(48, /*host=*/24, 0.01, GetParam());
  std::mt19937_64 rng(3);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::map<int64_t, int64_t> device, host;  // slot -> token
  std::set<SeqId> live, swapped;
  std::map<SeqId, std::vector<BlockId>> tables;  // live, on the device
  BatchId batch = 0;
  int hits = 0, copies = 0, swaps = 0, advances = 0, forks = 0;
  // Prompts share prefixes: 3 stems of 8 tokens plus a tail.
  auto prompt = [&] {
    std::vector<int64_t> p = Iota(8, 1000 * uni(0, 2));
    const int64_t tail = uni(0, 6);
    for (int64_t i = 0; i < tail; ++i) p.push_back(uni(0, 3));
    return p;
  };
  auto copy_block = [&](std::map<int64_t, int64_t>& from, BlockId src,
                        std::map<int64_t, int64_t>& to, BlockId dst) {
    for (int64_t o = 0; o < kBs; ++o) {
      to.erase(dst * kBs + o);
      auto it = from.find(src * kBs + o);
      if (it != from.end()) to[dst * kBs + o] = it->second;
    }
  };
  auto check_writes = [&](const BatchTensors& t, int64_t n_tokens) {
    const std::vector<int64_t> slots = Values(t.state.slot_mapping);
    const std::vector<int64_t> toks = Values(t.state.input_tokens);
    for (int64_t k = 0; k < n_tokens; ++k) {
      if (slots[k] < 0) continue;
      const BlockId b = static_cast<BlockId>(slots[k] / kBs);
      int holders = 0;
      for (const auto& [id, table] : tables) {
        holders += std::count(table.begin(), table.end(), b) > 0;
      }
      ASSERT_EQ(holders, 1)
          << "write into block " << b << " held by " << holders << " sequences";
      device[slots[k]] = toks[k];
    }
  };
  std::map<SeqId, int64_t> ntok;  // computed tokens, as the engine counts
  std::map<SeqId, std::vector<int64_t>> prompts;
  auto grow = [&](SeqId id, const AllocateResult& r) {
    for (const BlockCopy& c : r.sequences[0].copies) {
      copy_block(device, c.src, device, c.dst);
      ++copies;
    }
    tables[id] = r.sequences[0].block_table;
  };
  auto refresh = [&](SeqId id) {
    absl::StatusOr<AllocateResult> r = e->AllocateBlocks({Req(id, 0)});
    ASSERT_TRUE(r.ok());
    tables[id] = r->sequences[0].block_table;
  };
  for (int op = 0; op < 4000; ++op) {
    const SeqId id = static_cast<SeqId>(uni(1, 6));
    switch (uni(0, 8)) {
      case 0:
      case 1: {  // allocate (create with a prompt, or grow with CoW)
        const bool exists = live.count(id) > 0;
        std::vector<int64_t> p = exists ? std::vector<int64_t>{} : prompt();
        absl::StatusOr<AllocateResult> r = e->AllocateBlocks({Req(
            id, exists ? uni(0, 40) : static_cast<int64_t>(p.size()) + 1, p)});
        if (!r.ok()) break;
        const SequenceBlocks& sb = r->sequences[0];
        grow(id, *r);
        live.insert(id);
        if (!exists) {
          ntok[id] = sb.computed_tokens;
          prompts[id] = p;
        }
        for (int64_t pos = 0; !exists && pos < sb.computed_tokens; ++pos) {
          const int64_t slot = sb.block_table[pos / kBs] * kBs + pos % kBs;
          ASSERT_TRUE(device.count(slot)) << "hit on a never-written slot";
          ASSERT_EQ(device[slot], p[pos]) << "prefix hit served other tokens";
        }
        hits += !exists && sb.computed_tokens > 0;
        break;
      }
      case 2:  // free
        if (live.count(id)) {
          (void)e->FreeSequences(std::vector<SeqId>{id});
          live.erase(id);
          swapped.erase(id);
          tables.erase(id);
          ntok.erase(id);
        }
        break;
      case 3: {  // fork
        const SeqId child = static_cast<SeqId>(uni(1, 6));
        if (e->ForkSequence(id, std::vector<SeqId>{child}).ok()) {
          live.insert(child);
          ntok[child] = ntok[id];
          prompts[child] = prompts[id];
          refresh(child);
          ++forks;
        }
        break;
      }
      case 4: {  // swap out or in
        if (!live.count(id)) break;
        const bool out = !swapped.count(id);
        const std::vector<BlockId> before =
            tables.count(id) ? tables[id] : std::vector<BlockId>{};
        absl::StatusOr<SwapOutcome> r = out ? e->SwapOut(std::vector<SeqId>{id})
                                            : e->SwapIn(std::vector<SeqId>{id});
        if (!r.ok()) break;
        for (const BlockCopy& c : r->copies) {
          if (out) {
            copy_block(device, c.src, host, c.dst);
          } else {
            copy_block(host, c.src, device, c.dst);
          }
        }
        if (out) {
          swapped.insert(id);
          tables.erase(id);
        } else {
          swapped.erase(id);
          refresh(id);
        }
        ++swaps;
        break;
      }
      case 5:
      case 6: {  // a batch: one new token for every live device sequence
        // Sequences still in their prompt prefill the rest of it (prefill
        // rows first); the others decode one token.
        BatchSpec s;
        std::vector<BatchRowSpec> decode;
        for (SeqId sid : live) {
          if (swapped.count(sid)) continue;
          const std::vector<int64_t>& pr = prompts[sid];
          std::vector<int64_t> toks;
          if (ntok[sid] < static_cast<int64_t>(pr.size())) {
            toks.assign(pr.begin() + ntok[sid], pr.end());
          } else {
            toks = {uni(0, 3)};
          }
          // Grow for the row, copying any shared block first.
          absl::StatusOr<AllocateResult> g = e->AllocateBlocks(
              {Req(sid, ntok[sid] + static_cast<int64_t>(toks.size()))});
          if (!g.ok()) continue;
          grow(sid, *g);
          BatchRowSpec row = Row(sid, toks, ntok[sid]);
          if (toks.size() > 1 || ntok[sid] < static_cast<int64_t>(pr.size())) {
            row.prefill = true;
            s.rows.push_back(row);
          } else {
            decode.push_back(row);
          }
        }
        s.rows.insert(s.rows.end(), decode.begin(), decode.end());
        if (s.rows.empty()) break;
        std::vector<BatchId> release;
        if (batch != 0) release.push_back(batch);
        absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, release, true);
        ASSERT_TRUE(b.ok()) << b.status();
        batch = b->batch_id;
        check_writes(b->snapshot.tensors,
                     b->snapshot.tensors.state.input_tokens.numel());
        for (const BatchRowSpec& r : s.rows) {
          ntok[r.seq_id] =
              r.num_cached_tokens + static_cast<int64_t>(r.token_ids.size());
        }
        break;
      }
      default: {  // advance the batch after growing its sequences
        if (batch == 0) break;
        absl::StatusOr<BatchSnapshot> snap = e->GetBatch(batch);
        ASSERT_TRUE(snap.ok());
        for (SeqId sid : snap->seq_ids) {
          if (!live.count(sid) || swapped.count(sid)) continue;
          absl::StatusOr<AllocateResult> g =
              e->AllocateBlocks({Req(sid, ntok[sid] + 1)});
          if (g.ok()) grow(sid, *g);
        }
        std::vector<int64_t> sampled(snap->meta.num_queries);
        for (int64_t& t : sampled) t = uni(0, 3);
        absl::StatusOr<AdvanceResult> r =
            e->AdvanceStep(batch, Sampled(sampled), true, false);
        if (!r.ok()) break;  // a stale row, or a sequence could not grow
        ++advances;
        check_writes(r->snapshot.tensors, r->snapshot.meta.num_queries);
        const std::vector<int64_t> lens =
            Values(r->snapshot.tensors.state.seq_lens);
        for (size_t i = 0; i < r->snapshot.seq_ids.size(); ++i) {
          ntok[r->snapshot.seq_ids[i]] = lens[i];
        }
        break;
      }
    }
    if (uni(0, 200) == 0) e->ResetPrefixCache();
    ASSERT_TRUE(e->CheckInvariants().ok())
        << "after op " << op << ": " << e->CheckInvariants();
  }
  EXPECT_GT(hits, 20);
  EXPECT_GT(copies, 5);
  EXPECT_GT(swaps, 20);
  EXPECT_GT(forks, 20);
  EXPECT_GT(advances, 50);
  // Free everything: every block is available again.
  (void)e->ReleaseBatches(std::vector<BatchId>{batch});
  (void)e->FreeSequences(std::vector<SeqId>{1, 2, 3, 4, 5, 6});
  BlockStats st = e->Stats();
  EXPECT_EQ(st.available_blocks, 48);
  EXPECT_EQ(st.used_blocks, 0);
  EXPECT_EQ(st.host_free_blocks, 24);
}

INSTANTIATE_TEST_SUITE_P(Orders, BlockManagerModel,
                         ::testing::Values(BlockOrder::kDescending,
                                           BlockOrder::kRuns),
                         [](const ::testing::TestParamInfo<BlockOrder>& i) {
                           return std::string(BlockOrderName(i.param));
                         });

}  // namespace
}  // namespace kvstep
