#include "core/thread_pool.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvstep {
namespace {

// Every item runs exactly once, and its plain (non-atomic) writes are
// visible to the caller when ParallelFor returns, over many calls in a
// row: the caller's poll for a finishing worker must never let it return
// early or miss a worker's item. Under TSan (CI) an early return shows as
// a race on `hits` as well as a wrong count.
TEST(ThreadPool, EveryItemOnceAndVisibleAfterReturn) {
  for (const auto poll :
       {ThreadPool::kDefaultFinishPoll, std::chrono::microseconds(0)}) {
    ThreadPool pool(2);
    pool.set_finish_poll(poll);
    pool.set_idle_poll(poll == std::chrono::microseconds(0)
                           ? poll
                           : ThreadPool::kDefaultIdlePoll);
    ASSERT_EQ(pool.num_threads(), 2);
    for (int call = 0; call < 2000; ++call) {
      const int64_t n = 1 + call % 37;
      std::vector<int> hits(static_cast<size_t>(n), 0);
      pool.ParallelFor(n, [&](int64_t i) {
        // Uneven items, so either thread may be the last one busy.
        if ((i + call) % 5 == 0) {
          volatile int64_t spin = 0;
          for (int k = 0; k < 2000; ++k) spin = spin + k;
        }
        ++hits[static_cast<size_t>(i)];
      });
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(hits[static_cast<size_t>(i)], 1)
            << "call " << call << " item " << i << " poll " << poll.count();
      }
    }
  }
}

// A worker whose last item outlasts the caller's poll (ThreadPool::
// kDefaultFinishPoll, 200 us): the caller must fall back to waiting under the
// lock, not return. The caller's item waits (up to a second) until the worker
// has taken the other one, so that the slow item is the worker's.
TEST(ThreadPool, WaitsForAWorkerPastThePoll) {
  ThreadPool pool(2);
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<int> hits(2, 0);
  int worker_calls = 0;
  for (int call = 0; call < 20; ++call) {
    hits.assign(2, 0);
    std::atomic<bool> worker_started{false};
    pool.ParallelFor(2, [&](int64_t i) {
      if (std::this_thread::get_id() == caller) {
        const auto give_up =
            std::chrono::steady_clock::now() + std::chrono::seconds(1);
        while (!worker_started.load() &&
               std::chrono::steady_clock::now() < give_up) {
          std::this_thread::yield();
        }
      } else {
        worker_started.store(true);
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      ++hits[static_cast<size_t>(i)];
    });
    EXPECT_EQ(hits[0], 1) << "call " << call;
    EXPECT_EQ(hits[1], 1) << "call " << call;
    if (worker_started.load()) ++worker_calls;
  }
  // The point of the test is a slow worker item; on a machine where the
  // worker never got one, it would prove nothing.
  EXPECT_GT(worker_calls, 10);
}

// A worker polling for the next job (a minute's idle poll) still stops
// when the pool is destroyed: the poll watches the stop flag too. The bound
// is a hang check, far above any scheduling delay, not a speed claim.
TEST(ThreadPool, DestructionEndsAnIdlePoll) {
  const auto start = std::chrono::steady_clock::now();
  {
    ThreadPool pool(2);
    pool.set_idle_poll(std::chrono::seconds(60));
    EXPECT_EQ(pool.idle_poll(), std::chrono::seconds(60));
    int ran = 0;
    for (int call = 0; call < 3; ++call) {
      std::atomic<int> items{0};
      pool.ParallelFor(4, [&](int64_t) { items.fetch_add(1); });
      ran += items.load();
    }
    EXPECT_EQ(ran, 12);
    pool.set_idle_poll(std::chrono::microseconds(-5));
    EXPECT_EQ(pool.idle_poll(), std::chrono::microseconds(0));
    pool.set_idle_poll(std::chrono::seconds(60));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

TEST(ThreadPool, OneThreadAndEmptyCallsRunInline) {
  ThreadPool pool(1);
  const std::thread::id self = std::this_thread::get_id();
  int ran = 0;
  pool.ParallelFor(5, [&](int64_t) {
    EXPECT_EQ(std::this_thread::get_id(), self);
    ++ran;
  });
  EXPECT_EQ(ran, 5);
  pool.ParallelFor(0, [&](int64_t) { ++ran; });
  EXPECT_EQ(ran, 5);
}

}  // namespace
}  // namespace kvstep
