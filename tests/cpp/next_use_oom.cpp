// The "next-use" eviction policy when memory runs out (Note [Next-use
// eviction], Note [Next-use buckets]): no hook may throw, an entry that
// cannot get a bucket goes to the overflow list (evicted first), a later
// touch or hint takes it back into a bucket, and an emptied bucket's node is
// reused for a new time without allocating. Global operator new is
// replaced here so that allocations fail while `g_fail` is set. Every
// order is checked through ForEach; the sanitizer builds check the rest
// (no leak, no use after free). Exit 0 on success; prints the first
// violation and exits 1 otherwise.
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <new>
#include <vector>

#include "eviction_policy.h"

namespace {

bool g_fail = false;
long g_refused = 0;

}  // namespace

void* operator new(std::size_t n) {
  if (g_fail) {
    ++g_refused;
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

using prefetch::Entry;
using prefetch::kNoNextUse;
using prefetch::NextUsePolicy;

namespace {

int g_failures = 0;

std::vector<int64_t> Order(const NextUsePolicy& p) {
  std::vector<int64_t> ids;
  p.ForEach([](Entry* e, void* ctx) { static_cast<std::vector<int64_t>*>(ctx)->push_back(e->id); }, &ids);
  return ids;
}

// `want` is an initializer_list: no vector is made while g_fail is set.
void Expect(const NextUsePolicy& p, std::initializer_list<int64_t> want_ids, const char* what) {
  const bool fail = g_fail;
  g_fail = false;
  const std::vector<int64_t> want(want_ids);
  const std::vector<int64_t> got = Order(p);
  if (got != want) {
    std::fprintf(stderr, "FAIL: %s: order", what);
    for (int64_t id : got) std::fprintf(stderr, " %ld", static_cast<long>(id));
    std::fprintf(stderr, ", want");
    for (int64_t id : want) std::fprintf(stderr, " %ld", static_cast<long>(id));
    std::fprintf(stderr, "\n");
    ++g_failures;
  }
  g_fail = fail;
}

}  // namespace

int main() {
  std::vector<Entry> e(6);
  for (size_t i = 0; i < e.size(); ++i) e[i].id = static_cast<int64_t>(i);
  {
    NextUsePolicy p;
    p.OnClock(0);
    e[0].next_use = 5;
    e[1].next_use = 5;
    g_fail = true;  // no bucket can be made: both go to the overflow list
    p.OnInsert(&e[0]);
    p.OnInsert(&e[1]);
    g_fail = false;
    e[2].next_use = kNoNextUse;
    e[3].next_use = 7;
    p.OnInsert(&e[2]);
    p.OnInsert(&e[3]);
    Expect(p, {0, 1, 2, 3}, "overflow first, then unhinted, then valid hints");

    p.OnUse(&e[0]);  // memory is back: a touch takes it into its bucket
    Expect(p, {1, 2, 3, 0}, "a touch leaves the overflow list");

    g_fail = true;
    // Time 7 empties (its node cannot be kept: the spare list cannot grow)
    // and time 9 cannot be made: overflow, after 1.
    p.OnHint(&e[3], 9);
    Expect(p, {1, 3, 2, 0}, "a hint with no memory goes to the overflow list");
    p.OnHint(&e[1], 5);  // its own time, which exists: no memory needed, after 0
    Expect(p, {3, 2, 1, 0}, "an existing time takes an overflowed entry with no memory");
    g_fail = false;
    p.OnHint(&e[3], 9);  // its own time again: out of the overflow list now
    Expect(p, {2, 3, 1, 0}, "a hint takes an overflowed entry back");

    // Warm the spare list: time 9 empties (its node kept), time 11 takes it.
    p.OnHint(&e[3], 11);
    Expect(p, {2, 3, 1, 0}, "a new time from a kept node");
    g_fail = true;
    const long refused = g_refused;
    // Time 11 empties into the spare list (room kept from the last push)
    // and time 13 reuses that node: no allocation, no overflow.
    p.OnHint(&e[3], 13);
    Expect(p, {2, 3, 1, 0}, "a kept node reused with no memory");
    if (g_refused != refused) {
      std::fprintf(stderr, "FAIL: reusing a kept node allocated (%ld refused)\n", g_refused - refused);
      ++g_failures;
    }
    g_fail = false;

    p.OnClock(12);  // 5 expired, 13 valid
    Expect(p, {2, 0, 1, 3}, "expired hints before valid ones, first arrived first");

    // The unhinted, by touch: each holds a node of its own.
    e[4].next_use = kNoNextUse;
    g_fail = true;
    p.OnInsert(&e[4]);  // no node to be had: overflow
    Expect(p, {4, 2, 0, 1, 3}, "an unhinted entry with no memory goes to the overflow list");
    const long before_touch = g_refused;
    p.OnUse(&e[2]);  // its own node, re-keyed: stays among the unhinted, no memory needed
    Expect(p, {4, 2, 0, 1, 3}, "a touch of an unhinted entry needs no memory");
    if (g_refused != before_touch) {
      std::fprintf(stderr, "FAIL: touching an unhinted entry allocated (%ld refused)\n",
                   g_refused - before_touch);
      ++g_failures;
    }
    g_fail = false;
    p.OnUse(&e[4]);  // memory is back: among the unhinted, the newest touch
    Expect(p, {2, 4, 0, 1, 3}, "unhinted, least recently touched first");
    p.OnHint(&e[2], 20);  // leaves the unhinted: its node is kept
    Expect(p, {4, 0, 1, 2, 3}, "hinted: the farthest time, valid hints farthest first");
    g_fail = true;
    const long before_clear = g_refused;
    // Cleared with no memory: the kept node takes it back, by its touch
    // (older than 4's).
    p.OnHint(&e[2], kNoNextUse);
    Expect(p, {2, 4, 0, 1, 3}, "a cleared entry goes back by its touch, on a kept node");
    if (g_refused != before_clear) {
      std::fprintf(stderr, "FAIL: clearing onto a kept node allocated (%ld refused)\n",
                   g_refused - before_clear);
      ++g_failures;
    }
    p.OnHint(&e[0], kNoNextUse);  // no node kept now: overflow
    Expect(p, {0, 2, 4, 1, 3}, "a cleared entry with no memory and no node goes to the overflow list");
    g_fail = false;
    for (int i : {0, 1, 2, 3, 4}) p.OnRemove(&e[i]);
    Expect(p, {}, "every entry removed");
  }
  if (g_failures != 0) return 1;
  std::printf("ok next-use under allocation failure (%ld allocations refused)\n", g_refused);
  return 0;
}
