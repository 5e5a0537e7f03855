// Control-RPC latency against a bare gRPC ping, measured in the same run.
//
// The ping is grpc.health.v1 Check: gRPC's own smallest unary call on the
// same channel. Calls are interleaved (ping, then each kvstep RPC, round
// after round) so that the machine's noise hits every kind alike, and each
// kind's median is reported as a ratio to the ping's median. The bar: kvstep
// control RPCs within 10% of the ping.
//
//   build/bench/rpc_bench [--rounds=3000] [--rows=64] [--target=ADDR]
// Without --target, a server is started in this process on a unix socket.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "service/server.h"

ABSL_FLAG(int, rounds, 3000, "calls of each kind");
ABSL_FLAG(int, rows, 64, "decode rows in the batch");
ABSL_FLAG(std::string, target, "", "an external server (default: in-process)");

namespace {

struct Series {
  std::string name;
  std::function<bool()> call;
  std::vector<double> us;
};

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int rows = absl::GetFlag(FLAGS_rows);
  std::string target = absl::GetFlag(FLAGS_target);
  std::unique_ptr<kvstep::Server> server;
  if (target.empty()) {
    kvstep::ServerOptions o;
    o.listen = absl::StrCat("unix:/tmp/kvstep-rpc-bench-", getpid(), ".sock");
    // Enough blocks for every row to advance once per round; a small
    // geometry, since this measures control RPCs, not the pool.
    o.engine.cache.num_blocks = (rows + 1) * ((rounds * 2 + 32) / 16 + 1);
    o.engine.cache.num_layers = 1;
    o.engine.cache.num_kv_heads = 1;
    o.engine.cache.head_size = 8;
    auto s = kvstep::Server::Start(o);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      return 1;
    }
    server = *std::move(s);
    target = server->address();
  }
  auto client = kvstep::Client::Connect(target);
  if (absl::Status s = client->WaitForReady(absl::Seconds(10)); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }

  // One decode batch of `rows` sequences with room for every step.
  const uint64_t base = 1u << 30;
  std::vector<std::pair<uint64_t, int64_t>> seqs;
  kvstep::v1::CreateBatchRequest create;
  for (int i = 0; i < rows; ++i) {
    seqs.emplace_back(base + i, rounds * 2 + 16);
    kvstep::v1::BatchRow* r = create.add_rows();
    r->set_seq_id(base + i);
    r->add_token_ids(1);
  }
  if (auto a = client->AllocateBlocks(seqs); !a.ok()) {
    std::fprintf(stderr, "AllocateBlocks: %s\n", a.status().ToString().c_str());
    return 1;
  }
  auto batch = client->CreateBatch(create);
  if (!batch.ok()) {
    std::fprintf(stderr, "%s\n", batch.status().ToString().c_str());
    return 1;
  }
  kvstep::v1::AdvanceStepRequest step;
  step.set_batch_id(batch->batch_id());
  *step.mutable_sampled_token_ids() =
      kvstep::MakeIndexTensor(std::vector<int64_t>(rows, 7), {rows, 1});
  kvstep::v1::AdvanceStepRequest step_tensors = step;
  step_tensors.set_return_tensors(true);
  const std::vector<std::pair<uint64_t, int64_t>> retry(seqs.begin(),
                                                        seqs.begin() + 1);

  std::vector<Series> series = {
      {"ping (health Check)", [&] { return client->IsServing().ok(); }, {}},
      {"GetServerInfo", [&] { return client->GetServerInfo().ok(); }, {}},
      {"AllocateBlocks (1 seq, no-op retry)",
       [&] { return client->AllocateBlocks(retry).ok(); },
       {}},
      {absl::StrCat("AdvanceStep (", rows, " rows)"),
       [&] { return client->AdvanceStep(step).ok(); },
       {}},
      {absl::StrCat("AdvanceStep (", rows, " rows, return tensors)"),
       [&] { return client->AdvanceStep(step_tensors).ok(); },
       {}},
  };
  for (int warm = 0; warm < 100; ++warm) series[0].call();
  for (int r = 0; r < rounds; ++r) {
    for (Series& s : series) {
      const absl::Time t = absl::Now();
      if (!s.call()) {
        std::fprintf(stderr, "%s failed\n", s.name.c_str());
        return 1;
      }
      s.us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
    }
  }
  const double ping = Quantile(series[0].us, 0.5);
  std::printf("%-44s %9s %9s %9s\n", "call", "p50 us", "p90 us", "p50/ping");
  for (const Series& s : series) {
    std::printf("%-44s %9.1f %9.1f %9.2f\n", s.name.c_str(),
                Quantile(s.us, 0.5), Quantile(s.us, 0.9),
                Quantile(s.us, 0.5) / ping);
  }
  std::printf("(%d interleaved rounds, target %s)\n", rounds, target.c_str());
  return 0;
}
