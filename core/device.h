// Devices own the memory that tensors live in.
//
// A Device hands out Allocations: zero-filled, already-touched memory that is
// freed when the last shared_ptr to it goes. Only the CPU device exists now;
// the interface is what a CUDA device will implement too (kernels check
// host_accessible() before dereferencing, and copies go through the device).
// Thread-safe: Allocate and the copy functions may be called concurrently.
#ifndef KVSTEP_CORE_DEVICE_H_
#define KVSTEP_CORE_DEVICE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvstep {

enum class DeviceType { kCpu, kCuda };

class Device;

// A block of device memory. Immutable handle; the bytes are mutable.
class Allocation {
 public:
  Allocation(Device* device, void* data, size_t size)
      : device_(device), data_(data), size_(size) {}
  virtual ~Allocation() = default;
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;

  Device* device() const { return device_; }
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  Device* const device_;
  void* const data_;
  const size_t size_;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual DeviceType type() const = 0;
  virtual std::string name() const = 0;
  // True when host code may dereference this device's pointers.
  virtual bool host_accessible() const = 0;

  // Returns `bytes` of zero-filled memory, aligned to at least 64 bytes,
  // with every page already touched: memory touched for the first time runs
  // ~10x slower than warm memory on these machines, so the cost is paid
  // here, once, not in the first steps. RESOURCE_EXHAUSTED when the memory
  // cannot be had. A request of 0 bytes returns a valid empty allocation.
  virtual absl::StatusOr<std::shared_ptr<Allocation>> Allocate(
      size_t bytes) = 0;

  // Copies within this device, and between it and host memory.
  virtual void Copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void CopyFromHost(void* dst, const void* host_src, size_t bytes) = 0;
};

// The process-wide CPU device: aligned host memory. Allocations of 2 MiB or
// more are 2 MiB aligned and advised to use transparent huge pages, which
// measured 10-15% faster for paged attention here.
Device* CpuDevice();

}  // namespace kvstep

#endif  // KVSTEP_CORE_DEVICE_H_
