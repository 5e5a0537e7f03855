// Sessions (TTL, renewal, ownership, expiry) and exactly-once AdvanceStep in
// the Engine, on a fake clock so that no test depends on timing.
#include <memory>
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

// A clock the test moves by hand.
struct FakeClock {
  absl::Time now = absl::FromUnixSeconds(1'000'000);
};

std::unique_ptr<Engine> MakeEngine(FakeClock* clock, int64_t num_blocks = 64,
                                   int64_t max_sessions = 8) {
  EngineOptions o;
  o.cache.num_blocks = num_blocks;
  o.cache.block_size = 4;
  o.cache.num_layers = 1;
  o.cache.num_kv_heads = 1;
  o.cache.head_size = 1;
  o.cache.dtype = DType::kFloat16;
  o.cache.layout = CacheLayout::kNhd;
  o.limits.max_sessions = max_sessions;
  o.default_session_ttl = absl::Seconds(10);
  o.max_session_ttl = absl::Minutes(10);
  o.clock = [clock] { return clock->now; };
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return *std::move(e);
}

BatchSpec OneDecodeRowEach(std::vector<SeqId> ids, int64_t cached) {
  BatchSpec spec;
  for (SeqId id : ids) {
    BatchRowSpec r;
    r.seq_id = id;
    r.token_ids = {7};
    r.num_cached_tokens = cached;
    spec.rows.push_back(r);
  }
  return spec;
}

AdvanceInput Sampled(std::vector<int64_t> tokens, int64_t step) {
  AdvanceInput in;
  in.step = step;
  in.sampled_token_ids =
      I64({static_cast<int64_t>(tokens.size()), 1}, std::move(tokens));
  return in;
}

// A session's sequences and batch, set up through its calls.
struct Held {
  SessionId session = 0;
  BatchId batch = 0;
};

Held HoldSome(Engine* e, absl::Duration ttl, SeqId first) {
  Held h;
  absl::StatusOr<SessionInfo> s = e->OpenSession(ttl, "scheduler");
  EXPECT_TRUE(s.ok()) << s.status();
  h.session = s->id;
  const Caller c{h.session};
  std::vector<SequenceRequest> req = {{first, 8}, {first + 1, 8}};
  EXPECT_TRUE(e->AllocateBlocks(req, c).ok());
  BatchSpec spec = OneDecodeRowEach({first, first + 1}, 0);
  absl::StatusOr<CreateBatchResult> b = e->CreateBatch(spec, {}, false, c);
  EXPECT_TRUE(b.ok()) << b.status();
  h.batch = b->batch_id;
  absl::StatusOr<std::vector<SequenceBlocks>> fork =
      e->ForkSequence(first, std::vector<SeqId>{first + 2}, c);
  EXPECT_TRUE(fork.ok()) << fork.status();
  return h;
}

TEST(Session, CallsRenewItAndALapsedOneIsReapedWithEverythingItHeld) {
  FakeClock clock;
  auto e = MakeEngine(&clock);
  const Held h = HoldSome(e.get(), absl::Seconds(1), 1);
  const Caller c{h.session};
  EXPECT_EQ(e->Info().num_sessions, 1);
  EXPECT_EQ(e->Stats().used_blocks, 4);  // 2 + 2, the fork shares

  // Each call pushes the deadline a full TTL out.
  for (int i = 0; i < 5; ++i) {
    clock.now += absl::Milliseconds(900);
    ASSERT_TRUE(e->GetBatch(h.batch, c).ok()) << "renewal " << i;
    EXPECT_TRUE(e->ExpireSessions().empty());
  }
  clock.now += absl::Milliseconds(900);
  ASSERT_TRUE(e->KeepAlive(h.session).ok());

  // Silence past the TTL: calls fail at once, the reaper frees the rest.
  clock.now += absl::Milliseconds(1001);
  absl::StatusOr<BatchSnapshot> late = e->GetBatch(h.batch, c);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(late.status().message(), HasSubstr("lapsed"));
  EXPECT_EQ(e->KeepAlive(h.session).code(), absl::StatusCode::kNotFound);
  const std::vector<SessionEnd> ends = e->ExpireSessions();
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].id, h.session);
  EXPECT_EQ(ends[0].name, "scheduler");
  EXPECT_EQ(ends[0].sequences, 3);
  EXPECT_EQ(ends[0].batches, 1);
  EXPECT_EQ(ends[0].blocks_freed, 4);
  const EngineInfo info = e->Info();
  EXPECT_EQ(info.num_sessions, 0);
  EXPECT_EQ(info.sessions_expired, 1);
  EXPECT_EQ(info.num_sequences, 0);
  EXPECT_EQ(info.num_batches, 0);
  EXPECT_EQ(info.stats.used_blocks, 0);
  EXPECT_EQ(info.free_blocks, 64);
  EXPECT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
}

TEST(Session, ExpiryTakesOnlyTheLapsedSession) {
  FakeClock clock;
  auto e = MakeEngine(&clock);
  const Held a = HoldSome(e.get(), absl::Seconds(1), 1);
  const Held b = HoldSome(e.get(), absl::Seconds(5), 10);
  std::vector<SequenceRequest> mine = {{100, 4}};
  ASSERT_TRUE(e->AllocateBlocks(mine).ok());  // no session
  clock.now += absl::Seconds(2);
  const std::vector<SessionEnd> ends = e->ExpireSessions();
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].id, a.session);
  EXPECT_TRUE(e->GetBatch(b.batch, Caller{b.session}).ok());
  EXPECT_EQ(e->Info().num_sequences, 4);  // b's three and seq 100
  EXPECT_EQ(e->Stats().used_blocks, 5);
  EXPECT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
}

TEST(Session, CloseFreesAtOnceAndOnlyOnce) {
  FakeClock clock;
  auto e = MakeEngine(&clock);
  const Held h = HoldSome(e.get(), absl::ZeroDuration(), 1);
  // A sequence freed by its session leaves the session's books.
  ASSERT_TRUE(e->FreeSequences(std::vector<SeqId>{3}, Caller{h.session}).ok());
  absl::StatusOr<SessionEnd> end = e->CloseSession(h.session);
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->sequences, 2);
  EXPECT_EQ(end->batches, 1);
  EXPECT_EQ(e->Stats().used_blocks, 0);
  EXPECT_EQ(e->CloseSession(h.session).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(e->CloseSession(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Info().sessions_expired, 0);
  EXPECT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
}

TEST(Session, OnlyTheOwningSessionTouchesItsObjects) {
  FakeClock clock;
  auto e = MakeEngine(&clock);
  const Held a = HoldSome(e.get(), absl::Seconds(10), 1);
  absl::StatusOr<SessionInfo> b = e->OpenSession(absl::Seconds(10), "other");
  ASSERT_TRUE(b.ok());
  std::vector<SequenceRequest> free_seq = {{50, 4}};
  ASSERT_TRUE(e->AllocateBlocks(free_seq).ok());  // belongs to no session

  const BlockStats before = e->Stats();
  for (const Caller& other : {Caller{b->id}, Caller{}}) {
    SCOPED_TRACE(other.session);
    std::vector<SequenceRequest> grow = {{1, 12}};
    auto expect_denied = [](const absl::Status& s) {
      EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    };
    expect_denied(e->AllocateBlocks(grow, other).status());
    expect_denied(e->FreeSequences(std::vector<SeqId>{2}, other).status());
    expect_denied(e->ForkSequence(1, std::vector<SeqId>{40}, other).status());
    expect_denied(e->SwapOut(std::vector<SeqId>{1}, other).status());
    expect_denied(
        e->CreateBatch(OneDecodeRowEach({1}, 0), {}, false, other).status());
    expect_denied(e->CreateBatch(OneDecodeRowEach({50}, 0),
                                 std::vector<BatchId>{a.batch}, false, other)
                      .status());
    expect_denied(e->GetBatch(a.batch, other).status());
    expect_denied(
        e->ReleaseBatches(std::vector<BatchId>{a.batch}, other).status());
    expect_denied(
        e->AdvanceStep(a.batch, Sampled({5, 6}, 0), false, false, other)
            .status());
    AttentionRequest attn;
    expect_denied(e->PagedAttention(a.batch, attn, other).status());
  }
  // And a session may not touch what was made without one.
  std::vector<SequenceRequest> grow50 = {{50, 8}};
  EXPECT_EQ(e->AllocateBlocks(grow50, Caller{a.session}).status().code(),
            absl::StatusCode::kPermissionDenied);
  // Nothing changed: same blocks, the batch still there and at step 0.
  EXPECT_EQ(e->Stats().used_blocks, before.used_blocks);
  absl::StatusOr<BatchSnapshot> snap = e->GetBatch(a.batch, Caller{a.session});
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->step, 0);
  EXPECT_EQ(e->Info().num_sequences, 4);
  // Unknown ids are still reported, not refused.
  absl::StatusOr<FreeResult> f =
      e->FreeSequences(std::vector<SeqId>{999}, Caller{b->id});
  ASSERT_TRUE(f.ok());
  EXPECT_THAT(f->unknown, ElementsAre(999));
  EXPECT_TRUE(e->CheckInvariants().ok()) << e->CheckInvariants();
}

TEST(Session, OpenChecksTtlAndLimit) {
  FakeClock clock;
  auto e = MakeEngine(&clock, 64, /*max_sessions=*/2);
  EXPECT_EQ(e->OpenSession(absl::Milliseconds(99), "").status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(e->OpenSession(absl::Minutes(11), "").status().code(),
            absl::StatusCode::kOutOfRange);
  absl::StatusOr<SessionInfo> d = e->OpenSession(absl::ZeroDuration(), "");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ttl, absl::Seconds(10));  // the default
  ASSERT_TRUE(e->OpenSession(absl::Milliseconds(100), "").ok());
  EXPECT_EQ(e->OpenSession(absl::Seconds(1), "").status().code(),
            absl::StatusCode::kResourceExhausted);
  // Calls naming an unknown session fail before doing anything.
  std::vector<SequenceRequest> req = {{1, 4}};
  EXPECT_EQ(e->AllocateBlocks(req, Caller{12345}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(e->Info().num_sequences, 0);
}

// The batch of HoldSome after CreateBatch: rows at seq_len 1.
class ExactlyOnce : public ::testing::Test {
 protected:
  void SetUp() override {
    e_ = MakeEngine(&clock_);
    std::vector<SequenceRequest> req = {{1, 8}, {2, 8}};
    ASSERT_TRUE(e_->AllocateBlocks(req).ok());
    absl::StatusOr<CreateBatchResult> b =
        e_->CreateBatch(OneDecodeRowEach({1, 2}, 0), {}, false);
    ASSERT_TRUE(b.ok()) << b.status();
    batch_ = b->batch_id;
  }

  std::vector<int64_t> Positions() {
    return Values(e_->GetBatch(batch_).value().tensors.state.input_positions);
  }

  FakeClock clock_;
  std::unique_ptr<Engine> e_;
  BatchId batch_ = 0;
};

TEST_F(ExactlyOnce, RetryOfTheStepJustDoneAnswersWithoutAdvancing) {
  absl::StatusOr<AdvanceResult> first =
      e_->AdvanceStep(batch_, Sampled({5, 6}, 1), true, true);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->step, 1);
  EXPECT_THAT(Positions(), ElementsAre(1, 1));
  absl::StatusOr<AdvanceResult> retry =
      e_->AdvanceStep(batch_, Sampled({5, 6}, 1), true, true);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->step, 1);
  EXPECT_EQ(Values(retry->snapshot.tensors.state.slot_mapping),
            Values(first->snapshot.tensors.state.slot_mapping));
  EXPECT_EQ(Values(retry->flashinfer.paged_kv_indices),
            Values(first->flashinfer.paged_kv_indices));
  EXPECT_THAT(Positions(), ElementsAre(1, 1));  // not advanced again
  EXPECT_EQ(e_->GetBatch(batch_).value().step, 1);

  absl::StatusOr<AdvanceResult> second =
      e_->AdvanceStep(batch_, Sampled({8, 9}, 2), false, false);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->step, 2);
  EXPECT_THAT(Positions(), ElementsAre(2, 2));
  EXPECT_TRUE(e_->CheckInvariants().ok()) << e_->CheckInvariants();
}

TEST_F(ExactlyOnce, OtherStepNumbersAreRefusedAndChangeNothing) {
  ASSERT_TRUE(e_->AdvanceStep(batch_, Sampled({5, 6}, 1), false, false).ok());
  struct Case {
    AdvanceInput in;
    bool tensors;
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      {Sampled({5, 6}, 3), false, absl::StatusCode::kFailedPrecondition,
       "a step was skipped"},
      {Sampled({5, 6}, 7), false, absl::StatusCode::kFailedPrecondition,
       "the next is 2"},
      {Sampled({5, 7}, 1), false, absl::StatusCode::kFailedPrecondition,
       "other inputs"},
      {Sampled({5, 6}, 1), true, absl::StatusCode::kFailedPrecondition,
       "other inputs"},
      {Sampled({5, 6}, -1), false, absl::StatusCode::kInvalidArgument,
       "step must be >= 0"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<AdvanceResult> r =
        e_->AdvanceStep(batch_, c.in, c.tensors, false);
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
  }
  EXPECT_THAT(Positions(), ElementsAre(1, 1));
  ASSERT_TRUE(e_->AdvanceStep(batch_, Sampled({5, 6}, 2), false, false).ok());
  // An older step than the last is stale, not a retry.
  absl::StatusOr<AdvanceResult> old =
      e_->AdvanceStep(batch_, Sampled({5, 6}, 1), false, false);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(old.status().message(), HasSubstr("stale retry"));
  EXPECT_THAT(Positions(), ElementsAre(2, 2));
}

TEST_F(ExactlyOnce, UnnumberedStepsStayUncheckedAndCannotBeReplayed) {
  ASSERT_TRUE(e_->AdvanceStep(batch_, Sampled({5, 6}, 0), false, false).ok());
  ASSERT_TRUE(e_->AdvanceStep(batch_, Sampled({5, 6}, 0), false, false).ok());
  EXPECT_THAT(Positions(), ElementsAre(2, 2));
  absl::StatusOr<AdvanceResult> r =
      e_->AdvanceStep(batch_, Sampled({5, 6}, 2), false, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("not numbered"));
  // Numbering may start at any step.
  ASSERT_TRUE(e_->AdvanceStep(batch_, Sampled({5, 6}, 3), false, false).ok());
  EXPECT_THAT(Positions(), ElementsAre(3, 3));
}

TEST_F(ExactlyOnce, AFailedStepCanBeRetriedForReal) {
  // A wrong-shaped sample fails validation: nothing advanced, nothing
  // recorded, so the same number is still the next step.
  absl::StatusOr<AdvanceResult> bad =
      e_->AdvanceStep(batch_, Sampled({5}, 1), false, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(e_->AdvanceStep(batch_, Sampled({5, 6}, 1), false, false).ok());
  EXPECT_THAT(Positions(), ElementsAre(1, 1));
}

}  // namespace
}  // namespace kvstep
