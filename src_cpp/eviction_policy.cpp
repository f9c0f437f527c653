#include "eviction_policy.h"

#include <new>
#include <utility>

#include "decay_policy.h"
#include "errors.h"

namespace prefetch {

void EntryList::PushNewest(Entry* e) { LinkLast<&Entry::policy_prev, &Entry::policy_next>(e, oldest, newest); }

void EntryList::Unlink(Entry* e) {
  if (e->policy_prev != nullptr) {
    e->policy_prev->policy_next = e->policy_next;
  } else {
    oldest = e->policy_next;
  }
  if (e->policy_next != nullptr) {
    e->policy_next->policy_prev = e->policy_prev;
  } else {
    newest = e->policy_prev;
  }
  e->policy_prev = e->policy_next = nullptr;
}

void LruPolicy::Touch(Entry* e) {
  if (list_.newest == e) return;
  list_.Unlink(e);
  list_.PushNewest(e);
}

Entry* LruPolicy::PickVictim(bool (*evictable)(Entry*, void*), void* ctx) {
  for (Entry* e = list_.oldest; e != nullptr; e = e->policy_next) {
    if (evictable(e, ctx)) return e;
  }
  return nullptr;
}

void LruPolicy::ForEach(void (*fn)(Entry*, void*), void* ctx) const {
  for (Entry* e = list_.oldest; e != nullptr; e = e->policy_next) fn(e, ctx);
}

void CyclicPolicy::OnInsert(Entry* e) {
  e->policy_second_list = false;
  e->policy_stamp = clock_;
  fresh_.PushNewest(e);
}

void CyclicPolicy::OnRemove(Entry* e) {
  (e->policy_second_list ? used_ : fresh_).Unlink(e);
}

void CyclicPolicy::OnRequest(Entry* e) {
  // Asked for again: the next layers will read it.
  OnRemove(e);
  OnInsert(e);
}

void CyclicPolicy::OnUse(Entry* e) {
  OnRemove(e);
  e->policy_second_list = true;
  e->policy_stamp = clock_;
  used_.PushNewest(e);
}

template <class Policy>
Entry* WalkedPolicy<Policy>::PickVictim(bool (*evictable)(Entry*, void*), void* ctx) {
  return static_cast<Policy*>(this)->Walk([&](Entry* e) { return evictable(e, ctx); });
}

template <class Policy>
void WalkedPolicy<Policy>::ForEach(void (*fn)(Entry*, void*), void* ctx) const {
  static_cast<const Policy*>(this)->Walk([&](Entry* e) {
    fn(e, ctx);
    return false;
  });
}

// Note [Cyclic eviction]: stale fresh oldest first, then used newest first,
// then fresh oldest first (CyclicPolicy::Walk).
template class WalkedPolicy<CyclicPolicy>;

EntryList* NextUsePolicy::BucketFor(int64_t next_use) {
  if (last_list_ != nullptr && last_time_ == next_use) return last_list_;
  auto at = buckets_.lower_bound(next_use);
  if (at == buckets_.end() || at->first != next_use) {
    if (!spare_.empty()) {
      Buckets::node_type node = std::move(spare_.back());
      spare_.pop_back();
      node.key() = next_use;
      node.mapped() = EntryList{};
      at = buckets_.insert(at, std::move(node));  // a node handle's insert never allocates
    } else {
      try {
        at = buckets_.emplace_hint(at, next_use, EntryList{});
      } catch (const std::bad_alloc&) {
        return nullptr;
      }
    }
  }
  last_time_ = next_use;
  last_list_ = &at->second;
  return last_list_;
}

void NextUsePolicy::Place(Entry* e) {
  e->policy_second_list = false;
  e->policy_list = nullptr;
  if (e->next_use == kNoNextUse) {  // by its touch: a cleared entry keeps its place
    const Touched key{e->policy_stamp, e};
    if (!spare_unhinted_.empty()) {
      Unhinted::node_type node = std::move(spare_unhinted_.back());
      spare_unhinted_.pop_back();
      node.value() = key;
      unhinted_.insert(unhinted_.end(), std::move(node));  // a node handle's insert never allocates
      return;
    }
    try {
      unhinted_.insert(unhinted_.end(), key);  // a new touch goes last; a cleared one is searched for
      return;
    } catch (const std::bad_alloc&) {
    }
  } else if (EntryList* list = BucketFor(e->next_use)) {
    e->policy_list = list;
    list->PushNewest(e);  // the newest arrival at its time: no search
    return;
  }
  e->policy_second_list = true;
  overflow_.PushNewest(e);
}

void NextUsePolicy::Unplace(Entry* e) {
  if (e->policy_second_list) {
    overflow_.Unlink(e);
    e->policy_second_list = false;
    return;
  }
  if (e->next_use == kNoNextUse) {
    Unhinted::node_type node = unhinted_.extract(Touched{e->policy_stamp, e});
    if (node.empty()) return;  // not in the set (cannot happen): nothing to keep
    try {
      spare_unhinted_.push_back(std::move(node));
    } catch (const std::bad_alloc&) {
      // The node is freed with `node`.
    }
    return;
  }
  EntryList* list = BucketOf(e);
  list->Unlink(e);
  e->policy_list = nullptr;
  if (list->oldest != nullptr) return;
  if (list == last_list_) last_list_ = nullptr;
  Buckets::node_type node = buckets_.extract(e->next_use);
  try {
    spare_.push_back(std::move(node));
  } catch (const std::bad_alloc&) {
    // The node is freed with `node`.
  }
}

void NextUsePolicy::Touch(Entry* e) {
  if (e->policy_second_list) {  // in overflow_: try for a place again
    Unplace(e);
    e->policy_stamp = ++seq_;
    Place(e);
    return;
  }
  if (e->next_use == kNoNextUse) {  // its own node re-keyed as the newest: no allocation
    Unhinted::node_type node = unhinted_.extract(Touched{e->policy_stamp, e});
    e->policy_stamp = ++seq_;
    if (node.empty()) {  // not in the set (cannot happen): placed anew
      Place(e);
      return;
    }
    node.value() = Touched{e->policy_stamp, e};
    unhinted_.insert(unhinted_.end(), std::move(node));
    return;
  }
  e->policy_stamp = ++seq_;
  EntryList* list = BucketOf(e);
  if (list->newest == e) return;
  list->Unlink(e);
  list->PushNewest(e);
}

void NextUsePolicy::OnHint(Entry* e, int64_t next_use) {
  // The same time again: the entry keeps its place. Another time: it
  // arrives there now, the newest of that time, or (no hint) goes back
  // among the unhinted by its last touch (Note [Next-use buckets]).
  if (next_use == e->next_use && !e->policy_second_list) return;
  Unplace(e);
  e->next_use = next_use;
  Place(e);
}

// Note [Next-use eviction]: no valid hint first, then farthest next use
// (NextUsePolicy::Walk).
template class WalkedPolicy<NextUsePolicy>;
template class WalkedPolicy<DecayPolicy>;

void CheckEvictionPolicyName(const std::string& name) {
  if (name != "lru" && name != "cyclic" && name != "next-use" && name != "decay") {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "unknown eviction policy '" + name +
                            "' (known: lru, cyclic, next-use, decay)");
  }
}

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(const std::string& name,
                                                   uint64_t cycle) {
  CheckEvictionPolicyName(name);
  if (name == "lru") return std::make_unique<LruPolicy>();
  if (name == "cyclic") {
    return std::make_unique<CyclicPolicy>(kCyclicStaleAfterAcquires, cycle);
  }
  if (name == "decay") {
    return std::make_unique<DecayPolicy>(kCyclicStaleAfterAcquires, cycle);
  }
  return std::make_unique<NextUsePolicy>();
}

}  // namespace prefetch
