#include "service/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvstep {

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
  s->service_ = std::make_unique<KvStepService>(s->engine_.get(),
                                                options.max_message_bytes);

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
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(),
                           &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen));
  }
  if (absl::StartsWith(options.listen, "unix:")) {
    s->address_ = options.listen;
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
  return s;
}

Server::~Server() { Shutdown(absl::ZeroDuration()); }

void Server::Shutdown(absl::Duration grace) {
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
