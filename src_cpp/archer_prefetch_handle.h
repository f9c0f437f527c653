// ArcherPrefetchHandle: the engine's facade.
//
// Owns the registry of tensors (id -> Entry), one DeviceState per device (task
// queue, device cache, copy worker thread) and the copy backend. Named after
// MoE-Infinity's engine, whose batched prefetch_tensors call it generalises.
//
// Note [One lock]
// A single mutex `mu_` guards the registry, every Entry, every queue and cache
// and the counters. An entry's state spans queue and cache (queued -> copying
// -> resident), so splitting the lock would need a lock order on every
// transition; one short critical section per call is cheaper than that, and
// the batched enqueue takes it exactly once. Workers never hold it while
// copying bytes, and never call into Python. Public methods never call other
// public methods; helpers named *Locked REQUIRE mu_.
// Clang checks this (Note [Checked lock discipline] in thread_annotations.h):
// the members mu_ guards are GUARDED_BY(mu_), every *Locked helper is
// REQUIRES(mu_) and the public methods that take it EXCLUDES(mu_). A helper
// that drops and retakes the lock says so in its comment; it does so through
// DropLock/RetakeLock, so the analysis knows mu_ is not held in between.
// The state of DeviceState, Entry, TaskQueue and DeviceCache is guarded by
// mu_ too, but clang cannot name the handle's mutex from those types: it is
// checked only through the REQUIRES of the functions that touch it.
//
// Note [Acquire pins]
// Acquire increments Entry::pins before it waits, so an entry an acquirer is
// waiting for can never be evicted between its copy finishing and the
// acquirer waking. Release decrements; pins never go below zero (a release
// without acquire is refused with the state unchanged).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "copy_backend.h"
#include "device_cache.h"
#include "entry.h"
#include "errors.h"
#include "handle_args.h"
#include "stats.h"
#include "task_queue.h"
#include "thread_annotations.h"

namespace prefetch {

// Note [A cap that follows the worker's wake-ups]: the default cap on
// speculative bytes in flight, in chunks, at first and at most, and the
// speculative chunks without an underrun after which it steps down one.
constexpr size_t kMinSpecCapChunks = 2;
constexpr size_t kMaxSpecCapChunks = 4;
constexpr uint64_t kSpecCapStepDownChunks = 64;
constexpr uint8_t kPoisonByte = 0xDB;  // freed slots, with poison_freed_slots

// Note [Host tier]
// A disk-backed tensor (RegisterDisk) has no host copy of its own: its bytes
// are extents of files opened with OpenFile (a safetensors shard holds an
// expert's weights as separate tensors, so an expert is several extents,
// each going to its own offset of the device slot). Its copy job has two
// hops, disk -> host slot -> device slot, in one job of the device's queue:
// priority bands, dedup, cancel (while queued) and the all-or-nothing rules
// of acquire are the device queue's, unchanged, and a band-0 miss takes both
// hops at once, extent by extent (the read of the next extent overlaps the
// copy of the last). Reads run on a small pool of reader threads
// (disk_reader_threads), which stage the most urgent queued disk-backed
// tensors, several at once, while the device workers copy those already
// staged: a worker takes the most urgent queued entry that is ready (a
// host-memory tensor, or a staged one), so reads and host-to-device copies
// overlap and a read never holds a worker. The host slot comes from the
// host tier: one page-locked
// arena of host_budget_bytes, carved into slots like a device cache, with
// its own eviction policy ("lru") over a shadow Entry per disk-backed
// tensor. A tensor still in the host tier skips the disk. Each extent is read
// as its aligned span (Note [Disk reads] in disk_reader.h) into a 4096-byte
// aligned region of the slot, so the reads can bypass the page cache
// (O_DIRECT); the host-to-device copy then starts `lead` bytes in. A host
// slot is not reused before the device copies reading it have completed
// (the shadow's last_use token), never while a copy is being issued from
// it (its pins), and not while its tensor is still queued for that copy
// (readers stage ahead only into room no queued tensor needs). A read that fails (EIO, a short read, a file changed since
// it was opened: disk_io's checks) fails that copy job only: the acquirer
// gets kCopyFailed naming the file, and the engine serves everything else.
// The engine's host memory for disk-backed tensors is the arena: it never
// holds more than host_budget_bytes of them.

class ArcherPrefetchHandle {
 public:
  ArcherPrefetchHandle(HandleOptions options,
                       std::unique_ptr<CopyBackend> backend);
  ~ArcherPrefetchHandle();
  ArcherPrefetchHandle(const ArcherPrefetchHandle&) = delete;
  ArcherPrefetchHandle& operator=(const ArcherPrefetchHandle&) = delete;

  const char* BackendName() const { return backend_->Name(); }
  int DeviceCount() const { return static_cast<int>(devices_.size()); }
  uintptr_t ArenaAddress(int device) const;
  size_t BudgetBytes(int device) const;

  // Copies `total_bytes` (assembled from `parts`; bytes no part covers are
  // zero) into engine-owned host memory under `id`. REQUIRES: id unused,
  // 0 <= id <= kMaxTensorId, 0 < total_bytes <= the device's budget.
  void RegisterTensor(int64_t id, size_t total_bytes, int device,
                      const HostPart* parts, size_t n_parts) EXCLUDES(mu_);
  // Registers caller-owned host memory as `id` without copying it. The
  // caller keeps it alive and unchanged until the id is unregistered or the
  // handle closed; for DMA backends it must be page-locked (e.g. a torch
  // tensor made with pin_memory=True) or copies fall back to slow paths.
  void RegisterExternal(int64_t id, const void* host_ptr, size_t bytes,
                        int device) EXCLUDES(mu_);
  // Note [Host tier]: opens `path` for the disk tier (O_DIRECT per the
  // options) and returns its index; a missing file throws kIoError.
  int32_t OpenFile(const std::string& path) EXCLUDES(mu_);
  // The file `file` as OpenFile found it (size, mtime, inode, ...): what a
  // caller checks a file against, after opening it, not before (a file
  // replaced between a stat and the open would pass). kInvalidArgument for
  // an index OpenFile did not return.
  DiskFileInfo FileInfo(int32_t file) const EXCLUDES(mu_);
  // Registers `id` as `total_bytes` read from `extents` (bytes no extent
  // covers are zero). Throws kInvalidArgument without a host tier, for an
  // unknown file, an extent past its file's size (at open) or the tensor,
  // or a tensor whose staged spans do not fit the host tier.
  void RegisterDisk(int64_t id, const DiskExtent* extents, size_t n,
                    size_t total_bytes, int device) EXCLUDES(mu_);
  // Forgets `id` and frees its memory. REQUIRES: not acquired, not copying.
  void UnregisterTensor(int64_t id) EXCLUDES(mu_);
  bool IsRegistered(int64_t id) const EXCLUDES(mu_);

  // Prefetch at `priority` (0..kNumBands-1). All ids are validated first:
  // one unknown id throws kUnknownId and nothing is enqueued.
  void EnqueuePrefetch(int64_t id, int priority) EXCLUDES(mu_);
  void EnqueuePrefetchTensors(const int64_t* ids, size_t n, int priority)
      EXCLUDES(mu_);

  // Removes queued ids that no acquirer waits for; returns how many.
  size_t Cancel(const int64_t* ids, size_t n) EXCLUDES(mu_);
  // Removes every queued id in bands >= band (no acquirer waiting).
  size_t CancelAtOrBelow(int band) EXCLUDES(mu_);

  // Evicts the listed ids that are resident, unpinned and no longer used on
  // any stream (others are left alone); returns how many were evicted.
  size_t Evict(const int64_t* ids, size_t n) EXCLUDES(mu_);

  // Next-use hints (Note [Next-use eviction] in eviction_policy.h): id i is next
  // read at `when[i]` on the caller's clock (kNoNextUse: unknown), and, with
  // `set_now`, the clock is now `now`. Only the "next-use" policy reads
  // hints; others keep them. All-or-nothing: an unknown id, a negative time
  // or a clock going backwards throws and changes nothing.
  void HintNextUse(const int64_t* ids, const int64_t* when, size_t n,
                   int64_t now, bool set_now) EXCLUDES(mu_);
  int64_t HintClock() const EXCLUDES(mu_);

  // Waits until every id is resident and pins it. `streams` (nullptr, or one
  // per device, kNoStream = none; 0 is the legacy default stream, a real
  // one) names each device's consumer stream: on an async
  // backend an id whose copy is issued but not finished makes its device's
  // stream wait on the GPU instead of blocking the CPU; without a stream the
  // CPU waits for the copy. Writes where each id lives to slots[i].
  // All-or-nothing: on timeout, copy failure or close, nothing stays pinned.
  void Acquire(const int64_t* ids, size_t n, const uintptr_t* streams,
               double timeout_s, SlotInfo* slots) EXCLUDES(mu_);
  // Unpins. With a stream for the id's device, the slot is not reused before
  // the work queued on that stream so far has completed: one event per
  // device stream per call (Note [One token per release]). All-or-nothing.
  void Release(const int64_t* ids, size_t n, const uintptr_t* streams)
      EXCLUDES(mu_);

  // One MoE layer's whole conversation with the engine in one call (Note
  // [One call per layer]): release the previous layer's ids, cancel guesses
  // that turned out wrong, take next-use hints, acquire this layer's ids and
  // queue the predicted ones at `prefetch_band`. Every argument is checked
  // before anything changes; then the steps run in that order.
  void Step(const StepArgs& args) EXCLUDES(mu_);

  // Inspection (tests, debugging): queued ids of a device, most urgent band
  // first and FIFO within a band, as (band, id) pairs; resident ids of a
  // device in eviction order (next victim first).
  std::vector<std::pair<int, int64_t>> QueueSnapshot(int device) const
      EXCLUDES(mu_);
  std::vector<int64_t> ResidentSnapshot(int device) const EXCLUDES(mu_);

  // Tests: stall the device's copies on the GPU until `stream`'s work so far
  // completes (CUDA backend only).
  void DebugHoldCopies(int device, uintptr_t stream) EXCLUDES(mu_);

  void Pause() EXCLUDES(mu_);
  void Resume() EXCLUDES(mu_);
  Stats GetStats() const EXCLUDES(mu_);
  // The engine's own duration of the last batched enqueue, without copying
  // the whole Stats (BM2's cpp-internal figure).
  uint64_t LastBatchNs() const EXCLUDES(mu_);
  // Cancels the queue, wakes waiters with kClosed, joins workers, frees
  // memory. Bounded by one copy chunk per worker; idempotent.
  void Close() EXCLUDES(mu_);

 private:
  // Every field but `index`, the `cache` pointer and `worker` (set at
  // construction; Close joins `worker`) is guarded by mu_, and so is what
  // `queue` and `*cache` hold: clang cannot check it (Note [One lock]).
  struct DeviceState {
    int index = 0;                       // device ordinal
    TaskQueue queue;                     // pending copies
    std::unique_ptr<DeviceCache> cache;  // arena + eviction policy
    bool owns_arena = false;             // arena came from the backend
    CondVar work_cv;                     // wakes the worker
    bool worker_waiting = false;         // worker sleeps on work_cv
    bool worker_needs_room = false;      // ...because no slot could be freed
    bool worker_failed = false;          // worker died of an unexpected error
    size_t copying_bytes = 0;            // bytes of entries being issued now
    uint64_t next_lane = 0;              // round-robin over copy lanes
    std::deque<Entry*> inflight;         // async: issued, ready pending
    size_t inflight_bytes = 0;           // bytes of `inflight`
    size_t inflight_urgent_bytes = 0;    // of those, on-demand (band 0)
    // Note [Speculation counts what is on the link]: speculative chunks
    // issued and not yet seen done (token with its own reference, bytes).
    std::deque<std::pair<CopyToken, size_t>> spec_chunks;
    size_t spec_chunk_bytes = 0;  // bytes of spec_chunks
    // Note [A cap that follows the worker's wake-ups]: the cap on
    // spec_chunk_bytes now, and the speculative chunks issued since the
    // last underrun or the last step down.
    size_t spec_cap = 0;
    uint64_t spec_chunks_clean = 0;
    std::thread worker;
  };
  using Clock = std::chrono::steady_clock;

  // The constructor's steps: every check of the options (kInvalidArgument
  // before anything is built), each device's cache and arena (all freed
  // again if one fails), then one worker thread per device.
  void CheckOptions(const HandleOptions& options) const;
  void BuildDevices(const HandleOptions& options);
  void StartWorkers();

  // `lk` holds mu_ and came from the caller: drop it (for a copy, a CPU
  // wait) and take it back. Named functions rather than lk.unlock() and
  // lk.lock() because clang's analysis cannot tie a lock passed by
  // reference to mu_; through these it knows mu_ is not held in between.
  // Their own bodies are the one unchecked step.
  void DropLock(MutexLock& lk) RELEASE(mu_) NO_THREAD_SAFETY_ANALYSIS {
    lk.unlock();
  }
  void RetakeLock(MutexLock& lk) ACQUIRE(mu_) NO_THREAD_SAFETY_ANALYSIS {
    lk.lock();
  }

  // A device's copy worker: takes mu_, and holds it except while it waits on
  // work_cv and while its helpers drop it.
  void WorkerLoop(DeviceState* dev) EXCLUDES(mu_);
  // Its steps (copy_worker.cpp).
  // The worker could not start: the queued entry `e` fails with `error`.
  void FailUnstartedLocked(DeviceState* dev, Entry* e, const std::string& error)
      REQUIRES(mu_);
  // Holds speculation back and every copy to max_bytes_in_flight; returns
  // true if it waited (the caller re-checks everything). Drops and retakes
  // mu_ through `lk` while it waits, on work_cv or for a copy in flight.
  bool WaitForRoomInFlightLocked(DeviceState* dev, Entry* e, MutexLock& lk)
      REQUIRES(mu_);
  // No slot can be freed: waits on work_cv (dropping mu_ inside the wait)
  // for a release, an unregister, close, or 100 us with `wait_for_events`.
  void WaitForFreeSlotLocked(DeviceState* dev, bool wait_for_events,
                             MutexLock& lk) REQUIRES(mu_);
  // Copies `e` (out of the queue, its slot reserved by ReserveSlotLocked)
  // into its slot chunk by chunk on one lane, then FinishCopyLocked. Drops
  // mu_ around each chunk's backend call and retakes it (DropLock/
  // RetakeLock): other threads run in between, so anything the caller read
  // before the call must be read again. Between the chunks of a speculative
  // copy it issues a queued on-demand entry first (one level of recursion).
  // Called by the worker and by acquirers issuing their own misses.
  void CopyEntryLocked(DeviceState* dev, Entry* e, MutexLock& lk)
      REQUIRES(mu_);
  // Note [Speculation in chunks]: before each chunk of a speculative copy
  // after its first, waits (mu_ dropped) while the speculative chunks in
  // flight (dev->spec_chunks, this copy's and earlier ones') would exceed
  // dev->spec_cap with the next chunk, or while an
  // on-demand copy is in flight or being issued. Returns at once when the
  // entry is pinned (an acquirer waits for it), the handle stops, or no
  // speculative chunk is in flight (also with a miss in flight).
  void PaceSpeculativeChunkLocked(DeviceState* dev, Entry* e, size_t next,
                                  MutexLock& lk) REQUIRES(mu_);
  // A speculative chunk issued with `token` (its copy's bytes: `bytes`)
  // joins dev->spec_chunks with a reference of its own (Note [Speculation
  // counts what is on the link]); kTokenDone (a synchronous copy) does not.
  void TrackSpecChunkLocked(DeviceState* dev, CopyToken token, size_t bytes)
      REQUIRES(mu_);
  // A wait of the worker's for the oldest speculative chunk because the
  // chunks in flight had reached dev->spec_cap: waits for `token` (mu_
  // dropped), retires what landed, and counts an underrun if nothing
  // speculative is left on the link (Note [A cap that follows the worker's
  // wake-ups]).
  void WaitForSpecCapLocked(DeviceState* dev, CopyToken token, MutexLock& lk)
      REQUIRES(mu_);
  // Whether an on-demand copy is in flight on `dev`; if so *token is the
  // oldest one's (as dev->inflight holds it: kTokenDone once seen done).
  bool FirstUrgentInflightLocked(const DeviceState* dev, CopyToken* token)
      const REQUIRES(mu_);
  // Takes every chunk of dev->spec_chunks whose copy has completed off it
  // (in any order: lanes finish out of issue order), returning its
  // reference. Never drops mu_; only queries tokens.
  void RetireSpecChunksLocked(DeviceState* dev) REQUIRES(mu_);
  // Waits for `token` with mu_ dropped, as copy_poll_us says (Note [Polite
  // waits]); holds its own reference for the wait. A failed wait is left to
  // whoever acquires the entry.
  void WorkerWaitLocked(CopyToken token, MutexLock& lk) REQUIRES(mu_);
  // One backend copy of `bytes` to `dst`, with mu_ dropped: on success
  // *token becomes the copy's token (the previous one is returned), else
  // the error text comes back (never throws).
  std::string IssueCopy(int device, char* dst, const char* src, size_t bytes,
                        bool urgent, int lane, CopyToken* token)
      EXCLUDES(mu_);
  // The end of an entry's copy: resident (in flight while `token` is
  // pending), or back on the host with `error`; wakes acquirers. On an
  // error with chunks already issued, drops mu_ while it waits for them.
  void FinishCopyLocked(DeviceState* dev, Entry* e, CopyToken token,
                        const std::string& error, MutexLock& lk)
      REQUIRES(mu_);
  // Finds `e` a slot of e->bytes in dev's cache (e->slot_offset,
  // e->slot_bytes), evicting the policy's evictable victims one by one
  // until one fits. An unpinned speculative `e` evicts no entry needed no
  // later than itself (Note [Speculation never hurts]). Returns true with
  // the slot reserved: the caller copies into it or frees it. Returns false
  // with no slot when no victim can go; victims evicted on the way stay
  // evicted. Then *wait_for_events says an unpinned victim waits only on
  // GPU work (poll for it), and *refused, when given, that admission
  // refused a victim. Never drops mu_; only queries tokens, never waits.
  bool ReserveSlotLocked(DeviceState* dev, Entry* e, bool* wait_for_events,
                         bool* refused = nullptr) REQUIRES(mu_);
  // A resident entry leaves the cache: policy, slot, in-flight list, tokens.
  void DropSlotLocked(DeviceState* dev, Entry* e) REQUIRES(mu_);
  // DropSlotLocked, counted as an eviction (and as waste if never acquired).
  void EvictLocked(DeviceState* dev, Entry* e) REQUIRES(mu_);
  // Takes every entry whose copy has completed (`ready` queried done) off
  // dev->inflight, in any order, and its bytes off inflight_bytes and
  // inflight_urgent_bytes. The entries stay resident and keep their tokens.
  // Never drops mu_; only queries tokens, never waits.
  void RetireInflightLocked(DeviceState* dev) REQUIRES(mu_);
  // Takes `e` off dev->inflight if it is there (evicted or unregistered).
  void DropInflightLocked(DeviceState* dev, Entry* e) REQUIRES(mu_);
  // Notifies the worker of each device in `device_mask` (bit d: device d)
  // that sleeps on work_cv, unless paused (Resume wakes them all). A worker
  // that is awake re-checks its queue under mu_ before it sleeps, so it
  // needs no notify; a sleeping one cannot miss this one, since it set
  // worker_waiting under mu_. Call it after queueing the work.
  void WakeWorkersLocked(uint64_t device_mask) REQUIRES(mu_);

  void CheckNotForked() const;
  void CheckUsableLocked() const REQUIRES(mu_);
  void CheckDevice(int device) const;  // kInvalidArgument: no such device
  static void CheckPriority(int priority);
  Entry* LookupLocked(int64_t id) const REQUIRES(mu_);
  void ValidateIdsLocked(const int64_t* ids, size_t n) const REQUIRES(mu_);
  // Throws unless `id` can be registered with `bytes` on `device`.
  void CheckRegistrationLocked(int64_t id, size_t bytes, int device) const
      REQUIRES(mu_);
  // Adds a registry entry (throws kOutOfMemory without changing anything).
  void InsertEntryLocked(int64_t id, void* host, size_t bytes, int device,
                         bool owns_host) REQUIRES(mu_);
  // Validates and stores the entries in batch_scratch_.
  void ResolveIdsLocked(const int64_t* ids, size_t n) REQUIRES(mu_);
  // EnqueuePrefetchTensors' work once its arguments are checked; `start`
  // opens the batch's timing (stats_.last_batch_*). Throws kUnknownId
  // before any change.
  void EnqueuePrefetchLocked(const int64_t* ids, size_t n, int priority,
                             Clock::time_point start) REQUIRES(mu_);
  void ForEachEntryLocked(void (*fn)(Entry*, void*), void* ctx) const
      REQUIRES(mu_);
  void UnpinLocked(const int64_t* ids, size_t n) REQUIRES(mu_);
  // Throws kInvalidArgument if the distinct ids of one device need more
  // slot bytes together than its budget (they could never be held at once).
  void CheckFitsLocked(const int64_t* ids, size_t n) const REQUIRES(mu_);
  void ReleaseLocked(const int64_t* ids, size_t n, const uintptr_t* streams)
      REQUIRES(mu_);
  // Acquire once its ids are checked (valid, fitting), under `lk`; Step
  // calls it directly. Drops and retakes mu_ through `lk` (own copies, CPU
  // waits) and waits on ready_cv_.
  void AcquireLocked(const int64_t* ids, size_t n, const uintptr_t* streams,
                     double timeout_s, SlotInfo* slots, MutexLock& lk)
      REQUIRES(mu_);
  // Step's prefetches, queued under the lock its acquire ends with (Note
  // [A step's prefetches after its wait]).
  void QueueStepPrefetchesLocked(const StepArgs& a) REQUIRES(mu_);
  // Its steps (acquire_release.cpp says what each does).
  uint64_t PinAndQueueMissesLocked(const int64_t* ids, size_t n,
                                   uint64_t* error_seq) REQUIRES(mu_);
  // Drops and retakes mu_ through `lk` (CopyEntryLocked).
  void IssueOwnCopiesLocked(const int64_t* ids, size_t n, MutexLock& lk)
      REQUIRES(mu_);
  // Waits on ready_cv_ (dropping mu_ inside each wait).
  void WaitUntilResidentLocked(const int64_t* ids, size_t n,
                               const uint64_t* error_seq, double timeout_s,
                               MutexLock& lk) REQUIRES(mu_);
  // Drops mu_ through `lk` while the CPU waits for copies, then retakes it.
  void HandOutSlotsLocked(const int64_t* ids, size_t n,
                          const uintptr_t* streams, SlotInfo* slots,
                          MutexLock& lk) REQUIRES(mu_);
  // --active_calls_, wakes Close at zero
  void EndActiveCallLocked() REQUIRES(mu_);
  // ++acquire_calls_ and every policy's clock
  void TickAcquireClockLocked() REQUIRES(mu_);
  // Step's pin_ids and use_ids (Note [Pins without waiting]).
  void PinResidentLocked(const int64_t* ids, size_t n, const uintptr_t* streams,
                         int64_t* offsets) REQUIRES(mu_);
  void UseLocked(const int64_t* ids, size_t n) REQUIRES(mu_);
  // Cancel and HintNextUse once their arguments are checked (CancelLocked
  // counts what it removed and returns it).
  size_t CancelLocked(const int64_t* ids, size_t n) REQUIRES(mu_);
  void HintLocked(const int64_t* ids, const int64_t* when, size_t n,
                  int64_t now, bool set_now) REQUIRES(mu_);
  // Throws unless the hint arguments are valid (HintNextUse's rules).
  void CheckHintsLocked(const int64_t* ids, const int64_t* when, size_t n,
                        int64_t now, bool set_now) const REQUIRES(mu_);
  // A speculative (band > 0) copy may start on this device now: no
  // on-demand copy in flight, and speculative bytes in flight under the cap
  // (Note [Speculation never hurts]). Reads the in-flight gauges as they
  // are: the caller retires finished copies first (RetireInflightLocked).
  bool SpeculationAllowedLocked(const DeviceState* dev) const REQUIRES(mu_);
  // Pin-count changes that keep pinned_entries_ exact.
  void PinLocked(Entry* e) REQUIRES(mu_);
  void UnpinOneLocked(Entry* e) REQUIRES(mu_);
  void FreeEverythingLocked() REQUIRES(mu_);
  // Returns a slot to the cache, poisoning it first when asked to.
  void FreeSlotLocked(DeviceState* dev, Entry* e) REQUIRES(mu_);

  // The host tier (host_tier.cpp, Note [Host tier]).
  struct DiskSpec {
    std::vector<DiskExtent> extents;
    std::vector<uint64_t> region;  // per extent: its region's offset in the slot
    size_t stage_bytes = 0;        // the host slot: every extent's aligned span
    std::vector<std::pair<uint64_t, uint64_t>> gaps;  // (offset, bytes) no extent covers
    Entry stage;                   // the shadow entry in the host tier
  };
  void BuildHostTier(const HandleOptions& options);
  void StartReaders();  // disk_reader_threads of ReaderLoop, with a host tier
  void FreeHostTierLocked() REQUIRES(mu_);  // Close: stages, files, arena
  // Throws kInvalidArgument unless extent `i` of `id` fits its file (as
  // opened) and the tensor.
  void CheckExtentLocked(int64_t id, size_t i, const DiskExtent& x,
                         size_t total_bytes) const REQUIRES(mu_);
  // CopyEntryLocked for a disk-backed `e`, whose tensor is staged: copy
  // each extent from its host slot to the device. Drops and retakes mu_
  // around each copy.
  void CopyFromDiskLocked(DeviceState* dev, Entry* e, MutexLock& lk)
      REQUIRES(mu_);
  // A host slot for `spec`'s tensor, evicting staged tensors that no copy
  // reads and no queued entry waits for; false when none can go now.
  bool ReserveHostSlotLocked(DiskSpec* spec) REQUIRES(mu_);
  // Whether `e` (queued) can be copied now: a host-memory tensor, or a
  // staged disk-backed one.
  bool ReadyToCopyLocked(const Entry* e) const REQUIRES(mu_);
  // The most urgent queued entry of `dev` that is ready to copy, or null.
  Entry* NextReadyLocked(DeviceState* dev) const REQUIRES(mu_);
  // A reader thread: stages the most urgent queued disk-backed tensors.
  void ReaderLoop() EXCLUDES(mu_);
  // Its pick: the most urgent queued disk-backed entry, any device, whose
  // tensor is not staged or being staged; null if none.
  Entry* NextToStageLocked() const REQUIRES(mu_);
  // Reads `owner`'s extents into its reserved host slot (mu_ dropped around
  // each read); on failure the queued owner fails (FailUnstartedLocked).
  void StageLocked(Entry* owner, MutexLock& lk) REQUIRES(mu_);
  // A disk-backed entry's shadow leaves the host tier (unregister, close).
  void DropStageLocked(DiskSpec* spec) REQUIRES(mu_);

  // Set at construction, read-only after: no lock.
  const std::unique_ptr<CopyBackend> backend_;
  const size_t copy_chunk_bytes_;
  const size_t max_bytes_in_flight_;
  // The cap on speculative bytes in flight starts at spec_cap_min_ and
  // moves between it and spec_cap_max_ (equal: a fixed cap, the option's).
  const size_t spec_cap_min_;
  const size_t spec_cap_max_;
  const int copy_lanes_;
  const int64_t copy_poll_us_;
  const int64_t debug_issue_delay_ns_;
  const bool poison_freed_slots_;
  const long owner_pid_;  // process that built the handle (fork detection)

  mutable Mutex mu_;  // Note [One lock]
  CondVar ready_cv_;  // entry became resident/failed; close
  CondVar idle_cv_;   // active_calls_ dropped to zero
  // Filled by BuildDevices (construction), never resized after, so reading
  // the vector needs no lock; what each DeviceState holds does.
  std::vector<std::unique_ptr<DeviceState>> devices_;
  // Registry pages: page p holds the entries of ids [p << kPageBits,
  // (p + 1) << kPageBits) inline, so a lookup is two dependent loads and
  // neighbouring ids share cache lines. A free slot has id == -1.
  static constexpr int kPageBits = 10;
  static constexpr size_t kPageSize = size_t{1} << kPageBits;
  std::vector<std::unique_ptr<Entry[]>> pages_ GUARDED_BY(mu_);
  // Entries of the batched call being validated (reused, grows only).
  std::vector<Entry*> batch_scratch_ GUARDED_BY(mu_);
  size_t registered_ GUARDED_BY(mu_) = 0;        // entries in the registry
  size_t pinned_entries_ GUARDED_BY(mu_) = 0;    // entries with pins > 0
  size_t registered_bytes_ GUARDED_BY(mu_) = 0;  // their bytes
  bool paused_ GUARDED_BY(mu_) = false;
  bool stop_ GUARDED_BY(mu_) = false;     // workers must exit
  bool closed_ GUARDED_BY(mu_) = false;   // Close() started
  // Calls that may drop mu_ midway (Close waits).
  int active_calls_ GUARDED_BY(mu_) = 0;
  // HintNextUse's clock.
  int64_t hint_clock_ GUARDED_BY(mu_) = std::numeric_limits<int64_t>::min();
  // Acquire calls so far: Entry::want_at's clock.
  uint64_t acquire_calls_ GUARDED_BY(mu_) = 0;
  Stats stats_ GUARDED_BY(mu_);  // counters; gauges are filled by GetStats
  // Note [Host tier]. Files are never closed before Close, and DiskFile
  // objects never move, so a read outside mu_ may use one.
  const bool disk_direct_io_;
  std::vector<std::unique_ptr<DiskFile>> files_ GUARDED_BY(mu_);
  std::vector<std::unique_ptr<DiskSpec>> disk_specs_ GUARDED_BY(mu_);
  std::unique_ptr<DeviceCache> host_tier_;  // null without a host tier
  void* host_tier_alloc_ = nullptr;         // what AllocateHost returned
  size_t host_tier_alloc_bytes_ = 0;
  const int disk_reader_threads_;
  CondVar stage_cv_;  // readers: disk-backed work queued, room, close
  std::vector<std::thread> readers_;  // started with the workers; Close joins
};

}  // namespace prefetch
