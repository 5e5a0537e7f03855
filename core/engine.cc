#include "core/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/index_dispatch.h"

namespace kvstep {
namespace {

// Shorter TTLs would lapse between the steps of a healthy scheduler.
constexpr absl::Duration kMinSessionTtl = absl::Milliseconds(100);

// Same dtype, shape and bytes (or both undefined).
bool SameTensor(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

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
  if (options.num_host_blocks < 0 ||
      options.num_host_blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("num_host_blocks must be in [0, 2^31)");
  }
  if (!(options.watermark >= 0 && options.watermark < 1)) {
    return absl::InvalidArgumentError("watermark must be in [0, 1)");
  }
  if (options.limits.max_sessions < 0) {
    return absl::InvalidArgumentError("max_sessions must be >= 0");
  }
  if (options.attention_idle_poll_us < -1 ||
      options.attention_idle_poll_us > 1000000) {
    return absl::InvalidArgumentError(
        "attention_idle_poll_us must be in [-1, 1000000] (us; -1: the "
        "default)");
  }
  if (options.max_session_ttl < kMinSessionTtl ||
      options.default_session_ttl < kMinSessionTtl ||
      options.default_session_ttl > options.max_session_ttl) {
    return absl::InvalidArgumentError(
        "session TTLs must satisfy 100ms <= default_session_ttl <= "
        "max_session_ttl");
  }
  CacheConfig host = options.cache;
  host.num_blocks = options.num_host_blocks;
  if (options.num_host_blocks > 0 &&
      options.cache.total_bytes() + host.total_bytes() >
          options.limits.max_cache_bytes) {
    return absl::InvalidArgumentError(
        "the device and host tiers together exceed max_cache_bytes");
  }
  Device* device = options.device != nullptr ? options.device : CpuDevice();
  absl::StatusOr<std::unique_ptr<KvCache>> cache =
      KvCache::Create(options.cache, device);
  if (!cache.ok()) return cache.status();
  std::unique_ptr<KvCache> host_cache;
  if (options.num_host_blocks > 0) {
    absl::StatusOr<std::unique_ptr<KvCache>> h =
        KvCache::Create(host, CpuDevice());
    if (!h.ok()) return h.status();
    host_cache = *std::move(h);
  }
  return std::unique_ptr<Engine>(
      new Engine(options, *std::move(cache), std::move(host_cache)));
}

Engine::Engine(const EngineOptions& options, std::unique_ptr<KvCache> cache,
               std::unique_ptr<KvCache> host_cache)
    : instance_id_(NewInstanceId()),
      limits_(options.limits),
      watermark_(options.watermark),
      device_(options.device != nullptr ? options.device : CpuDevice()),
      cache_(std::move(cache)),
      host_cache_(std::move(host_cache)),
      pool_(std::make_unique<ThreadPool>(
          options.attention_threads > 0
              ? options.attention_threads
              : std::max(
                    1, static_cast<int>(std::thread::hardware_concurrency())))),
      attention_prefetch_(
          options.attention_prefetch == AttentionParams::Prefetch::kAuto
              ? BestPrefetch(options.cache.dtype, options.cache.layout)
              : options.attention_prefetch),
      clock_(options.clock),
      attention_kernel_hook_(options.attention_kernel_hook),
      default_session_ttl_(options.default_session_ttl),
      max_session_ttl_(options.max_session_ttl),
      events_(options.event_log_capacity),
      allocator_(options.cache.num_blocks, options.block_order,
                 [this](KvEvent e) { events_.Append(std::move(e)); }),
      host_allocator_(options.num_host_blocks > 0
                          ? std::make_unique<BlockAllocator>(
                                options.num_host_blocks, options.block_order)
                          : nullptr),
      seqs_(&allocator_, host_allocator_.get(), options.cache.block_size,
            options.limits.max_seq_len, options.limits.max_sequences) {
  if (options.attention_idle_poll_us >= 0) {
    pool_->set_idle_poll(
        std::chrono::microseconds(options.attention_idle_poll_us));
  }
}

EngineInfo Engine::Info() const {
  MutexLock lock(&mu_);
  EngineInfo info;
  info.instance_id = instance_id_;
  info.version = KVSTEP_VERSION;
  info.cache = cache_->config();
  info.limits = limits_;
  info.block_order = allocator_.order();
  info.free_blocks = allocator_.num_available();
  info.num_sequences = seqs_.size();
  info.num_batches = static_cast<int64_t>(batches_.size());
  info.num_sessions = static_cast<int64_t>(sessions_.size());
  info.sessions_expired = sessions_expired_;
  info.pin_waits = pin_waits_;
  // The vLLM layout's decode path is chosen per CPU for the cache's dtype
  // and block size (AttentionParams::vllm_rows; rows only in the AVX-512
  // build): said, since it moves a decode step's attention time by 3-7%
  // (docs/attention.md, session 47).
  const CacheConfig& c = cache_->config();
  const bool rows = BestIsa() == AttentionParams::Isa::kAvx512 &&
                    BestVllmRows(c.dtype, c.block_size);
  // And whether decode calls of long rows take 1024-key ranges
  // (BestLongRowRanges; 16-bit and fp32 caches).
  const bool long_ranges = BestLongRowRanges(c.dtype, c.layout);
  // And for an fp8 cache how its bytes meet a bf16 query in decode
  // (BestFp8DotScope): on AMD by VDPBF16PS (0.68-0.86x the conversion's
  // time on Zen 5), elsewhere mostly converted (0.70-0.91x the dot
  // products' time on an Intel Xeon; docs/attention.md, sessions 17 and
  // 59), and only in the shapes the dot passes take.
  const char* fp8 = "";
  if (DTypeSize(c.dtype) == 1) {
    switch (BestFp8DotScope(c)) {
      case Fp8DotScope::kKeysAndValues:
        fp8 = ", fp8 by VDPBF16PS for bf16 queries";
        break;
      case Fp8DotScope::kKeys:
        fp8 =
            ", fp8 keys by VDPBF16PS for bf16 queries, values converted to "
            "fp32";
        break;
      default:
        fp8 = ", fp8 converted to fp32";
    }
  }
  info.attention_kernel = absl::StrCat(
      IsaName(BestIsa()), ", ", PrefetchName(attention_prefetch_),
      AmxSupported() ? ", AMX for 16-bit prefill" : "",
      c.layout != CacheLayout::kVllm ? ""
      : rows ? ", decode rows over every KV head where they fit"
             : ", decode items per KV head",
      long_ranges ? ", long decode rows in 1024-key ranges" : "", fp8);
  info.stats = StatsLocked();
  return info;
}

absl::StatusOr<SessionInfo> Engine::OpenSession(absl::Duration ttl,
                                                std::string name) {
  if (ttl == absl::ZeroDuration()) ttl = default_session_ttl_;
  if (ttl < kMinSessionTtl || ttl > max_session_ttl_) {
    return absl::OutOfRangeError(
        absl::StrFormat("ttl %s is outside [%s, %s]", absl::FormatDuration(ttl),
                        absl::FormatDuration(kMinSessionTtl),
                        absl::FormatDuration(max_session_ttl_)));
  }
  MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= limits_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%d open sessions reached max_sessions %d",
                        sessions_.size(), limits_.max_sessions));
  }
  // Random ids: a session id is the only thing that lets a call touch the
  // session's sequences, so it must not be guessable from another's.
  absl::BitGen gen;
  SessionId id = 0;
  while (id == 0 || sessions_.contains(id)) id = absl::Uniform<uint64_t>(gen);
  Session& session = sessions_[id];
  session.name = std::move(name);
  session.ttl = ttl;
  session.deadline = Now() + ttl;
  return SessionInfo{id, ttl};
}

absl::Status Engine::UseSessionLocked(const Caller& caller) {
  if (caller.session == 0) return absl::OkStatus();
  auto it = sessions_.find(caller.session);
  const absl::Time now = Now();
  if (it == sessions_.end() || it->second.deadline < now) {
    return absl::NotFoundError(absl::StrFormat(
        "session %d is unknown, closed or lapsed (its sequences and batches "
        "are freed or about to be): open a new session",
        caller.session));
  }
  it->second.deadline = now + it->second.ttl;
  return absl::OkStatus();
}

absl::Status Engine::NotOwnerError(SessionId owner, absl::string_view what) {
  if (owner == 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        what,
        " was created without a session: only calls without a session "
        "may use it"));
  }
  return absl::PermissionDeniedError(
      absl::StrCat(what, " belongs to another session"));
}

absl::StatusOr<Batch*> Engine::FindBatchLocked(BatchId id,
                                               const Caller& caller) const {
  auto it = batches_.find(id);
  if (it == batches_.end()) {
    return absl::NotFoundError(absl::StrFormat("batch %d does not exist", id));
  }
  if (absl::Status s =
          CheckOwner(it->second->session(), caller,
                     [&] { return absl::StrFormat("batch %d", id); });
      !s.ok()) {
    return s;
  }
  return it->second.get();
}

absl::Status Engine::CheckSeqOwnerLocked(SeqId id, const Caller& caller,
                                         absl::string_view field,
                                         size_t i) const {
  const Sequence* seq = seqs_.Find(id);
  if (seq == nullptr) return absl::OkStatus();  // the caller reports unknowns
  return CheckOwner(seq->session, caller, [&] {
    return absl::StrFormat("%s[%d]: seq %d", field, i, id);
  });
}

absl::Status Engine::AdmitSeqIdsLocked(absl::Span<const SeqId> ids,
                                       const Caller& caller) {
  if (absl::Status s = UseSessionLocked(caller); !s.ok()) return s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (absl::Status s = CheckSeqOwnerLocked(ids[i], caller, "seq_ids", i);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

void Engine::AdoptSeqLocked(SeqId id, const Caller& caller) {
  if (caller.session == 0) return;
  seqs_.Find(id)->session = caller.session;
  sessions_.at(caller.session).seqs.insert(id);
}

absl::Status Engine::KeepAlive(SessionId id) {
  MutexLock lock(&mu_);
  if (id == 0) return absl::InvalidArgumentError("session_id is missing");
  return UseSessionLocked(Caller{id});
}

absl::StatusOr<SessionEnd> Engine::CloseSession(SessionId id) {
  MutexLock lock(&mu_);
  if (id == 0) return absl::InvalidArgumentError("session_id is missing");
  if (absl::Status s = UseSessionLocked(Caller{id}); !s.ok()) return s;
  return EndSessionLocked(id);
}

std::vector<SessionEnd> Engine::ExpireSessions() {
  MutexLock lock(&mu_);
  const absl::Time now = Now();
  std::vector<SessionId> lapsed;
  for (const auto& [id, session] : sessions_) {
    if (session.deadline < now) lapsed.push_back(id);
  }
  std::vector<SessionEnd> ends;
  ends.reserve(lapsed.size());
  for (SessionId id : lapsed) ends.push_back(EndSessionLocked(id));
  sessions_expired_ += static_cast<int64_t>(ends.size());
  return ends;
}

SessionEnd Engine::EndSessionLocked(SessionId id) {
  auto it = sessions_.find(id);
  Session session = std::move(it->second);
  sessions_.erase(it);
  SessionEnd end;
  end.id = id;
  end.name = std::move(session.name);
  for (BatchId b : session.batches) {
    if (batches_.contains(b)) ReleaseLocked(b);
  }
  end.batches = static_cast<int64_t>(session.batches.size());
  const int64_t available_before = allocator_.num_available();
  for (SeqId sid : session.seqs) {
    std::vector<BatchId> batches;
    int64_t references = 0;
    if (!seqs_.Free(sid, &references, &batches)) continue;
    ++end.sequences;
    // Ownership keeps other sessions' batches off these sequences; this is
    // belt and braces.
    std::vector<BatchId> stale;
    MarkStale(batches, sid, &stale);
  }
  end.blocks_freed = allocator_.num_available() - available_before;
  return end;
}

BlockStats Engine::StatsLocked() const {
  BlockStats st;
  st.num_blocks = allocator_.num_blocks();
  st.free_blocks = allocator_.num_free();
  st.cached_blocks = allocator_.num_cached();
  st.evictable_blocks = allocator_.num_evictable();
  st.available_blocks = allocator_.num_available();
  st.used_blocks = st.num_blocks - st.available_blocks;
  if (host_allocator_) {
    st.host_blocks = host_allocator_->num_blocks();
    st.host_free_blocks = host_allocator_->num_available();
  }
  st.prefix_query_tokens = seqs_.prefix_query_tokens();
  st.prefix_hit_tokens = seqs_.prefix_hit_tokens();
  st.prefix_hit_rate =
      st.prefix_query_tokens == 0
          ? 0
          : static_cast<double>(st.prefix_hit_tokens) / st.prefix_query_tokens;
  st.usage = static_cast<double>(st.used_blocks) / st.num_blocks;
  return st;
}

BlockStats Engine::Stats() const {
  MutexLock lock(&mu_);
  return StatsLocked();
}

void Engine::SyncBatches(const Sequence& seq, SeqId id) {
  for (BatchId bid : seq.batches) {
    Batch& b = *batches_.at(bid);
    b.SyncTableRow(b.RowOf(id), seq.blocks);
  }
}

void Engine::MarkStale(const std::vector<BatchId>& batches, SeqId id,
                       std::vector<BatchId>* stale) {
  for (BatchId bid : batches) {
    Batch& b = *batches_.at(bid);
    b.MarkStale(b.RowOf(id));
    if (std::find(stale->begin(), stale->end(), bid) == stale->end()) {
      stale->push_back(bid);
    }
  }
}

absl::StatusOr<AllocateResult> Engine::AllocateBlocks(
    absl::Span<const SequenceRequest> requests, const Caller& caller,
    bool omit_appended_tables) {
  MutexLock lock(&mu_);
  // First, as waiting lets other calls in: a call that takes fresh blocks
  // waits while an attention call in flight reads released ones (a no-op
  // retry or a growth inside the blocks held does not).
  bool waited = false;
  while (allocator_.num_pinned_unowned() > 0) {
    int64_t needed = 0, fresh = 0;
    bool never = false;
    if (!seqs_.BlocksNeeded(requests, &needed, &never, &fresh).ok() ||
        fresh == 0) {
      break;  // Allocate reports the error, or takes no block
    }
    if (!waited) ++pin_waits_;
    waited = true;
    WaitForPinsLocked(/*once=*/true);
  }
  if (absl::Status s = UseSessionLocked(caller); !s.ok()) return s;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (absl::Status s =
            CheckSeqOwnerLocked(requests[i].seq_id, caller, "sequences", i);
        !s.ok()) {
      return s;
    }
  }
  std::vector<SequenceGrowth> growth;
  const int64_t pinned_unowned = allocator_.num_pinned_unowned();
  if (absl::Status s = seqs_.Allocate(requests, &growth); !s.ok()) return s;
  // A prefix hit on a released pinned block owns it again: where that was
  // the last, the calls waiting for the pins may go.
  if (pinned_unowned > 0 && allocator_.num_pinned_unowned() == 0) {
    pins_released_.notify_all();
  }
  AllocateResult result;
  result.sequences.reserve(growth.size());
  for (SequenceGrowth& g : growth) {
    if (g.created) AdoptSeqLocked(g.seq_id, caller);
    const Sequence* seq = seqs_.Find(g.seq_id);
    // Copy-on-write: the bytes move before anyone can write the new block.
    for (const BlockCopy& c : g.copies) {
      KvCache::CopyBlock(*cache_, c.src, *cache_, c.dst);
    }
    if (!g.new_blocks.empty() || !g.copies.empty()) {
      // Keep the live batches' tables mirroring the sequence.
      SyncBatches(*seq, g.seq_id);
    }
    SequenceBlocks out;
    out.seq_id = g.seq_id;
    out.new_blocks = std::move(g.new_blocks);
    out.num_blocks = static_cast<int64_t>(seq->blocks.size());
    out.table_omitted = omit_appended_tables && !g.created && g.copies.empty();
    if (!out.table_omitted) out.block_table = seq->blocks;
    out.created = g.created;
    out.computed_tokens = g.computed_tokens;
    out.copies = std::move(g.copies);
    result.sequences.push_back(std::move(out));
  }
  result.free_blocks = allocator_.num_available();
  return result;
}

absl::StatusOr<FreeResult> Engine::FreeSequences(absl::Span<const SeqId> ids,
                                                 const Caller& caller) {
  MutexLock lock(&mu_);
  if (absl::Status s = AdmitSeqIdsLocked(ids, caller); !s.ok()) return s;
  FreeResult result;
  for (SeqId id : ids) {
    std::vector<BatchId> batches;
    const Sequence* seq = seqs_.Find(id);
    const SessionId owner = seq != nullptr ? seq->session : 0;
    if (!seqs_.Free(id, &result.blocks_freed, &batches)) {
      result.unknown.push_back(id);
      continue;
    }
    if (owner != 0) sessions_.at(owner).seqs.erase(id);
    result.freed.push_back(id);
    MarkStale(batches, id, &result.stale_batches);
  }
  result.free_blocks = allocator_.num_available();
  return result;
}

absl::StatusOr<Admission> Engine::CanAllocate(
    absl::Span<const SequenceRequest> requests, int64_t* needed) const {
  MutexLock lock(&mu_);
  bool never = false;
  absl::Status s = seqs_.BlocksNeeded(requests, needed, &never);
  if (s.code() == absl::StatusCode::kOutOfRange) return Admission::kNever;
  if (!s.ok()) return s;
  // vLLM's rule: NEVER when even an empty pool would sink below the
  // watermark, OK when the free blocks stay at or above it, else LATER.
  const int64_t watermark_blocks = static_cast<int64_t>(
      watermark_ * static_cast<double>(allocator_.num_blocks()));
  if (never || allocator_.num_blocks() - *needed < watermark_blocks) {
    return Admission::kNever;
  }
  if (allocator_.num_available() - *needed >= watermark_blocks) {
    return Admission::kOk;
  }
  return Admission::kLater;
}

absl::StatusOr<std::vector<SequenceBlocks>> Engine::ForkSequence(
    SeqId parent, absl::Span<const SeqId> children, const Caller& caller) {
  MutexLock lock(&mu_);
  if (absl::Status s = UseSessionLocked(caller); !s.ok()) return s;
  // Check everything first so that a failure creates no child.
  if (children.empty()) {
    return absl::InvalidArgumentError("child_seq_ids is empty");
  }
  const Sequence* p = seqs_.Find(parent);
  if (p == nullptr) {
    return absl::NotFoundError(
        absl::StrFormat("parent seq %d does not exist", parent));
  }
  if (absl::Status s =
          CheckOwner(p->session, caller,
                     [&] { return absl::StrFormat("parent seq %d", parent); });
      !s.ok()) {
    return s;
  }
  if (p->swapped) {
    return absl::FailedPreconditionError(
        absl::StrFormat("parent seq %d is swapped out", parent));
  }
  for (size_t i = 0; i < children.size(); ++i) {
    if (seqs_.Find(children[i]) != nullptr ||
        std::find(children.begin(), children.begin() + i, children[i]) !=
            children.begin() + i) {
      return absl::AlreadyExistsError(absl::StrFormat(
          "child_seq_ids[%d]: seq %d already exists", i, children[i]));
    }
  }
  if (seqs_.size() + static_cast<int64_t>(children.size()) >
      limits_.max_sequences) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%d children would exceed max_sequences %d",
                        children.size(), limits_.max_sequences));
  }
  std::vector<SequenceBlocks> out;
  for (SeqId child : children) {
    if (absl::Status s = seqs_.Fork(parent, child); !s.ok()) return s;
    AdoptSeqLocked(child, caller);
    SequenceBlocks sb;
    sb.seq_id = child;
    sb.block_table = seqs_.Find(child)->blocks;
    sb.num_blocks = static_cast<int64_t>(sb.block_table.size());
    sb.created = true;
    out.push_back(std::move(sb));
  }
  return out;
}

absl::StatusOr<SwapOutcome> Engine::SwapOut(absl::Span<const SeqId> ids,
                                            const Caller& caller) {
  return Swap(ids, /*out=*/true, caller);
}

absl::StatusOr<SwapOutcome> Engine::SwapIn(absl::Span<const SeqId> ids,
                                           const Caller& caller) {
  return Swap(ids, /*out=*/false, caller);
}

absl::StatusOr<SwapOutcome> Engine::Swap(absl::Span<const SeqId> ids, bool out,
                                         const Caller& caller) {
  MutexLock lock(&mu_);
  // SwapIn takes fresh device blocks; first, as waiting lets other calls in.
  if (!out && allocator_.num_pinned_unowned() > 0) {
    ++pin_waits_;
    WaitForPinsLocked(/*once=*/false);
  }
  if (absl::Status s = AdmitSeqIdsLocked(ids, caller); !s.ok()) return s;
  SwapResult r;
  absl::Status s = out ? seqs_.SwapOut(ids, &r) : seqs_.SwapIn(ids, &r);
  if (!s.ok()) return s;
  SwapOutcome outcome;
  for (const BlockCopy& c : r.copies) {
    if (out) {
      KvCache::CopyBlock(*cache_, c.src, *host_cache_, c.dst);
    } else {
      KvCache::CopyBlock(*host_cache_, c.src, *cache_, c.dst);
    }
  }
  outcome.copies = std::move(r.copies);
  if (out) {
    // A batch row on a swapped-out sequence would compute slots in blocks
    // the sequence no longer has: the row goes stale and leaves the
    // sequence's batch list.
    for (SeqId id : ids) {
      Sequence* seq = seqs_.Find(id);
      MarkStale(std::vector<BatchId>(seq->batches.begin(), seq->batches.end()),
                id, &outcome.stale_batches);
      seq->batches.clear();
    }
  }
  outcome.free_blocks = allocator_.num_available();
  outcome.host_free_blocks = host_allocator_->num_available();
  return outcome;
}

void Engine::ResetPrefixCache() {
  MutexLock lock(&mu_);
  allocator_.ResetPrefixCache();
  // Sequences re-register their full blocks from their next step on.
  seqs_.ClearHashes();
}

absl::StatusOr<CreateBatchResult> Engine::CreateBatch(
    const BatchSpec& spec, absl::Span<const BatchId> release, bool want_tensors,
    const Caller& caller) {
  MutexLock lock(&mu_);
  if (absl::Status s = UseSessionLocked(caller); !s.ok()) return s;
  for (size_t i = 0; i < release.size(); ++i) {
    auto it = batches_.find(release[i]);
    if (it == batches_.end()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "release_batch_ids[%d]: batch %d does not exist", i, release[i]));
    }
    if (absl::Status s = CheckOwner(it->second->session(), caller,
                                    [&] {
                                      return absl::StrFormat(
                                          "release_batch_ids[%d]: batch %d", i,
                                          release[i]);
                                    });
        !s.ok()) {
      return s;
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
  const CacheConfig& cfg = cache_->config();
  std::vector<RowSequence> rows(spec.rows.size());
  for (size_t i = 0; i < spec.rows.size(); ++i) {
    const Sequence* seq = seqs_.Find(spec.rows[i].seq_id);
    if (seq == nullptr) {
      return absl::NotFoundError(absl::StrFormat(
          "rows[%d]: seq %d has no blocks: call AllocateBlocks first", i,
          spec.rows[i].seq_id));
    }
    const BatchRowSpec& r = spec.rows[i];
    if (absl::Status s = CheckOwner(
            seq->session, caller,
            [&] { return absl::StrFormat("rows[%d]: seq %d", i, r.seq_id); });
        !s.ok()) {
      return s;
    }
    if (seq->swapped) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "rows[%d]: seq %d is swapped out: SwapIn first", i, r.seq_id));
    }
    // The row writes positions num_cached_tokens .. + len(token_ids) - 1:
    // none of them may be in a block another sequence shares. (A negative
    // or overflowing count is refused by Batch::Create with its reason.)
    const int64_t len = static_cast<int64_t>(r.token_ids.size());
    if (r.num_cached_tokens >= 0 && len > 0 &&
        r.num_cached_tokens <= std::numeric_limits<int64_t>::max() - len) {
      const int64_t shared = seqs_.FirstSharedBlock(
          *seq, r.num_cached_tokens / cfg.block_size,
          (r.num_cached_tokens + len - 1) / cfg.block_size + 1);
      if (shared >= 0) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "rows[%d] (seq %d): position %d is in block %d of the sequence, "
            "which is shared with another sequence: call AllocateBlocks "
            "first (it copies the block)",
            i, r.seq_id, std::max(r.num_cached_tokens, shared * cfg.block_size),
            shared));
      }
    }
    rows[i].blocks = seq->blocks;
    rows[i].num_tokens = seq->num_tokens;
  }
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
    const int64_t seq_len =
        r.num_cached_tokens + static_cast<int64_t>(r.token_ids.size());
    seq->num_tokens = seq_len;
    seq->batches.push_back(result.batch_id);
    // The step computes these tokens: their full blocks become cached
    // (vLLM v1 registers blocks when they are scheduled).
    seqs_.RecordTokens(seq, r.num_cached_tokens, r.token_ids, seq_len);
  }
  (*batch)->set_session(caller.session);
  if (caller.session != 0) {
    sessions_.at(caller.session).batches.insert(result.batch_id);
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

absl::StatusOr<BatchSnapshot> Engine::GetBatch(BatchId id,
                                               const Caller& caller) {
  MutexLock lock(&mu_);
  if (absl::Status s = UseSessionLocked(caller); !s.ok()) return s;
  absl::StatusOr<Batch*> b = FindBatchLocked(id, caller);
  if (!b.ok()) return b.status();
  return Snapshot(**b);
}

void Engine::ReleaseLocked(BatchId id) {
  auto it = batches_.find(id);
  if (const SessionId owner = it->second->session(); owner != 0) {
    // Absent while EndSessionLocked releases the session's batches.
    if (auto s = sessions_.find(owner); s != sessions_.end()) {
      s->second.batches.erase(id);
    }
  }
  last_steps_.erase(id);
  for (SeqId sid : it->second->seq_ids()) {
    if (Sequence* seq = seqs_.Find(sid); seq != nullptr) seq->LeaveBatch(id);
  }
  batches_.erase(it);
}

absl::StatusOr<ReleaseResult> Engine::ReleaseBatches(
    absl::Span<const BatchId> ids, const Caller& caller) {
  MutexLock lock(&mu_);
  if (absl::Status s = UseSessionLocked(caller); !s.ok()) return s;
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = batches_.find(ids[i]);
    if (it == batches_.end()) continue;
    if (absl::Status s = CheckOwner(it->second->session(), caller,
                                    [&] {
                                      return absl::StrFormat(
                                          "batch_ids[%d]: batch %d", i, ids[i]);
                                    });
        !s.ok()) {
      return s;
    }
  }
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
                                                  bool flashinfer,
                                                  const Caller& caller) {
  MutexLock lock(&mu_);
  if (absl::Status s = UseSessionLocked(caller); !s.ok()) return s;
  absl::StatusOr<Batch*> found = FindBatchLocked(id, caller);
  if (!found.ok()) return found.status();
  Batch& b = **found;
  if (in.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("step must be >= 0, got %d", in.step));
  }
  if (in.step != 0 && in.step == b.step()) {
    // A retry of the step just taken: answer it again, never advance twice.
    auto rec = last_steps_.find(id);
    if (rec == last_steps_.end() || rec->second.result.step != in.step) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "step %d of batch %d is already done and was not numbered, so it "
          "cannot be replayed",
          in.step, id));
    }
    const StepRecord& r = rec->second;
    if (!SameTensor(r.input.sampled_token_ids, in.sampled_token_ids) ||
        !SameTensor(r.input.spec_token, in.spec_token) ||
        !SameTensor(r.input.accepted_num, in.accepted_num) ||
        r.want_tensors != want_tensors || r.flashinfer != flashinfer) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "step %d of batch %d is already done with other inputs or options: "
          "a retry must repeat the call exactly",
          in.step, id));
    }
    return r.result;
  }
  if (in.step != 0 && in.step != b.step() + 1) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "step %d is not the next step of batch %d: it has taken %d steps, so "
        "the next is %d (%s)",
        in.step, id, b.step(), b.step() + 1,
        in.step > b.step() ? "a step was skipped" : "a stale retry"));
  }
  const std::vector<SeqId> before = b.seq_ids();
  // Each row's sequence, looked up once: the map does not change below.
  std::vector<Sequence*> seq_of(before.size(), nullptr);
  std::vector<int64_t> owned(before.size(), 0);
  for (size_t i = 0; i < before.size(); ++i) {
    // A freed or swapped-out sequence's row is stale and rejected by
    // Advance(); a fresh sequence reusing the id is not this row's.
    if (b.stale(static_cast<int64_t>(i))) continue;
    seq_of[i] = seqs_.Find(before[i]);
    owned[i] = static_cast<int64_t>(seq_of[i]->blocks.size());
  }
  AdvanceResult result;
  if (absl::Status s = b.Advance(in, owned, allocator_.ref_counts(),
                                 cache_->config().num_blocks,
                                 flashinfer ? &result.flashinfer : nullptr);
      !s.ok()) {
    return s;
  }
  // Keep the sequences in step; rows dropped by a prefill turn (unsampled
  // chunks) no longer belong to this batch. The rows kept are a
  // subsequence of the rows before, in order, and ids are unique in a
  // batch, so one walk pairs them (no stale row gets here).
  const std::vector<SeqId>& after = b.seq_ids();
  const StepState& st = b.tensors().state;
  const int64_t q = b.tokens_per_row();
  size_t k = 0;  // the row before the step of after[i]
  for (size_t i = 0; i < after.size(); ++i, ++k) {
    for (; before[k] != after[i]; ++k) seq_of[k]->LeaveBatch(id);
    Sequence* seq = seq_of[k];
    seq->num_tokens = LoadIndex(st.seq_lens, static_cast<int64_t>(i));
    // The row's first token is a real sample; speculative drafts after it
    // are recorded but not cached (they may be rejected).
    const int64_t first = st.input_positions.data<int64_t>()[i * q];
    seqs_.RecordTokens(
        seq, first,
        absl::MakeConstSpan(st.input_tokens.data<int64_t>() + i * q,
                            static_cast<size_t>(q)),
        first + 1);
  }
  for (; k < before.size(); ++k) seq_of[k]->LeaveBatch(id);
  result.step = b.step();
  if (want_tensors) {
    absl::StatusOr<BatchSnapshot> snap = Snapshot(b);
    // Cannot fail for want of memory once the step is done: a failure here
    // would leave a step taken but reported as failed.
    if (!snap.ok()) return snap.status();
    result.snapshot = *std::move(snap);
  }
  if (in.step != 0) {
    // Snapshot tensors are never written after this, so sharing them with
    // the record is safe.
    last_steps_[id] = StepRecord{in, want_tensors, flashinfer, result};
  } else {
    last_steps_.erase(id);
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

absl::StatusOr<Tensor> Engine::PagedAttention(BatchId id,
                                              const AttentionRequest& req,
                                              const Caller& caller) {
  MutexLock attention(&attention_mu_);
  AttentionRows rows;
  std::vector<BlockId> pinned;
  {
    MutexLock lock(&mu_);
    if (absl::Status s = UseSessionLocked(caller); !s.ok()) return s;
    absl::StatusOr<Batch*> found = FindBatchLocked(id, caller);
    if (!found.ok()) return found.status();
    const Batch& b = **found;
    const BatchMeta& m = b.meta();
    if (absl::Status s = b.CheckLive(); !s.ok()) return s;
    // Copies: the batch may change (or go) while the kernel runs.
    const BatchTensors& t = b.tensors();
    rows.query_start = IndexValues(t.query_start_loc);
    rows.seq_lens = IndexValues(t.state.seq_lens);
    rows.block_tables = IndexValues(t.state.block_tables);
    rows.width = b.table_width();
    rows.num_real = m.num_queries;
    const std::vector<int64_t> slots = IndexValues(t.state.slot_mapping);
    const int64_t bs = cache_->config().block_size;
    // No write may land in a block another sequence holds (a fork since the
    // step was planned): AllocateBlocks must copy it first.
    for (size_t k = 0; k < slots.size(); ++k) {
      if (slots[k] >= 0 &&
          allocator_.RefCount(static_cast<BlockId>(slots[k] / bs)) > 1) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "slot_mapping[%d] = %d is in block %d, which is shared with "
            "another sequence: call AllocateBlocks first (it copies the "
            "block)",
            k, slots[k], slots[k] / bs));
      }
    }
    if (absl::Status s = PrepareAttentionLocked(req, rows, slots, &pinned);
        !s.ok()) {
      return s;
    }
  }
  return AttendPinned(req, rows, pinned);
}

absl::StatusOr<Tensor> Engine::PagedAttentionExplicit(
    const AttentionRequest& req, const AttentionRows& rows,
    absl::Span<const int64_t> slots) {
  MutexLock attention(&attention_mu_);
  std::vector<BlockId> pinned;
  {
    MutexLock lock(&mu_);
    if (absl::Status s = PrepareAttentionLocked(req, rows, slots, &pinned);
        !s.ok()) {
      return s;
    }
  }
  return AttendPinned(req, rows, pinned);
}

absl::Status Engine::PrepareAttentionLocked(const AttentionRequest& req,
                                            const AttentionRows& rows,
                                            absl::Span<const int64_t> slots,
                                            std::vector<BlockId>* pinned) {
  // The query and rows are checked before the step's K/V are written, and
  // ReshapeAndCache checks its own inputs before writing anything.
  if (absl::Status s =
          ValidateAttention(cache_->config(), req.query, rows, req.params);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          ReshapeAndCache(*cache_, req.layer, req.key, req.value, slots,
                          req.params.k_scale, req.params.v_scale);
      !s.ok()) {
    return s;
  }
  // What the kernel reads: each real row's first ceil(seq_len / block_size)
  // table entries, which ValidateAttention checked are blocks of the pool.
  // In the explicit mode they may be anyone's, or free.
  const int64_t bs = cache_->config().block_size;
  pinned->clear();
  for (int64_t r = 0; r < rows.num_real; ++r) {
    const int64_t need = (rows.seq_lens[r] + bs - 1) / bs;
    for (int64_t j = 0; j < need; ++j) {
      pinned->push_back(
          static_cast<BlockId>(rows.block_tables[r * rows.width + j]));
    }
  }
  allocator_.Pin(*pinned);
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Engine::AttendPinned(
    const AttentionRequest& req, const AttentionRows& rows,
    const std::vector<BlockId>& pinned) {
  if (attention_kernel_hook_) attention_kernel_hook_();
  AttentionParams params = req.params;
  params.prefetch = attention_prefetch_;
  Tensor out = req.out;
  const absl::Status s = kvstep::PagedAttention(
      *cache_, req.layer, req.query, rows, params, pool_.get(), &out);
  {
    MutexLock lock(&mu_);
    const bool waited_on = allocator_.num_pinned_unowned() > 0;
    allocator_.Unpin(pinned);
    if (waited_on) pins_released_.notify_all();
  }
  if (!s.ok()) return s;
  return out;
}

void Engine::WaitForPinsLocked(bool once) {
  while (allocator_.num_pinned_unowned() > 0) {
    // Notified where the count reaches 0 (AttendPinned, AllocateBlocks);
    // the deadline is a backstop, not the wake-up.
    mu_.WaitUntil(pins_released_,
                  std::chrono::steady_clock::now() + std::chrono::seconds(1));
    if (once) return;
  }
}

absl::Status Engine::CheckInvariants() const {
  MutexLock lock(&mu_);
  const int64_t nb = allocator_.num_blocks();
  std::vector<int32_t> refs(static_cast<size_t>(nb), 0);
  const int64_t nh = host_allocator_ ? host_allocator_->num_blocks() : 0;
  std::vector<int32_t> host_refs(static_cast<size_t>(nh), 0);
  // Collected first: lambdas are opaque to the thread-safety analysis.
  std::vector<std::pair<SeqId, const Sequence*>> all;
  seqs_.ForEach(
      [&all](SeqId id, const Sequence& seq) { all.emplace_back(id, &seq); });
  for (const auto& [id, seq] : all) {
    const int64_t tier_blocks = seq->swapped ? nh : nb;
    for (BlockId b : seq->blocks) {
      if (b < 0 || b >= tier_blocks) {
        return absl::InternalError(
            absl::StrFormat("seq %d lists block %d outside its tier", id, b));
      }
      ++(seq->swapped ? host_refs : refs)[b];
    }
    if (static_cast<int64_t>(seq->tokens.size()) < seq->num_tokens) {
      return absl::InternalError(
          absl::StrFormat("seq %d knows %d tokens but has %d computed", id,
                          seq->tokens.size(), seq->num_tokens));
    }
    if (seq->swapped && !seq->batches.empty()) {
      return absl::InternalError(
          absl::StrFormat("swapped-out seq %d is still in a batch", id));
    }
    for (size_t c = 0;
         !seq->swapped && c < seq->hashes.size() && c < seq->blocks.size();
         ++c) {
      const std::optional<BlockHash> h = allocator_.HashOf(seq->blocks[c]);
      if (h.has_value() && *h != seq->hashes[c]) {
        return absl::InternalError(absl::StrFormat(
            "seq %d block %d is registered under another hash", id, c));
      }
    }
    for (BatchId bid : seq->batches) {
      auto it = batches_.find(bid);
      if (it == batches_.end() || it->second->RowOf(id) < 0 ||
          it->second->stale(it->second->RowOf(id))) {
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
        const int64_t v = LoadIndex(t, row * w + c);
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
  if (free_count != allocator_.num_available()) {
    return absl::InternalError(
        absl::StrFormat("%d blocks are unowned but %d are free or evictable",
                        free_count, allocator_.num_available()));
  }
  int64_t evictable = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const bool has_hash =
        allocator_.HashOf(static_cast<BlockId>(b)).has_value();
    if (refs[b] == 0 && has_hash) ++evictable;
    if (refs[b] == 0 && !has_hash &&
        !allocator_.IsOnFreeList(static_cast<BlockId>(b))) {
      return absl::InternalError(
          absl::StrFormat("block %d is neither owned, cached nor free", b));
    }
  }
  if (evictable != allocator_.num_evictable()) {
    return absl::InternalError(
        absl::StrFormat("%d cached unreferenced blocks, the evictor holds %d",
                        evictable, allocator_.num_evictable()));
  }
  for (int64_t b = 0; b < nh; ++b) {
    if (host_allocator_->RefCount(static_cast<BlockId>(b)) != host_refs[b]) {
      return absl::InternalError(absl::StrFormat(
          "host block %d has reference count %d but %d sequences list it", b,
          host_allocator_->RefCount(static_cast<BlockId>(b)), host_refs[b]));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvstep
