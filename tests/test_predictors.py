"""OraclePredictor against a brute-force reading of its trace: the experts
it predicts and the next-use times of its hints (Belady's rule for the
engine's "next-use" policy rests on them)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefetch._engine import NO_NEXT_USE

from prefetch.integration import OraclePredictor, RoutingTrace


class _Controller:
    """Stands in for the RoutingContext a predictor is given: a next-use
    handle whose cache does not hold every expert."""

    honours_hints = True
    holds_every_expert = False

    def __init__(self, num_layers, num_experts=8):
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.clock = -1


def _next_step(steps, layer, expert, after):
    return next((t for t in range(after + 1, len(steps)) if expert in steps[t][layer]), None)


traces = st.integers(1, 4).flatmap(lambda layers: st.integers(1, 7).flatmap(lambda experts: st.tuples(
    st.just(layers), st.just(experts),
    st.lists(st.lists(st.sets(st.integers(0, experts - 1), max_size=3), min_size=layers, max_size=layers),
             min_size=1, max_size=8))))


@settings(max_examples=150, deadline=None)
@given(traces, st.integers(1, 3), st.booleans())
def test_oracle_predictions_and_hints_match_the_trace(spec, distance, perturb):
    # perturb: every other layer routes to other experts than the trace says
    # (expert 0 toggled), so the hints of those routings are searched for,
    # not read from the oracle's table of the trace's own routings.
    layers, experts, raw = spec
    distance = min(distance, layers)  # a guess reaches at most one step ahead
    steps = [[sorted(e) for e in step] for step in raw]
    oracle = OraclePredictor(RoutingTrace(layers, experts, steps), distance=distance)
    ctl = _Controller(layers, experts)
    last = None  # (step, layer, experts, clock) routed before this layer
    for step in range(len(steps) + 1):  # one step past the trace: nothing predicted, no next use
        for layer in range(layers):
            ctl.clock += 1
            guesses = oracle.predict(ctl, step, layer, None)
            want = {}
            for d in range(1, distance + 1):
                target, target_step = (layer + d) % layers, step + (layer + d) // layers
                if target_step < len(steps) and steps[target_step][target]:
                    want.setdefault(target, steps[target_step][target])
            assert {t: g.tolist() for t, g in guesses.items()} == want
            routed = steps[step][layer] if step < len(steps) else [0]
            if perturb and (step + layer) % 2:
                routed = sorted(set(routed) ^ {0})
            routed = np.array(routed, dtype=np.int64)
            hints = oracle.observe(ctl, step, layer, routed)
            if last is not None:  # the previous routing's next reads come first
                s0, l0, e0, at = last
                lyr, ex, when = hints[0]
                assert lyr == l0 and ex.tolist() == e0
                for e, w in zip(e0, when.tolist()):
                    nxt = _next_step(steps, l0, e, s0)
                    assert w == (NO_NEXT_USE if nxt is None else at + (nxt - s0) * layers)
            assert (layer, routed.tolist(), ctl.clock) in [(h[0], list(h[1]), h[2]) for h in hints if np.isscalar(h[2])]
            last = (step, layer, routed.tolist(), ctl.clock)


def test_oracle_without_hints_returns_none():
    oracle = OraclePredictor(RoutingTrace(2, 4, [[[0], [1]]]), hints=False)
    ctl = _Controller(2)
    assert oracle.predict(ctl, 0, 0, None)[1].tolist() == [1]
    assert oracle.observe(ctl, 0, 0, np.array([0])) is None
    with pytest.raises(ValueError, match="distance"):
        OraclePredictor(RoutingTrace(2, 4, [[[0], [1]]]), distance=0)


def test_oracle_refuses_a_trace_with_expert_ids_out_of_range():
    # Its guesses skip the controller's range check (distinct_guesses), so
    # the trace is checked once here: -1 would silently name the last expert.
    for bad in ([[[0], [-1]]], [[[0], [4]]]):
        with pytest.raises(ValueError, match="expert ids must be in 0..3"):
            OraclePredictor(RoutingTrace(2, 4, bad))


@settings(max_examples=100, deadline=None)
@given(traces, st.data())
def test_a_request_start_hints_every_first_read(spec, data):
    # Note [Hints at a request's start]: the first predict of a request
    # hints, for every (layer, expert) the trace reads from (step, layer) on,
    # the clock time of its first read there; later predicts do not, until
    # the controller's new_sequence calls end_request.
    layers, experts, raw = spec
    steps = [[sorted(e) for e in step] for step in raw]
    step0 = data.draw(st.integers(0, len(steps) - 1))
    layer0 = data.draw(st.integers(0, layers - 1))
    oracle = OraclePredictor(RoutingTrace(layers, experts, steps))
    ctl = _Controller(layers, experts)
    ctl.clock = 40
    oracle.predict(ctl, step0, layer0, None)
    got = {}
    for lyr, ex, when in oracle._hints:
        if not np.isscalar(when):  # the prime: one time per expert
            for e, w in zip(ex.tolist(), when.tolist()):
                got[(lyr, e)] = w
    want = {}
    for lyr in range(layers):
        for e in range(experts):
            first = next(((t, lyr) for t in range(step0, len(steps)) if e in steps[t][lyr]
                          and (t, lyr) >= (step0, layer0)), None)
            if first is not None:
                want[(lyr, e)] = 40 + (first[0] - step0) * layers + (lyr - layer0)
    assert got == want
    ctl.clock += 1
    oracle._hints.clear()
    oracle.predict(ctl, step0, layer0, None)
    assert all(np.isscalar(h[2]) for h in oracle._hints)  # primed once a request
    oracle.end_request()
    oracle._hints.clear()
    oracle.predict(ctl, step0, layer0, None)
    assert any(not np.isscalar(h[2]) for h in oracle._hints) == bool(want)


def test_a_request_start_hints_nothing_without_hints():
    oracle = OraclePredictor(RoutingTrace(2, 4, [[[0], [1]]]), hints=False)
    oracle.predict(_Controller(2, 4), 0, 0, None)
    assert oracle._hints == []


class _NoPlan(OraclePredictor):
    plan = None  # the controller falls back to predict and observe


def _controller(predictor, layers, experts):
    import torch

    import prefetch
    from prefetch.controller import OffloadController

    handle = prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="host", eviction_policy="next-use")
    ctl = OffloadController(handle, num_layers=layers, num_experts=experts, top_k=3, predictor=predictor)
    for layer in range(layers):
        for e in range(experts):
            ctl.prefetcher.register_expert(layer, e, {"w": torch.zeros(4)})
    return ctl


@settings(max_examples=60, deadline=None)
@given(traces, st.integers(1, 3), st.sets(st.integers(0, 40), max_size=4))
def test_the_oracles_plan_gives_what_predict_and_observe_give(spec, distance, off_trace):
    # Note [The oracle's plan]: two controllers over the same routing, one
    # whose oracle plans and one that predicts and observes; every layer's
    # guesses, hints (as the engine takes them) and scores must agree,
    # including where the routing leaves the trace (the layers numbered in
    # `off_trace` route with expert 0 toggled) and the layer after it.
    layers, experts, raw = spec
    steps = [[sorted(e) for e in step] for step in raw]
    trace = RoutingTrace(layers, experts, steps)
    planned = _controller(OraclePredictor(trace, distance=distance, hints=True), layers, experts)
    plain = _controller(_NoPlan(trace, distance=distance, hints=True), layers, experts)
    used = 0
    try:
        for step in range(len(steps) + 1):  # one step past the trace: the plan does not hold
            for layer in range(layers):
                routed = steps[step][layer] if step < len(steps) else [0]
                if step * layers + layer in off_trace:
                    routed = sorted(set(routed) ^ {0})
                routed = np.array(routed, dtype=np.int64)
                got = []
                for ctl in (planned, plain):
                    ctl.begin_layer(layer)
                    guesses, hints = ctl.observe_and_guess(layer, routed)
                    ids, when = ctl.calls.hint_arrays(hints)
                    got.append(({t: g.tolist() for t, g in guesses.items()},
                                None if ids is None else ids.tolist(), None if when is None else when.tolist()))
                    if ctl is planned:
                        used += type(hints).__name__ == "TensorHints"
                assert got[0] == got[1]
            assert planned._pending.keys() == plain._pending.keys()
            assert (planned.prediction_hits, planned.predicted_total) == (plain.prediction_hits,
                                                                          plain.predicted_total)
    finally:
        planned.close()
        plain.close()
    # the plan holds from the request's second layer on while the routing is the trace's
    if not off_trace and len(steps) * layers > 1:
        assert used >= len(steps) * layers - 1


def test_a_predictor_is_given_a_read_only_routing_context():
    # A predictor receives the model's RoutingContext, not the controller:
    # it reads the shape, clock and hint policy, and can change nothing.
    from prefetch.offload.routing_context import RoutingContext

    seen = []

    class Spy:
        def predict(self, ctx, step, layer, hidden):
            seen.append(ctx)
            return {}

        def observe(self, ctx, step, layer, experts):
            return None

    ctl = _controller(Spy(), 2, 4)
    try:
        ctl.begin_layer(0)
        ctl.predict(0, None)
        (ctx,) = seen
        assert type(ctx) is RoutingContext and ctx is ctl.context
        assert (ctx.num_layers, ctx.num_experts, ctx.top_k, ctx.step, ctx.clock) == (2, 4, 3, 0, 0)
        assert ctx.honours_hints is True and ctx.holds_every_expert is True  # 8 tiny experts in 1 MiB
        assert not [name for name in dir(ctx) if not name.startswith("_") and name in ("controller", "handle",
                                                                                       "prefetcher")]
        for name in ("num_layers", "clock", "step", "honours_hints", "anything"):
            with pytest.raises(AttributeError):
                setattr(ctx, name, 1)
        with pytest.raises(AttributeError):
            del ctx.clock
        ctl.begin_layer(1)
        assert ctx.clock == 1  # a view: it follows the controller
    finally:
        ctl.close()
