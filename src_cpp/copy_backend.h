// Copy backends: how bytes get from the host registry into a device cache.
//
// The engine owns policy (what to copy, when, where); a backend owns mechanism
// (host memory, device memory, copy engines, completion tokens). All pointers
// and streams cross this interface as plain integers and void pointers so the
// engine never sees a CUDA or torch type.
//
// Note [Completion tokens]
// A CopyToken names the completion of some device work: a copy into a slot
// (Entry::ready) or a consumer's last use of a slot (Entry::last_use). Token 0
// means "already complete". A synchronous backend (host) returns 0 from every
// call. An asynchronous backend (CUDA) returns an event from its pool; the
// engine returns each token with ReleaseToken once it no longer needs it, and
// never releases a token that another thread may still wait on.
#pragma once

#include <chrono>
#include <cstddef>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "disk_io.h"
#include "errors.h"

namespace prefetch {

using CopyToken = uint64_t;
// "No consumer stream". Not 0: 0 is CUDA's legacy default stream, which is
// torch's default stream, and a real stream to wait on and record on.
constexpr uintptr_t kNoStream = ~uintptr_t{0};
constexpr int kMaxCopyLanes = 8;  // prefetch streams per device, at most
constexpr CopyToken kTokenDone = 0;

class CopyBackend {
 public:
  virtual ~CopyBackend() = default;

  virtual const char* Name() const = 0;
  // True when copies complete after Copy returns (tokens may be pending).
  virtual bool IsAsync() const = 0;
  // Devices this backend can serve (the engine refuses more).
  virtual int DeviceCount() const = 0;

  // Called once on each worker thread before its first copy (binds a context).
  virtual void BindWorkerThread(int /*device*/) {}

  // Host memory holding registered bytes (page-locked for DMA backends).
  // Throws PrefetchError(kOutOfMemory) on failure.
  virtual void* AllocateHost(size_t bytes) = 0;
  virtual void FreeHost(void* ptr, size_t bytes) noexcept = 0;

  // Device cache arena when the caller did not supply one.
  virtual void* AllocateDevice(int device, size_t bytes) = 0;
  virtual void FreeDevice(int device, void* ptr, size_t bytes) noexcept = 0;

  // Copies `bytes` from host `src` to device `dst`. `urgent` selects the
  // on-demand path (a high-priority stream for CUDA); otherwise `lane`
  // (0..kMaxCopyLanes-1) picks one of the prefetch streams, so copies of
  // different entries can run on several copy engines at once. When
  // `want_token` the return value names completion of this and every earlier
  // copy issued on the same path (urgent, or the same lane) of this device;
  // otherwise it is kTokenDone. Throws PrefetchError(kCopyFailed) on failure.
  virtual CopyToken Copy(int device, void* dst, const void* src, size_t bytes,
                         bool urgent, int lane, bool want_token) = 0;

  // Token bookkeeping (see Note [Completion tokens]). Query must not throw:
  // the engine calls it under its lock on worker threads; a backend that
  // cannot tell reports the token done and lets Wait raise.
  virtual bool Query(CopyToken token) = 0;
  virtual void Wait(CopyToken token) = 0;
  virtual void ReleaseToken(CopyToken token) noexcept = 0;
  // One more reference to `token`: each Retain needs its own ReleaseToken.
  // Lets one record stand for many entries (Release records one token per
  // stream per call and hands it to every id it unpins).
  virtual void RetainToken(CopyToken token) noexcept { (void)token; }

  // Makes `stream` wait on the GPU for `token` (no CPU block).
  virtual void StreamWait(uintptr_t stream, CopyToken token) = 0;

  // The fault to inject into the engine's next disk read (the disk tier,
  // Note [Host tier] in archer_prefetch_handle.h): kNone but in tests.
  virtual DiskFault NextReadFault() { return DiskFault::kNone; }
  // Records on `stream`; the returned token completes when the stream's work
  // queued so far does.
  virtual CopyToken RecordOnStream(int device, uintptr_t stream) = 0;

  // Fills `bytes` of device memory at `dst` with `value`, complete before
  // any later copy into it starts (debug poisoning of freed slots).
  virtual void Fill(int device, void* dst, size_t bytes, uint8_t value) = 0;

  // Tests: makes the device's copy streams wait for the work queued so far
  // on `stream`, so a test can stall copies on the GPU deterministically.
  virtual void HoldCopiesUntil(int /*device*/, uintptr_t /*stream*/) {
    throw PrefetchError(ErrorKind::kUnavailable,
                        std::string(Name()) + " backend has no copy streams");
  }
};

// A backend whose copies are complete when Copy returns: every token is
// kTokenDone, so there is nothing to query, wait for or release.
class CompletedCopiesBackend : public CopyBackend {
 public:
  bool Query(CopyToken) override { return true; }
  void Wait(CopyToken) override {}
  void ReleaseToken(CopyToken) noexcept override {}
  void StreamWait(uintptr_t, CopyToken) override {}
  CopyToken RecordOnStream(int, uintptr_t) override { return kTokenDone; }
};

// The embedded default: the device cache is a host-memory arena and a copy is
// a memcpy on the worker thread. Every token is kTokenDone.
class HostBackend final : public CompletedCopiesBackend {
 public:
  explicit HostBackend(int device_count = 1) : device_count_(device_count) {}
  const char* Name() const override { return "host"; }
  bool IsAsync() const override { return false; }
  int DeviceCount() const override { return device_count_; }
  void* AllocateHost(size_t bytes) override;
  void FreeHost(void* ptr, size_t bytes) noexcept override;
  void* AllocateDevice(int device, size_t bytes) override;
  void FreeDevice(int device, void* ptr, size_t bytes) noexcept override;
  CopyToken Copy(int device, void* dst, const void* src, size_t bytes,
                 bool urgent, int lane, bool want_token) override;
  void Fill(int device, void* dst, size_t bytes, uint8_t value) override;

 private:
  int device_count_;  // logical devices, each with its own arena and worker
};

// Faults a FaultBackend injects; tests change them while a handle runs.
// Every field is atomic: read by workers, written by the test thread.
struct FaultConfig {
  std::atomic<int64_t> copy_delay_us{0};        // sleep inside every Copy
  std::atomic<int64_t> fail_every_nth_copy{0};  // PrefetchError on the Nth
  std::atomic<int64_t> throw_every_nth_copy{0}; // non-std exception on the Nth
  std::atomic<int64_t> alloc_delay_us{0};       // sleep inside AllocateHost
  std::atomic<int64_t> fail_every_nth_alloc{0}; // kOutOfMemory on the Nth
  std::atomic<int64_t> report_async{0};  // 1: claim IsAsync (caller-runs paths)
  std::atomic<int64_t> fail_every_nth_record{0};  // kCopyFailed on the Nth RecordOnStream
  std::atomic<int64_t> eio_every_nth_read{0};   // the Nth disk read gets EIO
  std::atomic<int64_t> short_every_nth_read{0}; // the Nth disk read ends early
  // > 0: a simulated link per device (with report_async): each copy's token
  // completes this many microseconds (plus async_copy_ns_per_kib) after the
  // later of its call and the device's previous copy's completion (the
  // bytes are copied at once).
  std::atomic<int64_t> async_copy_us{0};
  // ... plus this many nanoseconds per KiB copied (a link of a given rate).
  std::atomic<int64_t> async_copy_ns_per_kib{0};
  std::atomic<int64_t> copies{0};               // Copy calls seen
  std::atomic<int64_t> allocs{0};               // AllocateHost calls seen
  std::atomic<int64_t> copy_failures{0};        // injected copy failures
  std::atomic<int64_t> alloc_failures{0};       // injected alloc failures
  std::atomic<int64_t> stream_records{0};       // RecordOnStream calls seen
  std::atomic<int64_t> reads{0};                // disk reads seen
  // With the simulated link: the most prefetch-lane bytes (urgent=false)
  // not yet complete, the new copy's included, over every prefetch-lane
  // Copy call; and the longest an urgent copy's token took to complete
  // after its call (how long a miss queued), in microseconds. Summed over
  // devices, like the idle times below: tests read them with one device.
  std::atomic<int64_t> max_lane_bytes_in_flight{0};
  std::atomic<int64_t> max_urgent_latency_us{0};
  std::atomic<int64_t> live_tokens{0};  // simulated tokens not yet released
  // With the simulated link: its idle time before each copy, summed by the
  // kind of copy that ended it (prefetch lane or urgent), in microseconds
  // (each device's link's, summed).
  std::atomic<int64_t> link_idle_before_lane_us{0};
  std::atomic<int64_t> link_idle_before_urgent_us{0};

  // By name, for bindings; unknown names throw kInvalidArgument.
  void Set(const std::string& name, int64_t value);
  int64_t Get(const std::string& name) const;
};

// The host backend with injectable faults (tests; runs without a GPU).
class FaultBackend final : public CompletedCopiesBackend {
 public:
  FaultBackend(int device_count, std::shared_ptr<FaultConfig> config)
      : host_(device_count), config_(std::move(config)) {}
  const char* Name() const override { return "fault"; }
  // Copies still complete before Copy returns, but with report_async the
  // engine takes its async paths, so they run on CPUs; with async_copy_us
  // (or async_copy_ns_per_kib) too the tokens complete later, on a
  // simulated link.
  bool IsAsync() const override { return config_->report_async != 0; }
  bool Query(CopyToken token) override;
  void Wait(CopyToken token) override;
  void ReleaseToken(CopyToken token) noexcept override;
  void RetainToken(CopyToken token) noexcept override;
  int DeviceCount() const override { return host_.DeviceCount(); }
  void* AllocateHost(size_t bytes) override;
  void FreeHost(void* ptr, size_t bytes) noexcept override {
    host_.FreeHost(ptr, bytes);
  }
  void* AllocateDevice(int device, size_t bytes) override {
    return host_.AllocateDevice(device, bytes);
  }
  void FreeDevice(int device, void* ptr, size_t bytes) noexcept override {
    host_.FreeDevice(device, ptr, bytes);
  }
  CopyToken Copy(int device, void* dst, const void* src, size_t bytes,
                 bool urgent, int lane, bool want_token) override;
  CopyToken RecordOnStream(int device, uintptr_t stream) override;
  void Fill(int device, void* dst, size_t bytes, uint8_t value) override {
    host_.Fill(device, dst, bytes, value);
  }
  DiskFault NextReadFault() override;

 private:
  // A token of the simulated link: done at `done_at`.
  struct SimToken {
    std::chrono::steady_clock::time_point done_at;
    std::atomic<int> refs{1};
  };
  CopyToken SimulateLink(int device, size_t bytes, bool urgent);
  static SimToken* AsSimToken(CopyToken token) {
    return reinterpret_cast<SimToken*>(static_cast<uintptr_t>(token));
  }

  HostBackend host_;                     // does the real work
  std::shared_ptr<FaultConfig> config_;  // shared with the test
  std::mutex link_mu_;  // guards link_free_at_ and lane_copies_
  std::vector<std::chrono::steady_clock::time_point> link_free_at_;
  // Prefetch-lane copies not known complete: (done_at, bytes).
  std::vector<std::pair<std::chrono::steady_clock::time_point, size_t>>
      lane_copies_;
};

// Creates the CUDA backend if the driver library loads and has a device;
// throws PrefetchError(kUnavailable) with the reason otherwise.
std::unique_ptr<CopyBackend> MakeCudaBackend();

// A FaultBackend of `device_count` logical devices sharing `config`.
std::unique_ptr<CopyBackend> MakeFaultBackend(
    int device_count, std::shared_ptr<FaultConfig> config);

// "host", "cuda" or "auto" (cuda when available, else host).
std::unique_ptr<CopyBackend> MakeBackend(const std::string& name,
                                         int host_device_count);

}  // namespace prefetch
