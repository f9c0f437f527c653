// ArcherPrefetchHandle: the queue's calls (prefetch, cancel, evict) and
// next-use hints - what a caller says about ids it has not acquired.
#include "archer_prefetch_handle.h"
#include "handle_internal.h"

#include <chrono>
#include <thread>
#include <vector>

namespace prefetch {

using detail::SteadyNs;

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
  MutexLock lk(mu_);
  CheckUsableLocked();
  EnqueuePrefetchLocked(ids, n, priority, start);
}

void ArcherPrefetchHandle::EnqueuePrefetchLocked(const int64_t* ids, size_t n,
                                                 int priority,
                                                 Clock::time_point start) {
  ResolveIdsLocked(ids, n);  // all-or-nothing: throws before any change
  uint64_t enqueued = 0, upgraded = 0, touched = 0;
  uint64_t wake_mask = 0;
  const uint8_t band = static_cast<uint8_t>(priority);
  Entry* const* entries = batch_scratch_.data();
  // New entries are linked into one local chain per device and spliced into
  // the queue once (TaskQueue::AppendChain). A band upgrade of an entry
  // already queued first flushes the chains, so FIFO order within the band
  // follows the order of `ids`.
  TaskQueue::Chain chains[kMaxDevices];
  const int device_count = DeviceCount();
  auto flush = [&] {
    for (int d = 0; d < device_count; ++d) {
      devices_[d]->queue.AppendChain(&chains[d], band);
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
        chains[d].Append(e);
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
        devices_[e->device]->cache->Requested(e);
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
  MutexGuard lk(mu_);
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
  MutexGuard lk(mu_);
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
  MutexGuard lk(mu_);
  CheckUsableLocked();
  ResolveIdsLocked(ids, n);
  size_t evicted = 0;
  uint64_t mask = 0;
  for (size_t i = 0; i < n; ++i) {
    Entry* e = batch_scratch_[i];
    if (e->state != EntryState::kResident || e->pins > 0 ||
        !detail::TokenDone(backend_.get(), &e->ready) ||
        !detail::TokenDone(backend_.get(), &e->last_use)) {
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
  MutexGuard lk(mu_);
  CheckUsableLocked();
  CheckHintsLocked(ids, when, n, now, set_now);
  HintLocked(ids, when, n, now, set_now);
}

void ArcherPrefetchHandle::HintLocked(const int64_t* ids, const int64_t* when,
                                      size_t n, int64_t now, bool set_now) {
  ResolveIdsLocked(ids, n);
  if (set_now) {
    hint_clock_ = now;
    for (auto& dev : devices_) dev->cache->Clock(now);
  }
  for (size_t i = 0; i < n; ++i) {
    Entry* e = batch_scratch_[i];
    if (e->state == EntryState::kResident) {
      devices_[e->device]->cache->Hint(e, when[i]);
    } else {
      e->next_use = when[i];
    }
  }
}

int64_t ArcherPrefetchHandle::HintClock() const {
  CheckNotForked();  // as every other call: the lock may be held by a parent's thread
  MutexGuard lk(mu_);
  return hint_clock_;
}

}  // namespace prefetch
