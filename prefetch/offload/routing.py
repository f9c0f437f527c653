"""Routing: an offloaded model's routing clock, its predictor's calls and
their scoring (what the controller's `begin_layer`, `predict`,
`read_back`, `observe`, `observe_and_guess` and `read_ahead` are)."""
from __future__ import annotations

import time

import numpy as np

from prefetch._engine import take_ids
from prefetch.expert_ids import distinct as _distinct
from prefetch.expert_ids import routed_experts as _routed_experts
from prefetch.offload.engine_calls import TensorHints
from prefetch.read_back import to_host

__all__ = ["Routing"]


class Routing:
    """Owned by an OffloadController (its `routing`): moves the routing
    clock (`begin_layer`), runs the predictor (`predict`, `host_predict`,
    `observe`, `observe_and_guess`), reads a layer's routing and guesses
    back (`read_back`), files guesses (`expect`) and scores them
    (`score`). Reads and writes the shared ExchangeState; the sync-free
    part (`seen`) is wired in after it is made."""

    def __init__(self, state, *, acct, gate, context, preloader):
        self._s = state
        self._acct = acct
        self._gate = gate
        self.context = context
        self._preloader = preloader
        self._syncd = None  # the SyncFreeDecode part (wire)

    def wire(self, *, sync) -> None:
        self._syncd = sync

    def begin_layer(self, layer: int) -> int:
        """Layer `layer` starts routing: moves the clock and the step count."""
        st = self._s
        st.clock += 1
        if layer == 0:
            if st.seen_layer0:
                st.step += 1
            st.seen_layer0 = True
            if st.predictor is not None:
                self._gate.step_started(self._s.handle.stats())
        return st.step

    def predict(self, layer: int, hidden) -> dict:
        """The predictor's guesses made before the routing reaches the host
        (values may be device tensors)."""
        st = self._s
        if st.predictor is None or st.late_predict or not self._gate.predicts_now():
            return {}
        return st.predictor.predict(self.context, st.step, layer, hidden)

    def read_back(self, raw: dict, routing=None):
        """The layer's one device-to-host copy (Note [Read-back without a
        pageable copy]): `routing` (a device index tensor, or None) and
        every guess in `raw` that is a device tensor come back together.
        Returns (routing as an int64 numpy array or None, {layer: sorted
        distinct experts} for every guess). Time spent waiting counts in
        sync_ns."""
        if not raw:  # no guesses (the common case): the routing alone
            if routing is None:
                return None, {}
            t0 = time.perf_counter_ns()
            host = to_host(routing)
            self._acct.sync_ns += time.perf_counter_ns() - t0
            return host, {}
        import torch

        st = self._s
        on_device = [(t, g) for t, g in raw.items() if isinstance(g, torch.Tensor) and g.device.type != "cpu"]
        parts = ([] if routing is None else [routing.reshape(-1)])
        parts += [g.reshape(-1).to(torch.int64) for _, g in on_device]
        host = None
        if parts:
            t0 = time.perf_counter_ns()
            host = to_host(torch.cat(parts) if len(parts) > 1 else parts[0])
            self._acct.sync_ns += time.perf_counter_ns() - t0
        pos = 0 if routing is None else routing.numel()
        guesses = {}
        for target, g in on_device:  # router top-k indices: in range
            guesses[target] = _routed_experts(host[pos : pos + g.numel()], st.num_experts)
            pos += g.numel()
        for target, g in raw.items():
            if target not in guesses:
                guesses[target] = _distinct(g, st.num_experts)
        return (None if routing is None else host[: routing.numel()]), guesses

    def observe(self, layer: int, experts: np.ndarray, guesses: dict, step: int | None = None
                ) -> tuple[dict, list | None]:
        """Layer `layer` routed to `experts` (sorted int64): scores earlier
        guesses for it, records the trace, tells the predictor. `guesses`
        ({layer: host experts}) are this layer's pre-routing guesses; a
        predictor that reads the routing adds its own here. Returns
        (guesses, hints). `step`: the step the routing belongs to (default:
        the current one; the sync-free path reads routings late)."""
        st = self._s
        step = st.step if step is None else step
        self.score(step, layer, experts)
        if st.sync_free:  # a synced step's reads (Note [Which path a step takes])
            self._syncd.seen[layer, experts] = True
        hints = None
        if st.observes:
            hints = st.predictor.observe(self.context, step, layer, experts)
            if st.late_predict and self._gate.predicts_now():
                guesses = self.host_predict(step, layer, None)
        self.expect(step, layer, guesses)
        return guesses, hints

    def score(self, step: int, layer: int, experts: np.ndarray) -> None:
        """Scores the guesses made for (step, layer) against its routing
        and records it in the trace."""
        st = self._s
        predicted = st.pending.pop((step, layer), None)
        if predicted is not None:
            # Both sorted and distinct: the overlap of two short lists.
            hits = len(set(predicted.tolist()).intersection(experts.tolist()))
            self.count_score(hits, int(predicted.shape[0]), int(experts.shape[0]))
        if st.trace is not None:
            st.trace.add(step, layer, experts)

    def count_score(self, hits: int, guessed: int, routed: int) -> None:
        """One scored layer: `hits` of its `guessed` guesses were among its
        `routed` experts (Note [Speculation by its precision])."""
        self._acct.count_score(hits, guessed, routed)
        self._gate.scored(hits, guessed)

    def observe_and_guess(self, layer: int, experts: np.ndarray) -> tuple[dict, object]:
        """For a predictor with host guesses (`host_guesses`; their
        `predict` need not run before the routing is read back): runs its
        predict, if this layer predicts, then `observe`, for layer `layer`
        of this step routed to `experts` (sorted distinct int64). A
        predictor with a plan (Note [The oracle's plan] in
        prefetch/predictors.py) gives both at once, its hints already as
        tensor ids. Returns (guesses, hints) for `exchange`."""
        st = self._s
        step = st.step
        predicts = st.predictor is not None and not st.late_predict and self._gate.predicts_now()
        plan = getattr(st.predictor, "plan", None)
        if plan is not None and st.local is None:
            got = plan(self.context, step, layer, experts, predicts)
            if got is not None:
                guesses, keys, times = got
                self.score(step, layer, experts)
                self.expect(step, layer, guesses)
                return guesses, (None if keys is None else TensorHints(take_ids(self.flat_table(), keys), times))
        guesses = self.host_predict(step, layer, None) if predicts else {}
        return self.observe(layer, experts, guesses)

    def flat_table(self) -> np.ndarray:
        """Tensor ids by layer * num_experts + expert (-1: not registered),
        made again after a registration."""
        st = self._s
        version = st.prefetcher.version
        if st.flat_ids is None or st.flat_ids[0] != version:
            table = np.full((st.num_layers, st.num_experts), -1, dtype=np.int64)
            for layer, ids in st.prefetcher._ids.items():
                if layer < st.num_layers:
                    n = min(ids.shape[0], st.num_experts)
                    table[layer, :n] = ids[:n]
            st.flat_ids = (version, table.reshape(-1))
        return st.flat_ids[1]

    def expect(self, step: int, layer: int, guesses: dict) -> None:
        """Files `guesses` ({layer: sorted distinct experts}, made at `layer`
        of `step`) to be scored by `observe` when their layers route."""
        st = self._s
        for target, guess in guesses.items():
            if guess.shape[0]:
                target_step = step + (1 if target <= layer else 0)
                st.pending[(target_step, target)] = guess

    def read_ahead(self, layer: int, experts: np.ndarray, guesses: dict) -> dict:
        """`guesses`, with the next layer's experts added where this call
        reads ahead (Note [Prefill read-ahead] in prefetch/offload/preload.py)."""
        st = self._s
        return self._preloader.read_ahead(layer, experts, guesses, st.predictor is not None)

    def host_predict(self, step: int, layer: int, hidden) -> dict:
        """The predictor's host guesses as {layer: sorted distinct experts}
        (taken as they are from a predictor that says they already are:
        distinct_guesses)."""
        st = self._s
        guesses = st.predictor.predict(self.context, step, layer, hidden)
        if st.distinct_guesses:
            return guesses
        return {t: _distinct(g, st.num_experts) for t, g in guesses.items()}

    def held_back(self, guesses: dict) -> bool:
        """Whether the predictor's `guesses` for this layer are not to be
        sent (speculation paused: Note [Speculation by its precision]); the
        layer then counts as paused."""
        st = self._s
        return bool(guesses) and st.predictor is not None and self._gate.hold_back()

    def host_routed(self, layer: int, hidden, experts):
        """A routing made on the host: moves the clock, reads the predictor's
        device guesses back, scores and records `experts`. Returns (sorted
        distinct experts, guesses, hints)."""
        st = self._s
        self.begin_layer(layer)
        _, guesses = self.read_back(self.predict(layer, hidden))
        routed = _distinct(experts, st.num_experts)
        guesses, hints = self.observe(layer, routed, guesses)
        return routed, guesses, hints
