"""Routing traces (which experts each MoE layer used at each step) and
Belady's floor on the loads any cache of a given size needs to serve one."""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field

import numpy as np

from prefetch.errors import InvalidArgumentError
from prefetch.untrusted_files import NotRegularFileError, RepeatedKeyError, no_repeated_keys, open_regular

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

    def add_routed(self, keys, routed: np.ndarray) -> None:
        """For each (step, layer) of `keys` (each layer at most once),
        records the experts set in row `layer` of `routed`, a [num_layers,
        num_experts] bool table: `add` for many layers in one numpy pass
        (Note [Routings nobody reads] in prefetch/offload/sync_free.py)."""
        layers = [layer for _, layer in keys]
        rows, experts = np.nonzero(routed[layers])
        counts = np.bincount(rows, minlength=len(layers)).tolist()
        flat = experts.tolist()  # sorted within each row
        pos = 0
        steps = self.steps
        for (step, layer), n in zip(keys, counts):
            while len(steps) <= step:
                steps.append([[] for _ in range(self.num_layers)])
            steps[step][layer] = flat[pos:pos + n]
            pos += n

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
        """Reads a trace file, an untrusted input: anything but the format
        (docs/trace_format.md) raises ValueError naming the problem."""
        try:
            f = open_regular(path)  # a missing file raises its OSError
        except NotRegularFileError:
            raise InvalidArgumentError(f"{path}: not a prefetch routing trace (not a regular file)") from None
        with f:
            raw = f.read()
        try:
            data = json.loads(raw.decode("utf-8"), object_pairs_hook=no_repeated_keys)
        except RepeatedKeyError as exc:  # the last one would win: the file says two things
            raise InvalidArgumentError(
                f"{path}: not a prefetch routing trace (the key {exc.key!r} is repeated)") from None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise InvalidArgumentError(f"{path}: not a prefetch routing trace (not JSON: {exc})") from None
        if not isinstance(data, dict):
            raise InvalidArgumentError(
                f"{path}: not a prefetch routing trace (a JSON {type(data).__name__}, not an object)")
        if data.get("format") != "prefetch-routing-trace/1":
            raise InvalidArgumentError(f"{path}: not a prefetch routing trace (format {data.get('format')!r})")
        num_layers = _count(data, "num_layers", path)
        num_experts = _count(data, "num_experts", path)
        steps = data.get("steps")
        if not isinstance(steps, list):
            raise InvalidArgumentError(f"{path}: steps must be a list, got {type(steps).__name__}")
        trace = cls(num_layers, num_experts, [])
        for s, step in enumerate(steps):
            if not isinstance(step, list) or len(step) != num_layers:
                got = f"{len(step)} layers" if isinstance(step, list) else f"a {type(step).__name__}"
                raise InvalidArgumentError(f"{path}: step {s} has {got}, expected a list of {num_layers} layers")
            layers = []
            for layer, experts in enumerate(step):
                where = f"{path}: step {s}, layer {layer}"
                if not isinstance(experts, list):
                    raise InvalidArgumentError(f"{where}: expected a list of experts, got {type(experts).__name__}")
                if any(type(e) is not int for e in experts):  # bools and floats are not expert indices
                    bad = next(e for e in experts if type(e) is not int)
                    raise InvalidArgumentError(f"{where}: expert indices must be integers, got {bad!r}")
                if any(not 0 <= e < num_experts for e in experts):
                    raise InvalidArgumentError(f"{where}: expert index out of range 0..{num_experts - 1}")
                ordered = sorted(experts)
                if any(a == b for a, b in zip(ordered, ordered[1:])):
                    raise InvalidArgumentError(f"{where}: an expert is listed twice (a layer lists distinct experts)")
                layers.append(ordered)
            trace.steps.append(layers)
        return trace


def _count(data: dict, key: str, path: str) -> int:
    """A trace header's positive integer `key`."""
    value = data.get(key)
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def belady_misses(trace: RoutingTrace, capacity: int, start_step: int = 0, end_step: int | None = None) -> int:
    """Fewest expert loads any cache of `capacity` experts needs to serve
    `trace` (Belady's MIN: evict the expert used furthest in the future);
    the floor for bytes that had to move. Only loads of steps `start_step`
    to `end_step` (exclusive; None: the last) are counted: the cache fills
    during the steps before, and its choices see the steps after."""
    if capacity < 1:
        raise InvalidArgumentError("capacity must be >= 1 expert")
    end_step = len(trace.steps) if end_step is None else end_step
    if not 0 <= start_step <= end_step <= len(trace.steps):
        raise InvalidArgumentError(f"need 0 <= start_step <= end_step <= {len(trace.steps)} steps, "
                                   f"got {start_step} and {end_step}")
    seq = []
    first_counted = last_counted = None
    for s, step in enumerate(trace.steps):
        if s == start_step:
            first_counted = len(seq)
        if s == end_step:
            last_counted = len(seq)
        seq.extend((layer, e) for layer, experts in enumerate(step) for e in experts)
    if first_counted is None:
        first_counted = len(seq)
    if last_counted is None:
        last_counted = len(seq)
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
        if first_counted <= i < last_counted:
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

