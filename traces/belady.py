"""Belady's (optimal, clairvoyant) hit rate of one expert cache over a routing trace's decode steps.

The cache holds (layer, expert) pairs, one cache shared by all layers, round(share * layers *
experts) pairs at most. Step 0 (the prompt) goes through the cache to warm it but is not counted;
the hit rate is hits / accesses over steps 1.. (the decode steps). The misses are
`prefetch.trace.belady_misses` (evict the pair whose next access is farthest away; Belady 1966).

usage: python traces/belady.py TRACE.json [TRACE.json ...]   (prints the rates at 10, 25 and 50 %)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefetch.trace import RoutingTrace, belady_misses  # noqa: E402

SHARES = (0.10, 0.25, 0.50)


def hit_rate(trace: RoutingTrace, share: float) -> float:
    """Belady's decode hit rate with capacity = round(share * layers * experts)."""
    capacity = round(share * trace.num_layers * trace.num_experts)
    accesses = sum(len(experts) for step in trace.steps[1:] for experts in step)
    return 1 - belady_misses(trace, capacity, start_step=1) / accesses


def main():
    for path in sys.argv[1:]:
        trace = RoutingTrace.load(path)
        print(path, " ".join(f"{share:.0%}:{hit_rate(trace, share):.1%}" for share in SHARES))


if __name__ == "__main__":
    main()
