// Whole processes: several stress_client processes against one server, one
// of them killed mid-run (every block must come back), and a kvstep-server
// process killed and restarted (the client must notice the new instance).
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/server.h"

extern char** environ;

namespace kvstep {
namespace {

using ::testing::HasSubstr;

pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args)
    argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc =
      posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  EXPECT_EQ(rc, 0) << "cannot start " << args[0];
  return rc == 0 ? pid : -1;
}

// The exit code, or 128 + the signal that ended it.
int WaitFor(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Kills and reaps the children a failed assertion leaves running.
class Children {
 public:
  Children() = default;
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;
  ~Children() {
    for (pid_t pid : pids_) {
      if (kill(pid, SIGKILL) == 0) waitpid(pid, nullptr, 0);
    }
  }
  pid_t Add(pid_t pid) {
    if (pid > 0) pids_.push_back(pid);
    return pid;
  }
  // The child was reaped: not ours to kill any more.
  void Reaped(pid_t pid) {
    pids_.erase(std::remove(pids_.begin(), pids_.end(), pid), pids_.end());
  }

 private:
  std::vector<pid_t> pids_;
};

template <typename Pred>
bool WaitUntil(Pred pred, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!pred()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

std::string SocketPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "kvstep-", name, "-", getpid(),
                      ".sock");
}

TEST(Stress, ManyClientsOneKilledMidRunEveryBlockComesBack) {
  ServerOptions o;
  o.listen = absl::StrCat("unix:", SocketPath("stress"));
  o.engine.cache.num_blocks = 400;
  o.engine.cache.block_size = 16;
  o.engine.cache.num_layers = 1;
  o.engine.cache.num_kv_heads = 1;
  o.engine.cache.head_size = 16;
  o.engine.cache.dtype = DType::kFloat16;
  o.session_reap_interval = absl::Milliseconds(25);
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  Engine* engine = (*server)->engine();

  // The victim runs until killed, with a short TTL so the test is quick.
  // It starts first and is killed while the others run.
  Children children;
  const pid_t victim =
      children.Add(Spawn({KVSTEP_STRESS_CLIENT, "--target=" + o.listen,
                          "--seed=99", "--iterations=0", "--ttl_ms=300"}));
  ASSERT_TRUE(WaitUntil(
      [&] {
        const EngineInfo info = engine->Info();
        return info.num_sessions == 1 && info.stats.used_blocks > 0;
      },
      absl::Seconds(30)));
  constexpr int kClients = 5;
  std::vector<pid_t> survivors;
  for (int i = 0; i < kClients; ++i) {
    survivors.push_back(
        children.Add(Spawn({KVSTEP_STRESS_CLIENT, "--target=" + o.listen,
                            absl::StrCat("--seed=", i + 1), "--iterations=1000",
                            "--ttl_ms=2000"})));
  }
  ASSERT_TRUE(WaitUntil([&] { return engine->Info().num_sessions >= 3; },
                        absl::Seconds(30)));
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  EXPECT_EQ(WaitFor(victim), 128 + SIGKILL);
  children.Reaped(victim);
  for (pid_t pid : survivors) {
    EXPECT_EQ(WaitFor(pid), 0) << "client " << pid;
    children.Reaped(pid);
  }

  // The survivors closed their sessions; the victim's lapses and is reaped.
  ASSERT_TRUE(WaitUntil([&] { return engine->Info().num_sessions == 0; },
                        absl::Seconds(10)));
  const EngineInfo info = engine->Info();
  EXPECT_EQ(info.sessions_expired, 1);
  EXPECT_EQ(info.num_sequences, 0);
  EXPECT_EQ(info.num_batches, 0);
  EXPECT_EQ(info.stats.used_blocks, 0);
  EXPECT_EQ(info.free_blocks, o.engine.cache.num_blocks);
  EXPECT_TRUE(engine->CheckInvariants().ok()) << engine->CheckInvariants();
  (*server)->Shutdown(absl::Seconds(1));
}

TEST(Restart, ClientNoticesAKilledAndRestartedServer) {
  const std::string target = absl::StrCat("unix:", SocketPath("restart"));
  const std::vector<std::string> cmd = {
      KVSTEP_SERVER,        "--listen=" + target, "--num_blocks=64",
      "--num_layers=1",     "--num_kv_heads=1",   "--head_size=16",
      "--block_order=runs", "--log_level=warning"};
  Children children;
  pid_t server = children.Add(Spawn(cmd));
  ClientOptions co;
  co.timeout = absl::Seconds(2);
  auto client = Client::Connect(target, co);
  ASSERT_TRUE(client->WaitForReady(absl::Seconds(20)).ok());
  absl::StatusOr<v1::GetServerInfoResponse> first = client->GetServerInfo();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->block_order(), "runs");
  ASSERT_TRUE(client->OpenSession().ok());
  std::vector<std::pair<uint64_t, int64_t>> seqs = {{1, 40}};
  ASSERT_TRUE(client->AllocateBlocks(seqs).ok());
  EXPECT_FALSE(client->server_restarted());

  ASSERT_EQ(kill(server, SIGKILL), 0);
  EXPECT_EQ(WaitFor(server), 128 + SIGKILL);
  children.Reaped(server);
  server = children.Add(Spawn(cmd));  // removes the dead one's socket file
  // The scheduler's next call: the old session died with the old server,
  // and the refusal itself tells the client that the server restarted.
  absl::StatusOr<v1::AllocateBlocksResponse> stale;
  ASSERT_TRUE(WaitUntil(
      [&] {
        stale = client->AllocateBlocks(seqs);
        return stale.status().code() != absl::StatusCode::kUnavailable;
      },
      absl::Seconds(30)))
      << stale.status();
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(stale.status().message(), HasSubstr("open a new session"));
  EXPECT_TRUE(client->server_restarted());
  absl::StatusOr<v1::GetServerInfoResponse> second = client->GetServerInfo();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(second->server_instance_id(), first->server_instance_id());
  EXPECT_EQ(client->instance_id(), second->server_instance_id());
  EXPECT_EQ(second->num_sequences(), 0);

  // SIGTERM: a clean stop, exit code 0.
  ASSERT_EQ(kill(server, SIGTERM), 0);
  EXPECT_EQ(WaitFor(server), 0);
  children.Reaped(server);
}

}  // namespace
}  // namespace kvstep
