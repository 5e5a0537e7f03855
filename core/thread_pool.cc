#include "core/thread_pool.h"

#include <chrono>

namespace kvstep {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunItems() {
  for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) {
    (*fn_)(i);
  }
}

void ThreadPool::WorkerLoop() {
  int64_t seen = 0;
  while (true) {
    {
      MutexLock lock(&mu_);
      while (!stop_ && generation_ == seen) {
        mu_.WaitUntil(
            cv_, std::chrono::steady_clock::now() + std::chrono::seconds(1));
      }
      if (stop_) return;
      seen = generation_;
      ++busy_;
    }
    RunItems();
    {
      MutexLock lock(&mu_);
      --busy_;
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
  }
  cv_.notify_all();
  RunItems();
  // Workers that woke for this generation finish their items; one that has
  // not woken yet finds no item left and only passes through.
  MutexLock lock(&mu_);
  while (busy_ > 0 || next_.load() < n_) {
    mu_.WaitUntil(done_cv_, std::chrono::steady_clock::now() +
                                std::chrono::milliseconds(10));
  }
}

}  // namespace kvstep
