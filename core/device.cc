#include "core/device.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_format.h"

namespace kvstep {
namespace {

constexpr size_t kSmallAlign = 64;
constexpr size_t kHugePage = size_t{2} << 20;

class CpuAllocation final : public Allocation {
 public:
  using Allocation::Allocation;
  ~CpuAllocation() override { std::free(data()); }
};

class CpuDeviceImpl final : public Device {
 public:
  DeviceType type() const override { return DeviceType::kCpu; }
  std::string name() const override { return "cpu"; }
  bool host_accessible() const override { return true; }

  absl::StatusOr<std::shared_ptr<Allocation>> Allocate(size_t bytes) override {
    const size_t align = bytes >= kHugePage ? kHugePage : kSmallAlign;
    // aligned_alloc wants a size that is a multiple of the alignment; a zero
    // size still gets a real (freeable) pointer.
    const size_t rounded =
        bytes == 0 ? align : (bytes + align - 1) / align * align;
    if (rounded < bytes) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("cpu: cannot allocate %d bytes", bytes));
    }
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("cpu: out of memory allocating %d bytes", bytes));
    }
    if (align == kHugePage) {
      // Best effort: THP is in madvise mode here; failure only costs speed.
      (void)madvise(p, rounded, MADV_HUGEPAGE);
    }
    std::memset(p, 0, rounded);  // zero-fill and pre-touch every page
    return std::shared_ptr<Allocation>(new CpuAllocation(this, p, bytes));
  }

  void Copy(void* dst, const void* src, size_t bytes) override {
    if (bytes != 0) std::memmove(dst, src, bytes);
  }
  void CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    Copy(host_dst, src, bytes);
  }
  void CopyFromHost(void* dst, const void* host_src, size_t bytes) override {
    Copy(dst, host_src, bytes);
  }
};

}  // namespace

Device* CpuDevice() {
  static Device* const device = new CpuDeviceImpl();
  return device;
}

}  // namespace kvstep
