// ArcherPrefetchHandle: construction (the options checked, each device
// built, the workers started), the checks and lookups every call shares,
// inspection, control and close.
#include "archer_prefetch_handle.h"
#include "handle_internal.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace prefetch {

using detail::IdText;

namespace {

// `n` chunks of `chunk` bytes, saturated (copy_chunk_bytes may be up to
// INT64_MAX).
size_t Chunks(size_t n, size_t chunk) {
  return chunk > SIZE_MAX / n ? SIZE_MAX : n * chunk;
}

}  // namespace

ArcherPrefetchHandle::ArcherPrefetchHandle(HandleOptions options,
                                           std::unique_ptr<CopyBackend> backend)
    : backend_(std::move(backend)),
      copy_chunk_bytes_(options.copy_chunk_bytes),
      max_bytes_in_flight_(options.max_bytes_in_flight),
      spec_cap_min_(options.max_speculative_bytes_in_flight != 0
                        ? options.max_speculative_bytes_in_flight
                        : Chunks(kMinSpecCapChunks, options.copy_chunk_bytes)),
      spec_cap_max_(options.max_speculative_bytes_in_flight != 0
                        ? options.max_speculative_bytes_in_flight
                        : Chunks(kMaxSpecCapChunks, options.copy_chunk_bytes)),
      copy_lanes_(options.copy_lanes),
      copy_poll_us_(options.copy_poll_us),
      debug_issue_delay_ns_(options.debug_issue_delay_ns),
      poison_freed_slots_(options.poison_freed_slots),
      owner_pid_(static_cast<long>(::getpid())),
      disk_direct_io_(options.disk_direct_io),
      disk_reader_threads_(options.disk_reader_threads) {
  CheckOptions(options);
  // Build the host tier and every device before starting any thread, so a
  // failure here leaves nothing running; then start workers.
  BuildHostTier(options);
  try {
    BuildDevices(options);
  } catch (...) {
    if (host_tier_alloc_ != nullptr) backend_->FreeHost(host_tier_alloc_, host_tier_alloc_bytes_);
    throw;
  }
  paused_ = options.start_paused;
  StartWorkers();
}

void ArcherPrefetchHandle::CheckOptions(const HandleOptions& options) const {
  if (!backend_) {
    throw PrefetchError(ErrorKind::kInvalidArgument, "no copy backend");
  }
  const size_t n = options.device_budget_bytes.size();
  if (n == 0 || n > static_cast<size_t>(kMaxDevices)) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "need 1.." + std::to_string(kMaxDevices) +
                            " device budgets, got " + std::to_string(n));
  }
  if (static_cast<int>(n) > backend_->DeviceCount()) {
    throw PrefetchError(
        ErrorKind::kInvalidArgument,
        std::to_string(n) + " devices requested but the " + backend_->Name() +
            " backend has " + std::to_string(backend_->DeviceCount()));
  }
  if (!options.device_arenas.empty() && options.device_arenas.size() != n) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "device_arenas must be empty or one per device");
  }
  if (copy_lanes_ < 1 || copy_lanes_ > kMaxCopyLanes) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "copy_lanes must be in 1.." +
                            std::to_string(kMaxCopyLanes));
  }
  if (copy_chunk_bytes_ == 0) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "copy_chunk_bytes must be > 0");
  }
  if (copy_poll_us_ < 0 || copy_poll_us_ > kMaxCopyPollUs) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "copy_poll_us must be in 0.." +
                            std::to_string(kMaxCopyPollUs));
  }
  if (options.disk_reader_threads < 1 ||
      options.disk_reader_threads > kMaxHandleReaderThreads) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "disk_reader_threads must be in 1.." +
                            std::to_string(kMaxHandleReaderThreads));
  }
  if (debug_issue_delay_ns_ < 0) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "debug_issue_delay_ns must be >= 0");
  }
  for (size_t d = 0; d < n; ++d) {
    if (options.device_budget_bytes[d] < kSlotAlignmentBytes) {
      throw PrefetchError(ErrorKind::kInvalidArgument,
                          "device budget must be at least " +
                              std::to_string(kSlotAlignmentBytes) + " bytes");
    }
  }
  CheckEvictionPolicyName(options.eviction_policy);
}

void ArcherPrefetchHandle::BuildDevices(const HandleOptions& options) {
  const size_t n = options.device_budget_bytes.size();
  try {
    for (size_t d = 0; d < n; ++d) {
      auto dev = std::make_unique<DeviceState>();
      dev->index = static_cast<int>(d);
      dev->spec_cap = spec_cap_min_;
      const size_t budget = options.device_budget_bytes[d];
      void* arena = options.device_arenas.empty() ? nullptr
                                                  : options.device_arenas[d];
      if (arena == nullptr) {
        arena = backend_->AllocateDevice(dev->index, budget);
        dev->owns_arena = true;
      }
      dev->cache = std::make_unique<DeviceCache>(
          static_cast<char*>(arena), budget,
          MakeEvictionPolicy(options.eviction_policy, options.cycle_acquires));
      devices_.push_back(std::move(dev));
    }
  } catch (...) {
    for (auto& dev : devices_) {
      if (dev->owns_arena) {
        backend_->FreeDevice(dev->index, dev->cache->arena(),
                             dev->cache->budget_bytes());
      }
    }
    throw;
  }
}

void ArcherPrefetchHandle::StartWorkers() {
  StartReaders();
  for (auto& dev : devices_) {
    DeviceState* raw = dev.get();
    dev->worker = std::thread([this, raw] {
      // Nothing may escape a thread (std::terminate). The loop catches what
      // the backend throws; this is the last line for anything else (an
      // allocation failure): the worker stops, acquirers of its device time
      // out with a clear error instead of the process dying.
      try {
        WorkerLoop(raw);
      } catch (...) {
        MutexGuard lk(mu_);
        raw->worker_failed = true;
        ready_cv_.notify_all();
      }
    });
  }
}

ArcherPrefetchHandle::~ArcherPrefetchHandle() { Close(); }

void ArcherPrefetchHandle::CheckDevice(int device) const {
  if (device < 0 || device >= DeviceCount()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "no device " + std::to_string(device));
  }
}

uintptr_t ArcherPrefetchHandle::ArenaAddress(int device) const {
  CheckDevice(device);
  return reinterpret_cast<uintptr_t>(devices_[device]->cache->arena());
}

size_t ArcherPrefetchHandle::BudgetBytes(int device) const {
  CheckDevice(device);
  return devices_[device]->cache->budget_bytes();
}

// ---------------------------------------------------------------- helpers

void ArcherPrefetchHandle::CheckNotForked() const {
  // Checked before taking mu_: a worker may have held it at the fork, and in
  // the child nobody would ever unlock it.
  if (static_cast<long>(::getpid()) != owner_pid_) {
    throw PrefetchError(ErrorKind::kClosed,
                        "PrefetchHandle used in a forked child process; its "
                        "worker threads exist only in the parent. Create a "
                        "new handle in the child");
  }
}

void ArcherPrefetchHandle::CheckUsableLocked() const {
  if (closed_) {
    throw PrefetchError(ErrorKind::kClosed, "PrefetchHandle is closed");
  }
}

void ArcherPrefetchHandle::CheckPriority(int priority) {
  if (priority < 0 || priority >= kNumBands) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "priority must be in 0.." +
                            std::to_string(kNumBands - 1) + " (0 = most "
                            "urgent), got " + std::to_string(priority));
  }
}

Entry* ArcherPrefetchHandle::LookupLocked(int64_t id) const {
  if (id < 0 || id > kMaxTensorId) return nullptr;
  const size_t page = static_cast<size_t>(id) >> kPageBits;
  if (page >= pages_.size() || !pages_[page]) return nullptr;
  Entry* e = &pages_[page][static_cast<size_t>(id) & (kPageSize - 1)];
  return e->id == id ? e : nullptr;
}

void ArcherPrefetchHandle::ResolveIdsLocked(const int64_t* ids, size_t n) {
  if (batch_scratch_.size() < n) batch_scratch_.resize(n);
  Entry** out = batch_scratch_.data();
  for (size_t i = 0; i < n; ++i) {
    Entry* e = LookupLocked(ids[i]);
    if (e == nullptr) {
      throw PrefetchError(ErrorKind::kUnknownId,
                          IdText(ids[i]) + " (at index " + std::to_string(i) +
                              ") is not registered");
    }
    out[i] = e;
  }
}

void ArcherPrefetchHandle::ForEachEntryLocked(void (*fn)(Entry*, void*),
                                              void* ctx) const {
  for (const auto& page : pages_) {
    if (!page) continue;
    for (size_t i = 0; i < kPageSize; ++i) {
      if (page[i].id >= 0) fn(&page[i], ctx);
    }
  }
}

void ArcherPrefetchHandle::ValidateIdsLocked(const int64_t* ids,
                                             size_t n) const {
  for (size_t i = 0; i < n; ++i) {
    if (LookupLocked(ids[i]) == nullptr) {
      throw PrefetchError(ErrorKind::kUnknownId,
                          IdText(ids[i]) + " (at index " + std::to_string(i) +
                              ") is not registered");
    }
  }
}

void ArcherPrefetchHandle::PinLocked(Entry* e) {
  if (e->pins++ == 0) ++pinned_entries_;
}

void ArcherPrefetchHandle::UnpinOneLocked(Entry* e) {
  if (--e->pins == 0) --pinned_entries_;
}

uint64_t ArcherPrefetchHandle::LastBatchNs() const {
  CheckNotForked();
  MutexGuard lk(mu_);
  return stats_.last_batch_ns;
}

void ArcherPrefetchHandle::WakeWorkersLocked(uint64_t device_mask) {
  while (device_mask != 0) {
    const int d = __builtin_ctzll(device_mask);
    device_mask &= device_mask - 1;
    DeviceState* dev = devices_[d].get();
    // A worker that is copying re-checks its queue before sleeping, so only
    // a sleeping one needs the (syscall-priced) notify.
    if (dev->worker_waiting && !paused_) dev->work_cv.notify_one();
  }
  if (host_tier_ && !paused_) stage_cv_.notify_all();  // disk-backed work, maybe
}

void ArcherPrefetchHandle::UnpinLocked(const int64_t* ids, size_t n) {
  uint64_t mask = 0;
  for (size_t i = 0; i < n; ++i) {
    Entry* e = LookupLocked(ids[i]);
    if (e != nullptr && e->pins > 0) {
      UnpinOneLocked(e);
      mask |= uint64_t{1} << e->device;
    }
  }
  // Unpinned entries may be evictable now: a blocked worker retries.
  for (int d = 0; d < DeviceCount(); ++d) {
    if ((mask >> d) & 1u) devices_[d]->work_cv.notify_one();
  }
}

// ----------------------------------------------------------------- control

std::vector<std::pair<int, int64_t>> ArcherPrefetchHandle::QueueSnapshot(
    int device) const {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckUsableLocked();
  CheckDevice(device);
  std::vector<std::pair<int, int64_t>> out;
  devices_[device]->queue.ForEach(
      [&out](Entry* e) { out.emplace_back(e->band, e->id); });
  return out;
}

std::vector<int64_t> ArcherPrefetchHandle::ResidentSnapshot(int device) const {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckUsableLocked();
  CheckDevice(device);
  std::vector<int64_t> out;
  devices_[device]->cache->ForEachInEvictionOrder(
      [](Entry* e, void* ctx) {
        static_cast<std::vector<int64_t>*>(ctx)->push_back(e->id);
      },
      &out);
  return out;
}

void ArcherPrefetchHandle::DebugHoldCopies(int device, uintptr_t stream) {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckUsableLocked();
  CheckDevice(device);
  backend_->HoldCopiesUntil(device, stream);
}

void ArcherPrefetchHandle::Pause() {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckUsableLocked();
  paused_ = true;
}

void ArcherPrefetchHandle::Resume() {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckUsableLocked();
  paused_ = false;
  for (auto& dev : devices_) dev->work_cv.notify_one();
  stage_cv_.notify_all();
  ready_cv_.notify_all();
}

Stats ArcherPrefetchHandle::GetStats() const {
  CheckNotForked();
  MutexGuard lk(mu_);
  Stats s = stats_;
  for (const auto& dev : devices_) {
    s.queue_depth += dev->queue.size();
    s.resident_count += dev->cache->resident_count();
    s.resident_bytes += dev->cache->used_bytes();
    s.bytes_in_flight += dev->copying_bytes;
    s.bytes_in_flight += dev->inflight_bytes;
    s.speculative_cap_bytes =
        std::max<uint64_t>(s.speculative_cap_bytes, dev->spec_cap);
  }
  if (host_tier_) {
    s.host_tier_used_bytes = host_tier_->used_bytes();
    s.host_tier_budget_bytes = host_tier_->budget_bytes();
  }
  s.registered = registered_;
  s.registered_bytes = registered_bytes_;
  s.pinned_count = pinned_entries_;
  return s;
}

void ArcherPrefetchHandle::Close() {
  if (static_cast<long>(::getpid()) != owner_pid_) {
    // A forked child: the workers and possibly the lock's owner live only in
    // the parent. Touch nothing; the child's copy of the memory is freed
    // with the process.
    for (auto& dev : devices_) {
      if (dev->worker.joinable()) dev->worker.detach();
    }
    for (std::thread& reader : readers_) {
      if (reader.joinable()) reader.detach();
    }
    return;
  }
  {
    MutexGuard lk(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
    for (auto& dev : devices_) {
      dev->queue.RemoveAtOrBelow(0, [](Entry* e) {
        e->state = EntryState::kHost;
      });
      dev->work_cv.notify_all();
    }
    stage_cv_.notify_all();
    ready_cv_.notify_all();
  }
  for (auto& dev : devices_) {
    if (dev->worker.joinable()) dev->worker.join();
  }
  for (std::thread& reader : readers_) {
    if (reader.joinable()) reader.join();
  }
  MutexLock lk(mu_);
  // The wait calls its predicate with mu_ held; clang checks a lambda on its own.
  idle_cv_.wait(lk, [this]() REQUIRES(mu_) { return active_calls_ == 0; });
  FreeEverythingLocked();
}

void ArcherPrefetchHandle::FreeEverythingLocked() {
  ForEachEntryLocked(
      [](Entry* e, void* ctx) {
        CopyBackend* backend = static_cast<CopyBackend*>(ctx);
        try {
          backend->Wait(e->ready);
          backend->Wait(e->last_use);
        } catch (...) {
          // Closing: a failed wait leaves nothing more to do for this entry.
        }
        backend->ReleaseToken(e->ready);
        backend->ReleaseToken(e->last_use);
        if (e->owns_host) backend->FreeHost(e->host_ptr, e->bytes);
        *e = Entry();
      },
      backend_.get());
  pages_.clear();
  FreeHostTierLocked();
  pinned_entries_ = 0;
  registered_ = 0;
  registered_bytes_ = 0;
  for (auto& dev : devices_) {
    dev->inflight.clear();
    dev->inflight_bytes = 0;
    for (const auto& chunk : dev->spec_chunks) {
      backend_->ReleaseToken(chunk.first);
    }
    dev->spec_chunks.clear();
    dev->spec_chunk_bytes = 0;
    if (dev->owns_arena) {
      backend_->FreeDevice(dev->index, dev->cache->arena(),
                           dev->cache->budget_bytes());
      dev->owns_arena = false;
    }
  }
}

}  // namespace prefetch
