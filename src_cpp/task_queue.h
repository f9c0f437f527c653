// Priority task queue of one device.
//
// Owns nothing: entries are linked intrusively (Entry::q_prev/q_next), so a
// push, a band upgrade and a targeted cancel are O(1) and allocate nothing.
// Bands 0..kNumBands-1, 0 the most urgent (on-demand); FIFO inside a band. A
// bitmask of non-empty bands makes PopMostUrgent O(1).
// Not thread-safe: REQUIRES the handle's mutex.
#pragma once

#include <cstddef>
#include <cstdint>

#include "entry.h"

namespace prefetch {

constexpr int kNumBands = 20;        // priority bands, 0 = on-demand
constexpr int kOnDemandBand = 0;
constexpr int kDefaultPrefetchBand = 1;

class TaskQueue {
 public:
  bool empty() const { return nonempty_mask_ == 0; }
  size_t size() const { return size_; }
  bool HasBand(int band) const { return (nonempty_mask_ >> band) & 1u; }

  // Appends `e` (not queued) at the back of `band`.
  void PushBack(Entry* e, int band);
  // Puts `e` (not queued) at the front of `band` (a popped task put back).
  void PushFront(Entry* e, int band);
  // Unlinks a queued `e`.
  void Remove(Entry* e);
  // Unlinks and returns the oldest entry of the most urgent band, or nullptr.
  Entry* PopMostUrgent();
  // Oldest entry of the most urgent band without unlinking it, or nullptr.
  Entry* PeekMostUrgent() const;
  // Calls fn(e) for every queued entry in bands >= band after unlinking it.
  template <typename Fn>
  size_t RemoveAtOrBelow(int band, Fn fn);

 private:
  Entry* head_[kNumBands] = {};  // oldest entry of each band
  Entry* tail_[kNumBands] = {};  // newest entry of each band
  uint32_t nonempty_mask_ = 0;   // bit b set iff band b is non-empty
  size_t size_ = 0;              // entries queued in all bands
};

template <typename Fn>
size_t TaskQueue::RemoveAtOrBelow(int band, Fn fn) {
  size_t removed = 0;
  for (int b = band; b < kNumBands; ++b) {
    while (head_[b] != nullptr) {
      Entry* e = head_[b];
      Remove(e);
      fn(e);
      ++removed;
    }
  }
  return removed;
}

}  // namespace prefetch
