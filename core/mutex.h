// Mutex and MutexLock: std::mutex with clang thread-safety annotations.
//
// Why not absl::Mutex: Debian's libabsl is built without TSan annotations,
// so TSan cannot see absl::Mutex's happens-before edges and reports races
// between correctly locked sections. std::mutex is pthread underneath, which
// TSan intercepts; the annotations keep -Wthread-safety's proofs. Header-only
// so the client library can use it without linking core.
#ifndef KVSTEP_CORE_MUTEX_H_
#define KVSTEP_CORE_MUTEX_H_

#include <mutex>

#include "absl/base/thread_annotations.h"

namespace kvstep {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

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
