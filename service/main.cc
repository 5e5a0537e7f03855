// kvstep-server: serves the KvStep gRPC API on one CPU KV-cache pool.
//
//   kvstep-server --listen=unix:/run/kvstep/kvstep.sock --num_blocks=4096
//
// The defaults start in about a second on a 2-core machine (a 512 MiB pool).
// SIGTERM or SIGINT: health turns NOT_SERVING, in-flight calls get up to
// --shutdown_grace to finish, then the process exits 0.
#include <signal.h>

#include <cstdio>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "service/server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50151",
          "host:port (port 0: any free port) or unix:PATH");
ABSL_FLAG(int64_t, num_blocks, 2048, "KV-cache blocks in the pool");
ABSL_FLAG(int64_t, block_size, 16, "token slots per block");
ABSL_FLAG(int64_t, num_layers, 4, "model layers (one K and one V cache each)");
ABSL_FLAG(int64_t, num_kv_heads, 8, "KV heads");
ABSL_FLAG(int64_t, head_size, 128, "elements per head");
ABSL_FLAG(std::string, cache_dtype, "float16",
          "float32, float16, bfloat16, fp8_e4m3 or fp8_e5m2");
ABSL_FLAG(std::string, cache_layout, "vllm",
          "vllm (key [blocks, heads, head/x, block, x]) or nhd");
ABSL_FLAG(
    std::string, block_order, "descending",
    "descending (vLLM v0: first tables start at the top id) or ascending");
ABSL_FLAG(int64_t, max_seq_len, 32768, "longest sequence in tokens");
ABSL_FLAG(int64_t, max_batch_rows, 1024, "rows per batch, padding included");
ABSL_FLAG(int64_t, max_batch_tokens, 65536, "query tokens per batch");
ABSL_FLAG(int64_t, max_sequences, 65536, "live sequences");
ABSL_FLAG(int64_t, max_batches, 256, "live batches");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{64} << 20, "gRPC message limit");
ABSL_FLAG(int64_t, max_cache_gib, 16, "refuse to start with a larger cache");
ABSL_FLAG(int64_t, num_host_blocks, 0,
          "blocks of the host tier for SwapOut/SwapIn (0: none)");
ABSL_FLAG(int32_t, attention_threads, 0,
          "threads for PagedAttention, this one included (0: one per core)");
ABSL_FLAG(double, watermark, 0.01,
          "CanAllocate answers LATER below this fraction of free blocks");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(5),
          "time in-flight calls get to finish on SIGTERM");

namespace {

int Fail(const std::string& msg) {
  std::fprintf(stderr, "kvstep-server: %s\n", msg.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves the kvstep.v1.KvStep gRPC API: KV-cache blocks and per-step "
      "batch state for an LLM model server.");
  absl::ParseCommandLine(argc, argv);

  // Block the signals in every thread (gRPC's included) and take them in one
  // thread with sigwait, so shutdown runs outside a signal handler.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  kvstep::ServerOptions opt;
  opt.listen = absl::GetFlag(FLAGS_listen);
  opt.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  kvstep::CacheConfig& c = opt.engine.cache;
  c.num_blocks = absl::GetFlag(FLAGS_num_blocks);
  c.block_size = absl::GetFlag(FLAGS_block_size);
  c.num_layers = absl::GetFlag(FLAGS_num_layers);
  c.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  c.head_size = absl::GetFlag(FLAGS_head_size);
  c.dtype = kvstep::ParseDType(absl::GetFlag(FLAGS_cache_dtype));
  if (!kvstep::ParseCacheLayout(absl::GetFlag(FLAGS_cache_layout), &c.layout)) {
    return Fail(absl::StrCat("--cache_layout: unknown layout '",
                             absl::GetFlag(FLAGS_cache_layout), "'"));
  }
  const std::string order = absl::GetFlag(FLAGS_block_order);
  if (order == "descending") {
    opt.engine.block_order = kvstep::BlockOrder::kDescending;
  } else if (order == "ascending") {
    opt.engine.block_order = kvstep::BlockOrder::kAscending;
  } else {
    return Fail(absl::StrCat("--block_order: unknown order '", order, "'"));
  }
  kvstep::EngineLimits& l = opt.engine.limits;
  l.max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
  l.max_batch_rows = absl::GetFlag(FLAGS_max_batch_rows);
  l.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  l.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  l.max_batches = absl::GetFlag(FLAGS_max_batches);
  const int64_t gib = absl::GetFlag(FLAGS_max_cache_gib);
  if (gib <= 0 || gib > (int64_t{1} << 20)) {
    return Fail("--max_cache_gib must be in [1, 2^20]");
  }
  l.max_cache_bytes = gib << 30;
  opt.engine.num_host_blocks = absl::GetFlag(FLAGS_num_host_blocks);
  opt.engine.watermark = absl::GetFlag(FLAGS_watermark);
  opt.engine.attention_threads = absl::GetFlag(FLAGS_attention_threads);

  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::unique_ptr<kvstep::Server>> server =
      kvstep::Server::Start(opt);
  if (!server.ok()) return Fail(server.status().ToString());
  std::fprintf(stderr,
               "kvstep-server %s listening on %s (instance %s)\n"
               "  pool: %s, %.1f MiB, ready in %.0f ms\n",
               KVSTEP_VERSION, (*server)->address().c_str(),
               (*server)->engine()->instance_id().c_str(),
               c.DebugString().c_str(),
               static_cast<double>(c.total_bytes()) / (1 << 20),
               absl::ToDoubleMilliseconds(absl::Now() - t0));

  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "kvstep-server: %s received, shutting down\n",
               sig == SIGTERM ? "SIGTERM" : "SIGINT");
  (*server)->Shutdown(absl::GetFlag(FLAGS_shutdown_grace));
  (*server)->Wait();
  std::fprintf(stderr, "kvstep-server: stopped\n");
  return 0;
}
