// ThreadPool: a fixed set of worker threads for data-parallel kernels.
//
// ParallelFor(n, fn) runs fn(i) for i in [0, n) on the workers and the
// calling thread, and returns when all are done. Work is claimed with an
// atomic counter, so uneven items balance themselves. A call with one item,
// or a pool of one thread, runs inline: waking a thread on the other core
// costs ~30 us here, more than a small kernel. Thread-safe; concurrent
// ParallelFor calls are serialized.
#ifndef KVSTEP_CORE_THREAD_POOL_H_
#define KVSTEP_CORE_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "core/mutex.h"

namespace kvstep {

class ThreadPool {
 public:
  // `num_threads` counts the calling thread: 1 means no workers.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunItems();

  Mutex call_mu_;  // one ParallelFor at a time
  Mutex mu_;
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
  std::vector<std::thread> workers_;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_THREAD_POOL_H_
