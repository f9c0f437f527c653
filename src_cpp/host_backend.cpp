#include <algorithm>
#include <cstdint>
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
  if (bytes > SIZE_MAX - kHostAlignmentBytes) {  // the rounding below would wrap
    throw PrefetchError(ErrorKind::kOutOfMemory,
                        std::string("could not allocate ") +
                            std::to_string(bytes) + " bytes of " + what);
  }
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
    PREFETCH_FAULT_FIELD(short_every_nth_read),
    PREFETCH_FAULT_FIELD(async_copy_us),
    PREFETCH_FAULT_FIELD(async_copy_ns_per_kib),  // the settings end here
    PREFETCH_FAULT_FIELD(copies), PREFETCH_FAULT_FIELD(allocs),
    PREFETCH_FAULT_FIELD(copy_failures), PREFETCH_FAULT_FIELD(alloc_failures),
    PREFETCH_FAULT_FIELD(stream_records), PREFETCH_FAULT_FIELD(reads),
    PREFETCH_FAULT_FIELD(max_lane_bytes_in_flight),
    PREFETCH_FAULT_FIELD(max_urgent_latency_us), PREFETCH_FAULT_FIELD(live_tokens),
    PREFETCH_FAULT_FIELD(link_idle_before_lane_us),
    PREFETCH_FAULT_FIELD(link_idle_before_urgent_us),
};
#undef PREFETCH_FAULT_FIELD
constexpr size_t kFaultSettings = 11;  // the first entries of kFaultFields

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
  const CopyToken done = host_.Copy(device, dst, src, bytes, urgent, lane,
                                    want_token);
  if ((config_->async_copy_us <= 0 && config_->async_copy_ns_per_kib <= 0) ||
      !want_token) {
    return done;
  }
  return SimulateLink(device, bytes, urgent);
}

// The simulated link: one per device, copies in call order.
CopyToken FaultBackend::SimulateLink(int device, size_t bytes, bool urgent) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point now = Clock::now();
  auto token = std::make_unique<SimToken>();
  std::lock_guard<std::mutex> lk(link_mu_);
  if (link_free_at_.size() <= static_cast<size_t>(device)) {
    link_free_at_.resize(static_cast<size_t>(device) + 1);
  }
  Clock::time_point& free_at = link_free_at_[static_cast<size_t>(device)];
  if (free_at != Clock::time_point() && now > free_at) {
    const int64_t idle =
        std::chrono::duration_cast<std::chrono::microseconds>(now - free_at)
            .count();
    (urgent ? config_->link_idle_before_urgent_us
            : config_->link_idle_before_lane_us) += idle;
  }
  token->done_at =
      std::max(now, free_at) +
      std::chrono::microseconds(config_->async_copy_us.load()) +
      std::chrono::nanoseconds(config_->async_copy_ns_per_kib.load() *
                               static_cast<int64_t>(bytes) / 1024);
  free_at = token->done_at;
  if (urgent) {
    const int64_t us = std::chrono::duration_cast<std::chrono::microseconds>(
                           token->done_at - now)
                           .count();
    if (us > config_->max_urgent_latency_us) config_->max_urgent_latency_us = us;
  } else {
    size_t in_flight = bytes;
    auto keep = lane_copies_.begin();
    for (auto it = lane_copies_.begin(); it != lane_copies_.end(); ++it) {
      if (it->first > now) {
        in_flight += it->second;
        *keep++ = *it;
      }
    }
    lane_copies_.erase(keep, lane_copies_.end());
    lane_copies_.emplace_back(token->done_at, bytes);
    const auto wide = static_cast<int64_t>(in_flight);
    if (wide > config_->max_lane_bytes_in_flight) {
      config_->max_lane_bytes_in_flight = wide;
    }
  }
  ++config_->live_tokens;
  return reinterpret_cast<uintptr_t>(token.release());
}

bool FaultBackend::Query(CopyToken token) {
  if (token == kTokenDone) return true;
  return std::chrono::steady_clock::now() >= AsSimToken(token)->done_at;
}

void FaultBackend::Wait(CopyToken token) {
  if (token == kTokenDone) return;
  std::this_thread::sleep_until(AsSimToken(token)->done_at);
}

void FaultBackend::RetainToken(CopyToken token) noexcept {
  if (token == kTokenDone) return;
  AsSimToken(token)->refs.fetch_add(1, std::memory_order_relaxed);
}

void FaultBackend::ReleaseToken(CopyToken token) noexcept {
  if (token == kTokenDone) return;
  SimToken* t = AsSimToken(token);
  if (t->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  delete t;
  --config_->live_tokens;
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
