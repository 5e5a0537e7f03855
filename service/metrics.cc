#include "service/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvstep {
namespace {

const char* CodeName(grpc::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  const int c = static_cast<int>(code);
  return c >= 0 && c < 17 ? kNames[c] : "UNKNOWN";
}

prometheus::MetricFamily Family(std::string name, std::string help,
                                prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

void Add(prometheus::MetricFamily* f, double value,
         std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (f->type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f->metric.push_back(std::move(m));
}

// The pool's gauges, read from the Engine when Prometheus scrapes, so they
// are never stale and cost nothing between scrapes.
class EngineCollector : public prometheus::Collectable {
 public:
  explicit EngineCollector(const Engine* engine) : engine_(engine) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    const EngineInfo info = engine_->Info();
    const BlockStats& st = info.stats;
    std::vector<prometheus::MetricFamily> out;
    auto gauge = [&out](const char* name, const char* help, double v) {
      out.push_back(Family(name, help, MetricType::Gauge));
      Add(&out.back(), v);
    };
    auto counter = [&out](const char* name, const char* help, double v) {
      out.push_back(Family(name, help, MetricType::Counter));
      Add(&out.back(), v);
    };
    gauge("vllm:kv_cache_usage_perc",
          "KV-cache usage (used blocks / all blocks), vLLM's name: 1 = 100%",
          st.usage);
    gauge("kvstep_kv_cache_usage_perc",
          "KV-cache usage (used blocks / all blocks): 1 = 100%", st.usage);
    out.push_back(
        Family("kvstep_blocks", "Device blocks by state", MetricType::Gauge));
    Add(&out.back(), static_cast<double>(st.num_blocks), {{"state", "total"}});
    Add(&out.back(), static_cast<double>(st.free_blocks), {{"state", "free"}});
    Add(&out.back(), static_cast<double>(st.used_blocks), {{"state", "used"}});
    Add(&out.back(), static_cast<double>(st.cached_blocks),
        {{"state", "cached"}});
    Add(&out.back(), static_cast<double>(st.evictable_blocks),
        {{"state", "evictable"}});
    Add(&out.back(), static_cast<double>(st.available_blocks),
        {{"state", "available"}});
    out.push_back(Family("kvstep_host_blocks", "Host-tier blocks by state",
                         MetricType::Gauge));
    Add(&out.back(), static_cast<double>(st.host_blocks), {{"state", "total"}});
    Add(&out.back(), static_cast<double>(st.host_free_blocks),
        {{"state", "free"}});
    gauge("kvstep_sequences", "Live sequences",
          static_cast<double>(info.num_sequences));
    gauge("kvstep_batches", "Live batches",
          static_cast<double>(info.num_batches));
    gauge("kvstep_sessions", "Open sessions",
          static_cast<double>(info.num_sessions));
    counter("kvstep_sessions_expired_total",
            "Sessions ended because their TTL lapsed",
            static_cast<double>(info.sessions_expired));
    counter("kvstep_attention_pin_waits_total",
            "AllocateBlocks and SwapIn calls that waited for a PagedAttention "
            "call in flight (it read a block freed meanwhile)",
            static_cast<double>(info.pin_waits));
    counter("kvstep_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache",
            static_cast<double>(st.prefix_query_tokens));
    counter("kvstep_prefix_cache_hits_total",
            "Prompt tokens served from the prefix cache",
            static_cast<double>(st.prefix_hit_tokens));
    out.push_back(Family("kvstep_info", "Server version and instance id",
                         MetricType::Gauge));
    Add(&out.back(), 1,
        {{"instance_id", info.instance_id}, {"version", info.version}});
    return out;
  }

 private:
  const Engine* const engine_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Start(
    const std::string& listen, const Engine* engine) {
  std::unique_ptr<Metrics> m(new Metrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  m->requests_ = &prometheus::BuildCounter()
                      .Name("kvstep_rpc_requests_total")
                      .Help("KvStep RPCs handled, by method and status code")
                      .Register(*m->registry_);
  auto& latency = prometheus::BuildHistogram()
                      .Name("kvstep_rpc_latency_seconds")
                      .Help("Time in the KvStep RPC handler, by method")
                      .Register(*m->registry_);
  const prometheus::Histogram::BucketBoundaries buckets = {
      25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
      25e-3, 50e-3, 0.1,    0.25,   0.5,    1,    2.5,    10};
  for (int r = 0; r < kNumRpcs; ++r) {
    m->latency_[r] =
        &latency.Add({{"rpc", RpcName(static_cast<Rpc>(r))}}, buckets);
  }
  m->engine_collector_ = std::make_shared<EngineCollector>(engine);
  // CivetServer (inside Exposer) throws when it cannot bind.
  try {
    m->exposer_ = std::make_unique<prometheus::Exposer>(listen, 1);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", listen, ": ", e.what()));
  }
  m->exposer_->RegisterCollectable(m->registry_);
  m->exposer_->RegisterCollectable(m->engine_collector_);
  const std::vector<int> ports = m->exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", listen));
  }
  m->port_ = ports.front();
  return m;
}

Metrics::~Metrics() = default;

prometheus::Counter* Metrics::CounterFor(Rpc rpc, grpc::StatusCode code) {
  int c = static_cast<int>(code);
  if (c < 0 || c >= kNumCodes) c = static_cast<int>(grpc::StatusCode::UNKNOWN);
  std::atomic<prometheus::Counter*>& slot =
      counters_[static_cast<int>(rpc) * kNumCodes + c];
  prometheus::Counter* counter = slot.load(std::memory_order_acquire);
  if (counter != nullptr) return counter;
  MutexLock lock(&add_mu_);
  counter = slot.load(std::memory_order_acquire);
  if (counter == nullptr) {
    counter =
        &requests_->Add({{"rpc", RpcName(rpc)},
                         {"code", CodeName(static_cast<grpc::StatusCode>(c))}});
    slot.store(counter, std::memory_order_release);
  }
  return counter;
}

void Metrics::RecordRpc(Rpc rpc, grpc::StatusCode code,
                        absl::Duration latency) {
  CounterFor(rpc, code)->Increment();
  latency_[static_cast<int>(rpc)]->Observe(absl::ToDoubleSeconds(latency));
}

}  // namespace kvstep
