#include "task_queue.h"

namespace prefetch {

void TaskQueue::PushBack(Entry* e, int band) {
  e->band = static_cast<uint8_t>(band);
  e->q_next = nullptr;
  e->q_prev = tail_[band];
  if (tail_[band] != nullptr) {
    tail_[band]->q_next = e;
  } else {
    head_[band] = e;
  }
  tail_[band] = e;
  nonempty_mask_ |= 1u << band;
  ++size_;
}

void TaskQueue::PushFront(Entry* e, int band) {
  e->band = static_cast<uint8_t>(band);
  e->q_prev = nullptr;
  e->q_next = head_[band];
  if (head_[band] != nullptr) {
    head_[band]->q_prev = e;
  } else {
    tail_[band] = e;
  }
  head_[band] = e;
  nonempty_mask_ |= 1u << band;
  ++size_;
}

void TaskQueue::Remove(Entry* e) {
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

Entry* TaskQueue::PeekMostUrgent() const {
  if (nonempty_mask_ == 0) return nullptr;
  return head_[__builtin_ctz(nonempty_mask_)];
}

Entry* TaskQueue::PopMostUrgent() {
  Entry* e = PeekMostUrgent();
  if (e != nullptr) Remove(e);
  return e;
}

}  // namespace prefetch
