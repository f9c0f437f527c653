"""Step pins on the host-routed path (Note [Host-routed step pins]): the
part of OffloadController for callers that route on the host and call
`route_and_acquire` once a layer (BM5's decoder, OffloadedMoEBlock)."""
from __future__ import annotations

import time

import numpy as np

from prefetch._engine import plan_pins, plan_rows, take_ids

__all__ = ["HostStepPlan"]

# -- Note [Host-routed step pins]
# On a host-routed layer (the routing read back, then the layer's experts
# acquired, then its compute launched) every microsecond of host work
# between the read-back and the launch is added to the step, and at batch 1
# the host's work is the step: BM5's replay of the gemma-4 trace on the
# H200 host took 436 us a layer with every expert resident and
# 666 us with the oracle, whose copies were nearly all in time (hit 0.97):
# its acquire cost 90-100 us a layer more than the resident gather (the
# engine call 39-45 of it) and its predictor 24 more. Yet the oracle knows
# at a step's first layer what every layer of the step reads and what the
# next step reads, as on the sync-free path (Note [Step pins] in
# prefetch/offload/sync_free.py). So, at layer 0, where the predictor gives both
# (`step_reads`) and the cache has room, one engine call releases what is
# held, reports the last step's uses, sends the hints, pins every resident
# expert this step reads in every layer (no wait, no fetch) and queues the
# next step's reads. Each layer of the step then looks its routed experts
# up in the pins: when all are pinned it makes no engine call, and its
# predictor part (scoring, trace, the predictor's observe and hints) is
# left to the next step's first layer, which does it for the whole step
# before its call. A routed expert that is not pinned (not resident at
# layer 0, or not in the plan) is acquired as on the layer-by-layer path:
# an engine call for those alone, which waits for their copies and
# releases the last such call's experts; the pins stay. The last layer's
# `release_held` releases them all. The room: this step's reads and the
# next step's fit the cache together (else the next step's copies would
# be declined), and beside the pins a layer's worst case of experts not
# pinned (all of its experts) still finds slots, so an acquire never
# waits for a release that only the end of the step would make. Not with
# expert parallel, not on a handle of several devices (the rows carry one
# device), and not for a call taken in pieces. A plan the model does not
# follow scores low (the next step's reads are filed as the predictor's
# guesses), speculation pauses, and a paused predictor gets no plan.


class HostStepPlan:
    """Owned by an OffloadController (its `plan`): the host-routed path's
    step plan. `applies(layer, stream)` says whether a call may go by a
    plan and `route` takes it (None: the layer goes the usual way);
    `observe_planned` does the planned layers' predictor part;
    `pinned_step` is the planned step while its pins are held, `end` says
    they were released; `planned` holds the layers not observed yet;
    `forget` and `new_request` drop what the last plan filed. Uses the
    sync-free part's `step_plan`, `pin_call`, `hints_to_send` and
    `expect_step`."""

    def __init__(self, state, *, acct):
        self._s = state
        self._acct = acct
        self._routing = self._syncd = self._calls = self._spec = None  # wire
        self.pinned_step = None  # the step whose plan's pins are held (None: no plan)
        self._plan_out = None  # flat [layers * experts] slot offsets of the pins, -1: not pinned
        self._plan_buf = None  # the pin call's answers
        self._plan_pins = None  # tensor ids pinned by the plan's call
        self._plan_extra = None  # tensor ids the last call for unpinned experts acquired
        self.planned: list = []  # (step, layer, routed experts, pinned ids) not observed yet
        # (step, clock at its layer 0, its planned reads as sorted flat
        # indices, whether the last plan filed them as its guesses)
        self._plan_now = None
        self._plan_filed = None  # (step, flat reads): what the last plan filed as the next step's guesses
        self._plan_hints = None  # (tensor ids, times): the planned step's hints, for the next call
        self.host_step_pins = 0  # host-routed steps taken by the plan
        self._plan_bounds = None  # per layer l, its reads in the plan: _plan_now's reads[bounds[l] : bounds[l + 1]]
        self._plan_kept = False  # the planned step's layers so far came in order, each routed as planned
        self._plan_whole_step = False  # ... and each found all its experts pinned
        self._plan_used = None  # the tensor ids the plan pinned (released with the step; reported as used)

    def wire(self, *, routing, sync, calls, speculation) -> None:
        """The sibling parts this one calls (made after it, or calling it)."""
        self._routing, self._syncd, self._calls, self._spec = routing, sync, calls, speculation

    def applies(self, layer: int, stream) -> bool:
        """Whether this call may go by a step plan: a step already planned
        (the same stream), or layer 0 with a predictor that knows steps."""
        st = self._s
        if layer:
            return self.pinned_step is not None and stream == st.held_stream
        return (getattr(st.predictor, "step_reads", None) is not None and st.local is None
                and st.cache_slots > 0 and self._s.handle.num_devices == 1)

    def route(self, layer: int, experts, stream, timeout: float, first: int | None):
        """route_and_acquire by the step plan; None (nothing done, the
        layer goes the usual way) where there is none."""
        st = self._s
        routed, ids = self._calls.routed_ids(layer, experts)
        pieces = first is not None and first < routed.shape[0]
        if layer == 0:
            if self.planned:
                self.observe_planned()
            plan = None if pieces else self._syncd.step_plan(st.step + 1 if st.seen_layer0 else st.step, host=True)
            if plan is None:
                self.send_late(stream)
                return None
            if self._spec.unsent is not None:  # the last layer-by-layer call's guesses
                self._spec.send_unsent()
            self._routing.begin_layer(0)
            self._pin_plan(plan[0], plan[1], stream)
        elif pieces:  # a planned step's layer larger than the cache: the pins go, the layer goes the usual way
            self._calls.release_held(stream)
            return None
        else:
            self._routing.begin_layer(layer)
        n = routed.shape[0]
        where = np.empty((n, 2), dtype=np.int64)
        n_pinned = plan_rows(self._plan_out, layer * st.num_experts, routed, where)
        self._acct.pinned_hits += n_pinned
        a, b = self._plan_bounds[layer], self._plan_bounds[layer + 1]
        if self._plan_kept:
            # Pinned ones are planned ones: all n pinned and n planned is
            # the plan's set (_followed_plan).
            self._plan_kept = layer == len(self.planned) and n == b - a and (
                n_pinned == n or np.array_equal(routed, self._plan_now[2][a:b] - layer * st.num_experts))
        if n_pinned == n:
            self.planned.append((st.step, layer, routed, ids))
            return routed, where
        self._plan_whole_step = False
        pinned = where[:, 0] >= 0
        self.planned.append((st.step, layer, routed, ids[pinned]))
        where[~pinned] = self._acquire_unpinned(ids[~pinned], stream, timeout)
        return routed, where

    def _pin_plan(self, now: np.ndarray, nxt: np.ndarray, stream) -> None:
        """The plan's one engine call at layer 0: release what is held,
        report uses, send hints, pin this step's resident reads, queue the
        next step's reads (and drop the guesses earlier layer-by-layer
        calls left queued)."""
        st = self._s
        table = self._routing.flat_table()
        pin = take_ids(table, now, True)  # now: sorted, distinct (plan_pins reads its layers' bounds off it)
        n = st.num_layers * st.num_experts
        if self._plan_out is None or self._plan_out.shape[0] != n:
            self._plan_out = np.full(n, -1, dtype=np.int64)
            self._plan_buf = np.empty(n, dtype=np.int64)
        buf = self._plan_buf[: pin.shape[0]]
        fetch = take_ids(table, nxt) if nxt.shape[0] else None
        if st.queued_guess:
            stale = [st.ids(t, g) for t, g in st.queued_guess.items()]
            st.queued_guess.clear()
            self._cancel_queued(np.concatenate(stale), stream)
        start = getattr(st.predictor, "start_hints", None)
        if start is not None:  # a request's first step: its first reads (Note [Hints at a request's start])
            st.late_hints.extend(start(self._routing.context, st.step))
        hint_ids, hint_when, had_hints = self._plan_hint_arrays()
        self._syncd.pin_call(pin, buf, st.use, fetch, hint_ids, hint_when, had_hints, stream)
        self._plan_hints = None
        held, self._plan_bounds = plan_pins(now, buf, pin, self._plan_out, st.num_layers, st.num_experts)
        self._plan_pins = self._plan_used = held
        self._plan_extra = None
        st.held = held if held.shape[0] else None
        self.pinned_step = st.step
        self._acct.step_pins += 1
        self.host_step_pins += 1
        # What the last plan filed as this step's guesses: scored at once
        # when it is this plan's reads (observe_planned).
        filed = self._plan_filed
        same = filed is not None and filed[0] == st.step and (filed[1] is now or np.array_equal(filed[1], now))
        self._plan_now = (st.step, st.clock, now, same)
        self._plan_kept = self._plan_whole_step = True
        self._plan_filed = (st.step + 1, nxt)
        self._syncd.expect_step(st.step + 1, nxt)

    def _acquire_unpinned(self, missing: np.ndarray, stream, timeout: float) -> np.ndarray:
        """A planned layer's routed experts that the plan did not pin,
        acquired in one engine call that releases the last such call's; the
        pins stay held."""
        st = self._s
        extra = self._plan_extra
        pins = self._plan_pins
        t0 = time.perf_counter_ns()
        try:
            where = self._s.handle.exchange(missing, release=extra, stream=stream, timeout=timeout)
        except (ValueError, KeyError, TypeError, OverflowError):
            raise  # refused before anything changed: still held as it was
        except BaseException:
            # The release ran; the acquire did not: the pins alone are held.
            self._plan_extra = None
            st.held = pins if pins is not None and pins.shape[0] else None
            raise
        finally:
            self._acct.engine_ns += time.perf_counter_ns() - t0
        self._plan_extra = missing
        st.held = missing if pins is None or not pins.shape[0] else np.concatenate((pins, missing))
        return where

    def forget(self) -> None:
        """Another predictor starts (Note [A predictor replaced]): the
        half-done step is no longer taken as followed, and what the last
        plan filed is not scored against it."""
        self._plan_filed = None
        self._plan_kept = False

    def new_request(self) -> None:
        """The step numbers start again (new_sequence)."""
        self._plan_now = self._plan_filed = None

    def close(self) -> None:
        """Observes what is pending; nothing more is prefetched."""
        if self.planned:
            self.observe_planned()

    def end(self) -> None:
        """The planned step's pins were released (with what else was held)."""
        self.pinned_step = self._plan_pins = self._plan_extra = None

    def _cancel_queued(self, cancel: np.ndarray, stream) -> None:
        t0 = time.perf_counter_ns()
        try:
            self._s.handle.exchange(cancel=cancel, stream=stream)
        finally:
            self._acct.engine_ns += time.perf_counter_ns() - t0

    def observe_planned(self) -> None:
        """The planned layers' predictor part, for a whole step at once:
        scoring, trace, the predictor's hints (they go with the next engine
        call), and the uses of the pinned experts they read. A step whose
        every layer routed as planned, with a predictor that can say so
        (`observe_step`), takes one pass over the step; any other, an
        `observe` a layer."""
        st = self._s
        planned, self.planned = self.planned, []
        step = self._followed_plan(planned)
        if step is not None and self._plan_whole_step:
            use = self._plan_used  # every read pinned, in the pins' order: the layers' reads in turn
        else:
            uses = [used for _, _, _, used in planned if used.shape[0]]
            use = np.concatenate(uses) if uses else None
        if use is not None and use.shape[0]:
            st.use = use if st.use is None else np.concatenate((st.use, use))
        if step is None:
            for step, layer, routed, _ in planned:
                _, hints = self._routing.observe(layer, routed, {}, step=step)
                if hints:
                    st.late_hints.extend(hints)
            return
        if self._plan_now[3]:
            # The last plan's guesses for this step were this plan's reads,
            # and the step read them: each layer's all hit.
            bounds = self._plan_bounds
            taken = st.pending.take_step(step, st.num_layers)
            for layer in range(st.num_layers):
                if taken[layer]:
                    count = bounds[layer + 1] - bounds[layer]
                    self._routing.count_score(count, count, count)
            if st.trace is not None:
                for _, layer, routed, _ in planned:
                    st.trace.add(step, layer, routed)
        else:
            for _, layer, routed, _ in planned:
                self._routing.score(step, layer, routed)
        got = st.predictor.observe_step(self._routing.context, step, self._plan_now[1])
        if got is not None:
            self._plan_hints = (take_ids(self._routing.flat_table(), got[0]), got[1])

    def _followed_plan(self, planned: list):
        """The step of `planned` when it holds every layer of the planned
        step, in order, each routed as planned (`_plan_kept`, kept as the
        layers route), and the predictor has `observe_step`; else None."""
        st = self._s
        plan = self._plan_now
        if (plan is None or not self._plan_kept or len(planned) != st.num_layers or planned[0][0] != plan[0]
                or getattr(st.predictor, "observe_step", None) is None):
            return None
        return plan[0]

    def _plan_hint_arrays(self):
        """(tensor ids, times, whether any) of the hints to send: the
        planned step's (`observe_step`) and the others (`hints_to_send`);
        the latter go last, so they win for an id named twice."""
        hint_ids, hint_when, had_hints = self._syncd.hints_to_send()
        if self._plan_hints is None:
            return hint_ids, hint_when, had_hints
        ids, when = self._plan_hints
        if had_hints and hint_ids is not None:
            ids, when = np.concatenate((ids, hint_ids)), np.concatenate((when, hint_when))
        return ids, when, True

    def send_late(self, stream) -> None:
        """Uses and hints left by planned steps, for a step that goes
        layer by layer: sent in an engine call of their own."""
        st = self._s
        hint_ids, hint_when, had_hints = self._plan_hint_arrays()
        self._plan_hints = None
        use = st.use
        if use is None and not had_hints:
            return
        t0 = time.perf_counter_ns()
        try:
            st.handle.exchange(use=use, hint_ids=hint_ids, hint_when=hint_when, now=st.clock if had_hints else None,
                               stream=stream)
        finally:
            self._acct.engine_ns += time.perf_counter_ns() - t0
        st.use = None
        if had_hints:
            st.late_hints = []
