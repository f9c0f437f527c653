// ArcherPrefetchHandle: Step, acquire and release (the serving thread's calls).
#include "archer_prefetch_handle.h"
#include "handle_internal.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace prefetch {

using detail::IdText;
using detail::StateName;
using detail::SteadyNs;
using detail::TokenDone;

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
    MutexLock lk(mu_);
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
    // Checked above: the acquire goes on under the same lock.
    if (a.n_acquire > 0) {
      AcquireLocked(a.acquire_ids, a.n_acquire, a.streams, a.timeout_s, a.slots, lk);
    }
    if (a.n_prefetch > 0) QueueStepPrefetchesLocked(a);
  }
}

// Note [A step's prefetches after its wait]
// Step checks its prefetch ids with the rest, but an acquire that waits
// drops the lock (for its wait, its own copies and its CPU waits), and
// another thread may unregister a prefetch id or close the handle
// meanwhile. The prefetches are queued under the lock the acquire ends
// with, so no later window is left. A prefetch is a guess: one whose id is
// gone by then is dropped and the step succeeds with the others queued
// (the step used to raise after its acquire had succeeded, and the
// caller, told nothing was held, never released the acquire's pins). A
// handle closed meanwhile raises kClosed, as any call after Close does,
// and queues nothing behind Close's emptied queues.
void ArcherPrefetchHandle::QueueStepPrefetchesLocked(const StepArgs& a) {
  CheckUsableLocked();
  const Clock::time_point start = Clock::now();
  try {
    EnqueuePrefetchLocked(a.prefetch_ids, a.n_prefetch, a.prefetch_band, start);
    return;
  } catch (const PrefetchError& ex) {
    if (ex.kind() != ErrorKind::kUnknownId) throw;
  }
  // Rare (a race with UnregisterTensor): the ids still registered.
  std::vector<int64_t> kept;
  kept.reserve(a.n_prefetch);
  for (size_t i = 0; i < a.n_prefetch; ++i) {
    if (LookupLocked(a.prefetch_ids[i]) != nullptr) kept.push_back(a.prefetch_ids[i]);
  }
  stats_.prefetches_gone += a.n_prefetch - kept.size();
  if (!kept.empty()) {
    EnqueuePrefetchLocked(kept.data(), kept.size(), a.prefetch_band, start);
  }
}

// Note [Pins without waiting]
// The sync-free decode path (prefetch/hf_experts.py, Note [Sync-free decode]) does
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
  TickAcquireClockLocked();
  const bool async = backend_->IsAsync();
  size_t i = 0;
  try {
    for (; i < n; ++i) {
      Entry* e = LookupLocked(ids[i]);
      offsets[i] = -1;
      if (e->state != EntryState::kResident) continue;
      if (async && !TokenDone(backend_.get(), &e->ready)) {
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
      devices_[e->device]->cache->Used(e);
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
  MutexLock lk(mu_);
  CheckUsableLocked();
  ValidateIdsLocked(ids, n);
  CheckFitsLocked(ids, n);
  AcquireLocked(ids, n, streams, timeout_s, slots, lk);
}

// An acquire, in four steps: pin every id and queue the misses at band 0;
// issue the copies this thread can issue itself; wait until every id is
// resident; then hand out the slots (the stream waits for copies still in
// flight, or the CPU does). Any failure leaves nothing pinned.
void ArcherPrefetchHandle::AcquireLocked(const int64_t* ids, size_t n,
                                         const uintptr_t* streams,
                                         double timeout_s, SlotInfo* slots,
                                         MutexLock& lk) {
  TickAcquireClockLocked();
  std::vector<uint64_t> error_seq(n);
  const uint64_t wake_mask = PinAndQueueMissesLocked(ids, n, error_seq.data());
  ++active_calls_;
  IssueOwnCopiesLocked(ids, n, lk);
  WakeWorkersLocked(wake_mask);
  WaitUntilResidentLocked(ids, n, error_seq.data(), timeout_s, lk);
  HandOutSlotsLocked(ids, n, streams, slots, lk);
}

// Pins every id and counts it; a miss not yet queued goes to band 0 (one
// queued at a lower band moves up). A prefetch of an id that failed hands
// its error to this acquire: then nothing stays pinned and kCopyFailed is
// thrown. Returns the devices whose workers have new work. Records each
// id's error sequence, so WaitUntilResidentLocked sees copies that fail.
uint64_t ArcherPrefetchHandle::PinAndQueueMissesLocked(const int64_t* ids,
                                                       size_t n,
                                                       uint64_t* error_seq) {
  const bool async = backend_->IsAsync();
  uint64_t wake_mask = 0;
  size_t kept_error_at = n;
  for (size_t i = 0; i < n; ++i) {
    Entry* e = LookupLocked(ids[i]);
    PinLocked(e);
    ++stats_.acquires;
    error_seq[i] = e->error_seq;
    const bool complete = e->state == EntryState::kResident &&
                          (!async || TokenDone(backend_.get(), &e->ready));
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
  return wake_mask;
}

// Note [Caller-runs on-demand copies]: on an async backend issuing a copy
// costs microseconds, so the acquirer issues the copies of ids it is
// waiting for itself, at band 0, instead of handing them to the worker and
// waiting for two thread wake-ups. On the host backend the copy is the
// memcpy itself and stays on the worker, so `timeout` bounds the wait.
// Drops and retakes `lk` while issuing (CopyEntryLocked).
void ArcherPrefetchHandle::IssueOwnCopiesLocked(const int64_t* ids, size_t n,
                                                MutexLock& lk) {
  if (!backend_->IsAsync() || paused_) return;
  for (size_t i = 0; i < n && !stop_; ++i) {
    Entry* e = LookupLocked(ids[i]);
    if (e->state != EntryState::kQueued) continue;  // issued, or ours already
    if (!ReadyToCopyLocked(e)) continue;  // a reader stages it (Note [Host tier])
    DeviceState* dev = devices_[e->device].get();
    bool wait_for_events = false;
    if (!ReserveSlotLocked(dev, e, &wait_for_events)) continue;  // worker's job
    dev->queue.Remove(e);
    e->band = kOnDemandBand;
    CopyEntryLocked(dev, e, lk);
    if (e->state == EntryState::kResident) ++stats_.caller_copies;
  }
}

// Waits on ready_cv_ until every id is resident (its copy issued), a copy
// of one fails, the handle closes or `timeout_s` passes; on failure unpins
// every id, ends this active call and throws.
void ArcherPrefetchHandle::WaitUntilResidentLocked(
    const int64_t* ids, size_t n, const uint64_t* error_seq, double timeout_s,
    MutexLock& lk) {
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
    if (failure.empty() && pending == nullptr) return;
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
      EndActiveCallLocked();
      throw PrefetchError(failure_kind, failure);
    }
    // One more pass after the deadline, so a copy that finished just then
    // still counts.
    timed_out = ready_cv_.wait_until(lk, deadline) == std::cv_status::timeout;
  }
}

// Every id is resident: records the use, fills `slots`, and makes each
// copy still in flight a wait of the id's stream (without a stream, of
// the CPU, outside the lock). Ends this active call; a failed wait unpins
// every id and throws kCopyFailed.
void ArcherPrefetchHandle::HandOutSlotsLocked(const int64_t* ids, size_t n,
                                              const uintptr_t* streams,
                                              SlotInfo* slots,
                                              MutexLock& lk) {
  const bool async = backend_->IsAsync();
  std::vector<CopyToken> cpu_waits;
  std::string stream_error;
  for (size_t i = 0; i < n; ++i) {
    Entry* e = LookupLocked(ids[i]);
    e->prefetched_unused = false;
    e->want_at = 0;
    devices_[e->device]->cache->Used(e);
    slots[i].offset = e->slot_offset;
    slots[i].bytes = e->bytes;
    slots[i].device = e->device;
    if (async && stream_error.empty() && !TokenDone(backend_.get(), &e->ready)) {
      const uintptr_t stream = streams == nullptr ? kNoStream : streams[e->device];
      if (stream == kNoStream) {
        backend_->RetainToken(e->ready);  // Note [Completed tokens]
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
    for (CopyToken t : cpu_waits) backend_->ReleaseToken(t);
    UnpinLocked(ids, n);
    EndActiveCallLocked();
    throw PrefetchError(ErrorKind::kCopyFailed, stream_error);
  }
  DropLock(lk);
  // Each wait holds its own reference (Note [Completed tokens]).
  std::string wait_error;
  for (CopyToken t : cpu_waits) {
    try {
      backend_->Wait(t);
    } catch (const std::exception& ex) {
      if (wait_error.empty()) wait_error = ex.what();
    }
    backend_->ReleaseToken(t);
  }
  RetakeLock(lk);
  EndActiveCallLocked();
  if (!wait_error.empty()) {
    UnpinLocked(ids, n);
    throw PrefetchError(ErrorKind::kCopyFailed, wait_error);
  }
}

// One layer on the clock of want_at and of the eviction policies: each
// Acquire call, or each Step that pins a layer instead.
void ArcherPrefetchHandle::TickAcquireClockLocked() {
  ++acquire_calls_;
  for (auto& dev : devices_) dev->cache->AcquireCall();
}

void ArcherPrefetchHandle::EndActiveCallLocked() {
  --active_calls_;
  if (active_calls_ == 0) idle_cv_.notify_all();
}

void ArcherPrefetchHandle::Release(const int64_t* ids, size_t n,
                                   const uintptr_t* streams) {
  if (n == 0) return;
  CheckNotForked();
  MutexGuard lk(mu_);
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
        known = e->last_use;
        if (!TokenDone(backend_.get(), &e->last_use)) {
          backend_->StreamWait(stream, e->last_use);
        }
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

}  // namespace prefetch
