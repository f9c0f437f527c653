// The device cache of one device: a byte arena carved into slots, and the
// eviction policy that orders resident entries.
//
// The arena is taken once (by the caller or the backend) and never grows, so
// resident bytes can never exceed the budget. Slots are variable-size ranges
// of the arena, aligned to kSlotAlignmentBytes, handed out first-fit from a
// free list that coalesces neighbours on free. When no range fits, the handle
// evicts the policy's first evictable victim and tries again; with experts of
// one size (the common MoE case) one eviction always frees a fitting slot.
//
// An entry is evictable only when unpinned and both its copy (`ready`) and its
// consumers' last use (`last_use`) have completed: see Note [Completion
// tokens] in copy_backend.h. That is PyTorch's record_stream contract.
// Not thread-safe: REQUIRES the handle's mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "entry.h"
#include "eviction_policy.h"

namespace prefetch {

constexpr size_t kSlotAlignmentBytes = 256;  // slot offsets and sizes

inline size_t AlignSlot(size_t bytes) {
  if (bytes == 0) return kSlotAlignmentBytes;
  return (bytes + kSlotAlignmentBytes - 1) / kSlotAlignmentBytes *
         kSlotAlignmentBytes;
}


class DeviceCache {
 public:
  DeviceCache(char* arena, size_t budget_bytes,
              std::unique_ptr<EvictionPolicy> policy);

  char* arena() const { return arena_; }
  size_t budget_bytes() const { return budget_bytes_; }
  size_t used_bytes() const { return used_bytes_; }
  size_t resident_count() const { return resident_count_; }

  // The policy's view of the entries (every call of the handle goes
  // through here; EvictionPolicy says what each means).
  void Requested(Entry* e) { policy_->OnRequest(e); }  // resident, asked for again
  void Used(Entry* e) { policy_->OnUse(e); }            // resident, read
  void AcquireCall() { policy_->OnAcquireCall(); }      // one layer's clock tick
  void Hint(Entry* e, int64_t next_use) { policy_->OnHint(e, next_use); }
  void Clock(int64_t now) { policy_->OnClock(now); }
  const char* PolicyName() const { return policy_->Name(); }
  Entry* PickVictim(bool (*evictable)(Entry*, void*), void* ctx) {
    return policy_->PickVictim(evictable, ctx);
  }
  void ForEachInEvictionOrder(void (*fn)(Entry*, void*), void* ctx) const {
    policy_->ForEach(fn, ctx);
  }

  // Takes a slot of AlignSlot(bytes) bytes; false when no free range fits.
  bool Allocate(size_t bytes, size_t* offset, size_t* slot_bytes);
  // Returns a slot taken by Allocate.
  void Free(size_t offset, size_t slot_bytes);

  void AddResident(Entry* e);     // e has a slot; enters the policy
  void RemoveResident(Entry* e);  // leaves the policy; slot still held

 private:
  char* arena_;                            // base of budget_bytes_ bytes
  size_t budget_bytes_;                    // arena size
  size_t used_bytes_ = 0;                  // bytes in allocated slots
  size_t resident_count_ = 0;              // entries in the policy
  std::map<size_t, size_t> free_ranges_;   // offset -> length, coalesced
  std::unique_ptr<EvictionPolicy> policy_;
};

}  // namespace prefetch
