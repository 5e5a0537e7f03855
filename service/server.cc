#include "service/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/log.h"

namespace kvstep {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path,
                                     absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot read '", path, "'"));
  }
  std::ostringstream data;
  data << in.rdbuf();
  return data.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(
    const TlsOptions& tls) {
  if (tls.cert_file.empty() && tls.key_file.empty()) {
    if (!tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "a client CA (mutual TLS) needs a server certificate and key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both a certificate file and a key file");
  }
  absl::StatusOr<std::string> cert = ReadFile(tls.cert_file, "TLS certificate");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFile(tls.key_file, "TLS key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions opts(
      tls.client_ca_file.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca =
        ReadFile(tls.client_ca_file, "TLS client CA");
    if (!ca.ok()) return ca.status();
    opts.pem_root_certs = *ca;
  }
  opts.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(opts);
}

bool IsLoopback(absl::string_view listen) {
  if (absl::StartsWith(listen, "unix:")) return true;
  const size_t colon = listen.rfind(':');
  absl::string_view host = listen.substr(0, colon);
  return host == "localhost" || host == "[::1]" ||
         absl::StartsWith(host, "127.");
}

}  // namespace

bool KeepFreedMemory() {
#if defined(__GLIBC__)
  // mallopt returns 1 on success; the sanitizers' interceptors return 0.
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 &&
         mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(
    const ServerOptions& options) {
  if (options.max_message_bytes <= 0 || options.max_message_bytes > INT_MAX) {
    return absl::InvalidArgumentError("max_message_bytes must be in [1, 2^31)");
  }
  std::unique_ptr<Server> s(new Server());
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(options.engine);
  if (!engine.ok()) return engine.status();
  s->engine_ = *std::move(engine);
  if (options.socket_mode < 0 || options.socket_mode > 0777) {
    return absl::InvalidArgumentError("socket_mode must be in [0, 0777]");
  }
  if (options.session_reap_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("session_reap_interval must be > 0");
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds =
      Credentials(options.tls);
  if (!creds.ok()) return creds.status();
  if (!options.metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<Metrics>> m =
        Metrics::Start(options.metrics_listen, s->engine_.get());
    if (!m.ok()) return m.status();
    s->metrics_ = *std::move(m);
  }
  ServiceOptions service_options;
  service_options.max_message_bytes = options.max_message_bytes;
  service_options.auth_token = options.auth_token;
  service_options.metrics = s->metrics_.get();
  service_options.shared_memory = options.shared_memory;
  s->service_ = std::make_unique<KvStepService>(s->engine_.get(),
                                                std::move(service_options));

  if (absl::StartsWith(options.listen, "unix:")) {
    // A socket file left by a dead server would make bind fail; remove it,
    // but never anything that is not a socket.
    std::string path = options.listen.substr(5);
    if (absl::StartsWith(path, "//")) path = path.substr(2);
    struct stat st;
    if (lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
      unlink(path.c_str());
    }
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, *creds, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(s->service_.get());
  const bool is_unix = absl::StartsWith(options.listen, "unix:");
  // The socket file is created by bind() inside BuildAndStart with mode
  // 0777 & ~umask: narrow the umask for that moment so that the socket is
  // never wider than socket_mode (a chmod afterwards would leave a window).
  // The umask is process-wide; nothing else creates files during start-up.
  const mode_t old_umask =
      is_unix ? umask(static_cast<mode_t>(0777 & ~options.socket_mode)) : 0;
  s->server_ = builder.BuildAndStart();
  if (is_unix) umask(old_umask);
  if (s->server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen));
  }
  if (is_unix) {
    s->address_ = options.listen;
    std::string path = options.listen.substr(5);
    if (absl::StartsWith(path, "//")) path = path.substr(2);
    if (chmod(path.c_str(), static_cast<mode_t>(options.socket_mode)) != 0) {
      return absl::InternalError(
          absl::StrCat("cannot set the mode of socket ", path));
    }
  } else {
    if (port == 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", options.listen));
    }
    // Replace the requested port (maybe 0) by the bound one.
    const size_t colon = options.listen.rfind(':');
    s->address_ = absl::StrCat(options.listen.substr(0, colon), ":", port);
  }
  grpc::HealthCheckServiceInterface* health =
      s->server_->GetHealthCheckService();
  health->SetServingStatus("kvstep.v1.KvStep", true);
  health->SetServingStatus(true);
  if (!IsLoopback(options.listen)) {
    if (options.tls.cert_file.empty()) {
      KVSTEP_LOG(kWarning,
                 "listening on %s without TLS: anyone who can reach the port "
                 "can read and change the KV cache",
                 options.listen);
    }
    if (options.auth_token.empty() && options.tls.client_ca_file.empty()) {
      KVSTEP_LOG(kWarning,
                 "listening on %s without a bearer token or client "
                 "certificates: every client is trusted",
                 options.listen);
    }
  }
  Server* raw = s.get();
  s->reaper_ = std::thread([raw, interval = options.session_reap_interval] {
    raw->ReapLoop(interval);
  });
  return s;
}

void Server::ReapLoop(absl::Duration interval) {
  MutexLock lock(&reap_mu_);
  while (!stop_reaper_) {
    reap_mu_.WaitUntil(reap_cv_, absl::ToChronoTime(absl::Now() + interval));
    if (stop_reaper_) break;
    // Takes the engine lock under reap_mu_; Shutdown only sets a flag under
    // reap_mu_, so the order is fixed and cannot deadlock.
    for (const SessionEnd& end : engine_->ExpireSessions()) {
      service_->SessionEnded(end.id);
      KVSTEP_LOG(kWarning,
                 "session %d ('%s') lapsed: freed %d sequences (%d blocks), "
                 "released %d batches",
                 end.id, absl::CHexEscape(end.name), end.sequences,
                 end.blocks_freed, end.batches);
    }
  }
}

Server::~Server() {
  Shutdown(absl::ZeroDuration());
  if (reaper_.joinable()) reaper_.join();
}

void Server::Shutdown(absl::Duration grace) {
  {
    MutexLock lock(&reap_mu_);
    stop_reaper_ = true;
  }
  reap_cv_.notify_all();
  if (server_ == nullptr) return;
  if (auto* health = server_->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(false);
  }
  service_->BeginShutdown();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
}

void Server::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace kvstep
