"""Belady's (optimal, clairvoyant) hit rate of one expert cache replayed over a routing trace.

The cache holds (layer, expert) pairs, one cache shared by all layers, `capacity` pairs at most.
Accesses are taken in order: step by step, within a step layer by layer, within a layer in expert
order. Every access of step 0 (the prompt) goes through the cache to warm it but is not counted;
the hit rate is hits / accesses over steps 1.. (the decode steps). On a miss with a full cache the
pair whose next access is farthest away (never again counts as farthest) is evicted, which is
optimal for hit count (Belady 1966).

usage: python belady.py TRACE.json [TRACE.json ...]   (prints the rates at 10, 25 and 50 %)
"""
import heapq
import json
import sys

SHARES = (0.10, 0.25, 0.50)


def accesses(steps, num_experts):
    """[(step, key)] with key = layer * num_experts + expert, in access order."""
    return [(s, layer * num_experts + e)
            for s, step in enumerate(steps) for layer, experts in enumerate(step) for e in experts]


def belady_hits(seq, capacity, counted_from=1):
    """(hits, counted accesses) of Belady's policy on `seq` = [(step, key)], counting only accesses
    of steps >= counted_from."""
    if capacity < 1:
        raise ValueError("capacity must be at least 1")
    never = len(seq)
    nxt = [never] * len(seq)
    last = {}
    for i in range(len(seq) - 1, -1, -1):
        key = seq[i][1]
        nxt[i] = last.get(key, never)
        last[key] = i
    cached = {}   # key -> its next access index
    heap = []     # (-next access, key); stale entries skipped on pop
    hits = counted = 0
    for i, (step, key) in enumerate(seq):
        count = step >= counted_from
        counted += count
        if key in cached:
            hits += count
        elif len(cached) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        cached[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
    return hits, counted


def hit_rate(trace, share):
    """Belady's decode hit rate with capacity = round(share * layers * experts)."""
    capacity = round(share * trace["num_layers"] * trace["num_experts"])
    hits, counted = belady_hits(accesses(trace["steps"], trace["num_experts"]), capacity)
    return hits / counted


def main():
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
        print(path, " ".join(f"{share:.0%}:{hit_rate(trace, share):.1%}" for share in SHARES))


if __name__ == "__main__":
    main()
