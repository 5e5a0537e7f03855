#include "service/kvstep_service.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "core/device.h"
#include "core/index_dispatch.h"
#include "core/log.h"
#include "service/convert.h"

namespace kvstep {
namespace {

grpc::Status Invalid(const std::string& msg) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, msg);
}

// Index widths a batch may use: unspecified means the given default.
absl::StatusOr<DType> IndexDType(v1::DType wire, DType fallback,
                                 absl::string_view field) {
  if (wire == v1::DTYPE_UNSPECIFIED) return fallback;
  const DType d = DTypeFromProto(wire);
  if (!IsIndexType(d)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be DTYPE_INT32 or DTYPE_INT64, got %d", field,
                        static_cast<int>(wire)));
  }
  return d;
}

// Compares in time independent of where the strings differ, so that the
// token cannot be guessed byte by byte from response times.
bool ConstantTimeEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace

grpc::Status KvStepService::Admit(Rpc rpc, const grpc::ServerContext& ctx,
                                  Caller* caller) const {
  const auto& md = ctx.client_metadata();
  if (!options_.auth_token.empty()) {
    auto it = md.find("authorization");
    constexpr absl::string_view kBearer = "Bearer ";
    const absl::string_view got =
        it == md.end()
            ? absl::string_view()
            : absl::string_view(it->second.data(), it->second.size());
    if (!absl::StartsWith(got, kBearer) ||
        !ConstantTimeEqual(got.substr(kBearer.size()), options_.auth_token)) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "missing or wrong bearer token: send the metadata "
                          "'authorization: Bearer <token>'");
    }
  }
  auto it = md.find(kSessionMetadataKey);
  if (it == md.end() || rpc == Rpc::kGetServerInfo) return grpc::Status::OK;
  const absl::string_view value(it->second.data(), it->second.size());
  uint64_t id = 0;
  if (!absl::SimpleAtoi(value, &id) || id == 0) {
    return Invalid(absl::StrCat("metadata ", kSessionMetadataKey,
                                " must be a session id (a positive decimal "
                                "number), got '",
                                absl::CHexEscape(value.substr(0, 64)), "'"));
  }
  caller->session = id;
  // Renews the session for calls that touch no session-owned object too.
  return ToGrpcStatus(engine_->KeepAlive(id));
}

template <typename Body>
grpc::Status KvStepService::Run(Rpc rpc, grpc::ServerContext* ctx,
                                Body&& body) {
  const absl::Time start = absl::Now();
  Caller caller;
  grpc::Status status = Admit(rpc, *ctx, &caller);
  if (status.ok()) status = body(caller);
  ctx->AddTrailingMetadata(kInstanceMetadataKey, engine_->instance_id());
  if (options_.metrics != nullptr) {
    options_.metrics->RecordRpc(rpc, status.error_code(), absl::Now() - start);
  }
  if (!status.ok()) {
    // A failed request is the client's business (it gets the message);
    // only a server-side failure is worth more than a debug line.
    const bool server_fault =
        status.error_code() == grpc::StatusCode::INTERNAL ||
        status.error_code() == grpc::StatusCode::UNKNOWN ||
        status.error_code() == grpc::StatusCode::DATA_LOSS;
    if (server_fault) {
      KVSTEP_LOG(kError, "%s failed (code %d): %s", RpcName(rpc),
                 static_cast<int>(status.error_code()), status.error_message());
    } else {
      KVSTEP_LOG(kDebug, "%s refused (code %d): %s", RpcName(rpc),
                 static_cast<int>(status.error_code()), status.error_message());
    }
  }
  return status;
}

grpc::Status KvStepService::OpenSession(grpc::ServerContext* ctx,
                                        const v1::OpenSessionRequest* req,
                                        v1::OpenSessionResponse* resp) {
  return Run(Rpc::kOpenSession, ctx, [&](const Caller&) -> grpc::Status {
    if (req->ttl_ms() < 0) {
      return Invalid(absl::StrCat("ttl_ms must be >= 0, got ", req->ttl_ms()));
    }
    if (req->name().size() > 256) {
      return Invalid("name must be at most 256 bytes");
    }
    absl::StatusOr<SessionInfo> s =
        engine_->OpenSession(absl::Milliseconds(req->ttl_ms()), req->name());
    if (!s.ok()) return ToGrpcStatus(s.status());
    KVSTEP_LOG(kInfo, "session %d opened by '%s' (ttl %s)", s->id,
               absl::CHexEscape(req->name()), absl::FormatDuration(s->ttl));
    resp->set_session_id(s->id);
    resp->set_ttl_ms(absl::ToInt64Milliseconds(s->ttl));
    resp->set_server_instance_id(engine_->instance_id());
    return grpc::Status::OK;
  });
}

grpc::Status KvStepService::KeepAlive(grpc::ServerContext* ctx,
                                      const v1::KeepAliveRequest* req,
                                      v1::KeepAliveResponse* resp) {
  return Run(Rpc::kKeepAlive, ctx, [&](const Caller&) -> grpc::Status {
    if (absl::Status s = engine_->KeepAlive(req->session_id()); !s.ok()) {
      return ToGrpcStatus(s);
    }
    resp->set_server_instance_id(engine_->instance_id());
    return grpc::Status::OK;
  });
}

grpc::Status KvStepService::CloseSession(grpc::ServerContext* ctx,
                                         const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse* resp) {
  return Run(Rpc::kCloseSession, ctx, [&](const Caller&) -> grpc::Status {
    absl::StatusOr<SessionEnd> end = engine_->CloseSession(req->session_id());
    if (!end.ok()) return ToGrpcStatus(end.status());
    SessionEnded(end->id);
    KVSTEP_LOG(kInfo,
               "session %d ('%s') closed: freed %d sequences (%d blocks), "
               "released %d batches",
               end->id, absl::CHexEscape(end->name), end->sequences,
               end->blocks_freed, end->batches);
    resp->set_sequences_freed(end->sequences);
    resp->set_blocks_freed(end->blocks_freed);
    resp->set_batches_released(end->batches);
    resp->set_server_instance_id(engine_->instance_id());
    return grpc::Status::OK;
  });
}

grpc::Status KvStepService::RegisterSharedMemory(
    grpc::ServerContext* ctx, const v1::RegisterSharedMemoryRequest* req,
    v1::RegisterSharedMemoryResponse* resp) {
  return Run(
      Rpc::kRegisterSharedMemory, ctx,
      [&](const Caller& caller) -> grpc::Status {
        // A path names a file on the server's host: only a client on
        // that host (a unix socket's peer) has one to name.
        if (!absl::StartsWith(ctx->peer(), "unix:")) {
          return grpc::Status(
              grpc::StatusCode::FAILED_PRECONDITION,
              "shared memory is for clients on the server's host: "
              "connect over a unix socket");
        }
        absl::StatusOr<uint64_t> id =
            shared_memory_.Register(req->path(), req->size(), caller.session);
        if (!id.ok()) return ToGrpcStatus(id.status());
        KVSTEP_LOG(kDebug, "shared-memory region %d: %d bytes of '%s'", *id,
                   req->size(), absl::CHexEscape(req->path().substr(0, 256)));
        resp->set_region_id(*id);
        resp->set_server_instance_id(engine_->instance_id());
        return grpc::Status::OK;
      });
}

grpc::Status KvStepService::UnregisterSharedMemory(
    grpc::ServerContext* ctx, const v1::UnregisterSharedMemoryRequest* req,
    v1::UnregisterSharedMemoryResponse* resp) {
  return Run(Rpc::kUnregisterSharedMemory, ctx,
             [&](const Caller& caller) -> grpc::Status {
               if (absl::Status s = shared_memory_.Unregister(req->region_id(),
                                                              caller.session);
                   !s.ok()) {
                 return ToGrpcStatus(s);
               }
               resp->set_server_instance_id(engine_->instance_id());
               return grpc::Status::OK;
             });
}

grpc::Status KvStepService::GetServerInfo(grpc::ServerContext* ctx,
                                          const v1::GetServerInfoRequest*,
                                          v1::GetServerInfoResponse* resp) {
  return Run(Rpc::kGetServerInfo, ctx,
             [&](const Caller& caller) -> grpc::Status {
               InfoToProto(engine_->Info(), options_.max_message_bytes, resp);
               return grpc::Status::OK;
             });
}

grpc::Status KvStepService::AllocateBlocks(grpc::ServerContext* ctx,
                                           const v1::AllocateBlocksRequest* req,
                                           v1::AllocateBlocksResponse* resp) {
  return Run(Rpc::kAllocateBlocks, ctx,
             [&](const Caller& caller) -> grpc::Status {
               absl::StatusOr<std::vector<SequenceRequest>> requests =
                   SequenceRequestsFromProto(*req);
               if (!requests.ok()) return ToGrpcStatus(requests.status());
               absl::StatusOr<AllocateResult> r = engine_->AllocateBlocks(
                   *requests, caller, req->omit_appended_tables());
               if (!r.ok()) return ToGrpcStatus(r.status());
               const int64_t bs = engine_->cache_config().block_size;
               for (const SequenceBlocks& s : r->sequences) {
                 SequenceBlocksToProto(s, bs, resp->add_sequences());
               }
               resp->set_free_blocks(r->free_blocks);
               resp->set_server_instance_id(engine_->instance_id());
               return grpc::Status::OK;
             });
}

grpc::Status KvStepService::CanAllocate(grpc::ServerContext* ctx,
                                        const v1::AllocateBlocksRequest* req,
                                        v1::CanAllocateResponse* resp) {
  return Run(Rpc::kCanAllocate, ctx, [&](const Caller& caller) -> grpc::Status {
    absl::StatusOr<std::vector<SequenceRequest>> requests =
        SequenceRequestsFromProto(*req);
    if (!requests.ok()) return ToGrpcStatus(requests.status());
    int64_t needed = 0;
    absl::StatusOr<Admission> a = engine_->CanAllocate(*requests, &needed);
    if (!a.ok()) return ToGrpcStatus(a.status());
    switch (*a) {
      case Admission::kOk:
        resp->set_admission(v1::CanAllocateResponse::ADMISSION_OK);
        break;
      case Admission::kLater:
        resp->set_admission(v1::CanAllocateResponse::ADMISSION_LATER);
        break;
      case Admission::kNever:
        resp->set_admission(v1::CanAllocateResponse::ADMISSION_NEVER);
        break;
    }
    resp->set_blocks_needed(needed);
    resp->set_available_blocks(engine_->Stats().available_blocks);
    resp->set_server_instance_id(engine_->instance_id());
    return grpc::Status::OK;
  });
}

grpc::Status KvStepService::ForkSequence(grpc::ServerContext* ctx,
                                         const v1::ForkSequenceRequest* req,
                                         v1::ForkSequenceResponse* resp) {
  return Run(
      Rpc::kForkSequence, ctx, [&](const Caller& caller) -> grpc::Status {
        std::vector<SeqId> children(req->child_seq_ids().begin(),
                                    req->child_seq_ids().end());
        absl::StatusOr<std::vector<SequenceBlocks>> r =
            engine_->ForkSequence(req->parent_seq_id(), children, caller);
        if (!r.ok()) return ToGrpcStatus(r.status());
        const int64_t bs = engine_->cache_config().block_size;
        for (const SequenceBlocks& s : *r) {
          SequenceBlocksToProto(s, bs, resp->add_children());
        }
        resp->set_server_instance_id(engine_->instance_id());
        return grpc::Status::OK;
      });
}

grpc::Status KvStepService::Swap(const v1::SwapRequest& req, bool out,
                                 const Caller& caller, v1::SwapResponse* resp) {
  std::vector<SeqId> ids(req.seq_ids().begin(), req.seq_ids().end());
  absl::StatusOr<SwapOutcome> r =
      out ? engine_->SwapOut(ids, caller) : engine_->SwapIn(ids, caller);
  if (!r.ok()) return ToGrpcStatus(r.status());
  for (const BlockCopy& c : r->copies) BlockCopyToProto(c, resp->add_copies());
  resp->mutable_stale_batch_ids()->Assign(r->stale_batches.begin(),
                                          r->stale_batches.end());
  resp->set_free_blocks(r->free_blocks);
  resp->set_host_free_blocks(r->host_free_blocks);
  resp->set_server_instance_id(engine_->instance_id());
  return grpc::Status::OK;
}

grpc::Status KvStepService::SwapOut(grpc::ServerContext* ctx,
                                    const v1::SwapRequest* req,
                                    v1::SwapResponse* resp) {
  return Run(Rpc::kSwapOut, ctx, [&](const Caller& caller) -> grpc::Status {
    return Swap(*req, /*out=*/true, caller, resp);
  });
}

grpc::Status KvStepService::SwapIn(grpc::ServerContext* ctx,
                                   const v1::SwapRequest* req,
                                   v1::SwapResponse* resp) {
  return Run(Rpc::kSwapIn, ctx, [&](const Caller& caller) -> grpc::Status {
    return Swap(*req, /*out=*/false, caller, resp);
  });
}

grpc::Status KvStepService::ResetPrefixCache(
    grpc::ServerContext* ctx, const v1::ResetPrefixCacheRequest*,
    v1::ResetPrefixCacheResponse* resp) {
  return Run(Rpc::kResetPrefixCache, ctx,
             [&](const Caller& caller) -> grpc::Status {
               engine_->ResetPrefixCache();
               resp->set_server_instance_id(engine_->instance_id());
               return grpc::Status::OK;
             });
}

grpc::Status KvStepService::SubscribeKvEvents(
    grpc::ServerContext* ctx, const v1::SubscribeKvEventsRequest* req,
    grpc::ServerWriter<v1::KvEventBatch>* writer) {
  return Run(
      Rpc::kSubscribeKvEvents, ctx, [&](const Caller& caller) -> grpc::Status {
        if (req->from_seq_no() < 0) {
          return Invalid("from_seq_no must be >= 0");
        }
        int64_t cursor =
            req->from_now() ? engine_->next_event_seq_no() : req->from_seq_no();
        // Wakes at least every 200 ms to notice cancellation and shutdown.
        while (!ctx->IsCancelled() && !shutting_down_) {
          int64_t missed = 0;
          std::vector<KvEvent> events = engine_->ReadEvents(
              cursor, 512, absl::Milliseconds(200), &missed);
          if (events.empty() && missed == 0) continue;
          v1::KvEventBatch batch;
          batch.set_missed_events(missed);
          batch.set_server_instance_id(engine_->instance_id());
          cursor += missed;
          for (const KvEvent& e : events) {
            KvEventToProto(e, batch.add_events());
            cursor = e.seq_no + 1;
          }
          if (!writer->Write(batch)) break;  // the client went away
        }
        return grpc::Status::OK;
      });
}

grpc::Status KvStepService::FreeSequences(grpc::ServerContext* ctx,
                                          const v1::FreeSequencesRequest* req,
                                          v1::FreeSequencesResponse* resp) {
  return Run(
      Rpc::kFreeSequences, ctx, [&](const Caller& caller) -> grpc::Status {
        std::vector<SeqId> ids(req->seq_ids().begin(), req->seq_ids().end());
        absl::StatusOr<FreeResult> freed = engine_->FreeSequences(ids, caller);
        if (!freed.ok()) return ToGrpcStatus(freed.status());
        const FreeResult& r = *freed;
        resp->mutable_freed_seq_ids()->Assign(r.freed.begin(), r.freed.end());
        resp->mutable_unknown_seq_ids()->Assign(r.unknown.begin(),
                                                r.unknown.end());
        resp->set_blocks_freed(r.blocks_freed);
        resp->set_free_blocks(r.free_blocks);
        resp->mutable_stale_batch_ids()->Assign(r.stale_batches.begin(),
                                                r.stale_batches.end());
        resp->set_server_instance_id(engine_->instance_id());
        return grpc::Status::OK;
      });
}

grpc::Status KvStepService::CreateBatch(grpc::ServerContext* ctx,
                                        const v1::CreateBatchRequest* req,
                                        v1::CreateBatchResponse* resp) {
  return Run(Rpc::kCreateBatch, ctx, [&](const Caller& caller) -> grpc::Status {
    BatchSpec spec;
    spec.rows.resize(req->rows_size());
    for (int i = 0; i < req->rows_size(); ++i) {
      const v1::BatchRow& r = req->rows(i);
      BatchRowSpec& row = spec.rows[i];
      row.seq_id = r.seq_id();
      row.token_ids.assign(r.token_ids().begin(), r.token_ids().end());
      row.num_cached_tokens = r.num_cached_tokens();
      row.prefill = r.prefill();
      row.skip_sampling = r.skip_sampling();
    }
    spec.num_padding_rows = req->num_padding_rows();
    spec.block_table_width = req->block_table_width();
    const std::tuple<v1::DType, DType, const char*, DType*> widths[] = {
        {req->seq_lens_dtype(), DType::kInt32, "seq_lens_dtype",
         &spec.seq_lens_dtype},
        {req->block_tables_dtype(), DType::kInt32, "block_tables_dtype",
         &spec.block_tables_dtype},
        {req->slot_mapping_dtype(), DType::kInt64, "slot_mapping_dtype",
         &spec.slot_mapping_dtype}};
    for (const auto& [wire, fallback, field, out] : widths) {
      absl::StatusOr<DType> d = IndexDType(wire, fallback, field);
      if (!d.ok()) return ToGrpcStatus(d.status());
      *out = *d;
    }
    std::vector<BatchId> release(req->release_batch_ids().begin(),
                                 req->release_batch_ids().end());
    absl::StatusOr<CreateBatchResult> r =
        engine_->CreateBatch(spec, release, req->return_tensors(), caller);
    if (!r.ok()) return ToGrpcStatus(r.status());
    resp->set_batch_id(r->batch_id);
    if (req->return_tensors())
      SnapshotToProto(r->snapshot, resp->mutable_tensors());
    resp->mutable_released_batch_ids()->Assign(r->released.begin(),
                                               r->released.end());
    resp->set_server_instance_id(engine_->instance_id());
    return grpc::Status::OK;
  });
}

grpc::Status KvStepService::GetBatch(grpc::ServerContext* ctx,
                                     const v1::GetBatchRequest* req,
                                     v1::GetBatchResponse* resp) {
  return Run(Rpc::kGetBatch, ctx, [&](const Caller& caller) -> grpc::Status {
    absl::StatusOr<BatchSnapshot> snap =
        engine_->GetBatch(req->batch_id(), caller);
    if (!snap.ok()) return ToGrpcStatus(snap.status());
    SnapshotToProto(*snap, resp->mutable_tensors());
    resp->set_step(snap->step);
    resp->set_server_instance_id(engine_->instance_id());
    return grpc::Status::OK;
  });
}

grpc::Status KvStepService::ReleaseBatches(grpc::ServerContext* ctx,
                                           const v1::ReleaseBatchesRequest* req,
                                           v1::ReleaseBatchesResponse* resp) {
  return Run(Rpc::kReleaseBatches, ctx,
             [&](const Caller& caller) -> grpc::Status {
               std::vector<BatchId> ids(req->batch_ids().begin(),
                                        req->batch_ids().end());
               absl::StatusOr<ReleaseResult> released =
                   engine_->ReleaseBatches(ids, caller);
               if (!released.ok()) return ToGrpcStatus(released.status());
               const ReleaseResult& r = *released;
               resp->mutable_released_batch_ids()->Assign(r.released.begin(),
                                                          r.released.end());
               resp->mutable_unknown_batch_ids()->Assign(r.unknown.begin(),
                                                         r.unknown.end());
               resp->set_server_instance_id(engine_->instance_id());
               return grpc::Status::OK;
             });
}

grpc::Status KvStepService::AdvanceStep(grpc::ServerContext* ctx,
                                        const v1::AdvanceStepRequest* req,
                                        v1::AdvanceStepResponse* resp) {
  return Run(Rpc::kAdvanceStep, ctx, [&](const Caller& caller) -> grpc::Status {
    resp->set_server_instance_id(engine_->instance_id());
    if (req->has_explicit_state()) {
      if (req->batch_id() != 0) {
        return Invalid(
            "batch_id and explicit_state are exclusive: name a server-held "
            "batch or send the whole state");
      }
      if (req->step() != 0) {
        return Invalid(
            "step numbers server-held batches; explicit_state carries "
            "no step");
      }
      return AdvanceExplicit(*req, resp);
    }
    if (req->batch_id() == 0) {
      return Invalid("batch_id is missing (or send explicit_state)");
    }
    AdvanceInput in;
    in.step = req->step();
    const std::tuple<const v1::Tensor&, bool, const char*, Tensor*> tensors[] =
        {{req->sampled_token_ids(), req->has_sampled_token_ids(),
          "sampled_token_ids", &in.sampled_token_ids},
         {req->spec_token(), req->has_spec_token(), "spec_token",
          &in.spec_token},
         {req->accepted_num(), req->has_accepted_num(), "accepted_num",
          &in.accepted_num}};
    for (const auto& [proto, present, field, out] : tensors) {
      absl::StatusOr<Tensor> t = TensorFromProto(proto, present, field);
      if (!t.ok()) return ToGrpcStatus(t.status());
      *out = *std::move(t);
    }
    absl::StatusOr<AdvanceResult> r = engine_->AdvanceStep(
        req->batch_id(), in, req->return_tensors(), req->flashinfer(), caller);
    if (!r.ok()) return ToGrpcStatus(r.status());
    resp->set_step(r->step);
    if (req->return_tensors())
      SnapshotToProto(r->snapshot, resp->mutable_tensors());
    if (req->flashinfer())
      FlashInferToProto(r->flashinfer, resp->mutable_flashinfer());
    return grpc::Status::OK;
  });
}

grpc::Status KvStepService::AdvanceExplicit(const v1::AdvanceStepRequest& req,
                                            v1::AdvanceStepResponse* resp) {
  const v1::ExplicitStepState& e = req.explicit_state();
  AdvanceStepArgs args;
  args.num_seqs = e.num_seqs();
  args.num_queries = e.num_queries();
  args.block_size = e.block_size();
  StepState state;
  const std::tuple<const v1::Tensor&, bool, const char*, Tensor*> tensors[] = {
      {req.sampled_token_ids(), req.has_sampled_token_ids(),
       "sampled_token_ids", &args.sampled_token_ids},
      {req.spec_token(), req.has_spec_token(), "spec_token", &args.spec_token},
      {req.accepted_num(), req.has_accepted_num(), "accepted_num",
       &args.accepted_num},
      {e.input_tokens(), e.has_input_tokens(), "explicit_state.input_tokens",
       &state.input_tokens},
      {e.input_positions(), e.has_input_positions(),
       "explicit_state.input_positions", &state.input_positions},
      {e.seq_lens(), e.has_seq_lens(), "explicit_state.seq_lens",
       &state.seq_lens},
      {e.slot_mapping(), e.has_slot_mapping(), "explicit_state.slot_mapping",
       &state.slot_mapping},
      {e.block_tables(), e.has_block_tables(), "explicit_state.block_tables",
       &state.block_tables}};
  for (const auto& [proto, present, field, out] : tensors) {
    absl::StatusOr<Tensor> t = TensorFromProto(proto, present, field);
    if (!t.ok()) return ToGrpcStatus(t.status());
    *out = *std::move(t);
  }
  FlashInferOutputs fi;
  if (absl::Status s = engine_->AdvanceStepExplicit(
          args, &state, req.flashinfer() ? &fi : nullptr);
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  v1::ExplicitStepState* out = resp->mutable_explicit_state();
  out->set_num_seqs(e.num_seqs());
  out->set_num_queries(e.num_queries());
  out->set_block_size(e.block_size());
  TensorToProto(state.input_tokens, out->mutable_input_tokens());
  TensorToProto(state.input_positions, out->mutable_input_positions());
  TensorToProto(state.seq_lens, out->mutable_seq_lens());
  TensorToProto(state.slot_mapping, out->mutable_slot_mapping());
  TensorToProto(state.block_tables, out->mutable_block_tables());
  if (req.flashinfer()) FlashInferToProto(fi, resp->mutable_flashinfer());
  return grpc::Status::OK;
}

absl::StatusOr<char*> KvStepService::SharedMemoryPlace(
    const v1::SharedMemoryRef& ref, int64_t num_bytes, absl::string_view field,
    const Caller& caller, std::vector<ShmUse>* held) const {
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> region =
      shared_memory_.Find(ref.region_id(), caller.session,
                          absl::StrCat(field, ".region_id"));
  if (!region.ok()) return region.status();
  if (absl::Status s = (*region)->CheckRange(ref.offset(), num_bytes, field);
      !s.ok()) {
    return s;
  }
  char* place = (*region)->base() + ref.offset();
  held->push_back({*std::move(region), ref.offset(), ref.offset() + num_bytes,
                   std::string(field)});
  return place;
}

absl::StatusOr<Tensor> KvStepService::TensorFromSharedMemory(
    const v1::Tensor& proto, absl::string_view field, const Caller& caller,
    std::vector<ShmUse>* held) const {
  if (!proto.data().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": data and shm are exclusive (shm set, with ",
                     proto.data().size(), " bytes of data)"));
  }
  // The shape and dtype are decoded as for bytes; only their place differs.
  DType dtype;
  Shape shape;
  if (absl::Status s = TensorMetaFromProto(proto, field, &dtype, &shape);
      !s.ok()) {
    return s;
  }
  int64_t numel = 1;
  for (int64_t d : shape) {
    // Bounded so that the byte count below cannot overflow.
    if (d < 0 || (d > 0 && numel > (int64_t{1} << 40) / d)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": shape [", absl::StrJoin(proto.shape(), ", "),
                       "] has a negative or too large dimension"));
    }
    numel *= d;
  }
  const int64_t num_bytes = numel * static_cast<int64_t>(DTypeSize(dtype));
  absl::StatusOr<char*> place = SharedMemoryPlace(
      proto.shm(), num_bytes, absl::StrCat(field, ".shm"), caller, held);
  if (!place.ok()) return place.status();
  // A view of the region where it is aligned to the element (a copy
  // otherwise). The client may write the region while the server reads it:
  // that can only give it other numbers back, since the activations are
  // read as values, never as sizes or indices (the index tensors are never
  // taken from shared memory), and the mapping cannot shrink (the seal).
  absl::StatusOr<Tensor> t =
      reinterpret_cast<uintptr_t>(*place) % DTypeSize(dtype) == 0
          ? Tensor::WrapHostBytes(dtype, std::move(shape), *place,
                                  static_cast<size_t>(num_bytes))
          : Tensor::FromHostBytes(CpuDevice(), dtype, std::move(shape), *place,
                                  static_cast<size_t>(num_bytes));
  if (!t.ok()) {
    return absl::Status(t.status().code(),
                        absl::StrCat(field, ": ", t.status().message()));
  }
  return t;
}

grpc::Status KvStepService::PagedAttention(grpc::ServerContext* ctx,
                                           const v1::PagedAttentionRequest* req,
                                           v1::PagedAttentionResponse* resp) {
  return Run(
      Rpc::kPagedAttention, ctx, [&](const Caller& caller) -> grpc::Status {
        resp->set_server_instance_id(engine_->instance_id());
        AttentionRequest a;
        a.layer = req->layer();
        Tensor alibi;
        const std::tuple<const v1::Tensor&, bool, const char*, Tensor*>
            tensors[] = {{req->query(), req->has_query(), "query", &a.query},
                         {req->key(), req->has_key(), "key", &a.key},
                         {req->value(), req->has_value(), "value", &a.value},
                         {req->alibi_slopes(), req->has_alibi_slopes(),
                          "alibi_slopes", &alibi}};
        // Regions this call reads or writes, held until it returns.
        std::vector<ShmUse> held;
        // Views of the request's bytes, which outlive the call: a prefill's
        // activations are tens of MB, and each copy of them one more buffer
        // of that size (with KeepFreedMemory, a 975-token call took
        // 0.79-0.89x the time of copies without it; rpc_bench
        // --prefill_tokens). Tensors in shared memory are views of the
        // region where they are aligned.
        for (const auto& [proto, present, field, out] : tensors) {
          absl::StatusOr<Tensor> t =
              present && proto.has_shm() && out != &alibi
                  ? TensorFromSharedMemory(proto, field, caller, &held)
                  : TensorViewOfProto(proto, present, field);
          if (!t.ok()) return ToGrpcStatus(t.status());
          *out = *std::move(t);
        }
        if (!a.query.defined() || !a.key.defined() || !a.value.defined()) {
          return Invalid("query, key and value are required");
        }
        if (alibi.defined()) {
          if (alibi.dtype() != DType::kFloat32 || alibi.rank() != 1) {
            return Invalid("alibi_slopes must be FLOAT32 [num_heads]");
          }
          a.params.alibi_slopes.assign(alibi.data<float>(),
                                       alibi.data<float>() + alibi.numel());
        }
        a.params.scale = req->scale();
        a.params.sliding_window = req->sliding_window();
        a.params.k_scale = req->k_scale() == 0 ? 1.0f : req->k_scale();
        a.params.v_scale = req->v_scale() == 0 ? 1.0f : req->v_scale();
        switch (req->kernel()) {
          case v1::PagedAttentionRequest::KERNEL_SINGLE_PASS:
            a.params.kernel = AttentionParams::Kernel::kSinglePass;
            break;
          case v1::PagedAttentionRequest::KERNEL_PARTITIONED:
            a.params.kernel = AttentionParams::Kernel::kPartitioned;
            break;
          case v1::PagedAttentionRequest::KERNEL_AUTO:
            break;
          default:
            return Invalid(
                "kernel is not a known PagedAttentionRequest.Kernel");
        }
        // The output's place is checked before anything is written: the
        // output takes the query's bytes (same shape and dtype).
        char* out_place = nullptr;
        if (req->has_out_shm()) {
          absl::StatusOr<char*> p = SharedMemoryPlace(
              req->out_shm(), static_cast<int64_t>(a.query.nbytes()), "out_shm",
              caller, &held);
          if (!p.ok()) return ToGrpcStatus(p.status());
          out_place = *p;
          // The kernel zero-fills its output before it reads the query: an
          // output over an input would compute from zeros.
          const ShmUse& o = held.back();
          for (size_t i = 0; i + 1 < held.size(); ++i) {
            if (held[i].region == o.region && held[i].begin < o.end &&
                o.begin < held[i].end && held[i].begin < held[i].end &&
                o.begin < o.end) {
              return Invalid(absl::StrFormat(
                  "out_shm: bytes [%d, %d) overlap %s's [%d, %d)", o.begin,
                  o.end, held[i].field, held[i].begin, held[i].end));
            }
          }
          // The kernel writes there itself where the place is aligned to
          // the element; otherwise its output is copied there.
          if (reinterpret_cast<uintptr_t>(out_place) %
                  DTypeSize(a.query.dtype()) ==
              0) {
            absl::StatusOr<Tensor> o = Tensor::WrapHostBytes(
                a.query.dtype(), a.query.shape(), out_place, a.query.nbytes());
            if (!o.ok()) return ToGrpcStatus(o.status());
            a.out = *std::move(o);
          }
        }
        const bool explicit_mode =
            req->has_block_tables() || req->has_seq_lens() ||
            req->has_slot_mapping() || req->has_query_start_loc();
        absl::StatusOr<Tensor> out;
        if (!explicit_mode) {
          if (req->batch_id() == 0) {
            return Invalid("batch_id is missing (or send the explicit rows)");
          }
          out = engine_->PagedAttention(req->batch_id(), a, caller);
        } else {
          if (req->batch_id() != 0) {
            return Invalid(
                "batch_id and the explicit rows (block_tables, seq_lens, "
                "slot_mapping, query_start_loc) are exclusive");
          }
          Tensor tables, lens, slots, qsl;
          const std::tuple<const v1::Tensor&, bool, const char*, Tensor*>
              rows_in[] = {
                  {req->block_tables(), req->has_block_tables(), "block_tables",
                   &tables},
                  {req->seq_lens(), req->has_seq_lens(), "seq_lens", &lens},
                  {req->slot_mapping(), req->has_slot_mapping(), "slot_mapping",
                   &slots},
                  {req->query_start_loc(), req->has_query_start_loc(),
                   "query_start_loc", &qsl}};
          for (const auto& [proto, present, field, t] : rows_in) {
            absl::StatusOr<Tensor> d = TensorFromProto(proto, present, field);
            if (!d.ok()) return ToGrpcStatus(d.status());
            if (d->defined() && !IsIndexType(d->dtype())) {
              return Invalid(absl::StrCat(field, " must be INT32 or INT64"));
            }
            *t = *std::move(d);
          }
          if (!tables.defined() || tables.rank() != 2 || !lens.defined() ||
              lens.rank() != 1 || tables.dim(0) != lens.dim(0) ||
              !slots.defined() || slots.rank() != 1) {
            return Invalid(
                "explicit mode needs block_tables [num_rows, W], seq_lens "
                "[num_rows] and slot_mapping [num_tokens]");
          }
          AttentionRows rows;
          rows.seq_lens = IndexValues(lens);
          rows.block_tables = IndexValues(tables);
          rows.width = tables.dim(1);
          rows.num_real = lens.dim(0);
          if (qsl.defined()) {
            if (qsl.rank() != 1 || qsl.dim(0) != lens.dim(0) + 1) {
              return Invalid("query_start_loc must be [num_rows + 1]");
            }
            rows.query_start = IndexValues(qsl);
          } else {
            for (int64_t r = 0; r <= lens.dim(0); ++r)
              rows.query_start.push_back(r);
          }
          out = engine_->PagedAttentionExplicit(a, rows, IndexValues(slots));
        }
        if (!out.ok()) return ToGrpcStatus(out.status());
        if (out_place != nullptr) {
          if (out->raw_data() != out_place) {
            std::memcpy(out_place, out->raw_data(), out->nbytes());
          }
          v1::Tensor* o = resp->mutable_out();
          o->set_dtype(DTypeToProto(out->dtype()));
          o->mutable_shape()->Assign(out->shape().begin(), out->shape().end());
          *o->mutable_shm() = req->out_shm();
        } else {
          TensorToProto(*out, resp->mutable_out());
        }
        return grpc::Status::OK;
      });
}

}  // namespace kvstep
