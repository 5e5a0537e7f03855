// ThreadPool: a fixed set of worker threads for data-parallel kernels.
//
// ParallelFor(n, fn) runs fn(i) for i in [0, n) on the workers and the
// calling thread, and returns when all are done. Work is claimed with an
// atomic counter, so uneven items balance themselves. A call with one item,
// or a pool of one thread, runs inline: waking a thread on the other core
// costs 10-200 us here, more than a small kernel. Between calls, workers
// poll for the next one for a while before they sleep, and so does the
// caller for its workers at the end of a call (kDefaultIdlePoll,
// kDefaultFinishPoll). Thread-safe; concurrent ParallelFor calls are
// serialized.
#ifndef KVSTEP_CORE_THREAD_POOL_H_
#define KVSTEP_CORE_THREAD_POOL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "core/mutex.h"

namespace kvstep {

class ThreadPool {
 public:
  // How long ParallelFor's caller, done with its own items, polls for
  // workers still on their last ones before it sleeps until they notify.
  // A sleeping caller's wake costs ~30 us on these 2-vCPU VMs, more when
  // the hypervisor has parked the idle vCPU: about what a second thread
  // saves on a 4 MiB attention call (docs/attention.md, session 15). A
  // worker's last item usually ends well within the default; past it the
  // caller sleeps, having spent at most this much of a core that had
  // nothing else of the call to do. 0: sleep at once (the pool before
  // session 15; attention_bench --pool_poll_us=0).
  static constexpr std::chrono::microseconds kDefaultFinishPoll{200};

  // How long a worker, done with a job, polls for the next one before it
  // sleeps on cv_. A worker that has slept through a millisecond or more
  // while the other vCPU ran wakes 95-200 us after the notify on these
  // VMs (10-15 us after shorter or idle gaps): longer than a whole 4 MiB
  // attention call, whose two threads then took as long as one. Polling
  // keeps it running, so the next job starts on both threads at once; on
  // the Zen 5 of session 15, 4 MiB bf16 calls 1 ms apart took 0.5x the
  // time (docs/attention.md). 2 ms covers the gap between a decode step's
  // layer-by-layer calls; a pool idle longer than that sleeps and costs
  // nothing. The poll yields its CPU every 50 us, so other threads (gRPC's)
  // are not kept waiting for a scheduler tick. 0: sleep at once.
  static constexpr std::chrono::microseconds kDefaultIdlePoll{2000};

  // `num_threads` counts the calling thread: 1 means no workers.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  // How many ParallelFor calls have handed items to the workers (those of
  // n >= 2 on a pool with workers): for tests of who runs on the pool.
  int64_t jobs() const {
    MutexLock lock(&mu_);
    return generation_;
  }
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

  // See kDefaultFinishPoll; takes effect from the next ParallelFor.
  void set_finish_poll(std::chrono::microseconds poll) {
    finish_poll_.Set(poll);
  }
  std::chrono::microseconds finish_poll() const { return finish_poll_.Get(); }

  // See kDefaultIdlePoll. Takes effect from a worker's next check, so a
  // change reaches a worker that is polling now.
  void set_idle_poll(std::chrono::microseconds poll) { idle_poll_.Set(poll); }
  std::chrono::microseconds idle_poll() const { return idle_poll_.Get(); }

 private:
  void WorkerLoop();
  void RunItems();
  // Polls (see set_idle_poll) until the generation moves past `seen`, the
  // pool stops, or the poll's time is up.
  void PollForJob(int64_t seen) const;

  // A poll's length, read by polling threads while another may set it;
  // negative settings are taken as 0.
  class PollTime {
   public:
    explicit PollTime(std::chrono::microseconds initial) { Set(initial); }
    void Set(std::chrono::microseconds poll) {
      us_.store(std::max<int64_t>(poll.count(), 0), std::memory_order_relaxed);
    }
    std::chrono::microseconds Get() const {
      return std::chrono::microseconds(us_.load(std::memory_order_relaxed));
    }

   private:
    std::atomic<int64_t> us_{0};
  };

  PollTime finish_poll_{kDefaultFinishPoll};
  PollTime idle_poll_{kDefaultIdlePoll};
  Mutex call_mu_;  // one ParallelFor at a time
  mutable Mutex mu_;
  std::condition_variable cv_;       // workers wait for a generation
  std::condition_variable done_cv_;  // the caller waits for workers
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // The current job; written before a generation starts, read by workers
  // after they see it (ordered by mu_).
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  // busy_'s value, written with it under mu_, for the caller to poll
  // without the lock while a worker finishes (ParallelFor).
  std::atomic<int> busy_mirror_{0};
  // generation_ and stop_, written with them under mu_, for idle workers
  // to poll without the lock (PollForJob); mu_ alone decides.
  std::atomic<int64_t> generation_mirror_{0};
  std::atomic<bool> stop_mirror_{false};
  std::vector<std::thread> workers_;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_THREAD_POOL_H_
