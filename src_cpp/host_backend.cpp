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

// Every field by name: the settings first (Set takes only those), then the
// counters (Get reads both).
namespace {
using FaultField = std::atomic<int64_t> FaultConfig::*;
struct NamedFaultField {
  const char* name;
  FaultField field;
};
#define PREFETCH_FAULT_FIELD(name) {#name, &FaultConfig::name}
constexpr NamedFaultField kFaultFields[] = {
    PREFETCH_FAULT_FIELD(copy_delay_us), PREFETCH_FAULT_FIELD(fail_every_nth_copy),
    PREFETCH_FAULT_FIELD(throw_every_nth_copy), PREFETCH_FAULT_FIELD(alloc_delay_us),
    PREFETCH_FAULT_FIELD(fail_every_nth_alloc), PREFETCH_FAULT_FIELD(report_async),
    PREFETCH_FAULT_FIELD(fail_every_nth_record), PREFETCH_FAULT_FIELD(eio_every_nth_read),
    PREFETCH_FAULT_FIELD(short_every_nth_read),  // the settings end here
    PREFETCH_FAULT_FIELD(copies), PREFETCH_FAULT_FIELD(allocs),
    PREFETCH_FAULT_FIELD(copy_failures), PREFETCH_FAULT_FIELD(alloc_failures),
    PREFETCH_FAULT_FIELD(stream_records), PREFETCH_FAULT_FIELD(reads),
};
#undef PREFETCH_FAULT_FIELD
constexpr size_t kFaultSettings = 9;  // the first entries of kFaultFields

// The field called `name` among the first `count` of kFaultFields, or null.
FaultField FindFaultField(const std::string& name, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    if (name == kFaultFields[i].name) return kFaultFields[i].field;
  }
  return nullptr;
}
}  // namespace

void FaultConfig::Set(const std::string& name, int64_t value) {
  if (value < 0) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "fault setting " + name + " must be >= 0");
  }
  const FaultField field = FindFaultField(name, kFaultSettings);
  if (field == nullptr) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "unknown fault setting '" + name + "'");
  }
  (this->*field) = value;
}

int64_t FaultConfig::Get(const std::string& name) const {
  const FaultField field =
      FindFaultField(name, sizeof(kFaultFields) / sizeof(kFaultFields[0]));
  if (field == nullptr) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "unknown fault counter '" + name + "'");
  }
  return (this->*field).load();
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

DiskFault FaultBackend::NextReadFault() {
  const int64_t call = ++config_->reads;
  if (NthCall(config_->eio_every_nth_read, call)) return DiskFault::kEio;
  if (NthCall(config_->short_every_nth_read, call)) return DiskFault::kShortRead;
  return DiskFault::kNone;
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
