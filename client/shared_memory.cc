#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace kvstep {

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(
    int64_t size) {
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("size must be at least 1, got %d", size));
  }
  const int fd = memfd_create("kvstep", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrFormat("memfd_create: %s", std::strerror(errno)));
  }
  auto fail = [fd](const char* what) {
    const int e = errno;
    close(fd);
    return absl::InternalError(
        absl::StrFormat("%s: %s", what, std::strerror(e)));
  };
  if (ftruncate(fd, size) != 0) return fail("ftruncate");
  // The server refuses a region that could shrink; growing would not harm
  // it, but a fixed size is simpler to reason about, and F_SEAL_SEAL keeps
  // the seals as they are.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail("fcntl(F_ADD_SEALS)");
  }
  void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE,
                 MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail("mmap");
  return std::unique_ptr<SharedMemory>(
      new SharedMemory(fd, static_cast<char*>(p), size));
}

SharedMemory::SharedMemory(int fd, char* data, int64_t size)
    : fd_(fd),
      data_(data),
      size_(size),
      path_(absl::StrFormat("/proc/%d/fd/%d", getpid(), fd)) {}

SharedMemory::~SharedMemory() {
  munmap(data_, static_cast<size_t>(size_));
  close(fd_);
}

}  // namespace kvstep
