#include "core/kv_events.h"

#include <utility>

#include "absl/time/clock.h"

namespace kvstep {

void EventLog::Append(KvEvent event) {
  {
    MutexLock lock(&mu_);
    event.seq_no = next_++;
    ring_.push_back(std::move(event));
    if (ring_.size() > capacity_) ring_.pop_front();
  }
  cv_.notify_all();
}

int64_t EventLog::next_seq_no() const {
  MutexLock lock(&mu_);
  return next_;
}

std::vector<KvEvent> EventLog::Read(int64_t from, size_t max_events,
                                    absl::Duration timeout, int64_t* missed) {
  MutexLock lock(&mu_);
  const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
  while (next_ <= from) {
    if (mu_.WaitUntil(cv_, deadline) == std::cv_status::timeout) break;
  }
  std::vector<KvEvent> out;
  const int64_t first = ring_.empty() ? next_ : ring_.front().seq_no;
  *missed = from < first ? first - from : 0;
  for (const KvEvent& e : ring_) {
    if (e.seq_no < from) continue;
    if (out.size() >= max_events) break;
    out.push_back(e);
  }
  return out;
}

}  // namespace kvstep
