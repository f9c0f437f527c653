// ArcherPrefetchHandle: the copy worker of each device (its loop, slot
// reservation and eviction, the chunked copy) and in-flight bookkeeping.
#include "archer_prefetch_handle.h"
#include "handle_internal.h"

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

namespace prefetch {

using detail::IdText;
using detail::StateName;
using detail::SteadyNs;
using detail::TokenDone;

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
// - Speculative bytes in flight are capped (max_speculative_bytes_in_flight;
//   by default two chunks, up to four while the worker wakes too late to
//   keep the link busy: Note [A cap that follows the worker's wake-ups]),
//   counted by chunk (Note [Speculation in chunks]), so a miss issued now
//   queues behind at most that much speculation on the copy engines,
//   however large the speculative entry.
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
    if (!TokenDone(c->backend, &v->ready) ||
        !TokenDone(c->backend, &v->last_use)) {
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
    Entry* victim = dev->cache->PickVictim(evictable, &ctx);
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
    if (TokenDone(backend_.get(), &e->ready)) {
      dev->inflight_bytes -= e->bytes;
      if (e->band == kOnDemandBand) dev->inflight_urgent_bytes -= e->bytes;
    } else {
      *keep++ = e;
    }
  }
  q.erase(keep, q.end());
}

void ArcherPrefetchHandle::TrackSpecChunkLocked(DeviceState* dev,
                                                CopyToken token, size_t bytes) {
  if (token == kTokenDone) return;  // a synchronous copy: nothing in flight
  backend_->RetainToken(token);
  dev->spec_chunks.emplace_back(token, bytes);
  dev->spec_chunk_bytes += bytes;
  // Note [A cap that follows the worker's wake-ups]: a grown cap steps down
  // a chunk after kSpecCapStepDownChunks chunks without an underrun.
  if (dev->spec_cap > spec_cap_min_ &&
      ++dev->spec_chunks_clean >= kSpecCapStepDownChunks) {
    dev->spec_cap = std::max(spec_cap_min_, dev->spec_cap - copy_chunk_bytes_);
    dev->spec_chunks_clean = 0;
  }
}

// Note [A cap that follows the worker's wake-ups]
// With the cap at two chunks, one chunk is on the link and the next queued
// behind it; the worker, waiting for the first, has the second's copy time
// (77 us for 4 MiB on the H200's link) to wake up and queue a third. When
// it wakes later than that, the link has drained and idles until the next
// chunk is issued. How late a sleeping thread wakes is the host's: BM5's
// gpt-oss-120b replay (47.5 MiB experts, the oracle's copies known a step
// ahead) moved 44.7 GB/s of the link's 55.1 on a slow host with the oracle
// hitting 92 % of its reads, and with a cap of four chunks 46.4 GB/s and 98 %
// (another run: 90 % and 94 %), while on a fast host the two
// caps were alike (85 % and 86 %). So the worker counts an underrun
// each time a wait it made because speculation had reached the cap ends
// with no speculative chunk left on the link (stats' spec_underruns). With
// the default cap (max_speculative_bytes_in_flight=None) each underrun
// raises the cap by a chunk, up to kMaxSpecCapChunks, and every
// kSpecCapStepDownChunks speculative chunks issued without one lower it by
// a chunk again, down to two: the cap is as deep as this host's wake-ups
// need, and a miss queues behind at most that (two chunks where the worker
// keeps up). A cap given as an option is never changed; its underruns are
// still counted. The gauge speculative_cap_bytes shows the cap now.
void ArcherPrefetchHandle::WaitForSpecCapLocked(DeviceState* dev,
                                                CopyToken token,
                                                MutexLock& lk) {
  WorkerWaitLocked(token, lk);
  RetireSpecChunksLocked(dev);
  if (stop_ || !dev->spec_chunks.empty()) return;
  ++stats_.spec_underruns;
  dev->spec_chunks_clean = 0;
  if (spec_cap_max_ - dev->spec_cap >= copy_chunk_bytes_) {
    dev->spec_cap += copy_chunk_bytes_;
  }
}

bool ArcherPrefetchHandle::FirstUrgentInflightLocked(const DeviceState* dev,
                                                     CopyToken* token) const {
  if (dev->inflight_urgent_bytes == 0) return false;
  for (const Entry* f : dev->inflight) {
    if (f->band == kOnDemandBand) {
      *token = f->ready;
      return true;
    }
  }
  return false;
}

void ArcherPrefetchHandle::RetireSpecChunksLocked(DeviceState* dev) {
  auto& q = dev->spec_chunks;
  auto keep = q.begin();
  for (auto it = q.begin(); it != q.end(); ++it) {
    if (backend_->Query(it->first)) {
      dev->spec_chunk_bytes -= it->second;
      backend_->ReleaseToken(it->first);
    } else {
      *keep++ = *it;
    }
  }
  q.erase(keep, q.end());
}

// Note [Speculation counts what is on the link]
// The cap on speculative bytes in flight is there to bound what a miss
// queues behind on the copy engines (Note [Speculation never hurts]). It
// counted a speculative entry whole until its last chunk landed, so after
// the last chunk of an entry of many chunks was issued the worker started
// the next entry only once that whole entry had landed: the link idled
// for the worker's wake-up (a poll of copy_poll_us, the lock, the slot, the
// driver call) once per entry. BM5's gpt-oss-120b replay, where the link
// sets the pace (47.5 MiB experts, twelve chunks), moved 43.8 GB/s of the
// link's 54.7 with the oracle's copies known a step ahead. The
// cap now counts the speculative chunks themselves, across entries
// (dev->spec_chunks): the next entry's first chunk goes as soon as it fits
// beside the chunks still on the link, as a chunk of the same entry
// would, so with the default cap of two chunks one is on the link and the
// next queued behind it across entry boundaries too. What a miss queues
// behind is still at most the cap.
bool ArcherPrefetchHandle::SpeculationAllowedLocked(
    const DeviceState* dev) const {
  // The worker loop retired finished copies and chunks just before asking.
  // copying_bytes > 0 here (outside the worker's own copy) is an acquirer
  // issuing its misses.
  return dev->copying_bytes == 0 && dev->inflight_urgent_bytes == 0 &&
         dev->spec_chunk_bytes < dev->spec_cap;
}

void ArcherPrefetchHandle::WorkerLoop(DeviceState* dev) {
  std::string bind_error;
  try {
    backend_->BindWorkerThread(dev->index);
  } catch (const std::exception& ex) {
    bind_error = ex.what();
  }
#ifdef __linux__
  // Note [Polite waits]: sleeps of copy_poll_us, not the default 50 us slack.
  if (copy_poll_us_ > 0) prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
#endif
  MutexLock lk(mu_);
  while (!stop_) {
    if (dev->inflight_bytes > 0) RetireInflightLocked(dev);
    if (dev->spec_chunk_bytes > 0) RetireSpecChunksLocked(dev);
    if (paused_ || dev->queue.empty()) {
      dev->worker_waiting = true;
      dev->work_cv.wait(lk);
      dev->worker_waiting = false;
      continue;
    }
    Entry* e = NextReadyLocked(dev);
    if (e == nullptr) {
      // Every queued entry is a disk-backed tensor a reader has not staged
      // yet (Note [Host tier]): readers notify; poll in case.
      dev->worker_waiting = true;
      dev->work_cv.wait_for(lk, std::chrono::microseconds(100));
      dev->worker_waiting = false;
      continue;
    }
    if (!bind_error.empty()) {
      FailUnstartedLocked(dev, e, "copy worker could not start: " + bind_error);
      continue;
    }
    if (WaitForRoomInFlightLocked(dev, e, lk)) continue;
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
      WaitForFreeSlotLocked(dev, wait_for_events, lk);
      continue;
    }
    dev->queue.Remove(e);
    CopyEntryLocked(dev, e, lk);
  }
  dev->worker_waiting = false;
}

// The worker could not start (its backend refused the thread): the queued
// entry `e` fails, and its acquirer gets `error`.
void ArcherPrefetchHandle::FailUnstartedLocked(DeviceState* dev, Entry* e,
                                               const std::string& error) {
  dev->queue.Remove(e);
  e->state = EntryState::kHost;
  e->error = error;
  ++e->error_seq;
  ++stats_.copy_errors;
  ready_cv_.notify_all();
}

// Speculation waits for the misses and for its own cap (Note [Speculation
// never hurts]); every copy waits for max_bytes_in_flight. Returns true if
// the worker waited (for an acquirer issuing misses, or for the oldest copy
// in flight, an urgent one first), false if `e` may go now. Drops and
// retakes `lk` while it waits.
bool ArcherPrefetchHandle::WaitForRoomInFlightLocked(
    DeviceState* dev, Entry* e, MutexLock& lk) {
  const bool held_back =
      e->band != kOnDemandBand && !SpeculationAllowedLocked(dev);
  if (!held_back && (dev->inflight.empty() ||
                     dev->inflight_bytes + e->bytes <= max_bytes_in_flight_)) {
    return false;
  }
  // What to wait for: a miss in flight first, then (held back by the cap)
  // the oldest speculative chunk, else the oldest copy in flight.
  CopyToken wait_for = kTokenDone;
  bool found = FirstUrgentInflightLocked(dev, &wait_for);
  if (!found && held_back && !dev->spec_chunks.empty()) {
    if (dev->copying_bytes == 0) {
      // Held back by the cap alone (no miss in flight or being issued).
      WaitForSpecCapLocked(dev, dev->spec_chunks.front().first, lk);
      RetireInflightLocked(dev);
      return true;
    }
    wait_for = dev->spec_chunks.front().first;
    found = true;
  }
  if (!found && !dev->inflight.empty()) {
    wait_for = dev->inflight.front()->ready;
    found = true;
  }
  if (!found) {
    // Held back with nothing in flight: an acquirer is issuing misses right
    // now; let it finish.
    dev->worker_waiting = true;
    dev->work_cv.wait_for(lk, std::chrono::microseconds(50));
    dev->worker_waiting = false;
    return true;
  }
  WorkerWaitLocked(wait_for, lk);
  RetireInflightLocked(dev);
  RetireSpecChunksLocked(dev);
  return true;
}

// Note [Polite waits]
// A copy worker spends most of a busy link waiting for its own copies: for
// the oldest copy when max_bytes_in_flight is reached, and between the
// chunks of a speculative copy (Note [Speculation in chunks]). On CUDA the
// backend's Wait is cuEventSynchronize on an event made with default
// flags, which spins a CPU in the driver until the copy is done. Beside the
// serving thread that costs: in a one-off probe with BM5's resident
// gpt-oss-120b decoder on the H200 host, a second thread copying and
// spin-waiting slowed the decoder 1.13x, the same thread sleeping in
// its waits 1.07x, copies queued by the serving thread itself
// 1.01x. So with copy_poll_us > 0 (default 20) the worker asks whether the
// copy is done (Query: one cuEventQuery) and sleeps copy_poll_us between
// asks, its thread's timer slack at 1 us (Linux) so that a sleep is about
// that long. A wake-up that late costs the link nothing while the next
// chunk is already queued behind the one waited for (the default cap is two
// chunks). copy_poll_us = 0 is the blocking wait.
void ArcherPrefetchHandle::WorkerWaitLocked(CopyToken token, MutexLock& lk) {
  if (token == kTokenDone) return;
  backend_->RetainToken(token);  // Note [Completed tokens]
  DropLock(lk);
  try {
    if (copy_poll_us_ > 0) {
      const auto pause = std::chrono::microseconds(copy_poll_us_);
      while (!backend_->Query(token)) std::this_thread::sleep_for(pause);
    } else {
      backend_->Wait(token);
    }
  } catch (...) {
    // A failed wait surfaces to the acquirer of that entry.
  }
  backend_->ReleaseToken(token);
  RetakeLock(lk);
}

// Note [Speculation in chunks]
// The cap on speculative bytes in flight bounds what a miss queues behind
// on the copy engines. Counted per entry, a speculative entry larger than
// the cap was issued whole once it started: a gpt-oss-120b expert is 47.5
// MiB, twelve 4 MiB chunks issued back to back, so a band-0 miss could
// queue behind up to 47.5 MiB of guesses (about 0.9 ms of the H200's
// link) against a cap of 8 MiB. So the cap counts chunks: before each
// chunk of a speculative copy after its first, the worker waits while the
// speculative chunks still in flight (this copy's and the copies' before
// it: Note [Speculation counts what is on the link]) plus the next chunk
// exceed the cap. While an on-demand copy is in flight or being issued it
// sends no chunk either, until that copy has landed or no speculative
// chunk is in flight (then none of their bytes are ahead of the miss on
// the link). With the default cap of two chunks one chunk is on the link
// and the next queued behind it, so the link does not idle between chunks.
// Once an acquirer pins the entry (it waits for this very copy) the pacing
// ends and the rest goes in one copy.
void ArcherPrefetchHandle::PaceSpeculativeChunkLocked(DeviceState* dev,
                                                      Entry* e, size_t next,
                                                      MutexLock& lk) {
  for (;;) {
    RetireSpecChunksLocked(dev);
    if (dev->spec_chunks.empty() || e->pins > 0 || stop_) return;
    if (dev->inflight_bytes > 0) RetireInflightLocked(dev);
    // copying_bytes holds this copy's own bytes; more is an acquirer
    // issuing its misses right now.
    const bool misses = dev->inflight_urgent_bytes > 0 ||
                        dev->copying_bytes > e->bytes;
    // Note [Speculation counts what is on the link]: the speculative chunks
    // in flight, this copy's and the copies' before it.
    if (!misses) {
      if (dev->spec_chunk_bytes + next <= dev->spec_cap) return;
      WaitForSpecCapLocked(dev, dev->spec_chunks.front().first, lk);
      continue;
    }
    CopyToken wait_for = dev->spec_chunks.front().first;
    FirstUrgentInflightLocked(dev, &wait_for);  // a miss in flight first
    WorkerWaitLocked(wait_for, lk);
  }
}

// Every slot is pinned (or still read on a stream): wait for a release, an
// unregister or close. GPU-side uses complete without a notification, so
// with `wait_for_events` poll every 100 us.
void ArcherPrefetchHandle::WaitForFreeSlotLocked(
    DeviceState* dev, bool wait_for_events, MutexLock& lk) {
  dev->worker_waiting = true;
  dev->worker_needs_room = true;
  if (wait_for_events) {
    dev->work_cv.wait_for(lk, std::chrono::microseconds(100));
  } else {
    dev->work_cv.wait(lk);
  }
  dev->worker_waiting = false;
  dev->worker_needs_room = false;
}

void ArcherPrefetchHandle::CopyEntryLocked(DeviceState* dev, Entry* e,
                                           MutexLock& lk) {
  if (e->disk >= 0) {  // two hops (Note [Host tier])
    CopyFromDiskLocked(dev, e, lk);
    return;
  }
  e->state = EntryState::kCopying;
  dev->copying_bytes += e->bytes;
  const bool urgent = e->band == kOnDemandBand;
  // Every chunk of an entry goes down one lane, so the last chunk's token
  // covers the whole entry; entries alternate between lanes.
  const int lane = urgent ? 0 : static_cast<int>(dev->next_lane++ % copy_lanes_);
  char* dst = dev->cache->arena() + e->slot_offset;
  const char* src = static_cast<const char*>(e->host_ptr);
  // Note [Whole on-demand copies]
  // Chunks exist so that an on-demand copy can overtake a long prefetch
  // between them. Nothing overtakes an on-demand copy, so it goes whole: one
  // backend call (on CUDA a cuMemcpyHtoDAsync and an event record) instead
  // of one per chunk, which the acquiring thread issues itself
  // (IssueOwnCopiesLocked) on the critical path of a miss. On the H200 host
  // each driver call costs microseconds; an expert of 9-12 MiB was 3 chunks.
  const size_t piece = urgent ? e->bytes : copy_chunk_bytes_;
  CopyToken token = kTokenDone;
  std::string error;
  size_t done = 0;
  while (done < e->bytes) {
    if (!urgent && done > 0) {
      PaceSpeculativeChunkLocked(dev, e, std::min(piece, e->bytes - done), lk);
    }
    // Pinned: an acquirer waits for this copy, so the rest goes at once.
    const size_t chunk =
        e->pins > 0 ? e->bytes - done : std::min(piece, e->bytes - done);
    DropLock(lk);
    const Clock::time_point start = Clock::now();
    error = IssueCopy(dev->index, dst + done, src + done, chunk, urgent, lane,
                      &token);
    const double seconds =
        std::chrono::duration<double>(Clock::now() - start).count();
    RetakeLock(lk);
    stats_.copy_seconds += seconds;
    if (!error.empty()) break;
    if (!urgent) TrackSpecChunkLocked(dev, token, chunk);
    done += chunk;
    if (stop_ && done < e->bytes) {
      error = "PrefetchHandle closed during the copy";
      break;
    }
    // Between chunks an on-demand request overtakes a long prefetch.
    if (!urgent && done < e->bytes && dev->queue.HasBand(kOnDemandBand) &&
        ReadyToCopyLocked(dev->queue.PeekMostUrgent())) {
      Entry* u = dev->queue.PeekMostUrgent();
      bool wait_for_events = false;
      if (ReserveSlotLocked(dev, u, &wait_for_events)) {
        dev->queue.Remove(u);
        CopyEntryLocked(dev, u, lk);  // urgent: never recurses further
      }
    }
  }
  dev->copying_bytes -= e->bytes;
  FinishCopyLocked(dev, e, token, error, lk);
}

std::string ArcherPrefetchHandle::IssueCopy(int device, char* dst,
                                            const char* src, size_t bytes,
                                            bool urgent, int lane,
                                            CopyToken* token) {
  try {
    const CopyToken t = backend_->Copy(device, dst, src, bytes, urgent, lane,
                                       /*want_token=*/true);
    backend_->ReleaseToken(*token);
    *token = t;
    return "";
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown error in the copy backend";
  }
}

void ArcherPrefetchHandle::FinishCopyLocked(DeviceState* dev, Entry* e,
                                            CopyToken token,
                                            const std::string& error,
                                            MutexLock& lk) {
  if (!error.empty()) {
    if (token != kTokenDone) {
      DropLock(lk);
      try {
        backend_->Wait(token);  // chunks already issued still target the slot
      } catch (...) {
      }
      RetakeLock(lk);
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
      dev->cache->Used(e);
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

}  // namespace prefetch
