"""Replays a routing trace through the engine's real cache (host backend),
one acquire per MoE layer, and counts hits and misses per step.

Every (layer, expert) pair is one registered tensor of SLOT_ALIGNMENT bytes,
so a budget of `capacity` slots holds exactly `capacity` experts and the
engine's own eviction policy decides what stays. Bytes are copied for real
(memcpy into the host arena); only their size is not an expert's.

Used by `bench/policies.py` (policies against Belady's optimum) and by
predictor studies that need the policy's misses."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import prefetch
from prefetch.trace import RoutingTrace

# The eviction policies a replay can run (cyclic and decay get the trace's layer count as their cycle).
POLICIES = ("lru", "cyclic", "decay")


def capacity_for(trace: RoutingTrace, share: float) -> int:
    """Experts a cache of `share` of the trace's (layer, expert) pairs holds
    (at least one layer's widest routing, so every acquire fits)."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    widest = max((len(experts) for step in trace.steps for experts in step), default=1)
    return max(round(share * trace.num_layers * trace.num_experts), widest, 1)


def halves(trace: RoutingTrace) -> tuple[range, range]:
    """The steps of the first and second halves of the trace's decode steps
    (1..N split at the middle; the first is the "fitted" one of the benches)."""
    n = len(trace.steps)
    if n < 3:
        raise ValueError(f"a trace needs a prompt step and at least two decode steps, got {n} steps")
    mid = 1 + (n - 1) // 2
    return range(1, mid), range(mid, n)


@dataclass
class Replay:
    """Hits and misses of each step (index = step); `resident_before[s][l]`,
    when asked for, the resident ids just before step s's layer l was
    acquired."""
    hits: np.ndarray
    misses: np.ndarray
    resident_before: list = field(default_factory=list)

    def hit_rate(self, start: int, end: int | None = None) -> float | None:
        h = int(self.hits[start:end].sum())
        m = int(self.misses[start:end].sum())
        return None if h + m == 0 else h / (h + m)


def pair_id(trace: RoutingTrace, layer: int, expert: int) -> int:
    return layer * trace.num_experts + expert


def replay(trace: RoutingTrace, capacity: int, policy: str, *, keep_resident: bool = False,
           prefetch_for=None, **handle_options) -> Replay:
    """Serves `trace` from an engine of `capacity` one-slot experts under
    eviction `policy`. `prefetch_for(step, layer, resident)`, if given, is
    called before each layer's acquire and returns (layer, expert) pairs to
    prefetch first (they arrive before the acquire: the host backend's
    worker copies them, and the acquire waits for any still queued)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    slot = prefetch.SLOT_ALIGNMENT
    options = dict(handle_options)
    if policy in ("cyclic", "decay"):
        options.setdefault("cycle_acquires", trace.num_layers)
    handle = prefetch.PrefetchHandle(device_budget_bytes=capacity * slot, backend="host",
                                     eviction_policy=policy, **options)
    try:
        payload = np.zeros(slot, dtype=np.uint8)
        for tid in range(trace.num_layers * trace.num_experts):
            handle.register(tid, payload)
        steps = len(trace.steps)
        hits = np.zeros(steps, dtype=np.int64)
        misses = np.zeros(steps, dtype=np.int64)
        resident_before = []
        for s, step in enumerate(trace.steps):
            row = []
            for layer, experts in enumerate(step):
                if not experts:
                    continue
                ids = np.array([pair_id(trace, layer, e) for e in experts], dtype=np.int64)
                if keep_resident or prefetch_for is not None:
                    resident = set(handle.resident())
                    if keep_resident:
                        row.append(resident)
                    if prefetch_for is not None:
                        wanted = [pair_id(trace, lay, e) for lay, e in prefetch_for(s, layer, resident)]
                        if wanted:
                            handle.prefetch_tensors(np.array(wanted, dtype=np.int64))
                before = handle.stats()
                handle.acquire(ids, timeout=30)
                handle.release(ids)
                after = handle.stats()
                hits[s] += after["hits"] - before["hits"]
                misses[s] += after["misses"] - before["misses"]
            resident_before.append(row)
        return Replay(hits, misses, resident_before if keep_resident else [])
    finally:
        handle.close()
