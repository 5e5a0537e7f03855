// Engine tests: blocks, batches and server-held AdvanceStep working
// together, with the invariants audited after the operations.
#include "core/engine.h"

#include <atomic>
#include <chrono>
#include <future>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace kvstep {
namespace {

using ::kvstep::testing_util::I64;
using ::kvstep::testing_util::Values;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

std::unique_ptr<Engine> MakeEngine(int64_t num_blocks, int64_t block_size = 16,
                                   EngineLimits limits = {}) {
  EngineOptions o;
  o.cache.num_blocks = num_blocks;
  o.cache.block_size = block_size;
  o.cache.num_layers = 1;
  o.cache.num_kv_heads = 1;
  o.cache.head_size = 1;
  o.cache.dtype = DType::kFloat16;
  o.cache.layout = CacheLayout::kNhd;
  o.limits = limits;
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return *std::move(e);
}

// A bf16 tensor of random values of magnitude 0.0078..1, a third of them
// negative.
Tensor RandomBf16(std::mt19937& rng, const Shape& shape) {
  std::uniform_int_distribution<int> bits(0x3c00, 0x3f7f);
  Tensor t = *Tensor::Zeros(CpuDevice(), DType::kBFloat16, shape);
  uint16_t* p = t.data<uint16_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    p[i] = static_cast<uint16_t>(bits(rng) | (i % 3 == 0 ? 0x8000 : 0));
  }
  return t;
}

// One layer of bf16 K/V in blocks of 16, attention on the calling thread.
EngineOptions Bf16AttentionOptions(int64_t num_blocks, int64_t kv_heads,
                                   int64_t head_size) {
  EngineOptions o;
  o.cache.num_blocks = num_blocks;
  o.cache.block_size = 16;
  o.cache.num_layers = 1;
  o.cache.num_kv_heads = kv_heads;
  o.cache.head_size = head_size;
  o.cache.dtype = DType::kBFloat16;
  o.attention_threads = 1;
  return o;
}

std::vector<uint8_t> Bytes(const Tensor& t) {
  const auto* b = static_cast<const uint8_t*>(t.raw_data());
  return std::vector<uint8_t>(b, b + t.nbytes());
}

BatchRowSpec Row(SeqId id, int64_t num_tokens, int64_t cached,
                 bool skip = false) {
  BatchRowSpec r;
  r.seq_id = id;
  for (int64_t i = 0; i < num_tokens; ++i) r.token_ids.push_back(100 + i);
  r.num_cached_tokens = cached;
  r.skip_sampling = skip;
  return r;
}

AdvanceInput Sampled(const std::vector<int64_t>& tokens) {
  AdvanceInput in;
  const int64_t n = static_cast<int64_t>(tokens.size());
  in.sampled_token_ids = I64({n, 1}, tokens);
  return in;
}

std::vector<std::vector<int64_t>> All(const BatchSnapshot& s) {
  const BatchTensors& t = s.tensors;
  return {Values(t.state.input_tokens), Values(t.state.input_positions),
          Values(t.state.seq_lens),     Values(t.state.slot_mapping),
          Values(t.state.block_tables), Values(t.query_start_loc),
          Values(t.seq_start_loc),      Values(t.context_lens)};
}

TEST(EngineSeed003, FivePromptsPrefillThenFirstDecode) {
  auto e = MakeEngine(1000);
  std::vector<SequenceRequest> req;
  for (SeqId k = 0; k < 5; ++k) req.push_back({k, 196});
  absl::StatusOr<AllocateResult> a = e->AllocateBlocks(req);
  ASSERT_TRUE(a.ok()) << a.status();
  for (int64_t k = 0; k < 5; ++k) {
    ASSERT_EQ(a->sequences[k].block_table.size(), 13u);
    for (int64_t j = 0; j < 13; ++j) {
      EXPECT_EQ(a->sequences[k].block_table[j], 999 - 13 * k - j);
    }
  }
  BatchSpec spec;
  for (SeqId k = 0; k < 5; ++k) spec.rows.push_back(Row(k, 195, 0));
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(spec, {}, true);
  ASSERT_TRUE(b.ok()) << b.status();
  const BatchSnapshot& s = b->snapshot;
  EXPECT_EQ(s.meta.num_prefills, 5);
  EXPECT_EQ(s.meta.num_prefill_tokens, 975);
  EXPECT_EQ(s.meta.num_decode_tokens, 0);
  const std::vector<int64_t> slots = Values(s.tensors.state.slot_mapping);
  ASSERT_EQ(slots.size(), 975u);
  // The seed's printed prefill slot_mapping: 15984..15999 (block 999), then
  // 15968.. (block 998); sequence 0 ends at 15794 and sequence 1 starts at
  // block 986 (15776); the last is 14962.
  for (int64_t j = 0; j < 16; ++j) EXPECT_EQ(slots[j], 15984 + j);
  EXPECT_EQ(slots[16], 15968);
  EXPECT_EQ(slots[194], 15794);
  EXPECT_EQ(slots[195], 15776);
  EXPECT_EQ(slots[974], 14962);

  absl::StatusOr<AdvanceResult> r =
      e->AdvanceStep(b->batch_id, Sampled({1, 2, 3, 4, 5}), true, false);
  ASSERT_TRUE(r.ok()) << r.status();
  const BatchTensors& t = r->snapshot.tensors;
  EXPECT_THAT(Values(t.state.slot_mapping),
              ElementsAre(15795, 15587, 15379, 15171, 14963));
  EXPECT_THAT(Values(t.state.seq_lens), ElementsAre(196, 196, 196, 196, 196));
  EXPECT_THAT(Values(t.state.input_positions),
              ElementsAre(195, 195, 195, 195, 195));
  EXPECT_THAT(Values(t.state.input_tokens), ElementsAre(1, 2, 3, 4, 5));
  EXPECT_EQ(r->snapshot.meta.num_decode_tokens, 5);
  EXPECT_EQ(r->snapshot.meta.max_decode_seq_len, 196);
  EXPECT_TRUE(e->CheckInvariants().ok());
}

// Seed 003's chunked-prefill trace. A pool of 128234 blocks (descending)
// with A (the 484-token prompt) allocated before B reproduces the seed's
// step-3 slots 2051253 and 2050756 exactly. The seed prints step 2 and 3
// with the decode row first; SEMANTICS puts prefill rows first, so B's row
// comes first here and the same values appear in that order.
TEST(EngineSeed003, ChunkedPrefillFlow) {
  auto e = MakeEngine(128234);
  const SeqId A = 1, B = 2;
  ASSERT_TRUE(e->AllocateBlocks({{A, 484}, {B, 484}}).ok());

  // Step 1: B's first 28-token chunk, A's whole prompt.
  BatchSpec s1;
  s1.rows = {Row(B, 28, 0, /*skip=*/true), Row(A, 484, 0)};
  absl::StatusOr<CreateBatchResult> b1 = e->CreateBatch(s1, {}, true);
  ASSERT_TRUE(b1.ok()) << b1.status();
  const BatchSnapshot& m1 = b1->snapshot;
  EXPECT_EQ(m1.meta.num_prefills, 2);
  EXPECT_EQ(m1.meta.num_prefill_tokens, 512);
  EXPECT_EQ(m1.meta.num_decode_tokens, 0);
  EXPECT_EQ(m1.meta.max_query_len, 484);
  EXPECT_EQ(m1.meta.max_prefill_seq_len, 484);
  EXPECT_EQ(m1.meta.max_decode_seq_len, 0);
  EXPECT_THAT(Values(m1.tensors.state.seq_lens), ElementsAre(28, 484));
  EXPECT_THAT(Values(m1.tensors.query_start_loc), ElementsAre(0, 28, 512));
  EXPECT_THAT(Values(m1.tensors.seq_start_loc), ElementsAre(0, 28, 512));
  EXPECT_THAT(Values(m1.tensors.context_lens), ElementsAre(0, 0));

  // Step 2: the rest of B (456 tokens after 28 cached), A's first decode.
  BatchSpec s2;
  s2.rows = {Row(B, 456, 28), Row(A, 1, 484)};
  const BatchId release[] = {b1->batch_id};
  absl::StatusOr<CreateBatchResult> b2 = e->CreateBatch(s2, release, true);
  ASSERT_TRUE(b2.ok()) << b2.status();
  EXPECT_THAT(b2->released, ElementsAre(b1->batch_id));
  const BatchSnapshot& m2 = b2->snapshot;
  EXPECT_EQ(m2.meta.num_prefills, 1);
  EXPECT_EQ(m2.meta.num_prefill_tokens, 456);
  EXPECT_EQ(m2.meta.num_decode_tokens, 1);
  EXPECT_EQ(m2.meta.max_query_len, 456);
  EXPECT_EQ(m2.meta.max_prefill_seq_len, 484);
  EXPECT_EQ(m2.meta.max_decode_seq_len, 485);
  EXPECT_THAT(Values(m2.tensors.state.seq_lens), ElementsAre(484, 485));
  EXPECT_THAT(Values(m2.tensors.query_start_loc), ElementsAre(0, 456, 457));
  EXPECT_THAT(Values(m2.tensors.seq_start_loc), ElementsAre(0, 484, 969));
  EXPECT_THAT(Values(m2.tensors.context_lens), ElementsAre(28, 484));

  // Step 3: both decode, advanced from the server-held state.
  absl::StatusOr<AdvanceResult> r =
      e->AdvanceStep(b2->batch_id, Sampled({7, 8}), true, false);
  ASSERT_TRUE(r.ok()) << r.status();
  const BatchSnapshot& m3 = r->snapshot;
  EXPECT_EQ(m3.meta.num_prefills, 0);
  EXPECT_EQ(m3.meta.num_prefill_tokens, 0);
  EXPECT_EQ(m3.meta.num_decode_tokens, 2);
  EXPECT_EQ(m3.meta.max_query_len, 1);
  EXPECT_EQ(m3.meta.max_decode_seq_len, 486);
  EXPECT_THAT(Values(m3.tensors.state.slot_mapping),
              ElementsAre(2050756, 2051253));
  EXPECT_THAT(Values(m3.tensors.state.seq_lens), ElementsAre(485, 486));
  EXPECT_THAT(Values(m3.tensors.query_start_loc), ElementsAre(0, 1, 2));
  EXPECT_THAT(Values(m3.tensors.seq_start_loc), ElementsAre(0, 485, 971));
  EXPECT_THAT(Values(m3.tensors.context_lens), ElementsAre(484, 485));
  EXPECT_THAT(Values(m3.tensors.state.input_tokens), ElementsAre(7, 8));
  EXPECT_TRUE(e->CheckInvariants().ok());
}

TEST(EngineTurn, AdvancingAMixedBatchDropsUnsampledChunks) {
  auto e = MakeEngine(100, 4);
  ASSERT_TRUE(e->AllocateBlocks({{1, 10}, {2, 10}, {3, 10}}).ok());
  BatchSpec s;
  // 1: unfinished chunk; 2: whole prompt; 3: decode-ready single token
  // prefill. One padding row.
  s.rows = {Row(1, 3, 0, true), Row(2, 5, 0), Row(3, 1, 0)};
  s.rows[2].prefill = true;
  s.num_padding_rows = 1;
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, true);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->snapshot.meta.num_prefills, 3);
  EXPECT_THAT(Values(b->snapshot.tensors.state.slot_mapping).back(), -1);

  // Wrong count: one sampled token per sampled row (2), not per row.
  absl::StatusOr<AdvanceResult> bad =
      e->AdvanceStep(b->batch_id, Sampled({1, 2, 3}), false, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("[2, 1]"));
  ASSERT_EQ(All(*e->GetBatch(b->batch_id)), All(b->snapshot));

  absl::StatusOr<AdvanceResult> r =
      e->AdvanceStep(b->batch_id, Sampled({50, 60}), true, false);
  ASSERT_TRUE(r.ok()) << r.status();
  const BatchSnapshot& m = r->snapshot;
  EXPECT_THAT(m.seq_ids, ElementsAre(2, 3));
  EXPECT_EQ(m.meta.num_seqs, 3);  // 2 rows + padding
  EXPECT_EQ(m.meta.num_queries, 2);
  EXPECT_THAT(Values(m.tensors.state.input_tokens), ElementsAre(50, 60, 0));
  EXPECT_THAT(Values(m.tensors.state.input_positions), ElementsAre(5, 1, 0));
  EXPECT_THAT(Values(m.tensors.state.seq_lens), ElementsAre(6, 2, 1));
  // Descending pool of 100: seq 1 has 99..97, seq 2 96..94, seq 3 93..91.
  EXPECT_THAT(Values(m.tensors.state.slot_mapping),
              ElementsAre(95 * 4 + 1, 93 * 4 + 1, -1));
  // Seq 1 left the batch: freeing it no longer makes the batch stale.
  FreeResult f = e->FreeSequences(std::vector<SeqId>{1}).value();
  EXPECT_TRUE(f.stale_batches.empty());
  EXPECT_TRUE(e->CheckInvariants().ok());
}

TEST(EngineTurn, BatchWithOnlyUnfinishedChunksCannotAdvance) {
  auto e = MakeEngine(10, 4);
  ASSERT_TRUE(e->AllocateBlocks({{1, 8}}).ok());
  BatchSpec s;
  s.rows = {Row(1, 3, 0, true)};
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, false);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(
      e->AdvanceStep(b->batch_id, Sampled({1}), false, false).status().code(),
      absl::StatusCode::kFailedPrecondition);
}

TEST(EngineAdvance, GrowthIsMirroredIntoLiveBatches) {
  auto e = MakeEngine(50, 4);
  ASSERT_TRUE(e->AllocateBlocks({{9, 4}}).ok());  // one block
  BatchSpec s;
  s.rows = {Row(9, 4, 0)};
  s.block_table_width = 3;
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, true);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(Values(b->snapshot.tensors.state.block_tables),
              ElementsAre(49, 0, 0));

  // Position 4 needs the sequence's second block, which it does not own:
  // the zero in the padded table must not be used.
  absl::StatusOr<AdvanceResult> r =
      e->AdvanceStep(b->batch_id, Sampled({5}), false, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("row 0 (seq 9): position 4 needs block 1 of the "
                        "sequence, which owns 1 blocks: call AllocateBlocks"));

  ASSERT_TRUE(e->AllocateBlocks({{9, 12}}).ok());
  absl::StatusOr<BatchSnapshot> g = e->GetBatch(b->batch_id);
  EXPECT_THAT(Values(g->tensors.state.block_tables), ElementsAre(49, 48, 47));
  EXPECT_TRUE(e->CheckInvariants().ok());
  for (int step = 0; step < 8; ++step) {
    r = e->AdvanceStep(b->batch_id, Sampled({5}), true, false);
    ASSERT_TRUE(r.ok()) << step << ": " << r.status();
  }
  // Positions 4..11 written; the next one (12) is past the table width.
  EXPECT_THAT(Values(r->snapshot.tensors.state.slot_mapping),
              ElementsAre(47 * 4 + 3));
  r = e->AdvanceStep(b->batch_id, Sampled({5}), false, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("width 3"));
}

TEST(EngineAdvance, FreedSequenceMakesTheBatchStale) {
  auto e = MakeEngine(50, 4);
  ASSERT_TRUE(e->AllocateBlocks({{1, 8}, {2, 8}}).ok());
  BatchSpec s;
  s.rows = {Row(1, 1, 0), Row(2, 1, 0)};
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, true);
  ASSERT_TRUE(b.ok());
  FreeResult f = e->FreeSequences(std::vector<SeqId>{2, 77}).value();
  EXPECT_THAT(f.freed, ElementsAre(2));
  EXPECT_THAT(f.unknown, ElementsAre(77));
  EXPECT_THAT(f.stale_batches, ElementsAre(b->batch_id));
  EXPECT_EQ(f.blocks_freed, 2);
  // Its blocks go to someone else; the batch must not write there.
  ASSERT_TRUE(e->AllocateBlocks({{3, 8}}).ok());
  absl::StatusOr<AdvanceResult> r =
      e->AdvanceStep(b->batch_id, Sampled({1, 2}), false, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("row 1 (seq 2)"));
  EXPECT_EQ(All(*e->GetBatch(b->batch_id)), All(b->snapshot));
  EXPECT_TRUE(e->CheckInvariants().ok());
}

TEST(EngineAdvance, SpeculativeServerHeldAndBack) {
  auto e = MakeEngine(50, 4);
  ASSERT_TRUE(e->AllocateBlocks({{1, 16}, {2, 16}}).ok());  // 4 blocks each
  BatchSpec s;
  s.rows = {Row(1, 1, 2), Row(2, 1, 0)};
  ASSERT_TRUE(e->AllocateBlocks({{1, 16}}).ok());
  // Seq 1 claims 2 cached tokens it never computed.
  EXPECT_EQ(e->CreateBatch(s, {}, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  s.rows = {Row(1, 3, 0), Row(2, 1, 0)};
  absl::StatusOr<CreateBatchResult> b0 = e->CreateBatch(s, {}, false);
  ASSERT_TRUE(b0.ok()) << b0.status();
  ASSERT_TRUE(
      e->AdvanceStep(b0->batch_id, Sampled({30, 31}), false, false).ok());
  // Now a decode batch: seq_lens [4, 2], positions [3, 1].
  AdvanceInput in;
  in.sampled_token_ids = I64({2, 3}, {10, 11, 12, 13, 14, 15});
  in.spec_token = I64({2, 2}, {20, 21, 22, 23});
  in.accepted_num = I64({2}, {0, 1});
  absl::StatusOr<AdvanceResult> r =
      e->AdvanceStep(b0->batch_id, in, true, true);
  ASSERT_TRUE(r.ok()) << r.status();
  const BatchTensors& t = r->snapshot.tensors;
  EXPECT_EQ(t.state.input_tokens.shape(), (Shape{2, 3}));
  // Row 0: base = 3 + 1 + 0 = 4; row 1: base = 1 + 1 + 1 = 3.
  EXPECT_THAT(Values(t.state.input_tokens),
              ElementsAre(10, 20, 21, 14, 22, 23));
  EXPECT_THAT(Values(t.state.input_positions), ElementsAre(4, 5, 6, 3, 4, 5));
  EXPECT_THAT(Values(t.state.seq_lens), ElementsAre(7, 6));
  EXPECT_THAT(Values(t.query_start_loc), ElementsAre(0, 3, 6));
  EXPECT_THAT(Values(t.context_lens), ElementsAre(4, 3));
  EXPECT_THAT(Values(r->flashinfer.block_table_bound), ElementsAre(2, 2));
  // Seq 1 owns blocks 49..46: positions 4, 5, 6 are in block 48.
  EXPECT_THAT(Values(t.state.slot_mapping).front(), 48 * 4 + 0);

  // Back to plain decode: one token per row again, from seq_lens.
  r = e->AdvanceStep(b0->batch_id, Sampled({8, 9}), true, false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->snapshot.tensors.state.input_tokens.shape(), (Shape{2}));
  EXPECT_THAT(Values(r->snapshot.tensors.state.input_positions),
              ElementsAre(7, 6));
  EXPECT_EQ(r->step, 3);
  EXPECT_TRUE(e->CheckInvariants().ok());
}

TEST(EngineAdvance, SpeculativeOnAPrefillBatchIsRefused) {
  auto e = MakeEngine(50, 4);
  ASSERT_TRUE(e->AllocateBlocks({{1, 16}}).ok());
  BatchSpec s;
  s.rows = {Row(1, 3, 0)};
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, false);
  ASSERT_TRUE(b.ok());
  AdvanceInput in;
  in.sampled_token_ids = I64({1, 2}, {1, 2});
  in.spec_token = I64({1, 1}, {3});
  in.accepted_num = I64({1}, {0});
  EXPECT_EQ(e->AdvanceStep(b->batch_id, in, false, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(EngineAdvance, RejectedCallsChangeNothing) {
  auto e = MakeEngine(50, 4);
  ASSERT_TRUE(e->AllocateBlocks({{1, 8}, {2, 8}}).ok());
  BatchSpec s;
  s.rows = {Row(1, 1, 0), Row(2, 1, 0)};
  s.num_padding_rows = 2;
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, true);
  ASSERT_TRUE(b.ok());
  const auto before = All(b->snapshot);
  EXPECT_EQ(e->AdvanceStep(b->batch_id, Sampled({1, -2}), false, false)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      e->AdvanceStep(b->batch_id, Sampled({1}), false, false).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->AdvanceStep(999, Sampled({1, 2}), false, false).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(All(*e->GetBatch(b->batch_id)), before);
  EXPECT_EQ(e->GetBatch(b->batch_id)->step, 0);
}

TEST(EngineCreateBatch, ValidationNamesTheRow) {
  EngineLimits limits;
  limits.max_batches = 2;
  limits.max_batch_rows = 4;
  limits.max_seq_len = 64;
  auto e = MakeEngine(50, 4, limits);
  ASSERT_TRUE(e->AllocateBlocks({{1, 8}, {2, 8}}).ok());
  struct Bad {
    BatchSpec spec;
    absl::StatusCode code;
    std::string text;
  };
  std::vector<Bad> cases;
  auto add = [&](std::vector<BatchRowSpec> rows, absl::StatusCode code,
                 std::string text) {
    Bad b;
    b.spec.rows = std::move(rows);
    b.code = code;
    b.text = std::move(text);
    cases.push_back(std::move(b));
  };
  add({}, absl::StatusCode::kInvalidArgument, "rows is empty");
  add({Row(1, 1, 0), Row(5, 1, 0)}, absl::StatusCode::kNotFound,
      "rows[1]: seq 5 has no blocks");
  add({Row(1, 1, 0), Row(1, 1, 0)}, absl::StatusCode::kInvalidArgument,
      "rows[1] (seq 1): the sequence is already in an earlier row");
  add({Row(1, 0, 0)}, absl::StatusCode::kInvalidArgument,
      "rows[0] (seq 1): token_ids is empty");
  add({Row(2, 1, 0), Row(1, 3, 0)}, absl::StatusCode::kInvalidArgument,
      "rows[1] (seq 1) is a prefill row after decode rows[0]");
  add({Row(1, 1, 0, true)}, absl::StatusCode::kInvalidArgument,
      "skip_sampling is for prefill chunks");
  add({Row(1, 1, -1)}, absl::StatusCode::kInvalidArgument,
      "num_cached_tokens -1 is negative");
  add({Row(1, 9, 0)}, absl::StatusCode::kOutOfRange,
      "rows[0] (seq 1): seq_len 9 needs 3 blocks, the sequence owns 2");
  BatchRowSpec neg = Row(2, 2, 0);
  neg.token_ids[1] = -3;
  add({neg}, absl::StatusCode::kInvalidArgument, "token_ids[1] = -3");
  for (const Bad& c : cases) {
    absl::StatusOr<CreateBatchResult> r = e->CreateBatch(c.spec, {}, false);
    EXPECT_EQ(r.status().code(), c.code) << c.text << ": " << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.text));
  }
  BatchSpec ok;
  ok.rows = {Row(1, 1, 0)};
  ok.num_padding_rows = 4;
  EXPECT_EQ(e->CreateBatch(ok, {}, false).status().code(),
            absl::StatusCode::kOutOfRange);  // 5 rows > max_batch_rows 4
  ok.num_padding_rows = -1;
  EXPECT_EQ(e->CreateBatch(ok, {}, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  ok.num_padding_rows = 0;
  ok.block_table_width = 17;  // > 64 / 4
  EXPECT_EQ(e->CreateBatch(ok, {}, false).status().code(),
            absl::StatusCode::kOutOfRange);
  ok.block_table_width = 0;
  ok.seq_lens_dtype = DType::kFloat32;
  EXPECT_EQ(e->CreateBatch(ok, {}, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  ok.seq_lens_dtype = DType::kInt64;
  const BatchId unknown[] = {42};
  EXPECT_EQ(e->CreateBatch(ok, unknown, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Info().num_batches, 0);  // nothing was created

  ASSERT_TRUE(e->CreateBatch(ok, {}, false).ok());
  ASSERT_TRUE(e->CreateBatch(ok, {}, false).ok());
  absl::StatusOr<CreateBatchResult> third = e->CreateBatch(ok, {}, false);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(third.status().message()), HasSubstr("max_batches"));
  EXPECT_TRUE(e->CheckInvariants().ok());
}

TEST(BatchCreate, Int32SlotsRefusedForAPoolTooLarge) {
  // Only the pool's size matters here, so no pool is allocated.
  const std::vector<BlockId> blocks = {5};
  const RowSequence seqs[] = {{blocks, 0}};
  BatchLimits limits;
  limits.num_blocks = int64_t{1} << 28;  // 2^32 slots of 16
  limits.block_size = 16;
  limits.max_batch_rows = limits.max_batch_tokens = limits.max_table_width = 8;
  BatchSpec s;
  s.rows = {Row(1, 1, 0)};
  s.slot_mapping_dtype = DType::kInt32;
  absl::StatusOr<std::unique_ptr<Batch>> r =
      Batch::Create(s, seqs, limits, CpuDevice());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("use int64"));
  s.slot_mapping_dtype = DType::kInt64;
  r = Batch::Create(s, seqs, limits, CpuDevice());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(Values((*r)->tensors().state.slot_mapping), ElementsAre(80));
}

TEST(EngineCreateBatch, IndexWidthsAreKept) {
  auto e = MakeEngine(50, 4);
  ASSERT_TRUE(e->AllocateBlocks({{1, 8}}).ok());
  BatchSpec s;
  s.rows = {Row(1, 2, 0)};
  s.seq_lens_dtype = DType::kInt64;
  s.block_tables_dtype = DType::kInt64;
  s.slot_mapping_dtype = DType::kInt32;
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, true);
  ASSERT_TRUE(b.ok());
  absl::StatusOr<AdvanceResult> r =
      e->AdvanceStep(b->batch_id, Sampled({3}), true, false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->snapshot.tensors.state.seq_lens.dtype(), DType::kInt64);
  EXPECT_EQ(r->snapshot.tensors.state.block_tables.dtype(), DType::kInt64);
  EXPECT_EQ(r->snapshot.tensors.state.slot_mapping.dtype(), DType::kInt32);
  EXPECT_THAT(Values(r->snapshot.tensors.state.slot_mapping),
              ElementsAre(49 * 4 + 2));
}

TEST(EngineRelease, ReleasingForgetsTheBatchNotTheBlocks) {
  auto e = MakeEngine(50, 4);
  ASSERT_TRUE(e->AllocateBlocks({{1, 8}}).ok());
  BatchSpec s;
  s.rows = {Row(1, 1, 0)};
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, {}, false);
  ASSERT_TRUE(b.ok());
  ReleaseResult r =
      e->ReleaseBatches(std::vector<BatchId>{b->batch_id, 999}).value();
  EXPECT_THAT(r.released, ElementsAre(b->batch_id));
  EXPECT_THAT(r.unknown, ElementsAre(999));
  EXPECT_EQ(e->GetBatch(b->batch_id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(e->Info().free_blocks, 48);
  EXPECT_TRUE(e->CheckInvariants().ok());
  EXPECT_TRUE(
      e->FreeSequences(std::vector<SeqId>{1}).value().stale_batches.empty());
}

TEST(EngineOptions, BadGeometryIsRefused) {
  EngineOptions o;
  o.cache.num_blocks = 0;
  EXPECT_EQ(Engine::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = EngineOptions();
  o.cache.head_size = 12;  // not a multiple of x = 8 for fp16 in vLLM layout
  EXPECT_EQ(Engine::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = EngineOptions();
  o.limits.max_cache_bytes = 1 << 20;
  EXPECT_EQ(Engine::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// --attention_idle_poll_us: -1 (the pool's default) up to a second.
TEST(EngineOptions, AttentionIdlePollRange) {
  EngineOptions o;
  o.cache.num_blocks = 8;
  for (const int64_t us : {int64_t{-2}, int64_t{1000001}}) {
    o.attention_idle_poll_us = us;
    const absl::Status s = Engine::Create(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << us;
    EXPECT_THAT(s.message(), HasSubstr("attention_idle_poll_us")) << us;
  }
  for (const int64_t us : {int64_t{-1}, int64_t{0}, int64_t{1000000}}) {
    o.attention_idle_poll_us = us;
    EXPECT_TRUE(Engine::Create(o).ok()) << us;
  }
}

// --attention_prefetch: each hint is reported as the one the server runs
// (kAuto as what it resolves to here), and all give the same bytes, since
// a hint changes timing only. A bf16 prefill of 40 tokens, GQA 4 over 2 KV
// heads, head 128: the AVX-512 passes that take the hint, where the CPU
// has them.
TEST(EngineOptions, AttentionPrefetchIsReportedAndChangesNoResult) {
  const int64_t T = 40, H = 8, KV = 2, D = 128;
  std::mt19937 rng(7);
  AttentionRequest req;
  req.query = RandomBf16(rng, {T, H, D});
  req.key = RandomBf16(rng, {T, KV, D});
  req.value = RandomBf16(rng, {T, KV, D});
  AttentionRows rows;
  rows.query_start = {0, T};
  rows.seq_lens = {T};
  rows.block_tables = {5, 2, 7};
  rows.width = 3;
  rows.num_real = 1;
  std::vector<int64_t> slots;
  for (int64_t i = 0; i < T; ++i) {
    slots.push_back(rows.block_tables[i / 16] * 16 + i % 16);
  }
  std::vector<uint8_t> first;
  for (auto hint :
       {AttentionParams::Prefetch::kAuto, AttentionParams::Prefetch::kNta,
        AttentionParams::Prefetch::kT0, AttentionParams::Prefetch::kT1}) {
    EngineOptions o = Bf16AttentionOptions(8, KV, D);
    o.attention_prefetch = hint;
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    ASSERT_TRUE(e.ok()) << e.status();
    const auto resolved =
        hint == AttentionParams::Prefetch::kAuto
            ? BestPrefetch(DType::kBFloat16, CacheLayout::kVllm)
            : hint;
    EXPECT_THAT((*e)->Info().attention_kernel,
                HasSubstr(absl::StrCat(IsaName(BestIsa()), ", ",
                                       PrefetchName(resolved))));
    EXPECT_EQ((*e)->Info().attention_kernel.find("AMX") != std::string::npos,
              AmxSupported());
    EXPECT_THAT((*e)->Info().attention_kernel,
                HasSubstr(BestIsa() == AttentionParams::Isa::kAvx512 &&
                                  BestVllmRows(DType::kBFloat16, 16)
                              ? "decode rows over every KV head"
                              : "decode items per KV head"));
    EXPECT_EQ((*e)->Info().attention_kernel.find("1024-key ranges") !=
                  std::string::npos,
              BestIsa() == AttentionParams::Isa::kAvx512 &&
                  BestLongRowRanges(DType::kBFloat16, CacheLayout::kVllm));
    absl::StatusOr<Tensor> out = (*e)->PagedAttentionExplicit(req, rows, slots);
    ASSERT_TRUE(out.ok()) << out.status();
    const std::vector<uint8_t> bytes = Bytes(*out);
    if (first.empty()) {
      first = bytes;
    } else {
      EXPECT_EQ(bytes, first) << PrefetchName(hint);
    }
  }
  // kAuto is resolved by the server's cache dtype and layout (BestPrefetch;
  // on AMD every dtype has taken prefetcht0 since session 22, fp32 alone
  // before; on Intel model 207 16-bit vLLM-layout caches since session
  // 52): the report names the fp32 choice.
  EngineOptions o;
  o.cache.num_blocks = 8;
  o.cache.dtype = DType::kFloat32;
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_THAT(
      (*e)->Info().attention_kernel,
      HasSubstr(absl::StrCat(
          IsaName(BestIsa()), ", ",
          PrefetchName(BestPrefetch(DType::kFloat32, CacheLayout::kVllm)))));
  EXPECT_THAT((*e)->Info().attention_kernel, Not(HasSubstr("fp8")));
  // An fp8 cache's report says how its bytes meet a bf16 query in decode,
  // as this CPU chooses for the layout, block size, head size and KV
  // heads (BestFp8DotScope; attention_test's Fp8DotScopeSaysWhatRuns
  // checks that against the calls).
  for (CacheLayout layout : {CacheLayout::kVllm, CacheLayout::kNhd}) {
    for (int64_t bs : {8, 16}) {
      for (int64_t head : {64, 96}) {
        for (int64_t kv : {1, 2}) {
          EngineOptions f;
          f.cache.num_blocks = 8;
          f.cache.block_size = bs;
          f.cache.layout = layout;
          f.cache.head_size = head;
          f.cache.num_kv_heads = kv;
          f.cache.dtype = DType::kFp8E4M3;
          absl::StatusOr<std::unique_ptr<Engine>> fe = Engine::Create(f);
          ASSERT_TRUE(fe.ok()) << fe.status();
          const char* want = ", fp8 converted to fp32";
          switch (BestFp8DotScope(f.cache)) {
            case Fp8DotScope::kKeysAndValues:
              want = ", fp8 by VDPBF16PS for bf16 queries";
              break;
            case Fp8DotScope::kKeys:
              want =
                  ", fp8 keys by VDPBF16PS for bf16 queries, values "
                  "converted to fp32";
              break;
            default:
              break;
          }
          const std::string report = (*fe)->Info().attention_kernel;
          EXPECT_TRUE(absl::EndsWith(report, want))
              << report << "; block " << bs << " head " << head << " kv " << kv;
        }
      }
    }
  }
}

// Random operations through the whole engine, auditing the invariants
// after each one and ending with every block back in the pool.
TEST(EngineRandom, InvariantsHoldUnderRandomOperations) {
  auto e = MakeEngine(64, 4);
  std::mt19937_64 rng(7);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::vector<BatchId> batches;
  int advanced = 0;
  for (int op = 0; op < 3000; ++op) {
    // Weights: allocate 2, free 1, create 1, advance 3, release 1.
    static constexpr int kOp[] = {0, 0, 1, 2, 3, 3, 3, 4};
    switch (kOp[uni(0, 7)]) {
      case 0: {
        std::vector<SequenceRequest> req;
        for (SeqId id = 0; id < 8; ++id) {
          if (uni(0, 2) == 0) req.push_back({id, uni(0, 64)});
        }
        (void)e->AllocateBlocks(req);
        break;
      }
      case 1:
        (void)e->FreeSequences(
            std::vector<SeqId>{static_cast<SeqId>(uni(0, 7))});
        break;
      case 2: {
        BatchSpec s;
        for (SeqId id = 0; id < 8; ++id) {
          if (uni(0, 2) == 0) {
            s.rows.push_back(Row(id, 1, uni(0, 1) == 0 ? 0 : uni(0, 20)));
          }
        }
        s.num_padding_rows = uni(0, 2);
        absl::StatusOr<CreateBatchResult> b = e->CreateBatch(s, batches, false);
        if (b.ok()) batches = {b->batch_id};
        break;
      }
      case 3:
        for (BatchId id : batches) {
          absl::StatusOr<BatchSnapshot> snap = e->GetBatch(id);
          ASSERT_TRUE(snap.ok());
          std::vector<int64_t> tokens(snap->meta.num_queries, 1);
          advanced += e->AdvanceStep(id, Sampled(tokens), false, true).ok();
        }
        break;
      default:
        (void)e->ReleaseBatches(batches);
        batches.clear();
        break;
    }
    ASSERT_TRUE(e->CheckInvariants().ok())
        << "after op " << op << ": " << e->CheckInvariants();
  }
  EXPECT_GT(advanced, 50);
  (void)e->ReleaseBatches(batches);
  std::vector<SeqId> all = {0, 1, 2, 3, 4, 5, 6, 7};
  (void)e->FreeSequences(all);
  EXPECT_EQ(e->Info().free_blocks, 64);
  EXPECT_EQ(e->Info().num_batches, 0);
}

// Several schedulers at once, each on its own sequences, plus an auditor:
// run under TSan in CI. Ends with every block back in the pool.
TEST(EngineConcurrency, ManyThreadsKeepTheInvariants) {
  auto e = MakeEngine(256, 4);
  constexpr int kThreads = 4;
  std::atomic<bool> stop{false};
  std::atomic<int> steps{0};
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int round = 0; round < 150; ++round) {
        const SeqId a = t * 100 + 1, b = t * 100 + 2;
        if (!e->AllocateBlocks({{a, 8}, {b, 8}}).ok()) continue;
        BatchSpec s;
        s.rows = {Row(a, 3, 0), Row(b, 1, 0)};
        absl::StatusOr<CreateBatchResult> batch = e->CreateBatch(s, {}, false);
        ASSERT_TRUE(batch.ok()) << batch.status();
        for (int k = 0; k < 4; ++k) {
          absl::StatusOr<AdvanceResult> r = e->AdvanceStep(
              batch->batch_id, Sampled({1, 2}), (rng() & 1) != 0, k == 1);
          ASSERT_TRUE(r.ok()) << r.status();
          ++steps;
        }
        // Freeing before releasing leaves a stale batch for a moment.
        (void)e->FreeSequences(std::vector<SeqId>{a, b});
        (void)e->ReleaseBatches(std::vector<BatchId>{batch->batch_id});
      }
    });
  }
  std::thread auditor([&] {
    while (!stop) {
      ASSERT_TRUE(e->CheckInvariants().ok());
      (void)e->Info();
    }
  });
  for (std::thread& t : threads) t.join();
  stop = true;
  auditor.join();
  EXPECT_EQ(steps.load(), kThreads * 150 * 4);
  EXPECT_EQ(e->Info().free_blocks, 256);
  EXPECT_EQ(e->Info().num_batches, 0);
  EXPECT_TRUE(e->CheckInvariants().ok());
}

// PagedAttention holds the engine's lock only for its checks, its K/V
// write and its pins: control calls made while its kernel runs come back
// at once, a block it reads that they release is not handed out again
// until it is done, and it returns what it returns alone. Under TSan this
// also checks the kernel's reads against what those calls write (the
// copy-on-write below copies a block the kernel is reading).
TEST(EngineConcurrency, ControlCallsRunBesideAnAttentionKernel) {
  const int64_t H = 4, KV = 2, D = 64;
  std::promise<void> in_kernel, release;
  std::future<void> kernel_reached = in_kernel.get_future();
  const std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> hold{false};
  EngineOptions o = Bf16AttentionOptions(16, KV, D);
  o.attention_kernel_hook = [&] {
    if (hold.exchange(false)) {
      in_kernel.set_value();
      released.wait();
    }
  };
  absl::StatusOr<std::unique_ptr<Engine>> created = Engine::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  Engine& e = **created;
  absl::StatusOr<AllocateResult> a = e.AllocateBlocks({{1, 48}});
  ASSERT_TRUE(a.ok()) << a.status();
  const std::vector<BlockId> table = a->sequences[0].block_table;
  ASSERT_EQ(table.size(), 3u);
  ASSERT_TRUE(e.AllocateBlocks({{5, 16}}).ok());  // retried below: a no-op
  BatchSpec spec;
  spec.rows = {Row(1, 40, 0)};
  absl::StatusOr<CreateBatchResult> batch = e.CreateBatch(spec, {}, false);
  ASSERT_TRUE(batch.ok()) << batch.status();
  // The prompt's step, then a decode step at position 40, in table[2].
  ASSERT_TRUE(e.AdvanceStep(batch->batch_id, Sampled({7}), false, false).ok());
  std::mt19937 rng(11);
  AttentionRequest req;
  req.query = RandomBf16(rng, {1, H, D});
  req.key = RandomBf16(rng, {1, KV, D});
  req.value = RandomBf16(rng, {1, KV, D});
  absl::StatusOr<Tensor> alone = e.PagedAttention(batch->batch_id, req);
  ASSERT_TRUE(alone.ok()) << alone.status();

  hold = true;
  absl::StatusOr<Tensor> during;
  std::thread attention(
      [&] { during = e.PagedAttention(batch->batch_id, req); });
  // No ASSERT while threads run: a return would leave them joinable.
  const bool reached = kernel_reached.wait_for(std::chrono::seconds(60)) ==
                       std::future_status::ready;
  EXPECT_TRUE(reached) << "the attention call did not reach its kernel";
  if (!reached) {
    release.set_value();
    attention.join();
    return;
  }
  // The control calls run on a thread of their own, so that a lock held
  // through the kernel fails the test rather than hanging it.
  size_t copies = 0;
  std::promise<void> control_done;
  std::future<void> control_back = control_done.get_future();
  std::thread control([&] {
    // A fork shares the blocks the kernel reads; the child's growth copies
    // the shared partial one (table[2]) into a fresh block.
    EXPECT_TRUE(e.ForkSequence(1, std::vector<SeqId>{3}).ok());
    absl::StatusOr<AllocateResult> grow = e.AllocateBlocks({{3, 48}});
    EXPECT_TRUE(grow.ok()) << grow.status();
    if (grow.ok()) copies = grow->sequences[0].copies.size();
    // Freed: table[0] and table[1] stay the child's, table[2] goes back.
    absl::StatusOr<FreeResult> freed = e.FreeSequences(std::vector<SeqId>{1});
    EXPECT_TRUE(freed.ok()) << freed.status();
    EXPECT_TRUE(e.AllocateBlocks({{5, 16}}).ok());  // takes no block
    EXPECT_EQ(e.Info().pin_waits, 0);
    int64_t needed = 0;
    EXPECT_TRUE(e.CanAllocate({{4, 16}}, &needed).ok());
    // Released, table[2] counts as available: it is, once the kernel is
    // done, and an allocation waits that long for it.
    EXPECT_EQ(e.Info().free_blocks, 16 - 3 - 1 - 1 + 1);
    control_done.set_value();
  });
  const bool came_back = control_back.wait_for(std::chrono::seconds(60)) ==
                         std::future_status::ready;
  EXPECT_TRUE(came_back) << "control calls waited for the attention kernel";
  // An allocation that needs a fresh block while table[2], released, is
  // still read waits for the kernel. (Had it not waited, it would have
  // taken table[2] by now: 100 ms is only how long this looks.)
  std::atomic<bool> allocated{false};
  absl::StatusOr<AllocateResult> later;
  std::thread waiter;
  if (came_back) {
    waiter = std::thread([&] {
      later = e.AllocateBlocks({{4, 16}});
      allocated = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(allocated.load());
  }
  release.set_value();
  attention.join();
  control.join();
  if (waiter.joinable()) waiter.join();
  EXPECT_EQ(copies, 1u);
  ASSERT_TRUE(during.ok()) << during.status();
  EXPECT_EQ(Bytes(*during), Bytes(*alone));
  ASSERT_TRUE(later.ok()) << later.status();
  // What it would have taken with no attention call in flight: the block
  // released last (LIFO).
  EXPECT_THAT(later->sequences[0].new_blocks, ElementsAre(table[2]));
  EXPECT_EQ(e.Info().pin_waits, 1);
  EXPECT_TRUE(e.CheckInvariants().ok()) << e.CheckInvariants();
  ASSERT_TRUE(e.FreeSequences(std::vector<SeqId>{3, 4, 5}).ok());
  EXPECT_EQ(e.Info().free_blocks, 16);
}

}  // namespace
}  // namespace kvstep
