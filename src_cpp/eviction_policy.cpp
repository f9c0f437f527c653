#include "eviction_policy.h"

#include <new>
#include <utility>

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

void NextUsePolicy::Link(Entry* e) {
  e->policy_stamp = ++seq_;
  Place(e);
}

void NextUsePolicy::Place(Entry* e) {
  e->policy_second_list = false;  // in order_
  try {
    order_.insert(Key{e->next_use, e->policy_stamp, e});
  } catch (const std::bad_alloc&) {
    e->policy_second_list = true;
    overflow_.PushNewest(e);
  }
}

void NextUsePolicy::OnRemove(Entry* e) {
  if (e->policy_second_list) {
    overflow_.Unlink(e);
    e->policy_second_list = false;
  } else {
    order_.erase(Key{e->next_use, e->policy_stamp, e});
  }
}

void NextUsePolicy::Rekey(Entry* e, int64_t next_use, uint64_t seq) {
  if (e->policy_second_list) {  // in overflow_: no node to reuse
    OnRemove(e);
    e->next_use = next_use;
    e->policy_stamp = seq;
    Place(e);
    return;
  }
  auto node = order_.extract(Key{e->next_use, e->policy_stamp, e});
  e->next_use = next_use;
  e->policy_stamp = seq;
  if (node.empty()) {  // not linked (cannot happen): link it anew
    Place(e);
    return;
  }
  node.value() = Key{next_use, seq, e};
  order_.insert(std::move(node));  // a node handle's insert never allocates
}

void NextUsePolicy::OnHint(Entry* e, int64_t next_use) {
  // A hint is not a use: the touch sequence stays.
  Rekey(e, next_use, e->policy_stamp);
}

// Note [Next-use eviction]: no valid hint first, then farthest next use
// (NextUsePolicy::Walk).
template class WalkedPolicy<NextUsePolicy>;

void CheckEvictionPolicyName(const std::string& name) {
  if (name != "lru" && name != "cyclic" && name != "next-use") {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "unknown eviction policy '" + name +
                            "' (known: lru, cyclic, next-use)");
  }
}

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(const std::string& name,
                                                   uint64_t cycle) {
  CheckEvictionPolicyName(name);
  if (name == "lru") return std::make_unique<LruPolicy>();
  if (name == "cyclic") {
    return std::make_unique<CyclicPolicy>(kCyclicStaleAfterAcquires, cycle);
  }
  return std::make_unique<NextUsePolicy>();
}

}  // namespace prefetch
