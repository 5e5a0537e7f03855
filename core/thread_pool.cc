#include "core/thread_pool.h"

#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvstep {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    stop_mirror_.store(true, std::memory_order_relaxed);
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunItems() {
  for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) {
    (*fn_)(i);
  }
}

void ThreadPool::PollForJob(int64_t seen) const {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Clock::time_point yielded = start;
  while (generation_mirror_.load(std::memory_order_relaxed) == seen &&
         !stop_mirror_.load(std::memory_order_relaxed)) {
    for (int i = 0; i < 16; ++i) CpuRelax();
    const Clock::time_point now = Clock::now();
    if (now - start >= idle_poll()) return;
    // Other threads of this CPU (gRPC's, the server's) get it at once: a
    // poller that only spun would hold it until the scheduler's tick.
    if (now - yielded >= std::chrono::microseconds(50)) {
      std::this_thread::yield();
      yielded = now;
    }
  }
}

void ThreadPool::WorkerLoop() {
  int64_t seen = 0;
  while (true) {
    PollForJob(seen);
    {
      MutexLock lock(&mu_);
      while (!stop_ && generation_ == seen) {
        mu_.WaitUntil(
            cv_, std::chrono::steady_clock::now() + std::chrono::seconds(1));
      }
      if (stop_) return;
      seen = generation_;
      ++busy_;
      busy_mirror_.store(busy_, std::memory_order_relaxed);
    }
    RunItems();
    {
      MutexLock lock(&mu_);
      --busy_;
      busy_mirror_.store(busy_, std::memory_order_relaxed);
    }
    done_cv_.notify_all();
  }
}

void ThreadPool::ParallelFor(int64_t n,
                             const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  MutexLock call(&call_mu_);
  {
    MutexLock lock(&mu_);
    // A worker that woke late for the previous job may still be passing
    // through it; the job may only change once none is.
    while (busy_ > 0) {
      mu_.WaitUntil(done_cv_, std::chrono::steady_clock::now() +
                                  std::chrono::milliseconds(10));
    }
    fn_ = &fn;
    n_ = n;
    next_.store(0);
    ++generation_;
    generation_mirror_.store(generation_, std::memory_order_relaxed);
  }
  cv_.notify_all();
  RunItems();
  // Workers that woke for this generation finish their items; one that has
  // not woken yet finds no item left and only passes through. Every item is
  // claimed by now, so only a busy worker is waited for: polled first (see
  // kDefaultFinishPoll), then under mu_, which alone decides (the mirror only
  // saves a sleep, and mu_ orders the workers' writes before the return).
  const auto poll_end = std::chrono::steady_clock::now() + finish_poll();
  while (busy_mirror_.load(std::memory_order_relaxed) > 0 &&
         std::chrono::steady_clock::now() < poll_end) {
    for (int i = 0; i < 16; ++i) CpuRelax();
  }
  MutexLock lock(&mu_);
  while (busy_ > 0 || next_.load() < n_) {
    mu_.WaitUntil(done_cv_, std::chrono::steady_clock::now() +
                                std::chrono::milliseconds(10));
  }
}

}  // namespace kvstep
