#include "decay_policy.h"

#include <cmath>
#include <new>
#include <utility>

namespace prefetch {

DecayPolicy::DecayPolicy(uint64_t stale_after, uint64_t cycle)
    : stale_after_(stale_after),
      tau_(static_cast<double>(kDecayTokens * (cycle == 0 ? 1 : cycle))) {}

void DecayPolicy::OnInsert(Entry* e) {
  e->policy_where = kFresh;
  e->policy_stamp = clock_;
  fresh_.PushNewest(e);
}

void DecayPolicy::OnRequest(Entry* e) {
  // Asked for again: the next layers will read it (its score is kept).
  Unlink(e);
  OnInsert(e);
}

void DecayPolicy::OnUse(Entry* e) {
  Unlink(e);
  const double now = static_cast<double>(clock_) / tau_;
  // ln(score * exp(-gap / tau) + 1) + now / tau, with score * exp(-gap /
  // tau) = exp(key - now / tau); -inf (never used) gives now / tau.
  e->policy_key = now + std::log1p(std::exp(e->policy_key - now));
  e->policy_used_at = clock_;
  Keyed keyed{e->policy_key, clock_, e};
  try {
    if (!spare_.empty()) {
      Scored::node_type node = std::move(spare_.back());
      spare_.pop_back();
      node.value() = keyed;
      scored_.insert(std::move(node));
    } else {
      scored_.insert(keyed);
    }
    e->policy_where = kScored;
  } catch (const std::bad_alloc&) {
    e->policy_where = kOverflow;
    overflow_.PushNewest(e);
  }
}

void DecayPolicy::OnRemove(Entry* e) { Unlink(e); }

void DecayPolicy::Unlink(Entry* e) {
  switch (e->policy_where) {
    case kFresh:
      fresh_.Unlink(e);
      return;
    case kOverflow:
      overflow_.Unlink(e);
      return;
    default:
      break;
  }
  // Among the nodes of its key (one, but for exact ties), the entry's own.
  auto it = scored_.lower_bound(Keyed{e->policy_key, e->policy_used_at, nullptr});
  while (it != scored_.end() && it->e != e) ++it;
  if (it == scored_.end()) return;  // not reached: a scored entry has its node
  Scored::node_type node = scored_.extract(it);
  try {
    spare_.push_back(std::move(node));  // kept for the next use
  } catch (const std::bad_alloc&) {
    // the node is freed here instead
  }
}

}  // namespace prefetch
