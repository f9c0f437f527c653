"""PathChoice: whether each decode step goes sync-free or synced (Note
[Which path a step takes])."""
from __future__ import annotations

__all__ = ["PathChoice"]


# Note [Which path a step takes]: the miss fractions that switch a step's
# path, the length of a sync-free run that counts as a failed try, and the
# longest hold after failed tries (steps).
_SYNC_FREE_MAX_MISSED = 0.10
_SYNCED_MAX_MISSED = 0.03
_TRY_STEPS = 4
_FIRST_HOLD = 4
_MAX_HOLD = 64


class PathChoice:
    """Note [Which path a step takes]
    A sync-free step pays for a miss with a read over PCIe by the kernel (as
    slow as a copy, and then a prefetch of the same bytes for the next step:
    twice the traffic) but has no sync; a synced step pays a sync per layer
    but copies each miss once and lets a predictor's guesses land first. So
    the step goes sync-free while misses are rare: after a step that missed
    more than _SYNC_FREE_MAX_MISSED (10 %) of its routed experts the next
    steps are synced, and they go back to sync-free once a step misses less
    than _SYNCED_MAX_MISSED (3 %) (measured on the H200, OLMoE: at batch 1
    and a quarter of the experts cached, 2 % misses and sync-free wins; at
    batch 8, 30-65 % misses and the synced path wins, 126 ms against 183
    per token).

    A synced step's misses do not always say what a sync-free one would
    miss: the synced path lets a predictor's copies land before their layer
    reads them, the sync-free path pins what is resident when the layer
    starts. With a cache smaller than what one step reads, the oracle missed
    under 3 % on synced steps and over 10 % on sync-free ones, so the path
    flipped every step: OLMoE-1B-7B at batch 1 and a tenth of the experts
    cached (BM6 on the H200) took 33 sync-free steps of 70 with 37 switches,
    copied 3,715 experts against 1,884 for the same row kept synced (Belady:
    1,669) and ran 1.43x the resident model against 1.33. So a sync-free run
    that a switch began and that ends within _TRY_STEPS steps is a failed
    try: the synced steps after it wait out a hold (steps that would have
    switched stay synced) that starts at _FIRST_HOLD steps and doubles with
    each failed try in a row, up to _MAX_HOLD; a sync-free run that lasts
    longer clears it. Misses of experts no earlier step read (a cache
    still warming) fail no try: no path avoids them, and the first
    sync-free run (a model's first steps, before any synced step) is no
    try either."""

    def __init__(self):
        self.sync_free = True  # the path of the step about to run
        self.switches = 0
        self.held = 0  # synced steps that missed little but stayed synced (the hold)
        self._run = None  # steps of a sync-free run that a switch began; None otherwise
        self._hold = 0  # steps that would switch to sync-free still to stay synced
        self._next_hold = _FIRST_HOLD

    def after(self, missed: float | None, missed_again: float | None = None) -> bool:
        """The step that just ran missed `missed` of its routed experts (a
        fraction; None: not known, nothing changes), `missed_again` of them
        experts some earlier step had read (a sync-free step's; None: all of
        its misses count); returns whether the next step goes sync-free."""
        if missed is None:
            return self.sync_free
        if self.sync_free:
            if self._run is not None:
                self._run += 1
            if missed > _SYNC_FREE_MAX_MISSED:
                self.sync_free = False
                self.switches += 1
                again = missed if missed_again is None else missed_again
                if self._run is not None and self._run < _TRY_STEPS and again > _SYNC_FREE_MAX_MISSED:
                    self._hold = self._next_hold
                    self._next_hold = min(2 * self._next_hold, _MAX_HOLD)
                self._run = None
            elif self._run is not None and self._run >= _TRY_STEPS:
                self._next_hold = _FIRST_HOLD  # a run that held: the tries start over
        elif missed < _SYNCED_MAX_MISSED:
            if self._hold:
                self._hold -= 1
                self.held += 1
            else:
                self.sync_free = True
                self.switches += 1
                self._run = 0
        return self.sync_free
