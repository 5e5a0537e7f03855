#include "service/convert.h"

#include <cstdint>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvstep {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

DType DTypeFromProto(v1::DType dtype) {
  const int v = static_cast<int>(dtype);
  if (v < 1 || v > kMaxDType) return DType::kInvalid;
  return static_cast<DType>(v);
}

v1::DType DTypeToProto(DType dtype) { return static_cast<v1::DType>(dtype); }

namespace {

// TensorFromProto (view false) and TensorViewOfProto (true).
absl::StatusOr<Tensor> DecodeTensor(const v1::Tensor& proto, bool present,
                                    absl::string_view field, bool view) {
  if (!present) return Tensor();
  if (proto.has_shm()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field,
        ": shm (shared memory) is accepted only for PagedAttention's query, "
        "key and value; send data"));
  }
  DType dtype;
  Shape shape;
  if (absl::Status s = TensorMetaFromProto(proto, field, &dtype, &shape);
      !s.ok()) {
    return s;
  }
  const std::string& bytes = proto.data();
  // A view writes nothing through its pointer (TensorViewOfProto's
  // contract), so the proto's const bytes may back it.
  absl::StatusOr<Tensor> t =
      view && reinterpret_cast<uintptr_t>(bytes.data()) % DTypeSize(dtype) == 0
          ? Tensor::WrapHostBytes(dtype, std::move(shape),
                                  const_cast<char*>(bytes.data()), bytes.size())
          : Tensor::FromHostBytes(CpuDevice(), dtype, std::move(shape),
                                  bytes.data(), bytes.size());
  if (!t.ok()) {
    return absl::Status(t.status().code(),
                        absl::StrCat(field, ": ", t.status().message()));
  }
  return t;
}

}  // namespace

absl::Status TensorMetaFromProto(const v1::Tensor& proto,
                                 absl::string_view field, DType* dtype,
                                 Shape* shape) {
  *dtype = DTypeFromProto(proto.dtype());
  if (*dtype == DType::kInvalid) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": dtype is missing or unknown (",
                     static_cast<int>(proto.dtype()), ")"));
  }
  if (proto.shape_size() > 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": rank ", proto.shape_size(), " is above 8"));
  }
  shape->assign(proto.shape().begin(), proto.shape().end());
  return absl::OkStatus();
}

absl::StatusOr<Tensor> TensorFromProto(const v1::Tensor& proto, bool present,
                                       absl::string_view field) {
  return DecodeTensor(proto, present, field, /*view=*/false);
}

absl::StatusOr<Tensor> TensorViewOfProto(const v1::Tensor& proto, bool present,
                                         absl::string_view field) {
  return DecodeTensor(proto, present, field, /*view=*/true);
}

void TensorToProto(const Tensor& tensor, v1::Tensor* proto) {
  if (!tensor.defined()) return;
  proto->set_dtype(DTypeToProto(tensor.dtype()));
  proto->mutable_shape()->Assign(tensor.shape().begin(), tensor.shape().end());
  proto->mutable_data()->assign(static_cast<const char*>(tensor.raw_data()),
                                tensor.nbytes());
}

std::string ExtraKey(absl::string_view adapter_id, absl::string_view salt) {
  if (adapter_id.empty() && salt.empty()) return "";
  return absl::StrCat(adapter_id.size(), ":", adapter_id, salt);
}

namespace {

// The adapter id back from ExtraKey's encoding.
std::string AdapterOf(absl::string_view extra) {
  const size_t colon = extra.find(':');
  size_t n = 0;
  if (colon == absl::string_view::npos ||
      !absl::SimpleAtoi(extra.substr(0, colon), &n) ||
      colon + 1 + n > extra.size()) {
    return "";
  }
  return std::string(extra.substr(colon + 1, n));
}

std::string HashBytes(const BlockHash& h) {
  std::string out(16, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(h.hi >> (56 - 8 * i));
    out[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<SequenceRequest>> SequenceRequestsFromProto(
    const v1::AllocateBlocksRequest& req) {
  std::vector<SequenceRequest> out(req.sequences_size());
  for (int i = 0; i < req.sequences_size(); ++i) {
    const v1::SequenceAllocation& a = req.sequences(i);
    if (a.num_lookahead_tokens() < 0 ||
        a.num_lookahead_tokens() > (int64_t{1} << 40) ||
        a.num_tokens() > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sequences[%d] (seq %d): num_lookahead_tokens %d must be in "
          "[0, 2^40] and num_tokens at most 2^40",
          i, a.seq_id(), a.num_lookahead_tokens()));
    }
    out[i].seq_id = a.seq_id();
    out[i].num_tokens = a.num_tokens() + a.num_lookahead_tokens();
    out[i].prompt_token_ids.assign(a.prompt_token_ids().begin(),
                                   a.prompt_token_ids().end());
    out[i].extra_key = ExtraKey(a.adapter_id(), a.cache_salt());
  }
  return out;
}

void BlockCopyToProto(const BlockCopy& c, v1::BlockCopy* p) {
  p->set_src(c.src);
  p->set_dst(c.dst);
}

void SequenceBlocksToProto(const SequenceBlocks& s, int64_t block_size,
                           v1::SequenceBlocks* out) {
  out->set_seq_id(s.seq_id);
  out->mutable_new_block_ids()->Assign(s.new_blocks.begin(),
                                       s.new_blocks.end());
  out->mutable_block_table()->Assign(s.block_table.begin(),
                                     s.block_table.end());
  out->set_block_table_omitted(s.table_omitted);
  out->set_num_blocks(s.num_blocks);
  out->set_capacity_tokens(s.num_blocks * block_size);
  out->set_created(s.created);
  out->set_computed_tokens(s.computed_tokens);
  for (const BlockCopy& c : s.copies) BlockCopyToProto(c, out->add_copies());
}

void KvEventToProto(const KvEvent& e, v1::KvEvent* p) {
  p->set_seq_no(e.seq_no);
  switch (e.type) {
    case KvEvent::Type::kBlockStored: {
      v1::KvEvent::BlockStored* s = p->mutable_block_stored();
      for (const BlockHash& h : e.block_hashes)
        s->add_block_hashes(HashBytes(h));
      if (e.parent_hash) s->set_parent_block_hash(HashBytes(*e.parent_hash));
      s->mutable_token_ids()->Assign(e.token_ids.begin(), e.token_ids.end());
      s->set_block_size(e.block_size);
      s->set_adapter_id(AdapterOf(e.extra_key));
      break;
    }
    case KvEvent::Type::kBlockRemoved:
      for (const BlockHash& h : e.block_hashes) {
        p->mutable_block_removed()->add_block_hashes(HashBytes(h));
      }
      break;
    case KvEvent::Type::kAllBlocksCleared:
      p->mutable_all_blocks_cleared();
      break;
  }
}

void SnapshotToProto(const BatchSnapshot& snap, v1::BatchTensors* p) {
  const BatchTensors& t = snap.tensors;
  TensorToProto(t.state.input_tokens, p->mutable_input_tokens());
  TensorToProto(t.state.input_positions, p->mutable_input_positions());
  TensorToProto(t.state.seq_lens, p->mutable_seq_lens());
  TensorToProto(t.state.slot_mapping, p->mutable_slot_mapping());
  TensorToProto(t.state.block_tables, p->mutable_block_tables());
  TensorToProto(t.query_start_loc, p->mutable_query_start_loc());
  TensorToProto(t.seq_start_loc, p->mutable_seq_start_loc());
  TensorToProto(t.context_lens, p->mutable_context_lens());
  const BatchMeta& m = snap.meta;
  p->set_num_seqs(m.num_seqs);
  p->set_num_queries(m.num_queries);
  p->set_num_prefills(m.num_prefills);
  p->set_num_prefill_tokens(m.num_prefill_tokens);
  p->set_num_decode_tokens(m.num_decode_tokens);
  p->set_max_query_len(m.max_query_len);
  p->set_max_prefill_seq_len(m.max_prefill_seq_len);
  p->set_max_decode_seq_len(m.max_decode_seq_len);
  p->mutable_seq_ids()->Assign(snap.seq_ids.begin(), snap.seq_ids.end());
}

void FlashInferToProto(const FlashInferOutputs& fi, v1::FlashInferTensors* p) {
  TensorToProto(fi.paged_kv_indptr, p->mutable_paged_kv_indptr());
  TensorToProto(fi.paged_kv_indices, p->mutable_paged_kv_indices());
  TensorToProto(fi.paged_kv_last_page_len, p->mutable_paged_kv_last_page_len());
  TensorToProto(fi.block_table_bound, p->mutable_block_table_bound());
}

void InfoToProto(const EngineInfo& info, int64_t max_message_bytes,
                 v1::GetServerInfoResponse* p) {
  p->set_server_instance_id(info.instance_id);
  p->set_version(info.version);
  v1::CacheGeometry* g = p->mutable_geometry();
  g->set_num_blocks(info.cache.num_blocks);
  g->set_block_size(info.cache.block_size);
  g->set_num_layers(info.cache.num_layers);
  g->set_num_kv_heads(info.cache.num_kv_heads);
  g->set_head_size(info.cache.head_size);
  g->set_cache_dtype(DTypeToProto(info.cache.dtype));
  g->set_cache_layout(static_cast<v1::CacheLayout>(info.cache.layout));
  g->set_bytes_per_block_per_layer(info.cache.bytes_per_block());
  v1::ServerLimits* l = p->mutable_limits();
  l->set_max_seq_len(info.limits.max_seq_len);
  l->set_max_batch_rows(info.limits.max_batch_rows);
  l->set_max_batch_tokens(info.limits.max_batch_tokens);
  l->set_max_sequences(info.limits.max_sequences);
  l->set_max_batches(info.limits.max_batches);
  l->set_max_message_bytes(max_message_bytes);
  l->set_max_sessions(info.limits.max_sessions);
  p->set_num_sessions(info.num_sessions);
  p->set_sessions_expired(info.sessions_expired);
  p->set_attention_kernel(info.attention_kernel);
  p->set_free_blocks(info.free_blocks);
  p->set_num_sequences(info.num_sequences);
  p->set_num_batches(info.num_batches);
  p->set_block_order(std::string(BlockOrderName(info.block_order)));
  const BlockStats& st = info.stats;
  v1::BlockStats* o = p->mutable_stats();
  o->set_num_blocks(st.num_blocks);
  o->set_free_blocks(st.free_blocks);
  o->set_cached_blocks(st.cached_blocks);
  o->set_evictable_blocks(st.evictable_blocks);
  o->set_used_blocks(st.used_blocks);
  o->set_available_blocks(st.available_blocks);
  o->set_host_blocks(st.host_blocks);
  o->set_host_free_blocks(st.host_free_blocks);
  o->set_prefix_query_tokens(st.prefix_query_tokens);
  o->set_prefix_hit_tokens(st.prefix_hit_tokens);
  o->set_prefix_hit_rate(st.prefix_hit_rate);
  o->set_kv_cache_usage_perc(st.usage);
}

}  // namespace kvstep
