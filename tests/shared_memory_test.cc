// PagedAttention's tensors through shared memory (RegisterSharedMemory):
// the same results as through message bytes, every refusal named and
// nothing written by a refused call, what Register accepts, ownership by
// sessions, and the limits.
#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/server.h"
#include "tests/wire_test_util.h"

namespace kvstep {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kBs = 16, kH = 4, kKv = 2, kD = 16, kTokens = 20;

// `t`'s shape and dtype, its bytes at `offset` of `shm` instead of data.
v1::Tensor InShm(const v1::Tensor& t, SharedMemory& shm, uint64_t region,
                 int64_t offset) {
  std::memcpy(shm.data() + offset, t.data().data(), t.data().size());
  v1::Tensor s = t;
  s.clear_data();
  s.mutable_shm()->set_region_id(region);
  s.mutable_shm()->set_offset(offset);
  return s;
}

class SharedMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions o;
    o.listen = absl::StrCat("unix:", ::testing::TempDir(), "kvstep-shm-",
                            getpid(), ".sock");
    o.engine.cache.num_blocks = 32;
    o.engine.cache.block_size = kBs;
    o.engine.cache.num_layers = 2;
    o.engine.cache.num_kv_heads = kKv;
    o.engine.cache.head_size = kD;
    o.engine.cache.dtype = DType::kFloat32;
    o.shared_memory.max_regions = 3;
    o.session_reap_interval = absl::Milliseconds(20);
    absl::StatusOr<std::unique_ptr<Server>> s = Server::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    client_ = Client::Connect(server_->address());
    ASSERT_TRUE(client_->WaitForReady(absl::Seconds(10)).ok());
    std::mt19937_64 rng(3);
    std::uniform_real_distribution<float> uni(-1, 1);
    for (int64_t i = 0; i < kTokens * kH * kD; ++i) q_.push_back(uni(rng));
    for (int64_t i = 0; i < kTokens * kKv * kD; ++i) {
      k_.push_back(uni(rng));
      v_.push_back(uni(rng));
    }
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(2));
  }

  // A sealed region registered by client_ (or `c`).
  std::unique_ptr<SharedMemory> Region(int64_t size, uint64_t* id,
                                       Client* c = nullptr) {
    absl::StatusOr<std::unique_ptr<SharedMemory>> shm =
        SharedMemory::Create(size);
    EXPECT_TRUE(shm.ok()) << shm.status();
    if (!shm.ok()) return nullptr;
    absl::StatusOr<v1::RegisterSharedMemoryResponse> r =
        (c ? c : client_.get())
            ->RegisterSharedMemory((*shm)->path(), (*shm)->size());
    EXPECT_TRUE(r.ok()) << r.status();
    *id = r.ok() ? r->region_id() : 0;
    return *std::move(shm);
  }

  // An explicit-mode request for one row of kTokens tokens of seq 1, whose
  // K and V are written (slots) or only read (slot -1 each).
  v1::PagedAttentionRequest Explicit(int64_t layer, bool write) {
    v1::PagedAttentionRequest req;
    req.set_layer(layer);
    *req.mutable_query() = FloatTensor(q_, {kTokens, kH, kD});
    *req.mutable_key() = FloatTensor(k_, {kTokens, kKv, kD});
    *req.mutable_value() = FloatTensor(v_, {kTokens, kKv, kD});
    std::vector<int32_t> table = {static_cast<int32_t>(table_[0]),
                                  static_cast<int32_t>(table_[1])};
    std::vector<int64_t> slots;
    for (int64_t p = 0; p < kTokens; ++p) {
      slots.push_back(write ? table_[p / kBs] * kBs + p % kBs : -1);
    }
    *req.mutable_block_tables() = MakeIndexTensor(
        std::vector<int64_t>(table.begin(), table.end()), {1, 2});
    *req.mutable_seq_lens() =
        MakeIndexTensor(std::vector<int64_t>{kTokens}, {1});
    *req.mutable_slot_mapping() = MakeIndexTensor(slots, {kTokens});
    *req.mutable_query_start_loc() =
        MakeIndexTensor(std::vector<int64_t>{0, kTokens}, {2});
    return req;
  }
  void AllocateSeq() {
    absl::StatusOr<v1::AllocateBlocksResponse> a =
        client_->AllocateBlocks({{1, kTokens}});
    ASSERT_TRUE(a.ok()) << a.status();
    table_.assign(a->sequences(0).block_table().begin(),
                  a->sequences(0).block_table().end());
    ASSERT_EQ(table_.size(), 2u);
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<Client> client_;
  std::vector<float> q_, k_, v_;
  std::vector<int64_t> table_;
};

TEST_F(SharedMemoryTest, TensorsInSharedMemoryGiveTheBytesResults) {
  AllocateSeq();
  absl::StatusOr<v1::PagedAttentionResponse> bytes =
      client_->PagedAttention(Explicit(0, true));
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  ASSERT_EQ(bytes->out().data().size(), q_.size() * sizeof(float));

  uint64_t id = 0;
  std::unique_ptr<SharedMemory> shm = Region(1 << 20, &id);
  ASSERT_NE(shm, nullptr);
  // Layer 1, everything in shared memory at unaligned offsets, the output
  // too: the same bytes as layer 0's reply.
  v1::PagedAttentionRequest req = Explicit(1, true);
  *req.mutable_query() = InShm(req.query(), *shm, id, 3);
  *req.mutable_key() = InShm(req.key(), *shm, id, 100003);
  *req.mutable_value() = InShm(req.value(), *shm, id, 200001);
  req.mutable_out_shm()->set_region_id(id);
  req.mutable_out_shm()->set_offset(300005);
  std::memset(shm->data() + 300005, 0x7f, q_.size() * sizeof(float));
  absl::StatusOr<v1::PagedAttentionResponse> r = client_->PagedAttention(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->out().data().empty());
  EXPECT_EQ(r->out().dtype(), v1::DTYPE_FLOAT32);
  EXPECT_THAT(r->out().shape(), ::testing::ElementsAre(kTokens, kH, kD));
  EXPECT_EQ(r->out().shm().region_id(), id);
  EXPECT_EQ(r->out().shm().offset(), 300005);
  EXPECT_EQ(std::memcmp(shm->data() + 300005, bytes->out().data().data(),
                        bytes->out().data().size()),
            0);

  // Aligned offsets: the server reads the inputs where they are and the
  // kernel writes the output there itself. Layer 1 again, written anew.
  req = Explicit(1, true);
  *req.mutable_query() = InShm(req.query(), *shm, id, 0);
  *req.mutable_key() = InShm(req.key(), *shm, id, 65536);
  *req.mutable_value() = InShm(req.value(), *shm, id, 131072);
  req.mutable_out_shm()->set_region_id(id);
  req.mutable_out_shm()->set_offset(196608);
  std::memset(shm->data() + 196608, 0x7f, q_.size() * sizeof(float));
  r = client_->PagedAttention(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->out().shm().offset(), 196608);
  EXPECT_EQ(std::memcmp(shm->data() + 196608, bytes->out().data().data(),
                        bytes->out().data().size()),
            0);

  // Mixed: the query in shared memory, K and V as bytes, the output as
  // bytes; a read of layer 1 (slot -1) gives the same again.
  v1::PagedAttentionRequest mixed = Explicit(1, false);
  *mixed.mutable_query() = InShm(mixed.query(), *shm, id, 0);
  r = client_->PagedAttention(mixed);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->out().data(), bytes->out().data());
}

TEST_F(SharedMemoryTest, RefusalsNameTheFieldAndWriteNothing) {
  AllocateSeq();
  absl::StatusOr<v1::PagedAttentionResponse> before =
      client_->PagedAttention(Explicit(0, true));
  ASSERT_TRUE(before.ok()) << before.status();
  uint64_t id = 0;
  const int64_t size = 64 << 10;
  std::unique_ptr<SharedMemory> shm = Region(size, &id);
  ASSERT_NE(shm, nullptr);
  const int64_t q_bytes = static_cast<int64_t>(q_.size() * sizeof(float));
  const int64_t kv_bytes = static_cast<int64_t>(k_.size() * sizeof(float));
  std::memset(shm->data(), 0x5a, size);

  // Each request writes other K and V (all 2.0) into layer 0 if accepted.
  const std::vector<float> other(k_.size(), 2.0f);
  auto request = [&] {
    v1::PagedAttentionRequest req = Explicit(0, true);
    *req.mutable_key() = FloatTensor(other, {kTokens, kKv, kD});
    *req.mutable_value() = FloatTensor(other, {kTokens, kKv, kD});
    return req;
  };
  struct Case {
    const char* what;
    v1::PagedAttentionRequest req;
    absl::StatusCode code;
    const char* message;
  };
  std::vector<Case> cases;
  {
    v1::PagedAttentionRequest r = request();
    r.mutable_query()->mutable_shm()->set_region_id(id);  // data kept too
    cases.push_back({"data and shm", r, absl::StatusCode::kInvalidArgument,
                     "query: data and shm are exclusive"});
  }
  {
    v1::PagedAttentionRequest r = request();
    r.mutable_key()->clear_data();
    r.mutable_key()->mutable_shm()->set_region_id(id + 7);
    cases.push_back({"unknown region", r, absl::StatusCode::kNotFound,
                     "key.shm.region_id"});
  }
  {
    v1::PagedAttentionRequest r = request();
    r.mutable_value()->clear_data();
    r.mutable_value()->mutable_shm()->set_region_id(id);
    r.mutable_value()->mutable_shm()->set_offset(size - kv_bytes + 1);
    cases.push_back(
        {"past the end", r, absl::StatusCode::kOutOfRange, "value.shm: bytes"});
  }
  {
    v1::PagedAttentionRequest r = request();
    r.mutable_value()->clear_data();
    r.mutable_value()->mutable_shm()->set_region_id(id);
    r.mutable_value()->mutable_shm()->set_offset(-4);
    cases.push_back(
        {"negative offset", r, absl::StatusCode::kOutOfRange, "value.shm"});
  }
  {
    v1::PagedAttentionRequest r = request();
    r.mutable_query()->clear_data();
    r.mutable_query()->mutable_shm()->set_region_id(id);
    r.mutable_query()->set_dtype(v1::DTYPE_UNSPECIFIED);
    cases.push_back(
        {"no dtype", r, absl::StatusCode::kInvalidArgument, "query: dtype"});
  }
  {
    v1::PagedAttentionRequest r = request();
    r.mutable_query()->clear_data();
    r.mutable_query()->mutable_shm()->set_region_id(id);
    r.mutable_query()->mutable_shape()->Set(0, int64_t{1} << 40);
    cases.push_back(
        {"huge shape", r, absl::StatusCode::kInvalidArgument, "too large"});
  }
  {
    v1::PagedAttentionRequest r = request();
    r.mutable_out_shm()->set_region_id(id);
    r.mutable_out_shm()->set_offset(size - q_bytes + 4);
    cases.push_back({"output past the end", r, absl::StatusCode::kOutOfRange,
                     "out_shm: bytes"});
  }
  {
    v1::PagedAttentionRequest r = request();
    *r.mutable_alibi_slopes() = FloatTensor(std::vector<float>(kH, 0.5f), {kH});
    r.mutable_alibi_slopes()->clear_data();
    r.mutable_alibi_slopes()->mutable_shm()->set_region_id(id);
    cases.push_back({"alibi in shm", r, absl::StatusCode::kInvalidArgument,
                     "alibi_slopes: shm (shared memory) is accepted only"});
  }
  for (Case& c : cases) {
    absl::StatusOr<v1::PagedAttentionResponse> r =
        client_->PagedAttention(c.req);
    EXPECT_EQ(r.status().code(), c.code) << c.what << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.message)) << c.what;
  }
  // Nothing was written: the region as it was, and layer 0's cache still
  // gives the first call's output when only read.
  for (int64_t i = 0; i < size; ++i) {
    ASSERT_EQ(shm->data()[i], 0x5a) << "byte " << i;
  }
  absl::StatusOr<v1::PagedAttentionResponse> after =
      client_->PagedAttention(Explicit(0, false));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->out().data(), before->out().data());

  // An output over an input would be computed from the zeros the kernel
  // starts it with: refused.
  {
    v1::PagedAttentionRequest r = Explicit(0, false);
    *r.mutable_query() = InShm(r.query(), *shm, id, 0);
    r.mutable_out_shm()->set_region_id(id);
    r.mutable_out_shm()->set_offset(q_bytes - 4);
    absl::StatusOr<v1::PagedAttentionResponse> o = client_->PagedAttention(r);
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(
        o.status().message(),
        HasSubstr(absl::StrCat("out_shm: bytes [", q_bytes - 4, ", ",
                               2 * q_bytes - 4, ") overlap query.shm's [0, ")));
  }

  // Other RPCs' tensors take bytes only.
  v1::AdvanceStepRequest adv;
  v1::ExplicitStepState* e = adv.mutable_explicit_state();
  e->set_num_seqs(1);
  e->set_num_queries(1);
  e->set_block_size(kBs);
  e->mutable_input_tokens()->mutable_shm()->set_region_id(id);
  e->mutable_input_tokens()->set_dtype(v1::DTYPE_INT64);
  absl::StatusOr<v1::AdvanceStepResponse> a = client_->AdvanceStep(adv);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SharedMemoryTest, RegisterTakesOnlySealedMemfds) {
  auto refused = [&](const std::string& path, int64_t size,
                     absl::StatusCode code, const char* message) {
    absl::StatusOr<v1::RegisterSharedMemoryResponse> r =
        client_->RegisterSharedMemory(path, size);
    EXPECT_EQ(r.status().code(), code) << path << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(message)) << path;
  };
  const std::string file =
      absl::StrCat(::testing::TempDir(), "kvstep-shm-", getpid(), ".file");
  {
    std::ofstream f(file);
    f << std::string(4096, 'x');
  }
  refused(file, 4096, absl::StatusCode::kFailedPrecondition,
          "not a memfd sealed with F_SEAL_SHRINK");
  std::remove(file.c_str());
  refused(file, 4096, absl::StatusCode::kFailedPrecondition,
          "cannot be opened");
  refused(::testing::TempDir(), 4096, absl::StatusCode::kFailedPrecondition,
          "not a regular file");
  refused("", 4096, absl::StatusCode::kInvalidArgument, "path is empty");

  // A memfd that could shrink.
  const int fd = memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  refused(absl::StrCat("/proc/", getpid(), "/fd/", fd), 4096,
          absl::StatusCode::kFailedPrecondition, "F_SEAL_SHRINK");
  close(fd);

  absl::StatusOr<std::unique_ptr<SharedMemory>> shm =
      SharedMemory::Create(8192);
  ASSERT_TRUE(shm.ok()) << shm.status();
  refused((*shm)->path(), 8193, absl::StatusCode::kFailedPrecondition,
          "fewer than size 8193");
  refused((*shm)->path(), 0, absl::StatusCode::kInvalidArgument,
          "size must be at least 1");

  // The limit of 3 regions; a freed place is taken again.
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<v1::RegisterSharedMemoryResponse> r =
        client_->RegisterSharedMemory((*shm)->path(), 8192);
    ASSERT_TRUE(r.ok()) << r.status();
    ids.push_back(r->region_id());
  }
  refused((*shm)->path(), 8192, absl::StatusCode::kResourceExhausted,
          "the limits are 3 regions");
  ASSERT_TRUE(client_->UnregisterSharedMemory(ids[1]).ok());
  EXPECT_EQ(client_->UnregisterSharedMemory(ids[1]).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(client_->RegisterSharedMemory((*shm)->path(), 8192).ok());

  // Over TCP the path would name a file on another host.
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.engine.cache.num_blocks = 4;
  o.engine.cache.block_size = kBs;
  o.engine.cache.num_layers = 1;
  o.engine.cache.num_kv_heads = kKv;
  o.engine.cache.head_size = kD;
  absl::StatusOr<std::unique_ptr<Server>> tcp = Server::Start(o);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  std::unique_ptr<Client> remote = Client::Connect((*tcp)->address());
  absl::StatusOr<v1::RegisterSharedMemoryResponse> r =
      remote->RegisterSharedMemory((*shm)->path(), 8192);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("unix socket"));
  (*tcp)->Shutdown(absl::Seconds(1));
}

TEST_F(SharedMemoryTest, RegionsBelongToTheirSession) {
  AllocateSeq();
  std::unique_ptr<Client> owner = Client::Connect(server_->address());
  ASSERT_TRUE(owner->OpenSession(absl::Seconds(30), "shm").ok());
  uint64_t id = 0;
  std::unique_ptr<SharedMemory> shm = Region(1 << 20, &id, owner.get());
  ASSERT_NE(shm, nullptr);
  // client_ is in no session: it may neither use nor unregister it.
  v1::PagedAttentionRequest req = Explicit(0, true);
  *req.mutable_query() = InShm(req.query(), *shm, id, 0);
  absl::StatusOr<v1::PagedAttentionResponse> r = client_->PagedAttention(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(r.status().message(),
              HasSubstr("query.shm.region_id: shared-memory region"));
  EXPECT_EQ(client_->UnregisterSharedMemory(id).code(),
            absl::StatusCode::kPermissionDenied);
  // Closing the session unregisters it.
  ASSERT_TRUE(owner->CloseSession().ok());
  EXPECT_EQ(client_->UnregisterSharedMemory(id).code(),
            absl::StatusCode::kNotFound);

  // And so does a lapse (the reaper runs every 20 ms here).
  ASSERT_TRUE(owner->OpenSession(absl::Milliseconds(100), "lapses").ok());
  std::unique_ptr<SharedMemory> shm2 = Region(4096, &id, owner.get());
  ASSERT_NE(shm2, nullptr);
  owner->set_session_id(0);
  absl::Status s;
  for (int i = 0; i < 200; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    s = client_->UnregisterSharedMemory(id);
    if (s.code() == absl::StatusCode::kNotFound) break;
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
}

}  // namespace
}  // namespace kvstep
