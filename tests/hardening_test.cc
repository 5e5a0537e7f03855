// Production hardening over real gRPC: bearer tokens, TLS and mutual TLS
// (certificates made by openssl at test time), the unix socket's mode,
// sessions carried in metadata and reaped by the server, exactly-once
// AdvanceStep on the wire, and the Prometheus endpoint.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/server.h"

namespace kvstep {
namespace {

using ::testing::HasSubstr;

ServerOptions SmallServer(const std::string& listen) {
  ServerOptions o;
  o.listen = listen;
  o.engine.cache.num_blocks = 256;
  o.engine.cache.block_size = 16;
  o.engine.cache.num_layers = 1;
  o.engine.cache.num_kv_heads = 1;
  o.engine.cache.head_size = 16;
  o.engine.cache.dtype = DType::kFloat16;
  return o;
}

std::unique_ptr<Server> StartOrDie(const ServerOptions& o) {
  absl::StatusOr<std::unique_ptr<Server>> s = Server::Start(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream data;
  data << in.rdbuf();
  return data.str();
}

// ---- bearer token
// ------------------------------------------------------------

TEST(BearerToken, EveryKvStepCallNeedsItButHealthDoesNot) {
  ServerOptions o = SmallServer("127.0.0.1:0");
  o.auth_token = "s3cret-token-of-some-length";
  auto server = StartOrDie(o);
  ASSERT_NE(server, nullptr);

  auto anonymous = Client::Connect(server->address());
  absl::StatusOr<v1::GetServerInfoResponse> r = anonymous->GetServerInfo();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(r.status().message(), HasSubstr("Bearer"));
  std::vector<std::pair<uint64_t, int64_t>> seqs = {{1, 16}};
  EXPECT_EQ(anonymous->AllocateBlocks(seqs).status().code(),
            absl::StatusCode::kUnauthenticated);
  // Probes keep working without the token.
  absl::StatusOr<bool> serving = anonymous->IsServing();
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_TRUE(*serving);

  ClientOptions wrong;
  wrong.auth_token = "s3cret-token-of-some-lengtX";
  EXPECT_EQ(Client::Connect(server->address(), wrong)
                ->AllocateBlocks(seqs)
                .status()
                .code(),
            absl::StatusCode::kUnauthenticated);
  ClientOptions prefix;
  prefix.auth_token = "s3cret";
  EXPECT_EQ(Client::Connect(server->address(), prefix)
                ->GetServerInfo()
                .status()
                .code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(server->engine()->Info().num_sequences, 0);

  ClientOptions right;
  right.auth_token = o.auth_token;
  auto client = Client::Connect(server->address(), right);
  EXPECT_TRUE(client->AllocateBlocks(seqs).ok());
  EXPECT_EQ(server->engine()->Info().num_sequences, 1);
}

// ---- TLS
// -----------------------------------------------------------------------

// A CA, a server certificate for localhost/127.0.0.1 and a client
// certificate, made once for the suite.
class Tls : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(
        absl::StrCat(::testing::TempDir(), "kvstep-tls-", getpid()));
    const std::string d = *dir_;
    const std::string key =
        "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string script = absl::StrCat(
        "set -e; mkdir -p ", d, "; cd ", d, "; openssl req -x509 ", key,
        " -keyout ca.key -out ca.pem -days 2 -subj /CN=kvstep-test-ca",
        "; openssl req ", key,
        " -keyout server.key -out server.csr -subj /CN=localhost",
        "; printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext",
        "; openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key "
        "-CAcreateserial -out server.pem -days 2 -extfile san.ext",
        "; openssl req ", key,
        " -keyout client.key -out client.csr -subj /CN=scheduler",
        "; openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key "
        "-CAcreateserial -out client.pem -days 2",
        "; openssl req -x509 ", key,
        " -keyout other.key -out other.pem -days 2 -subj /CN=intruder");
    ok_ = std::system(absl::StrCat("(", script, ") >/dev/null 2>&1").c_str()) ==
          0;
  }
  static void TearDownTestSuite() {
    std::system(absl::StrCat("rm -rf ", *dir_).c_str());
    delete dir_;
  }
  void SetUp() override {
    ASSERT_TRUE(ok_) << "openssl could not make the test certificates";
  }

  static std::string File(const std::string& name) {
    return absl::StrCat(*dir_, "/", name);
  }
  static ServerOptions TlsServer(bool mutual) {
    ServerOptions o = SmallServer("127.0.0.1:0");
    o.tls.cert_file = File("server.pem");
    o.tls.key_file = File("server.key");
    if (mutual) o.tls.client_ca_file = File("ca.pem");
    return o;
  }
  static ClientOptions TlsClient(const std::string& cert = "",
                                 const std::string& key = "") {
    ClientOptions c;
    c.use_tls = true;
    c.tls_root_certs_pem = ReadAll(File("ca.pem"));
    if (!cert.empty()) {
      c.tls_cert_chain_pem = ReadAll(File(cert));
      c.tls_private_key_pem = ReadAll(File(key));
    }
    c.timeout = absl::Seconds(5);
    return c;
  }

  static std::string* dir_;
  static bool ok_;
};
std::string* Tls::dir_ = nullptr;
bool Tls::ok_ = false;

TEST_F(Tls, ServerTlsAcceptsVerifyingClientsOnly) {
  auto server = StartOrDie(TlsServer(/*mutual=*/false));
  ASSERT_NE(server, nullptr);
  auto client = Client::Connect(server->address(), TlsClient());
  absl::StatusOr<v1::GetServerInfoResponse> r = client->GetServerInfo();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->server_instance_id(), server->engine()->instance_id());

  ClientOptions plain;
  plain.timeout = absl::Seconds(2);
  EXPECT_EQ(Client::Connect(server->address(), plain)
                ->GetServerInfo()
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
  // A client that trusts another CA refuses the server.
  ClientOptions distrust = TlsClient();
  distrust.tls_root_certs_pem = ReadAll(File("other.pem"));
  EXPECT_EQ(Client::Connect(server->address(), distrust)
                ->GetServerInfo()
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(Tls, MutualTlsNeedsAClientCertificateFromTheCa) {
  auto server = StartOrDie(TlsServer(/*mutual=*/true));
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(
      Client::Connect(server->address(), TlsClient("client.pem", "client.key"))
          ->GetServerInfo()
          .ok());
  EXPECT_EQ(Client::Connect(server->address(), TlsClient())
                ->GetServerInfo()
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(
      Client::Connect(server->address(), TlsClient("other.pem", "other.key"))
          ->GetServerInfo()
          .status()
          .code(),
      absl::StatusCode::kUnavailable);
}

TEST_F(Tls, BadFilesAreRefusedAtStart) {
  ServerOptions o = TlsServer(false);
  o.tls.key_file = File("missing.key");
  absl::StatusOr<std::unique_ptr<Server>> s = Server::Start(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("missing.key"));
  o = SmallServer("127.0.0.1:0");
  o.tls.client_ca_file = File("ca.pem");
  EXPECT_EQ(Server::Start(o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- unix socket mode
// ----------------------------------------------------------

TEST(UnixSocket, IsCreatedWithTheConfiguredMode) {
  for (int mode : {0600, 0660}) {
    const std::string path = absl::StrCat(::testing::TempDir(), "kvstep-mode-",
                                          getpid(), "-", mode, ".sock");
    ServerOptions o = SmallServer(absl::StrCat("unix:", path));
    o.socket_mode = mode;
    auto server = StartOrDie(o);
    ASSERT_NE(server, nullptr);
    struct stat st;
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, static_cast<mode_t>(mode))
        << absl::StrFormat("%o", st.st_mode & 0777);
    EXPECT_TRUE(Client::Connect(server->address())->GetServerInfo().ok());
  }
  ServerOptions bad = SmallServer("127.0.0.1:0");
  bad.socket_mode = 01777;
  EXPECT_EQ(Server::Start(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- sessions over the wire
// ----------------------------------------------------

TEST(SessionService, ALapsedSessionIsReapedByTheServer) {
  ServerOptions o = SmallServer("127.0.0.1:0");
  o.session_reap_interval = absl::Milliseconds(20);
  auto server = StartOrDie(o);
  ASSERT_NE(server, nullptr);
  auto client = Client::Connect(server->address());
  absl::StatusOr<v1::OpenSessionResponse> s =
      client->OpenSession(absl::Milliseconds(300), "doomed");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->ttl_ms(), 300);
  EXPECT_EQ(client->session_id(), s->session_id());
  std::vector<std::pair<uint64_t, int64_t>> seqs = {{1, 100}, {2, 50}};
  ASSERT_TRUE(client->AllocateBlocks(seqs).ok());
  v1::CreateBatchRequest batch;
  batch.add_rows()->set_seq_id(1);
  batch.mutable_rows(0)->add_token_ids(5);
  ASSERT_TRUE(client->CreateBatch(batch).ok());
  EXPECT_EQ(server->engine()->Stats().used_blocks, 7 + 4);

  // Another client (no session) may not free the session's sequences.
  auto other = Client::Connect(server->address());
  std::vector<uint64_t> ids = {1, 2};
  EXPECT_EQ(other->FreeSequences(ids).status().code(),
            absl::StatusCode::kPermissionDenied);

  // The scheduler goes silent (as if killed): the server frees its blocks.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (server->engine()->Info().num_sessions > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const EngineInfo info = server->engine()->Info();
  EXPECT_EQ(info.num_sessions, 0);
  EXPECT_EQ(info.sessions_expired, 1);
  EXPECT_EQ(info.num_sequences, 0);
  EXPECT_EQ(info.num_batches, 0);
  EXPECT_EQ(info.stats.used_blocks, 0);
  absl::StatusOr<v1::AllocateBlocksResponse> late =
      client->AllocateBlocks(seqs);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(late.status().message(), HasSubstr("open a new session"));
  absl::StatusOr<v1::GetServerInfoResponse> gi = other->GetServerInfo();
  ASSERT_TRUE(gi.ok());
  EXPECT_EQ(gi->sessions_expired(), 1);
}

TEST(SessionService, CloseFreesAndMalformedMetadataIsRefused) {
  auto server = StartOrDie(SmallServer("127.0.0.1:0"));
  ASSERT_NE(server, nullptr);
  auto client = Client::Connect(server->address());
  ASSERT_TRUE(client->OpenSession().ok());
  ASSERT_TRUE(client->KeepAlive().ok());
  std::vector<std::pair<uint64_t, int64_t>> seqs = {{1, 100}};
  ASSERT_TRUE(client->AllocateBlocks(seqs).ok());
  absl::StatusOr<v1::CloseSessionResponse> closed = client->CloseSession();
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(closed->sequences_freed(), 1);
  EXPECT_EQ(closed->blocks_freed(), 7);
  EXPECT_EQ(client->session_id(), 0u);
  EXPECT_EQ(server->engine()->Stats().used_blocks, 0);

  // Raw metadata: not a number, zero, and an unknown session.
  auto stub = v1::KvStep::NewStub(grpc::CreateChannel(
      server->address(), grpc::InsecureChannelCredentials()));
  for (const char* value : {"abc", "0", "-5", "12345678901234567890123"}) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("kvstep-session-id", value);
    v1::ReleaseBatchesResponse resp;
    grpc::Status st = stub->ReleaseBatches(&ctx, {}, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << value;
    EXPECT_THAT(st.error_message(), HasSubstr("kvstep-session-id"));
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("kvstep-session-id", "777");
    v1::ReleaseBatchesResponse resp;
    EXPECT_EQ(stub->ReleaseBatches(&ctx, {}, &resp).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {
    // GetServerInfo ignores the session: it is the restart probe.
    grpc::ClientContext ctx;
    ctx.AddMetadata("kvstep-session-id", "777");
    v1::GetServerInfoResponse resp;
    EXPECT_TRUE(stub->GetServerInfo(&ctx, {}, &resp).ok());
  }
  v1::OpenSessionRequest bad;
  bad.set_ttl_ms(10);
  grpc::ClientContext ctx2;
  v1::OpenSessionResponse open;
  EXPECT_EQ(stub->OpenSession(&ctx2, bad, &open).error_code(),
            grpc::StatusCode::OUT_OF_RANGE);
}

// ---- exactly-once AdvanceStep on the wire
// --------------------------------------

TEST(ExactlyOnceService, ARetriedStepGetsTheSameBytes) {
  auto server = StartOrDie(SmallServer("127.0.0.1:0"));
  ASSERT_NE(server, nullptr);
  auto client = Client::Connect(server->address());
  std::vector<std::pair<uint64_t, int64_t>> seqs = {{1, 64}, {2, 64}};
  ASSERT_TRUE(client->AllocateBlocks(seqs).ok());
  v1::CreateBatchRequest cb;
  for (uint64_t id : {1, 2}) {
    v1::BatchRow* row = cb.add_rows();
    row->set_seq_id(id);
    row->add_token_ids(9);
  }
  absl::StatusOr<v1::CreateBatchResponse> batch = client->CreateBatch(cb);
  ASSERT_TRUE(batch.ok());
  v1::AdvanceStepRequest req;
  req.set_batch_id(batch->batch_id());
  *req.mutable_sampled_token_ids() = MakeIndexTensor({11, 12}, {2, 1});
  req.set_return_tensors(true);
  req.set_flashinfer(true);
  req.set_step(1);
  absl::StatusOr<v1::AdvanceStepResponse> first = client->AdvanceStep(req);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<v1::AdvanceStepResponse> retry = client->AdvanceStep(req);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(first->SerializeAsString(), retry->SerializeAsString());
  req.set_step(3);
  absl::StatusOr<v1::AdvanceStepResponse> skipped = client->AdvanceStep(req);
  EXPECT_EQ(skipped.status().code(), absl::StatusCode::kFailedPrecondition);
  req.set_step(2);
  absl::StatusOr<v1::AdvanceStepResponse> second = client->AdvanceStep(req);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->step(), 2);
  absl::StatusOr<std::vector<int64_t>> pos =
      IndexTensorValues(second->tensors().input_positions());
  ASSERT_TRUE(pos.ok());
  EXPECT_EQ(*pos, (std::vector<int64_t>{2, 2}));
}

// ---- Prometheus
// ----------------------------------------------------------------

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: localhost\r\n\r\n");
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return "";
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
  close(fd);
  return out;
}

TEST(Metrics, ExportsPoolGaugesAndPerRpcCountsAndLatencies) {
  ServerOptions o = SmallServer("127.0.0.1:0");
  o.metrics_listen = "127.0.0.1:0";
  auto server = StartOrDie(o);
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->metrics_port(), 0);
  auto client = Client::Connect(server->address());
  std::vector<std::pair<uint64_t, int64_t>> seqs = {{1, 16 * 64}};
  ASSERT_TRUE(client->AllocateBlocks(seqs).ok());  // 64 of 256 blocks
  EXPECT_EQ(client->GetBatch(42).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(client->OpenSession().ok());

  const std::string text = HttpGet(server->metrics_port(), "/metrics");
  ASSERT_THAT(text, HasSubstr("200 OK"));
  EXPECT_THAT(text, HasSubstr("\nvllm:kv_cache_usage_perc 0.25\n"));
  EXPECT_THAT(text, HasSubstr("\nkvstep_kv_cache_usage_perc 0.25\n"));
  EXPECT_THAT(text, HasSubstr("kvstep_blocks{state=\"used\"} 64\n"));
  EXPECT_THAT(text, HasSubstr("kvstep_blocks{state=\"free\"} 192\n"));
  EXPECT_THAT(text, HasSubstr("\nkvstep_sequences 1\n"));
  EXPECT_THAT(text, HasSubstr("\nkvstep_sessions 1\n"));
  EXPECT_THAT(text, HasSubstr("\nkvstep_attention_pin_waits_total 0\n"));
  EXPECT_THAT(text, HasSubstr("kvstep_rpc_requests_total{code=\"OK\",rpc="
                              "\"AllocateBlocks\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("kvstep_rpc_requests_total{code=\"NOT_FOUND\","
                              "rpc=\"GetBatch\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("kvstep_rpc_latency_seconds_count{rpc="
                              "\"AllocateBlocks\"} 1\n"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvstep_info{instance_id=\"",
                                           server->engine()->instance_id(),
                                           "\",version=\"")));

  ServerOptions clash = SmallServer("127.0.0.1:0");
  clash.metrics_listen = absl::StrCat("127.0.0.1:", server->metrics_port());
  EXPECT_EQ(Server::Start(clash).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvstep
