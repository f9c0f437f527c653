// Priority task queue of one device.
//
// Owns nothing: entries are linked intrusively (Entry::q_prev/q_next), so a
// push, a band upgrade and a targeted cancel are O(1) and allocate nothing.
// Bands 0..kNumBands-1, 0 the most urgent (on-demand); FIFO inside a band. A
// bitmask of non-empty bands makes PeekMostUrgent O(1).
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
  // Entries linked into a chain outside any queue, in order, to be spliced
  // into one band at once (AppendChain): the batched enqueue builds one per
  // device, so consecutive appends do not serialise on the store to tail_.
  struct Chain {
    Entry* first = nullptr;
    Entry* last = nullptr;
    size_t count = 0;
    void Append(Entry* e) {
      LinkLast<&Entry::q_prev, &Entry::q_next>(e, first, last);
      ++count;
    }
  };
  // Splices `chain` (every entry with e->band == band) at the back of
  // `band` and empties it.
  void AppendChain(Chain* chain, int band);
  // Unlinks a queued `e`.
  void Remove(Entry* e);
  // Oldest entry of the most urgent band without unlinking it, or nullptr.
  Entry* PeekMostUrgent() const;
  // Calls fn(e) for every queued entry, most urgent first, without unlinking.
  template <typename Fn>
  void ForEach(Fn fn) const {
    for (int b = 0; b < kNumBands; ++b) {
      for (Entry* e = head_[b]; e != nullptr; e = e->q_next) fn(e);
    }
  }
  // Calls fn(e) for every queued entry in bands >= band after unlinking it.
  template <typename Fn>
  size_t RemoveAtOrBelow(int band, Fn fn);

 private:
  Entry* head_[kNumBands] = {};  // oldest entry of each band
  Entry* tail_[kNumBands] = {};  // newest entry of each band
  uint32_t nonempty_mask_ = 0;   // bit b set iff band b is non-empty
  size_t size_ = 0;              // entries queued in all bands
};

inline void TaskQueue::PushBack(Entry* e, int band) {
  e->band = static_cast<uint8_t>(band);
  LinkLast<&Entry::q_prev, &Entry::q_next>(e, head_[band], tail_[band]);
  nonempty_mask_ |= 1u << band;
  ++size_;
}

inline void TaskQueue::AppendChain(Chain* chain, int band) {
  if (chain->count == 0) return;
  chain->first->q_prev = tail_[band];
  if (tail_[band] != nullptr) {
    tail_[band]->q_next = chain->first;
  } else {
    head_[band] = chain->first;
  }
  tail_[band] = chain->last;
  nonempty_mask_ |= 1u << band;
  size_ += chain->count;
  *chain = Chain{};
}

inline void TaskQueue::Remove(Entry* e) {
  const int band = e->band;
  if (e->q_prev != nullptr) {
    e->q_prev->q_next = e->q_next;
  } else {
    head_[band] = e->q_next;
  }
  if (e->q_next != nullptr) {
    e->q_next->q_prev = e->q_prev;
  } else {
    tail_[band] = e->q_prev;
  }
  e->q_prev = e->q_next = nullptr;
  if (head_[band] == nullptr) nonempty_mask_ &= ~(1u << band);
  --size_;
}

inline Entry* TaskQueue::PeekMostUrgent() const {
  if (nonempty_mask_ == 0) return nullptr;
  return head_[__builtin_ctz(nonempty_mask_)];
}

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
