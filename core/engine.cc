#include "core/engine.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_format.h"

namespace kvstep {
namespace {

std::string NewInstanceId() {
  absl::BitGen gen;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(gen),
                         absl::Uniform<uint64_t>(gen));
}

absl::Status ValidateLimits(const EngineLimits& l) {
  constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();
  const std::pair<int64_t, const char*> positive[] = {
      {l.max_seq_len, "max_seq_len"},
      {l.max_batch_rows, "max_batch_rows"},
      {l.max_batch_tokens, "max_batch_tokens"},
      {l.max_sequences, "max_sequences"},
      {l.max_batches, "max_batches"},
      {l.max_cache_bytes, "max_cache_bytes"}};
  for (const auto& [v, name] : positive) {
    if (v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s must be > 0, got %d", name, v));
    }
  }
  // query_start_loc, seq_start_loc and context_lens are int32 (vLLM).
  if (l.max_seq_len > kI32 / l.max_batch_rows || l.max_batch_tokens > kI32) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max_batch_rows * max_seq_len (%d * %d) and max_batch_tokens must "
        "fit int32",
        l.max_batch_rows, l.max_seq_len));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    const EngineOptions& options) {
  if (absl::Status s = ValidateLimits(options.limits); !s.ok()) return s;
  if (absl::Status s = options.cache.Validate(options.limits.max_cache_bytes);
      !s.ok()) {
    return s;
  }
  Device* device = options.device != nullptr ? options.device : CpuDevice();
  absl::StatusOr<std::unique_ptr<KvCache>> cache =
      KvCache::Create(options.cache, device);
  if (!cache.ok()) return cache.status();
  return std::unique_ptr<Engine>(new Engine(options, *std::move(cache)));
}

Engine::Engine(const EngineOptions& options, std::unique_ptr<KvCache> cache)
    : instance_id_(NewInstanceId()),
      limits_(options.limits),
      device_(options.device != nullptr ? options.device : CpuDevice()),
      cache_(std::move(cache)),
      allocator_(options.cache.num_blocks, options.block_order),
      seqs_(&allocator_, options.cache.block_size, options.limits.max_seq_len,
            options.limits.max_sequences) {}

EngineInfo Engine::Info() const {
  MutexLock lock(&mu_);
  EngineInfo info;
  info.instance_id = instance_id_;
  info.version = KVSTEP_VERSION;
  info.cache = cache_->config();
  info.limits = limits_;
  info.block_order = allocator_.order();
  info.free_blocks = allocator_.num_free();
  info.num_sequences = seqs_.size();
  info.num_batches = static_cast<int64_t>(batches_.size());
  return info;
}

absl::StatusOr<AllocateResult> Engine::AllocateBlocks(
    absl::Span<const SequenceRequest> requests) {
  MutexLock lock(&mu_);
  std::vector<SequenceGrowth> growth;
  if (absl::Status s = seqs_.Allocate(requests, &growth); !s.ok()) return s;
  AllocateResult result;
  result.sequences.reserve(growth.size());
  for (SequenceGrowth& g : growth) {
    const Sequence* seq = seqs_.Find(g.seq_id);
    if (!g.new_blocks.empty()) {
      // Keep the live batches' tables mirroring the grown sequence.
      for (BatchId bid : seq->batches) {
        Batch& b = *batches_.at(bid);
        b.SyncTableRow(b.RowOf(g.seq_id), seq->blocks);
      }
    }
    SequenceBlocks out;
    out.seq_id = g.seq_id;
    out.new_blocks = std::move(g.new_blocks);
    out.block_table = seq->blocks;
    out.created = g.created;
    result.sequences.push_back(std::move(out));
  }
  result.free_blocks = allocator_.num_free();
  return result;
}

FreeResult Engine::FreeSequences(absl::Span<const SeqId> ids) {
  MutexLock lock(&mu_);
  FreeResult result;
  for (SeqId id : ids) {
    std::vector<BatchId> batches;
    if (!seqs_.Free(id, &result.blocks_freed, &batches)) {
      result.unknown.push_back(id);
      continue;
    }
    result.freed.push_back(id);
    for (BatchId bid : batches) {
      Batch& b = *batches_.at(bid);
      b.MarkStale(b.RowOf(id));
      if (std::find(result.stale_batches.begin(), result.stale_batches.end(),
                    bid) == result.stale_batches.end()) {
        result.stale_batches.push_back(bid);
      }
    }
  }
  result.free_blocks = allocator_.num_free();
  return result;
}

absl::StatusOr<CreateBatchResult> Engine::CreateBatch(
    const BatchSpec& spec, absl::Span<const BatchId> release,
    bool want_tensors) {
  MutexLock lock(&mu_);
  for (size_t i = 0; i < release.size(); ++i) {
    if (!batches_.contains(release[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "release_batch_ids[%d]: batch %d does not exist", i, release[i]));
    }
  }
  const int64_t live_after = static_cast<int64_t>(batches_.size()) + 1 -
                             static_cast<int64_t>(release.size());
  if (live_after > limits_.max_batches) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%d live batches reached max_batches %d: release batches (or name "
        "them in release_batch_ids)",
        batches_.size(), limits_.max_batches));
  }
  std::vector<RowSequence> rows(spec.rows.size());
  for (size_t i = 0; i < spec.rows.size(); ++i) {
    const Sequence* seq = seqs_.Find(spec.rows[i].seq_id);
    if (seq == nullptr) {
      return absl::NotFoundError(absl::StrFormat(
          "rows[%d]: seq %d has no blocks: call AllocateBlocks first", i,
          spec.rows[i].seq_id));
    }
    rows[i].blocks = seq->blocks;
    rows[i].num_tokens = seq->num_tokens;
  }
  const CacheConfig& cfg = cache_->config();
  BatchLimits bl;
  bl.num_blocks = cfg.num_blocks;
  bl.block_size = cfg.block_size;
  bl.max_batch_rows = limits_.max_batch_rows;
  bl.max_batch_tokens = limits_.max_batch_tokens;
  bl.max_table_width =
      (limits_.max_seq_len + cfg.block_size - 1) / cfg.block_size;
  absl::StatusOr<std::unique_ptr<Batch>> batch =
      Batch::Create(spec, rows, bl, device_);
  if (!batch.ok()) return batch.status();

  CreateBatchResult result;
  if (want_tensors) {
    absl::StatusOr<BatchSnapshot> snap = Snapshot(**batch);
    if (!snap.ok()) return snap.status();
    result.snapshot = *std::move(snap);
  }
  // Nothing can fail from here on.
  for (BatchId id : release) ReleaseLocked(id);
  result.released.assign(release.begin(), release.end());
  result.batch_id = next_batch_id_++;
  for (const BatchRowSpec& r : spec.rows) {
    Sequence* seq = seqs_.Find(r.seq_id);
    seq->num_tokens =
        r.num_cached_tokens + static_cast<int64_t>(r.token_ids.size());
    seq->batches.push_back(result.batch_id);
  }
  batches_[result.batch_id] = *std::move(batch);
  return result;
}

absl::StatusOr<BatchSnapshot> Engine::Snapshot(const Batch& b) const {
  BatchSnapshot snap;
  absl::StatusOr<BatchTensors> t = b.CloneTensors();
  if (!t.ok()) return t.status();
  snap.tensors = *std::move(t);
  snap.meta = b.meta();
  snap.seq_ids = b.seq_ids();
  snap.step = b.step();
  return snap;
}

absl::StatusOr<BatchSnapshot> Engine::GetBatch(BatchId id) const {
  MutexLock lock(&mu_);
  auto it = batches_.find(id);
  if (it == batches_.end()) {
    return absl::NotFoundError(absl::StrFormat("batch %d does not exist", id));
  }
  return Snapshot(*it->second);
}

void Engine::ReleaseLocked(BatchId id) {
  auto it = batches_.find(id);
  for (SeqId sid : it->second->seq_ids()) {
    if (Sequence* seq = seqs_.Find(sid); seq != nullptr) {
      auto& v = seq->batches;
      v.erase(std::remove(v.begin(), v.end(), id), v.end());
    }
  }
  batches_.erase(it);
}

ReleaseResult Engine::ReleaseBatches(absl::Span<const BatchId> ids) {
  MutexLock lock(&mu_);
  ReleaseResult result;
  for (BatchId id : ids) {
    if (batches_.contains(id)) {
      ReleaseLocked(id);
      result.released.push_back(id);
    } else {
      result.unknown.push_back(id);
    }
  }
  return result;
}

absl::StatusOr<AdvanceResult> Engine::AdvanceStep(BatchId id,
                                                  const AdvanceInput& in,
                                                  bool want_tensors,
                                                  bool flashinfer) {
  MutexLock lock(&mu_);
  auto it = batches_.find(id);
  if (it == batches_.end()) {
    return absl::NotFoundError(absl::StrFormat("batch %d does not exist", id));
  }
  Batch& b = *it->second;
  const std::vector<SeqId> before = b.seq_ids();
  std::vector<int64_t> owned(before.size(), 0);
  for (size_t i = 0; i < before.size(); ++i) {
    // A freed sequence's row is stale and rejected by Advance().
    if (const Sequence* seq = seqs_.Find(before[i]); seq != nullptr) {
      owned[i] = static_cast<int64_t>(seq->blocks.size());
    }
  }
  AdvanceResult result;
  if (absl::Status s = b.Advance(in, owned, cache_->config().num_blocks,
                                 flashinfer ? &result.flashinfer : nullptr);
      !s.ok()) {
    return s;
  }
  // Keep the sequences in step; rows dropped by a prefill turn (unsampled
  // chunks) no longer belong to this batch.
  const std::vector<SeqId>& after = b.seq_ids();
  const Tensor& lens = b.tensors().state.seq_lens;
  for (size_t i = 0; i < after.size(); ++i) {
    seqs_.Find(after[i])->num_tokens = lens.dtype() == DType::kInt32
                                           ? lens.data<int32_t>()[i]
                                           : lens.data<int64_t>()[i];
  }
  if (after.size() != before.size()) {
    for (SeqId sid : before) {
      if (std::find(after.begin(), after.end(), sid) != after.end()) continue;
      auto& v = seqs_.Find(sid)->batches;
      v.erase(std::remove(v.begin(), v.end(), id), v.end());
    }
  }
  result.step = b.step();
  if (want_tensors) {
    absl::StatusOr<BatchSnapshot> snap = Snapshot(b);
    if (!snap.ok()) return snap.status();
    result.snapshot = *std::move(snap);
  }
  return result;
}

absl::Status Engine::AdvanceStepExplicit(AdvanceStepArgs args, StepState* state,
                                         FlashInferOutputs* flashinfer) const {
  args.num_blocks = cache_->config().num_blocks;
  args.row_owned_blocks = {};
  args.row_seq_ids = {};
  return kvstep::AdvanceStep(args, state, flashinfer);
}

absl::Status Engine::CheckInvariants() const {
  MutexLock lock(&mu_);
  const int64_t nb = allocator_.num_blocks();
  std::vector<int32_t> refs(static_cast<size_t>(nb), 0);
  // Collected first: lambdas are opaque to the thread-safety analysis.
  std::vector<std::pair<SeqId, const Sequence*>> all;
  seqs_.ForEach(
      [&all](SeqId id, const Sequence& seq) { all.emplace_back(id, &seq); });
  for (const auto& [id, seq] : all) {
    for (BlockId b : seq->blocks) {
      if (b < 0 || b >= nb) {
        return absl::InternalError(
            absl::StrFormat("seq %d lists block %d outside the pool", id, b));
      }
      ++refs[b];
    }
    for (BatchId bid : seq->batches) {
      auto it = batches_.find(bid);
      if (it == batches_.end() || it->second->RowOf(id) < 0) {
        return absl::InternalError(absl::StrFormat(
            "seq %d names batch %d, which has no row on it", id, bid));
      }
      const Batch& b = *it->second;
      const int64_t row = b.RowOf(id);
      const Tensor& t = b.tensors().state.block_tables;
      const int64_t w = t.dim(1);
      const int64_t n =
          std::min<int64_t>(w, static_cast<int64_t>(seq->blocks.size()));
      for (int64_t c = 0; c < n; ++c) {
        const int64_t v = t.dtype() == DType::kInt32
                              ? t.data<int32_t>()[row * w + c]
                              : t.data<int64_t>()[row * w + c];
        if (v != seq->blocks[c]) {
          return absl::InternalError(absl::StrFormat(
              "batch %d row %d: block_tables[%d] = %d, the sequence has %d",
              bid, row, c, v, seq->blocks[c]));
        }
      }
    }
  }
  int64_t free_count = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (allocator_.RefCount(static_cast<BlockId>(b)) != refs[b]) {
      return absl::InternalError(absl::StrFormat(
          "block %d has reference count %d but %d sequences list it", b,
          allocator_.RefCount(static_cast<BlockId>(b)), refs[b]));
    }
    if (refs[b] == 0) ++free_count;
  }
  if (free_count != allocator_.num_free()) {
    return absl::InternalError(
        absl::StrFormat("%d blocks are unowned but the free list holds %d",
                        free_count, allocator_.num_free()));
  }
  return absl::OkStatus();
}

}  // namespace kvstep
