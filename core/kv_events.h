// KV cache events (what vLLM's KV events give routers such as llm-d and
// Dynamo): which block contents became reusable, which were dropped, and
// when the whole prefix cache was cleared.
//
// EventLog keeps the most recent events in a bounded ring with increasing
// sequence numbers; subscribers read from a cursor and learn how many events
// they missed if they fell behind. Thread-safe.
#ifndef KVSTEP_CORE_KV_EVENTS_H_
#define KVSTEP_CORE_KV_EVENTS_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/block_hash.h"
#include "core/mutex.h"

namespace kvstep {

struct KvEvent {
  enum class Type { kBlockStored, kBlockRemoved, kAllBlocksCleared };
  Type type = Type::kBlockStored;
  int64_t seq_no = 0;  // set by EventLog
  std::vector<BlockHash> block_hashes;
  // kBlockStored only.
  std::optional<BlockHash> parent_hash;
  std::vector<int64_t> token_ids;
  int64_t block_size = 0;
  std::string extra_key;  // adapter id and cache salt the hash covers
};

class EventLog {
 public:
  explicit EventLog(size_t capacity = 65536) : capacity_(capacity) {}

  // Stamps the event with the next sequence number and keeps it.
  void Append(KvEvent event);

  // Events with seq_no >= `from`, waiting up to `timeout` for the first one.
  // `*missed` receives how many such events were already dropped from the
  // ring. Returns at most `max_events`.
  std::vector<KvEvent> Read(int64_t from, size_t max_events,
                            absl::Duration timeout, int64_t* missed);

  // The seq_no the next event will get.
  int64_t next_seq_no() const;

 private:
  const size_t capacity_;
  mutable Mutex mu_;
  std::condition_variable cv_;
  std::deque<KvEvent> ring_ ABSL_GUARDED_BY(mu_);
  int64_t next_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_KV_EVENTS_H_
