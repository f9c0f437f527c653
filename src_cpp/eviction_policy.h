// Eviction policies: the order in which a device cache gives up resident
// entries (EvictionPolicy), and three the engine offers: "lru", "cyclic"
// and "next-use" ("decay" is in decay_policy.h). The device cache
// (device_cache.h) owns one and calls it.
// Not thread-safe: REQUIRES the handle's mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "entry.h"

namespace prefetch {

// Orders resident entries for eviction. Implementations link entries through
// Entry::policy_prev/policy_next (and may keep Entry::policy_stamp,
// Entry::policy_second_list and Entry::policy_list).
// No hook throws: one that allocates must cope with running out of memory.
class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual const char* Name() const = 0;
  virtual void OnInsert(Entry* e) = 0;   // became resident (copy issued)
  virtual void OnRequest(Entry* e) = 0;  // prefetch asked for it while resident
  virtual void OnUse(Entry* e) = 0;      // acquired while resident
  virtual void OnRemove(Entry* e) = 0;   // evicted or unregistered
  // Once per Acquire call, on every device's policy: a clock of "layers".
  virtual void OnAcquireCall() {}
  // Next-use hints (Note [Next-use eviction]). OnHint sets e->next_use; the
  // handle calls it for resident entries only (others just take the field).
  virtual void OnHint(Entry* e, int64_t next_use) { e->next_use = next_use; }
  // The caller's clock moved to `now` (never backwards).
  virtual void OnClock(int64_t now) { (void)now; }
  // Calls fn(e, ctx) for every entry in eviction order (next victim first).
  virtual void ForEach(void (*fn)(Entry*, void*), void* ctx) const = 0;
  // First entry in eviction order for which evictable(e, ctx) is true.
  virtual Entry* PickVictim(bool (*evictable)(Entry*, void*), void* ctx) = 0;
};

// A policy whose victim order is written once, as its `Walk(visit)`: visit
// the entries in that order until visit(e) returns true, and return that
// entry (or nullptr). PickVictim and ForEach are that walk (defined and
// instantiated in eviction_policy.cpp for the cyclic and next-use policies).
template <class Policy>
class WalkedPolicy : public EvictionPolicy {
 public:
  Entry* PickVictim(bool (*evictable)(Entry*, void*), void* ctx) final;
  void ForEach(void (*fn)(Entry*, void*), void* ctx) const final;
};

// A doubly linked list through Entry::policy_prev/policy_next.
struct EntryList {
  Entry* oldest = nullptr;
  Entry* newest = nullptr;
  void PushNewest(Entry* e);
  void Unlink(Entry* e);
};

// Least recently used first; a prefetch request or an acquire both count as
// a use.
class LruPolicy final : public EvictionPolicy {
 public:
  const char* Name() const override { return "lru"; }
  void OnInsert(Entry* e) override { list_.PushNewest(e); }
  void OnRequest(Entry* e) override { Touch(e); }
  void OnUse(Entry* e) override { Touch(e); }
  void OnRemove(Entry* e) override { list_.Unlink(e); }
  Entry* PickVictim(bool (*evictable)(Entry*, void*), void* ctx) override;
  void ForEach(void (*fn)(Entry*, void*), void* ctx) const override;

 private:
  void Touch(Entry* e);
  EntryList list_;  // oldest = next to evict
};

// Note [Cyclic eviction]
// A decode step visits the MoE layers in the same order every token, so the
// expert used longest ago is the one needed soonest (the next layers), and
// LRU, evicting exactly that one, misses on every access of a cyclic scan
// larger than the cache. Here, among entries that have been acquired since
// they arrived ("used"), the MOST recently used is evicted first: it belongs
// to the layer just computed, whose next use is a whole step away (MRU is
// optimal for a pure loop). Entries that arrived by prefetch or were asked for
// again by a prefetch and have not been acquired since ("fresh") are what the
// next layers will read, so they go last, oldest first. A fresh entry that
// `stale_after` Acquire calls (about that many layers) have passed without
// acquiring it was a wrong prediction: it goes first, oldest first, so
// mispredictions do not crowd out the entries that give hits.
// Victim order: stale fresh (oldest first), used (newest first), fresh
// (oldest first). One Acquire call per layer is what the clock assumes.
//
// With `cycle` (the Acquire calls of one decode step, the MoE layer count) an
// entry not used within the last `cycle` calls is out of the loop's working
// set (a prompt's leftovers, a layer that stopped routing to it): such
// entries go first, least recently used first, before any MRU choice. When
// the working set fits in the cache the loop then keeps all of it (MRU alone
// would keep the leftovers and evict the working set); when it does not, the
// order is the MRU one above. Measured on the H200 (BM6, OLMoE, batch 1, 25 %
// of the experts, a working set of half the cache): 0.28 hits without the
// cycle.
// Victim order with a cycle: stale fresh, out-of-cycle used (oldest first),
// in-cycle used (newest first), fresh.
class CyclicPolicy final : public WalkedPolicy<CyclicPolicy> {
 public:
  CyclicPolicy(uint64_t stale_after, uint64_t cycle)
      : stale_after_(stale_after), cycle_(cycle) {}
  const char* Name() const override { return "cyclic"; }
  void OnInsert(Entry* e) override;
  void OnRequest(Entry* e) override;
  void OnUse(Entry* e) override;
  void OnRemove(Entry* e) override;
  void OnAcquireCall() override { ++clock_; }

 private:
  friend class WalkedPolicy<CyclicPolicy>;
  bool Stale(const Entry* e) const { return clock_ - e->policy_stamp > stale_after_; }
  bool OutOfCycle(const Entry* e) const {
    return cycle_ != 0 && clock_ - e->policy_stamp > cycle_;
  }
  // Visits entries in victim order until visit(e) returns true; returns that
  // entry or nullptr. The one place the order is written down.
  template <typename Visit>
  Entry* Walk(Visit visit) const {
    for (Entry* e = fresh_.oldest; e != nullptr && Stale(e); e = e->policy_next) {
      if (visit(e)) return e;
    }
    // used_ is in order of use: the out-of-cycle entries are its oldest.
    Entry* in_cycle = used_.oldest;
    for (; in_cycle != nullptr && OutOfCycle(in_cycle); in_cycle = in_cycle->policy_next) {
      if (visit(in_cycle)) return in_cycle;
    }
    for (Entry* e = used_.newest; e != nullptr; e = e->policy_prev) {
      if (in_cycle == nullptr) break;
      if (visit(e)) return e;
      if (e == in_cycle) break;
    }
    for (Entry* e = fresh_.oldest; e != nullptr; e = e->policy_next) {
      if (!Stale(e) && visit(e)) return e;
    }
    return nullptr;
  }
  const uint64_t stale_after_;
  const uint64_t cycle_;  // 0: no cycle known
  uint64_t clock_ = 0;  // Acquire calls so far
  EntryList fresh_;     // not acquired since it arrived; oldest first
  EntryList used_;      // acquired; newest = next to evict
};

// Note [Next-use eviction]
// Belady's rule needs the future: evict the entry whose next read is
// farthest away. A caller that knows it (a replayed routing trace, or a
// predictor it trusts) says so with hints: HintNextUse(ids, when, now) gives
// each id the time of its next read on the caller's own clock (any
// increasing count, e.g. MoE layers routed so far), and moves the clock to
// `now`. A hint whose time has passed without a new one has expired: the
// read it announced happened (or never came), and the caller did not say
// when the next one is, so it goes before any valid hint. Victim order:
// entries never hinted (or cleared), least recently acquired or requested
// first (needed by nobody we know of); then expired hints, earliest first;
// then valid hints, farthest next use first. Within one hinted time,
// entries go in order of arrival at that time: an entry arrives when it
// becomes resident, when it is used or requested, and when a hint moves it
// there from another time (a hint to the time it already has leaves it in
// place); expired times give up their first arrivals first, valid ones
// their last. Hints belong to the id, resident or not, so an id can be
// hinted before its prefetch. If no memory can be had for an entry's place
// (Note [Next-use buckets]) it goes to an unordered overflow list that is
// evicted first, never an exception.
//
// Note [Next-use buckets]
// The entries used to sit in one std::set keyed by (next_use, touch
// sequence), and every use, request or hint re-keyed the entry's node: a
// walk down a tree of every resident entry, whose nodes are cold between
// decode layers. A step plan's engine call (Note [Host-routed step pins] in
// prefetch/offload/step_plan.py) reports a step's reads as used, requests the next
// step's and hints them: BM5's gemma-4 replay makes 180 of each once a
// step, and on the development VM that call took 160-180 us inside the
// decode loop. Now each hinted time has a bucket (a std::map from the time
// to an intrusive list in arrival order), so a use, a request or a hint of
// a hinted entry moves it in O(1) but for finding a new time's bucket in a
// map of the distinct times (tens, not thousands; the last one found is
// kept, since a call hints runs of ids with one time). Emptied buckets'
// nodes are kept for new times, so hints that move entries from time to
// time allocate nothing once warm.
// The unhinted entries keep the set, ordered by touch sequence alone: a
// hint cleared (NO_NEXT_USE, which the oracle sends for an expert its trace
// never reads again) puts the entry back by its last touch, which needs a
// search. The first buckets did that search by walking the unhinted
// bucket (clearing 384 hints among 6,144 entries: 7.3-7.6 ms against the
// set's 50 us, bench/engine_path.py's hints-clear row); a bucket of the
// unhinted in arrival order needed none, but put a cleared entry behind
// every unhinted one, and the oracle then hit less when a sequence was
// generated again (a tiny OLMoE on the development VM, a quarter cached,
// the oracle on next-use: 0.954-0.958 against 0.973-0.981). A touch of an
// unhinted entry re-keys its own node; nodes of entries that left the set
// are kept for the next ones to enter it.
class NextUsePolicy final : public WalkedPolicy<NextUsePolicy> {
 public:
  const char* Name() const override { return "next-use"; }
  void OnInsert(Entry* e) override {
    e->policy_stamp = ++seq_;
    Place(e);
  }
  void OnRequest(Entry* e) override { Touch(e); }
  void OnUse(Entry* e) override { Touch(e); }
  void OnRemove(Entry* e) override { Unplace(e); }
  void OnHint(Entry* e, int64_t next_use) override;
  void OnClock(int64_t now) override { now_ = now; }

 private:
  friend class WalkedPolicy<NextUsePolicy>;
  // next_use -> its entries, first arrived first (Note [Next-use buckets]).
  using Buckets = std::map<int64_t, EntryList>;
  // The unhinted entries by touch sequence (Entry::policy_stamp), oldest
  // first.
  struct Touched {
    uint64_t seq;
    Entry* e;
    bool operator<(const Touched& o) const { return seq < o.seq; }
  };
  using Unhinted = std::set<Touched>;
  // Into unhinted_ by its touch (no hint), else the newest of its time's
  // bucket; overflow_ when neither can take it.
  void Place(Entry* e);
  // Out of unhinted_, its bucket (dropped when empty) or overflow_.
  void Unplace(Entry* e);
  // A use or request: a new touch sequence; the newest of its bucket, or
  // of unhinted_.
  void Touch(Entry* e);
  // The bucket of `next_use`, made if need be (from spare_ when it has a
  // node: no allocation); nullptr when none can be made.
  EntryList* BucketFor(int64_t next_use);
  static EntryList* BucketOf(const Entry* e) { return static_cast<EntryList*>(e->policy_list); }
  // Victim order; the one place it is written down.
  template <typename Visit>
  Entry* Walk(Visit visit) const {
    for (Entry* e = overflow_.oldest; e != nullptr; e = e->policy_next) {
      if (visit(e)) return e;
    }
    for (const Touched& t : unhinted_) {  // never hinted (or cleared): least recently touched first
      if (visit(t.e)) return t.e;
    }
    auto valid = buckets_.begin();  // expired hints: oldest hint first
    for (; valid != buckets_.end() && valid->first < now_; ++valid) {
      for (Entry* e = valid->second.oldest; e != nullptr; e = e->policy_next) {
        if (visit(e)) return e;
      }
    }
    for (auto it = buckets_.end(); it != valid;) {  // valid hints: farthest first
      --it;
      for (Entry* e = it->second.newest; e != nullptr; e = e->policy_prev) {
        if (visit(e)) return e;
      }
    }
    return nullptr;
  }
  Buckets buckets_;  // hinted times only (never kNoNextUse)
  // Nodes of emptied buckets, for the next new ones: hints move entries
  // between times every step, and each move would otherwise free one bucket
  // and allocate another.
  std::vector<Buckets::node_type> spare_;
  // The bucket the last Place found (a hint call names runs of ids with one
  // time); nullptr once that bucket is dropped.
  int64_t last_time_ = 0;
  EntryList* last_list_ = nullptr;
  Unhinted unhinted_;
  // Nodes of entries that left unhinted_ (hinted, evicted), for the next
  // ones that enter it: no allocation once warm.
  std::vector<Unhinted::node_type> spare_unhinted_;
  EntryList overflow_;  // could get neither a bucket nor a node (std::bad_alloc)
  uint64_t seq_ = 0;  // touch sequence
  int64_t now_ = std::numeric_limits<int64_t>::min();
};

// Acquire calls after which an unacquired prefetched entry counts as a wrong
// prediction under "cyclic" (Note [Cyclic eviction]).
constexpr uint64_t kCyclicStaleAfterAcquires = 8;

// Throws kInvalidArgument unless `name` is "lru", "cyclic", "next-use" or
// "decay".
void CheckEvictionPolicyName(const std::string& name);
// "lru", "cyclic", "next-use" or "decay"; anything else is kInvalidArgument.
// `cycle`: Acquire calls per decode step for "cyclic" and "decay" (0:
// unknown).
std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(const std::string& name,
                                                   uint64_t cycle = 0);

}  // namespace prefetch
