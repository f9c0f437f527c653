#include <cstdlib>
#include <cstring>
#include <chrono>
#include <new>
#include <thread>

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
                            bool, int, bool) {
  std::memcpy(dst, src, bytes);
  return kTokenDone;
}

void HostBackend::Fill(int, void* dst, size_t bytes, uint8_t value) {
  std::memset(dst, value, bytes);
}

namespace {

// True when `call` (1-based) is a multiple of n > 0.
bool NthCall(int64_t n, int64_t call) { return n > 0 && call % n == 0; }

void SleepUs(int64_t us) {
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

struct InjectedWorkerFault {};  // deliberately not a std::exception

}  // namespace

void FaultConfig::Set(const std::string& name, int64_t value) {
  if (value < 0) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "fault setting " + name + " must be >= 0");
  }
  if (name == "copy_delay_us") copy_delay_us = value;
  else if (name == "fail_every_nth_copy") fail_every_nth_copy = value;
  else if (name == "throw_every_nth_copy") throw_every_nth_copy = value;
  else if (name == "alloc_delay_us") alloc_delay_us = value;
  else if (name == "fail_every_nth_alloc") fail_every_nth_alloc = value;
  else if (name == "report_async") report_async = value;
  else if (name == "fail_every_nth_record") fail_every_nth_record = value;
  else
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "unknown fault setting '" + name + "'");
}

int64_t FaultConfig::Get(const std::string& name) const {
  if (name == "copy_delay_us") return copy_delay_us;
  if (name == "fail_every_nth_copy") return fail_every_nth_copy;
  if (name == "throw_every_nth_copy") return throw_every_nth_copy;
  if (name == "alloc_delay_us") return alloc_delay_us;
  if (name == "fail_every_nth_alloc") return fail_every_nth_alloc;
  if (name == "report_async") return report_async;
  if (name == "fail_every_nth_record") return fail_every_nth_record;
  if (name == "copies") return copies;
  if (name == "allocs") return allocs;
  if (name == "copy_failures") return copy_failures;
  if (name == "alloc_failures") return alloc_failures;
  if (name == "stream_records") return stream_records;
  throw PrefetchError(ErrorKind::kInvalidArgument,
                      "unknown fault counter '" + name + "'");
}

void* FaultBackend::AllocateHost(size_t bytes) {
  const int64_t call = ++config_->allocs;
  SleepUs(config_->alloc_delay_us);
  if (NthCall(config_->fail_every_nth_alloc, call)) {
    ++config_->alloc_failures;
    throw PrefetchError(ErrorKind::kOutOfMemory,
                        "injected host allocation failure (call " +
                            std::to_string(call) + ", " +
                            std::to_string(bytes) + " bytes)");
  }
  return host_.AllocateHost(bytes);
}

CopyToken FaultBackend::Copy(int device, void* dst, const void* src,
                             size_t bytes, bool urgent, int lane,
                             bool want_token) {
  const int64_t call = ++config_->copies;
  SleepUs(config_->copy_delay_us);
  if (NthCall(config_->throw_every_nth_copy, call)) {
    ++config_->copy_failures;
    throw InjectedWorkerFault{};
  }
  if (NthCall(config_->fail_every_nth_copy, call)) {
    ++config_->copy_failures;
    throw PrefetchError(ErrorKind::kCopyFailed,
                        "injected copy failure (call " + std::to_string(call) +
                            ")");
  }
  return host_.Copy(device, dst, src, bytes, urgent, lane, want_token);
}

CopyToken FaultBackend::RecordOnStream(int device, uintptr_t stream) {
  (void)device;
  (void)stream;
  const int64_t call = ++config_->stream_records;
  if (NthCall(config_->fail_every_nth_record, call)) {
    throw PrefetchError(ErrorKind::kCopyFailed,
                        "injected stream record failure (call " +
                            std::to_string(call) + ")");
  }
  return kTokenDone;
}

std::unique_ptr<CopyBackend> MakeFaultBackend(
    int device_count, std::shared_ptr<FaultConfig> config) {
  if (!config) config = std::make_shared<FaultConfig>();
  return std::make_unique<FaultBackend>(device_count, std::move(config));
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
