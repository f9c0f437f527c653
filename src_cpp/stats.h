// Engine counters, read as one consistent snapshot under the handle's lock.
//
// Invariants (tested): requests == enqueued + deduplicated;
// acquires == hits + misses; late <= misses; wasted <= evictions; and, with
// no unregister, enqueued + on_demand == copies + copy_errors + cancelled +
// declined +// queue_depth (every queued id leaves the queue exactly once).
#pragma once

#include <cstdint>

namespace prefetch {

struct Stats {
  uint64_t requests = 0;          // ids named by prefetch calls
  uint64_t enqueued = 0;          // of those, newly queued
  uint64_t deduplicated = 0;      // of those, already queued/copying/resident
  uint64_t upgraded = 0;          // queued ids moved to a more urgent band
  uint64_t touched = 0;           // resident ids whose recency was refreshed
  uint64_t cancelled = 0;         // queued ids removed by cancel
  uint64_t declined = 0;          // prefetches dropped: the cache held only
                                  // entries needed sooner (admission control)
  uint64_t prefetches_gone = 0;   // a step's prefetch ids unregistered by
                                  // another thread while its acquire waited
                                  // (dropped, not requested)
  uint64_t acquires = 0;          // ids named by acquire calls
  uint64_t hits = 0;              // acquired while resident and complete
  uint64_t misses = 0;            // acquired while not resident or pending
  uint64_t late = 0;              // misses whose copy was already under way
  uint64_t on_demand = 0;         // ids queued (at band 0) by acquire
  uint64_t evictions = 0;         // resident entries evicted
  uint64_t wasted = 0;            // evicted after a prefetch, never acquired
  uint64_t copies = 0;            // completed copies
  uint64_t caller_copies = 0;     // of those, issued by an acquirer itself
  uint64_t copy_errors = 0;       // failed copies
  uint64_t spec_underruns = 0;    // cap waits after which no speculative
                                  // chunk was left on the link
  uint64_t bytes_copied = 0;      // bytes of completed copies
  double copy_seconds = 0;        // time issuing/doing copies (workers and acquirers)
  uint64_t queue_depth = 0;       // gauge: queued ids, all devices
  uint64_t bytes_in_flight = 0;   // gauge: bytes being copied
  uint64_t resident_count = 0;    // gauge: resident entries
  uint64_t resident_bytes = 0;    // gauge: bytes of slots in use
  uint64_t pinned_count = 0;      // gauge: entries with pins > 0
  uint64_t speculative_cap_bytes = 0;  // gauge: the cap on speculative bytes
                                       // in flight now (largest device's)
  uint64_t disk_reads = 0;        // host tier: reads of disk-backed tensors
  uint64_t disk_read_bytes = 0;   // their spans' bytes (aligned)
  uint64_t disk_errors = 0;       // reads that failed (also copy_errors)
  uint64_t host_tier_hits = 0;    // copies of a tensor staged for an earlier copy: no read
  uint64_t host_tier_evictions = 0;  // staged tensors evicted from it
  uint64_t host_tier_used_bytes = 0;    // gauge: bytes of its slots in use
  uint64_t host_tier_budget_bytes = 0;  // gauge: its page-locked arena
  uint64_t registered = 0;        // gauge: registered ids
  uint64_t registered_bytes = 0;  // gauge: their bytes
  uint64_t last_batch_ns = 0;     // duration of the last batched call
  int64_t last_batch_start_ns = 0;  // steady clock at its start
  int64_t last_batch_end_ns = 0;    // steady clock at its end
};

}  // namespace prefetch
