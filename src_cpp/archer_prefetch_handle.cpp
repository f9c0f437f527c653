#include "archer_prefetch_handle.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace prefetch {
namespace {

std::string IdText(int64_t id) { return "tensor id " + std::to_string(id); }

const char* StateName(EntryState s) {
  switch (s) {
    case EntryState::kHost: return "not requested";
    case EntryState::kQueued: return "queued";
    case EntryState::kCopying: return "copying";
    case EntryState::kResident: return "resident";
  }
  return "?";
}

int64_t SteadyNs(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             t.time_since_epoch())
      .count();
}

}  // namespace

ArcherPrefetchHandle::ArcherPrefetchHandle(HandleOptions options,
                                           std::unique_ptr<CopyBackend> backend)
    : backend_(std::move(backend)),
      copy_chunk_bytes_(options.copy_chunk_bytes),
      max_bytes_in_flight_(options.max_bytes_in_flight),
      max_speculative_bytes_(options.max_speculative_bytes_in_flight != 0
                                 ? options.max_speculative_bytes_in_flight
                                 : 2 * options.copy_chunk_bytes),
      copy_lanes_(options.copy_lanes),
      debug_issue_delay_ns_(options.debug_issue_delay_ns),
      poison_freed_slots_(options.poison_freed_slots),
      owner_pid_(static_cast<long>(::getpid())) {
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
  auto policy_check = MakeEvictionPolicy(options.eviction_policy);
  (void)policy_check;

  // Build every device before starting any thread, so a failure here leaves
  // nothing running; then start workers.
  try {
    for (size_t d = 0; d < n; ++d) {
      auto dev = std::make_unique<DeviceState>();
      dev->index = static_cast<int>(d);
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
  paused_ = options.start_paused;
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
        std::lock_guard<std::mutex> lk(mu_);
        raw->worker_failed = true;
        ready_cv_.notify_all();
      }
    });
  }
}

ArcherPrefetchHandle::~ArcherPrefetchHandle() { Close(); }

uintptr_t ArcherPrefetchHandle::ArenaAddress(int device) const {
  if (device < 0 || device >= DeviceCount()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "no device " + std::to_string(device));
  }
  return reinterpret_cast<uintptr_t>(devices_[device]->cache->arena());
}

size_t ArcherPrefetchHandle::BudgetBytes(int device) const {
  if (device < 0 || device >= DeviceCount()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "no device " + std::to_string(device));
  }
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
  std::lock_guard<std::mutex> lk(mu_);
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

// ------------------------------------------------------------ registration

void ArcherPrefetchHandle::CheckRegistrationLocked(int64_t id, size_t bytes,
                                                   int device) const {
  if (id < 0 || id > kMaxTensorId) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + " out of range 0.." +
                            std::to_string(kMaxTensorId));
  }
  if (device < 0 || device >= DeviceCount()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "device " + std::to_string(device) +
                            " out of range 0.." +
                            std::to_string(DeviceCount() - 1));
  }
  if (bytes == 0) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + ": cannot register an empty tensor");
  }
  const size_t budget = devices_[device]->cache->budget_bytes();
  if (AlignSlot(bytes) > budget) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + " needs " +
                            std::to_string(AlignSlot(bytes)) +
                            " bytes of cache but device " +
                            std::to_string(device) + " has a budget of " +
                            std::to_string(budget));
  }
  if (LookupLocked(id) != nullptr) {
    throw PrefetchError(ErrorKind::kAlreadyExists,
                        IdText(id) + " is already registered");
  }
}

void ArcherPrefetchHandle::InsertEntryLocked(int64_t id, void* host,
                                             size_t bytes, int device,
                                             bool owns_host) {
  const size_t page = static_cast<size_t>(id) >> kPageBits;
  try {
    if (page >= pages_.size()) pages_.resize(page + 1);
    if (!pages_[page]) pages_[page].reset(new Entry[kPageSize]);
  } catch (const std::bad_alloc&) {
    throw PrefetchError(ErrorKind::kOutOfMemory,
                        IdText(id) + ": no memory for the registry page");
  }
  Entry* entry = &pages_[page][static_cast<size_t>(id) & (kPageSize - 1)];
  *entry = Entry();
  entry->id = id;
  entry->host_ptr = host;
  entry->owns_host = owns_host;
  entry->bytes = bytes;
  entry->device = device;
  ++registered_;
  registered_bytes_ += bytes;
}

void ArcherPrefetchHandle::RegisterTensor(int64_t id, size_t total_bytes,
                                          int device, const HostPart* parts,
                                          size_t n_parts) {
  {
    CheckNotForked();
    std::lock_guard<std::mutex> lk(mu_);
    CheckUsableLocked();
    CheckRegistrationLocked(id, total_bytes, device);
    for (size_t p = 0; p < n_parts; ++p) {
      if (parts[p].offset > total_bytes ||
          parts[p].bytes > total_bytes - parts[p].offset) {
        throw PrefetchError(ErrorKind::kInvalidArgument,
                            IdText(id) + ": part " + std::to_string(p) +
                                " runs past the tensor's " +
                                std::to_string(total_bytes) + " bytes");
      }
    }
    ++active_calls_;
  }
  // Allocate and fill outside the lock: registering gigabytes must not stall
  // issuance or the workers.
  void* host = nullptr;
  std::string failure;
  ErrorKind failure_kind = ErrorKind::kOutOfMemory;
  try {
    host = backend_->AllocateHost(total_bytes);
    size_t covered = 0;
    for (size_t p = 0; p < n_parts; ++p) covered += parts[p].bytes;
    if (covered < total_bytes) std::memset(host, 0, total_bytes);
    for (size_t p = 0; p < n_parts; ++p) {
      std::memcpy(static_cast<char*>(host) + parts[p].offset, parts[p].src,
                  parts[p].bytes);
    }
  } catch (const PrefetchError& e) {
    failure = e.what();
    failure_kind = e.kind();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  std::lock_guard<std::mutex> lk(mu_);
  --active_calls_;
  if (active_calls_ == 0) idle_cv_.notify_all();
  if (!failure.empty()) throw PrefetchError(failure_kind, failure);
  try {
    CheckUsableLocked();
    CheckRegistrationLocked(id, total_bytes, device);  // raced with another
    InsertEntryLocked(id, host, total_bytes, device, /*owns_host=*/true);
  } catch (...) {
    backend_->FreeHost(host, total_bytes);
    throw;
  }
}

void ArcherPrefetchHandle::RegisterExternal(int64_t id, const void* host_ptr,
                                            size_t bytes, int device) {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  if (host_ptr == nullptr) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + ": null host pointer");
  }
  CheckRegistrationLocked(id, bytes, device);
  InsertEntryLocked(id, const_cast<void*>(host_ptr), bytes, device,
                    /*owns_host=*/false);
}

void ArcherPrefetchHandle::UnregisterTensor(int64_t id) {
  void* host = nullptr;
  size_t bytes = 0;
  {
    CheckNotForked();
    std::lock_guard<std::mutex> lk(mu_);
    CheckUsableLocked();
    Entry* e = LookupLocked(id);
    if (e == nullptr) {
      throw PrefetchError(ErrorKind::kUnknownId,
                          IdText(id) + " is not registered");
    }
    if (e->pins > 0) {
      throw PrefetchError(ErrorKind::kState,
                          IdText(id) + " is acquired; release it first");
    }
    DeviceState* dev = devices_[e->device].get();
    if (e->state == EntryState::kCopying) {
      throw PrefetchError(ErrorKind::kState,
                          IdText(id) + " is being copied; retry later");
    }
    if (e->state == EntryState::kResident) {
      if (!backend_->Query(e->ready) || !backend_->Query(e->last_use)) {
        throw PrefetchError(ErrorKind::kState,
                            IdText(id) + " is still in use on a stream; "
                                         "retry after it synchronises");
      }
      DropSlotLocked(dev, e);
    } else if (e->state == EntryState::kQueued) {
      dev->queue.Remove(e);
    }
    host = e->owns_host ? e->host_ptr : nullptr;
    bytes = e->bytes;
    *e = Entry();  // id -1: the registry slot is free again
    --registered_;
    registered_bytes_ -= bytes;
    dev->work_cv.notify_one();  // a freed slot may unblock the worker
  }
  if (host != nullptr) backend_->FreeHost(host, bytes);
}

bool ArcherPrefetchHandle::IsRegistered(int64_t id) const {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  return !closed_ && LookupLocked(id) != nullptr;
}

// ---------------------------------------------------------------- prefetch

void ArcherPrefetchHandle::EnqueuePrefetch(int64_t id, int priority) {
  EnqueuePrefetchTensors(&id, 1, priority);
}

void ArcherPrefetchHandle::EnqueuePrefetchTensors(const int64_t* ids, size_t n,
                                                  int priority) {
  const Clock::time_point start = Clock::now();
  if (debug_issue_delay_ns_ > 0) {
    std::this_thread::sleep_for(std::chrono::nanoseconds(debug_issue_delay_ns_));
  }
  CheckPriority(priority);
  CheckNotForked();
  std::unique_lock<std::mutex> lk(mu_);
  CheckUsableLocked();
  ResolveIdsLocked(ids, n);  // all-or-nothing: throws before any change
  uint64_t enqueued = 0, upgraded = 0, touched = 0;
  uint64_t wake_mask = 0;
  const uint8_t band = static_cast<uint8_t>(priority);
  Entry* const* entries = batch_scratch_.data();
  // New entries are linked into one local chain per device and spliced into
  // the queue once (TaskQueue::AppendChain). A band upgrade of an entry
  // already queued first flushes the chains, so FIFO order within the band
  // follows the order of `ids`.
  Entry* chain_first[kMaxDevices];
  Entry* chain_last[kMaxDevices];
  size_t chain_count[kMaxDevices];
  const int device_count = DeviceCount();
  for (int d = 0; d < device_count; ++d) {
    chain_first[d] = chain_last[d] = nullptr;
    chain_count[d] = 0;
  }
  auto flush = [&] {
    for (int d = 0; d < device_count; ++d) {
      if (chain_count[d] == 0) continue;
      devices_[d]->queue.AppendChain(chain_first[d], chain_last[d],
                                     chain_count[d], band);
      chain_first[d] = chain_last[d] = nullptr;
      chain_count[d] = 0;
    }
  };
  for (size_t i = 0; i < n; ++i) {
    Entry* e = entries[i];
    switch (e->state) {
      case EntryState::kHost: {
        const int d = e->device;
        e->state = EntryState::kQueued;
        e->band = band;
        e->want_at = acquire_calls_ + band;
        e->q_next = nullptr;
        e->q_prev = chain_last[d];
        if (chain_last[d] != nullptr) {
          chain_last[d]->q_next = e;
        } else {
          chain_first[d] = e;
        }
        chain_last[d] = e;
        ++chain_count[d];
        ++enqueued;
        wake_mask |= uint64_t{1} << d;
        break;
      }
      case EntryState::kQueued:
        if (band < e->band) {
          e->want_at = acquire_calls_ + band;
          flush();
          TaskQueue& q = devices_[e->device]->queue;
          q.Remove(e);
          q.PushBack(e, band);
          ++upgraded;
        }
        break;
      case EntryState::kCopying:
        break;
      case EntryState::kResident:
        devices_[e->device]->cache->policy().OnRequest(e);
        e->want_at = acquire_calls_ + band;
        ++touched;
        break;
    }
  }
  flush();
  stats_.requests += n;
  stats_.enqueued += enqueued;
  stats_.deduplicated += n - enqueued;
  stats_.upgraded += upgraded;
  stats_.touched += touched;
  WakeWorkersLocked(wake_mask);
  const Clock::time_point end = Clock::now();
  stats_.last_batch_ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(end - start)
          .count());
  stats_.last_batch_start_ns = SteadyNs(start);
  stats_.last_batch_end_ns = SteadyNs(end);
}

size_t ArcherPrefetchHandle::Cancel(const int64_t* ids, size_t n) {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  ValidateIdsLocked(ids, n);
  return CancelLocked(ids, n);
}

size_t ArcherPrefetchHandle::CancelLocked(const int64_t* ids, size_t n) {
  size_t removed = 0;
  for (size_t i = 0; i < n; ++i) {
    Entry* e = LookupLocked(ids[i]);
    // An id an acquirer waits for stays queued: cancel is for speculation.
    if (e->state == EntryState::kQueued && e->pins == 0) {
      devices_[e->device]->queue.Remove(e);
      e->state = EntryState::kHost;
      e->use_on_arrival = false;
      ++removed;
    }
  }
  stats_.cancelled += removed;
  return removed;
}

size_t ArcherPrefetchHandle::CancelAtOrBelow(int band) {
  CheckPriority(band);
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  size_t removed = 0;
  for (auto& dev : devices_) {
    std::vector<Entry*> keep;  // waited-for entries go back in order
    dev->queue.RemoveAtOrBelow(band, [&](Entry* e) {
      if (e->pins > 0) {
        keep.push_back(e);
      } else {
        e->state = EntryState::kHost;
        ++removed;
      }
    });
    for (Entry* e : keep) dev->queue.PushBack(e, e->band);
  }
  stats_.cancelled += removed;
  return removed;
}

size_t ArcherPrefetchHandle::Evict(const int64_t* ids, size_t n) {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  ResolveIdsLocked(ids, n);
  size_t evicted = 0;
  uint64_t mask = 0;
  for (size_t i = 0; i < n; ++i) {
    Entry* e = batch_scratch_[i];
    if (e->state != EntryState::kResident || e->pins > 0 ||
        !backend_->Query(e->ready) || !backend_->Query(e->last_use)) {
      continue;
    }
    EvictLocked(devices_[e->device].get(), e);
    mask |= uint64_t{1} << e->device;
    ++evicted;
  }
  for (int d = 0; d < DeviceCount(); ++d) {
    if ((mask >> d) & 1u) devices_[d]->work_cv.notify_one();
  }
  return evicted;
}

void ArcherPrefetchHandle::HintNextUse(const int64_t* ids, const int64_t* when,
                                       size_t n, int64_t now, bool set_now) {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  CheckHintsLocked(ids, when, n, now, set_now);
  HintLocked(ids, when, n, now, set_now);
}

void ArcherPrefetchHandle::HintLocked(const int64_t* ids, const int64_t* when,
                                      size_t n, int64_t now, bool set_now) {
  ResolveIdsLocked(ids, n);
  if (set_now) {
    hint_clock_ = now;
    for (auto& dev : devices_) dev->cache->policy().OnClock(now);
  }
  for (size_t i = 0; i < n; ++i) {
    Entry* e = batch_scratch_[i];
    if (e->state == EntryState::kResident) {
      devices_[e->device]->cache->policy().OnHint(e, when[i]);
    } else {
      e->next_use = when[i];
    }
  }
}

int64_t ArcherPrefetchHandle::HintClock() const {
  std::lock_guard<std::mutex> lk(mu_);
  return hint_clock_;
}

// ---------------------------------------------------------- acquire/release

void ArcherPrefetchHandle::CheckFitsLocked(const int64_t* ids, size_t n) const {
  size_t need[kMaxDevices] = {};
  bool over = false;
  for (size_t i = 0; i < n; ++i) {
    const Entry* e = LookupLocked(ids[i]);
    need[e->device] += AlignSlot(e->bytes);
    over = over || need[e->device] > devices_[e->device]->cache->budget_bytes();
  }
  if (!over) return;
  // Duplicates hold one slot: count each id once before refusing.
  std::vector<int64_t> distinct(ids, ids + n);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  std::fill(need, need + kMaxDevices, 0);
  size_t count[kMaxDevices] = {};
  for (int64_t id : distinct) {
    const Entry* e = LookupLocked(id);
    need[e->device] += AlignSlot(e->bytes);
    ++count[e->device];
  }
  for (int d = 0; d < DeviceCount(); ++d) {
    const size_t budget = devices_[d]->cache->budget_bytes();
    if (need[d] > budget) {
      throw PrefetchError(
          ErrorKind::kInvalidArgument,
          "acquire needs " + std::to_string(need[d]) + " bytes of device " +
              std::to_string(d) + "'s cache at once (" +
              std::to_string(count[d]) + " tensors) but its budget is " +
              std::to_string(budget) +
              " bytes: they can never be held together; acquire fewer at a "
              "time or raise device_budget_bytes");
    }
  }
}

void ArcherPrefetchHandle::CheckHintsLocked(const int64_t* ids,
                                            const int64_t* when, size_t n,
                                            int64_t now, bool set_now) const {
  if (set_now && now < hint_clock_) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "now=" + std::to_string(now) +
                            " is earlier than the hint clock (" +
                            std::to_string(hint_clock_) +
                            "); the clock never goes back");
  }
  for (size_t i = 0; i < n; ++i) {
    if (when[i] < 0) {
      throw PrefetchError(ErrorKind::kInvalidArgument,
                          "next-use time " + std::to_string(when[i]) +
                              " (at index " + std::to_string(i) +
                              ") is negative");
    }
  }
  ValidateIdsLocked(ids, n);
}

// Note [One call per layer]
// A decode step crosses into the engine once per MoE layer: Step releases
// the layer before (its compute is queued on the stream by now, so the one
// token recorded covers it), cancels the caller's guesses for this layer
// still queued, moves the hints, acquires this layer's experts and
// queues the guesses for later layers. Release -> acquire -> prefetch is
// also the order the cache wants: the slots the last layer held are free to
// take, and this layer's misses are issued before any speculation.
void ArcherPrefetchHandle::Step(const StepArgs& a) {
  CheckPriority(a.prefetch_band);
  if (!(a.timeout_s >= 0) || std::isinf(a.timeout_s)) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "timeout must be a finite number of seconds >= 0");
  }
  CheckNotForked();
  {
    std::lock_guard<std::mutex> lk(mu_);
    CheckUsableLocked();
    ValidateIdsLocked(a.release_ids, a.n_release);
    ValidateIdsLocked(a.cancel_ids, a.n_cancel);
    CheckHintsLocked(a.hint_ids, a.hint_when, a.n_hint, a.now, a.set_now);
    ValidateIdsLocked(a.acquire_ids, a.n_acquire);
    CheckFitsLocked(a.acquire_ids, a.n_acquire);
    ValidateIdsLocked(a.prefetch_ids, a.n_prefetch);
    ValidateIdsLocked(a.pin_ids, a.n_pin);
    ValidateIdsLocked(a.use_ids, a.n_use);
    if (a.n_pin > 0 && a.pin_offsets == nullptr) {
      throw PrefetchError(ErrorKind::kInvalidArgument, "pin_ids without pin_offsets");
    }
    if (a.n_release > 0) {
      ReleaseLocked(a.release_ids, a.n_release, a.release_streams);
    }
    if (a.n_cancel > 0) CancelLocked(a.cancel_ids, a.n_cancel);
    if (a.n_hint > 0 || a.set_now) {
      HintLocked(a.hint_ids, a.hint_when, a.n_hint, a.now, a.set_now);
    }
    if (a.n_use > 0) UseLocked(a.use_ids, a.n_use);
    if (a.n_pin > 0) PinResidentLocked(a.pin_ids, a.n_pin, a.streams, a.pin_offsets);
  }
  if (a.n_acquire > 0) {
    Acquire(a.acquire_ids, a.n_acquire, a.streams, a.timeout_s, a.slots);
  }
  if (a.n_prefetch > 0) {
    EnqueuePrefetchTensors(a.prefetch_ids, a.n_prefetch, a.prefetch_band);
  }
}

// Note [Pins without waiting]
// The sync-free decode path (prefetch/hf.py, Note [Sync-free decode]) does
// not know a layer's routing on the host when it computes: the GPU reads
// each routed expert from its cache slot when resident, else straight from
// page-locked host memory. Before the layer runs it pins every expert of
// the layer that is resident, so none of them can be evicted under the
// kernels (the usual release records their completion token). A pin is not
// a use (pinning a whole layer would make every one of its experts look
// used); the routing, read back later, reports the uses (UseLocked). An
// entry whose copy is issued but not complete is pinned too: the stream
// waits for the copy on the GPU (no stream: left unpinned, -1). The pins
// count as one Acquire call on the eviction policies' clock (one layer).
void ArcherPrefetchHandle::PinResidentLocked(const int64_t* ids, size_t n,
                                             const uintptr_t* streams,
                                             int64_t* offsets) {
  ++acquire_calls_;
  for (auto& dev : devices_) dev->cache->policy().OnAcquireCall();
  const bool async = backend_->IsAsync();
  size_t i = 0;
  try {
    for (; i < n; ++i) {
      Entry* e = LookupLocked(ids[i]);
      offsets[i] = -1;
      if (e->state != EntryState::kResident) continue;
      if (async && !backend_->Query(e->ready)) {
        const uintptr_t stream = streams == nullptr ? kNoStream : streams[e->device];
        if (stream == kNoStream) continue;
        backend_->StreamWait(stream, e->ready);
      }
      PinLocked(e);
      offsets[i] = static_cast<int64_t>(e->slot_offset);
    }
  } catch (...) {
    for (size_t j = 0; j < i; ++j) {
      if (offsets[j] >= 0) UnpinOneLocked(LookupLocked(ids[j]));
      offsets[j] = -1;
    }
    throw;
  }
}

// Uses reported after the fact (Note [Pins without waiting]): a resident
// entry counts as used now; one that is not is marked, so that it counts as
// used when its copy lands (a prefetch of it, if any, is the caller's).
void ArcherPrefetchHandle::UseLocked(const int64_t* ids, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    Entry* e = LookupLocked(ids[i]);
    if (e->state == EntryState::kResident) {
      e->prefetched_unused = false;
      e->want_at = 0;
      devices_[e->device]->cache->policy().OnUse(e);
    } else {
      e->use_on_arrival = true;
    }
  }
}

void ArcherPrefetchHandle::Acquire(const int64_t* ids, size_t n,
                                   const uintptr_t* streams, double timeout_s,
                                   SlotInfo* slots) {
  if (!(timeout_s >= 0) || std::isinf(timeout_s)) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "timeout must be a finite number of seconds >= 0");
  }
  if (n == 0) return;
  CheckNotForked();
  std::unique_lock<std::mutex> lk(mu_);
  CheckUsableLocked();
  ValidateIdsLocked(ids, n);
  CheckFitsLocked(ids, n);
  ++acquire_calls_;
  for (auto& dev : devices_) dev->cache->policy().OnAcquireCall();
  const bool async = backend_->IsAsync();
  std::vector<uint64_t> error_seq(n);
  uint64_t wake_mask = 0;
  size_t kept_error_at = n;
  for (size_t i = 0; i < n; ++i) {
    Entry* e = LookupLocked(ids[i]);
    PinLocked(e);
    ++stats_.acquires;
    error_seq[i] = e->error_seq;
    const bool complete = e->state == EntryState::kResident &&
                          (!async || backend_->Query(e->ready));
    if (complete) {
      ++stats_.hits;
      continue;
    }
    ++stats_.misses;
    if (e->state == EntryState::kCopying ||
        e->state == EntryState::kResident) {
      ++stats_.late;
    } else if (e->state == EntryState::kHost && !e->error.empty() &&
               kept_error_at == n) {
      kept_error_at = i;  // a failed prefetch: its acquirer gets the error
    }
    TaskQueue& q = devices_[e->device]->queue;
    if (e->state == EntryState::kHost) {
      q.PushBack(e, kOnDemandBand);
      e->state = EntryState::kQueued;
      ++stats_.on_demand;
      wake_mask |= uint64_t{1} << e->device;
    } else if (e->state == EntryState::kQueued && e->band != kOnDemandBand) {
      q.Remove(e);
      q.PushBack(e, kOnDemandBand);
      ++stats_.upgraded;
      wake_mask |= uint64_t{1} << e->device;
    }
  }
  if (kept_error_at != n) {
    Entry* e = LookupLocked(ids[kept_error_at]);
    const std::string message = IdText(e->id) + ": copy failed: " + e->error;
    e->error.clear();
    UnpinLocked(ids, n);
    WakeWorkersLocked(wake_mask);
    throw PrefetchError(ErrorKind::kCopyFailed, message);
  }
  ++active_calls_;
  // Note [Caller-runs on-demand copies]: on an async backend issuing a copy
  // costs microseconds, so the acquirer issues the copies of ids it is
  // waiting for itself, at band 0, instead of handing them to the worker
  // and waiting for two thread wake-ups. On the host backend the copy is the
  // memcpy itself and stays on the worker, so `timeout` bounds the wait.
  if (async && !paused_) {
    for (size_t i = 0; i < n && !stop_; ++i) {
      Entry* e = LookupLocked(ids[i]);
      if (e->state != EntryState::kQueued) continue;  // issued, or ours already
      DeviceState* dev = devices_[e->device].get();
      bool wait_for_events = false;
      if (!ReserveSlotLocked(dev, e, &wait_for_events)) continue;  // worker's job
      dev->queue.Remove(e);
      e->band = kOnDemandBand;
      CopyEntryLocked(dev, e, lk);
      if (e->state == EntryState::kResident) ++stats_.caller_copies;
    }
  }
  WakeWorkersLocked(wake_mask);

  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(timeout_s));
  std::string failure;
  ErrorKind failure_kind = ErrorKind::kTimeout;
  bool timed_out = false;
  for (;;) {
    Entry* pending = nullptr;  // first id not resident yet
    for (size_t i = 0; i < n; ++i) {
      Entry* e = LookupLocked(ids[i]);
      if (e->error_seq != error_seq[i]) {
        failure = IdText(e->id) + ": copy failed: " + e->error;
        failure_kind = ErrorKind::kCopyFailed;
        e->error.clear();
        break;
      }
      if (e->state != EntryState::kResident && pending == nullptr) pending = e;
    }
    if (failure.empty() && stop_) {
      failure = "PrefetchHandle was closed while acquire waited";
      failure_kind = ErrorKind::kClosed;
    }
    if (failure.empty() && pending == nullptr) break;
    if (failure.empty() && timed_out) {
      failure = "acquire timed out after " + std::to_string(timeout_s) +
                " s waiting for " + IdText(pending->id) + " (" +
                StateName(pending->state) + (paused_ ? ", workers paused" : "") +
                (devices_[pending->device]->worker_failed
                     ? ", the copy worker of its device failed"
                     : "") +
                "; the cache of device " + std::to_string(pending->device) +
                " may be full of acquired tensors)";
    }
    if (!failure.empty()) {
      UnpinLocked(ids, n);
      --active_calls_;
      if (active_calls_ == 0) idle_cv_.notify_all();
      throw PrefetchError(failure_kind, failure);
    }
    // One more pass after the deadline, so a copy that finished just then
    // still counts.
    timed_out = ready_cv_.wait_until(lk, deadline) == std::cv_status::timeout;
  }

  std::vector<CopyToken> cpu_waits;
  std::string stream_error;
  for (size_t i = 0; i < n; ++i) {
    Entry* e = LookupLocked(ids[i]);
    e->prefetched_unused = false;
    e->want_at = 0;
    devices_[e->device]->cache->policy().OnUse(e);
    slots[i].offset = e->slot_offset;
    slots[i].bytes = e->bytes;
    slots[i].device = e->device;
    if (async && stream_error.empty() && !backend_->Query(e->ready)) {
      const uintptr_t stream = streams == nullptr ? kNoStream : streams[e->device];
      if (stream == kNoStream) {
        cpu_waits.push_back(e->ready);
        continue;
      }
      try {
        backend_->StreamWait(stream, e->ready);
      } catch (const std::exception& ex) {
        stream_error = ex.what();
      }
    }
  }
  if (!stream_error.empty()) {  // nothing stays pinned, Close is not held up
    UnpinLocked(ids, n);
    --active_calls_;
    if (active_calls_ == 0) idle_cv_.notify_all();
    throw PrefetchError(ErrorKind::kCopyFailed, stream_error);
  }
  lk.unlock();
  // Pinned entries keep their tokens (Note [Completion tokens]).
  std::string wait_error;
  for (CopyToken t : cpu_waits) {
    try {
      backend_->Wait(t);
    } catch (const std::exception& ex) {
      if (wait_error.empty()) wait_error = ex.what();
    }
  }
  lk.lock();
  --active_calls_;
  if (active_calls_ == 0) idle_cv_.notify_all();
  if (!wait_error.empty()) {
    UnpinLocked(ids, n);
    throw PrefetchError(ErrorKind::kCopyFailed, wait_error);
  }
}

void ArcherPrefetchHandle::Release(const int64_t* ids, size_t n,
                                   const uintptr_t* streams) {
  if (n == 0) return;
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  ValidateIdsLocked(ids, n);
  ReleaseLocked(ids, n, streams);
}

// Note [One token per release]
// A release names the consumers' stream work that still reads the slots. One
// event recorded on a device's stream covers every id of that device in the
// call, so it is recorded once per stream and shared (RetainToken per id).
// Order: check every pin, make each stream wait on the previous holders'
// pending uses (so the new token covers them too), record; only then unpin.
// Anything that throws does so before an id is unpinned, so a failed release
// changes nothing and no slot can be reused under a running kernel.
void ArcherPrefetchHandle::ReleaseLocked(const int64_t* ids, size_t n,
                                         const uintptr_t* streams) {
  // Pins: decrement tentatively so duplicates count, then undo in any case.
  size_t i = 0;
  for (; i < n; ++i) {
    Entry* e = LookupLocked(ids[i]);
    if (e->pins <= 0) break;
    --e->pins;
  }
  for (size_t j = 0; j < i; ++j) ++LookupLocked(ids[j])->pins;
  if (i != n) {
    throw PrefetchError(ErrorKind::kState,
                        IdText(ids[i]) + " is not acquired (release "
                                         "without a matching acquire)");
  }
  const int device_count = DeviceCount();
  CopyToken tokens[kMaxDevices];
  for (int d = 0; d < device_count; ++d) tokens[d] = kTokenDone;
  uint64_t mask = 0;
  if (backend_->IsAsync() && streams != nullptr) {
    uint64_t recorded = 0;
    try {
      // A previous holder's use still pending: the stream waits for it, so
      // the new token covers it. Ids released together share a token, so
      // one query answers for a run of them.
      CopyToken known = kTokenDone;
      for (size_t k = 0; k < n; ++k) {
        Entry* e = LookupLocked(ids[k]);
        const uintptr_t stream = streams[e->device];
        if (stream == kNoStream || e->last_use == kTokenDone ||
            e->last_use == known) {
          continue;
        }
        if (!backend_->Query(e->last_use)) {
          backend_->StreamWait(stream, e->last_use);
        }
        known = e->last_use;
      }
      for (size_t k = 0; k < n; ++k) {
        Entry* e = LookupLocked(ids[k]);
        const uintptr_t stream = streams[e->device];
        if (stream == kNoStream || ((recorded >> e->device) & 1u)) continue;
        tokens[e->device] = backend_->RecordOnStream(e->device, stream);
        recorded |= uint64_t{1} << e->device;
      }
    } catch (...) {
      for (int d = 0; d < device_count; ++d) backend_->ReleaseToken(tokens[d]);
      throw;
    }
  }
  for (size_t k = 0; k < n; ++k) {
    Entry* e = LookupLocked(ids[k]);
    mask |= uint64_t{1} << e->device;
    const CopyToken t = tokens[e->device];
    if (t != kTokenDone) {
      backend_->ReleaseToken(e->last_use);
      backend_->RetainToken(t);
      e->last_use = t;
    }
    UnpinOneLocked(e);
  }
  for (int d = 0; d < device_count; ++d) backend_->ReleaseToken(tokens[d]);
  // Only a worker waiting for room cares that a slot became free: waking an
  // idle one costs the releasing thread a futex call and a handoff of the
  // lock (measured: 0.8 us warm, 36 us after the caches went cold under a
  // model's forward, most of a layer's engine call).
  for (int d = 0; d < device_count; ++d) {
    DeviceState* dev = devices_[d].get();
    if (((mask >> d) & 1u) && dev->worker_needs_room) dev->work_cv.notify_one();
  }
}

// ------------------------------------------------------------------ worker

void ArcherPrefetchHandle::FreeSlotLocked(DeviceState* dev, Entry* e) {
  if (poison_freed_slots_) {
    try {
      backend_->Fill(dev->index, dev->cache->arena() + e->slot_offset,
                     e->slot_bytes, kPoisonByte);
    } catch (...) {
      // Poisoning is a debugging aid; a failure to poison frees the slot as is.
    }
  }
  dev->cache->Free(e->slot_offset, e->slot_bytes);
}

void ArcherPrefetchHandle::DropSlotLocked(DeviceState* dev, Entry* e) {
  DropInflightLocked(dev, e);
  dev->cache->RemoveResident(e);
  FreeSlotLocked(dev, e);
  backend_->ReleaseToken(e->ready);
  backend_->ReleaseToken(e->last_use);
  e->ready = e->last_use = kTokenDone;
}

void ArcherPrefetchHandle::EvictLocked(DeviceState* dev, Entry* e) {
  DropSlotLocked(dev, e);
  e->state = EntryState::kHost;
  ++stats_.evictions;
  if (e->prefetched_unused) ++stats_.wasted;
  e->prefetched_unused = false;
}

// Note [Speculation never hurts]
// A prefetch is a guess; a miss is a kernel waiting. Three rules keep the
// guesses out of the misses' way:
// - Admission: a speculative copy (band > 0) may not evict an entry needed
//   no later than itself: a prefetched entry not yet acquired whose wanted-by
//   acquire call (Entry::want_at: the acquire-call clock at its request plus
//   its band) has not passed and is not after the newcomer's, or, with
//   hints, an entry whose valid next use is no later than the newcomer's.
//   If only such entries could make room, the guess is declined (dropped
//   back to the host state, Stats::declined), not queued behind them.
// - While an on-demand copy is being issued or in flight on a device, its
//   worker starts no speculative copy: the link belongs to the misses.
// - Speculative bytes in flight are capped (max_speculative_bytes_in_flight,
//   default two chunks), so a miss issued now queues behind at most that
//   much speculation on the copy engines.
// On-demand copies (band 0) are never refused or held back by these rules.
bool ArcherPrefetchHandle::ReserveSlotLocked(DeviceState* dev, Entry* e,
                                             bool* wait_for_events,
                                             bool* refused) {
  struct Ctx {
    CopyBackend* backend;
    const Entry* incoming;   // null: an on-demand copy, no admission control
    uint64_t acquire_calls;  // the clock of want_at
    int64_t hint_clock;      // the clock of next_use
    bool pending_seen;  // an unpinned victim waits only on GPU work
    bool refused_seen;  // a victim is needed sooner than the newcomer
  } ctx{backend_.get(),
        e->band == kOnDemandBand || e->pins > 0 ? nullptr : e,
        acquire_calls_, hint_clock_, false, false};
  auto evictable = [](Entry* v, void* raw) {
    auto* c = static_cast<Ctx*>(raw);
    if (v->pins > 0) return false;
    if (!c->backend->Query(v->ready) || !c->backend->Query(v->last_use)) {
      c->pending_seen = true;
      return false;
    }
    const Entry* in = c->incoming;
    if (in != nullptr) {
      const bool wanted_sooner = v->want_at != 0 &&
                                 v->want_at >= c->acquire_calls &&
                                 v->want_at <= in->want_at;
      const bool hinted_sooner = in->next_use != kNoNextUse &&
                                 v->next_use != kNoNextUse &&
                                 v->next_use >= c->hint_clock &&
                                 v->next_use <= in->next_use;
      if (wanted_sooner || hinted_sooner) {
        c->refused_seen = true;
        return false;
      }
    }
    return true;
  };
  for (;;) {
    if (dev->cache->Allocate(e->bytes, &e->slot_offset, &e->slot_bytes)) {
      return true;
    }
    Entry* victim = dev->cache->policy().PickVictim(evictable, &ctx);
    if (victim == nullptr) {
      *wait_for_events = ctx.pending_seen;
      if (refused != nullptr) *refused = ctx.refused_seen;
      return false;
    }
    EvictLocked(dev, victim);
  }
}

void ArcherPrefetchHandle::DropInflightLocked(DeviceState* dev, Entry* e) {
  auto it = std::find(dev->inflight.begin(), dev->inflight.end(), e);
  if (it != dev->inflight.end()) {
    dev->inflight_bytes -= e->bytes;
    if (e->band == kOnDemandBand) dev->inflight_urgent_bytes -= e->bytes;
    dev->inflight.erase(it);
  }
}

// Copies on different streams finish out of issue order (an on-demand copy
// overtakes the lanes), so every finished entry leaves, not just a prefix.
void ArcherPrefetchHandle::RetireInflightLocked(DeviceState* dev) {
  auto& q = dev->inflight;
  auto keep = q.begin();
  for (auto it = q.begin(); it != q.end(); ++it) {
    Entry* e = *it;
    if (backend_->Query(e->ready)) {
      dev->inflight_bytes -= e->bytes;
      if (e->band == kOnDemandBand) dev->inflight_urgent_bytes -= e->bytes;
    } else {
      *keep++ = e;
    }
  }
  q.erase(keep, q.end());
}

bool ArcherPrefetchHandle::SpeculationAllowedLocked(
    const DeviceState* dev) const {
  // The worker loop retired finished copies just before asking.
  // copying_bytes > 0 here (outside the worker's own copy) is an acquirer
  // issuing its misses.
  return dev->copying_bytes == 0 && dev->inflight_urgent_bytes == 0 &&
         dev->inflight_bytes < max_speculative_bytes_;
}

void ArcherPrefetchHandle::WorkerLoop(DeviceState* dev) {
  std::string bind_error;
  try {
    backend_->BindWorkerThread(dev->index);
  } catch (const std::exception& ex) {
    bind_error = ex.what();
  }
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    if (dev->inflight_bytes > 0) RetireInflightLocked(dev);
    if (paused_ || dev->queue.empty()) {
      dev->worker_waiting = true;
      dev->work_cv.wait(lk);
      dev->worker_waiting = false;
      continue;
    }
    Entry* e = dev->queue.PeekMostUrgent();
    if (!bind_error.empty()) {
      dev->queue.Remove(e);
      e->state = EntryState::kHost;
      e->error = "copy worker could not start: " + bind_error;
      ++e->error_seq;
      ++stats_.copy_errors;
      ready_cv_.notify_all();
      continue;
    }
    // Speculation waits for the misses and for its own cap (Note
    // [Speculation never hurts]); every copy waits for max_bytes_in_flight.
    const bool held_back =
        e->band != kOnDemandBand && !SpeculationAllowedLocked(dev);
    if (held_back && dev->inflight.empty()) {
      // An acquirer is issuing misses right now: let it finish.
      dev->worker_waiting = true;
      dev->work_cv.wait_for(lk, std::chrono::microseconds(50));
      dev->worker_waiting = false;
      continue;
    }
    if (held_back || (!dev->inflight.empty() &&
                      dev->inflight_bytes + e->bytes > max_bytes_in_flight_)) {
      Entry* first = dev->inflight.front();
      if (dev->inflight_urgent_bytes > 0) {
        for (Entry* f : dev->inflight) {
          if (f->band == kOnDemandBand) {
            first = f;
            break;
          }
        }
      }
      const CopyToken oldest = first->ready;
      lk.unlock();
      try {
        backend_->Wait(oldest);
      } catch (...) {
        // A failed wait surfaces to the acquirer of that entry.
      }
      lk.lock();
      RetireInflightLocked(dev);
      continue;
    }
    bool wait_for_events = false;
    bool refused = false;
    if (!ReserveSlotLocked(dev, e, &wait_for_events, &refused)) {
      if (refused && !wait_for_events && e->band != kOnDemandBand &&
          e->pins == 0) {
        // Only entries needed sooner could make room: drop the guess.
        dev->queue.Remove(e);
        e->state = EntryState::kHost;
        e->want_at = 0;
        ++stats_.declined;
        continue;
      }
      // Every slot is pinned (or still read on a stream): wait for a
      // release, an unregister or close. GPU-side uses complete without a
      // notification, so then poll.
      dev->worker_waiting = true;
      dev->worker_needs_room = true;
      if (wait_for_events) {
        dev->work_cv.wait_for(lk, std::chrono::microseconds(100));
      } else {
        dev->work_cv.wait(lk);
      }
      dev->worker_waiting = false;
      dev->worker_needs_room = false;
      continue;
    }
    dev->queue.Remove(e);
    CopyEntryLocked(dev, e, lk);
  }
  dev->worker_waiting = false;
}

void ArcherPrefetchHandle::CopyEntryLocked(DeviceState* dev, Entry* e,
                                           std::unique_lock<std::mutex>& lk) {
  e->state = EntryState::kCopying;
  dev->copying_bytes += e->bytes;
  const bool urgent = e->band == kOnDemandBand;
  // Every chunk of an entry goes down one lane, so the last chunk's token
  // covers the whole entry; entries alternate between lanes.
  const int lane = urgent ? 0 : static_cast<int>(dev->next_lane++ % copy_lanes_);
  char* dst = dev->cache->arena() + e->slot_offset;
  const char* src = static_cast<const char*>(e->host_ptr);
  CopyToken token = kTokenDone;
  std::string error;
  size_t done = 0;
  while (done < e->bytes) {
    const size_t chunk = std::min(copy_chunk_bytes_, e->bytes - done);
    lk.unlock();
    const Clock::time_point start = Clock::now();
    try {
      const CopyToken t =
          backend_->Copy(dev->index, dst + done, src + done, chunk, urgent,
                         lane, /*want_token=*/true);
      backend_->ReleaseToken(token);
      token = t;
    } catch (const std::exception& ex) {
      error = ex.what();
    } catch (...) {
      error = "unknown error in the copy backend";
    }
    const double seconds =
        std::chrono::duration<double>(Clock::now() - start).count();
    lk.lock();
    stats_.copy_seconds += seconds;
    if (!error.empty()) break;
    done += chunk;
    if (stop_ && done < e->bytes) {
      error = "PrefetchHandle closed during the copy";
      break;
    }
    // Between chunks an on-demand request overtakes a long prefetch.
    if (!urgent && done < e->bytes && dev->queue.HasBand(kOnDemandBand)) {
      Entry* u = dev->queue.PeekMostUrgent();
      bool wait_for_events = false;
      if (ReserveSlotLocked(dev, u, &wait_for_events)) {
        dev->queue.Remove(u);
        CopyEntryLocked(dev, u, lk);  // urgent: never recurses further
      }
    }
  }
  dev->copying_bytes -= e->bytes;
  if (!error.empty()) {
    if (token != kTokenDone) {
      lk.unlock();
      try {
        backend_->Wait(token);  // chunks already issued still target the slot
      } catch (...) {
      }
      lk.lock();
      backend_->ReleaseToken(token);
    }
    FreeSlotLocked(dev, e);
    e->state = EntryState::kHost;
    e->error = error;
    ++e->error_seq;
    ++stats_.copy_errors;
  } else {
    e->state = EntryState::kResident;
    e->ready = token;
    e->error.clear();
    e->prefetched_unused = e->pins == 0;
    dev->cache->AddResident(e);
    if (e->use_on_arrival) {  // read from host memory while it was missing
      e->use_on_arrival = false;
      e->prefetched_unused = false;
      dev->cache->policy().OnUse(e);
    }
    if (token != kTokenDone) {
      dev->inflight.push_back(e);
      dev->inflight_bytes += e->bytes;
      if (e->band == kOnDemandBand) dev->inflight_urgent_bytes += e->bytes;
    }
    ++stats_.copies;
    stats_.bytes_copied += e->bytes;
  }
  ready_cv_.notify_all();
}

// ----------------------------------------------------------------- control

std::vector<std::pair<int, int64_t>> ArcherPrefetchHandle::QueueSnapshot(
    int device) const {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  if (device < 0 || device >= DeviceCount()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "no device " + std::to_string(device));
  }
  std::vector<std::pair<int, int64_t>> out;
  devices_[device]->queue.ForEach(
      [&out](Entry* e) { out.emplace_back(e->band, e->id); });
  return out;
}

std::vector<int64_t> ArcherPrefetchHandle::ResidentSnapshot(int device) const {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  if (device < 0 || device >= DeviceCount()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "no device " + std::to_string(device));
  }
  std::vector<int64_t> out;
  devices_[device]->cache->policy().ForEach(
      [](Entry* e, void* ctx) {
        static_cast<std::vector<int64_t>*>(ctx)->push_back(e->id);
      },
      &out);
  return out;
}

void ArcherPrefetchHandle::DebugHoldCopies(int device, uintptr_t stream) {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  if (device < 0 || device >= DeviceCount()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "no device " + std::to_string(device));
  }
  backend_->HoldCopiesUntil(device, stream);
}

void ArcherPrefetchHandle::Pause() {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  paused_ = true;
}

void ArcherPrefetchHandle::Resume() {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  CheckUsableLocked();
  paused_ = false;
  for (auto& dev : devices_) dev->work_cv.notify_one();
  ready_cv_.notify_all();
}

Stats ArcherPrefetchHandle::GetStats() const {
  CheckNotForked();
  std::lock_guard<std::mutex> lk(mu_);
  Stats s = stats_;
  for (const auto& dev : devices_) {
    s.queue_depth += dev->queue.size();
    s.resident_count += dev->cache->resident_count();
    s.resident_bytes += dev->cache->used_bytes();
    s.bytes_in_flight += dev->copying_bytes;
    s.bytes_in_flight += dev->inflight_bytes;
  }
  s.registered = registered_;
  s.registered_bytes = registered_bytes_;
  s.pinned_count = pinned_entries_;
  return s;
}

bool ArcherPrefetchHandle::IsClosed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return closed_;
}

void ArcherPrefetchHandle::Close() {
  if (static_cast<long>(::getpid()) != owner_pid_) {
    // A forked child: the workers and possibly the lock's owner live only in
    // the parent. Touch nothing; the child's copy of the memory is freed
    // with the process.
    for (auto& dev : devices_) {
      if (dev->worker.joinable()) dev->worker.detach();
    }
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
    for (auto& dev : devices_) {
      dev->queue.RemoveAtOrBelow(0, [](Entry* e) {
        e->state = EntryState::kHost;
      });
      dev->work_cv.notify_all();
    }
    ready_cv_.notify_all();
  }
  for (auto& dev : devices_) {
    if (dev->worker.joinable()) dev->worker.join();
  }
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [this] { return active_calls_ == 0; });
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
  pinned_entries_ = 0;
  registered_ = 0;
  registered_bytes_ = 0;
  for (auto& dev : devices_) {
    dev->inflight.clear();
    dev->inflight_bytes = 0;
    if (dev->owns_arena) {
      backend_->FreeDevice(dev->index, dev->cache->arena(),
                           dev->cache->budget_bytes());
      dev->owns_arena = false;
    }
  }
}

}  // namespace prefetch
