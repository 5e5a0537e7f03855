// kvstep-cli: talks to a kvstep server.
//
//   kvstep-cli [--target=ADDR] info | stats | health | events
//   kvstep-cli [--target=ADDR] allocate SEQ_ID NUM_TOKENS [SEQ_ID NUM_TOKENS]
//   kvstep-cli [--target=ADDR] free SEQ_ID [SEQ_ID ...]
//   kvstep-cli [--target=ADDR] demo [--steps=N --num_seqs=N --prompt_len=N]
//
// `health` exits 0 when the server is SERVING (a container health check).
// TLS and the bearer token: --tls --tls_ca=... --auth_token_file=...
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/demo.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50151",
          "server address: host:port or unix:PATH");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "deadline of each call");
ABSL_FLAG(absl::Duration, wait, absl::Seconds(10),
          "how long to wait for the server to be reachable");
ABSL_FLAG(int64_t, num_seqs, 5, "demo: sequences");
ABSL_FLAG(int64_t, prompt_len, 195, "demo: prompt tokens per sequence");
ABSL_FLAG(int64_t, steps, 8, "demo: decode steps");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding the server's bearer token");
ABSL_FLAG(bool, tls, false, "connect with TLS");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM roots to verify the server with (default: the system's)");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mutual TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to check the server certificate against");

namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvstep-cli: %s\n", s.ToString().c_str());
  return 1;
}

// The file's content; trailing whitespace dropped for token files.
bool ReadFile(const std::string& path, std::string* out, bool strip) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream data;
  data << in.rdbuf();
  *out =
      strip ? std::string(absl::StripAsciiWhitespace(data.str())) : data.str();
  return true;
}

int Usage() {
  std::fprintf(stderr,
               "usage: kvstep-cli [flags] info | health | stats | events | "
               "allocate SEQ TOKENS "
               "[SEQ TOKENS ...] | free SEQ [SEQ ...] | demo\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kvstep-cli info|health|stats|events|allocate|free|demo: talks to a "
      "kvstep server");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) return Usage();
  const std::string cmd = args[1];
  std::vector<int64_t> nums;
  for (size_t i = 2; i < args.size(); ++i) {
    int64_t v;
    if (!absl::SimpleAtoi(args[i], &v)) return Usage();
    nums.push_back(v);
  }

  kvstep::ClientOptions opt;
  opt.timeout = absl::GetFlag(FLAGS_timeout);
  const std::tuple<std::string, std::string*, bool> files[] = {
      {absl::GetFlag(FLAGS_auth_token_file), &opt.auth_token, true},
      {absl::GetFlag(FLAGS_tls_ca), &opt.tls_root_certs_pem, false},
      {absl::GetFlag(FLAGS_tls_cert), &opt.tls_cert_chain_pem, false},
      {absl::GetFlag(FLAGS_tls_key), &opt.tls_private_key_pem, false}};
  for (const auto& [path, out, strip] : files) {
    if (!path.empty() && !ReadFile(path, out, strip)) {
      return Fail(
          absl::InvalidArgumentError(absl::StrCat("cannot read '", path, "'")));
    }
  }
  opt.use_tls = absl::GetFlag(FLAGS_tls);
  opt.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  auto client = kvstep::Client::Connect(absl::GetFlag(FLAGS_target), opt);
  if (absl::Status s = client->WaitForReady(absl::GetFlag(FLAGS_wait));
      !s.ok()) {
    return Fail(s);
  }

  if (cmd == "info") {
    auto r = client->GetServerInfo();
    if (!r.ok()) return Fail(r.status());
    std::cout << r->DebugString();
  } else if (cmd == "stats") {
    auto r = client->GetServerInfo();
    if (!r.ok()) return Fail(r.status());
    std::cout << r->stats().DebugString();
  } else if (cmd == "events") {
    kvstep::v1::SubscribeKvEventsRequest req;
    req.set_from_now(true);
    auto sub = client->SubscribeKvEvents(req);
    kvstep::v1::KvEventBatch batch;
    while (sub->Next(&batch)) std::cout << batch.DebugString() << std::flush;
    return Fail(sub->Finish());
  } else if (cmd == "health") {
    auto r = client->IsServing();
    if (!r.ok()) return Fail(r.status());
    std::cout << (*r ? "SERVING" : "NOT_SERVING") << "\n";
    return *r ? 0 : 1;
  } else if (cmd == "allocate") {
    if (nums.empty() || nums.size() % 2 != 0) return Usage();
    std::vector<std::pair<uint64_t, int64_t>> seqs;
    for (size_t i = 0; i < nums.size(); i += 2) {
      seqs.emplace_back(static_cast<uint64_t>(nums[i]), nums[i + 1]);
    }
    auto r = client->AllocateBlocks(seqs);
    if (!r.ok()) return Fail(r.status());
    std::cout << r->DebugString();
  } else if (cmd == "free") {
    if (nums.empty()) return Usage();
    std::vector<uint64_t> ids(nums.begin(), nums.end());
    auto r = client->FreeSequences(ids);
    if (!r.ok()) return Fail(r.status());
    std::cout << r->DebugString();
  } else if (cmd == "demo") {
    kvstep::DemoOptions d;
    d.num_seqs = absl::GetFlag(FLAGS_num_seqs);
    d.prompt_len = absl::GetFlag(FLAGS_prompt_len);
    d.steps = absl::GetFlag(FLAGS_steps);
    if (absl::Status s = kvstep::RunDemo(*client, d, std::cout); !s.ok()) {
      return Fail(s);
    }
  } else {
    return Usage();
  }
  return 0;
}
