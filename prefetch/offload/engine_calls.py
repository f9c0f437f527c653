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
    stream, and the guesses queued per layer are state
    shared with the sync-free path and the step plan: the ExchangeState
    (prefetch/offload/exchange_state.py). The sibling parts it calls are
    wired in after it is made."""

    def __init__(self, state, *, acct):
        self._s = state
        self._acct = acct
        self._routing = self._spec = self._stepplan = self._syncd = self._held_back = None  # wire

    def wire(self, *, routing, speculation, plan, sync) -> None:
        """The sibling parts this one calls (made after it, or calling it)."""
        self._routing, self._spec, self._stepplan, self._syncd = routing, speculation, plan, sync
        self._held_back = routing.held_back  # bound once: exchange asks it every layer

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
        st = self._s
        if self._spec.unsent is not None:
            self._spec.send_unsent()
        if st.local is not None:
            guesses, hints = self.only_local(guesses, hints)
        if self._held_back(guesses):
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
            distance = (target - layer) % st.num_layers or st.num_layers
            ids = st.ids(target, guess)
            queued.append((target, guess))
            if prefetch is None or distance < band:
                if prefetch is not None:
                    extra = [*(extra or ()), (prefetch, band)]
                prefetch, band = ids, min(_MAX_BAND, distance)
            else:
                extra = [*(extra or ()), (ids, min(_MAX_BAND, distance))]
        stale = st.queued_guess.pop(layer, None)
        cancel = st.ids(layer, stale) if stale is not None else None
        for target, guess in queued:
            st.queued_guess[target] = guess
        hint_ids, hint_when = self.hint_arrays(hints)
        if st.held is not None and stream is not st.held_stream and stream != st.held_stream:
            self.release_held()  # another stream now: its own release
        held, st.held = st.held, None
        if self._stepplan.pinned_step is not None:  # a planned step's pins go with this release
            self._stepplan.end()
        acquire = st.ids(layer, experts) if acquire_ids is None else acquire_ids
        t0 = time.perf_counter_ns()
        try:
            where = st.handle.exchange(acquire, release=held, prefetch=prefetch, priority=band, cancel=cancel,
                                       hint_ids=hint_ids, hint_when=hint_when,
                                       now=(st.clock if now is None else now) if hints is not None else None,
                                       stream=stream, timeout=timeout)
        except (ValueError, KeyError, TypeError, OverflowError):
            # Bad arguments are refused before anything changes: still held.
            st.held = held
            raise
        finally:
            self._acct.engine_ns += time.perf_counter_ns() - t0
        if acquire.shape[0]:
            st.held = acquire
            st.held_stream = stream
        if extra is not None:  # after the step's bookkeeping: a failure here holds what the step took
            t0 = time.perf_counter_ns()
            try:
                for ids, b in extra:
                    self._queue_guesses(ids, b)
            finally:
                self._acct.engine_ns += time.perf_counter_ns() - t0
        return where

    def _queue_guesses(self, ids: np.ndarray, band: int) -> None:
        """Queues guesses after the step: as in the engine's own step (Note
        [A step's prefetches after its wait] in src_cpp/acquire_release.cpp),
        a guess whose id was unregistered behind the controller is dropped,
        not raised after the step's acquire has succeeded."""
        try:
            self._s.handle.prefetch_tensors(ids, band)
        except UnknownIdError:
            kept = np.fromiter((i for i in ids.tolist() if i in self._s.handle), dtype=np.int64)
            if kept.shape[0]:
                self._s.handle.prefetch_tensors(kept, band)

    def hint_arrays(self, hints):
        """(tensor ids, next-use times) of predictor hints [(layer, experts,
        one time or one per expert)], or (None, None) for none."""
        st = self._s
        if not hints:
            return None, None
        if type(hints) is TensorHints:
            return hints.ids, hints.when
        return hint_arrays(hints, st.prefetcher._ids)  # one C pass (prefetch/_routing.pxi)

    def only_local(self, guesses: dict, hints):
        st = self._s
        local = st.local
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
        st = self._s
        if self._spec.unsent is not None:
            self._spec.send_unsent()
        held, st.held = st.held, None
        self._syncd._steady = None  # Note [Steady pins]: a steady step's pins were held here
        if self._stepplan.pinned_step is not None:
            self._stepplan.end()
        if held is not None and held.shape[0]:
            t0 = time.perf_counter_ns()
            self._s.handle.release(held, stream=stream if stream is not None else st.held_stream)
            self._acct.engine_ns += time.perf_counter_ns() - t0

    def send_guesses(self, layer: int, guesses: dict, hints, now: int | None = None) -> None:
        """An engine call that queues guesses and sends hints only: what is
        held stays held. `now`: the clock the hints were made at (default:
        the routing clock)."""
        st = self._s
        if guesses or hints or layer in st.queued_guess:
            held = st.held
            st.held = None
            try:
                self.exchange(layer, _EMPTY, guesses, hints, now=now)
            finally:
                st.held = held

    def routed_ids(self, layer: int, experts) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct `experts`, their tensor ids) in one C pass for a
        short host list (Note [Short expert lists in C] in
        prefetch/_routing.pxi), else as _distinct and ids make them."""
        st = self._s
        table = st.prefetcher._ids.get(layer)
        if table is not None and table.shape[0] >= st.num_experts:
            got = distinct_ids(experts, st.num_experts, table)
            if got is not None:
                return got
        routed = _distinct(experts, st.num_experts)
        return routed, st.ids(layer, routed)

    def flush(self) -> None:
        """The controller's `flush` (under the forward lock, Note [One
        forward at a time] in prefetch/integration.py): runs a host-routed
        layer's deferred speculation, reads every routing noted on the
        sync-free path and not read yet, observes a step plan's layers, and
        sends the uses and prefetches still pending to the engine."""
        st = self._s
        with st.forward_lock:
            speculation = self._spec
            speculation.speculate()
            if speculation.unsent is not None:
                speculation.send_unsent()
            if self._syncd._routings:
                self._syncd.read_routings()
            if self._stepplan.planned:  # Note [Host-routed step pins]
                self._stepplan.observe_planned()
            if (st.use is not None or st.fetch is not None) and not self._s.handle.closed:
                use, fetch, st.use, st.fetch = st.use, st.fetch, None, None
                t0 = time.perf_counter_ns()
                try:
                    self._s.handle.exchange(use=use, prefetch=fetch, priority=1)
                finally:
                    self._acct.engine_ns += time.perf_counter_ns() - t0
