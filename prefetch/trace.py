"""Routing traces (which experts each MoE layer used at each step) and
Belady's floor on the loads any cache of a given size needs to serve one."""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field

import numpy as np

__all__ = ["RoutingTrace", "belady_misses"]


@dataclass
class RoutingTrace:
    """Which experts each MoE layer used at each step (one forward pass).

    File format (JSON): {"format": "prefetch-routing-trace/1", "num_layers": L,
    "num_experts": E, "steps": [[[e, ...] per layer] per step]}; experts of a
    layer are the distinct experts any token of the batch routed to, sorted.
    See docs/trace_format.md.
    """

    num_layers: int
    num_experts: int
    steps: list[list[list[int]]] = field(default_factory=list)

    def add(self, step: int, layer: int, experts) -> None:
        while len(self.steps) <= step:
            self.steps.append([[] for _ in range(self.num_layers)])
        self.steps[step][layer] = sorted(experts.tolist() if isinstance(experts, np.ndarray)
                                         else [int(e) for e in experts])

    def experts(self, step: int, layer: int) -> list[int] | None:
        if step >= len(self.steps) or layer >= self.num_layers:
            return None
        return self.steps[step][layer]

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(
                {"format": "prefetch-routing-trace/1", "num_layers": self.num_layers,
                 "num_experts": self.num_experts, "steps": self.steps},
                f,
            )

    @classmethod
    def load(cls, path: str) -> RoutingTrace:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != "prefetch-routing-trace/1":
            raise ValueError(f"{path}: not a prefetch routing trace (format {data.get('format')!r})")
        trace = cls(int(data["num_layers"]), int(data["num_experts"]), [])
        for step in data["steps"]:
            if len(step) != trace.num_layers:
                raise ValueError(f"{path}: a step has {len(step)} layers, expected {trace.num_layers}")
            for layer in step:
                if any(not (0 <= int(e) < trace.num_experts) for e in layer):
                    raise ValueError(f"{path}: expert index out of range 0..{trace.num_experts - 1}")
            trace.steps.append([sorted(int(e) for e in layer) for layer in step])
        return trace


def belady_misses(trace: RoutingTrace, capacity: int, start_step: int = 0) -> int:
    """Fewest expert loads any cache of `capacity` experts needs to serve
    `trace` (Belady's MIN: evict the expert used furthest in the future);
    the floor for bytes that had to move. Loads before `start_step` (a
    warm-up) are not counted, though the cache fills during them."""
    if capacity < 1:
        raise ValueError("capacity must be >= 1 expert")
    seq = []
    first_counted = None
    for s, step in enumerate(trace.steps):
        if s == start_step:
            first_counted = len(seq)
        seq.extend((layer, e) for layer, experts in enumerate(step) for e in experts)
    if first_counted is None:
        first_counted = len(seq)
    next_use = [0] * len(seq)
    last = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = last.get(seq[i], float("inf"))
        last[seq[i]] = i
    cache: dict = {}
    misses = 0
    heap: list = []
    for i, key in enumerate(seq):
        if key in cache:
            cache[key] = next_use[i]
            heapq.heappush(heap, (-next_use[i], key))
            continue
        if i >= first_counted:
            misses += 1
        if len(cache) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if victim in cache and cache[victim] == -neg:
                    del cache[victim]
                    break
        cache[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return misses

