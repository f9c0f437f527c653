"""Accounting: the counters of one offloaded model and `report()`."""
from __future__ import annotations

from collections import deque

__all__ = ["Accounting"]

# report()["predictors"] keeps the last this many predictors assigned (a
# stack that assigns one per request would otherwise grow the list forever).
_SCORED_PREDICTORS = 64


class Accounting:
    """What the controller and its parts count: prediction scores (in all
    and per predictor), cache reads outside the engine's own counters, and
    the host time of the offloaded layers. `report` turns them and the
    engine's stats into the numbers OffloadController.report gives."""

    def __init__(self):
        self.prediction_hits = 0
        self.predicted_total = 0
        self.actual_total = 0
        # Each predictor's own scores, in the order they were assigned:
        # [class name, prediction hits, guessed, routed] (report()["predictors"]).
        self.scores: deque[list] = deque(maxlen=_SCORED_PREDICTORS)
        # Host time of the offloaded layers (ns): engine calls, the routing
        # read-back (which waits for the GPU), and everything else we add.
        self.layers_run = 0
        self.engine_ns = 0
        self.sync_ns = 0
        self.host_ns = 0
        self.comm_ns = 0  # expert parallel: the per-layer all-reduces (they wait for the slowest rank)
        self.zero_copy_reads = 0  # routed experts read from host memory (not resident at pin time)
        self.pinned_hits = 0  # routed experts read from the cache on the sync-free path
        self.step_pins = 0  # steps pinned and fetched by the predictor's step plan (either path)
        self.read_aheads = 0  # Note [Prefill read-ahead]
        self.preloaded = 0  # experts queued by preload() (Note [Preload])

    def new_predictor(self, predictor) -> None:
        """`predictor` is scored on its own from here."""
        self.scores.append([type(predictor).__name__ if predictor is not None else None, 0, 0, 0])

    def count_score(self, hits: int, guessed: int, routed: int) -> None:
        """One scored layer: `hits` of its `guessed` guesses were among its
        `routed` experts."""
        self.prediction_hits += hits
        self.predicted_total += guessed
        self.actual_total += routed
        own = self.scores[-1]
        own[1] += hits
        own[2] += guessed
        own[3] += routed

    def report(self, s: dict, *, sync, expert_bytes: int, paused_layers: int, expert_parallel: bool) -> dict:
        """OffloadController.report from the engine's stats `s`: `sync`,
        the sync-free part where sync-free decode is on (else None)."""
        hits = s["hits"] + self.pinned_hits
        acquired = s["hits"] + s["misses"] + self.pinned_hits + self.zero_copy_reads
        layers = self.layers_run
        on = sync is not None
        return {
            "hit_rate": hits / acquired if acquired else None,
            "zero_copy_reads": self.zero_copy_reads,
            "path_switches": sync.path_switches if on else None,
            "sync_free_steps": sync.sync_free_steps if on else None,
            "zero_copy_bytes": self.zero_copy_reads * expert_bytes,
            "read_aheads": self.read_aheads,
            "preloaded": self.preloaded,
            "speculation_paused_layers": paused_layers,
            "steady_steps": sync.steady_steps if on else None,
            "step_pins": self.step_pins if on or self.step_pins else None,
            "prediction_precision": self.prediction_hits / self.predicted_total if self.predicted_total else None,
            "prediction_recall": self.prediction_hits / self.actual_total if self.actual_total else None,
            # the two above add up every predictor assigned; each one's own:
            "predictors": [{"predictor": name, "prediction_precision": h / g if g else None,
                            "prediction_recall": h / r if r else None, "guessed": g, "routed": r}
                           for name, h, g, r in self.scores],
            "bytes_copied": s["bytes_copied"],
            "copies": s["copies"],
            "evictions": s["evictions"],
            "wasted": s["wasted"],
            "late": s["late"],
            "declined": s["declined"],
            # Note [A cap that follows the worker's wake-ups] (src_cpp/copy_worker.cpp)
            "spec_underruns": s["spec_underruns"],
            "speculative_cap_bytes": s["speculative_cap_bytes"],
            "layers_run": layers,
            "engine_us_per_layer": self.engine_ns / layers / 1e3 if layers else None,
            "sync_us_per_layer": self.sync_ns / layers / 1e3 if layers else None,
            "host_us_per_layer": self.host_ns / layers / 1e3 if layers else None,
            "allreduce_us_per_layer": self.comm_ns / layers / 1e3 if layers and expert_parallel else None,
        }
