// Engine: everything one kvstep server owns (the KV cache, its block
// allocator, the sequences and the batches) behind one API that the gRPC
// service adapts one-to-one. No gRPC in here: errors are absl::Status with
// the canonical code the service passes through.
//
// Invariants kept across every call:
//   * a block is free, or owned by exactly the sequences that list it;
//   * a batch's block_tables rows mirror its sequences' tables (up to the
//     batch's width), because AllocateBlocks updates the live batches;
//   * a batch whose sequence was freed cannot advance (its row is stale), so
//     a step can never compute slots in a block that went back to the pool;
//   * a rejected call changes nothing.
//
// Sessions: a caller may open a session with a time-to-live. Sequences and
// batches created by its calls belong to it, only its calls may touch them
// (PERMISSION_DENIED otherwise), each of its calls renews it, and when it
// closes or lapses (the scheduler died) its batches are released and its
// sequences freed. Objects created without a session belong to no session
// and only session-less calls may touch them.
//
// Thread-safe: every method may be called from any thread. One mutex (mu_)
// guards all state; each call holds it for microseconds (no I/O under the
// lock). PagedAttention, whose kernel takes milliseconds, holds it only to
// check its inputs, write the step's K/V and pin the blocks it reads, and
// runs the kernel outside it, so that control calls do not queue behind
// attention: a pinned block may be released meanwhile but not handed out
// again until the call is done (BlockAllocator::Pin; an allocation that
// would need to waits for it). Attention calls run one at a time
// (attention_mu_, taken before mu_): they share the attention threads, and
// one call's K/V write must not land under another's reads.
#ifndef KVSTEP_CORE_ENGINE_H_
#define KVSTEP_CORE_ENGINE_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/advance_step.h"
#include "core/attention.h"
#include "core/batch.h"
#include "core/block_allocator.h"
#include "core/kv_cache.h"
#include "core/kv_events.h"
#include "core/mutex.h"
#include "core/sequence_manager.h"
#include "core/thread_pool.h"

namespace kvstep {

struct EngineLimits {
  int64_t max_seq_len = 32768;
  int64_t max_batch_rows = 1024;
  int64_t max_batch_tokens = 65536;
  int64_t max_sequences = 65536;
  int64_t max_batches = 256;
  int64_t max_cache_bytes = int64_t{16} << 30;
  int64_t max_sessions = 1024;
};

struct EngineOptions {
  CacheConfig cache;
  BlockOrder block_order = BlockOrder::kDescending;
  EngineLimits limits;
  Device* device = nullptr;  // the CPU device when null
  // Blocks of the host tier (SwapOut/SwapIn); 0: no host tier.
  int64_t num_host_blocks = 0;
  // CanAllocate answers LATER while fewer than this fraction of the pool
  // would stay available (vLLM's watermark, default 1%).
  double watermark = 0.01;
  // KV events kept for subscribers.
  size_t event_log_capacity = 65536;
  // Threads for attention, the calling thread included (0: one per core).
  int attention_threads = 0;
  // How long an attention worker polls for the next call before it sleeps
  // (ThreadPool::set_idle_poll; -1: ThreadPool::kDefaultIdlePoll, 0:
  // sleep at once). Polling burns the worker's core between calls that
  // come this close together, for calls that start on every thread.
  int64_t attention_idle_poll_us = -1;
  // The attention kernel's prefetch hint for every PagedAttention call
  // (AttentionParams::prefetch; kAuto chooses by CPU vendor). A setting of
  // the machine, not of a request: the protocol does not carry it.
  AttentionParams::Prefetch attention_prefetch =
      AttentionParams::Prefetch::kAuto;
  // Sessions opened without a TTL get this one; longer ones are refused.
  absl::Duration default_session_ttl = absl::Seconds(30);
  absl::Duration max_session_ttl = absl::Hours(24);
  // The clock session deadlines are kept on (tests substitute a fake).
  std::function<absl::Time()> clock;  // absl::Now when empty
  // Tests only: called on a PagedAttention call's thread once the call has
  // written its K/V, pinned its blocks and let go of the engine's lock,
  // just before its kernel runs; a test holds the call there to run
  // control calls beside it.
  std::function<void()> attention_kernel_hook;
};

// Who makes a call: the session it runs in (0: none).
struct Caller {
  SessionId session = 0;
};

struct SessionInfo {
  SessionId id = 0;
  absl::Duration ttl;
};

// What ending a session (closed or lapsed) gave back.
struct SessionEnd {
  SessionId id = 0;
  std::string name;
  int64_t sequences = 0;
  // Blocks back in the pool (a block shared with a sequence outside the
  // session stays with it).
  int64_t blocks_freed = 0;
  int64_t batches = 0;
};

struct AttentionRequest {
  int64_t layer = 0;
  Tensor query;  // [num_tokens, num_heads, head_size]
  Tensor key;    // [num_tokens, num_kv_heads, head_size]: this step's K/V
  Tensor value;
  AttentionParams params;
  // Optional: where the output goes (the query's dtype and shape, host
  // memory; the service's shared memory), instead of a new tensor.
  Tensor out;
};

struct BlockStats {
  int64_t num_blocks = 0;
  int64_t free_blocks = 0;       // on the free list
  int64_t cached_blocks = 0;     // with a registered hash, owned or not
  int64_t evictable_blocks = 0;  // cached and unreferenced
  int64_t used_blocks = 0;       // reference count >= 1
  int64_t available_blocks = 0;  // free + evictable
  int64_t host_blocks = 0;
  int64_t host_free_blocks = 0;
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  double prefix_hit_rate = 0;  // hit / query tokens (0 before any query)
  double usage = 0;            // used / num_blocks (vLLM kv_cache_usage_perc)
};

enum class Admission { kOk, kLater, kNever };

struct EngineInfo {
  std::string instance_id;
  std::string version;
  CacheConfig cache;
  EngineLimits limits;
  BlockOrder block_order;
  int64_t free_blocks = 0;  // available to allocations (free + evictable)
  int64_t num_sequences = 0;
  int64_t num_batches = 0;
  int64_t num_sessions = 0;
  int64_t sessions_expired = 0;  // since start
  // Allocating calls (AllocateBlocks, SwapIn) that waited for an attention
  // call in flight, which read a block freed meanwhile; since start.
  int64_t pin_waits = 0;
  BlockStats stats;
  // PagedAttention's instruction set and prefetch hint, resolved.
  std::string attention_kernel;
};

struct SequenceBlocks {
  SeqId seq_id = 0;
  std::vector<BlockId> new_blocks;
  // The whole table after the call; empty when table_omitted.
  std::vector<BlockId> block_table;
  int64_t num_blocks = 0;  // the table's length, always set
  // AllocateBlocks(omit_appended_tables): the table is the one the caller
  // was last told plus new_blocks, so it was left out.
  bool table_omitted = false;
  bool created = false;
  int64_t computed_tokens = 0;    // prefix-cache hits
  std::vector<BlockCopy> copies;  // copy-on-write, already done
};

struct AllocateResult {
  std::vector<SequenceBlocks> sequences;
  int64_t free_blocks = 0;
};

struct SwapOutcome {
  std::vector<BlockCopy> copies;  // already done
  std::vector<BatchId> stale_batches;
  int64_t free_blocks = 0;
  int64_t host_free_blocks = 0;
};

struct FreeResult {
  std::vector<SeqId> freed;
  std::vector<SeqId> unknown;
  int64_t blocks_freed = 0;
  int64_t free_blocks = 0;
  std::vector<BatchId> stale_batches;
};

// A consistent copy of a batch's state.
struct BatchSnapshot {
  BatchTensors tensors;
  BatchMeta meta;
  std::vector<SeqId> seq_ids;
  int64_t step = 0;
};

struct CreateBatchResult {
  BatchId batch_id = 0;
  std::vector<BatchId> released;
  BatchSnapshot snapshot;  // filled when asked for
};

struct ReleaseResult {
  std::vector<BatchId> released;
  std::vector<BatchId> unknown;
};

struct AdvanceResult {
  int64_t step = 0;
  BatchSnapshot snapshot;  // filled when asked for
  FlashInferOutputs flashinfer;
};

class Engine {
 public:
  // Validates the options and allocates (and pre-touches) the KV cache.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      const EngineOptions& options);

  // A random id, new at every Create(): a changed id tells a client the
  // server restarted.
  const std::string& instance_id() const { return instance_id_; }
  const CacheConfig& cache_config() const { return cache_->config(); }
  const KvCache& cache() const { return *cache_; }
  EngineInfo Info() const;

  // Sessions. A session lapses `ttl` after its last call (OpenSession,
  // KeepAlive or any call made in it); from then on its calls fail with
  // NOT_FOUND and the next ExpireSessions() frees what it held.
  // ttl 0: options.default_session_ttl; at least 100 ms, at most
  // options.max_session_ttl. RESOURCE_EXHAUSTED past limits.max_sessions.
  absl::StatusOr<SessionInfo> OpenSession(absl::Duration ttl, std::string name);
  absl::Status KeepAlive(SessionId id);
  // Releases the session's batches and frees its sequences.
  absl::StatusOr<SessionEnd> CloseSession(SessionId id);
  // Ends every lapsed session; the server calls it periodically.
  std::vector<SessionEnd> ExpireSessions();

  // omit_appended_tables: leave out the block_table of each sequence whose
  // table this call only appended to (not created, no copy-on-write); a
  // scheduler that mirrors the tables appends new_blocks itself. A decode
  // step's reservation then costs its new blocks, not every row's table.
  absl::StatusOr<AllocateResult> AllocateBlocks(
      absl::Span<const SequenceRequest> requests, const Caller& caller = {},
      bool omit_appended_tables = false);
  absl::StatusOr<FreeResult> FreeSequences(absl::Span<const SeqId> ids,
                                           const Caller& caller = {});

  // Whether AllocateBlocks(requests) could be served now (OK), after other
  // sequences free blocks (LATER: it would leave fewer than the watermark
  // available), or never (NEVER: more than the whole pool, or past
  // max_seq_len). Changes nothing. `*needed` gets the blocks it would take.
  absl::StatusOr<Admission> CanAllocate(
      absl::Span<const SequenceRequest> requests, int64_t* needed) const;

  // The child shares all of the parent's blocks (parallel sampling, beam
  // search); the first write into a shared partial block copies it.
  // All children or none are created; each gets the parent's table.
  absl::StatusOr<std::vector<SequenceBlocks>> ForkSequence(
      SeqId parent, absl::Span<const SeqId> children,
      const Caller& caller = {});

  // Moves sequences' blocks to the host tier and back (whole-block copies).
  // Batches with a row on a swapped-out sequence become stale.
  absl::StatusOr<SwapOutcome> SwapOut(absl::Span<const SeqId> ids,
                                      const Caller& caller = {});
  absl::StatusOr<SwapOutcome> SwapIn(absl::Span<const SeqId> ids,
                                     const Caller& caller = {});

  // Forgets every cached block hash (their blocks become free when
  // unreferenced). Emits AllBlocksCleared.
  void ResetPrefixCache();

  BlockStats Stats() const;

  // KV events from `from` on (see EventLog::Read).
  std::vector<KvEvent> ReadEvents(int64_t from, size_t max_events,
                                  absl::Duration timeout, int64_t* missed) {
    return events_.Read(from, max_events, timeout, missed);
  }
  int64_t next_event_seq_no() const { return events_.next_seq_no(); }

  // Creates a batch; then, only if that succeeded, releases `release`
  // (unknown ids there are INVALID_ARGUMENT, checked first).
  absl::StatusOr<CreateBatchResult> CreateBatch(
      const BatchSpec& spec, absl::Span<const BatchId> release,
      bool want_tensors, const Caller& caller = {});
  absl::StatusOr<BatchSnapshot> GetBatch(BatchId id, const Caller& caller = {});
  absl::StatusOr<ReleaseResult> ReleaseBatches(absl::Span<const BatchId> ids,
                                               const Caller& caller = {});

  // Server-held AdvanceStep: advances the batch and keeps its sequences'
  // token counts in step.
  //
  // Exactly once: with in.step != 0 the call must name the step it takes
  // (the batch's step() + 1). A retry of the step just taken, with the same
  // inputs and options, returns that step's result again without advancing;
  // any other step number is FAILED_PRECONDITION (a skipped step, an older
  // one, or a retry with different inputs), and changes nothing.
  absl::StatusOr<AdvanceResult> AdvanceStep(BatchId id, const AdvanceInput& in,
                                            bool want_tensors, bool flashinfer,
                                            const Caller& caller = {});

  // Explicit AdvanceStep: the op on caller-owned tensors, with block ids
  // checked against this pool. Touches no engine state (needs no lock).
  absl::Status AdvanceStepExplicit(AdvanceStepArgs args, StepState* state,
                                   FlashInferOutputs* flashinfer) const;

  // PagedAttention for one layer of a server-held batch: writes the step's
  // K/V at the batch's slot_mapping (reshape_and_cache), then attends every
  // real row over its context (padding rows get zeros). FAILED_PRECONDITION
  // for a stale batch or a slot in a block another sequence shares. The
  // call sees the batch as it was when it began: control calls that come
  // while its kernel runs (AdvanceStep, FreeSequences, ...) change the
  // batch for later calls, not for this one.
  absl::StatusOr<Tensor> PagedAttention(BatchId id, const AttentionRequest& req,
                                        const Caller& caller = {});
  // The op with the caller's rows and slots (block ids checked against the
  // pool only, as explicit AdvanceStep).
  absl::StatusOr<Tensor> PagedAttentionExplicit(
      const AttentionRequest& req, const AttentionRows& rows,
      absl::Span<const int64_t> slots);

  // Audits the invariants (for tests): every block free or owned with the
  // right reference count, every batch row mirroring its sequence.
  absl::Status CheckInvariants() const;

 private:
  Engine(const EngineOptions& options, std::unique_ptr<KvCache> cache,
         std::unique_ptr<KvCache> host_cache);

  absl::StatusOr<BatchSnapshot> Snapshot(const Batch& b) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseLocked(BatchId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SyncBatches(const Sequence& seq, SeqId id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkStale(const std::vector<BatchId>& batches, SeqId id,
                 std::vector<BatchId>* stale)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  BlockStats StatsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Validates, writes the step's K/V at `slots`, and pins the blocks the
  // kernel will read into *pinned (nothing written or pinned on error).
  absl::Status PrepareAttentionLocked(const AttentionRequest& req,
                                      const AttentionRows& rows,
                                      absl::Span<const int64_t> slots,
                                      std::vector<BlockId>* pinned)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(attention_mu_, mu_);
  // Runs the kernel on rows whose blocks PrepareAttentionLocked pinned,
  // without mu_, then unpins them.
  absl::StatusOr<Tensor> AttendPinned(const AttentionRequest& req,
                                      const AttentionRows& rows,
                                      const std::vector<BlockId>& pinned)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(attention_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits (mu_ released meanwhile) until no block an attention call in
  // flight reads is unowned, so that an allocation may take any free block;
  // with `once`, for one wake-up at most (the caller checks again).
  void WaitForPinsLocked(bool once) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<SwapOutcome> Swap(absl::Span<const SeqId> ids, bool out,
                                   const Caller& caller);

  struct Session {
    std::string name;
    absl::Duration ttl;
    absl::Time deadline;
    absl::flat_hash_set<SeqId> seqs;
    absl::flat_hash_set<BatchId> batches;
  };
  // What the last numbered AdvanceStep of a batch took and gave, to answer
  // its retry.
  struct StepRecord {
    AdvanceInput input;  // shares the caller's (immutable) tensors
    bool want_tensors = false;
    bool flashinfer = false;
    AdvanceResult result;
  };

  absl::Time Now() const { return clock_ ? clock_() : absl::Now(); }
  // OK for no session; NOT_FOUND for an unknown or lapsed one; else renews
  // it.
  absl::Status UseSessionLocked(const Caller& caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PERMISSION_DENIED unless the object belongs to the caller's session.
  // `name()` names the object in the error; it runs only for a refusal, so
  // that a per-row check costs no formatting on the common path.
  template <typename NameFn>
  static absl::Status CheckOwner(SessionId owner, const Caller& caller,
                                 const NameFn& name) {
    if (owner == caller.session) return absl::OkStatus();
    return NotOwnerError(owner, name());
  }
  static absl::Status NotOwnerError(SessionId owner, absl::string_view what);
  // CheckOwner for the sequence `id`, named field[i]; OK when there is no
  // such sequence (each method treats unknown ids its own way).
  absl::Status CheckSeqOwnerLocked(SeqId id, const Caller& caller,
                                   absl::string_view field, size_t i) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UseSessionLocked, then CheckSeqOwnerLocked for every id of a request's
  // `seq_ids`.
  absl::Status AdmitSeqIdsLocked(absl::Span<const SeqId> ids,
                                 const Caller& caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finds the batch and checks that the caller may use it.
  absl::StatusOr<Batch*> FindBatchLocked(BatchId id, const Caller& caller) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adopts a sequence created by the caller into its session.
  void AdoptSeqLocked(SeqId id, const Caller& caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SessionEnd EndSessionLocked(SessionId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string instance_id_;
  const EngineLimits limits_;
  const double watermark_;
  Device* const device_;
  const std::unique_ptr<KvCache> cache_;
  const std::unique_ptr<KvCache> host_cache_;  // null without a host tier
  // One attention call at a time (see the class comment); taken before mu_.
  Mutex attention_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  const std::unique_ptr<ThreadPool> pool_ ABSL_PT_GUARDED_BY(attention_mu_);
  const AttentionParams::Prefetch attention_prefetch_;  // never kAuto
  const std::function<absl::Time()> clock_;
  const std::function<void()> attention_kernel_hook_;
  const absl::Duration default_session_ttl_;
  const absl::Duration max_session_ttl_;
  EventLog events_;  // own lock; appended to under mu_

  mutable Mutex mu_;
  // Notified when an attention call unpins its blocks (WaitForPinsLocked).
  std::condition_variable pins_released_;
  BlockAllocator allocator_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<BlockAllocator> host_allocator_ ABSL_GUARDED_BY(mu_);
  SequenceManager seqs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<BatchId, std::unique_ptr<Batch>> batches_
      ABSL_GUARDED_BY(mu_);
  BatchId next_batch_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<BatchId, StepRecord> last_steps_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  int64_t sessions_expired_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pin_waits_ ABSL_GUARDED_BY(mu_) = 0;  // EngineInfo::pin_waits
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_ENGINE_H_
