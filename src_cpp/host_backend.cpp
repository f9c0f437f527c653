#include <cstdlib>
#include <cstring>
#include <new>

#include "copy_backend.h"
#include "errors.h"

namespace prefetch {
namespace {

constexpr size_t kHostAlignmentBytes = 256;  // matches the cache slot alignment

void* AlignedAlloc(size_t bytes, const char* what) {
  size_t rounded = (bytes + kHostAlignmentBytes - 1) / kHostAlignmentBytes *
                   kHostAlignmentBytes;
  if (rounded == 0) rounded = kHostAlignmentBytes;
  void* p = std::aligned_alloc(kHostAlignmentBytes, rounded);
  if (p == nullptr) {
    throw PrefetchError(ErrorKind::kOutOfMemory,
                        std::string("could not allocate ") +
                            std::to_string(bytes) + " bytes of " + what);
  }
  return p;
}

}  // namespace

void* HostBackend::AllocateHost(size_t bytes) {
  return AlignedAlloc(bytes, "host memory");
}

void HostBackend::FreeHost(void* ptr, size_t) noexcept { std::free(ptr); }

void* HostBackend::AllocateDevice(int, size_t bytes) {
  return AlignedAlloc(bytes, "cache arena");
}

void HostBackend::FreeDevice(int, void* ptr, size_t) noexcept {
  std::free(ptr);
}

CopyToken HostBackend::Copy(int, void* dst, const void* src, size_t bytes,
                            bool, bool) {
  std::memcpy(dst, src, bytes);
  return kTokenDone;
}

std::unique_ptr<CopyBackend> MakeBackend(const std::string& name,
                                         int host_device_count) {
  if (name == "host") return std::make_unique<HostBackend>(host_device_count);
  if (name == "cuda") return MakeCudaBackend();
  if (name == "auto") {
    try {
      return MakeCudaBackend();
    } catch (const PrefetchError& e) {
      if (e.kind() != ErrorKind::kUnavailable) throw;
      return std::make_unique<HostBackend>(host_device_count);
    }
  }
  throw PrefetchError(ErrorKind::kInvalidArgument,
                      "backend must be 'host', 'cuda' or 'auto', got '" +
                          name + "'");
}

}  // namespace prefetch
