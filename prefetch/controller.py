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
from collections import deque

import numpy as np

from prefetch._engine import DEFAULT_ACQUIRE_TIMEOUT_S, PrefetchHandle, distinct_ids, hint_arrays, take_ids
from prefetch.errors import InvalidArgumentError, UnknownIdError
from prefetch.expert_ids import EMPTY as _EMPTY
from prefetch.expert_ids import Guesses
from prefetch.expert_ids import distinct as _distinct
from prefetch.expert_ids import routed_experts as _routed_experts
from prefetch.expert_prefetcher import ExpertPrefetcher
from prefetch.offload.routing_context import RoutingContext
from prefetch.read_back import to_host
from prefetch.step_plan import HostStepPlan
from prefetch.sync_free import SyncFreeDecode
from prefetch.trace import RoutingTrace

__all__ = ["OffloadController"]

_MAX_BAND = 19  # kNumBands - 1
# Note [Speculation by its precision]: the recent precision's memory (per
# scored layer) and how many recent guesses it needs before it judges.
_PRECISION_DECAY = 0.95
# report()["predictors"] keeps the last this many predictors assigned (a
# stack that assigns one per request would otherwise grow the list forever).
_SCORED_PREDICTORS = 64
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


class _TensorHints:
    """Hints already as the engine takes them: tensor ids and next-use
    times (from a predictor's plan, Note [The oracle's plan] in
    prefetch/predictors.py)."""

    __slots__ = ("ids", "when")

    def __init__(self, ids: np.ndarray, when: np.ndarray):
        self.ids = ids
        self.when = when


def _serialized(method):
    """The method runs under the controller's forward lock (Note [One
    forward at a time] in prefetch/integration.py)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.forward_lock:
            return method(self, *args, **kwargs)
    return locked


def check_predictor(predictor) -> None:
    """TypeError unless `predictor` is None or a predictor object: one with
    `predict` and `observe` methods (prefetch/predictors.py). A class
    where an instance belongs, or a name such as "oracle", would otherwise
    fail only at the first forward, deep inside it."""
    if predictor is None:
        return
    if isinstance(predictor, type):
        raise TypeError(f"predictor must be a predictor object, got the class {predictor.__name__}: pass an instance, "
                        f"e.g. {predictor.__name__}(...)")
    missing = [m for m in ("predict", "observe") if not callable(getattr(predictor, m, None))]
    if missing:
        raise TypeError(f"predictor must be None or an object with predict and observe methods (prefetch.predictors: "
                        f"NextLayerGatePredictor, OraclePredictor, TracePredictor), got {type(predictor).__name__} "
                        f"{predictor!r} without {' and '.join(missing)}")


class OffloadController(SyncFreeDecode, HostStepPlan):
    """Owns the engine, the (layer, expert) mapping, the predictor and the
    accounting for one offloaded model."""

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
        # Each predictor's own scores, in the order they were assigned:
        # [class name, prediction hits, guessed, routed] (report()["predictors"]).
        self._scores: deque[list] = deque(maxlen=_SCORED_PREDICTORS)
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
        self.prediction_hits = 0
        self.predicted_total = 0
        self.actual_total = 0
        # Host time of the offloaded layers (ns): engine calls, the routing
        # read-back (which waits for the GPU), and everything else we add.
        self.layers_run = 0
        self.engine_ns = 0
        self.sync_ns = 0
        self.host_ns = 0
        self.comm_ns = 0  # expert parallel: the per-layer all-reduces (they wait for the slowest rank)
        # Sync-free decode (Note [Sync-free decode] in prefetch/host_experts.py): off
        # until the transformers adapter enables it.
        self.sync_free = False
        self._routings: list = []  # (layer, step, device routing, pinned mask), not read back yet
        self.zero_copy_reads = 0  # routed experts read from host memory (not resident at pin time)
        self.expert_bytes = 0  # bytes of one expert (set with sync_free)
        self.pinned_hits = 0  # routed experts read from the cache on the sync-free path
        self._steady = None  # this step's pins are all held (Note [Steady pins] in prefetch/sync_free.py)
        self._use = None  # tensor ids read (from read_routings), for the next engine call
        self._fetch = None  # of those, the ones read from host memory: prefetched
        self._late_hints: list = []
        # Note [Prefill read-ahead]: cache slots (set by the transformers
        # adapter; 0 turns it off) and the calls that read ahead.
        self.read_ahead_slots = 0
        # Expert slots of the cache (set by offload_moe_experts; Note [Step
        # pins], Note [Host-routed step pins]); 0: no step plans.
        self.cache_slots = 0
        self.step_pins = 0  # steps pinned and fetched by the predictor's step plan (either path)
        self._init_host_plan()
        self.read_aheads = 0
        self.preloaded = 0  # experts queued by preload() (Note [Preload])
        self._deferred = None  # (layer, routed experts): Note [Speculation after launch]
        self._flat_ids = None  # (prefetcher version, [layers * experts] tensor ids): _plan's hints
        self._unsent = None  # (layer, guesses, hints, clock): Note [Speculation rides on the next acquire]
        # Note [Speculation by its precision]
        self.speculation_min_precision = 0.25
        self._recent_hits = 0.0
        self._recent_guessed = 0.0
        self.speculation_paused_layers = 0
        self._paused_predicts = 0  # predictor calls asked for while paused (one in _PAUSED_PROBE_EVERY runs)
        # Note [Speculation by what its copies waste]
        self.speculation_max_wasted = 0.5
        self._recent_prefetched = 0.0  # copies made for prefetches, decayed per step
        self._recent_wasted = 0.0  # of those, evicted unused
        self._prefetch_counts = None  # (prefetched copies, wasted) when this step began
        # Note [Speculation with nothing to fetch]
        self.probe_when_nothing_fetched = True  # False: the predictor runs whatever the engine copies
        self._copies_at_step = None  # copies asked of the engine when this step began
        self._idle_steps = 0  # consecutive steps that asked for no copy
        self.nothing_fetched = False  # the last two steps asked for no copy: the predictor probes

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
        layer's scoring, trace and guesses wait in `_deferred` for
        `speculate` (Note [Speculation after launch]), a step plan's layers
        in `_planned` until the next step's first layer (Note [Host-routed
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
        self._plan_filed = None
        self._plan_kept = False
        self._recent_hits = self._recent_guessed = 0.0
        self._recent_prefetched = self._recent_wasted = 0.0
        self._paused_predicts = 0

    @predictor.setter
    @_serialized
    def predictor(self, predictor) -> None:
        check_predictor(predictor)
        assigned = "_predictor" in self.__dict__
        if assigned and predictor is not self._predictor:
            self._settle_predictor()  # Note [A predictor replaced]
        if not assigned or predictor is not self._predictor:  # scored on its own from here
            self._scores.append([type(predictor).__name__ if predictor is not None else None, 0, 0, 0])
        self._predictor = predictor
        self._late_predict = bool(getattr(predictor, "reads_routing", False))
        # A predictor that says its observe does nothing (`observes = False`)
        # is not called with each routing (Note [Routings nobody reads] in
        # prefetch/sync_free.py).
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
                s = self.handle.stats()
                self._count_waste(s)
                if self.probe_when_nothing_fetched:
                    asked = s["enqueued"] + s["on_demand"]  # copies asked for (done or not)
                    idle = asked == self._copies_at_step and s["queue_depth"] == 0
                    self._idle_steps = self._idle_steps + 1 if idle else 0
                    self.nothing_fetched = self._idle_steps >= _IDLE_STEPS_TO_PROBE
                    self._copies_at_step = asked
        return self.step

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

    def predict(self, layer: int, hidden) -> dict:
        """The predictor's guesses made before the routing reaches the host
        (values may be device tensors)."""
        if self._predictor is None or self._late_predict or not self._predicts_now():
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
            self.sync_ns += time.perf_counter_ns() - t0
            return host, {}
        import torch

        on_device = [(t, g) for t, g in raw.items() if isinstance(g, torch.Tensor) and g.device.type != "cpu"]
        parts = ([] if routing is None else [routing.reshape(-1)])
        parts += [g.reshape(-1).to(torch.int64) for _, g in on_device]
        host = None
        if parts:
            t0 = time.perf_counter_ns()
            host = to_host(torch.cat(parts) if len(parts) > 1 else parts[0])
            self.sync_ns += time.perf_counter_ns() - t0
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
            self._seen[layer, experts] = True
        hints = None
        if self._observes:
            hints = self._predictor.observe(self.context, step, layer, experts)
            if self._late_predict and self._predicts_now():
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
        self.prediction_hits += hits
        self.predicted_total += guessed
        self.actual_total += routed
        own = self._scores[-1]
        own[1] += hits
        own[2] += guessed
        own[3] += routed
        self._recent_hits = self._recent_hits * _PRECISION_DECAY + hits
        self._recent_guessed = self._recent_guessed * _PRECISION_DECAY + guessed

    def observe_and_guess(self, layer: int, experts: np.ndarray) -> tuple[dict, object]:
        """For a predictor with host guesses (`host_guesses`; their
        `predict` need not run before the routing is read back): runs its
        predict, if this layer predicts, then `observe`, for layer `layer`
        of this step routed to `experts` (sorted distinct int64). A
        predictor with a plan (Note [The oracle's plan] in
        prefetch/predictors.py) gives both at once, its hints already as
        tensor ids. Returns (guesses, hints) for `exchange`."""
        step = self.step
        predicts = self._predictor is not None and not self._late_predict and self._predicts_now()
        plan = getattr(self._predictor, "plan", None)
        if plan is not None and self.local is None:
            got = plan(self.context, step, layer, experts, predicts)
            if got is not None:
                guesses, keys, times = got
                self._score(step, layer, experts)
                self._expect(step, layer, guesses)
                return guesses, (None if keys is None else _TensorHints(take_ids(self._flat_table(), keys), times))
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
        """Note [Prefill read-ahead]
        A call that routes to nearly every expert of its layer (90 % or
        more: a prompt, where each of hundreds of rows picks top-k) is
        followed by a next layer that does the same. Without a predictor
        nothing would be copied for that layer until its own routing, and
        the link would idle through this layer's compute and the host work
        in between, once per layer of the prefill (BM6, Qwen3-30B-A3B, a
        512-token prompt at a quarter of the experts cached: time to first
        token 1.40x its floor on-demand, 1.01x with the gate, which does
        keep the link busy). So, with no predictor, such a call also
        queues the next layer's experts at band 1, behind this layer's
        misses; the next layer's own call cancels those still queued, as it
        does a guess's. Only where the cache holds two layers' experts: a
        smaller one would evict the read-ahead before its use, or this
        layer's later pieces. Decode calls route to far fewer experts (8
        rows of top-8 over 64 experts: about 63 %) and never read ahead."""
        nxt = layer + 1
        if (self._predictor is not None or nxt >= self.num_layers or self.read_ahead_slots < 2 * self.num_experts
                or experts.shape[0] < 0.9 * self.num_experts or nxt in guesses):
            return guesses
        self.read_aheads += 1
        return {**guesses, nxt: np.arange(self.num_experts, dtype=np.int64)}

    def _host_predict(self, step: int, layer: int, hidden) -> dict:
        """The predictor's host guesses as {layer: sorted distinct experts}
        (taken as they are from a predictor that says they already are:
        distinct_guesses)."""
        guesses = self._predictor.predict(self.context, step, layer, hidden)
        if self._distinct_guesses:
            return guesses
        return {t: _distinct(g, self.num_experts) for t, g in guesses.items()}

    @property
    def speculation_paused(self) -> bool:
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
        return (self.speculation_min_precision > 0 and self._recent_guessed >= _PRECISION_MIN_GUESSES
                and self._recent_hits < self.speculation_min_precision * self._recent_guessed)

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
        return (self.speculation_max_wasted < 1 and self._recent_prefetched >= _WASTE_MIN_COPIES
                and self._recent_wasted > self.speculation_max_wasted * self._recent_prefetched)

    def _predicts_now(self) -> bool:
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
        if not self.speculation_paused and not self.nothing_fetched:
            return True
        self._paused_predicts += 1
        if self._paused_predicts % _PAUSED_PROBE_EVERY:
            self.speculation_paused_layers += 1
            return False
        return True

    def _held_back(self, guesses: dict) -> bool:
        """Whether the predictor's `guesses` for this layer are not to be
        sent (speculation paused: Note [Speculation by its precision]); the
        layer then counts as paused."""
        if guesses and self._predictor is not None and self.speculation_paused:
            self.speculation_paused_layers += 1
            return True
        return False

    # -- the engine

    def ids(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Tensor ids of `experts` (distinct, in range: from _distinct) of
        `layer`; an unregistered one maps to -1, which the engine refuses."""
        return self.prefetcher._ids[layer][experts]

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
        the caller has them (`_routed_ids`)."""
        if self._unsent is not None:
            self._send_unsent()
        if self.local is not None:
            guesses, hints = self._only_local(guesses, hints)
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
            distance = (target - layer) % self.num_layers or self.num_layers
            ids = self.ids(target, guess)
            queued.append((target, guess))
            if prefetch is None or distance < band:
                if prefetch is not None:
                    extra = [*(extra or ()), (prefetch, band)]
                prefetch, band = ids, min(_MAX_BAND, distance)
            else:
                extra = [*(extra or ()), (ids, min(_MAX_BAND, distance))]
        stale = self._queued_guess.pop(layer, None)
        cancel = self.ids(layer, stale) if stale is not None else None
        for target, guess in queued:
            self._queued_guess[target] = guess
        hint_ids, hint_when = self._hint_arrays(hints)
        if self._held is not None and stream is not self._held_stream and stream != self._held_stream:
            self.release_held()  # another stream now: its own release
        held, self._held = self._held, None
        if self._plan_step is not None:  # a planned step's pins go with this release
            self._end_plan()
        acquire = self.ids(layer, experts) if acquire_ids is None else acquire_ids
        t0 = time.perf_counter_ns()
        try:
            where = self.handle.step(acquire, release=held, prefetch=prefetch, band=band, cancel=cancel,
                                     hint_ids=hint_ids, hint_when=hint_when,
                                     now=(self.clock if now is None else now) if hints is not None else None,
                                     stream=stream, timeout=timeout)
        except (ValueError, KeyError, TypeError, OverflowError):
            # Bad arguments are refused before anything changes: still held.
            self._held = held
            raise
        finally:
            self.engine_ns += time.perf_counter_ns() - t0
        if acquire.shape[0]:
            self._held = acquire
            self._held_stream = stream
        if extra is not None:  # after the step's bookkeeping: a failure here holds what the step took
            t0 = time.perf_counter_ns()
            try:
                for ids, b in extra:
                    self._queue_guesses(ids, b)
            finally:
                self.engine_ns += time.perf_counter_ns() - t0
        return where

    def _queue_guesses(self, ids: np.ndarray, band: int) -> None:
        """Queues guesses after the step: as in the engine's own step (Note
        [A step's prefetches after its wait] in src_cpp/acquire_release.cpp),
        a guess whose id was unregistered behind the controller is dropped,
        not raised after the step's acquire has succeeded."""
        try:
            self.handle.prefetch_tensors(ids, band)
        except UnknownIdError:
            kept = np.fromiter((i for i in ids.tolist() if i in self.handle), dtype=np.int64)
            if kept.shape[0]:
                self.handle.prefetch_tensors(kept, band)

    def _hint_arrays(self, hints):
        """(tensor ids, next-use times) of predictor hints [(layer, experts,
        one time or one per expert)], or (None, None) for none."""
        if not hints:
            return None, None
        if type(hints) is _TensorHints:
            return hints.ids, hints.when
        return hint_arrays(hints, self.prefetcher._ids)  # one C pass (prefetch/_routing.pxi)

    def _only_local(self, guesses: dict, hints):
        local = self.local
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
        if self._unsent is not None:
            self._send_unsent()
        held, self._held = self._held, None
        self._steady = None  # Note [Steady pins]: a steady step's pins were held here
        if self._plan_step is not None:
            self._end_plan()
        if held is not None and held.shape[0]:
            t0 = time.perf_counter_ns()
            self.handle.release(held, stream=stream if stream is not None else self._held_stream)
            self.engine_ns += time.perf_counter_ns() - t0

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
        self._send_guesses(layer, guesses, hints)

    def _send_guesses(self, layer: int, guesses: dict, hints, now: int | None = None) -> None:
        """An engine call that queues guesses and sends hints only: what is
        held stays held. `now`: the clock the hints were made at (default:
        the routing clock)."""
        if guesses or hints or layer in self._queued_guess:
            held = self._held
            self._held = None
            try:
                self.exchange(layer, _EMPTY, guesses, hints, now=now)
            finally:
                self._held = held

    def _defers_speculation(self) -> bool:
        """Note [Speculation after launch]
        On a host-routed layer (OffloadedMoEBlock, BM5) the GPU has drained
        by the time the routing reaches the host, and it idles until the
        layer's experts are acquired and their compute is queued: every
        microsecond of host work in between is added to the step. Scoring
        and recording the routing, the predictor's observe and predict, its
        hints and the queueing of its guesses need not be in that window
        when the predictor's guesses are host data (no hidden state to read
        back: `host_guesses`, `reads_routing`, or no predictor). Then
        `route_and_acquire` makes the critical call alone (release the last
        layer, cancel this layer's stale guesses, acquire) and the rest runs
        in `speculate`, which the caller calls once the layer's compute is
        queued, while the GPU works; the next `route_and_acquire` (or
        `flush`) runs it if the caller did not. Its engine call then goes
        with the next acquire's (Note [Speculation rides on the next
        acquire]). Measured on BM5 with the
        oracle on the gemma-4 trace (H200 host, before this): the
        predictor's part took 4.5-5.7 ms of a 37 ms step at a hit rate of
        1.00. The best moment is the next layer's, just before its routing
        read-back: the GPU then has this layer's expert compute and the next
        layer's attention and router queued, the longest work the host can
        hide behind (right after this layer's launch, the expert compute
        alone, a fraction of a millisecond at batch 1, was often done before
        the predictor was). OffloadedMoEBlock and BM5 call it there, except
        after a step's last layer: the next call is the next step's first,
        after the lm head and the token's read-back, too late for guesses
        aimed at the next step's first layers, so the last layer speculates
        right after its launch (without that exception, on the H200 host, the
        oracle's hit rate fell from 1.000 to 0.997 on gemma-4 and from
        0.856 to 0.847 on gpt-oss-120b). What the later moment costs: the
        guesses made there for the layer about to be acquired are dropped
        (its acquire takes them at band 0), so a host-guess predictor of
        distance d prefetches d - 1 layers ahead in effect. Where the copies
        set the pace that decides the step: on a CPU model of the link under
        BM5's gpt-oss-120b replay at 25 %, the oracle ran 1.27-1.33x the
        IO floor at distance 2 and 1.06-1.07x at 4 (1.19-1.28x at 2 when it
        speculated right after each acquire instead). A predictor that
        guesses from the hidden state on the device (the next-layer gate)
        keeps the single call: its guesses are read back with the routing,
        before the acquire."""
        p = self._predictor
        return p is None or self._late_predict or bool(getattr(p, "host_guesses", False))

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
        if (not layer or self._plan_step is not None) and self._plan_applies(layer, stream):
            got = self._route_planned(layer, experts, stream, timeout, first)  # Note [Host-routed step pins]
            if got is not None:
                return got
        if self._defers_speculation():
            routed, ids = self._routed_ids(layer, experts)
            self.begin_layer(layer)
            if first is not None:
                routed_now, ids = routed[:first], ids[:first]
            else:
                routed_now = routed
            if self._unsent is not None:
                where = self._acquire_with_unsent(layer, routed_now, stream, timeout, ids)
            else:
                where = self.exchange(layer, routed_now, {}, None, stream=stream, timeout=timeout, acquire_ids=ids)
            self._deferred = (layer, routed)
            return routed, where
        if self._unsent is not None:
            self._send_unsent()
        routed, guesses, hints = self._host_routed(layer, hidden, experts)
        return routed, self.exchange(layer, routed[:first], guesses, hints, stream=stream, timeout=timeout)

    def _routed_ids(self, layer: int, experts) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct `experts`, their tensor ids) in one C pass for a
        short host list (Note [Short expert lists in C] in
        prefetch/_routing.pxi), else as _distinct and ids make them."""
        table = self.prefetcher._ids.get(layer)
        if table is not None and table.shape[0] >= self.num_experts:
            got = distinct_ids(experts, self.num_experts, table)
            if got is not None:
                return got
        routed = _distinct(experts, self.num_experts)
        return routed, self.ids(layer, routed)

    def _acquire_with_unsent(self, layer: int, experts: np.ndarray, stream, timeout: float,
                             acquire_ids: np.ndarray | None = None) -> np.ndarray:
        """Note [Speculation rides on the next acquire]
        `speculate(with_next_acquire=True)` makes the last layer's guesses
        and hints on the host and leaves them for this call: one engine
        crossing a layer instead of two (the issue's "one call per layer";
        a call is 4-8 us of the engine's own on this project's development
        VM and 10.9 us on the H200 host by bench/engine_path.py, plus the
        controller's work around it). The
        guesses lose only the routing read-back's wait, during which the
        GPU computes the layer's attention and router: the guesses for
        this very layer are dropped (its acquire takes them at band 0),
        the later ones queue at their distance from this layer, and the
        hints keep the clock they were made at, so this layer's acquire
        evicts as a call made then would."""
        _, guesses, hints, clock = self._unsent
        self._unsent = None
        if layer in guesses:  # still scored (observe_and_guess filed them), not sent
            guesses = {t: g for t, g in guesses.items() if t != layer}
        # The guesses for this layer queued by earlier calls are cancelled
        # by this call, as ever (exchange's `stale`).
        return self.exchange(layer, experts, guesses, hints, stream=stream, timeout=timeout, now=clock,
                             acquire_ids=acquire_ids)

    def _send_unsent(self) -> None:
        """Sends the guesses and hints `speculate(with_next_acquire=True)`
        left when something other than the next acquire comes first."""
        layer, guesses, hints, clock = self._unsent
        self._unsent = None
        if not self.handle.closed:
            self._send_guesses(layer, guesses, hints, now=clock)

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
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        if self._predictor is None and self._trace is None and not self._pending:
            # Nothing to score, record, guess or hint: the next acquire goes
            # alone, the same engine call (on-demand's speculate phase took
            # 3.7-4.3 us a layer on the H200 host in a host-only BM5 replay).
            return
        layer, routed = deferred
        guesses, hints = self.observe_and_guess(layer, routed)
        if self.handle.closed:
            return
        if with_next_acquire:
            self._unsent = (layer, guesses, hints, self.clock)
        else:
            self._send_guesses(layer, guesses, hints)

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
        self._plan_now = self._plan_filed = None  # Note [Host-routed step pins]: the step numbers start again

    # -- reporting

    @_serialized
    def preload(self, slots: int, *, only_if_all: bool = False) -> int:
        """Note [Preload]
        A cache starts empty, so the first tokens after offloading copy on
        demand every expert they route to, and until every routed expert
        has come once a step still misses now and then (BM6 at a cache of
        every expert: 34 first copies and 24 of 64 steps off the steady
        path). This queues, at the least urgent band (every miss
        and guess goes first), as many of the registered experts as
        `slots` cache slots hold: all of them layer by layer where they
        fit, otherwise the first experts of every layer in turn, so each
        layer starts with the same share; with `only_if_all`, nothing
        unless all of them fit. Returns how many were queued."""
        chosen = sorted(self.prefetcher.registered_experts())  # layer by layer
        if len(chosen) > slots:
            if only_if_all:
                return 0
            # Each expert's rank in its layer: the layers' first experts,
            # then their second ones, and so on.
            rank: dict = {}
            ranked = []
            for layer, e in chosen:
                ranked.append((rank.get(layer, 0), layer, e))
                rank[layer] = rank.get(layer, 0) + 1
            chosen = [(layer, e) for _, layer, e in sorted(ranked)][:max(0, slots)]
        if not chosen:
            return 0
        ids = np.fromiter((self.prefetcher.tensor_id(layer, e) for layer, e in chosen), dtype=np.int64,
                          count=len(chosen))
        self.handle.prefetch_tensors(ids, priority=_MAX_BAND)
        self.preloaded += len(chosen)
        return len(chosen)

    def wait_preloaded(self, timeout: float | None = None, *, progress: bool = False) -> bool:
        """Note [Waiting for the preload]
        The preload (Note [Preload]) copies in the background, and a
        serving stack that takes requests at once competes with it: Qwen3-
        30B-A3B's 54 GiB take about a second on the H200's link, and BM6's
        generates right after offloading found 173 experts not yet copied
        there. This blocks until the engine has no copy queued or being
        issued (its counters balance: enqueued + on_demand == copies +
        copy_errors + cancelled, queue_depth 0) and then, on CUDA, until the
        issued copies have landed (the engine's copy streams are the
        device's: torch.cuda.synchronize). It waits for every copy, not the
        preload's alone: call it before serving. A failed copy counts as
        done (the acquirer of its expert gets CopyFailedError). Returns
        True when done, False when `timeout` seconds passed first (the
        copies go on). `progress`: print how many of the preloaded experts
        are resident while it waits, at once and then about once a second.
        After close() it raises HandleClosedError, as every engine call
        does."""
        if timeout is not None and not timeout >= 0:
            raise InvalidArgumentError(f"timeout must be None or >= 0 seconds, not {timeout!r}")
        start = time.monotonic()
        next_report = start  # the first report at once, then about once a second
        while True:
            s = self.handle.stats()
            issued = s["copies"] + s["copy_errors"] + s["cancelled"]
            if s["queue_depth"] == 0 and issued >= s["enqueued"] + s["on_demand"]:
                break
            now = time.monotonic()
            if timeout is not None and now - start >= timeout:
                return False
            if progress and now >= next_report:
                print(f"prefetch: preloading, {min(s['resident_count'], self.preloaded)} of {self.preloaded} "
                      "experts cached", flush=True)
                next_report = now + 1.0
            time.sleep(0.001)
        if self.handle.backend == "cuda":
            import torch

            for d in range(self.handle.num_devices):
                torch.cuda.synchronize(self.handle.arena(d).device)
        return True

    @_serialized
    def report(self) -> dict:
        """Hit rate, prediction precision and recall, bytes and copies moved,
        and the host time of the offloaded layers (us per layer: engine
        calls, the routing read-back, the rest). `predictors`: each
        predictor assigned, in order (the last 64), with its own precision
        and recall (the totals add up all of them)."""
        self.flush()
        s = self.handle.stats()
        hits = s["hits"] + self.pinned_hits
        acquired = s["hits"] + s["misses"] + self.pinned_hits + self.zero_copy_reads
        layers = self.layers_run
        return {
            "hit_rate": hits / acquired if acquired else None,
            "zero_copy_reads": self.zero_copy_reads,
            "path_switches": self.path_switches if self.sync_free else None,
            "sync_free_steps": self.sync_free_steps if self.sync_free else None,
            "zero_copy_bytes": self.zero_copy_reads * self.expert_bytes,
            "read_aheads": self.read_aheads,
            "preloaded": self.preloaded,
            "speculation_paused_layers": self.speculation_paused_layers,
            "steady_steps": self.steady_steps if self.sync_free else None,
            "step_pins": self.step_pins if self.sync_free or self.step_pins else None,
            "prediction_precision": self.prediction_hits / self.predicted_total if self.predicted_total else None,
            "prediction_recall": self.prediction_hits / self.actual_total if self.actual_total else None,
            # the two above add up every predictor assigned; each one's own:
            "predictors": [{"predictor": name, "prediction_precision": h / g if g else None,
                            "prediction_recall": h / r if r else None, "guessed": g, "routed": r}
                           for name, h, g, r in self._scores],
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
            "allreduce_us_per_layer": (self.comm_ns / layers / 1e3 if layers and self.expert_parallel is not None
                                       else None),
        }

    @_serialized
    def flush(self) -> None:
        super().flush()

    flush.__doc__ = SyncFreeDecode.flush.__doc__

    @_serialized
    def close(self) -> None:
        """Scores and records what is pending (nothing more is prefetched),
        then closes the engine handle, which frees its cache; the handle is
        closed even when the pending work raises (a predictor's error goes
        on to the caller)."""
        try:
            if self._routings:
                self.read_routings()  # the trace stays complete; nothing more is prefetched
            if self._planned:
                self._observe_planned()
            self._unsent = None  # nothing more is prefetched
            deferred, self._deferred = self._deferred, None
            if deferred is not None:  # scored and recorded; nothing more is prefetched
                self.observe(*deferred, {})
        finally:
            self._use = self._fetch = None
            self._held = None
            self._unsent = None
            self._deferred = None
            self._routings = []
            self._planned = []
            self.handle.close()
