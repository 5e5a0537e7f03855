// Mutex and MutexLock: std::mutex with clang thread-safety annotations.
//
// Why not absl::Mutex: Debian's libabsl is built without TSan annotations,
// so TSan cannot see absl::Mutex's happens-before edges and reports races
// between correctly locked sections. std::mutex is pthread underneath, which
// TSan intercepts; the annotations keep -Wthread-safety's proofs. Header-only
// so the client library can use it without linking core.
#ifndef KVSTEP_CORE_MUTEX_H_
#define KVSTEP_CORE_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace kvstep {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

  // Releases the mutex while waiting on `cv` until notified (spurious
  // wake-ups included) or `deadline`; holds it again on return.
  template <typename Clock, typename Duration>
  std::cv_status WaitUntil(
      std::condition_variable& cv,
      const std::chrono::time_point<Clock, Duration>& deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    const std::cv_status status = cv.wait_until(lock, deadline);
    lock.release();  // still held; ownership stays with the caller
    return status;
  }

 private:
  std::mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace kvstep

#endif  // KVSTEP_CORE_MUTEX_H_
