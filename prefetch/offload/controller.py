"""OffloadController: one offloaded model's engine, (layer, expert) mapping,
predictor, routing clock and accounting.

A MoE layer talks to the engine once (Note [One call per layer] in
src_cpp/acquire_release.cpp): `exchange` releases the layer computed
before, cancels this layer's wrong guesses, sends hints, acquires this
layer's experts and queues the guesses for later layers, in one GIL-free
`PrefetchHandle.step`. The previous layer's release rides on that call: its
compute is queued on the stream by then, so the one completion token
recorded covers it.
"""
from __future__ import annotations

import functools
import threading
import time

import numpy as np

from prefetch._engine import DEFAULT_ACQUIRE_TIMEOUT_S, PrefetchHandle, take_ids
from prefetch.errors import InvalidArgumentError
from prefetch.expert_ids import Guesses
from prefetch.expert_ids import distinct as _distinct
from prefetch.expert_ids import routed_experts as _routed_experts
from prefetch.expert_prefetcher import ExpertPrefetcher
from prefetch.offload.accounting import Accounting
from prefetch.offload.deferred import DeferredSpeculation
from prefetch.offload.engine_calls import EngineCalls, TensorHints
from prefetch.offload.preload import Preload
from prefetch.offload.routing_context import RoutingContext
from prefetch.offload.speculation import SpeculationGate
from prefetch.offload.step_plan import HostStepPlan
from prefetch.offload.sync_free import SyncFreeDecode
from prefetch.predictors import check_predictor
from prefetch.read_back import to_host
from prefetch.trace import RoutingTrace

__all__ = ["OffloadController", "check_predictor"]


def _serialized(method):
    """The method runs under the controller's forward lock (Note [One
    forward at a time] in prefetch/integration.py)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.forward_lock:
            return method(self, *args, **kwargs)
    return locked


def _delegated(part: str, name: str, doc: str = "", settable: bool = True):
    """A controller attribute that lives in one of its parts."""
    def get(self):
        return getattr(getattr(self, part), name)

    def set_(self, value):
        setattr(getattr(self, part), name, value)
    return property(get, set_ if settable else None, doc=doc or f"The {part} part's `{name}`.")


class OffloadController:
    """Owns the engine, the (layer, expert) mapping, the predictor and the
    routing clock for one offloaded model, and the parts that do the rest
    (prefetch/offload/): `context` (what predictors read), `gate` (when
    speculation pauses), `speculation` (a host-routed layer's deferred
    predictor part), `preloader`, `acct` (counters and report), `sync`
    (sync-free decode), `plan` (the host-routed step plan) and `calls`
    (a layer's engine calls: `exchange`, `release_held`). The engine calls'
    shared state (what is held, uses, fetches and hints still to send) is
    the controller's; the parts reach it through their owner."""

    def __reduce_ex__(self, protocol):
        # copy.copy, copy.deepcopy and pickle of a controller, or of a model
        # whose experts it offloaded (each offloaded layer holds it): the
        # engine's memory and threads cannot be copied, and a shallow copy
        # would be a second controller on the same engine.
        raise TypeError("a model offloaded by prefetch (and its OffloadController) cannot be copied or pickled: "
                        "its experts live in the engine. Copy or save the model before offload_moe_experts and "
                        "offload each copy (host_experts=controller.host_experts shares the packed experts)")

    def __init__(self, handle: PrefetchHandle, *, num_layers: int, num_experts: int, top_k: int,
                 predictor=None, routers=None, record_trace: bool = False, device=None, local=None):
        self.handle = handle
        # Note [One forward at a time] (prefetch/integration.py): held by the
        # offloaded model's forward and by this controller's public calls.
        self.forward_lock = threading.RLock()
        self.prefetcher = ExpertPrefetcher(handle)
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.context = RoutingContext(self)  # what predictors are given, read-only
        self.acct = Accounting()
        self.gate = SpeculationGate()
        self.speculation = DeferredSpeculation(self)
        self.preloader = Preload(handle, self.prefetcher, self.acct, num_layers, num_experts)
        self.sync = SyncFreeDecode(self)
        self.plan = HostStepPlan(self)
        self.calls = EngineCalls(self)
        # The parts' entry points, as the controller's own (bound once: no
        # extra call on the per-layer path).
        self.exchange, self.release_held = self.calls.exchange, self.calls.release_held
        self.pin_layer, self.note_routing = self.sync.pin_layer, self.sync.note_routing
        self.choose_path, self.read_routings = self.sync.choose_path, self.sync.read_routings
        self.queue_read_back, self.whole_step_offsets = self.sync.queue_read_back, self.sync.whole_step_offsets
        self.predictor = predictor  # and what it says of itself: the setter below
        self.routers = routers or []
        self.host_experts = None  # transformers models: the packed host copy (prefetch.hf.HostExperts)
        self.device = device
        # Expert parallel: [layers, experts] bool, the experts this rank owns
        # (only those are registered); exchange drops guesses and hints for
        # the others. None: every expert is ours (no process group).
        self.local = None if local is None else np.asarray(local, dtype=bool)
        self.expert_parallel = None  # prefetch.expert_parallel.ExpertParallel, set by the transformers adapter
        self.step = 0
        self.clock = -1  # routing calls so far, minus one: never goes back (hint_next_use)
        self._seen_layer0 = False  # a second layer-0 routing starts a new step
        self._trace = RoutingTrace(num_layers, num_experts) if record_trace else None
        self._pending = Guesses()  # (step, layer) -> guessed experts
        self._queued_guess: dict[int, np.ndarray] = {}  # layer -> guessed experts sent to the engine
        self._held: np.ndarray | None = None  # tensor ids acquired, released by the next exchange
        self._held_stream = None
        # Sync-free decode (Note [Sync-free decode] in prefetch/host_experts.py): off
        # until the transformers adapter enables it.
        self.sync_free = False
        self.expert_bytes = 0  # bytes of one expert (set with sync_free)
        self._use = None  # tensor ids read (from read_routings), for the next engine call
        self._fetch = None  # of those, the ones read from host memory: prefetched
        self._late_hints: list = []
        # Expert slots of the cache (set by offload_moe_experts; Note [Step
        # pins], Note [Host-routed step pins]); 0: no step plans.
        self.cache_slots = 0
        self._flat_ids = None  # (prefetcher version, [layers * experts] tensor ids): _plan's hints

    # Counters and settings kept by the parts, read and set here as before.
    prediction_hits = _delegated("acct", "prediction_hits")
    predicted_total = _delegated("acct", "predicted_total")
    actual_total = _delegated("acct", "actual_total")
    layers_run = _delegated("acct", "layers_run")
    engine_ns = _delegated("acct", "engine_ns")
    sync_ns = _delegated("acct", "sync_ns")
    host_ns = _delegated("acct", "host_ns")
    comm_ns = _delegated("acct", "comm_ns")
    zero_copy_reads = _delegated("acct", "zero_copy_reads")
    pinned_hits = _delegated("acct", "pinned_hits")
    step_pins = _delegated("acct", "step_pins")
    read_aheads = _delegated("acct", "read_aheads")
    preloaded = _delegated("acct", "preloaded")
    read_ahead_slots = _delegated("preloader", "read_ahead_slots", "Note [Prefill read-ahead]: cache slots, 0: off.")
    speculation_min_precision = _delegated("gate", "min_precision", "Note [Speculation by its precision]")
    speculation_max_wasted = _delegated("gate", "max_wasted", "Note [Speculation by what its copies waste]")
    probe_when_nothing_fetched = _delegated("gate", "probe_when_nothing_fetched",
                                            "Note [Speculation with nothing to fetch]")
    nothing_fetched = _delegated("gate", "nothing_fetched")
    speculation_paused = _delegated("gate", "paused", "Whether guesses are held back now.", settable=False)
    speculation_paused_layers = _delegated("gate", "paused_layers")
    sync_free_active = _delegated("sync", "active", "This step's path (Note [Which path a step takes]).")
    sync_free_steps = _delegated("sync", "sync_free_steps")
    steady_steps = _delegated("sync", "steady_steps")
    early_read_backs = _delegated("sync", "early_read_backs")
    path_switches = _delegated("sync", "path_switches", settable=False)
    sync_free_held = _delegated("sync", "sync_free_held", settable=False)
    host_step_pins = _delegated("plan", "host_step_pins")

    def enable_sync_free(self, num_experts: int, expert_bytes: int, adaptive: bool = True) -> None:
        """Turns sync-free decode on (Note [Sync-free decode] in
        prefetch/host_experts.py) for `num_experts` experts a layer of
        `expert_bytes` each; `adaptive`: each step picks its path."""
        self.sync_free = True
        self.expert_bytes = expert_bytes
        self.sync.enable(num_experts, adaptive)

    @property
    def predictor(self):
        """The route-ahead predictor (prefetch/predictors.py), or None.
        Assigning one also takes what it says of itself, and first settles
        what the one it replaces left pending (Note [A predictor
        replaced])."""
        return self._predictor

    def _settle_predictor(self) -> None:
        """Note [A predictor replaced]
        The predictor's work trails the routing it is about: a host-routed
        layer's scoring, trace and guesses wait in `speculation.deferred` for
        `speculate` (Note [Speculation after launch]), a step plan's layers
        in `plan.planned` until the next step's first layer (Note [Host-routed
        step pins]), a sync-free step's routings until the next read
        (`read_routings`). Whatever is pending when another predictor is
        assigned was the old one's to do, and the new one cannot do it: the
        next-layer gate given a deferred layer has no hidden state to run
        its router on (it raised AttributeError from `report()`, and the
        layer was lost from the trace), and an oracle given another's plan
        scores a step it never planned, against its own trace (IndexError
        from `report()`, `new_sequence()` and `close()`). So assigning a
        different predictor first flushes, with the old one: every routing
        is scored, recorded and observed, and its last guesses and uses
        reach the engine. The new one then starts on its own record: the
        guesses still filed (the old one's, for layers not routed yet) are
        not scored against it, a plan's half-done step is no longer taken
        as followed, and the recent precision and wasted copies that pause
        speculation (Note [Speculation by its precision], Note [Speculation
        by what its copies waste]) start again from nothing, so a good
        predictor is not held back for a bad one's guesses. Guesses already
        queued in the engine stay queued and are dropped as ever when their
        layer is acquired (`exchange`); hints already made stay too (the
        engine keeps those it was sent)."""
        self.flush()
        self._pending.clear()
        self.plan.forget()
        self.gate.forget()

    @predictor.setter
    @_serialized
    def predictor(self, predictor) -> None:
        check_predictor(predictor)
        assigned = "_predictor" in self.__dict__
        if assigned and predictor is not self._predictor:
            self._settle_predictor()  # Note [A predictor replaced]
        if not assigned or predictor is not self._predictor:  # scored on its own from here
            self.acct.new_predictor(predictor)
        self._predictor = predictor
        self._late_predict = bool(getattr(predictor, "reads_routing", False))
        # A predictor that says its observe does nothing (`observes = False`)
        # is not called with each routing (Note [Routings nobody reads] in
        # prefetch/offload/sync_free.py).
        self._observes = predictor is not None and (self._late_predict or bool(getattr(predictor, "observes", True)))
        # A predictor whose host guesses are sorted, distinct, in-range int64
        # arrays (the oracle's, made once from its trace) says so: they skip
        # _distinct's pass.
        self._distinct_guesses = bool(getattr(predictor, "distinct_guesses", False))
        # Host guesses (the sync-free path makes them at each layer's pin).
        self._host_guesses = bool(getattr(predictor, "host_guesses", False))

    @property
    @_serialized
    def trace(self):
        """The recorded routing (RoutingTrace), or None without record_trace;
        routings still on their way back from the device are read first."""
        self.flush()
        return self._trace

    # -- routing clock and predictions

    def router_logits(self, layer: int, hidden):
        router = self.routers[layer]
        out = router(hidden)
        if isinstance(out, tuple):  # HF routers return (logits, weights, indices)
            out = out[0]
        return out

    def router_topk(self, layer: int, hidden, k: int):
        """The k experts layer `layer`'s router would pick for each row of
        `hidden` (a device tensor). A router with a 2-D `weight` (the
        transformers top-k routers) costs one matmul and one top-k: softmax
        keeps the order, so the top-k of the logits is the router's."""
        import torch

        router = self.routers[layer]
        weight = getattr(router, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[-1] == hidden.shape[-1]:
            bias = getattr(router, "bias", None)  # gpt-oss's router has one
            bias = bias if isinstance(bias, torch.Tensor) and bias.shape == weight.shape[:1] else None
            logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
        else:
            logits = self.router_logits(layer, hidden)
        return torch.topk(logits, min(k, logits.shape[-1]), dim=-1).indices

    def begin_layer(self, layer: int) -> int:
        """Layer `layer` starts routing: moves the clock and the step count."""
        self.clock += 1
        if layer == 0:
            if self._seen_layer0:
                self.step += 1
            self._seen_layer0 = True
            if self._predictor is not None:
                self.gate.step_started(self.handle.stats())
        return self.step

    def predict(self, layer: int, hidden) -> dict:
        """The predictor's guesses made before the routing reaches the host
        (values may be device tensors)."""
        if self._predictor is None or self._late_predict or not self.gate.predicts_now():
            return {}
        return self._predictor.predict(self.context, self.step, layer, hidden)

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
            self.acct.sync_ns += time.perf_counter_ns() - t0
            return host, {}
        import torch

        on_device = [(t, g) for t, g in raw.items() if isinstance(g, torch.Tensor) and g.device.type != "cpu"]
        parts = ([] if routing is None else [routing.reshape(-1)])
        parts += [g.reshape(-1).to(torch.int64) for _, g in on_device]
        host = None
        if parts:
            t0 = time.perf_counter_ns()
            host = to_host(torch.cat(parts) if len(parts) > 1 else parts[0])
            self.acct.sync_ns += time.perf_counter_ns() - t0
        pos = 0 if routing is None else routing.numel()
        guesses = {}
        for target, g in on_device:  # router top-k indices: in range
            guesses[target] = _routed_experts(host[pos : pos + g.numel()], self.num_experts)
            pos += g.numel()
        for target, g in raw.items():
            if target not in guesses:
                guesses[target] = _distinct(g, self.num_experts)
        return (None if routing is None else host[: routing.numel()]), guesses

    def observe(self, layer: int, experts: np.ndarray, guesses: dict, step: int | None = None
                ) -> tuple[dict, list | None]:
        """Layer `layer` routed to `experts` (sorted int64): scores earlier
        guesses for it, records the trace, tells the predictor. `guesses`
        ({layer: host experts}) are this layer's pre-routing guesses; a
        predictor that reads the routing adds its own here. Returns
        (guesses, hints). `step`: the step the routing belongs to (default:
        the current one; the sync-free path reads routings late)."""
        step = self.step if step is None else step
        self._score(step, layer, experts)
        if self.sync_free:  # a synced step's reads (Note [Which path a step takes])
            self.sync.seen[layer, experts] = True
        hints = None
        if self._observes:
            hints = self._predictor.observe(self.context, step, layer, experts)
            if self._late_predict and self.gate.predicts_now():
                guesses = self._host_predict(step, layer, None)
        self._expect(step, layer, guesses)
        return guesses, hints

    def _score(self, step: int, layer: int, experts: np.ndarray) -> None:
        """Scores the guesses made for (step, layer) against its routing
        and records it in the trace."""
        predicted = self._pending.pop((step, layer), None)
        if predicted is not None:
            # Both sorted and distinct: the overlap of two short lists.
            hits = len(set(predicted.tolist()).intersection(experts.tolist()))
            self._count_score(hits, int(predicted.shape[0]), int(experts.shape[0]))
        if self._trace is not None:
            self._trace.add(step, layer, experts)

    def _count_score(self, hits: int, guessed: int, routed: int) -> None:
        """One scored layer: `hits` of its `guessed` guesses were among its
        `routed` experts (Note [Speculation by its precision])."""
        self.acct.count_score(hits, guessed, routed)
        self.gate.scored(hits, guessed)

    def observe_and_guess(self, layer: int, experts: np.ndarray) -> tuple[dict, object]:
        """For a predictor with host guesses (`host_guesses`; their
        `predict` need not run before the routing is read back): runs its
        predict, if this layer predicts, then `observe`, for layer `layer`
        of this step routed to `experts` (sorted distinct int64). A
        predictor with a plan (Note [The oracle's plan] in
        prefetch/predictors.py) gives both at once, its hints already as
        tensor ids. Returns (guesses, hints) for `exchange`."""
        step = self.step
        predicts = self._predictor is not None and not self._late_predict and self.gate.predicts_now()
        plan = getattr(self._predictor, "plan", None)
        if plan is not None and self.local is None:
            got = plan(self.context, step, layer, experts, predicts)
            if got is not None:
                guesses, keys, times = got
                self._score(step, layer, experts)
                self._expect(step, layer, guesses)
                return guesses, (None if keys is None else TensorHints(take_ids(self._flat_table(), keys), times))
        guesses = self._host_predict(step, layer, None) if predicts else {}
        return self.observe(layer, experts, guesses)

    def _flat_table(self) -> np.ndarray:
        """Tensor ids by layer * num_experts + expert (-1: not registered),
        made again after a registration."""
        version = self.prefetcher.version
        if self._flat_ids is None or self._flat_ids[0] != version:
            table = np.full((self.num_layers, self.num_experts), -1, dtype=np.int64)
            for layer, ids in self.prefetcher._ids.items():
                if layer < self.num_layers:
                    n = min(ids.shape[0], self.num_experts)
                    table[layer, :n] = ids[:n]
            self._flat_ids = (version, table.reshape(-1))
        return self._flat_ids[1]

    def _expect(self, step: int, layer: int, guesses: dict) -> None:
        """Files `guesses` ({layer: sorted distinct experts}, made at `layer`
        of `step`) to be scored by `observe` when their layers route."""
        for target, guess in guesses.items():
            if guess.shape[0]:
                target_step = step + (1 if target <= layer else 0)
                self._pending[(target_step, target)] = guess

    def read_ahead(self, layer: int, experts: np.ndarray, guesses: dict) -> dict:
        """`guesses`, with the next layer's experts added where this call
        reads ahead (Note [Prefill read-ahead] in prefetch/offload/preload.py)."""
        return self.preloader.read_ahead(layer, experts, guesses, self._predictor is not None)

    def _host_predict(self, step: int, layer: int, hidden) -> dict:
        """The predictor's host guesses as {layer: sorted distinct experts}
        (taken as they are from a predictor that says they already are:
        distinct_guesses)."""
        guesses = self._predictor.predict(self.context, step, layer, hidden)
        if self._distinct_guesses:
            return guesses
        return {t: _distinct(g, self.num_experts) for t, g in guesses.items()}

    def _held_back(self, guesses: dict) -> bool:
        """Whether the predictor's `guesses` for this layer are not to be
        sent (speculation paused: Note [Speculation by its precision]); the
        layer then counts as paused."""
        return bool(guesses) and self._predictor is not None and self.gate.hold_back()

    # -- the engine

    def ids(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Tensor ids of `experts` (distinct, in range: from _distinct) of
        `layer`; an unregistered one maps to -1, which the engine refuses."""
        return self.prefetcher._ids[layer][experts]

    def _host_routed(self, layer: int, hidden, experts):
        """A routing made on the host: moves the clock, reads the predictor's
        device guesses back, scores and records `experts`. Returns (sorted
        distinct experts, guesses, hints)."""
        self.begin_layer(layer)
        _, guesses = self.read_back(self.predict(layer, hidden))
        routed = _distinct(experts, self.num_experts)
        guesses, hints = self.observe(layer, routed, guesses)
        return routed, guesses, hints

    def on_routed(self, layer: int, hidden, experts) -> None:
        """For callers that route on the host and acquire by themselves:
        layer `layer` chose `experts`; score, record, and queue the
        predictor's guesses in one engine call. The caller acquires (a
        second call; `route_and_acquire` does both in one)."""
        self.speculate()
        _, guesses, hints = self._host_routed(layer, hidden, experts)
        self.calls.send_guesses(layer, guesses, hints)

    def route_and_acquire(self, layer: int, hidden, experts, *, stream=None,
                          timeout: float = DEFAULT_ACQUIRE_TIMEOUT_S, first: int | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
        """For callers that route on the host themselves (OffloadedMoEBlock,
        BM5): layer `layer` chose `experts`. Makes the layer's engine call
        (`exchange`): release what the last call acquired (its compute is
        queued by now), acquire `experts` (held until the next call or
        `release_held`; the last layer of a forward calls that). Scoring,
        recording and the predictor's guesses and hints go with it, or, for
        predictors with host guesses, into `speculate` (Note [Speculation
        after launch]): call that once the layer's compute is queued.
        Returns (the sorted distinct experts, acquire's (offset, device) rows
        for them in that order). `first`: acquire only the first that many of
        them (a layer larger than the cache); `acquire_more` takes the rest,
        piece by piece."""
        if first is not None and first < 1:
            raise InvalidArgumentError(f"first must be >= 1, got {first}")
        self.speculate(with_next_acquire=True)
        speculation = self.speculation
        if (not layer or self.plan.pinned_step is not None) and self.plan.applies(layer, stream):
            got = self.plan.route(layer, experts, stream, timeout, first)  # Note [Host-routed step pins]
            if got is not None:
                return got
        if speculation.defers():
            routed, ids = self.calls.routed_ids(layer, experts)
            self.begin_layer(layer)
            if first is not None:
                routed_now, ids = routed[:first], ids[:first]
            else:
                routed_now = routed
            if speculation.unsent is not None:
                where = speculation.acquire_with_unsent(layer, routed_now, stream, timeout, ids)
            else:
                where = self.exchange(layer, routed_now, {}, None, stream=stream, timeout=timeout, acquire_ids=ids)
            speculation.defer(layer, routed)
            return routed, where
        if speculation.unsent is not None:
            speculation.send_unsent()
        routed, guesses, hints = self._host_routed(layer, hidden, experts)
        return routed, self.exchange(layer, routed[:first], guesses, hints, stream=stream, timeout=timeout)

    def acquire_more(self, layer: int, experts: np.ndarray, *, stream=None,
                     timeout: float = DEFAULT_ACQUIRE_TIMEOUT_S) -> np.ndarray:
        """The next piece of the layer `route_and_acquire` routed (sorted
        distinct experts from its result): releases the piece acquired
        before (its compute is queued by now) and acquires these, in one
        engine call. Returns their (offset, device) rows."""
        return self.exchange(layer, experts, {}, None, stream=stream, timeout=timeout)

    def speculate(self, with_next_acquire: bool = False) -> None:
        """The deferred part of the last `route_and_acquire` (Note
        [Speculation after launch]): score and record its routing, run the
        predictor, queue its guesses and send its hints in one engine call.
        Nothing to do after a call that did it all, or twice.
        `with_next_acquire`: the guesses and hints go with the next
        `route_and_acquire`'s engine call instead (Note [Speculation rides
        on the next acquire]); for a caller about to make it (any other
        engine call sends them first)."""
        self.speculation.speculate(with_next_acquire)

    @_serialized
    def new_sequence(self) -> None:
        """Call between requests: resets the step counter and lets a learning
        predictor file the finished request (the sync-free path's last
        routings are read first: they belong to it)."""
        self.flush()
        end = getattr(self._predictor, "end_request", None)
        if end is not None:
            end()
        self.step = 0
        self._seen_layer0 = False
        self._pending.clear()
        self.plan.new_request()  # Note [Host-routed step pins]: the step numbers start again

    # -- reporting

    @_serialized
    def preload(self, slots: int, *, only_if_all: bool = False) -> int:
        """Queues, at the least urgent band, as many of the registered
        experts as `slots` cache slots hold (Note [Preload] in
        prefetch/offload/preload.py); with `only_if_all`, nothing unless all
        of them fit. Returns how many were queued."""
        return self.preloader.queue(slots, only_if_all)

    def wait_preloaded(self, timeout: float | None = None, *, progress: bool = False) -> bool:
        """Blocks until the engine has no copy queued or being issued and,
        on CUDA, the issued copies have landed (Note [Waiting for the
        preload] in prefetch/offload/preload.py). Returns True when done,
        False when `timeout` seconds passed first (the copies go on).
        `progress`: print how many of the preloaded experts are resident
        while it waits. After close() it raises HandleClosedError."""
        return self.preloader.wait(timeout, progress=progress)

    @_serialized
    def report(self) -> dict:
        """Hit rate, prediction precision and recall, bytes and copies moved,
        and the host time of the offloaded layers (us per layer: engine
        calls, the routing read-back, the rest). `predictors`: each
        predictor assigned, in order (the last 64), with its own precision
        and recall (the totals add up all of them)."""
        self.flush()
        return self.acct.report(self.handle.stats(), sync=self.sync if self.sync_free else None,
                                expert_bytes=self.expert_bytes, paused_layers=self.gate.paused_layers,
                                expert_parallel=self.expert_parallel is not None)

    @_serialized
    def flush(self) -> None:
        """Reads every routing noted on the sync-free path and not read yet,
        and sends its uses and prefetches to the engine (they would
        otherwise wait for the next forward). A host-routed layer's
        deferred speculation runs too."""
        speculation = self.speculation
        speculation.speculate()
        if speculation.unsent is not None:
            speculation.send_unsent()
        if self.sync._routings:
            self.sync.read_routings()
        if self.plan.planned:  # Note [Host-routed step pins]
            self.plan.observe_planned()
        if (self._use is not None or self._fetch is not None) and not self.handle.closed:
            use, fetch, self._use, self._fetch = self._use, self._fetch, None, None
            t0 = time.perf_counter_ns()
            try:
                self.handle.exchange(use=use, prefetch=fetch, priority=1)
            finally:
                self.acct.engine_ns += time.perf_counter_ns() - t0

    @_serialized
    def close(self) -> None:
        """Scores and records what is pending (nothing more is prefetched),
        then closes the engine handle, which frees its cache; the handle is
        closed even when the pending work raises (a predictor's error goes
        on to the caller)."""
        try:
            if self.sync._routings:
                self.sync.read_routings()  # the trace stays complete; nothing more is prefetched
            self.plan.close()
            self.speculation.close()  # scored and recorded; nothing more is prefetched
        finally:
            self._use = self._fetch = None
            self._held = None
            self.speculation.drop()
            self.sync._routings = []
            self.plan.planned = []
            self.handle.close()
