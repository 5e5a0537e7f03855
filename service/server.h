// Server: a running kvstep gRPC server (the KvStep service, the standard
// grpc.health.v1 service and server reflection) around one Engine.
//
// Start() allocates the pool, binds and starts serving; health is SERVING as
// soon as Start() returns. Shutdown() turns health to NOT_SERVING, lets
// in-flight calls finish until the deadline, then stops. Thread-safe.
#ifndef KVSTEP_SERVICE_SERVER_H_
#define KVSTEP_SERVICE_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine.h"
#include "service/kvstep_service.h"

namespace kvstep {

struct ServerOptions {
  // "host:port" (port 0 picks a free one) or "unix:PATH".
  std::string listen = "127.0.0.1:50151";
  EngineOptions engine;
  int64_t max_message_bytes = int64_t{64} << 20;
};

class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Start(
      const ServerOptions& options);
  ~Server();

  // The address clients dial: for "host:0" the port actually bound.
  const std::string& address() const { return address_; }
  Engine* engine() const { return engine_.get(); }

  void Shutdown(absl::Duration grace = absl::Seconds(5));
  void Wait();

 private:
  Server() = default;

  std::string address_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<KvStepService> service_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace kvstep

#endif  // KVSTEP_SERVICE_SERVER_H_
