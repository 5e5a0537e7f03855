#include "core/batch.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "core/index_dispatch.h"

namespace kvstep {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

std::string RowName(int64_t i, SeqId id) {
  return absl::StrFormat("rows[%d] (seq %d)", i, id);
}

// Allocates every tensor listed, or none usable on failure.
absl::Status ZerosAll(
    Device* device,
    std::initializer_list<std::tuple<Tensor*, DType, Shape>> wanted) {
  for (const auto& [out, dtype, shape] : wanted) {
    absl::StatusOr<Tensor> t = Tensor::Zeros(device, dtype, shape);
    if (!t.ok()) return t.status();
    *out = *std::move(t);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Batch>> Batch::Create(
    const BatchSpec& spec, absl::Span<const RowSequence> seqs,
    const BatchLimits& limits, Device* device) {
  const int64_t nq = static_cast<int64_t>(spec.rows.size());
  const int64_t pad = spec.num_padding_rows;
  const int64_t bs = limits.block_size;
  if (nq == 0) return absl::InvalidArgumentError("rows is empty");
  if (pad < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_padding_rows %d is negative", pad));
  }
  if (nq + pad > limits.max_batch_rows) {
    return absl::OutOfRangeError(
        absl::StrFormat("%d rows + %d padding rows exceed max_batch_rows %d",
                        nq, pad, limits.max_batch_rows));
  }
  const std::pair<DType, const char*> dtypes[] = {
      {spec.seq_lens_dtype, "seq_lens_dtype"},
      {spec.block_tables_dtype, "block_tables_dtype"},
      {spec.slot_mapping_dtype, "slot_mapping_dtype"}};
  for (const auto& [dtype, name] : dtypes) {
    if (!IsIndexType(dtype)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s must be int32 or int64, got %s", name, DTypeName(dtype)));
    }
  }
  if (spec.slot_mapping_dtype == DType::kInt32 &&
      limits.num_blocks * bs - 1 > kInt32Max) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "slot_mapping_dtype int32 cannot hold the slots of a pool of %d "
        "slots; use int64",
        limits.num_blocks * bs));
  }
  if (spec.block_table_width < 0 ||
      spec.block_table_width > limits.max_table_width) {
    return absl::OutOfRangeError(absl::StrFormat(
        "block_table_width %d is outside [0, %d] (max_seq_len / block_size)",
        spec.block_table_width, limits.max_table_width));
  }

  // Validate every row before allocating anything.
  absl::flat_hash_set<SeqId> seen;
  int64_t first_decode = -1;
  int64_t total_tokens = 0;
  int64_t width = std::max<int64_t>(spec.block_table_width, 1);
  for (int64_t i = 0; i < nq; ++i) {
    const BatchRowSpec& r = spec.rows[i];
    const RowSequence& s = seqs[i];
    if (!seen.insert(r.seq_id).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: the sequence is already in an earlier row",
                          RowName(i, r.seq_id)));
    }
    const int64_t q = static_cast<int64_t>(r.token_ids.size());
    if (q == 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: token_ids is empty", RowName(i, r.seq_id)));
    }
    for (int64_t j = 0; j < q; ++j) {
      if (r.token_ids[j] < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: token_ids[%d] = %d is negative",
                            RowName(i, r.seq_id), j, r.token_ids[j]));
      }
    }
    const bool prefill = r.prefill || q > 1;
    if (prefill && first_decode >= 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s is a prefill row after decode rows[%d]: list prefill rows first",
          RowName(i, r.seq_id), first_decode));
    }
    if (!prefill) {
      if (first_decode < 0) first_decode = i;
      if (r.skip_sampling) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: skip_sampling is for prefill chunks, not decode rows",
            RowName(i, r.seq_id)));
      }
    }
    if (r.num_cached_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: num_cached_tokens %d is negative",
                          RowName(i, r.seq_id), r.num_cached_tokens));
    }
    if (r.num_cached_tokens > s.num_tokens) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: num_cached_tokens %d, but only %d tokens of the sequence have "
          "been computed",
          RowName(i, r.seq_id), r.num_cached_tokens, s.num_tokens));
    }
    const int64_t seq_len = r.num_cached_tokens + q;
    const int64_t have = static_cast<int64_t>(s.blocks.size());
    if ((seq_len + bs - 1) / bs > have) {
      return absl::OutOfRangeError(absl::StrFormat(
          "%s: seq_len %d needs %d blocks, the sequence owns %d: call "
          "AllocateBlocks for at least %d tokens first",
          RowName(i, r.seq_id), seq_len, (seq_len + bs - 1) / bs, have,
          seq_len));
    }
    width = std::max(width, have);
    total_tokens += q;
  }
  if (total_tokens + pad > limits.max_batch_tokens) {
    return absl::OutOfRangeError(absl::StrFormat(
        "%d query tokens + %d padding tokens exceed max_batch_tokens %d",
        total_tokens, pad, limits.max_batch_tokens));
  }

  std::unique_ptr<Batch> b(new Batch());
  const int64_t n = nq + pad;
  const int64_t T = total_tokens + pad;
  BatchTensors& t = b->t_;
  if (absl::Status s = ZerosAll(
          device, {{&t.state.input_tokens, DType::kInt64, {T}},
                   {&t.state.input_positions, DType::kInt64, {T}},
                   {&t.state.slot_mapping, spec.slot_mapping_dtype, {T}},
                   {&t.state.seq_lens, spec.seq_lens_dtype, {n}},
                   {&t.state.block_tables, spec.block_tables_dtype, {n, width}},
                   {&t.query_start_loc, DType::kInt32, {n + 1}},
                   {&t.seq_start_loc, DType::kInt32, {n + 1}},
                   {&t.context_lens, DType::kInt32, {n}}});
      !s.ok()) {
    return s;
  }
  int64_t* tokens = t.state.input_tokens.data<int64_t>();
  int64_t* positions = t.state.input_positions.data<int64_t>();
  int32_t* qsl = t.query_start_loc.data<int32_t>();
  int32_t* ssl = t.seq_start_loc.data<int32_t>();
  int32_t* ctx = t.context_lens.data<int32_t>();
  BatchMeta& m = b->meta_;
  m.num_seqs = n;
  m.num_queries = nq;
  int64_t tok = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool real = i < nq;
    const int64_t cached = real ? spec.rows[i].num_cached_tokens : 0;
    const int64_t q =
        real ? static_cast<int64_t>(spec.rows[i].token_ids.size()) : 1;
    const int64_t seq_len = cached + q;
    for (int64_t j = 0; j < q; ++j, ++tok) {
      if (real) {
        const int64_t pos = cached + j;
        tokens[tok] = spec.rows[i].token_ids[j];
        positions[tok] = pos;
        StoreIndex(t.state.slot_mapping, tok,
                   int64_t{seqs[i].blocks[pos / bs]} * bs + pos % bs);
      } else {
        StoreIndex(t.state.slot_mapping, tok, -1);  // tokens, positions: 0
      }
    }
    StoreIndex(t.state.seq_lens, i, seq_len);
    if (real) {
      const auto& blocks = seqs[i].blocks;
      for (size_t c = 0; c < blocks.size(); ++c) {
        StoreIndex(t.state.block_tables, i * width + c, blocks[c]);
      }
    }
    qsl[i + 1] = static_cast<int32_t>(qsl[i] + q);
    ssl[i + 1] = static_cast<int32_t>(ssl[i] + seq_len);
    ctx[i] = static_cast<int32_t>(cached);
    m.max_query_len = std::max(m.max_query_len, q);
    if (real && (spec.rows[i].prefill || q > 1)) {
      ++m.num_prefills;
      m.num_prefill_tokens += q;
      m.max_prefill_seq_len = std::max(m.max_prefill_seq_len, seq_len);
    } else if (real) {
      m.max_decode_seq_len = std::max(m.max_decode_seq_len, seq_len);
    }
  }
  m.num_decode_tokens = T - m.num_prefill_tokens;

  b->num_padding_rows_ = pad;
  b->block_size_ = bs;
  b->decode_form_ = total_tokens == nq;
  for (int64_t i = 0; i < nq; ++i) {
    b->seq_ids_.push_back(spec.rows[i].seq_id);
    b->skip_sampling_.push_back(spec.rows[i].skip_sampling);
    b->decode_form_ = b->decode_form_ && !spec.rows[i].skip_sampling;
  }
  b->stale_.assign(nq, false);
  return b;
}

absl::Status Batch::CheckLive() const {
  for (int64_t i = 0; i < meta_.num_queries; ++i) {
    if (stale_[i]) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "row %d (seq %d): the sequence was freed or swapped out after the "
          "batch was created; create a new batch",
          i, seq_ids_[i]));
    }
  }
  return absl::OkStatus();
}

void Batch::SyncTableRow(int64_t row, absl::Span<const BlockId> blocks) {
  const int64_t w = table_width();
  const int64_t n = std::min<int64_t>(w, static_cast<int64_t>(blocks.size()));
  for (int64_t c = 0; c < n; ++c) {
    StoreIndex(t_.state.block_tables, row * w + c, blocks[c]);
  }
}

int64_t Batch::RowOf(SeqId id) const {
  auto it = std::find(seq_ids_.begin(), seq_ids_.end(), id);
  return it == seq_ids_.end() ? -1 : it - seq_ids_.begin();
}

void Batch::RecomputeDecodeDerived(int64_t q) {
  const int64_t n = meta_.num_seqs;
  const int64_t nq = meta_.num_queries;
  int32_t* qsl = t_.query_start_loc.data<int32_t>();
  int32_t* ssl = t_.seq_start_loc.data<int32_t>();
  int32_t* ctx = t_.context_lens.data<int32_t>();
  int64_t max_len = 0;
  qsl[0] = ssl[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ql = i < nq ? q : 1;
    const int64_t len = LoadIndex(t_.state.seq_lens, i);
    qsl[i + 1] = static_cast<int32_t>(qsl[i] + ql);
    ssl[i + 1] = static_cast<int32_t>(ssl[i] + len);
    ctx[i] = static_cast<int32_t>(len - ql);
    if (i < nq) max_len = std::max(max_len, len);
  }
  meta_.num_prefills = 0;
  meta_.num_prefill_tokens = 0;
  meta_.num_decode_tokens = t_.state.input_tokens.numel();
  meta_.max_query_len = q;
  meta_.max_prefill_seq_len = 0;
  meta_.max_decode_seq_len = max_len;
}

absl::Status Batch::Advance(const AdvanceInput& in,
                            absl::Span<const int64_t> owned_blocks,
                            absl::Span<const int32_t> block_ref_counts,
                            int64_t num_blocks, FlashInferOutputs* flashinfer) {
  const int64_t nq = meta_.num_queries;
  if (absl::Status s = CheckLive(); !s.ok()) return s;
  const bool spec = in.spec_token.defined() || in.accepted_num.defined();
  int64_t q_new = 1;
  if (spec) {
    if (!decode_form_) {
      return absl::FailedPreconditionError(
          "speculative AdvanceStep needs a decode batch; this batch still has "
          "prefill rows: advance it once without drafts first");
    }
    if (!in.spec_token.defined() || in.spec_token.rank() != 2 ||
        in.spec_token.dim(1) < 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "spec_token must have shape [num_seqs=%d, spec_num >= 1], got %s",
          meta_.num_seqs,
          in.spec_token.defined() ? ShapeToString(in.spec_token.shape())
                                  : "nothing"));
    }
    q_new = 1 + in.spec_token.dim(1);
  }

  AdvanceStepArgs args;
  args.block_size = block_size_;
  args.sampled_token_ids = in.sampled_token_ids;
  args.spec_token = in.spec_token;
  args.accepted_num = in.accepted_num;
  args.num_blocks = num_blocks;
  args.block_ref_counts = block_ref_counts;

  if (decode_form_ && q_new == q_) {
    // The common step: in place.
    args.num_seqs = meta_.num_seqs;
    args.num_queries = nq;
    args.row_owned_blocks = owned_blocks;
    args.row_seq_ids = seq_ids_;
    if (absl::Status s = AdvanceStep(args, &t_.state, flashinfer); !s.ok()) {
      return s;
    }
    RecomputeDecodeDerived(q_);
    ++step_;
    return absl::OkStatus();
  }

  // The batch changes shape: from prefill to decode rows (§5), or to or from
  // speculative width. Build the new state beside the old one and swap it in
  // only on success, so that a rejected step changes nothing.
  std::vector<int64_t> kept;  // old row index of each new real row
  for (int64_t i = 0; i < nq; ++i) {
    if (!skip_sampling_[i]) kept.push_back(i);
  }
  if (kept.empty()) {
    return absl::FailedPreconditionError(
        "no row of the batch is sampled (every row is a prefill chunk with "
        "skip_sampling): create the batch of the next chunk instead");
  }
  const int64_t nq2 = static_cast<int64_t>(kept.size());
  const int64_t n2 = nq2 + num_padding_rows_;
  const int64_t w = table_width();
  Device* device = t_.state.seq_lens.device();
  BatchTensors nt;
  if (absl::Status s = ZerosAll(
          device,
          {{&nt.state.input_tokens, DType::kInt64,
            q_new == 1 ? Shape{n2} : Shape{n2, q_new}},
           {&nt.state.input_positions, DType::kInt64,
            q_new == 1 ? Shape{n2} : Shape{n2, q_new}},
           {&nt.state.slot_mapping, t_.state.slot_mapping.dtype(),
            q_new == 1 ? Shape{n2} : Shape{n2, q_new}},
           {&nt.state.seq_lens, t_.state.seq_lens.dtype(), {n2}},
           {&nt.state.block_tables, t_.state.block_tables.dtype(), {n2, w}},
           {&nt.query_start_loc, DType::kInt32, {n2 + 1}},
           {&nt.seq_start_loc, DType::kInt32, {n2 + 1}},
           {&nt.context_lens, DType::kInt32, {n2}}});
      !s.ok()) {
    return s;
  }
  // Row starts of the old per-token tensors, to find each row's first
  // position (read by speculative mode).
  const int32_t* old_qsl = t_.query_start_loc.data<int32_t>();
  std::vector<int64_t> owned2(nq2);
  std::vector<SeqId> ids2(nq2);
  for (int64_t r = 0; r < n2; ++r) {
    const bool real = r < nq2;
    const int64_t old = real ? kept[r] : nq + (r - nq2);  // padding keeps order
    StoreIndex(nt.state.seq_lens, r, LoadIndex(t_.state.seq_lens, old));
    for (int64_t c = 0; c < w; ++c) {
      StoreIndex(nt.state.block_tables, r * w + c,
                 LoadIndex(t_.state.block_tables, old * w + c));
    }
    if (real) {
      nt.state.input_positions.data<int64_t>()[r * q_new] =
          t_.state.input_positions.data<int64_t>()[old_qsl[old]];
      owned2[r] = old < static_cast<int64_t>(owned_blocks.size())
                      ? owned_blocks[old]
                      : std::numeric_limits<int64_t>::max();
      ids2[r] = seq_ids_[old];
    }
  }
  args.num_seqs = n2;
  args.num_queries = nq2;
  args.row_owned_blocks = owned2;
  args.row_seq_ids = ids2;
  if (absl::Status s = AdvanceStep(args, &nt.state, flashinfer); !s.ok()) {
    return s;
  }
  t_ = std::move(nt);
  meta_.num_seqs = n2;
  meta_.num_queries = nq2;
  seq_ids_ = std::move(ids2);
  skip_sampling_.assign(nq2, false);
  stale_.assign(nq2, false);
  decode_form_ = true;
  q_ = q_new;
  RecomputeDecodeDerived(q_);
  ++step_;
  return absl::OkStatus();
}

absl::StatusOr<BatchTensors> Batch::CloneTensors() const {
  BatchTensors out;
  const std::pair<Tensor*, const Tensor*> pairs[] = {
      {&out.state.input_tokens, &t_.state.input_tokens},
      {&out.state.input_positions, &t_.state.input_positions},
      {&out.state.seq_lens, &t_.state.seq_lens},
      {&out.state.slot_mapping, &t_.state.slot_mapping},
      {&out.state.block_tables, &t_.state.block_tables},
      {&out.query_start_loc, &t_.query_start_loc},
      {&out.seq_start_loc, &t_.seq_start_loc},
      {&out.context_lens, &t_.context_lens}};
  for (const auto& [dst, src] : pairs) {
    absl::StatusOr<Tensor> c = src->Clone();
    if (!c.ok()) return c.status();
    *dst = *std::move(c);
  }
  return out;
}

}  // namespace kvstep
