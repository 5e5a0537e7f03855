// kvstep::Client: a typed C++ client for the kvstep.v1.KvStep service, for a
// scheduler to link.
//
// One method per RPC; each call gets a deadline (the client's default or the
// one passed) and returns absl::StatusOr with the server's canonical code and
// message. The client remembers the server instance id of the last reply
// (errors included: the server sends it in trailing metadata); a change
// means the server restarted and its sequences, batches and sessions are
// gone.
//
// Sessions: after OpenSession() every call carries the session id, so the
// sequences and batches it creates belong to the session and come back to
// the pool if this process dies (the server frees them after the TTL).
//
// Thread-safe: calls may be made concurrently from many threads.
#ifndef KVSTEP_CLIENT_CLIENT_H_
#define KVSTEP_CLIENT_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/mutex.h"
#include "kvstep/v1/kvstep.grpc.pb.h"

namespace kvstep {

struct ClientOptions {
  // Deadline of each call unless the call passes its own.
  absl::Duration timeout = absl::Seconds(10);
  int max_message_bytes = 64 << 20;
  // Sent as `authorization: Bearer <token>` on every KvStep call.
  std::string auth_token;
  // TLS: set use_tls; the PEM strings are optional (the system roots when
  // root_certs_pem is empty; a client certificate for mutual TLS).
  bool use_tls = false;
  std::string tls_root_certs_pem;
  std::string tls_cert_chain_pem;
  std::string tls_private_key_pem;
  // Overrides the name the server certificate is checked against.
  std::string tls_server_name;
  // Longest wait between reconnection attempts after the server went away
  // (gRPC's default is 2 minutes; a restarted sidecar is back in a second).
  absl::Duration max_reconnect_backoff = absl::Seconds(1);
};

class Client {
 public:
  // Creates a channel to `target` ("host:port" or "unix:PATH"); does not
  // wait for the server (see WaitForReady).
  static std::unique_ptr<Client> Connect(const std::string& target,
                                         const ClientOptions& options = {});
  Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options);

  // Blocks until the channel is connected or `timeout` passes
  // (DEADLINE_EXCEEDED).
  absl::Status WaitForReady(absl::Duration timeout);

  // A zero timeout means options.timeout.
  absl::StatusOr<v1::GetServerInfoResponse> GetServerInfo(
      absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::AllocateBlocksResponse> AllocateBlocks(
      const v1::AllocateBlocksRequest& req,
      absl::Duration timeout = absl::ZeroDuration());
  // Convenience: (seq_id, num_tokens) pairs.
  absl::StatusOr<v1::AllocateBlocksResponse> AllocateBlocks(
      absl::Span<const std::pair<uint64_t, int64_t>> seqs,
      absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::FreeSequencesResponse> FreeSequences(
      absl::Span<const uint64_t> seq_ids,
      absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::CreateBatchResponse> CreateBatch(
      const v1::CreateBatchRequest& req,
      absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::GetBatchResponse> GetBatch(
      uint64_t batch_id, absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::ReleaseBatchesResponse> ReleaseBatches(
      absl::Span<const uint64_t> batch_ids,
      absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::AdvanceStepResponse> AdvanceStep(
      const v1::AdvanceStepRequest& req,
      absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::PagedAttentionResponse> PagedAttention(
      const v1::PagedAttentionRequest& req,
      absl::Duration timeout = absl::ZeroDuration());

  absl::StatusOr<v1::ForkSequenceResponse> ForkSequence(
      uint64_t parent, absl::Span<const uint64_t> children,
      absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::CanAllocateResponse> CanAllocate(
      const v1::AllocateBlocksRequest& req,
      absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::SwapResponse> SwapOut(
      absl::Span<const uint64_t> seq_ids,
      absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::SwapResponse> SwapIn(
      absl::Span<const uint64_t> seq_ids,
      absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::ResetPrefixCacheResponse> ResetPrefixCache(
      absl::Duration timeout = absl::ZeroDuration());
  // Shared memory for PagedAttention's tensors (client/shared_memory.h);
  // over a unix socket only.
  absl::StatusOr<v1::RegisterSharedMemoryResponse> RegisterSharedMemory(
      const std::string& path, int64_t size,
      absl::Duration timeout = absl::ZeroDuration());
  absl::Status UnregisterSharedMemory(
      uint64_t region_id, absl::Duration timeout = absl::ZeroDuration());

  // A KV-event stream; no deadline (it runs until cancelled).
  class EventSubscription {
   public:
    // Blocks for the next batch; false when the stream ended.
    bool Next(v1::KvEventBatch* batch) { return reader_->Read(batch); }
    // Ends the stream from any thread; Next() then returns false.
    void Cancel() { ctx_.TryCancel(); }
    // The stream's final status, after Next() returned false.
    absl::Status Finish();

   private:
    friend class Client;
    grpc::ClientContext ctx_;
    std::unique_ptr<grpc::ClientReader<v1::KvEventBatch>> reader_;
  };
  std::unique_ptr<EventSubscription> SubscribeKvEvents(
      const v1::SubscribeKvEventsRequest& req);

  // Opens a session (ttl 0: the server's default) and makes every later
  // call of this client part of it.
  absl::StatusOr<v1::OpenSessionResponse> OpenSession(
      absl::Duration ttl = absl::ZeroDuration(), const std::string& name = "",
      absl::Duration timeout = absl::ZeroDuration());
  // Renews the session (any call does; this one does nothing else).
  absl::Status KeepAlive(absl::Duration timeout = absl::ZeroDuration());
  // Ends the session (its sequences are freed) and leaves it.
  absl::StatusOr<v1::CloseSessionResponse> CloseSession(
      absl::Duration timeout = absl::ZeroDuration());
  // The session calls run in (0: none); set_session_id joins an existing
  // one, or leaves with 0.
  uint64_t session_id() const { return session_.load(); }
  void set_session_id(uint64_t id) { session_.store(id); }

  // The standard grpc.health.v1 check of the KvStep service: true when
  // SERVING.
  absl::StatusOr<bool> IsServing(absl::Duration timeout = absl::ZeroDuration());

  // server_instance_id of the latest reply that carried one ("" before).
  std::string instance_id() const;
  // True once a reply carried an instance id different from an earlier one.
  bool server_restarted() const;

 private:
  template <typename Resp, typename Call>
  absl::StatusOr<Resp> Invoke(absl::Duration timeout, Call&& call);
  void NoteInstance(const std::string& id);
  // Deadline, token and session metadata of a call.
  void Prepare(grpc::ClientContext* ctx, absl::Duration timeout) const;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvStep::Stub> stub_;
  const ClientOptions options_;
  std::atomic<uint64_t> session_{0};
  mutable Mutex mu_;
  std::string instance_id_ ABSL_GUARDED_BY(mu_);
  bool restarted_ ABSL_GUARDED_BY(mu_) = false;
};

// Tensor helpers for schedulers: int64 values to a wire tensor of `dtype`
// (INT32 or INT64), and any INT32/INT64 wire tensor back to int64 values.
v1::Tensor MakeIndexTensor(absl::Span<const int64_t> values,
                           std::vector<int64_t> shape,
                           v1::DType dtype = v1::DTYPE_INT64);
absl::StatusOr<std::vector<int64_t>> IndexTensorValues(const v1::Tensor& t);

}  // namespace kvstep

#endif  // KVSTEP_CLIENT_CLIENT_H_
