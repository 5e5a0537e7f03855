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
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/log.h"
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
ABSL_FLAG(std::string, block_order, "descending",
          "descending (vLLM v0: first tables start at the top id; freed blocks "
          "reused LIFO), ascending (the same from id 0), or runs (each "
          "sequence's blocks kept consecutive where they can be, which the "
          "attention kernel reads faster)");
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
ABSL_FLAG(int64_t, attention_idle_poll_us, -1,
          "how long an attention worker polls for the next PagedAttention "
          "call before it sleeps, in us (-1: the default, 2000; 0: sleep at "
          "once); see docs/operations.md");
ABSL_FLAG(std::string, attention_prefetch, "auto",
          "PagedAttention's K/V prefetch hint: auto (prefetcht0 on AMD and, "
          "for 16-bit caches in the vLLM layout, on Intel model 207; "
          "prefetcht1 elsewhere), nta, t0 or t1; see docs/attention.md");
ABSL_FLAG(double, watermark, 0.01,
          "CanAllocate answers LATER below this fraction of free blocks");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(5),
          "time in-flight calls get to finish on SIGTERM");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mTLS)");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding a bearer token that every KvStep call must send as "
          "'authorization: Bearer <token>' (a file, so that the token is not "
          "in the process list)");
ABSL_FLAG(std::string, socket_mode, "0600",
          "permission bits (octal) of the unix socket file");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port of the Prometheus /metrics endpoint (empty: none)");
ABSL_FLAG(absl::Duration, session_ttl, absl::Seconds(30),
          "TTL of sessions opened without one");
ABSL_FLAG(absl::Duration, max_session_ttl, absl::Hours(24),
          "longest TTL a session may ask for");
ABSL_FLAG(int64_t, max_sessions, 1024, "open sessions");
ABSL_FLAG(int64_t, max_shared_memory_regions, 64,
          "shared-memory regions clients on this host may register at once "
          "(RegisterSharedMemory; 0: none)");
ABSL_FLAG(int64_t, max_shared_memory_mib, 16384,
          "their bytes mapped at once, in MiB");
ABSL_FLAG(bool, keep_freed_memory, true,
          "keep freed heap memory for reuse (glibc malloc: no fresh pages "
          "for each large message's buffers; see KeepFreedMemory)");
ABSL_FLAG(std::string, log_level, "info", "error, warning, info or debug");

namespace {

int Fail(const std::string& msg) {
  KVSTEP_LOG(kError, "kvstep-server: %s", msg);
  return 2;
}

// The token file's content without surrounding whitespace (a trailing
// newline is what editors and `kubectl create secret` leave).
bool ReadToken(const std::string& path, std::string* token) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  char buf[4096];
  const size_t n = std::fread(buf, 1, sizeof(buf), f);
  std::fclose(f);
  *token = std::string(absl::StripAsciiWhitespace(absl::string_view(buf, n)));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves the kvstep.v1.KvStep gRPC API: KV-cache blocks and per-step "
      "batch state for an LLM model server.");
  absl::ParseCommandLine(argc, argv);
  kvstep::LogLevel level;
  if (!kvstep::ParseLogLevel(absl::GetFlag(FLAGS_log_level), &level)) {
    return Fail(absl::StrCat("--log_level: unknown level '",
                             absl::GetFlag(FLAGS_log_level), "'"));
  }
  kvstep::SetLogLevel(level);

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
  } else if (order == "runs") {
    opt.engine.block_order = kvstep::BlockOrder::kRuns;
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
  opt.engine.attention_idle_poll_us =
      absl::GetFlag(FLAGS_attention_idle_poll_us);
  if (!kvstep::ParsePrefetch(absl::GetFlag(FLAGS_attention_prefetch),
                             &opt.engine.attention_prefetch)) {
    return Fail(absl::StrCat("--attention_prefetch: unknown hint '",
                             absl::GetFlag(FLAGS_attention_prefetch),
                             "' (auto, nta, t0 or t1)"));
  }
  opt.engine.default_session_ttl = absl::GetFlag(FLAGS_session_ttl);
  opt.engine.max_session_ttl = absl::GetFlag(FLAGS_max_session_ttl);
  l.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  opt.shared_memory.max_regions =
      absl::GetFlag(FLAGS_max_shared_memory_regions);
  const int64_t shm_mib = absl::GetFlag(FLAGS_max_shared_memory_mib);
  if (opt.shared_memory.max_regions < 0 || shm_mib < 0 ||
      shm_mib > (int64_t{1} << 30)) {
    return Fail(
        "--max_shared_memory_regions must be >= 0 and "
        "--max_shared_memory_mib in [0, 2^30]");
  }
  opt.shared_memory.max_bytes = shm_mib << 20;
  opt.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  opt.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  opt.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  opt.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file);
      !path.empty()) {
    if (!ReadToken(path, &opt.auth_token)) {
      return Fail(absl::StrCat("--auth_token_file: cannot read '", path, "'"));
    }
    if (opt.auth_token.size() < 16) {
      return Fail("--auth_token_file: the token must be at least 16 bytes");
    }
  }
  const std::string mode_text = absl::GetFlag(FLAGS_socket_mode);
  int mode = 0;
  for (char ch : mode_text) {
    if (ch < '0' || ch > '7' || mode > 0777) {
      mode = -1;
      break;
    }
    mode = mode * 8 + (ch - '0');
  }
  if (mode_text.empty() || mode < 0 || mode > 0777) {
    return Fail("--socket_mode must be octal permission bits, e.g. 0660");
  }
  opt.socket_mode = mode;

  if (absl::GetFlag(FLAGS_keep_freed_memory) && !kvstep::KeepFreedMemory()) {
    KVSTEP_LOG(kWarning,
               "--keep_freed_memory: this malloc does not take the setting; "
               "large messages' buffers come back as fresh pages");
  }
  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::unique_ptr<kvstep::Server>> server =
      kvstep::Server::Start(opt);
  if (!server.ok()) return Fail(server.status().ToString());
  KVSTEP_LOG(kInfo, "kvstep-server %s listening on %s (instance %s, %s%s)",
             KVSTEP_VERSION, (*server)->address(),
             (*server)->engine()->instance_id(),
             opt.tls.cert_file.empty()
                 ? "plaintext"
                 : (opt.tls.client_ca_file.empty() ? "TLS" : "mutual TLS"),
             opt.auth_token.empty() ? "" : ", bearer token");
  KVSTEP_LOG(kInfo, "pool: %s, %.1f MiB, ready in %.0f ms", c.DebugString(),
             static_cast<double>(c.total_bytes()) / (1 << 20),
             absl::ToDoubleMilliseconds(absl::Now() - t0));
  if ((*server)->metrics_port() != 0) {
    KVSTEP_LOG(kInfo, "metrics on %s (port %d)", opt.metrics_listen,
               (*server)->metrics_port());
  }

  int sig = 0;
  sigwait(&signals, &sig);
  KVSTEP_LOG(kInfo, "%s received: NOT_SERVING, draining for up to %s",
             sig == SIGTERM ? "SIGTERM" : "SIGINT",
             absl::FormatDuration(absl::GetFlag(FLAGS_shutdown_grace)));
  (*server)->Shutdown(absl::GetFlag(FLAGS_shutdown_grace));
  (*server)->Wait();
  KVSTEP_LOG(kInfo, "stopped");
  return 0;
}
