// SharedMemoryRegistry: the shared-memory regions clients on the same host
// registered (RegisterSharedMemory), mapped into the server, by id.
//
// A region is a client's memfd sealed against shrinking (F_SEAL_SHRINK),
// which the server opens by a path (/proc/<client pid>/fd/<fd>) and maps
// whole. The seal is the safety contract: a mapped file that shrank would
// turn the server's next access past its new end into SIGBUS, so a file
// that could shrink is refused. The client may still write the region
// while the server reads it; the server copies inputs out before using
// them and writes outputs once, so such a race gives the client torn
// bytes, never the server undefined state.
//
// Regions belong to the session that registered them (0: none), as
// sequences and batches do: only calls in that session may use or
// unregister them, and EndSession unregisters them all. A region in use by
// a call stays mapped until the call lets go of it (shared_ptr).
// Thread-safe.
#ifndef KVSTEP_SERVICE_SHARED_MEMORY_H_
#define KVSTEP_SERVICE_SHARED_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/engine.h"
#include "core/mutex.h"

namespace kvstep {

class SharedMemoryRegion {
 public:
  SharedMemoryRegion(void* base, int64_t size, SessionId owner)
      : base_(static_cast<char*>(base)), size_(size), owner_(owner) {}
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  char* base() const { return base_; }
  int64_t size() const { return size_; }
  SessionId owner() const { return owner_; }

  // OUT_OF_RANGE, naming `field`, unless [offset, offset + num_bytes) lies
  // inside the region.
  absl::Status CheckRange(int64_t offset, int64_t num_bytes,
                          absl::string_view field) const;

 private:
  char* const base_;
  const int64_t size_;
  const SessionId owner_;
};

struct SharedMemoryLimits {
  int64_t max_regions = 64;
  int64_t max_bytes = int64_t{16} << 30;  // mapped at once, all regions
};

class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(SharedMemoryLimits limits = {})
      : limits_(limits) {}

  // Opens and maps `path`'s first `size` bytes for `owner`. INVALID_ARGUMENT
  // for an empty path or a size under 1; FAILED_PRECONDITION for a file
  // that cannot be opened, is not a memfd sealed with F_SEAL_SHRINK, or is
  // smaller than `size`; RESOURCE_EXHAUSTED past the limits.
  absl::StatusOr<uint64_t> Register(const std::string& path, int64_t size,
                                    SessionId owner);
  // NOT_FOUND for an unknown id; PERMISSION_DENIED for another session's.
  absl::Status Unregister(uint64_t id, SessionId caller);
  // The region, held for the caller's use; errors as Unregister's, naming
  // `field`.
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> Find(
      uint64_t id, SessionId caller, absl::string_view field) const;
  // Unregisters every region of `session` (closed or lapsed); how many.
  int64_t EndSession(SessionId session);

  int64_t num_regions() const;
  int64_t mapped_bytes() const;

 private:
  // RESOURCE_EXHAUSTED unless one more region of `size` bytes fits the
  // limits.
  absl::Status CheckRoomLocked(int64_t size) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SharedMemoryLimits limits_;
  mutable Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<const SharedMemoryRegion>>
      regions_ ABSL_GUARDED_BY(mu_);
  int64_t mapped_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvstep

#endif  // KVSTEP_SERVICE_SHARED_MEMORY_H_
