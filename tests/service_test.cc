// Service tests: a real kvstep server on a unix socket and on a loopback
// TCP port, driven through the client library over real gRPC connections.
#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/demo.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/convert.h"
#include "service/server.h"
#include "tests/wire_test_util.h"

namespace kvstep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<int64_t> V(const v1::Tensor& t) {
  absl::StatusOr<std::vector<int64_t>> v = IndexTensorValues(t);
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? *v : std::vector<int64_t>{};
}

ServerOptions SmallServer(const std::string& listen,
                          int64_t num_blocks = 1000) {
  ServerOptions o;
  o.listen = listen;
  o.engine.cache.num_blocks = num_blocks;
  o.engine.cache.block_size = 16;
  o.engine.cache.num_layers = 2;
  o.engine.cache.num_kv_heads = 2;
  o.engine.cache.head_size = 16;
  o.engine.cache.dtype = DType::kFloat16;
  return o;
}

std::string UnixTarget() {
  return absl::StrCat("unix:", ::testing::TempDir(), "kvstep-test-", getpid(),
                      ".sock");
}

enum class Transport { kUnix, kTcp };

class ServiceTest : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    const std::string listen =
        GetParam() == Transport::kUnix ? UnixTarget() : "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<Server>> s =
        Server::Start(SmallServer(listen));
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    client_ = Client::Connect(server_->address());
    ASSERT_TRUE(client_->WaitForReady(absl::Seconds(10)).ok());
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(1));
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<Client> client_;
};

INSTANTIATE_TEST_SUITE_P(Transports, ServiceTest,
                         ::testing::Values(Transport::kUnix, Transport::kTcp),
                         [](const auto& info) {
                           return info.param == Transport::kUnix ? "Unix"
                                                                 : "Tcp";
                         });

TEST_P(ServiceTest, ServerInfoDescribesThePool) {
  absl::StatusOr<v1::GetServerInfoResponse> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->geometry().num_blocks(), 1000);
  EXPECT_EQ(info->geometry().block_size(), 16);
  EXPECT_EQ(info->geometry().cache_dtype(), v1::DTYPE_FLOAT16);
  EXPECT_EQ(info->geometry().cache_layout(), v1::CACHE_LAYOUT_VLLM);
  EXPECT_EQ(info->geometry().bytes_per_block_per_layer(), 16 * 2 * 16 * 2);
  EXPECT_EQ(info->free_blocks(), 1000);
  EXPECT_EQ(info->block_order(), "descending");
  EXPECT_EQ(info->server_instance_id().size(), 32u);
  EXPECT_EQ(info->server_instance_id(), client_->instance_id());
  EXPECT_GT(info->limits().max_seq_len(), 0);
  EXPECT_EQ(info->limits().max_message_bytes(), 64 << 20);
}

// SEMANTICS §2 golden case 3: seed 003's five 195-token prompts, reached
// through AllocateBlocks + CreateBatch + AdvanceStep over gRPC.
TEST_P(ServiceTest, Seed003FirstDecodeSlots) {
  std::vector<std::pair<uint64_t, int64_t>> seqs;
  for (uint64_t k = 0; k < 5; ++k) seqs.emplace_back(k, 196);
  absl::StatusOr<v1::AllocateBlocksResponse> a = client_->AllocateBlocks(seqs);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->sequences_size(), 5);
  EXPECT_THAT(a->sequences(1).block_table(),
              ElementsAre(986, 985, 984, 983, 982, 981, 980, 979, 978, 977, 976,
                          975, 974));
  EXPECT_EQ(a->sequences(1).capacity_tokens(), 208);
  EXPECT_TRUE(a->sequences(1).created());
  EXPECT_EQ(a->free_blocks(), 1000 - 65);

  v1::CreateBatchRequest create;
  for (uint64_t k = 0; k < 5; ++k) {
    v1::BatchRow* row = create.add_rows();
    row->set_seq_id(k);
    for (int j = 0; j < 195; ++j) row->add_token_ids(j);
  }
  create.set_return_tensors(true);
  absl::StatusOr<v1::CreateBatchResponse> b = client_->CreateBatch(create);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->tensors().num_prefill_tokens(), 975);
  EXPECT_EQ(b->tensors().seq_lens().dtype(), v1::DTYPE_INT32);
  EXPECT_EQ(b->tensors().slot_mapping().dtype(), v1::DTYPE_INT64);
  EXPECT_EQ(V(b->tensors().slot_mapping())[0], 15984);

  v1::AdvanceStepRequest adv;
  adv.set_batch_id(b->batch_id());
  *adv.mutable_sampled_token_ids() =
      MakeIndexTensor({13, 1968, 13, 13, 13}, {5, 1});
  adv.set_return_tensors(true);
  adv.set_flashinfer(true);
  absl::StatusOr<v1::AdvanceStepResponse> r = client_->AdvanceStep(adv);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step(), 1);
  EXPECT_THAT(V(r->tensors().slot_mapping()),
              ElementsAre(15795, 15587, 15379, 15171, 14963));
  EXPECT_THAT(V(r->tensors().seq_lens()), ElementsAre(196, 196, 196, 196, 196));
  EXPECT_THAT(V(r->tensors().input_tokens()),
              ElementsAre(13, 1968, 13, 13, 13));
  EXPECT_THAT(V(r->flashinfer().paged_kv_indptr()),
              ElementsAre(0, 13, 26, 39, 52, 65));
  EXPECT_THAT(V(r->flashinfer().paged_kv_last_page_len()),
              ElementsAre(4, 4, 4, 4, 4));

  // Without return_tensors only the step comes back; GetBatch has the rest.
  adv.set_return_tensors(false);
  adv.set_flashinfer(false);
  r = client_->AdvanceStep(adv);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->has_tensors());
  absl::StatusOr<v1::GetBatchResponse> g = client_->GetBatch(b->batch_id());
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->step(), 2);
  EXPECT_THAT(V(g->tensors().slot_mapping()),
              ElementsAre(15796, 15588, 15380, 15172, 14964));
  EXPECT_THAT(g->tensors().seq_ids(), ElementsAre(0, 1, 2, 3, 4));

  // Free everything: every block returns.
  const uint64_t bid = b->batch_id();
  ASSERT_TRUE(client_->ReleaseBatches({&bid, 1}).ok());
  const std::vector<uint64_t> ids = {0, 1, 2, 3, 4, 99};
  absl::StatusOr<v1::FreeSequencesResponse> f = client_->FreeSequences(ids);
  ASSERT_TRUE(f.ok());
  EXPECT_THAT(f->unknown_seq_ids(), ElementsAre(99));
  EXPECT_EQ(f->blocks_freed(), 65);
  EXPECT_EQ(f->free_blocks(), 1000);
}

TEST_P(ServiceTest, AllocateIsAllOrNothingAndSafeToRetry) {
  const std::vector<std::pair<uint64_t, int64_t>> first = {{1, 100}};
  absl::StatusOr<v1::AllocateBlocksResponse> a = client_->AllocateBlocks(first);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->sequences(0).new_block_ids_size(), 7);
  a = client_->AllocateBlocks(first);  // a retry
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->sequences(0).new_block_ids_size(), 0);
  EXPECT_FALSE(a->sequences(0).created());
  EXPECT_EQ(a->free_blocks(), 993);

  const std::vector<std::pair<uint64_t, int64_t>> too_many = {{1, 200},
                                                              {2, 16 * 990}};
  a = client_->AllocateBlocks(too_many);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(a.status().message()),
              HasSubstr("need 996 blocks, 993 available: 3 blocks missing"));
  absl::StatusOr<v1::GetServerInfoResponse> info = client_->GetServerInfo();
  EXPECT_EQ(info->free_blocks(), 993);
  EXPECT_EQ(info->num_sequences(), 1);
}

// The op itself: every tensor in the request, updated ones in the reply.
TEST_P(ServiceTest, ExplicitModeGoldenCase1) {
  v1::AdvanceStepRequest req;
  v1::ExplicitStepState* e = req.mutable_explicit_state();
  e->set_num_seqs(4);
  e->set_num_queries(4);
  e->set_block_size(128);
  *e->mutable_input_tokens() = MakeIndexTensor({0, 0, 0, 0}, {4});
  *e->mutable_input_positions() = MakeIndexTensor({5, 7, 5, 5}, {4});
  *e->mutable_seq_lens() = MakeIndexTensor({6, 8, 6, 6}, {4}, v1::DTYPE_INT32);
  *e->mutable_slot_mapping() = MakeIndexTensor({0, 0, 0, 0}, {4});
  *e->mutable_block_tables() =
      MakeIndexTensor({0, 1, 2, 3}, {4, 1}, v1::DTYPE_INT32);
  *req.mutable_sampled_token_ids() =
      MakeIndexTensor({13, 1968, 13, 13}, {4, 1});
  absl::StatusOr<v1::AdvanceStepResponse> r = client_->AdvanceStep(req);
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::ExplicitStepState& out = r->explicit_state();
  EXPECT_THAT(V(out.input_tokens()), ElementsAre(13, 1968, 13, 13));
  EXPECT_THAT(V(out.input_positions()), ElementsAre(6, 8, 6, 6));
  EXPECT_THAT(V(out.seq_lens()), ElementsAre(7, 9, 7, 7));
  EXPECT_EQ(out.seq_lens().dtype(), v1::DTYPE_INT32);
  EXPECT_THAT(V(out.slot_mapping()), ElementsAre(6, 136, 262, 390));
  EXPECT_THAT(V(out.block_tables()), ElementsAre(0, 1, 2, 3));

  // A block id outside this server's pool of 1000 is refused.
  *e->mutable_block_tables() =
      MakeIndexTensor({0, 1, 2, 1000}, {4, 1}, v1::DTYPE_INT32);
  r = client_->AdvanceStep(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("row 3: block_tables[3][0] = 1000 is not a block of "
                        "the pool [0, 1000)"));
}

TEST_P(ServiceTest, WireValidationNamesTheField) {
  v1::AdvanceStepRequest req;
  v1::ExplicitStepState* e = req.mutable_explicit_state();
  e->set_num_seqs(1);
  e->set_num_queries(1);
  e->set_block_size(16);
  *e->mutable_input_tokens() = MakeIndexTensor({0}, {1});
  *e->mutable_input_positions() = MakeIndexTensor({0}, {1});
  *e->mutable_seq_lens() = MakeIndexTensor({3}, {1});
  *e->mutable_slot_mapping() = MakeIndexTensor({0}, {1});
  *e->mutable_block_tables() = MakeIndexTensor({0}, {1, 1});
  *req.mutable_sampled_token_ids() = MakeIndexTensor({1}, {1, 1});
  ASSERT_TRUE(client_->AdvanceStep(req).ok());

  struct Case {
    std::function<void(v1::AdvanceStepRequest*)> mutate;
    absl::StatusCode code;
    std::string text;
  };
  const std::vector<Case> cases = {
      {[](auto* r) {
         r->mutable_explicit_state()
             ->mutable_seq_lens()
             ->mutable_data()
             ->pop_back();
       },
       absl::StatusCode::kInvalidArgument,
       "explicit_state.seq_lens: tensor: int64[1] needs 8 bytes, got 7"},
      {[](auto* r) {
         r->mutable_explicit_state()->mutable_slot_mapping()->set_dtype(
             v1::DTYPE_UNSPECIFIED);
       },
       absl::StatusCode::kInvalidArgument,
       "explicit_state.slot_mapping: dtype is missing"},
      {[](auto* r) {
         r->mutable_explicit_state()->mutable_slot_mapping()->set_dtype(
             static_cast<v1::DType>(99));
       },
       absl::StatusCode::kInvalidArgument, "dtype is missing or unknown (99)"},
      {[](auto* r) {
         r->mutable_explicit_state()->mutable_block_tables()->set_shape(0, -1);
       },
       absl::StatusCode::kInvalidArgument,
       "explicit_state.block_tables: tensor: shape [-1, 1] has a negative"},
      {[](auto* r) { r->mutable_explicit_state()->clear_input_positions(); },
       absl::StatusCode::kInvalidArgument, "input_positions is missing"},
      {[](auto* r) { r->set_batch_id(5); }, absl::StatusCode::kInvalidArgument,
       "batch_id and explicit_state are exclusive"},
      {[](auto* r) {
         *r->mutable_sampled_token_ids() =
             MakeIndexTensor({1}, {1, 1}, v1::DTYPE_INT32);
       },
       absl::StatusCode::kInvalidArgument,
       "sampled_token_ids must be int64, got int32"},
      {[](auto* r) { r->mutable_explicit_state()->set_num_queries(2); },
       absl::StatusCode::kInvalidArgument,
       "num_queries must be in [1, num_seqs=1]"},
      {[](auto* r) { r->clear_explicit_state(); },
       absl::StatusCode::kInvalidArgument, "batch_id is missing"},
  };
  for (const Case& c : cases) {
    v1::AdvanceStepRequest bad = req;
    c.mutate(&bad);
    absl::StatusOr<v1::AdvanceStepResponse> r = client_->AdvanceStep(bad);
    EXPECT_EQ(r.status().code(), c.code) << c.text << ": " << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.text));
  }

  v1::AdvanceStepRequest unknown;
  unknown.set_batch_id(12345);
  *unknown.mutable_sampled_token_ids() = MakeIndexTensor({1}, {1, 1});
  EXPECT_EQ(client_->AdvanceStep(unknown).status().code(),
            absl::StatusCode::kNotFound);

  v1::CreateBatchRequest cb;
  cb.add_rows()->set_seq_id(1);
  cb.set_seq_lens_dtype(v1::DTYPE_FLOAT32);
  absl::StatusOr<v1::CreateBatchResponse> c = client_->CreateBatch(cb);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("seq_lens_dtype"));
}

// N steps of incremental decoding through the service (a prefill, then
// PagedAttention + AdvanceStep each step) match dense causal attention
// over each whole sequence. Two sequences, GQA 4/2, fp32 cache.
TEST(ServiceAttention, IncrementalDecodingMatchesDenseAttention) {
  ServerOptions o = SmallServer(UnixTarget() + ".attn", 64);
  o.engine.cache.dtype = DType::kFloat32;
  o.engine.cache.num_kv_heads = 2;
  o.engine.cache.head_size = 16;
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  std::unique_ptr<Client> c = Client::Connect((*server)->address());
  constexpr int64_t H = 4, KV = 2, D = 16, kPrompt = 13, kSteps = 20;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> uni(-1, 1);
  // history[s]: per position, q [H*D], k and v [KV*D].
  struct Tok {
    std::vector<float> q, k, v;
  };
  std::vector<std::vector<Tok>> hist(2);
  auto make = [&] {
    Tok t;
    for (int i = 0; i < H * D; ++i) t.q.push_back(uni(rng));
    for (int i = 0; i < KV * D; ++i) t.k.push_back(uni(rng));
    for (int i = 0; i < KV * D; ++i) t.v.push_back(uni(rng));
    return t;
  };
  // Dense causal attention of sequence s's token at position p.
  auto dense = [&](int s, int64_t p) {
    std::vector<double> out(H * D, 0.0);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / (H / KV);
      std::vector<double> l;
      for (int64_t j = 0; j <= p; ++j) {
        double d = 0;
        for (int64_t x = 0; x < D; ++x) {
          d += hist[s][p].q[h * D + x] * hist[s][j].k[kvh * D + x];
        }
        l.push_back(d / std::sqrt(static_cast<double>(D)));
      }
      const double m = *std::max_element(l.begin(), l.end());
      double sum = 0;
      for (double& x : l) sum += (x = std::exp(x - m));
      for (int64_t j = 0; j <= p; ++j) {
        for (int64_t x = 0; x < D; ++x) {
          out[h * D + x] += l[j] / sum * hist[s][j].v[kvh * D + x];
        }
      }
    }
    return out;
  };
  // Runs PagedAttention for the tokens (s, p) listed, in batch order.
  auto attend = [&](uint64_t batch,
                    const std::vector<std::pair<int, int64_t>>& toks) {
    std::vector<float> q, k, v;
    for (auto [s, p] : toks) {
      const Tok& t = hist[s][p];
      q.insert(q.end(), t.q.begin(), t.q.end());
      k.insert(k.end(), t.k.begin(), t.k.end());
      v.insert(v.end(), t.v.begin(), t.v.end());
    }
    const int64_t n = static_cast<int64_t>(toks.size());
    v1::PagedAttentionRequest req;
    req.set_batch_id(batch);
    req.set_layer(1);
    *req.mutable_query() = FloatTensor(q, {n, H, D});
    *req.mutable_key() = FloatTensor(k, {n, KV, D});
    *req.mutable_value() = FloatTensor(v, {n, KV, D});
    absl::StatusOr<v1::PagedAttentionResponse> r = c->PagedAttention(req);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return;
    const std::vector<float> out = FloatValues(r->out());
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<double> want = dense(toks[i].first, toks[i].second);
      for (int64_t x = 0; x < H * D; ++x) {
        ASSERT_NEAR(out[i * H * D + x], want[x], 1e-4)
            << "seq " << toks[i].first << " position " << toks[i].second;
      }
    }
  };
  // Prefill: both prompts in one batch.
  ASSERT_TRUE(c->AllocateBlocks({{1, kPrompt + 1}, {2, kPrompt + 1}}).ok());
  v1::CreateBatchRequest cb;
  std::vector<std::pair<int, int64_t>> toks;
  for (uint64_t s = 1; s <= 2; ++s) {
    v1::BatchRow* row = cb.add_rows();
    row->set_seq_id(s);
    for (int64_t p = 0; p < kPrompt; ++p) {
      row->add_token_ids(p);
      hist[s - 1].push_back(make());
      toks.emplace_back(s - 1, p);
    }
  }
  cb.set_block_table_width(4);  // room for the decode steps' blocks
  absl::StatusOr<v1::CreateBatchResponse> b = c->CreateBatch(cb);
  ASSERT_TRUE(b.ok()) << b.status();
  attend(b->batch_id(), toks);
  for (int64_t step = 0; step < kSteps; ++step) {
    const int64_t len = kPrompt + step;  // tokens before this step's
    ASSERT_TRUE(c->AllocateBlocks({{1, len + 1}, {2, len + 1}}).ok());
    v1::AdvanceStepRequest adv;
    adv.set_batch_id(b->batch_id());
    *adv.mutable_sampled_token_ids() = MakeIndexTensor({5, 6}, {2, 1});
    absl::StatusOr<v1::AdvanceStepResponse> stepped = c->AdvanceStep(adv);
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    hist[0].push_back(make());
    hist[1].push_back(make());
    attend(b->batch_id(), {{0, len}, {1, len}});
    if (HasFatalFailure()) return;
  }
  // A fork shares the last, partly filled block: attention for the parent's
  // next step must not write there until AllocateBlocks copies it.
  const uint64_t child[] = {3};
  ASSERT_TRUE(c->ForkSequence(1, child).ok());
  v1::PagedAttentionRequest req;
  req.set_batch_id(b->batch_id());
  *req.mutable_query() = FloatTensor(std::vector<float>(2 * H * D), {2, H, D});
  *req.mutable_key() = FloatTensor(std::vector<float>(2 * KV * D), {2, KV, D});
  *req.mutable_value() =
      FloatTensor(std::vector<float>(2 * KV * D), {2, KV, D});
  absl::StatusOr<v1::PagedAttentionResponse> r = c->PagedAttention(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("shared"));
  // Wrong shapes are refused before anything is written.
  *req.mutable_key() = FloatTensor(std::vector<float>(KV * D), {1, KV, D});
  EXPECT_EQ(c->PagedAttention(req).status().code(),
            absl::StatusCode::kFailedPrecondition);  // the shared block first
  const uint64_t kid[] = {3};
  ASSERT_TRUE(c->FreeSequences(kid).ok());
  r = c->PagedAttention(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("key must be"));
  (*server)->Shutdown(absl::Seconds(1));
}

// The README's main job (scripts/run-demo.sh: kvstep-cli demo against a
// 1000-block server): prefill, decode steps across a block boundary with
// the tables kept by the client, and every block back at the end.
TEST(Demo, TheMainJobRunsAndGivesEveryBlockBack) {
  ServerOptions o = SmallServer(UnixTarget() + ".demo", 1000);
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  std::unique_ptr<Client> c = Client::Connect((*server)->address());
  ASSERT_TRUE(c->WaitForReady(absl::Seconds(10)).ok());
  DemoOptions d;
  d.steps = 30;  // 195 + 30 tokens: the rows' tables grow by a block
  d.ping_rounds = 10;
  std::ostringstream out;
  absl::Status s = RunDemo(*c, d, out);
  ASSERT_TRUE(s.ok()) << s << "\n" << out.str();
  EXPECT_THAT(out.str(), HasSubstr("the client's tables (kept from replies "
                                   "without them) matched the batch's at "
                                   "every step"));
  EXPECT_THAT(out.str(), HasSubstr("freed 5 sequences, 75 blocks; 1000 free "
                                   "(was 1000)"));
  EXPECT_TRUE((*server)->engine()->CheckInvariants().ok());
  (*server)->Shutdown(absl::Seconds(1));
}

TEST(ServiceAttention, ExplicitModeMatchesAPlainComputation) {
  ServerOptions o = SmallServer(UnixTarget() + ".explicit", 16);
  o.engine.cache.dtype = DType::kFloat32;
  o.engine.cache.num_kv_heads = 1;
  o.engine.cache.head_size = 8;
  o.engine.cache.layout = CacheLayout::kNhd;
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  std::unique_ptr<Client> c = Client::Connect((*server)->address());
  // One row, two tokens written at slots 5*16+0 and 5*16+1; a query on the
  // second attends both: with identical keys the output is the mean of V.
  v1::PagedAttentionRequest req;
  req.set_layer(0);
  *req.mutable_block_tables() = MakeIndexTensor({5}, {1, 1});
  *req.mutable_seq_lens() = MakeIndexTensor({2}, {1});
  *req.mutable_slot_mapping() = MakeIndexTensor({80, 81}, {2});
  *req.mutable_query_start_loc() = MakeIndexTensor({0, 2}, {2});
  std::vector<float> k(16, 0.5f), v(16);
  for (int i = 0; i < 8; ++i) {
    v[i] = 1.0f;
    v[8 + i] = 3.0f;
  }
  *req.mutable_query() = FloatTensor(std::vector<float>(16, 0.25f), {2, 1, 8});
  *req.mutable_key() = FloatTensor(k, {2, 1, 8});
  *req.mutable_value() = FloatTensor(v, {2, 1, 8});
  absl::StatusOr<v1::PagedAttentionResponse> r = c->PagedAttention(req);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> out = FloatValues(r->out());
  for (int i = 0; i < 8; ++i) {
    EXPECT_FLOAT_EQ(out[i], 1.0f);      // token 0 sees only itself
    EXPECT_FLOAT_EQ(out[8 + i], 2.0f);  // token 1: mean of 1 and 3
  }
  req.set_batch_id(9);
  EXPECT_EQ(c->PagedAttention(req).status().code(),
            absl::StatusCode::kInvalidArgument);
  (*server)->Shutdown(absl::Seconds(1));
}

TEST_P(ServiceTest, HealthIsServing) {
  absl::StatusOr<bool> serving = client_->IsServing();
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_TRUE(*serving);
}

// Server reflection answers list_services with the KvStep service. Debian
// ships no reflection .proto, so the request is encoded by hand:
// ServerReflectionRequest{list_services = ""} is field 7, length 0.
TEST_P(ServiceTest, ReflectionListsTheService) {
  auto channel = grpc::CreateChannel(server_->address(),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto call = stub.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      &cq);
  auto wait = [&](intptr_t want) {
    void* tag;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), want);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(wait(1));
  const char req_bytes[] = {0x3a, 0x00};
  grpc::Slice slice(req_bytes, sizeof(req_bytes));
  grpc::ByteBuffer req(&slice, 1);
  call->Write(req, reinterpret_cast<void*>(2));
  ASSERT_TRUE(wait(2));
  grpc::ByteBuffer resp;
  call->Read(&resp, reinterpret_cast<void*>(3));
  ASSERT_TRUE(wait(3));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(resp.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  EXPECT_THAT(bytes, HasSubstr("kvstep.v1.KvStep"));
  call->WritesDone(reinterpret_cast<void*>(4));
  wait(4);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  wait(5);
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
}

TEST_P(ServiceTest, ExpiredDeadlineFailsTheCall) {
  // A deadline already past fails before anything is sent. (A deadline of
  // a nanosecond is not deterministic: a fast loopback reply can beat the
  // deadline timer.)
  absl::StatusOr<v1::GetServerInfoResponse> r =
      client_->GetServerInfo(absl::Seconds(-1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
}

// A peer that accepts TCP connections but never speaks HTTP/2: the call
// must end at its deadline, not hang.
TEST(ClientDeadline, AStalledServerTimesOutAtTheDeadline) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  std::unique_ptr<Client> client =
      Client::Connect(absl::StrCat("127.0.0.1:", ntohs(addr.sin_port)));
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::GetServerInfoResponse> r =
      client->GetServerInfo(absl::Milliseconds(200));
  const absl::Duration took = absl::Now() - start;
  close(fd);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded)
      << r.status();
  EXPECT_GE(took, absl::Milliseconds(150));
  EXPECT_LT(took, absl::Seconds(10));
}

TEST(ServiceRestart, ClientNoticesANewInstance) {
  const std::string target = UnixTarget() + ".restart";
  absl::StatusOr<std::unique_ptr<Server>> a =
      Server::Start(SmallServer(target, 64));
  ASSERT_TRUE(a.ok()) << a.status();
  std::unique_ptr<Client> client = Client::Connect(target);
  absl::StatusOr<v1::GetServerInfoResponse> first = client->GetServerInfo();
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(client->server_restarted());
  (*a)->Shutdown(absl::Seconds(1));
  a->reset();

  absl::StatusOr<std::unique_ptr<Server>> b =
      Server::Start(SmallServer(target, 64));
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<v1::GetServerInfoResponse> second;
  for (int i = 0; i < 100; ++i) {  // the channel reconnects
    second = client->GetServerInfo(absl::Seconds(2));
    if (second.ok()) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(second->server_instance_id(), first->server_instance_id());
  EXPECT_TRUE(client->server_restarted());
}

TEST(Convert, TensorViewOfProtoReadsTheProtosBytes) {
  const std::vector<float> v = {1.5f, -2.0f, 3.25f, 0.0f, 8.0f, -1.0f};
  v1::Tensor p;
  p.set_dtype(v1::DTYPE_FLOAT32);
  p.add_shape(2);
  p.add_shape(3);
  p.set_data(std::string(reinterpret_cast<const char*>(v.data()),
                         v.size() * sizeof(float)));
  absl::StatusOr<Tensor> view = TensorViewOfProto(p, true, "query");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->raw_data(), static_cast<const void*>(p.data().data()));
  EXPECT_EQ(view->DebugString(), "float32[2, 3]");
  absl::StatusOr<Tensor> copy = TensorFromProto(p, true, "query");
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_NE(copy->raw_data(), view->raw_data());
  EXPECT_EQ(std::memcmp(copy->raw_data(), view->raw_data(), p.data().size()),
            0);
  EXPECT_FALSE(TensorViewOfProto(p, false, "query")->defined());
  // The same checks as the copy, naming the field.
  p.add_shape(2);
  absl::StatusOr<Tensor> bad = TensorViewOfProto(p, true, "key");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              testing::HasSubstr("key: tensor: float32[2, 3, 2] needs 48 "
                                 "bytes, got 24"));
  p.set_dtype(static_cast<v1::DType>(99));
  EXPECT_THAT(
      std::string(TensorViewOfProto(p, true, "value").status().message()),
      testing::HasSubstr("value: dtype is missing or unknown"));
}

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVSTEP_OWN_ALLOCATOR 1
#endif
#endif

TEST(KeepFreedMemory, AFreedBlockComesBackWithoutPageFaults) {
#ifdef KVSTEP_OWN_ALLOCATOR
  GTEST_SKIP() << "the sanitizer's allocator is not glibc's";
#else
  ASSERT_TRUE(KeepFreedMemory());
  constexpr size_t kBytes = size_t{16} << 20;  // 4096 pages of 4 KB
  auto minor_faults = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
  };
  char* a = static_cast<char*>(std::malloc(kBytes));
  ASSERT_NE(a, nullptr);
  std::memset(a, 1, kBytes);
  // Keeps the memset: a store to memory about to be freed is otherwise
  // dead, and the first block would never have been touched.
  asm volatile("" : : "r"(a) : "memory");
  std::free(a);
  const long before = minor_faults();
  char* b = static_cast<char*>(std::malloc(kBytes));
  ASSERT_NE(b, nullptr);
  std::memset(b, 2, kBytes);
  const long faults = minor_faults() - before;
  std::free(b);
  // glibc's defaults would mmap the block afresh (or trim the heap under
  // it), and touching it again fault in each page: 4096 on 4 KB pages.
  EXPECT_LT(faults, 64);
#endif
}

TEST(ServiceStart, BadOptionsAreReported) {
  ServerOptions o = SmallServer("127.0.0.1:0");
  o.engine.cache.block_size = 0;
  EXPECT_EQ(Server::Start(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = SmallServer("unix:/nonexistent-dir/x.sock");
  EXPECT_EQ(Server::Start(o).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvstep
