"""EngineCalls: the engine calls of a synced or host-routed layer (Note
[One call per layer] in src_cpp/acquire_release.cpp): `exchange` releases
the layer computed before, cancels this layer's wrong guesses, sends hints,
acquires this layer's experts and queues the guesses for later layers, in
one GIL-free `PrefetchHandle.step`."""
from __future__ import annotations

import time

import numpy as np

from prefetch._engine import DEFAULT_ACQUIRE_TIMEOUT_S, distinct_ids, hint_arrays
from prefetch.errors import UnknownIdError
from prefetch.expert_ids import EMPTY as _EMPTY
from prefetch.expert_ids import distinct as _distinct
from prefetch.offload.preload import LEAST_URGENT_BAND as _MAX_BAND

__all__ = ["EngineCalls", "TensorHints"]


class TensorHints:
    """Hints already as the engine takes them: tensor ids and next-use
    times (from a predictor's plan, Note [The oracle's plan] in
    prefetch/predictors.py)."""

    __slots__ = ("ids", "when")

    def __init__(self, ids: np.ndarray, when: np.ndarray):
        self.ids = ids
        self.when = when


class EngineCalls:
    """Owned by an OffloadController (its `calls`; `exchange` and
    `release_held` are the controller's too): the layer's engine call
    (`exchange`), guesses and hints alone (`send_guesses`), the release
    at a forward's end (`release_held`), and the conversions they share
    (`routed_ids`, `hint_arrays`, `only_local`). What is held, on which
    stream, and the guesses queued per layer are the controller's state,
    shared with the sync-free path and the step plan."""

    def __init__(self, controller):
        self._c = controller

    def exchange(self, layer: int, experts: np.ndarray, guesses: dict, hints, *, stream=None,
                 timeout: float = DEFAULT_ACQUIRE_TIMEOUT_S, now: int | None = None,
                 acquire_ids: np.ndarray | None = None) -> np.ndarray:
        """The one engine call of a layer: release what the last exchange
        acquired, cancel this layer's guesses still queued,
        send hints, acquire `experts` of `layer` (distinct expert indices;
        held until the next exchange or `release_held`) and queue the
        guesses ({layer: experts}; band = distance in layers). Returns
        acquire's (offset, device) rows. Expert parallel: `experts` are this
        rank's own; guesses and hints for other ranks' experts are dropped.
        `now`: the hint clock the hints were made at (default: the
        routing clock). `acquire_ids`: the tensor ids of `experts`, where
        the caller has them (`routed_ids`)."""
        c = self._c
        if c.speculation.unsent is not None:
            c.speculation.send_unsent()
        if c.local is not None:
            guesses, hints = self.only_local(guesses, hints)
        if c._held_back(guesses):
            guesses = {}
        # Every guess for this layer still queued is dropped; a right one is
        # then acquired at band 0 in the same call (queued again and issued
        # by this thread), as a queued guess would have been upgraded.
        prefetch = None
        band = 1
        extra = None
        queued = []
        for target, guess in guesses.items():  # the guesses' ids before anything is recorded
            if not guess.shape[0]:
                continue
            distance = (target - layer) % c.num_layers or c.num_layers
            ids = c.ids(target, guess)
            queued.append((target, guess))
            if prefetch is None or distance < band:
                if prefetch is not None:
                    extra = [*(extra or ()), (prefetch, band)]
                prefetch, band = ids, min(_MAX_BAND, distance)
            else:
                extra = [*(extra or ()), (ids, min(_MAX_BAND, distance))]
        stale = c._queued_guess.pop(layer, None)
        cancel = c.ids(layer, stale) if stale is not None else None
        for target, guess in queued:
            c._queued_guess[target] = guess
        hint_ids, hint_when = self.hint_arrays(hints)
        if c._held is not None and stream is not c._held_stream and stream != c._held_stream:
            self.release_held()  # another stream now: its own release
        held, c._held = c._held, None
        if c.plan.pinned_step is not None:  # a planned step's pins go with this release
            c.plan.end()
        acquire = c.ids(layer, experts) if acquire_ids is None else acquire_ids
        t0 = time.perf_counter_ns()
        try:
            where = c.handle.exchange(acquire, release=held, prefetch=prefetch, priority=band, cancel=cancel,
                                     hint_ids=hint_ids, hint_when=hint_when,
                                     now=(c.clock if now is None else now) if hints is not None else None,
                                     stream=stream, timeout=timeout)
        except (ValueError, KeyError, TypeError, OverflowError):
            # Bad arguments are refused before anything changes: still held.
            c._held = held
            raise
        finally:
            c.acct.engine_ns += time.perf_counter_ns() - t0
        if acquire.shape[0]:
            c._held = acquire
            c._held_stream = stream
        if extra is not None:  # after the step's bookkeeping: a failure here holds what the step took
            t0 = time.perf_counter_ns()
            try:
                for ids, b in extra:
                    self._queue_guesses(ids, b)
            finally:
                c.acct.engine_ns += time.perf_counter_ns() - t0
        return where

    def _queue_guesses(self, ids: np.ndarray, band: int) -> None:
        """Queues guesses after the step: as in the engine's own step (Note
        [A step's prefetches after its wait] in src_cpp/acquire_release.cpp),
        a guess whose id was unregistered behind the controller is dropped,
        not raised after the step's acquire has succeeded."""
        c = self._c
        try:
            c.handle.prefetch_tensors(ids, band)
        except UnknownIdError:
            kept = np.fromiter((i for i in ids.tolist() if i in c.handle), dtype=np.int64)
            if kept.shape[0]:
                c.handle.prefetch_tensors(kept, band)

    def hint_arrays(self, hints):
        """(tensor ids, next-use times) of predictor hints [(layer, experts,
        one time or one per expert)], or (None, None) for none."""
        c = self._c
        if not hints:
            return None, None
        if type(hints) is TensorHints:
            return hints.ids, hints.when
        return hint_arrays(hints, c.prefetcher._ids)  # one C pass (prefetch/_routing.pxi)

    def only_local(self, guesses: dict, hints):
        c = self._c
        local = c.local
        guesses = {t: g[local[t][g]] for t, g in guesses.items()}
        if hints:
            kept = []
            for lyr, ex, when in hints:
                ex = np.asarray(ex, dtype=np.int64)
                mask = local[lyr][ex]
                if mask.any():
                    kept.append((lyr, ex[mask], when if np.isscalar(when) else np.asarray(when)[mask]))
            hints = kept
        return guesses, hints

    def release_held(self, stream=None) -> None:
        """Releases what the last exchange acquired (the end of a forward)."""
        c = self._c
        if c.speculation.unsent is not None:
            c.speculation.send_unsent()
        held, c._held = c._held, None
        c.sync._steady = None  # Note [Steady pins]: a steady step's pins were held here
        if c.plan.pinned_step is not None:
            c.plan.end()
        if held is not None and held.shape[0]:
            t0 = time.perf_counter_ns()
            c.handle.release(held, stream=stream if stream is not None else c._held_stream)
            c.acct.engine_ns += time.perf_counter_ns() - t0

    def send_guesses(self, layer: int, guesses: dict, hints, now: int | None = None) -> None:
        """An engine call that queues guesses and sends hints only: what is
        held stays held. `now`: the clock the hints were made at (default:
        the routing clock)."""
        c = self._c
        if guesses or hints or layer in c._queued_guess:
            held = c._held
            c._held = None
            try:
                self.exchange(layer, _EMPTY, guesses, hints, now=now)
            finally:
                c._held = held

    def routed_ids(self, layer: int, experts) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct `experts`, their tensor ids) in one C pass for a
        short host list (Note [Short expert lists in C] in
        prefetch/_routing.pxi), else as _distinct and ids make them."""
        c = self._c
        table = c.prefetcher._ids.get(layer)
        if table is not None and table.shape[0] >= c.num_experts:
            got = distinct_ids(experts, c.num_experts, table)
            if got is not None:
                return got
        routed = _distinct(experts, c.num_experts)
        return routed, c.ids(layer, routed)
