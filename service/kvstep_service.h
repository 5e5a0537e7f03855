// KvStepService: the kvstep.v1.KvStep gRPC service. Thin by design: each
// method decodes its request (validating every wire field), calls the Engine
// and encodes the result; all logic and all state live in core/Engine.
// Every KvStep call first passes Admit(): the bearer token when one is
// configured, and the session metadata (see the proto's conventions); every
// call's code and latency go to the Metrics when there are some.
// Thread-safe (the Engine is).
#ifndef KVSTEP_SERVICE_KVSTEP_SERVICE_H_
#define KVSTEP_SERVICE_KVSTEP_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/engine.h"
#include "kvstep/v1/kvstep.grpc.pb.h"
#include "service/metrics.h"
#include "service/rpc.h"
#include "service/shared_memory.h"

namespace kvstep {

// The metadata key of the session id (decimal).
inline constexpr char kSessionMetadataKey[] = "kvstep-session-id";
// Trailing metadata of every KvStep reply, errors included: the server's
// instance id, so that a client notices a restart from any reply.
inline constexpr char kInstanceMetadataKey[] = "kvstep-instance-id";

struct ServiceOptions {
  int64_t max_message_bytes = int64_t{64} << 20;
  // Non-empty: every KvStep call must carry `authorization: Bearer <token>`.
  std::string auth_token;
  Metrics* metrics = nullptr;  // optional; must outlive the service
  SharedMemoryLimits shared_memory;
};

class KvStepService final : public v1::KvStep::Service {
 public:
  // `engine` must outlive the service.
  KvStepService(Engine* engine, ServiceOptions options)
      : engine_(engine),
        options_(std::move(options)),
        shared_memory_(options_.shared_memory) {}

  grpc::Status GetServerInfo(grpc::ServerContext* ctx,
                             const v1::GetServerInfoRequest* req,
                             v1::GetServerInfoResponse* resp) override;
  grpc::Status AllocateBlocks(grpc::ServerContext* ctx,
                              const v1::AllocateBlocksRequest* req,
                              v1::AllocateBlocksResponse* resp) override;
  grpc::Status FreeSequences(grpc::ServerContext* ctx,
                             const v1::FreeSequencesRequest* req,
                             v1::FreeSequencesResponse* resp) override;
  grpc::Status CreateBatch(grpc::ServerContext* ctx,
                           const v1::CreateBatchRequest* req,
                           v1::CreateBatchResponse* resp) override;
  grpc::Status GetBatch(grpc::ServerContext* ctx,
                        const v1::GetBatchRequest* req,
                        v1::GetBatchResponse* resp) override;
  grpc::Status ReleaseBatches(grpc::ServerContext* ctx,
                              const v1::ReleaseBatchesRequest* req,
                              v1::ReleaseBatchesResponse* resp) override;
  grpc::Status AdvanceStep(grpc::ServerContext* ctx,
                           const v1::AdvanceStepRequest* req,
                           v1::AdvanceStepResponse* resp) override;
  grpc::Status PagedAttention(grpc::ServerContext* ctx,
                              const v1::PagedAttentionRequest* req,
                              v1::PagedAttentionResponse* resp) override;
  grpc::Status ForkSequence(grpc::ServerContext* ctx,
                            const v1::ForkSequenceRequest* req,
                            v1::ForkSequenceResponse* resp) override;
  grpc::Status CanAllocate(grpc::ServerContext* ctx,
                           const v1::AllocateBlocksRequest* req,
                           v1::CanAllocateResponse* resp) override;
  grpc::Status SwapOut(grpc::ServerContext* ctx, const v1::SwapRequest* req,
                       v1::SwapResponse* resp) override;
  grpc::Status SwapIn(grpc::ServerContext* ctx, const v1::SwapRequest* req,
                      v1::SwapResponse* resp) override;
  grpc::Status ResetPrefixCache(grpc::ServerContext* ctx,
                                const v1::ResetPrefixCacheRequest* req,
                                v1::ResetPrefixCacheResponse* resp) override;
  grpc::Status SubscribeKvEvents(
      grpc::ServerContext* ctx, const v1::SubscribeKvEventsRequest* req,
      grpc::ServerWriter<v1::KvEventBatch>* writer) override;
  grpc::Status OpenSession(grpc::ServerContext* ctx,
                           const v1::OpenSessionRequest* req,
                           v1::OpenSessionResponse* resp) override;
  grpc::Status KeepAlive(grpc::ServerContext* ctx,
                         const v1::KeepAliveRequest* req,
                         v1::KeepAliveResponse* resp) override;
  grpc::Status CloseSession(grpc::ServerContext* ctx,
                            const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse* resp) override;
  grpc::Status RegisterSharedMemory(
      grpc::ServerContext* ctx, const v1::RegisterSharedMemoryRequest* req,
      v1::RegisterSharedMemoryResponse* resp) override;
  grpc::Status UnregisterSharedMemory(
      grpc::ServerContext* ctx, const v1::UnregisterSharedMemoryRequest* req,
      v1::UnregisterSharedMemoryResponse* resp) override;

  // What a session held outside the engine (its shared-memory regions)
  // goes with it: CloseSession calls this, and the server's reaper for
  // lapsed sessions.
  void SessionEnded(SessionId id) { shared_memory_.EndSession(id); }
  const SharedMemoryRegistry& shared_memory() const { return shared_memory_; }

  // Ends event streams (they would otherwise hold shutdown up until its
  // deadline).
  void BeginShutdown() { shutting_down_ = true; }

 private:
  // Authenticates the call and reads (and renews) its session.
  // GetServerInfo ignores the session: it is how a client probes a server
  // that may have restarted (and forgotten the session).
  grpc::Status Admit(Rpc rpc, const grpc::ServerContext& ctx,
                     Caller* caller) const;
  // Admits the call, runs `body(caller)`, and records the outcome.
  template <typename Body>
  grpc::Status Run(Rpc rpc, grpc::ServerContext* ctx, Body&& body);

  // A call's use of shared memory: the region (kept mapped until the call
  // returns) and the bytes [begin, end) of it that `field` names.
  struct ShmUse {
    std::shared_ptr<const SharedMemoryRegion> region;
    int64_t begin = 0, end = 0;
    std::string field;
  };
  // Where `ref` puts num_bytes for the caller, its use added to `held`:
  // NOT_FOUND, PERMISSION_DENIED or OUT_OF_RANGE naming `field`.
  absl::StatusOr<char*> SharedMemoryPlace(const v1::SharedMemoryRef& ref,
                                          int64_t num_bytes,
                                          absl::string_view field,
                                          const Caller& caller,
                                          std::vector<ShmUse>* held) const;
  // A request tensor whose bytes are in shared memory (proto.shm): a view
  // of them where aligned, else a copy.
  absl::StatusOr<Tensor> TensorFromSharedMemory(
      const v1::Tensor& proto, absl::string_view field, const Caller& caller,
      std::vector<ShmUse>* held) const;
  grpc::Status AdvanceExplicit(const v1::AdvanceStepRequest& req,
                               v1::AdvanceStepResponse* resp);
  grpc::Status Swap(const v1::SwapRequest& req, bool out, const Caller& caller,
                    v1::SwapResponse* resp);

  Engine* const engine_;
  const ServiceOptions options_;
  SharedMemoryRegistry shared_memory_;
  std::atomic<bool> shutting_down_{false};
};

}  // namespace kvstep

#endif  // KVSTEP_SERVICE_KVSTEP_SERVICE_H_
