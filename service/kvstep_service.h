// KvStepService: the kvstep.v1.KvStep gRPC service. Thin by design: each
// method decodes its request (validating every wire field), calls the Engine
// and encodes the result; all logic and all state live in core/Engine.
// Thread-safe (the Engine is).
#ifndef KVSTEP_SERVICE_KVSTEP_SERVICE_H_
#define KVSTEP_SERVICE_KVSTEP_SERVICE_H_

#include <atomic>
#include <cstdint>

#include "core/engine.h"
#include "kvstep/v1/kvstep.grpc.pb.h"

namespace kvstep {

class KvStepService final : public v1::KvStep::Service {
 public:
  // `engine` must outlive the service.
  KvStepService(Engine* engine, int64_t max_message_bytes)
      : engine_(engine), max_message_bytes_(max_message_bytes) {}

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

  // Ends event streams (they would otherwise hold shutdown up until its
  // deadline).
  void BeginShutdown() { shutting_down_ = true; }

 private:
  grpc::Status AdvanceExplicit(const v1::AdvanceStepRequest& req,
                               v1::AdvanceStepResponse* resp);
  grpc::Status Swap(const v1::SwapRequest& req, bool out,
                    v1::SwapResponse* resp);

  Engine* const engine_;
  const int64_t max_message_bytes_;
  std::atomic<bool> shutting_down_{false};
};

}  // namespace kvstep

#endif  // KVSTEP_SERVICE_KVSTEP_SERVICE_H_
