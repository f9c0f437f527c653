"""Route-ahead predictors: while layer L routes, guess the experts of later
layers so the engine can copy them before they are needed.

A predictor returns guesses and next-use times; it never calls the engine.
The controller gathers what every predictor says for a layer and sends it
with the layer's acquire in one engine call (`PrefetchHandle.step`).

Every call a predictor receives starts with `ctx`, a read-only
`RoutingContext` (prefetch/offload/routing_context.py) of the offloaded
model, not the controller: `num_layers`, `num_experts`, `top_k`, `step`,
`clock`, `router_logits(layer, hidden)`, `router_topk(layer, hidden, k)`,
`honours_hints` (the eviction policy reads next-use hints) and
`holds_every_expert` (nothing is ever evicted). It can change nothing.

- `predict(ctx, step, layer, hidden)` runs before the layer's routing
  reaches the host. It returns {later_layer: experts}, where experts are a
  host sequence of ints or an integer tensor on the model's device (for
  example a router's top-k indices): device tensors are read back in the same
  device-to-host copy as the routing itself, so a prediction costs no sync
  of its own.
- `observe(ctx, step, layer, experts)` runs once the routed experts
  of `layer` are known on the host (a sorted int64 numpy array). It may
  return next-use hints, a list of (layer, experts, when), `when` one time
  for all or one per expert, on the controller's routing clock
  (`ctx.clock`); the engine's "next-use" eviction policy reads them.

A predictor whose guesses depend on this layer's routing sets
``reads_routing = True``: its `predict` then runs after `observe` and
returns host sequences only.

A predictor whose `observe` does nothing (returns None and keeps nothing)
sets ``observes = False``: the controller then does not call it, and a
sync-free decode step with no trace to record and no guess to score reads
its routings back without a pass over the layers (Note [Routings nobody
reads] in prefetch/offload/sync_free.py).

A predictor whose guesses are host data (``host_guesses = True``) may also
offer `plan(ctx, step, layer, experts, predict)`: the guesses and
hints of `predict` then `observe` in one go, hints as flat keys and times,
or None where it cannot tell them that way (Note [The oracle's plan]).
"""
from __future__ import annotations

import numpy as np

from prefetch._engine import NO_NEXT_USE, hint_times
from prefetch.errors import InvalidArgumentError

__all__ = ["RoutePredictor", "NextLayerGatePredictor", "TracePredictor", "OraclePredictor", "check_predictor"]


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


class RoutePredictor:
    """Base of route-ahead predictors: every member the controller reads,
    with the default it assumes where a predictor does not set it.
    Subclassing is optional (any object with `predict` and `observe` is a
    predictor); a subclass overrides what it offers. `ctx`, the first
    argument of every call, is the model's RoutingContext (read-only:
    its shape, `step`, `clock`, routers, `honours_hints`,
    `holds_every_expert`; see the module's docstring).

    - `predict(ctx, step, layer, hidden)`: required; {later layer:
      experts} (see the module's docstring).
    - `observe(ctx, step, layer, experts)`: next-use hints or None.
    - `reads_routing` (False): `predict` runs after `observe`, on the host.
    - `observes` (True): False says `observe` does nothing, so it is not
      called (Note [Routings nobody reads]).
    - `host_guesses` (False): guesses are host data, made after the
      routing's read-back in one go with `observe`.
    - `distinct_guesses` (False): guesses come without repeats and within
      the model's experts, so the controller takes them as they are.
    - `plan` (None): `plan(ctx, step, layer, experts, predict)`,
      guesses and hints in one go (Note [The oracle's plan]).
    - `step_reads` (None): `step_reads(step, num_layers, num_experts,
      ahead=True)`, every expert a whole step reads, for a predictor that
      knows it (the oracle): steps pinned at once (Note [Step pins]).
    - `start_hints` (None) and `observe_step` (None): `start_hints(ctx,
      step)` and `observe_step(ctx, step, clock0)`, a step plan's hints
      (Note [Host-routed step pins]).
    - `end_request()`: called when a request ends (controller.new_sequence);
      does nothing here.
    """

    reads_routing = False
    observes = True
    host_guesses = False
    distinct_guesses = False
    plan = None
    step_reads = None
    start_hints = None
    observe_step = None

    def predict(self, ctx, step: int, layer: int, hidden) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must implement predict()")

    def observe(self, ctx, step: int, layer: int, experts: np.ndarray) -> list | None:
        return None

    def end_request(self) -> None:
        return None


class NextLayerGatePredictor(RoutePredictor):
    """The router of layer L+d applied to layer L's hidden state (the MoE
    input), for d = 1..distance: hidden states change slowly across layers, so
    the next router's choice on this layer's input is a good guess. The
    guess stays on the device until the routing's own read-back."""

    observes = False  # observe does nothing: the controller skips it

    def __init__(self, distance: int = 1, extra_per_token: int = 0):
        if distance < 1:
            raise InvalidArgumentError("distance must be >= 1")
        if extra_per_token < 0:
            raise InvalidArgumentError("extra_per_token must be >= 0")
        self.distance = distance
        self.extra_per_token = extra_per_token  # prefetch top_k + extra per token

    def predict(self, ctx, step, layer, hidden):
        out = {}
        for d in range(1, self.distance + 1):
            target = layer + d
            if target >= ctx.num_layers:
                break
            out[target] = ctx.router_topk(target, hidden, ctx.top_k + self.extra_per_token)
        return out

    def observe(self, ctx, step, layer, experts):
        return None


class TracePredictor(RoutePredictor):
    """MoE-Infinity's activation-matrix idea: remember each past request's
    expert activation matrix (layers x experts, counts); during a request,
    match its partial matrix (layers seen so far) against the past ones by
    cosine similarity and prefetch, for the next `distance` layers, the
    experts the closest past request used most there."""

    reads_routing = True  # matches on the layers seen so far, this one included

    def __init__(self, distance: int = 2, max_experts: int | None = None, history: int = 256):
        if distance < 1:
            raise InvalidArgumentError("distance must be >= 1")
        if max_experts is not None and max_experts < 1:
            raise InvalidArgumentError(f"max_experts must be None (twice top_k) or >= 1, got {max_experts!r}")
        if history < 1:
            raise InvalidArgumentError(f"history must be >= 1 (past requests kept), got {history!r}")
        self.distance = distance
        self.max_experts = max_experts
        self.history = history
        self.past: list[np.ndarray] = []
        self.current: np.ndarray | None = None

    def begin_request(self, ctx) -> None:
        self.current = np.zeros((ctx.num_layers, ctx.num_experts), dtype=np.float32)

    def end_request(self) -> None:
        if self.current is not None and self.current.any():
            self.past.append(self.current)
            self.past = self.past[-self.history :]
        self.current = None

    def observe(self, ctx, step, layer, experts):
        if self.current is None:
            self.begin_request(ctx)
        self.current[layer, experts] += 1
        return None

    def predict(self, ctx, step, layer, hidden):
        if not self.past:
            return {}
        if self.current is None:
            self.begin_request(ctx)
        seen = self.current[: layer + 1].ravel()
        best, best_score = None, -1.0
        norm = float(np.linalg.norm(seen)) or 1.0
        for eam in self.past:
            part = eam[: layer + 1].ravel()
            score = float(part @ seen) / ((float(np.linalg.norm(part)) or 1.0) * norm)
            if score > best_score:
                best, best_score = eam, score
        out = {}
        k = self.max_experts or ctx.top_k * 2
        for d in range(1, self.distance + 1):
            target = layer + d
            if target >= ctx.num_layers:
                break
            row = best[target]
            order = np.argsort(-row, kind="stable")
            out[target] = [int(e) for e in order[:k] if row[e] > 0]
        return out


class OraclePredictor(RoutePredictor):
    """Replays a recorded routing trace: predicts exactly what step s, layer
    L+d will use (the ceiling of any predictor). With hints it also says
    when each expert will next be read, on the controller's routing clock,
    so a handle made with ``eviction_policy="next-use"`` evicts by Belady's
    rule. ``hints=None`` (default) gives them only to such a handle (other
    policies ignore hints, so they would cost host time for nothing), and
    only while its cache cannot hold every expert at once (Note [No hints
    when everything fits]); True or False forces it.

    On a host-routed model (OffloadedMoEBlock, BM5) the guesses are made
    one layer late (Note [Speculation after launch] in
    prefetch/offload/deferred.py): there a distance of d prefetches d - 1 layers
    ahead, and the default of 1 prefetches nothing in time
    (a CPU model of the link under BM5's gpt-oss replay: 1.87x the IO floor
    at distance 1, as on-demand's 1.91x; 1.43x at 2; 1.06x at 4).

    The trace is turned into arrays once: per (step, layer) its experts, and
    per layer every read sorted by (expert, step). A layer's predict and
    observe are then a few
    array operations, not a Python loop over its experts: they run once per
    MoE layer of every token (BM6 with the oracle on OLMoE shapes, H200,
    before the tables: 172 us of host time per layer against 92 without a
    predictor)."""

    host_guesses = True  # predict returns host arrays (the sync-free decode path uses them)
    distinct_guesses = True  # ... already sorted and distinct: the controller skips its pass over them

    def __init__(self, trace, distance: int = 1, hints: bool | None = None):
        if distance < 1:
            raise InvalidArgumentError("distance must be >= 1")
        self.trace = trace
        self.distance = distance
        self.hints = hints
        steps, layers = len(trace.steps), trace.num_layers
        self._experts = [[np.unique(np.asarray(trace.steps[s][la], dtype=np.int64)) for la in range(layers)]
                         for s in range(steps)]
        # The controller takes these guesses as they are (distinct_guesses):
        # an id out of range would index another expert's tensor id.
        for s, row in enumerate(self._experts):
            for la, experts in enumerate(row):
                if experts.shape[0] and (experts[0] < 0 or experts[-1] >= trace.num_experts):
                    raise InvalidArgumentError(f"trace step {s}, layer {la}: expert ids must be in "
                                               f"0..{trace.num_experts - 1}, got {experts.tolist()}")
        # Per layer, every read as the key expert * stride + step, sorted: the
        # next read of e after step s is the first key above e * stride + s,
        # if it is still e's (memory: one int64 per read of the trace).
        # A sentinel past every key ends each array, so a search never runs off it.
        self._stride = steps + 1
        end = np.array([np.iinfo(np.int64).max], dtype=np.int64)
        self._reads = [np.concatenate([np.sort(np.concatenate(
            [self._experts[s][layer] * self._stride + s for s in range(steps)] or [end[:0]])), end])
            for layer in range(layers)]
        # Per (step, layer), how many layers ahead each of its experts is
        # read next, and which are never read again: observe's hint for a
        # routing that is the trace's own (the usual case) is then an add
        # (numpy's where costs more than the rest of observe on 6 experts).
        self._ahead = [[self._layers_ahead(s, la, self._experts[s][la], layers) for la in range(layers)]
                       for s in range(steps)]
        self._routed = None  # (step, layer, experts, clock) of the last routing
        self._hints: list = []  # (layer, experts, one time or an array) not yet returned
        self._plans = [[self._plan_arrays(s, la) for la in range(layers)] for s in range(steps)]
        self._primed = False  # this request's first reads were hinted (Note [Hints at a request's start])
        self._step_reads: dict = {}  # (step, experts, ahead) -> flat reads (step_reads)
        # Per step, its reads as (layers, experts, reads in its first
        # `distance` layers): step_reads' flat indices in one array op (a
        # concatenation of a step's layers was 70 us of a host-routed step
        # plan's first layer).
        self._step_cat = []
        for row in self._experts:
            counts = [e.shape[0] for e in row]
            self._step_cat.append((np.repeat(np.arange(layers, dtype=np.int64), counts),
                                   np.concatenate(row) if row else np.empty(0, dtype=np.int64),
                                   sum(counts[: distance])))
        self._step_next: dict = {}  # step -> its reads' next reads (observe_step)

    def step_reads(self, step: int, num_layers: int, num_experts: int, ahead: bool = True):
        """Every (layer, expert) step `step` of the trace reads, and with
        `ahead` the next step's first `distance` layers (what this step's
        guesses would name), as flat indices layer * num_experts + expert
        of a model of `num_layers` x `num_experts` (sorted without
        `ahead`); None past the trace or for a trace of another shape. The
        sync-free path checks them against its pins at a step's first
        layer (Note [Steady pins]) and pins and fetches by them (Note
        [Step pins] in prefetch/offload/sync_free.py). Made once per step; the
        array is shared, and read-only."""
        if (not 0 <= step < len(self._experts) or self.trace.num_layers != num_layers
                or self.trace.num_experts > num_experts):
            return None
        key = (step, num_experts, ahead)
        flat = self._step_reads.get(key)
        if flat is None:
            layer_of, experts, _ = self._step_cat[step]
            flat = layer_of * num_experts + experts
            if ahead and step + 1 < len(self._experts):
                layer_of, experts, first = self._step_cat[step + 1]
                flat = np.concatenate((flat, layer_of[:first] * num_experts + experts[:first]))
            flat.flags.writeable = False
            self._step_reads[key] = flat
        return flat

    def start_hints(self, ctx, step: int) -> list:
        """Note [Host-routed step pins] in prefetch/offload/step_plan.py: a step
        plan at the first step of a request makes no `predict` call, so the
        request's first reads are hinted here instead (Note [Hints at a
        request's start]): [(layer, experts, times)], or [] when they were
        hinted already or hints are off."""
        if self._primed or not self._sends_hints(ctx):
            return []
        self._primed = True
        return self._first_reads(ctx, step, 0)

    def observe_step(self, ctx, step: int, clock0: int):
        """Note [Host-routed step pins] in prefetch/offload/step_plan.py: for step
        `step` of a model of the trace's shape, whose every layer routed as
        the trace says (layer l at clock `clock0` + l) without a `predict`
        or `observe` call, each read's next read as hints (keys layer *
        experts + expert, times; NO_NEXT_USE where the trace reads it no
        more), or None without hints; the predictor's state moves as after
        the step's last `observe`. One array op a step instead of an
        `observe` a layer."""
        layers = self.trace.num_layers
        self._hints = []
        self._routed = (step, layers - 1, self._experts[step][layers - 1], clock0 + layers - 1)
        if not self._sends_hints(ctx):
            return None
        got = self._step_next.get(step)
        if got is None:
            num_experts = self.trace.num_experts
            keys, offset, never, start = [], [], [], 0
            for layer in range(layers):
                experts = self._experts[step][layer]
                ahead, none = self._ahead[step][layer]
                keys.append(layer * num_experts + experts)
                offset.append(ahead + layer)
                if none is not None:
                    never.append(none + start)
                start += experts.shape[0]
            got = (np.concatenate(keys), np.concatenate(offset), np.concatenate(never) if never else None)
            self._step_next[step] = got
        keys, offset, never = got
        return keys, hint_times(offset, clock0, never, NO_NEXT_USE)

    def _plan_arrays(self, step: int, layer: int):
        """Note [The oracle's plan]: what `plan` returns for (step, layer),
        made once: (guesses, hint keys and time offsets without the
        guesses' reads, the same with them, positions of the hints that
        are NO_NEXT_USE). A key is layer * experts + expert of the trace's
        shape; a time is the offset plus the routing's clock."""
        layers, num_experts = self.trace.num_layers, self.trace.num_experts
        flat, offset, never = [], [], None
        prev_step, prev_layer = (step, layer - 1) if layer else (step - 1, layers - 1)
        if prev_step >= 0:  # the predecessor's next reads; it routed one clock tick ago
            prev = self._experts[prev_step][prev_layer]
            ahead, never = self._ahead[prev_step][prev_layer]
            flat.append(prev_layer * num_experts + prev)
            offset.append(ahead - 1)
        experts = self._experts[step][layer]
        flat.append(layer * num_experts + experts)  # read now
        offset.append(np.zeros(experts.shape[0], dtype=np.int64))
        observed = (np.concatenate(flat), np.concatenate(offset))
        guesses = {}
        for d, target, guess in self._guesses(step, layer, layers):
            guesses[target] = guess
            flat.append(target * num_experts + guess)
            offset.append(np.full(guess.shape[0], d, dtype=np.int64))
        predicted = (np.concatenate(flat), np.concatenate(offset))
        return guesses, observed, predicted, never

    def plan(self, ctx, step: int, layer: int, experts: np.ndarray, predict: bool):
        """Note [The oracle's plan]
        `predict` and `observe` make a layer's guesses and hints from the
        trace with a dozen array operations and a list of hint tuples the
        controller turns into tensor ids, 60-110 us of host time per layer
        on the H200 host (BM5's gemma-4 replay: the oracle's
        speculation took 107 us a layer of a step the host's work decides).
        Yet when the model routes as the trace says, and the last routing
        was the trace's one clock tick before, all of it is known when the
        trace is loaded. `plan` returns it, made once per (step, layer):
        (guesses {layer: experts} as `predict` would return them, or {}
        when `predict` is False; hint keys layer * num_experts + expert;
        their times on the controller's clock), the same as `predict` then
        `observe` would give, in one array each (None, None without
        hints). It returns None when the plan does not hold: another
        routing, another previous routing, the request's first hints not
        sent yet, a model of another shape; the controller then calls
        `predict` and `observe`. The predictor's state moves as theirs
        would."""
        if (ctx.num_layers != self.trace.num_layers or ctx.num_experts != self.trace.num_experts
                or not 0 <= step < len(self._plans) or self._hints):
            return None
        hints = self._sends_hints(ctx)
        now = ctx.clock
        if hints:
            if not self._primed:
                return None
            prev = self._routed
            if prev is None and (step or layer):
                return None
            if prev is not None:
                prev_step, prev_layer = (step, layer - 1) if layer else (step - 1, self.trace.num_layers - 1)
                if (prev[0] != prev_step or prev[1] != prev_layer or prev[3] != now - 1
                        or prev[2].tobytes() != self._experts[prev_step][prev_layer].tobytes()):
                    return None
        ours = self._experts[step][layer]
        if experts.tobytes() != ours.tobytes():
            return None
        guesses, observed, predicted, never = self._plans[step][layer]
        self._routed = (step, layer, ours, now)
        if not predict:
            guesses = {}
        if not hints:
            return guesses, None, None
        keys, offset = predicted if predict else observed
        return guesses, keys, hint_times(offset, now, never, NO_NEXT_USE)

    def _sends_hints(self, ctx) -> bool:
        """Note [No hints when everything fits]
        Hints tell a next-use handle which expert to evict. When each
        device's cache holds every registered expert at once, nothing is
        ever evicted and they change nothing, yet making and sending them
        was the oracle's largest host cost with every expert cached: the
        oracle on a next-use handle over 48 tokens (tiny OLMoE, host
        backend, this project's 2-core VM) took 26.2 us of host time a layer
        with hints, 17.6 without them (this rule), against 17.8 for the
        oracle on an lru handle and 14.8 with no predictor; in BM6 on the
        H200 the oracle row took 68-77 us a layer against 40-54 for the
        others.
        So with ``hints=None`` they go only to a next-use handle that may
        evict. The check is the prefetcher's, cached per registration
        (``holds_every_expert``, which the routing context passes on); the
        guesses are not affected."""
        if self.hints is None:
            return ctx.honours_hints and not ctx.holds_every_expert
        return self.hints

    def end_request(self) -> None:
        """The controller starts a new request (new_sequence): its first
        predict hints every expert's first read again."""
        self._primed = False

    def predict(self, ctx, step, layer, hidden):
        if self.trace.num_experts > ctx.num_experts:
            # The controller takes these guesses as they are (distinct_guesses):
            # an id past the model's experts has no tensor id.
            raise InvalidArgumentError(
                f"OraclePredictor: its trace has {self.trace.num_experts} experts a layer, the model "
                f"{ctx.num_experts}: a trace recorded on another model")
        out = {}
        hints = self._sends_hints(ctx)
        if hints and not self._primed:
            self._primed = True
            self._hints.extend(self._first_reads(ctx, step, layer))
        for d, target, experts in self._guesses(step, layer, ctx.num_layers):
            out[target] = experts
            if hints:  # read d layers from now
                self._hints.append((target, experts, ctx.clock + d))
        return out

    def _guesses(self, step: int, layer: int, num_layers: int):
        """(d, target layer, its experts) for the layers d = 1..distance
        after (step, layer) of a model of `num_layers` that the trace
        routes to at least one expert (`predict`'s guesses; the plan's)."""
        for d in range(1, self.distance + 1):
            target, target_step = layer + d, step
            if target >= num_layers:
                target -= num_layers
                target_step += 1
            if not 0 <= target_step < len(self._experts) or target >= len(self._experts[target_step]):
                continue
            experts = self._experts[target_step][target]
            if experts.shape[0]:
                yield d, target, experts

    def observe(self, ctx, step, layer, experts):
        if not self._sends_hints(ctx):
            self._hints.clear()
            return None
        now = ctx.clock
        experts = np.asarray(experts, dtype=np.int64)
        # The experts routed now are read now: their hint moves on only once
        # the next layer routes (they are released by then), or a prefetch
        # for the next layer could evict them before their acquire.
        out = [self._next_reads(ctx, *self._routed)] if self._routed is not None else []
        out.append((layer, experts, now))
        out.extend(self._hints)  # later layers' reads, from this layer's predict
        self._hints = []
        self._routed = (step, layer, experts, now)
        return out

    def _first_reads(self, ctx, step, layer) -> list:
        """Note [Hints at a request's start]
        The experts resident when a request starts were left by another one
        (a warm-up, the last request): their hints have expired, so the
        next-use policy ranks them before every valid hint, in the order
        they were hinted, not by when this request reads them. A prefill
        reads nearly every expert, and the oracle's guesses, two layers
        ahead, can evict residents the next layers were about to read. In
        BM6 on the H200 the oracle's time to first token was 1.22-1.24x its
        floor against on-demand's 1.07x; on a CPU proxy of the prefill's
        copies the oracle's prefill copied 814-986 experts
        over seven runs against on-demand's 875, and 881-887 or fewer with
        these hints (the counts move with the copy workers' timing). So the
        first predict of a request hints, for every (layer, expert) the trace
        reads from (step, layer) on, the time of its first read there: with
        those, Belady's rule keeps what is read soonest (with every prefetch
        landed before its layer's acquire, 41 copies against 47:
        test_a_request_start_hints_keep_the_residents_read_soonest). One hint
        call of up to layers x experts ids, once a request. [(layer, experts,
        times)]."""
        num_layers = ctx.num_layers
        if num_layers != len(self._reads) or not 0 <= step < self._stride - 1:
            return []
        out = []
        stride = self._stride
        experts = np.arange(ctx.num_experts, dtype=np.int64)
        # Not _layers_ahead(first - 1, ...): at step 0 its key for expert 0
        # is -1, and the sentinel minus -1 overflows int64 on a layer the
        # trace never routes. Here the found key is compared, not subtracted.
        for lyr in range(num_layers):
            first = step if lyr >= layer else step + 1  # this step's earlier layers have read already
            reads = self._reads[lyr]
            keys = experts * stride + first
            found = reads[np.searchsorted(reads, keys, side="left")]
            mine = found < (experts + 1) * stride  # still this expert's read (the sentinel is not)
            if mine.any():
                at = found[mine] - experts[mine] * stride
                out.append((lyr, experts[mine], ctx.clock + (at - step) * num_layers + (lyr - layer)))
        return out

    def _layers_ahead(self, step, layer, experts, num_layers):
        """Per expert read at (step, layer): (layers until its next read
        there, 0 where there is none in the trace; positions of those)."""
        stride = self._stride
        reads = self._reads[layer]
        key = experts * stride + step
        # The first key above (e, step): e's next read if it is still e's,
        # that is if it lies less than a stride (minus step) above.
        ahead = reads[np.searchsorted(reads, key, side="right")] - key
        never = np.flatnonzero(ahead >= stride - step)
        return np.where(ahead < stride - step, ahead * num_layers, 0), (never if never.shape[0] else None)

    def _next_reads(self, ctx, step, layer, experts, at):
        """(layer, experts, times): the next read of experts read at clock
        `at` (step, layer); NO_NEXT_USE = never again in the trace."""
        if layer >= len(self._reads) or not 0 <= step < self._stride - 1:
            return layer, experts, np.full(experts.shape[0], NO_NEXT_USE, dtype=np.int64)
        ours = self._experts[step][layer]
        if ctx.num_layers == len(self._reads) and experts.tobytes() == ours.tobytes():
            ahead, never = self._ahead[step][layer]
        else:  # routed other than the trace says: search
            ahead, never = self._layers_ahead(step, layer, experts, ctx.num_layers)
        return layer, experts, hint_times(ahead, at, never, NO_NEXT_USE)
