"""OffloadController: one offloaded model's engine, (layer, expert) mapping,
predictor, routing clock and accounting.

A MoE layer talks to the engine once (Note [One call per layer] in
src_cpp/acquire_release.cpp): `exchange` releases the layer computed
before, cancels this layer's wrong guesses, sends hints, acquires this
layer's experts and queues the guesses for later layers, in one GIL-free
`PrefetchHandle.exchange`. The previous layer's release rides on that call: its
compute is queued on the stream by then, so the one completion token
recorded covers it.
"""
from __future__ import annotations

import functools

import numpy as np

from prefetch._engine import DEFAULT_ACQUIRE_TIMEOUT_S, PrefetchHandle
from prefetch.errors import InvalidArgumentError
from prefetch.expert_prefetcher import ExpertPrefetcher
from prefetch.offload.accounting import Accounting
from prefetch.offload.deferred import DeferredSpeculation
from prefetch.offload.engine_calls import EngineCalls
from prefetch.offload.exchange_state import ExchangeState
from prefetch.offload.preload import Preload
from prefetch.offload.routing import Routing
from prefetch.offload.routing_context import RoutingContext
from prefetch.offload.speculation import SpeculationGate
from prefetch.offload.step_plan import HostStepPlan
from prefetch.offload.sync_free import SyncFreeDecode
from prefetch.predictors import check_predictor
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
    predictor part), `preloader`, `acct` (counters and report), `routing`
    (the routing clock, the predictor's calls and their scoring), `sync`
    (sync-free decode), `plan` (the host-routed step plan) and `calls`
    (a layer's engine calls: `exchange`, `release_held`). The state they
    share (what is held, uses, fetches and hints still to send, guesses
    queued and filed, the clock) is `state`, an ExchangeState; each part is
    given it (the handle among it) and the siblings it calls, never the controller
    (issue #59: no layer calls back up into the one above it)."""

    _predictor_set = False  # the first assignment is no replacement (Note [A predictor replaced])

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
        self.prefetcher = ExpertPrefetcher(handle)
        # The shape, fixed: plain attributes (the adapter reads them per layer).
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        # Expert parallel: [layers, experts] bool, the experts this rank owns
        # (only those are registered); exchange drops guesses and hints for
        # the others. None: every expert is ours (no process group).
        st = self.state = ExchangeState(
            handle, self.prefetcher, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
            local=None if local is None else np.asarray(local, dtype=bool),
            trace=RoutingTrace(num_layers, num_experts) if record_trace else None)
        # Note [One forward at a time] (prefetch/integration.py): held by the
        # offloaded model's forward and by this controller's public calls.
        self.forward_lock = st.forward_lock
        self.routers = routers or []
        # What predictors are given, read-only: made from what it shows.
        self.context = RoutingContext(st, self.routers,
                                      honours_hints=getattr(handle, "eviction_policy", None) == "next-use")
        # The parts share `state` (the handle among it) and call each other,
        # never the controller (issue #59): each is given the siblings it uses.
        self.acct = Accounting()
        self.gate = SpeculationGate()
        self.preloader = Preload(handle, self.prefetcher, self.acct, num_layers, num_experts)
        self.routing = Routing(st, acct=self.acct, gate=self.gate, context=self.context,
                               preloader=self.preloader)
        self.speculation = DeferredSpeculation(st)
        self.sync = SyncFreeDecode(st, acct=self.acct, gate=self.gate)
        self.plan = HostStepPlan(st, acct=self.acct)
        self.calls = EngineCalls(st, acct=self.acct)
        self.routing.wire(sync=self.sync)
        self.speculation.wire(routing=self.routing, calls=self.calls)
        self.sync.wire(routing=self.routing, calls=self.calls)
        self.plan.wire(routing=self.routing, sync=self.sync, calls=self.calls, speculation=self.speculation)
        self.calls.wire(routing=self.routing, speculation=self.speculation, plan=self.plan, sync=self.sync)
        # The parts' entry points, as the controller's own (bound once: no
        # extra call on the per-layer path).
        self.exchange, self.release_held = self.calls.exchange, self.calls.release_held
        self.pin_layer, self.note_routing = self.sync.pin_layer, self.sync.note_routing
        self.choose_path, self.read_routings = self.sync.choose_path, self.sync.read_routings
        self.queue_read_back, self.whole_step_offsets = self.sync.queue_read_back, self.sync.whole_step_offsets
        r = self.routing
        self.begin_layer, self.predict, self.read_back, self.observe = r.begin_layer, r.predict, r.read_back, r.observe
        self.observe_and_guess, self._host_routed, self.ids = r.observe_and_guess, r.host_routed, st.ids
        self.router_logits, self.router_topk = self.context.router_logits, self.context.router_topk
        self.predictor = predictor  # and what it says of itself: the setter below
        self.host_experts = None  # transformers models: the packed host copy (prefetch.hf.HostExperts)
        self.device = device
        self.expert_parallel = None  # prefetch.expert_parallel.ExpertParallel, set by the transformers adapter

    @property
    def handle(self) -> PrefetchHandle:
        """The engine handle. Setting it (tests and benches wrap it to
        count the calls) hands the new one to the state, where every part
        that calls the engine per layer reads it; the prefetcher and
        preload keep the one they were made with, as before."""
        return self.state.handle

    @handle.setter
    def handle(self, handle) -> None:
        self.state.handle = handle

    # The shared state, read and set here as before (Note [One forward at a
    # time] holds for it as for the rest).
    local = _delegated("state", "local")
    step = _delegated("state", "step")
    clock = _delegated("state", "clock")
    cache_slots = _delegated("state", "cache_slots", "Expert slots of the cache (Note [Step pins], "
                             "Note [Host-routed step pins]); 0: no step plans.")
    sync_free = _delegated("state", "sync_free")
    expert_bytes = _delegated("state", "expert_bytes")
    _seen_layer0 = _delegated("state", "seen_layer0")
    _held = _delegated("state", "held")
    _held_stream = _delegated("state", "held_stream")
    _use = _delegated("state", "use")
    _fetch = _delegated("state", "fetch")
    _late_hints = _delegated("state", "late_hints")
    _queued_guess = _delegated("state", "queued_guess")
    _pending = _delegated("state", "pending")
    _trace = _delegated("state", "trace")
    _predictor = _delegated("state", "predictor", settable=False)

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
        return self.state.predictor

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
        st = self.state
        assigned = self._predictor_set
        if assigned and predictor is not st.predictor:
            self._settle_predictor()  # Note [A predictor replaced]
        if not assigned or predictor is not st.predictor:  # scored on its own from here
            self.acct.new_predictor(predictor)
        self._predictor_set = True
        st.predictor = predictor
        st.late_predict = bool(getattr(predictor, "reads_routing", False))
        # A predictor that says its observe does nothing (`observes = False`)
        # is not called with each routing (Note [Routings nobody reads] in
        # prefetch/offload/sync_free.py).
        st.observes = predictor is not None and (st.late_predict or bool(getattr(predictor, "observes", True)))
        # A predictor whose host guesses are sorted, distinct, in-range int64
        # arrays (the oracle's, made once from its trace) says so: they skip
        # _distinct's pass.
        st.distinct_guesses = bool(getattr(predictor, "distinct_guesses", False))
        # Host guesses (the sync-free path makes them at each layer's pin).
        st.host_guesses = bool(getattr(predictor, "host_guesses", False))

    @property
    @_serialized
    def trace(self):
        """The recorded routing (RoutingTrace), or None without record_trace;
        routings still on their way back from the device are read first."""
        self.flush()
        return self.state.trace

    def read_ahead(self, layer: int, experts: np.ndarray, guesses: dict) -> dict:
        """`guesses`, with the next layer's experts added where this call
        reads ahead (Note [Prefill read-ahead] in prefetch/offload/preload.py)."""
        return self.preloader.read_ahead(layer, experts, guesses, self.state.predictor is not None)

    # -- the engine

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
        end = getattr(self.state.predictor, "end_request", None)
        if end is not None:
            end()
        st = self.state
        st.step = 0
        st.seen_layer0 = False
        st.pending.clear()
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
        self.calls.flush()

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
            st = self.state
            st.use = st.fetch = None
            st.held = None
            self.speculation.drop()
            self.sync._routings = []
            self.plan.planned = []
            self.handle.close()
