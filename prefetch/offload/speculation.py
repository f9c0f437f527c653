"""SpeculationGate: whether the predictor runs on a layer and whether its
guesses are sent, by its recent precision (Note [Speculation by its
precision]), by what its copies waste (Note [Speculation by what its copies
waste]) and by whether anything was fetched lately (Note [Speculation with
nothing to fetch])."""
from __future__ import annotations

__all__ = ["SpeculationGate"]

# Note [Speculation by its precision]: the recent precision's memory (per
# scored layer) and how many recent guesses it needs before it judges.
_PRECISION_DECAY = 0.95
_PRECISION_MIN_GUESSES = 32
# While paused, the predictor runs on one layer in this many (its guesses
# scored, not sent).
_PAUSED_PROBE_EVERY = 8
# Note [Speculation with nothing to fetch]: steps in a row that copied
# nothing before the predictor only probes.
_IDLE_STEPS_TO_PROBE = 2
# Note [Speculation by what its copies waste]: the recent counts' memory
# (per step) and how many recent prefetched copies it needs before it judges.
_WASTE_DECAY = 0.9
_WASTE_MIN_COPIES = 64


class SpeculationGate:
    """The three pauses of speculation. The controller tells it each scored
    layer (`scored`) and each step's start (`step_started`, with the
    engine's stats); it answers whether this layer runs the predictor
    (`predicts_now`), whether guesses go out (`paused`, `hold_back`), and
    forgets the recent record when another predictor is assigned
    (`forget`). `min_precision`, `max_wasted` and
    `probe_when_nothing_fetched` are the controller's settings of the same
    names (speculation_min_precision, speculation_max_wasted)."""

    def __init__(self):
        # Note [Speculation by its precision]
        self.min_precision = 0.25
        self._recent_hits = 0.0
        self._recent_guessed = 0.0
        self.paused_layers = 0  # report()["speculation_paused_layers"]
        self._paused_predicts = 0  # predictor calls asked for while paused (one in _PAUSED_PROBE_EVERY runs)
        # Note [Speculation by what its copies waste]
        self.max_wasted = 0.5
        self._recent_prefetched = 0.0  # copies made for prefetches, decayed per step
        self._recent_wasted = 0.0  # of those, evicted unused
        self._prefetch_counts = None  # (prefetched copies, wasted) when this step began
        # Note [Speculation with nothing to fetch]
        self.probe_when_nothing_fetched = True  # False: the predictor runs whatever the engine copies
        self._copies_at_step = None  # copies asked of the engine when this step began
        self._idle_steps = 0  # consecutive steps that asked for no copy
        self.nothing_fetched = False  # the last two steps asked for no copy: the predictor probes

    def forget(self) -> None:
        """Another predictor starts (Note [A predictor replaced]): the
        recent precision and wasted copies start again from nothing."""
        self._recent_hits = self._recent_guessed = 0.0
        self._recent_prefetched = self._recent_wasted = 0.0
        self._paused_predicts = 0

    def scored(self, hits: int, guessed: int) -> None:
        """One scored layer's `hits` of its `guessed` guesses."""
        self._recent_hits = self._recent_hits * _PRECISION_DECAY + hits
        self._recent_guessed = self._recent_guessed * _PRECISION_DECAY + guessed

    def step_started(self, s: dict) -> None:
        """A step's first layer, with a predictor: the engine's stats `s`
        now."""
        self._count_waste(s)
        if self.probe_when_nothing_fetched:
            asked = s["enqueued"] + s["on_demand"]  # copies asked for (done or not)
            idle = asked == self._copies_at_step and s["queue_depth"] == 0
            self._idle_steps = self._idle_steps + 1 if idle else 0
            self.nothing_fetched = self._idle_steps >= _IDLE_STEPS_TO_PROBE
            self._copies_at_step = asked

    def _count_waste(self, s: dict) -> None:
        """At a step's start: the engine's copies made for prefetches (every
        completed copy an acquire did not queue itself) and those evicted
        unused since the last step's start, into decayed sums (Note
        [Speculation by what its copies waste])."""
        counts = (s["copies"] - s["on_demand"], s["wasted"])
        if self._prefetch_counts is not None:
            made, wasted = (c - b for c, b in zip(counts, self._prefetch_counts))
            self._recent_prefetched = max(0.0, self._recent_prefetched * _WASTE_DECAY + made)
            self._recent_wasted = max(0.0, self._recent_wasted * _WASTE_DECAY + wasted)
        self._prefetch_counts = counts

    @property
    def paused(self) -> bool:
        """Note [Speculation by its precision]
        A guess that is wrong still takes the link and a cache slot, and at
        a low precision it takes them for nearly nothing: BM5's next-layer
        gate on the real routing traces (its routers random, the routing
        forced from the trace) guessed right 1.5-5 % of the time, moved
        2.0-3.3x the bytes of on-demand and ran 1.22-1.50x slower than it
        on the H200 host (0.89-1.23x in an earlier run there),
        while on BM6's models it is right 72-76 % of the time and can be the
        fastest row. So the controller keeps the precision of the recent
        guesses (each scored layer's hits and guesses, decayed by
        _PRECISION_DECAY per scored layer: about the last 20 layers) and,
        once at least _PRECISION_MIN_GUESSES recent guesses were scored,
        sends none while it is below `speculation_min_precision` (default
        0.25; 0 never pauses). While paused the predictor still runs on one
        layer in _PAUSED_PROBE_EVERY, and those guesses are scored and not
        sent, so speculation resumes when they get better (about 14 right
        probes after a long wrong run); on the other layers it does not run
        at all, since making a guess costs host time as well: the paused
        gate's router and read-back still left it 1.04-1.11x slower than
        on-demand on the real traces while it moved the same bytes (every
        layer still predicting). Hints and the prefill read-ahead are
        not guesses and go on. `report()` counts the layers whose guesses
        were held back or not made. Speculation pauses the same way while
        most of its copies are wasted (Note [Speculation by what its copies
        waste])."""
        if self._wastes_copies():
            return True
        return (self.min_precision > 0 and self._recent_guessed >= _PRECISION_MIN_GUESSES
                and self._recent_hits < self.min_precision * self._recent_guessed)

    def _wastes_copies(self) -> bool:
        """Note [Speculation by what its copies waste]
        A guess that names a cached expert costs nothing but host time; one
        that names an expert not cached costs a copy and an eviction, and
        only those decide what speculation is worth. A predictor can be
        right most of the time and still waste most of its copies: where
        the cache is small, its right guesses mostly name cached experts
        and its wrong ones mostly do not. BM6, OLMoE-1B-7B at batch 1 and a
        tenth of the experts cached, on the H200 host: the next-layer gate,
        precision 0.68-0.72, copied 2.4x what on-demand copied, 57-61 % of its
        prefetched copies evicted unused, for the same hit rate (0.72-0.75
        against 0.74); its decode p50 was 29.1-34.4 ms against on-demand's
        24.5-25.1. Where it did not lose (a quarter cached, batch 8: 45 %
        wasted, 2 % faster than on-demand; batch 1: 11 %) or won,
        fewer were wasted. So the controller keeps the engine's copies made
        for prefetches and those of them evicted unused (counted at each
        step's start, decayed by _WASTE_DECAY a step) and, once the recent
        copies number _WASTE_MIN_COPIES, sends no guesses while more than
        `speculation_max_wasted` of them were wasted (default 0.5: more
        copies wasted than read, where each wasted one cost a copy and an
        eviction and each read one saved at most a miss; 1 never pauses),
        as for a low precision: the predictor probes on one layer
        in _PAUSED_PROBE_EVERY, its guesses scored and not sent. While
        paused, few copies are made and the sums decay below
        _WASTE_MIN_COPIES (about 20 steps at the gate's rate there): the
        guesses go out again and what they waste is measured anew. Copies
        that are not guesses (a sync-free step's misses, read-ahead,
        preload) count as prefetched too. The first two are read at once
        and only make the pause later; a preload=True of a cache smaller
        than the experts can be evicted unused by the first steps and pause
        the guesses until that decays."""
        return (self.max_wasted < 1 and self._recent_prefetched >= _WASTE_MIN_COPIES
                and self._recent_wasted > self.max_wasted * self._recent_prefetched)

    def predicts_now(self) -> bool:
        """Whether this layer runs the predictor: always, but while paused
        (Note [Speculation by its precision]) or after a step that fetched
        nothing (Note [Speculation with nothing to fetch]) only one layer in
        _PAUSED_PROBE_EVERY; the others count as paused layers.

        Note [Speculation with nothing to fetch]
        When the cache already holds what the model routes to (a budget
        that holds the working set, after warm-up), every guess names
        experts already resident: the predictor's host work buys nothing.
        That work is not free: BM6's oracle spent 107-117 us a layer of
        host work at a cache of 100 %, against on-demand's 60-64, and ran
        1.19-1.27x the resident model against 1.13-1.19 on the H200. So at the
        start of each step the controller reads how many copies the engine
        was asked for (ids newly queued by prefetches and by misses) and how
        many still wait in its queue, not how many completed: a copy worker
        slow to finish, on a loaded 2-core CI machine, must not read as a
        step that needed nothing. If the last _IDLE_STEPS_TO_PROBE steps
        asked for none and left none waiting (no miss, no guess that needed
        a copy), the predictor runs on one layer in
        _PAUSED_PROBE_EVERY only. Those guesses are sent (unlike a precision
        pause's probes): one that names an expert not resident copies it,
        and any copy, a miss's or a guess's, ends the pause at the next
        step. The price: the first step that needs something new after such
        a pause finds most of its guesses not made. `probe_when_nothing_fetched
        = False` keeps the predictor on every layer."""
        if not self.paused and not self.nothing_fetched:
            return True
        self._paused_predicts += 1
        if self._paused_predicts % _PAUSED_PROBE_EVERY:
            self.paused_layers += 1
            return False
        return True

    def hold_back(self) -> bool:
        """Whether a layer's guesses are not to be sent (speculation
        paused: Note [Speculation by its precision]); the layer then counts
        as paused."""
        if self.paused:
            self.paused_layers += 1
            return True
        return False
