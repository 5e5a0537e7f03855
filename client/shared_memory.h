// SharedMemory: a region a client on the server's host shares with it, for
// PagedAttention's tensors (RegisterSharedMemory in the proto).
//
// A memfd sealed with F_SEAL_SHRINK and F_SEAL_GROW (its size is fixed, so
// the server's mapping can never reach past its end), mapped here. The
// server opens it by path(), /proc/<this pid>/fd/<fd>, which it can only
// do on the same host, as the same user (or with the right to ptrace this
// process), and while this object lives.
//
//   auto shm = kvstep::SharedMemory::Create(64 << 20);
//   auto reg = client->RegisterSharedMemory(shm->path(), shm->size());
//   // Write the query at offset 0 (shm->data()), then in the request:
//   req.mutable_query()->mutable_shm()->set_region_id(reg->region_id());
//
// Not thread-safe: one owner writes it between calls.
#ifndef KVSTEP_CLIENT_SHARED_MEMORY_H_
#define KVSTEP_CLIENT_SHARED_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvstep {

class SharedMemory {
 public:
  // A zero-filled region of `size` bytes (at least 1).
  static absl::StatusOr<std::unique_ptr<SharedMemory>> Create(int64_t size);
  ~SharedMemory();
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  char* data() const { return data_; }
  int64_t size() const { return size_; }
  // What RegisterSharedMemory's path takes.
  const std::string& path() const { return path_; }

 private:
  SharedMemory(int fd, char* data, int64_t size);
  const int fd_;
  char* const data_;
  const int64_t size_;
  const std::string path_;
};

}  // namespace kvstep

#endif  // KVSTEP_CLIENT_SHARED_MEMORY_H_
