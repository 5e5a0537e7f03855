#include "service/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"

namespace kvstep {

SharedMemoryRegion::~SharedMemoryRegion() {
  munmap(base_, static_cast<size_t>(size_));
}

absl::Status SharedMemoryRegion::CheckRange(int64_t offset, int64_t num_bytes,
                                            absl::string_view field) const {
  if (offset < 0 || num_bytes < 0 || offset > size_ ||
      num_bytes > size_ - offset) {
    return absl::OutOfRangeError(absl::StrFormat(
        "%s: bytes [%d, %d + %d) are not inside the region's %d", field, offset,
        offset, num_bytes, size_));
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::CheckRoomLocked(int64_t size) const {
  if (static_cast<int64_t>(regions_.size()) >= limits_.max_regions ||
      mapped_bytes_ + size > limits_.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%d regions of %d bytes are registered; the limits are %d regions "
        "and %d bytes",
        regions_.size(), mapped_bytes_, limits_.max_regions,
        limits_.max_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SharedMemoryRegistry::Register(const std::string& path,
                                                        int64_t size,
                                                        SessionId owner) {
  if (path.empty()) return absl::InvalidArgumentError("path is empty");
  if (path.size() > 4096 || path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        "path must be at most 4096 bytes, with no NUL");
  }
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("size must be at least 1, got %d", size));
  }
  if (size > limits_.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "size %d is above the server's shared-memory limit of %d bytes", size,
        limits_.max_bytes));
  }
  const std::string shown = absl::CHexEscape(path.substr(0, 256));
  // Opening some files does something (a device's open, a FIFO's wait):
  // the path is first opened with O_PATH, which opens nothing, and only a
  // regular file is then opened for reading and writing, through that
  // descriptor (memfds are regular files).
  const int path_fd = open(path.c_str(), O_PATH | O_CLOEXEC);
  if (path_fd < 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "path '%s' cannot be opened: %s", shown, std::strerror(errno)));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { close(fd); }
  } path_closer{path_fd};
  struct stat st;
  if (fstat(path_fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("path '%s' is not a regular file (a memfd is)", shown));
  }
  const int fd = open(absl::StrFormat("/proc/self/fd/%d", path_fd).c_str(),
                      O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("path '%s' cannot be opened read-write: %s", shown,
                        std::strerror(errno)));
  }
  FdCloser closer{fd};
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "path '%s' is not a memfd sealed with F_SEAL_SHRINK (%s): a file "
        "that can shrink under the server's mapping is refused",
        shown, seals < 0 ? std::strerror(errno) : "no such seal"));
  }
  if (fstat(fd, &st) != 0 || st.st_size < size) {
    return absl::FailedPreconditionError(
        absl::StrFormat("path '%s' holds %d bytes, fewer than size %d", shown,
                        static_cast<int64_t>(st.st_size), size));
  }
  {
    // Limits first, so that a refused call maps nothing.
    MutexLock lock(&mu_);
    if (absl::Status s = CheckRoomLocked(size); !s.ok()) return s;
  }
  void* base = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE,
                    MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "path '%s' cannot be mapped: %s", shown, std::strerror(errno)));
  }
  auto region = std::make_shared<const SharedMemoryRegion>(base, size, owner);
  MutexLock lock(&mu_);
  // Checked again: another Register may have taken the room meanwhile.
  if (absl::Status s = CheckRoomLocked(size); !s.ok()) return s;
  const uint64_t id = next_id_++;
  regions_.emplace(id, std::move(region));
  mapped_bytes_ += size;
  return id;
}

absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>>
SharedMemoryRegistry::Find(uint64_t id, SessionId caller,
                           absl::string_view field) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "%s: shared-memory region %d is not registered", field, id));
  }
  if (it->second->owner() != caller) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: shared-memory region %d belongs to %s", field, id,
        it->second->owner() == 0
            ? std::string("no session")
            : absl::StrFormat("session %d", it->second->owner())));
  }
  return it->second;
}

absl::Status SharedMemoryRegistry::Unregister(uint64_t id, SessionId caller) {
  std::shared_ptr<const SharedMemoryRegion> gone;  // unmapped unlocked
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrFormat("region_id %d is not registered", id));
  }
  if (it->second->owner() != caller) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "region_id %d belongs to another session than the caller's", id));
  }
  mapped_bytes_ -= it->second->size();
  gone = std::move(it->second);
  regions_.erase(it);
  return absl::OkStatus();
}

int64_t SharedMemoryRegistry::EndSession(SessionId session) {
  std::vector<std::shared_ptr<const SharedMemoryRegion>> gone;
  MutexLock lock(&mu_);
  for (auto it = regions_.begin(); it != regions_.end();) {
    if (it->second->owner() == session) {
      mapped_bytes_ -= it->second->size();
      gone.push_back(std::move(it->second));
      regions_.erase(it++);
    } else {
      ++it;
    }
  }
  return static_cast<int64_t>(gone.size());
}

int64_t SharedMemoryRegistry::num_regions() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(regions_.size());
}

int64_t SharedMemoryRegistry::mapped_bytes() const {
  MutexLock lock(&mu_);
  return mapped_bytes_;
}

}  // namespace kvstep
