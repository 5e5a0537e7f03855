// Server: a running kvstep gRPC server (the KvStep service, the standard
// grpc.health.v1 service and server reflection) around one Engine, with an
// optional Prometheus endpoint and a session reaper.
//
// Start() allocates the pool, binds and starts serving; health is SERVING as
// soon as Start() returns. Shutdown() turns health to NOT_SERVING, lets
// in-flight calls finish until the deadline, then stops. Thread-safe.
#ifndef KVSTEP_SERVICE_SERVER_H_
#define KVSTEP_SERVICE_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine.h"
#include "core/mutex.h"
#include "service/kvstep_service.h"
#include "service/metrics.h"

namespace kvstep {

// TLS from PEM files. With a client CA the server requires and verifies a
// client certificate signed by it (mutual TLS).
struct TlsOptions {
  std::string cert_file;       // server certificate chain (PEM)
  std::string key_file;        // its private key (PEM)
  std::string client_ca_file;  // optional: CA bundle for client certificates
};

struct ServerOptions {
  // "host:port" (port 0 picks a free one) or "unix:PATH".
  std::string listen = "127.0.0.1:50151";
  EngineOptions engine;
  int64_t max_message_bytes = int64_t{64} << 20;
  // Set cert_file and key_file to serve TLS instead of plaintext.
  TlsOptions tls;
  // Non-empty: KvStep calls need `authorization: Bearer <token>`.
  std::string auth_token;
  // Permission bits of the unix socket file; the socket is created with
  // them (never wider, even for an instant).
  int socket_mode = 0600;
  // "host:port" of the Prometheus endpoint; empty: none.
  std::string metrics_listen;
  // How often lapsed sessions are looked for (their blocks come back at most
  // this long after the TTL).
  absl::Duration session_reap_interval = absl::Milliseconds(250);
  // Regions clients may register (RegisterSharedMemory), and their bytes.
  SharedMemoryLimits shared_memory;
};

class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Start(
      const ServerOptions& options);
  ~Server();

  // The address clients dial: for "host:0" the port actually bound.
  const std::string& address() const { return address_; }
  Engine* engine() const { return engine_.get(); }
  // The Prometheus endpoint's port (0: none).
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }

  void Shutdown(absl::Duration grace = absl::Seconds(5));
  void Wait();

 private:
  Server() = default;
  void ReapLoop(absl::Duration interval);

  std::string address_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<KvStepService> service_;
  std::unique_ptr<grpc::Server> server_;

  Mutex reap_mu_;
  std::condition_variable reap_cv_;
  bool stop_reaper_ ABSL_GUARDED_BY(reap_mu_) = false;
  std::thread reaper_;
};

// Has glibc's malloc keep freed memory for reuse instead of handing it back
// to the kernel: blocks of up to 32 MiB (M_MMAP_THRESHOLD's largest) come
// from the heap rather than fresh mmaps, and the heap is not trimmed below
// 1 GiB of free space (M_TRIM_THRESHOLD). A prefill PagedAttention call
// moves tens of MB of activations, and every buffer gRPC and protobuf
// allocate for them otherwise comes back as fresh pages, which the kernel
// zeroes at a tenth of warm memory's speed. With it and the service's
// views of the request's tensors (TensorViewOfProto), a 975-token prefill
// call took 0.79-0.89x the time, 1800 tokens 0.67-0.77x (rpc_bench
// --prefill_tokens; docs/attention.md, session 62). The cost: the process
// keeps the peak of its transient buffers (a few of the largest messages)
// after they are freed. Process-wide: kvstep-server calls it at start
// unless --keep_freed_memory=false. Returns false where the malloc is not
// glibc's or refuses (sanitizer builds replace it).
bool KeepFreedMemory();

}  // namespace kvstep

#endif  // KVSTEP_SERVICE_SERVER_H_
