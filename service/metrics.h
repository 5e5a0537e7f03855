// Metrics: a Prometheus endpoint (text format over HTTP, prometheus-cpp)
// exporting
//   * per RPC: kvstep_rpc_requests_total{rpc,code} and the latency histogram
//     kvstep_rpc_latency_seconds{rpc} (time in the handler, the server's
//     share of a call);
//   * the pool, read from the Engine at scrape time: vLLM's
//     vllm:kv_cache_usage_perc (so vLLM dashboards work unchanged) and
//     kvstep_kv_cache_usage_perc, kvstep_blocks{state}, kvstep_host_blocks,
//     kvstep_sequences, kvstep_batches, kvstep_sessions,
//     kvstep_sessions_expired_total, kvstep_prefix_cache_{queries,hits}_total
//     (tokens) and kvstep_info{version,instance_id}.
// Thread-safe. RecordRpc costs two atomic adds after the first call of each
// (rpc, code) pair.
#ifndef KVSTEP_SERVICE_METRICS_H_
#define KVSTEP_SERVICE_METRICS_H_

#include <grpcpp/grpcpp.h>

#include <array>
#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine.h"
#include "core/mutex.h"
#include "service/rpc.h"

namespace prometheus {
class Collectable;
class Counter;
class Exposer;
template <typename T>
class Family;
class Histogram;
class Registry;
}  // namespace prometheus

namespace kvstep {

class Metrics {
 public:
  // Serves /metrics on `listen` ("host:port"; port 0 picks a free one).
  // `engine` must outlive the Metrics.
  static absl::StatusOr<std::unique_ptr<Metrics>> Start(
      const std::string& listen, const Engine* engine);
  ~Metrics();

  // The bound port.
  int port() const { return port_; }
  void RecordRpc(Rpc rpc, grpc::StatusCode code, absl::Duration latency);

 private:
  Metrics() = default;
  prometheus::Counter* CounterFor(Rpc rpc, grpc::StatusCode code);

  static constexpr int kNumCodes = 17;  // grpc::StatusCode 0..16
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> engine_collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  std::array<prometheus::Histogram*, kNumRpcs> latency_{};
  // Created on first use (Family::Add takes a lock and hashes the labels).
  std::array<std::atomic<prometheus::Counter*>,
             static_cast<size_t>(kNumRpcs) * kNumCodes>
      counters_{};
  Mutex add_mu_;  // serializes the first creation of a counter
  int port_ = 0;
};

}  // namespace kvstep

#endif  // KVSTEP_SERVICE_METRICS_H_
