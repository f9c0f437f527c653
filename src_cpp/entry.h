// One registered tensor and its place in the engine's state machine.
//
// Note [Entry states]
//   kHost      bytes only in host memory; not queued.
//   kQueued    linked into its device's TaskQueue at `band`.
//   kCopying   a copier owns it and is issuing its copy into `slot_offset`:
//              the device's worker, or an acquirer issuing its own miss
//              (Note [Caller-runs on-demand copies] in acquire_release.cpp).
//   kResident  its slot holds (or, while `ready` is pending, will hold) the
//              bytes; linked into the device cache's eviction policy.
// Transitions: Host->Queued (prefetch/acquire), Queued->Host (cancel),
// Queued->Copying (a worker or an acquirer takes it), Copying->Resident
// (copy issued),
// Copying->Host (copy failed: `error` set), Resident->Host (evicted).
// Every field is guarded by the handle's mutex; the copier reads `host_ptr`
// and `bytes` outside it while the entry is kCopying, which nobody else
// changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "copy_backend.h"

namespace prefetch {

// Entry::next_use when the caller gave no hint (Note [Next-use eviction]).
constexpr int64_t kNoNextUse = std::numeric_limits<int64_t>::max();

enum class EntryState : uint8_t { kHost, kQueued, kCopying, kResident };

struct alignas(64) Entry {
  // Hot: read or written by every batched enqueue; kept in one cache line.
  int64_t id = -1;                   // the tensor id; -1 = registry slot free
  EntryState state = EntryState::kHost;
  uint8_t band = 0;                  // queue band while kQueued or kCopying
  bool prefetched_unused = false;    // copied by a prefetch, not yet acquired
  int32_t device = 0;                // home device
  Entry* q_prev = nullptr;           // TaskQueue links
  Entry* q_next = nullptr;
  Entry* policy_prev = nullptr;      // EvictionPolicy links (every policy)
  Entry* policy_next = nullptr;
  // Cold.
  void* host_ptr = nullptr;          // host bytes (engine-owned unless external)
  bool owns_host = true;             // false: registered with RegisterExternal
  size_t bytes = 0;                  // registered size in bytes
  int32_t pins = 0;                  // acquirers holding (or waiting for) it
  uint64_t error_seq = 0;            // bumped on every failed copy
  size_t slot_offset = 0;            // offset of its slot in the device arena
  size_t slot_bytes = 0;             // size of its slot (aligned)
  CopyToken ready = kTokenDone;      // completion of the copy into the slot
  CopyToken last_use = kTokenDone;   // completion of consumers' stream work
  // Cyclic: the acquire clock at its last move; next-use: its touch sequence.
  uint64_t policy_stamp = 0;
  // Which of its policy's two lists the entry is on: cyclic, `used_` (true)
  // or `fresh_`; next-use, the `overflow_` list (true) or else a bucket (a
  // hinted entry) or the unhinted set.
  bool policy_second_list = false;
  void* policy_list = nullptr;       // next-use: its bucket (an EntryList) while in one
  // Decay (Note [Decayed-frequency eviction]): its moment-free score key and
  // the Acquire call of its last use; both outlive an eviction.
  double policy_key = -std::numeric_limits<double>::infinity();
  uint64_t policy_used_at = 0;
  uint8_t policy_where = 0;          // decay: fresh, scored or overflow
  int64_t next_use = kNoNextUse;     // caller's hint: when it is next read
  uint64_t want_at = 0;              // prefetch: acquire call it is wanted by
  bool use_on_arrival = false;       // read while not resident: a use once copied
  int32_t disk = -1;                 // disk-backed: its index in disk_specs_ (Note [Host tier])
  std::string error;                 // last copy failure, raised on acquire
};

// An Entry is on two intrusive lists at once, each through its own pair of
// links: a TaskQueue band (q_prev, q_next) and its eviction policy's list
// (policy_prev, policy_next). Appending `e` after `last` is the same for
// both.
template <Entry* Entry::*Prev, Entry* Entry::*Next>
inline void LinkLast(Entry* e, Entry*& first, Entry*& last) {
  e->*Next = nullptr;
  e->*Prev = last;
  if (last != nullptr) {
    last->*Next = e;
  } else {
    first = e;
  }
  last = e;
}

}  // namespace prefetch
