#include "device_cache.h"

#include <new>

#include "errors.h"

namespace prefetch {

void EntryList::PushNewest(Entry* e) {
  e->lru_next = nullptr;
  e->lru_prev = newest;
  if (newest != nullptr) {
    newest->lru_next = e;
  } else {
    oldest = e;
  }
  newest = e;
}

void EntryList::Unlink(Entry* e) {
  if (e->lru_prev != nullptr) {
    e->lru_prev->lru_next = e->lru_next;
  } else {
    oldest = e->lru_next;
  }
  if (e->lru_next != nullptr) {
    e->lru_next->lru_prev = e->lru_prev;
  } else {
    newest = e->lru_prev;
  }
  e->lru_prev = e->lru_next = nullptr;
}

void LruPolicy::Touch(Entry* e) {
  if (list_.newest == e) return;
  list_.Unlink(e);
  list_.PushNewest(e);
}

Entry* LruPolicy::PickVictim(bool (*evictable)(Entry*, void*), void* ctx) {
  for (Entry* e = list_.oldest; e != nullptr; e = e->lru_next) {
    if (evictable(e, ctx)) return e;
  }
  return nullptr;
}

void LruPolicy::ForEach(void (*fn)(Entry*, void*), void* ctx) const {
  for (Entry* e = list_.oldest; e != nullptr; e = e->lru_next) fn(e, ctx);
}

void CyclicPolicy::OnInsert(Entry* e) {
  e->policy_used = false;
  e->policy_stamp = clock_;
  fresh_.PushNewest(e);
}

void CyclicPolicy::OnRemove(Entry* e) {
  (e->policy_used ? used_ : fresh_).Unlink(e);
}

void CyclicPolicy::OnRequest(Entry* e) {
  // Asked for again: the next layers will read it.
  OnRemove(e);
  OnInsert(e);
}

void CyclicPolicy::OnUse(Entry* e) {
  OnRemove(e);
  e->policy_used = true;
  e->policy_stamp = clock_;
  used_.PushNewest(e);
}

// Note [Cyclic eviction]: stale fresh oldest first, then used newest first,
// then fresh oldest first (CyclicPolicy::Walk).
Entry* CyclicPolicy::PickVictim(bool (*evictable)(Entry*, void*), void* ctx) {
  return Walk([&](Entry* e) { return evictable(e, ctx); });
}

void CyclicPolicy::ForEach(void (*fn)(Entry*, void*), void* ctx) const {
  Walk([&](Entry* e) {
    fn(e, ctx);
    return false;
  });
}

void NextUsePolicy::Link(Entry* e) {
  e->policy_stamp = ++seq_;
  Place(e);
}

void NextUsePolicy::Place(Entry* e) {
  e->policy_used = false;  // in order_, not overflow_
  try {
    order_.insert(Key{e->next_use, e->policy_stamp, e});
  } catch (const std::bad_alloc&) {
    e->policy_used = true;
    overflow_.PushNewest(e);
  }
}

void NextUsePolicy::OnRemove(Entry* e) {
  if (e->policy_used) {
    overflow_.Unlink(e);
    e->policy_used = false;
  } else {
    order_.erase(Key{e->next_use, e->policy_stamp, e});
  }
}

void NextUsePolicy::OnHint(Entry* e, int64_t next_use) {
  OnRemove(e);
  e->next_use = next_use;
  Place(e);  // a hint is not a use: the touch sequence stays
}

// Note [Next-use eviction]: no valid hint first, then farthest next use.
Entry* NextUsePolicy::PickVictim(bool (*evictable)(Entry*, void*), void* ctx) {
  return Walk([&](Entry* e) { return evictable(e, ctx); });
}

void NextUsePolicy::ForEach(void (*fn)(Entry*, void*), void* ctx) const {
  Walk([&](Entry* e) {
    fn(e, ctx);
    return false;
  });
}

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(const std::string& name,
                                                   uint64_t cycle) {
  if (name == "lru") return std::make_unique<LruPolicy>();
  if (name == "cyclic") {
    return std::make_unique<CyclicPolicy>(kCyclicStaleAfterAcquires, cycle);
  }
  if (name == "next-use") return std::make_unique<NextUsePolicy>();
  throw PrefetchError(ErrorKind::kInvalidArgument,
                      "unknown eviction policy '" + name +
                          "' (known: lru, cyclic, next-use)");
}

DeviceCache::DeviceCache(char* arena, size_t budget_bytes,
                         std::unique_ptr<EvictionPolicy> policy)
    : arena_(arena), budget_bytes_(budget_bytes), policy_(std::move(policy)) {
  const size_t usable = budget_bytes_ / kSlotAlignmentBytes * kSlotAlignmentBytes;
  if (usable > 0) free_ranges_.emplace(0, usable);
}

bool DeviceCache::Allocate(size_t bytes, size_t* offset, size_t* slot_bytes) {
  const size_t need = AlignSlot(bytes);
  for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
    if (it->second < need) continue;
    *offset = it->first;
    *slot_bytes = need;
    const size_t rest = it->second - need;
    const size_t rest_offset = it->first + need;
    free_ranges_.erase(it);
    if (rest > 0) free_ranges_.emplace(rest_offset, rest);
    used_bytes_ += need;
    return true;
  }
  return false;
}

void DeviceCache::Free(size_t offset, size_t slot_bytes) {
  used_bytes_ -= slot_bytes;
  auto next = free_ranges_.lower_bound(offset);
  size_t start = offset;
  size_t length = slot_bytes;
  if (next != free_ranges_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      length += prev->second;
      free_ranges_.erase(prev);
    }
  }
  if (next != free_ranges_.end() && offset + slot_bytes == next->first) {
    length += next->second;
    free_ranges_.erase(next);
  }
  free_ranges_.emplace(start, length);
}

void DeviceCache::AddResident(Entry* e) {
  policy_->OnInsert(e);
  ++resident_count_;
}

void DeviceCache::RemoveResident(Entry* e) {
  policy_->OnRemove(e);
  --resident_count_;
}

}  // namespace prefetch
