#include "client/client.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvstep {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      s.error_message());
}

template <typename Resp>
const std::string* InstanceOf(const Resp& r) {
  return &r.server_instance_id();
}

}  // namespace

std::unique_ptr<Client> Client::Connect(const std::string& target,
                                        const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  const int backoff_ms = static_cast<int>(std::clamp<int64_t>(
      absl::ToInt64Milliseconds(options.max_reconnect_backoff), 100, 120000));
  // First retry after 100 ms, growing 1.6x up to the maximum; each attempt
  // may take a second to connect (a local sidecar answers in microseconds).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, backoff_ms);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
  std::shared_ptr<grpc::ChannelCredentials> creds =
      grpc::InsecureChannelCredentials();
  if (options.use_tls) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = options.tls_root_certs_pem;
    tls.pem_cert_chain = options.tls_cert_chain_pem;
    tls.pem_private_key = options.tls_private_key_pem;
    creds = grpc::SslCredentials(tls);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  }
  return std::make_unique<Client>(
      grpc::CreateCustomChannel(target, creds, args), options);
}

Client::Client(std::shared_ptr<grpc::Channel> channel,
               const ClientOptions& options)
    : channel_(std::move(channel)),
      stub_(v1::KvStep::NewStub(channel_)),
      options_(options) {}

absl::Status Client::WaitForReady(absl::Duration timeout) {
  if (channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::OkStatus();
  }
  return absl::DeadlineExceededError("kvstep server not reachable in time");
}

void Client::NoteInstance(const std::string& id) {
  if (id.empty()) return;
  MutexLock lock(&mu_);
  if (!instance_id_.empty() && instance_id_ != id) restarted_ = true;
  instance_id_ = id;
}

std::string Client::instance_id() const {
  MutexLock lock(&mu_);
  return instance_id_;
}

bool Client::server_restarted() const {
  MutexLock lock(&mu_);
  return restarted_;
}

void Client::Prepare(grpc::ClientContext* ctx, absl::Duration timeout) const {
  if (timeout != absl::InfiniteDuration()) {
    ctx->set_deadline(absl::ToChronoTime(
        absl::Now() +
        (timeout == absl::ZeroDuration() ? options_.timeout : timeout)));
  }
  if (!options_.auth_token.empty()) {
    ctx->AddMetadata("authorization",
                     absl::StrCat("Bearer ", options_.auth_token));
  }
  if (const uint64_t session = session_.load(); session != 0) {
    ctx->AddMetadata("kvstep-session-id", absl::StrCat(session));
  }
}

template <typename Resp, typename Call>
absl::StatusOr<Resp> Client::Invoke(absl::Duration timeout, Call&& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, timeout);
  Resp resp;
  grpc::Status s = call(&ctx, &resp);
  // Every reply, errors included, names the server instance in its
  // trailing metadata (a session error after a restart says so).
  const auto& trailers = ctx.GetServerTrailingMetadata();
  if (auto it = trailers.find("kvstep-instance-id"); it != trailers.end()) {
    NoteInstance(std::string(it->second.data(), it->second.size()));
  }
  if (!s.ok()) return FromGrpc(s);
  NoteInstance(*InstanceOf(resp));
  return resp;
}

absl::StatusOr<v1::GetServerInfoResponse> Client::GetServerInfo(
    absl::Duration timeout) {
  return Invoke<v1::GetServerInfoResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::GetServerInfoResponse* r) {
        return stub_->GetServerInfo(ctx, v1::GetServerInfoRequest(), r);
      });
}

absl::StatusOr<v1::AllocateBlocksResponse> Client::AllocateBlocks(
    const v1::AllocateBlocksRequest& req, absl::Duration timeout) {
  return Invoke<v1::AllocateBlocksResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::AllocateBlocksResponse* r) {
        return stub_->AllocateBlocks(ctx, req, r);
      });
}

absl::StatusOr<v1::AllocateBlocksResponse> Client::AllocateBlocks(
    absl::Span<const std::pair<uint64_t, int64_t>> seqs,
    absl::Duration timeout) {
  v1::AllocateBlocksRequest req;
  for (const auto& [id, tokens] : seqs) {
    v1::SequenceAllocation* s = req.add_sequences();
    s->set_seq_id(id);
    s->set_num_tokens(tokens);
  }
  return AllocateBlocks(req, timeout);
}

absl::StatusOr<v1::FreeSequencesResponse> Client::FreeSequences(
    absl::Span<const uint64_t> seq_ids, absl::Duration timeout) {
  v1::FreeSequencesRequest req;
  req.mutable_seq_ids()->Assign(seq_ids.begin(), seq_ids.end());
  return Invoke<v1::FreeSequencesResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::FreeSequencesResponse* r) {
        return stub_->FreeSequences(ctx, req, r);
      });
}

absl::StatusOr<v1::CreateBatchResponse> Client::CreateBatch(
    const v1::CreateBatchRequest& req, absl::Duration timeout) {
  return Invoke<v1::CreateBatchResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::CreateBatchResponse* r) {
        return stub_->CreateBatch(ctx, req, r);
      });
}

absl::StatusOr<v1::GetBatchResponse> Client::GetBatch(uint64_t batch_id,
                                                      absl::Duration timeout) {
  v1::GetBatchRequest req;
  req.set_batch_id(batch_id);
  return Invoke<v1::GetBatchResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::GetBatchResponse* r) {
        return stub_->GetBatch(ctx, req, r);
      });
}

absl::StatusOr<v1::ReleaseBatchesResponse> Client::ReleaseBatches(
    absl::Span<const uint64_t> batch_ids, absl::Duration timeout) {
  v1::ReleaseBatchesRequest req;
  req.mutable_batch_ids()->Assign(batch_ids.begin(), batch_ids.end());
  return Invoke<v1::ReleaseBatchesResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::ReleaseBatchesResponse* r) {
        return stub_->ReleaseBatches(ctx, req, r);
      });
}

absl::StatusOr<v1::AdvanceStepResponse> Client::AdvanceStep(
    const v1::AdvanceStepRequest& req, absl::Duration timeout) {
  return Invoke<v1::AdvanceStepResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::AdvanceStepResponse* r) {
        return stub_->AdvanceStep(ctx, req, r);
      });
}

absl::StatusOr<v1::PagedAttentionResponse> Client::PagedAttention(
    const v1::PagedAttentionRequest& req, absl::Duration timeout) {
  return Invoke<v1::PagedAttentionResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::PagedAttentionResponse* r) {
        return stub_->PagedAttention(ctx, req, r);
      });
}

absl::StatusOr<v1::ForkSequenceResponse> Client::ForkSequence(
    uint64_t parent, absl::Span<const uint64_t> children,
    absl::Duration timeout) {
  v1::ForkSequenceRequest req;
  req.set_parent_seq_id(parent);
  req.mutable_child_seq_ids()->Assign(children.begin(), children.end());
  return Invoke<v1::ForkSequenceResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::ForkSequenceResponse* r) {
        return stub_->ForkSequence(ctx, req, r);
      });
}

absl::StatusOr<v1::CanAllocateResponse> Client::CanAllocate(
    const v1::AllocateBlocksRequest& req, absl::Duration timeout) {
  return Invoke<v1::CanAllocateResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::CanAllocateResponse* r) {
        return stub_->CanAllocate(ctx, req, r);
      });
}

absl::StatusOr<v1::SwapResponse> Client::SwapOut(
    absl::Span<const uint64_t> seq_ids, absl::Duration timeout) {
  v1::SwapRequest req;
  req.mutable_seq_ids()->Assign(seq_ids.begin(), seq_ids.end());
  return Invoke<v1::SwapResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::SwapResponse* r) {
        return stub_->SwapOut(ctx, req, r);
      });
}

absl::StatusOr<v1::SwapResponse> Client::SwapIn(
    absl::Span<const uint64_t> seq_ids, absl::Duration timeout) {
  v1::SwapRequest req;
  req.mutable_seq_ids()->Assign(seq_ids.begin(), seq_ids.end());
  return Invoke<v1::SwapResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::SwapResponse* r) {
        return stub_->SwapIn(ctx, req, r);
      });
}

absl::StatusOr<v1::ResetPrefixCacheResponse> Client::ResetPrefixCache(
    absl::Duration timeout) {
  return Invoke<v1::ResetPrefixCacheResponse>(
      timeout, [&](grpc::ClientContext* ctx, v1::ResetPrefixCacheResponse* r) {
        return stub_->ResetPrefixCache(ctx, v1::ResetPrefixCacheRequest(), r);
      });
}

absl::StatusOr<v1::RegisterSharedMemoryResponse> Client::RegisterSharedMemory(
    const std::string& path, int64_t size, absl::Duration timeout) {
  v1::RegisterSharedMemoryRequest req;
  req.set_path(path);
  req.set_size(size);
  return Invoke<v1::RegisterSharedMemoryResponse>(
      timeout, [&](auto* ctx, auto* resp) {
        return stub_->RegisterSharedMemory(ctx, req, resp);
      });
}

absl::Status Client::UnregisterSharedMemory(uint64_t region_id,
                                            absl::Duration timeout) {
  v1::UnregisterSharedMemoryRequest req;
  req.set_region_id(region_id);
  return Invoke<v1::UnregisterSharedMemoryResponse>(
             timeout,
             [&](auto* ctx, auto* resp) {
               return stub_->UnregisterSharedMemory(ctx, req, resp);
             })
      .status();
}

std::unique_ptr<Client::EventSubscription> Client::SubscribeKvEvents(
    const v1::SubscribeKvEventsRequest& req) {
  auto sub = std::unique_ptr<EventSubscription>(new EventSubscription());
  Prepare(&sub->ctx_, absl::InfiniteDuration());
  sub->reader_ = stub_->SubscribeKvEvents(&sub->ctx_, req);
  return sub;
}

absl::Status Client::EventSubscription::Finish() {
  return FromGrpc(reader_->Finish());
}

absl::StatusOr<v1::OpenSessionResponse> Client::OpenSession(
    absl::Duration ttl, const std::string& name, absl::Duration timeout) {
  v1::OpenSessionRequest req;
  req.set_ttl_ms(absl::ToInt64Milliseconds(ttl));
  req.set_name(name);
  absl::StatusOr<v1::OpenSessionResponse> r =
      Invoke<v1::OpenSessionResponse>(timeout, [&](auto* ctx, auto* resp) {
        return stub_->OpenSession(ctx, req, resp);
      });
  if (r.ok()) session_.store(r->session_id());
  return r;
}

absl::Status Client::KeepAlive(absl::Duration timeout) {
  v1::KeepAliveRequest req;
  req.set_session_id(session_.load());
  return Invoke<v1::KeepAliveResponse>(timeout,
                                       [&](auto* ctx, auto* resp) {
                                         return stub_->KeepAlive(ctx, req,
                                                                 resp);
                                       })
      .status();
}

absl::StatusOr<v1::CloseSessionResponse> Client::CloseSession(
    absl::Duration timeout) {
  v1::CloseSessionRequest req;
  req.set_session_id(session_.load());
  absl::StatusOr<v1::CloseSessionResponse> r =
      Invoke<v1::CloseSessionResponse>(timeout, [&](auto* ctx, auto* resp) {
        return stub_->CloseSession(ctx, req, resp);
      });
  // Left on success, and when the server no longer knows the session.
  if (r.ok() || r.status().code() == absl::StatusCode::kNotFound) {
    session_.store(0);
  }
  return r;
}

absl::StatusOr<bool> Client::IsServing(absl::Duration timeout) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(
      absl::Now() +
      (timeout == absl::ZeroDuration() ? options_.timeout : timeout)));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service("kvstep.v1.KvStep");
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = health->Check(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

v1::Tensor MakeIndexTensor(absl::Span<const int64_t> values,
                           std::vector<int64_t> shape, v1::DType dtype) {
  v1::Tensor t;
  t.set_dtype(dtype);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  std::string* data = t.mutable_data();
  if (dtype == v1::DTYPE_INT32) {
    data->resize(values.size() * 4);
    for (size_t i = 0; i < values.size(); ++i) {
      const int32_t v = static_cast<int32_t>(values[i]);
      std::memcpy(&(*data)[i * 4], &v, 4);
    }
  } else {
    data->assign(reinterpret_cast<const char*>(values.data()),
                 values.size() * 8);
  }
  return t;
}

absl::StatusOr<std::vector<int64_t>> IndexTensorValues(const v1::Tensor& t) {
  const size_t width = t.dtype() == v1::DTYPE_INT32   ? 4
                       : t.dtype() == v1::DTYPE_INT64 ? 8
                                                      : 0;
  if (width == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("not an index tensor (dtype ", t.dtype(), ")"));
  }
  if (t.data().size() % width != 0) {
    return absl::InvalidArgumentError("tensor data is not whole elements");
  }
  std::vector<int64_t> out(t.data().size() / width);
  for (size_t i = 0; i < out.size(); ++i) {
    if (width == 4) {
      int32_t v;
      std::memcpy(&v, t.data().data() + i * 4, 4);
      out[i] = v;
    } else {
      std::memcpy(&out[i], t.data().data() + i * 8, 8);
    }
  }
  return out;
}

}  // namespace kvstep
