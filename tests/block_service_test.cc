// The block manager through gRPC: prefix caching, fork and copy-on-write,
// admission, swap, the KV-event stream, stats, and a stress test with many
// clients at once that ends with every block back in the pool.
#include <unistd.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/block_tables.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/server.h"

namespace kvstep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kBs = 16;

class BlockServiceTest : public ::testing::Test {
 protected:
  void Start(int64_t num_blocks, int64_t host_blocks = 0) {
    ServerOptions o;
    o.listen = absl::StrCat("unix:", ::testing::TempDir(), "kvstep-block-",
                            getpid(), ".sock");
    o.engine.cache.num_blocks = num_blocks;
    o.engine.cache.block_size = kBs;
    o.engine.cache.num_layers = 2;
    o.engine.cache.num_kv_heads = 2;
    o.engine.cache.head_size = 16;
    o.engine.num_host_blocks = host_blocks;
    absl::StatusOr<std::unique_ptr<Server>> s = Server::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    client_ = Client::Connect(server_->address());
    ASSERT_TRUE(client_->WaitForReady(absl::Seconds(10)).ok());
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(2));
  }

  v1::AllocateBlocksRequest Alloc(uint64_t id, int64_t tokens,
                                  const std::vector<int64_t>& prompt = {},
                                  const std::string& adapter = "") {
    v1::AllocateBlocksRequest r;
    v1::SequenceAllocation* a = r.add_sequences();
    a->set_seq_id(id);
    a->set_num_tokens(tokens);
    a->mutable_prompt_token_ids()->Assign(prompt.begin(), prompt.end());
    a->set_adapter_id(adapter);
    return r;
  }
  absl::StatusOr<v1::CreateBatchResponse> Prefill(
      uint64_t id, const std::vector<int64_t>& tokens, int64_t cached = 0) {
    v1::CreateBatchRequest c;
    v1::BatchRow* row = c.add_rows();
    row->set_seq_id(id);
    row->mutable_token_ids()->Assign(tokens.begin(), tokens.end());
    row->set_num_cached_tokens(cached);
    row->set_prefill(true);
    return client_->CreateBatch(c);
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<Client> client_;
};

std::vector<int64_t> Iota(int64_t n, int64_t from = 1) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

TEST_F(BlockServiceTest, PrefixCachingAndStats) {
  Start(64);
  const std::vector<int64_t> prompt = Iota(40);
  absl::StatusOr<v1::AllocateBlocksResponse> a =
      client_->AllocateBlocks(Alloc(1, 41, prompt, "lora-7"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->sequences(0).computed_tokens(), 0);
  ASSERT_TRUE(Prefill(1, prompt).ok());
  a = client_->AllocateBlocks(Alloc(2, 41, prompt, "lora-7"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->sequences(0).computed_tokens(), 32);
  // The scheduler starts the prefill at the computed tokens.
  ASSERT_TRUE(
      Prefill(2, std::vector<int64_t>(prompt.begin() + 32, prompt.end()), 32)
          .ok());
  a = client_->AllocateBlocks(Alloc(3, 41, prompt, "lora-8"));
  EXPECT_EQ(a->sequences(0).computed_tokens(), 0);  // another adapter
  absl::StatusOr<v1::GetServerInfoResponse> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok());
  const v1::BlockStats& st = info->stats();
  EXPECT_EQ(st.num_blocks(), 64);
  EXPECT_EQ(st.used_blocks(), 3 + 1 + 3);  // seq 2 shares seq 1's two
  EXPECT_EQ(st.cached_blocks(), 2);
  EXPECT_EQ(st.prefix_query_tokens(), 120);
  EXPECT_EQ(st.prefix_hit_tokens(), 32);
  EXPECT_NEAR(st.prefix_hit_rate(), 32.0 / 120, 1e-9);
  EXPECT_NEAR(st.kv_cache_usage_perc(), 7.0 / 64, 1e-9);
  ASSERT_TRUE(client_->ResetPrefixCache().ok());
  info = client_->GetServerInfo();
  EXPECT_EQ(info->stats().cached_blocks(), 0);
  EXPECT_TRUE(server_->engine()->CheckInvariants().ok());
}

TEST_F(BlockServiceTest, ForkThenCopyOnWrite) {
  Start(64);
  ASSERT_TRUE(client_->AllocateBlocks(Alloc(1, 20)).ok());
  ASSERT_TRUE(Prefill(1, Iota(20)).ok());  // block 2 holds 4 of 16
  const uint64_t children[] = {2, 3};
  absl::StatusOr<v1::ForkSequenceResponse> f =
      client_->ForkSequence(1, children);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->children_size(), 2);
  EXPECT_THAT(f->children(1).block_table(), ElementsAre(63, 62));
  EXPECT_EQ(client_->ForkSequence(1, children).status().code(),
            absl::StatusCode::kAlreadyExists);
  // Children and parent each want to write position 20: two copies, and
  // the last one keeps the original block.
  v1::AllocateBlocksRequest grow;
  for (uint64_t id : {1, 2, 3})
    *grow.add_sequences() = Alloc(id, 21).sequences(0);
  absl::StatusOr<v1::AllocateBlocksResponse> a = client_->AllocateBlocks(grow);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->sequences(0).copies_size(), 1);
  EXPECT_EQ(a->sequences(0).copies(0).src(), 62);
  ASSERT_EQ(a->sequences(1).copies_size(), 1);
  EXPECT_EQ(a->sequences(2).copies_size(), 0);
  EXPECT_EQ(a->sequences(2).block_table(1), 62);
  EXPECT_TRUE(server_->engine()->CheckInvariants().ok());
}

// A scheduler mirroring the tables (BlockTables) from replies that leave
// out appended tables keeps the server's tables exactly: through creation,
// growth, a fork's copy-on-write and a swap out and in.
TEST_F(BlockServiceTest, OmittedTablesAreRebuiltByAppending) {
  Start(64, /*host_blocks=*/16);
  BlockTables mirror;
  auto reserve = [&](const std::vector<std::pair<uint64_t, int64_t>>& seqs) {
    v1::AllocateBlocksRequest r;
    r.set_omit_appended_tables(true);
    for (const auto& [id, tokens] : seqs) {
      *r.add_sequences() = Alloc(id, tokens).sequences(0);
    }
    absl::StatusOr<v1::AllocateBlocksResponse> a = client_->AllocateBlocks(r);
    EXPECT_TRUE(a.ok()) << a.status();
    if (a.ok()) {
      for (const v1::SequenceBlocks& s : a->sequences()) {
        EXPECT_EQ(s.capacity_tokens(), s.num_blocks() * kBs);
        if (s.block_table_omitted()) {
          EXPECT_EQ(s.block_table_size(), 0);
        }
      }
      absl::Status applied = mirror.Apply(*a);
      EXPECT_TRUE(applied.ok()) << applied;
    }
    return a;
  };
  auto truth = [&](uint64_t id) {
    absl::StatusOr<v1::AllocateBlocksResponse> a =
        client_->AllocateBlocks(Alloc(id, 0));  // a no-op sends the table
    EXPECT_TRUE(a.ok()) << a.status();
    if (!a.ok()) return std::vector<int64_t>{};
    EXPECT_FALSE(a->sequences(0).block_table_omitted());
    return std::vector<int64_t>(a->sequences(0).block_table().begin(),
                                a->sequences(0).block_table().end());
  };
  auto known = [&](uint64_t id) {
    const std::vector<int64_t>* t = mirror.Find(id);
    return t == nullptr ? std::vector<int64_t>{99999} : *t;
  };

  absl::StatusOr<v1::AllocateBlocksResponse> a = reserve({{1, 20}});
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->sequences(0).block_table_omitted());  // created here
  ASSERT_TRUE(Prefill(1, Iota(20)).ok());
  for (int64_t tokens = 21; tokens <= 40; ++tokens) {
    a = reserve({{1, tokens}});
    ASSERT_TRUE(a.ok());
    EXPECT_TRUE(a->sequences(0).block_table_omitted());
    EXPECT_EQ(a->sequences(0).new_block_ids_size(), tokens == 33 ? 1 : 0);
  }
  EXPECT_EQ(known(1), truth(1));
  EXPECT_EQ(known(1).size(), 3u);

  // A fork's child comes with its table; the parent's next write into the
  // shared partial block copies it, and that reply carries the table.
  const uint64_t child[] = {2};
  absl::StatusOr<v1::ForkSequenceResponse> f = client_->ForkSequence(1, child);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(mirror.ApplyFork(*f).ok());
  a = reserve({{1, 21}, {2, 21}});  // both write position 20, in entry 1
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->sequences(0).block_table_omitted());
  EXPECT_EQ(a->sequences(0).copies_size(), 1);
  EXPECT_TRUE(a->sequences(1).block_table_omitted());  // kept the original
  a = reserve({{1, 50}, {2, 60}});
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->sequences(0).block_table_omitted());
  EXPECT_EQ(a->sequences(0).new_block_ids_size(), 1);
  EXPECT_EQ(a->sequences(1).new_block_ids_size(), 2);
  EXPECT_EQ(known(1), truth(1));
  EXPECT_EQ(known(2), truth(2));

  // Swapping maps every block of the sequence; appending goes on from
  // the mapped table.
  const uint64_t ids[] = {2};
  absl::StatusOr<v1::SwapResponse> sw = client_->SwapOut(ids);
  ASSERT_TRUE(sw.ok()) << sw.status();
  ASSERT_TRUE(mirror.ApplySwap(*sw, ids).ok());
  sw = client_->SwapIn(ids);
  ASSERT_TRUE(sw.ok()) << sw.status();
  ASSERT_TRUE(mirror.ApplySwap(*sw, ids).ok());
  a = reserve({{2, 70}});
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->sequences(0).block_table_omitted());
  EXPECT_EQ(a->sequences(0).new_block_ids_size(), 1);
  EXPECT_EQ(known(2), truth(2));

  // A reply the mirror missed shows as DATA_LOSS on the next omitted one,
  // and that sequence's table is left alone; a full reply resynchronizes.
  ASSERT_TRUE(client_->AllocateBlocks(Alloc(1, 80)).ok());  // not applied
  const std::vector<int64_t> stale = known(1);
  v1::AllocateBlocksRequest r = Alloc(1, 96);
  r.set_omit_appended_tables(true);
  a = client_->AllocateBlocks(r);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::Status applied = mirror.Apply(*a);
  EXPECT_EQ(applied.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(applied.message()),
              HasSubstr("seq 1: the reply left its table out and appended 1 "
                        "blocks to a table of 6, but this copy has 4 blocks"));
  EXPECT_EQ(known(1), stale);
  a = client_->AllocateBlocks(Alloc(1, 96));
  ASSERT_TRUE(a.ok() && mirror.Apply(*a).ok());
  EXPECT_EQ(known(1), truth(1));
  const uint64_t unknown[] = {7};
  EXPECT_EQ(mirror.ApplySwap(*sw, unknown).code(), absl::StatusCode::kNotFound);
  mirror.Forget(ids);
  EXPECT_EQ(mirror.Find(2), nullptr);
  EXPECT_TRUE(server_->engine()->CheckInvariants().ok());
}

TEST_F(BlockServiceTest, CanAllocateWithWatermark) {
  Start(100);  // default watermark 1%: 1 block
  absl::StatusOr<v1::CanAllocateResponse> c =
      client_->CanAllocate(Alloc(1, 99 * kBs));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->admission(), v1::CanAllocateResponse::ADMISSION_OK);
  EXPECT_EQ(c->blocks_needed(), 99);
  c = client_->CanAllocate(Alloc(1, 100 * kBs));
  EXPECT_EQ(c->admission(), v1::CanAllocateResponse::ADMISSION_NEVER);
  ASSERT_TRUE(client_->AllocateBlocks(Alloc(2, 50 * kBs)).ok());
  c = client_->CanAllocate(Alloc(1, 50 * kBs));
  EXPECT_EQ(c->admission(), v1::CanAllocateResponse::ADMISSION_LATER);
  // Look-ahead slots count toward the need.
  v1::AllocateBlocksRequest la = Alloc(1, 40 * kBs);
  la.mutable_sequences(0)->set_num_lookahead_tokens(9 * kBs);
  c = client_->CanAllocate(la);
  EXPECT_EQ(c->blocks_needed(), 49);
  EXPECT_EQ(c->admission(), v1::CanAllocateResponse::ADMISSION_OK);
  la.mutable_sequences(0)->set_num_lookahead_tokens(-1);
  EXPECT_EQ(client_->CanAllocate(la).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(BlockServiceTest, SwapOutAndIn) {
  Start(16, /*host_blocks=*/8);
  ASSERT_TRUE(client_->AllocateBlocks(Alloc(1, 40)).ok());
  absl::StatusOr<v1::CreateBatchResponse> b = Prefill(1, Iota(40));
  ASSERT_TRUE(b.ok());
  const uint64_t ids[] = {1};
  absl::StatusOr<v1::SwapResponse> out = client_->SwapOut(ids);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->copies_size(), 3);
  EXPECT_THAT(out->stale_batch_ids(), ElementsAre(b->batch_id()));
  EXPECT_EQ(out->host_free_blocks(), 5);
  EXPECT_EQ(out->free_blocks(), 16);
  absl::StatusOr<v1::SwapResponse> in = client_->SwapIn(ids);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->host_free_blocks(), 8);
  EXPECT_EQ(client_->SwapIn(ids).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const uint64_t unknown[] = {77};
  EXPECT_EQ(client_->SwapOut(unknown).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(server_->engine()->CheckInvariants().ok());
}

TEST_F(BlockServiceTest, KvEventStream) {
  Start(64);
  v1::SubscribeKvEventsRequest req;
  req.set_from_now(true);
  std::unique_ptr<Client::EventSubscription> sub =
      client_->SubscribeKvEvents(req);
  // Wait until the stream is set up, so the events below are after "now".
  absl::SleepFor(absl::Milliseconds(300));
  const std::vector<int64_t> prompt = Iota(33);
  ASSERT_TRUE(client_->AllocateBlocks(Alloc(1, 34, prompt, "ad")).ok());
  ASSERT_TRUE(Prefill(1, prompt).ok());
  ASSERT_TRUE(client_->ResetPrefixCache().ok());

  std::vector<v1::KvEvent> events;
  v1::KvEventBatch batch;
  while (events.size() < 3 && sub->Next(&batch)) {
    EXPECT_EQ(batch.missed_events(), 0);
    for (const v1::KvEvent& e : batch.events()) events.push_back(e);
  }
  ASSERT_EQ(events.size(), 3u);
  ASSERT_TRUE(events[0].has_block_stored());
  const auto& s0 = events[0].block_stored();
  EXPECT_EQ(s0.block_hashes(0).size(), 16u);
  EXPECT_TRUE(s0.parent_block_hash().empty());
  EXPECT_THAT(s0.token_ids(), ElementsAre(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                          13, 14, 15, 16));
  EXPECT_EQ(s0.block_size(), kBs);
  EXPECT_EQ(s0.adapter_id(), "ad");
  EXPECT_EQ(events[1].block_stored().parent_block_hash(), s0.block_hashes(0));
  EXPECT_TRUE(events[2].has_all_blocks_cleared());
  EXPECT_EQ(events[2].seq_no(), events[0].seq_no() + 2);
  sub->Cancel();
  while (sub->Next(&batch)) {
  }
  EXPECT_EQ(sub->Finish().code(), absl::StatusCode::kCancelled);
}

// Many schedulers at once against one server: prefix hits across clients,
// forks, swaps, batches and steps. Every call's outcome is either success
// or a clean, expected refusal; at the end every block is back.
TEST_F(BlockServiceTest, StressManyClientsEveryBlockComesBack) {
  Start(256, /*host_blocks=*/64);
  constexpr int kClients = 6;
  constexpr int kRounds = 40;
  std::atomic<int> steps{0}, hits{0}, failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<Client> c = Client::Connect(server_->address());
      std::mt19937_64 rng(t);
      for (int round = 0; round < kRounds; ++round) {
        const uint64_t a = 1000 * t + 2 * round + 1;
        const uint64_t child = a + 1;
        // Shared stems across clients make prefix hits.
        std::vector<int64_t> prompt = Iota(32, 100 * (rng() % 3));
        prompt.push_back(static_cast<int64_t>(rng() % 1000));
        absl::StatusOr<v1::AllocateBlocksResponse> al =
            c->AllocateBlocks(Alloc(a, 36, prompt));
        if (!al.ok()) {
          failures +=
              al.status().code() != absl::StatusCode::kResourceExhausted;
          continue;
        }
        const int64_t computed = al->sequences(0).computed_tokens();
        hits += computed > 0;
        v1::CreateBatchRequest cb;
        v1::BatchRow* row = cb.add_rows();
        row->set_seq_id(a);
        row->mutable_token_ids()->Assign(prompt.begin() + computed,
                                         prompt.end());
        row->set_num_cached_tokens(computed);
        row->set_prefill(true);
        absl::StatusOr<v1::CreateBatchResponse> b = c->CreateBatch(cb);
        if (!b.ok()) {
          ++failures;
          continue;
        }
        if (round % 3 == 0) {
          const uint64_t kids[] = {child};
          failures += !c->ForkSequence(a, kids).ok();
        }
        for (int s = 0; s < 3; ++s) {
          v1::AllocateBlocksRequest g = Alloc(a, 34 + s);
          if (!c->AllocateBlocks(g).ok()) break;
          v1::AdvanceStepRequest adv;
          adv.set_batch_id(b->batch_id());
          *adv.mutable_sampled_token_ids() = MakeIndexTensor({7}, {1, 1});
          absl::StatusOr<v1::AdvanceStepResponse> r = c->AdvanceStep(adv);
          if (!r.ok()) {
            ++failures;
            break;
          }
          ++steps;
        }
        if (round % 4 == 1) {
          const uint64_t ids[] = {a};
          // Either may be refused for space, never for anything else; a
          // sequence left on the host is freed from there below.
          absl::StatusOr<v1::SwapResponse> o = c->SwapOut(ids);
          if (!o.ok()) {
            failures +=
                o.status().code() != absl::StatusCode::kResourceExhausted;
          } else if (absl::StatusOr<v1::SwapResponse> i = c->SwapIn(ids);
                     !i.ok()) {
            failures +=
                i.status().code() != absl::StatusCode::kResourceExhausted;
          }
        }
        const uint64_t bid = b->batch_id();
        failures += !c->ReleaseBatches({&bid, 1}).ok();
        const uint64_t all[] = {a, child};
        failures += !c->FreeSequences(all).ok();
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(steps.load(), kClients * kRounds);
  EXPECT_GT(hits.load(), kClients);
  absl::StatusOr<v1::GetServerInfoResponse> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->stats().used_blocks(), 0);
  EXPECT_EQ(info->stats().available_blocks(), 256);
  EXPECT_EQ(info->stats().host_free_blocks(), 64);
  EXPECT_EQ(info->num_sequences(), 0);
  EXPECT_EQ(info->num_batches(), 0);
  EXPECT_TRUE(server_->engine()->CheckInvariants().ok())
      << server_->engine()->CheckInvariants();
}

}  // namespace
}  // namespace kvstep
