// The "decay" eviction policy: frequency with exponential decay, for the
// routing of trained models (Note [Decayed-frequency eviction]).
// Not thread-safe: REQUIRES the handle's mutex.
#pragma once

#include <cstdint>
#include <set>
#include <vector>

#include "eviction_policy.h"

namespace prefetch {

// Note [Decayed-frequency eviction]
// A trained model's router keeps coming back to a layer's favourite
// experts across tokens, and some experts are favourites for many tokens.
// LRU forgets an expert after one absence; "cyclic" assumes a loop. Here
// each acquired entry has a score, the number of its uses, each weighted by
// exp(-age / tau) with the age in Acquire calls; the lowest score goes
// first. tau is kDecayTokens decode steps (cycle Acquire calls each; one
// call a step when the cycle is unknown).
//
// Scores are compared at one moment, so each entry keeps the moment-free
// key ln(score at its last use) + (last use) / tau: two entries' keys
// differ by the log of their scores' ratio at any time, and a use re-keys
// only the entry used (new score = old score * exp(-gap / tau) + 1).
//
// Entries that a prefetch brought (or asked for again) and no acquire has
// read since are what the next layers will read: they go last, oldest
// first, unless kCyclicStaleAfterAcquires calls passed them by (a wrong
// guess): those go first, as under "cyclic". A use moves an entry to the
// scored set, keeping its score from earlier stays (an id's score outlives
// its eviction, in Entry::policy_score and policy_stamp).
// Victim order: stale fresh (oldest first), scored (lowest key first, then
// least recently used), fresh (oldest first). A node that cannot be had
// for the scored set (std::bad_alloc) puts the entry on an overflow list
// that goes first, never an exception.
//
// kDecayTokens was fitted on the first halves of three real routing traces
// (gemma-4-26B-A4B, gpt-oss-120b, Qwen3-30B-A3B; bench/policies.py) and is
// reported on the second halves in docs/benchmarks.md.
class DecayPolicy final : public WalkedPolicy<DecayPolicy> {
 public:
  DecayPolicy(uint64_t stale_after, uint64_t cycle);
  const char* Name() const override { return "decay"; }
  void OnInsert(Entry* e) override;
  void OnRequest(Entry* e) override;
  void OnUse(Entry* e) override;
  void OnRemove(Entry* e) override;
  void OnAcquireCall() override { ++clock_; }

 private:
  friend class WalkedPolicy<DecayPolicy>;
  struct Keyed {
    double key;
    uint64_t last_use;  // ties: least recently used first
    Entry* e;
    bool operator<(const Keyed& o) const {
      return key != o.key ? key < o.key : last_use < o.last_use;
    }
  };
  using Scored = std::multiset<Keyed>;
  enum Where : uint8_t { kFresh = 0, kScored = 1, kOverflow = 2 };
  bool Stale(const Entry* e) const { return clock_ - e->policy_stamp > stale_after_; }
  void Unlink(Entry* e);
  template <typename Visit>
  Entry* Walk(Visit visit) const {
    for (Entry* e = overflow_.oldest; e != nullptr; e = e->policy_next) {
      if (visit(e)) return e;
    }
    for (Entry* e = fresh_.oldest; e != nullptr && Stale(e); e = e->policy_next) {
      if (visit(e)) return e;
    }
    for (const Keyed& k : scored_) {
      if (visit(k.e)) return k.e;
    }
    for (Entry* e = fresh_.oldest; e != nullptr; e = e->policy_next) {
      if (!Stale(e) && visit(e)) return e;
    }
    return nullptr;
  }
  const uint64_t stale_after_;
  const double tau_;    // Acquire calls
  uint64_t clock_ = 0;  // Acquire calls so far
  EntryList fresh_;     // prefetched, not acquired since; oldest first
  EntryList overflow_;  // no node could be had for scored_
  Scored scored_;
  // Nodes of entries that left scored_, for the next ones: no allocation
  // once warm.
  std::vector<Scored::node_type> spare_;
};

// Decode steps of "decay"'s time constant (Note [Decayed-frequency eviction]).
constexpr uint64_t kDecayTokens = 16;

}  // namespace prefetch
