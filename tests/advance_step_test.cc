// Tests of the AdvanceStep kernel (SEMANTICS §2-§4): the golden cases, a
// randomized comparison with a plain reference written from the spec, and
// every validation rule, each checked to leave the state unchanged.
#include "core/advance_step.h"

#include <limits>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace kvstep {
namespace {

using ::kvstep::testing_util::I64;
using ::kvstep::testing_util::MakeIndex;
using ::kvstep::testing_util::Values;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

struct Case {
  int64_t num_seqs = 0, num_queries = 0, block_size = 16, num_blocks = 0;
  int64_t width = 1;
  int64_t q = 1;  // tokens per row (1 + spec_num in speculative mode)
  DType seq_dt = DType::kInt64, table_dt = DType::kInt64,
        slot_dt = DType::kInt64;
  std::vector<int64_t> tokens, positions, seq_lens, slots, tables;
  std::vector<int64_t> sampled, spec, accepted;
  bool speculative = false;
};

struct Built {
  AdvanceStepArgs args;
  StepState state;
};

Built Build(const Case& c) {
  Built b;
  b.args.num_seqs = c.num_seqs;
  b.args.num_queries = c.num_queries;
  b.args.block_size = c.block_size;
  b.args.num_blocks = c.num_blocks;
  const Shape per_token =
      c.speculative ? Shape{c.num_seqs, c.q} : Shape{c.num_seqs};
  b.state.input_tokens = I64(per_token, c.tokens);
  b.state.input_positions = I64(per_token, c.positions);
  b.state.seq_lens = MakeIndex(c.seq_dt, {c.num_seqs}, c.seq_lens);
  b.state.slot_mapping = MakeIndex(c.slot_dt, per_token, c.slots);
  b.state.block_tables = MakeIndex(c.table_dt, {c.num_seqs, c.width}, c.tables);
  if (c.speculative) {
    b.args.sampled_token_ids = I64({c.num_seqs, c.q}, c.sampled);
    b.args.spec_token = I64({c.num_seqs, c.q - 1}, c.spec);
    b.args.accepted_num = I64({c.num_seqs}, c.accepted);
  } else {
    b.args.sampled_token_ids = I64({c.num_queries, 1}, c.sampled);
  }
  return b;
}

std::vector<std::vector<int64_t>> Snapshot(const StepState& s) {
  return {Values(s.input_tokens), Values(s.input_positions), Values(s.seq_lens),
          Values(s.slot_mapping), Values(s.block_tables)};
}

// The plain reference, written from SEMANTICS §2 and §4 without looking at
// the kernel. Returns the code of the first failing row's first failing
// check, and changes `c` only when it returns OK.
absl::StatusCode Reference(Case& c) {
  auto max_of = [](DType d) {
    return d == DType::kInt32 ? int64_t{std::numeric_limits<int32_t>::max()}
                              : std::numeric_limits<int64_t>::max();
  };
  auto slot_of = [&](int64_t i, int64_t pos, int64_t* slot) {
    if (pos / c.block_size >= c.width) return absl::StatusCode::kOutOfRange;
    const int64_t block = c.tables[i * c.width + pos / c.block_size];
    if (block < 0 || (c.num_blocks > 0 && block >= c.num_blocks)) {
      return absl::StatusCode::kOutOfRange;
    }
    *slot = block * c.block_size + pos % c.block_size;
    if (*slot > max_of(c.slot_dt)) return absl::StatusCode::kOutOfRange;
    return absl::StatusCode::kOk;
  };
  std::vector<int64_t> firsts(c.num_queries);
  for (int64_t i = 0; i < c.num_queries; ++i) {
    int64_t first;
    if (!c.speculative) {
      if (c.sampled[i] < 0) return absl::StatusCode::kInvalidArgument;
      first = c.seq_lens[i];
      if (first < 0) return absl::StatusCode::kInvalidArgument;
    } else {
      const int64_t k = c.q - 1, a = c.accepted[i];
      if (a < 0 || a > k) return absl::StatusCode::kInvalidArgument;
      for (int64_t j = 0; j <= k; ++j) {
        if (c.sampled[i * c.q + j] < 0)
          return absl::StatusCode::kInvalidArgument;
        if (j < k && c.spec[i * k + j] < 0) {
          return absl::StatusCode::kInvalidArgument;
        }
      }
      if (c.positions[i * c.q] < 0) return absl::StatusCode::kInvalidArgument;
      first = c.positions[i * c.q] + 1 + a;
    }
    if (first + c.q > max_of(c.seq_dt)) return absl::StatusCode::kOutOfRange;
    for (int64_t j = 0; j < c.q; ++j) {
      int64_t slot;
      if (auto code = slot_of(i, first + j, &slot);
          code != absl::StatusCode::kOk) {
        return code;
      }
    }
    firsts[i] = first;
  }
  for (int64_t i = 0; i < c.num_queries; ++i) {
    const int64_t first = firsts[i];
    for (int64_t j = 0; j < c.q; ++j) {
      int64_t slot = 0;
      slot_of(i, first + j, &slot);
      c.positions[i * c.q + j] = first + j;
      c.slots[i * c.q + j] = slot;
      if (!c.speculative) {
        c.tokens[i] = c.sampled[i];
      } else if (j == 0) {
        c.tokens[i * c.q] = c.sampled[i * c.q + c.accepted[i]];
      } else {
        c.tokens[i * c.q + j] = c.spec[i * (c.q - 1) + j - 1];
      }
    }
    c.seq_lens[i] = first + c.q;
  }
  for (int64_t i = c.num_queries; i < c.num_seqs; ++i) {
    c.tokens[i] = 0;
    c.positions[i] = 0;
    c.slots[i] = -1;
  }
  return absl::StatusCode::kOk;
}

// ---- Golden cases (SEMANTICS §2) ------------------------------------------

TEST(AdvanceStepGolden, Case1_BlockSize128) {
  Case c;
  c.num_seqs = c.num_queries = 4;
  c.block_size = 128;
  c.num_blocks = 4;
  c.seq_dt = c.table_dt = DType::kInt32;
  c.tokens = {0, 0, 0, 0};
  c.positions = {5, 7, 5, 5};
  c.seq_lens = {6, 8, 6, 6};
  c.slots = {0, 0, 0, 0};
  c.tables = {0, 1, 2, 3};
  c.sampled = {13, 1968, 13, 13};
  Built b = Build(c);
  ASSERT_TRUE(AdvanceStep(b.args, &b.state, nullptr).ok());
  EXPECT_THAT(Values(b.state.input_tokens), ElementsAre(13, 1968, 13, 13));
  EXPECT_THAT(Values(b.state.input_positions), ElementsAre(6, 8, 6, 6));
  EXPECT_THAT(Values(b.state.seq_lens), ElementsAre(7, 9, 7, 7));
  EXPECT_THAT(Values(b.state.slot_mapping), ElementsAre(6, 136, 262, 390));
  EXPECT_EQ(b.state.seq_lens.dtype(), DType::kInt32);  // width kept
}

TEST(AdvanceStepGolden, Case2_BlockBoundary) {
  for (int64_t seq_len : {15, 16}) {
    Case c;
    c.num_seqs = c.num_queries = 1;
    c.block_size = 16;
    c.width = 2;
    c.tokens = {0};
    c.positions = {0};
    c.seq_lens = {seq_len};
    c.slots = {0};
    c.tables = {5, 9};
    c.sampled = {7};
    Built b = Build(c);
    ASSERT_TRUE(AdvanceStep(b.args, &b.state, nullptr).ok());
    EXPECT_THAT(Values(b.state.input_positions), ElementsAre(seq_len));
    EXPECT_THAT(Values(b.state.slot_mapping),
                ElementsAre(seq_len == 15 ? 95 : 144));
  }
}

TEST(AdvanceStepGolden, Case3_Seed003FirstDecode) {
  Case c;
  c.num_seqs = c.num_queries = 5;
  c.block_size = 16;
  c.num_blocks = 1000;
  c.width = 13;
  c.seq_dt = c.table_dt = DType::kInt32;
  for (int64_t k = 0; k < 5; ++k) {
    for (int64_t j = 0; j < 13; ++j) c.tables.push_back(999 - 13 * k - j);
    c.seq_lens.push_back(195);
    c.positions.push_back(194);
    c.tokens.push_back(1);
    c.slots.push_back(0);
    c.sampled.push_back(100 + k);
  }
  Built b = Build(c);
  ASSERT_TRUE(AdvanceStep(b.args, &b.state, nullptr).ok());
  EXPECT_THAT(Values(b.state.slot_mapping),
              ElementsAre(15795, 15587, 15379, 15171, 14963));
  EXPECT_THAT(Values(b.state.seq_lens), ElementsAre(196, 196, 196, 196, 196));
}

TEST(AdvanceStepGolden, Case4_PaddingRows) {
  Case c;
  c.num_seqs = 8;
  c.num_queries = 5;
  c.block_size = 16;
  c.width = 2;
  for (int64_t i = 0; i < 8; ++i) {
    c.tokens.push_back(77);
    c.positions.push_back(33);
    c.seq_lens.push_back(10 + i);
    c.slots.push_back(55);
    c.tables.push_back(i);
    c.tables.push_back(i + 8);
  }
  c.sampled = {1, 2, 3, 4, 5};
  Built b = Build(c);
  ASSERT_TRUE(AdvanceStep(b.args, &b.state, nullptr).ok());
  EXPECT_THAT(Values(b.state.input_tokens),
              ElementsAre(1, 2, 3, 4, 5, 0, 0, 0));
  EXPECT_THAT(Values(b.state.input_positions),
              ElementsAre(10, 11, 12, 13, 14, 0, 0, 0));
  EXPECT_THAT(Values(b.state.slot_mapping),
              ElementsAre(10, 27, 44, 61, 78, -1, -1, -1));
  // Padding rows keep their seq_lens.
  EXPECT_THAT(Values(b.state.seq_lens),
              ElementsAre(11, 12, 13, 14, 15, 15, 16, 17));
}

TEST(AdvanceStepGolden, TokenZeroIsAToken) {
  Case c;
  c.num_seqs = c.num_queries = 1;
  c.tokens = {9};
  c.positions = {0};
  c.seq_lens = {1};
  c.slots = {0};
  c.tables = {3};
  c.sampled = {0};
  Built b = Build(c);
  ASSERT_TRUE(AdvanceStep(b.args, &b.state, nullptr).ok());
  EXPECT_THAT(Values(b.state.input_tokens), ElementsAre(0));
}

TEST(AdvanceStepSpeculative, HandComputed) {
  Case c;
  c.num_seqs = c.num_queries = 1;
  c.speculative = true;
  c.q = 3;  // spec_num 2
  c.block_size = 4;
  c.width = 3;
  c.tokens = {0, 0, 0};
  c.positions = {5, 6, 7};
  c.seq_lens = {8};
  c.slots = {0, 0, 0};
  c.tables = {7, 8, 9};
  c.sampled = {10, 11, 12};
  c.spec = {20, 21};
  c.accepted = {1};
  Built b = Build(c);
  ASSERT_TRUE(AdvanceStep(b.args, &b.state, nullptr).ok());
  // base = 5 + 1 + 1 = 7: positions 7, 8, 9 in blocks 8 (offset 3), 9, 9.
  EXPECT_THAT(Values(b.state.input_tokens), ElementsAre(11, 20, 21));
  EXPECT_THAT(Values(b.state.input_positions), ElementsAre(7, 8, 9));
  EXPECT_THAT(Values(b.state.seq_lens), ElementsAre(10));
  EXPECT_THAT(Values(b.state.slot_mapping), ElementsAre(35, 36, 37));
}

TEST(AdvanceStepFlashInfer, MetadataWithPadding) {
  Case c;
  c.num_seqs = 3;
  c.num_queries = 2;
  c.block_size = 4;
  c.width = 3;
  c.tokens = {0, 0, 0};
  c.positions = {0, 0, 0};
  c.seq_lens = {3, 4, 9};
  c.slots = {0, 0, 0};
  c.tables = {10, 11, 12, 20, 21, 22, 30, 31, 32};
  c.sampled = {1, 2};
  Built b = Build(c);
  FlashInferOutputs fi;
  ASSERT_TRUE(AdvanceStep(b.args, &b.state, &fi).ok());
  // New seq_lens 4 and 5: last pages 4 and 1, bounds 1 and 2.
  EXPECT_THAT(Values(fi.paged_kv_last_page_len), ElementsAre(4, 1, 0));
  EXPECT_THAT(Values(fi.block_table_bound), ElementsAre(1, 2, 0));
  EXPECT_THAT(Values(fi.paged_kv_indptr), ElementsAre(0, 1, 3, 3));
  EXPECT_THAT(Values(fi.paged_kv_indices), ElementsAre(10, 20, 21));
  EXPECT_EQ(fi.paged_kv_indptr.dtype(), DType::kInt32);
}

// ---- Randomized comparison with the reference -----------------------------

Case RandomCase(std::mt19937_64& rng) {
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  auto chance = [&](int percent) { return uni(0, 99) < percent; };
  const DType dts[] = {DType::kInt32, DType::kInt64};
  Case c;
  c.speculative = chance(25);
  c.num_seqs = uni(1, 40);
  c.num_queries = c.speculative ? c.num_seqs : uni(1, c.num_seqs);
  const int64_t sizes[] = {1, 2, 8, 16, 128};
  c.block_size = sizes[uni(0, 4)];
  c.width = uni(1, 12);
  c.num_blocks = chance(80) ? uni(1, 4096) : 0;
  c.q = c.speculative ? uni(2, 5) : 1;
  c.seq_dt = dts[uni(0, 1)];
  c.table_dt = dts[uni(0, 1)];
  c.slot_dt = dts[uni(0, 1)];
  const int64_t max_block = c.num_blocks > 0 ? c.num_blocks - 1 : 1 << 20;
  const int64_t per_row = c.q;
  // Errors are rare per row so that most batches succeed.
  const int bad = chance(50) ? 0 : 1;
  for (int64_t i = 0; i < c.num_seqs; ++i) {
    for (int64_t j = 0; j < c.width; ++j) {
      c.tables.push_back(chance(bad) ? (chance(50) ? -1 : max_block + 1)
                                     : uni(0, max_block));
    }
    // Land exactly on block boundaries often.
    int64_t len =
        chance(30)
            ? uni(0, c.width - 1) * c.block_size
            : uni(0, std::max<int64_t>(0, c.width * c.block_size - per_row));
    if (chance(bad)) len = chance(50) ? -uni(1, 5) : c.width * c.block_size;
    c.seq_lens.push_back(len);
    for (int64_t j = 0; j < per_row; ++j) {
      c.tokens.push_back(uni(0, 1000));
      c.slots.push_back(uni(-1, 1000));
      c.positions.push_back(j == 0 ? std::max<int64_t>(len - per_row - 1, 0) +
                                         (chance(bad) ? -100 : 0)
                                   : uni(0, 50));
    }
    if (c.speculative) {
      for (int64_t j = 0; j < c.q; ++j) {
        c.sampled.push_back(chance(bad) ? -1 : uni(0, 50000));
      }
      for (int64_t j = 0; j + 1 < c.q; ++j) {
        c.spec.push_back(chance(bad) ? -2 : uni(0, 50000));
      }
      c.accepted.push_back(chance(bad) ? c.q : uni(0, c.q - 1));
    } else if (i < c.num_queries) {
      c.sampled.push_back(chance(bad) ? -1 : uni(0, 50000));
    }
  }
  return c;
}

TEST(AdvanceStepRandom, MatchesReferenceOnThousandsOfBatches) {
  std::mt19937_64 rng(20261122);
  int ok = 0, rejected = 0, spec = 0, int32_any = 0;
  for (int iter = 0; iter < 5000; ++iter) {
    Case c = RandomCase(rng);
    Built b = Build(c);
    const auto before = Snapshot(b.state);
    const bool flashinfer = iter % 3 == 0;
    FlashInferOutputs fi;
    absl::Status s = AdvanceStep(b.args, &b.state, flashinfer ? &fi : nullptr);
    Case expect = c;
    const absl::StatusCode want = Reference(expect);
    ASSERT_EQ(s.code(), want) << "iteration " << iter << ": " << s;
    if (s.ok()) {
      ++ok;
      ASSERT_THAT(Values(b.state.input_tokens), ElementsAreArray(expect.tokens))
          << iter;
      ASSERT_THAT(Values(b.state.input_positions),
                  ElementsAreArray(expect.positions))
          << iter;
      ASSERT_THAT(Values(b.state.seq_lens), ElementsAreArray(expect.seq_lens))
          << iter;
      ASSERT_THAT(Values(b.state.slot_mapping), ElementsAreArray(expect.slots))
          << iter;
      if (flashinfer) {
        // indptr is the prefix sum of ceil(seq_len / block_size).
        std::vector<int64_t> indptr = {0};
        for (int64_t i = 0; i < c.num_seqs; ++i) {
          const int64_t len = expect.seq_lens[i];
          indptr.push_back(indptr.back() +
                           (i < c.num_queries
                                ? (len + c.block_size - 1) / c.block_size
                                : 0));
        }
        ASSERT_THAT(Values(fi.paged_kv_indptr), ElementsAreArray(indptr));
      }
    } else {
      ++rejected;
      ASSERT_EQ(Snapshot(b.state), before)
          << "rejected call wrote, iter " << iter;
    }
    spec += c.speculative;
    int32_any += c.seq_dt == DType::kInt32 || c.slot_dt == DType::kInt32;
  }
  // The generator must exercise both outcomes and both modes.
  EXPECT_GT(ok, 1500);
  EXPECT_GT(rejected, 500);
  EXPECT_GT(spec, 500);
  EXPECT_GT(int32_any, 2000);
}

// ---- Validation: every rule, state unchanged -------------------------------

class AdvanceStepValidation : public ::testing::Test {
 protected:
  void SetUp() override {
    c_.num_seqs = 3;
    c_.num_queries = 2;
    c_.block_size = 16;
    c_.num_blocks = 100;
    c_.width = 2;
    c_.seq_dt = c_.table_dt = DType::kInt32;
    c_.tokens = {1, 2, 3};
    c_.positions = {4, 5, 6};
    c_.seq_lens = {5, 20, 7};
    c_.slots = {8, 9, 10};
    c_.tables = {1, 2, 3, 4, 5, 6};
    c_.sampled = {11, 12};
  }

  // Runs the case and expects `code` with `text` in the message and no
  // tensor changed.
  void ExpectRejected(Built b, absl::StatusCode code, const std::string& text) {
    const auto before = Snapshot(b.state);
    absl::Status s = AdvanceStep(b.args, &b.state, nullptr);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(text));
    EXPECT_EQ(Snapshot(b.state), before);
  }

  Case c_;
};

TEST_F(AdvanceStepValidation, TheBaseCaseIsValid) {
  Built b = Build(c_);
  EXPECT_TRUE(AdvanceStep(b.args, &b.state, nullptr).ok());
}

TEST_F(AdvanceStepValidation, NumQueriesZero) {
  Built b = Build(c_);
  b.args.num_queries = 0;
  ExpectRejected(b, absl::StatusCode::kInvalidArgument, "num_queries");
}

TEST_F(AdvanceStepValidation, NumQueriesAboveNumSeqs) {
  Built b = Build(c_);
  b.args.num_queries = 4;
  ExpectRejected(b, absl::StatusCode::kInvalidArgument, "num_queries");
}

TEST_F(AdvanceStepValidation, NumSeqsZero) {
  Built b = Build(c_);
  b.args.num_seqs = 0;
  ExpectRejected(b, absl::StatusCode::kInvalidArgument, "num_seqs");
}

TEST_F(AdvanceStepValidation, BlockSizeZero) {
  Built b = Build(c_);
  b.args.block_size = 0;
  ExpectRejected(b, absl::StatusCode::kInvalidArgument, "block_size");
}

TEST_F(AdvanceStepValidation, TokensMustBeInt64) {
  Built b = Build(c_);
  b.state.input_tokens = MakeIndex(DType::kInt32, {3}, {1, 2, 3});
  ExpectRejected(b, absl::StatusCode::kInvalidArgument,
                 "input_tokens must be int64, got int32");
}

TEST_F(AdvanceStepValidation, FloatSeqLensRejected) {
  Built b = Build(c_);
  b.state.seq_lens = *Tensor::Zeros(CpuDevice(), DType::kFloat32, {3});
  ExpectRejected(b, absl::StatusCode::kInvalidArgument,
                 "seq_lens must be int32 or int64");
}

TEST_F(AdvanceStepValidation, SampledShape) {
  Built b = Build(c_);
  b.args.sampled_token_ids = I64({2, 2}, {1, 2, 3, 4});
  ExpectRejected(b, absl::StatusCode::kInvalidArgument,
                 "sampled_token_ids must have shape [2, 1]");
}

TEST_F(AdvanceStepValidation, MissingTensor) {
  Built b = Build(c_);
  b.state.slot_mapping = Tensor();
  ExpectRejected(b, absl::StatusCode::kInvalidArgument,
                 "slot_mapping is missing");
}

TEST_F(AdvanceStepValidation, FirstDimensionMismatch) {
  Built b = Build(c_);
  b.state.input_positions = I64({2}, {1, 2});
  ExpectRejected(b, absl::StatusCode::kInvalidArgument,
                 "input_positions must have shape [3]");
}

TEST_F(AdvanceStepValidation, BlockTablesRank) {
  Built b = Build(c_);
  b.state.block_tables = MakeIndex(DType::kInt32, {6}, c_.tables);
  ExpectRejected(b, absl::StatusCode::kInvalidArgument, "block_tables");
}

TEST_F(AdvanceStepValidation, EmptyBlockTables) {
  Built b = Build(c_);
  b.state.block_tables = MakeIndex(DType::kInt32, {3, 0}, {});
  ExpectRejected(b, absl::StatusCode::kInvalidArgument, "W >= 1");
}

TEST_F(AdvanceStepValidation, NegativeSeqLen) {
  c_.seq_lens[1] = -1;
  ExpectRejected(Build(c_), absl::StatusCode::kInvalidArgument,
                 "row 1: seq_lens[1] = -1 is negative");
}

TEST_F(AdvanceStepValidation, PositionPastTableWidth) {
  c_.seq_lens[1] = 32;  // needs entry 2 of a width-2 table
  ExpectRejected(Build(c_), absl::StatusCode::kOutOfRange,
                 "row 1: position 32 needs block_tables[1][2], but "
                 "block_tables has width 2");
}

TEST_F(AdvanceStepValidation, NegativeBlockId) {
  c_.tables[3] = -1;  // row 1, entry 1 (seq_len 20 -> entry 1)
  ExpectRejected(Build(c_), absl::StatusCode::kOutOfRange,
                 "block_tables[1][1] = -1 is not a block of the pool");
}

TEST_F(AdvanceStepValidation, BlockIdOutsidePool) {
  c_.tables[0] = 100;
  ExpectRejected(
      Build(c_), absl::StatusCode::kOutOfRange,
      "block_tables[0][0] = 100 is not a block of the pool [0, 100)");
}

TEST_F(AdvanceStepValidation, NegativeSampledToken) {
  c_.sampled[1] = -5;
  ExpectRejected(Build(c_), absl::StatusCode::kInvalidArgument,
                 "row 1: sampled_token_ids[1][0] = -5 is negative");
}

TEST_F(AdvanceStepValidation, Int32SlotOverflow) {
  c_.slot_dt = DType::kInt32;
  c_.num_blocks = 0;  // unchecked pool: only the width limits the slot
  c_.tables[0] = int64_t{1} << 27;  // * 16 = 2^31
  ExpectRejected(Build(c_), absl::StatusCode::kOutOfRange,
                 "does not fit slot_mapping (int32)");
}

TEST_F(AdvanceStepValidation, Int32SeqLenOverflow) {
  c_.num_blocks = 0;
  c_.block_size = int64_t{1} << 30;
  c_.seq_lens[0] = std::numeric_limits<int32_t>::max();
  c_.tables[1] = 0;
  ExpectRejected(Build(c_), absl::StatusCode::kOutOfRange,
                 "does not fit seq_lens (int32)");
}

TEST_F(AdvanceStepValidation, PaddingRowsAreNotValidated) {
  c_.seq_lens[2] = -7;  // padding row: untouched, not read
  c_.tables[4] = -1;
  Built b = Build(c_);
  ASSERT_TRUE(AdvanceStep(b.args, &b.state, nullptr).ok());
  EXPECT_EQ(Values(b.state.seq_lens)[2], -7);
}

TEST_F(AdvanceStepValidation, OwnedBlocksBoundTheRow) {
  Built b = Build(c_);
  const std::vector<int64_t> owned = {1, 1};  // row 1 needs entry 1
  const std::vector<uint64_t> ids = {70, 71};
  b.args.row_owned_blocks = owned;
  b.args.row_seq_ids = ids;
  ExpectRejected(b, absl::StatusCode::kOutOfRange,
                 "row 1 (seq 71): position 20 needs block 1 of the sequence, "
                 "which owns 1 blocks");
}

class SpeculativeValidation : public AdvanceStepValidation {
 protected:
  void SetUp() override {
    c_.num_seqs = c_.num_queries = 2;
    c_.speculative = true;
    c_.q = 3;
    c_.block_size = 4;
    c_.num_blocks = 50;
    c_.width = 3;
    c_.tokens = {0, 0, 0, 0, 0, 0};
    c_.positions = {1, 2, 3, 2, 3, 4};
    c_.seq_lens = {4, 5};
    c_.slots = {0, 0, 0, 0, 0, 0};
    c_.tables = {1, 2, 3, 4, 5, 6};
    c_.sampled = {10, 11, 12, 13, 14, 15};
    c_.spec = {20, 21, 22, 23};
    c_.accepted = {0, 2};
  }
};

TEST_F(SpeculativeValidation, TheBaseCaseIsValid) {
  Built b = Build(c_);
  ASSERT_TRUE(AdvanceStep(b.args, &b.state, nullptr).ok());
  // Row 1: base = 2 + 1 + 2 = 5, token sampled[1][2] = 15.
  EXPECT_THAT(Values(b.state.input_tokens),
              ElementsAre(10, 20, 21, 15, 22, 23));
  EXPECT_THAT(Values(b.state.input_positions), ElementsAre(2, 3, 4, 5, 6, 7));
  EXPECT_THAT(Values(b.state.seq_lens), ElementsAre(5, 8));
}

TEST_F(SpeculativeValidation, AcceptedAboveSpecNum) {
  c_.accepted[1] = 3;
  ExpectRejected(Build(c_), absl::StatusCode::kInvalidArgument,
                 "accepted_num[1] = 3 is outside [0, 2]");
}

TEST_F(SpeculativeValidation, NeedsNumQueriesEqualNumSeqs) {
  Built b = Build(c_);
  b.args.num_queries = 1;
  ExpectRejected(b, absl::StatusCode::kInvalidArgument,
                 "speculative mode needs num_queries == num_seqs");
}

TEST_F(SpeculativeValidation, NeedsBothTensors) {
  Built b = Build(c_);
  b.args.accepted_num = Tensor();
  ExpectRejected(b, absl::StatusCode::kInvalidArgument,
                 "needs both spec_token and accepted_num");
}

TEST_F(SpeculativeValidation, SpecTokenShape) {
  Built b = Build(c_);
  b.args.spec_token = I64({2}, {1, 2});
  ExpectRejected(b, absl::StatusCode::kInvalidArgument, "spec_token must");
}

TEST_F(SpeculativeValidation, NegativeDraftToken) {
  c_.spec[3] = -1;
  ExpectRejected(Build(c_), absl::StatusCode::kInvalidArgument,
                 "spec_token[1][1] = -1 is negative");
}

TEST_F(SpeculativeValidation, LastDraftPositionPastTable) {
  c_.positions[3] = 8;  // base 11, positions 11..13: entry 3 of width 3
  ExpectRejected(Build(c_), absl::StatusCode::kOutOfRange,
                 "position 12 needs block_tables[1][3]");
}

}  // namespace
}  // namespace kvstep
