#include "device_cache.h"

#include <new>

#include "errors.h"

namespace prefetch {

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
