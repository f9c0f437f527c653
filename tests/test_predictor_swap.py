"""A predictor assigned to a live controller (Note [A predictor replaced] in
prefetch/offload/controller.py), and what a predictor or model of the wrong shape
gets: a clear error, and a controller that still works after it."""
import copy

import numpy as np
import pytest
import torch
from conftest import wait_drained
from torch import nn

import prefetch
from prefetch.integration import (
    NextLayerGatePredictor,
    OffloadController,
    OffloadedMoEBlock,
    OraclePredictor,
    RoutingTrace,
    TracePredictor,
    offload_moe_experts,
)

HIDDEN = 16


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return self.w(x)


class Stop(Exception):
    pass


class Blocks(nn.Module):
    """A residual stack of OffloadedMoEBlocks (host-routed); `stop_after`
    raises after that block, as an interrupted forward does."""

    def __init__(self, layers=4, experts=8, top_k=2, counts=None):
        super().__init__()
        torch.manual_seed(0)
        counts = counts or [experts] * layers
        self.blocks = nn.ModuleList(OffloadedMoEBlock(nn.Linear(HIDDEN, n, bias=False), [Expert() for _ in range(n)],
                                                      top_k) for n in counts)
        self.stop_after = None

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = x + block(x)
            if i == self.stop_after:
                raise Stop
        return x


def inputs(n):
    return [torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def test_a_predictor_assigned_with_a_layer_deferred_settles_it_with_the_old_one():
    # With no predictor a host-routed layer leaves its scoring and trace to
    # speculate (Note [Speculation after launch]). A forward stopped after
    # its second block leaves that pending; the gate assigned then must not
    # be handed it (it has no hidden state for it: AttributeError from
    # report(), the layer lost from the trace).
    x = inputs(1)[0]
    traces = []
    for swap in (False, True):
        model = Blocks()
        ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", progress=False,
                                  record_trace=True)
        try:
            with torch.no_grad():
                model(x)
                model.stop_after = 1
                with pytest.raises(Stop):
                    model(x)
                assert ctl.speculation.deferred is not None  # the second block's routing, not scored yet
                if swap:
                    ctl.predictor = NextLayerGatePredictor()
                    assert ctl.speculation.deferred is None
                ctl.report()
                model.stop_after = None
                ctl.new_sequence()
                model(x)  # the gate (when swapped in) runs on a whole forward
            traces.append(ctl.trace.steps)
        finally:
            ctl.close()
    assert traces[0] == traces[1]
    assert all(traces[1][1][layer] for layer in (0, 1))  # the stopped step's two layers are in the trace


def planned_controller(trace, slots=64):
    handle = prefetch.PrefetchHandle(device_budget_bytes=slots * 256, backend="host", eviction_policy="next-use")
    ctl = OffloadController(handle, num_layers=trace.num_layers, num_experts=trace.num_experts, top_k=2,
                            predictor=OraclePredictor(trace, distance=2), record_trace=True)
    for layer in range(trace.num_layers):
        for e in range(trace.num_experts):
            ctl.prefetcher.register_expert(layer, e, {"w": torch.full((64,), layer * 100 + e, dtype=torch.int32)})
    ctl.cache_slots = slots
    return ctl


def decode(ctl, steps):
    """route_and_acquire a layer as BM5's decoder calls it, the copies
    drained after each step."""
    for step in steps:
        for layer, experts in enumerate(step):
            ctl.speculate(with_next_acquire=True)
            ctl.route_and_acquire(layer, None, list(experts), timeout=10)
        ctl.release_held()
        ctl.speculate()
        wait_drained(ctl.handle)


def random_trace(seed, steps, layers=4, experts=8):
    gen = torch.Generator().manual_seed(seed)
    return RoutingTrace(layers, experts, [[sorted(torch.randperm(experts, generator=gen)[:2].tolist())
                                           for _ in range(layers)] for _ in range(steps)])


@pytest.mark.parametrize("then", ["report", "new_sequence", "close"])
def test_an_oracle_replaced_with_its_plan_pending_leaves_the_controller_working(then):
    # Note [Host-routed step pins]: a planned step's layers wait in _planned
    # for the next step's first layer. An oracle of another (one-step)
    # trace assigned then was handed the old plan's step: IndexError from
    # report(), new_sequence() and close(), and close() left the handle open.
    trace = random_trace(1, 6)
    ctl = planned_controller(trace)
    try:
        decode(ctl, trace.steps[:3])
        assert ctl.host_step_pins > 0 and ctl.plan.planned
        ctl.predictor = OraclePredictor(RoutingTrace(trace.num_layers, trace.num_experts, trace.steps[:1]),
                                        distance=2)
        assert not ctl.plan.planned
        getattr(ctl, then)()
        assert ctl.trace.steps == trace.steps[:3]  # the pending step recorded, by the old oracle's pass
        if then != "close":
            decode(ctl, trace.steps[:2])
            assert ctl.report()["hit_rate"] is not None
    finally:
        ctl.close()
    assert ctl.handle.closed


def test_close_closes_the_handle_when_the_pending_work_raises():
    class Broken(OraclePredictor):
        fail = False

        def observe_step(self, controller, step, clock0):
            if self.fail:
                raise RuntimeError("broken predictor")
            return super().observe_step(controller, step, clock0)

    trace = random_trace(2, 4)
    ctl = planned_controller(trace)
    ctl.predictor = broken = Broken(trace, distance=2)
    decode(ctl, trace.steps[:3])
    assert ctl.plan.planned
    broken.fail = True
    with pytest.raises(RuntimeError, match="broken predictor"):
        ctl.close()
    assert ctl.handle.closed
    ctl.close()  # again: nothing left to do


class Wrong:
    """Guesses experts the trace below never routes to."""

    host_guesses = True

    def predict(self, controller, step, layer, hidden):
        return {(layer + 1) % controller.num_layers: np.array([5, 6, 7], dtype=np.int64)}

    def observe(self, controller, step, layer, experts):
        return None


def test_a_new_predictor_starts_without_the_old_ones_pause():
    # Note [Speculation by its precision]: a predictor whose guesses are
    # always wrong pauses speculation. A perfect oracle assigned after it
    # starts unpaused and is held back on no more layers than on a fresh
    # controller (it was held back on 49 of 120 when it took over the
    # wrong one's record).
    layers, experts = 4, 8
    gen = torch.Generator().manual_seed(3)
    trace = RoutingTrace(layers, experts, [[sorted(set(torch.randint(0, 5, (3,), generator=gen).tolist()))
                                            for _ in range(layers)] for _ in range(30)])

    def run(ctl):
        for step in trace.steps:
            for layer, routed in enumerate(step):
                ctl.on_routed(layer, None, routed)
                ctl.prefetcher.acquire_experts(layer, routed, timeout=10)
                ctl.prefetcher.release_experts(layer, routed)

    def controller(predictor):
        handle = prefetch.PrefetchHandle(device_budget_bytes=10 * 256, backend="host")
        ctl = OffloadController(handle, num_layers=layers, num_experts=experts, top_k=2, predictor=predictor)
        for layer in range(layers):
            for e in range(experts):
                ctl.prefetcher.register_expert(layer, e, {"w": torch.zeros(64, dtype=torch.int32)})
        return ctl

    swapped = controller(Wrong())
    fresh = controller(OraclePredictor(trace))
    try:
        run(swapped)
        assert swapped.speculation_paused
        swapped.new_sequence()
        swapped.predictor = OraclePredictor(trace)
        assert not swapped.speculation_paused
        before = swapped.speculation_paused_layers
        run(swapped)
        run(fresh)
        assert swapped.speculation_paused_layers - before == fresh.speculation_paused_layers
        report = swapped.report()
        assert report["prediction_precision"] < 1  # the wrong one's scores stay in the total...
        wrong, right = report["predictors"]  # ...and each predictor has its own
        assert (wrong["predictor"], right["predictor"]) == ("Wrong", "OraclePredictor")
        assert wrong["prediction_precision"] < 1 and right["prediction_precision"] == 1.0
        assert fresh.report()["predictors"] == [right]  # as if it had been the only one
        assert wrong["guessed"] + right["guessed"] == swapped.predicted_total
    finally:
        swapped.close()
        fresh.close()


def test_reassigning_the_same_predictor_changes_nothing():
    trace = random_trace(4, 5)
    ctl = planned_controller(trace)
    try:
        decode(ctl, trace.steps[:3])
        planned = list(ctl.plan.planned)
        ctl.predictor = ctl.predictor
        assert ctl.plan.planned == planned  # nothing flushed
        assert len(ctl.report()["predictors"]) == 1  # nor scored apart
    finally:
        ctl.close()


def test_the_report_keeps_the_last_64_predictors():
    # A stack that assigns a predictor a request would grow the list for
    # good; the totals still add up every one.
    trace = random_trace(4, 5)
    ctl = planned_controller(trace)
    try:
        decode(ctl, trace.steps[:2])
        first = ctl.report()["predictors"][0]
        assert first["guessed"] > 0
        for _ in range(100):
            ctl.predictor = OraclePredictor(trace)
        r = ctl.report()
        assert len(r["predictors"]) == 64
        assert all(p["guessed"] == 0 for p in r["predictors"])  # the first one's record is gone...
        assert ctl.predicted_total == first["guessed"]  # ...and its guesses still count in the totals
        assert r["prediction_precision"] == first["prediction_precision"]
    finally:
        ctl.close()


def test_an_oracle_of_a_model_with_more_experts_raises_and_the_controller_goes_on():
    # The oracle's guesses are taken as they are (distinct_guesses): one of
    # a trace with more experts than the model indexed past the layer's
    # tensor ids (IndexError), and the bad guess stayed queued, so every
    # later forward failed, with the predictor removed too.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.OlmoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="batched_mm").eval()
    model = copy.deepcopy(ref)
    trace = RoutingTrace(3, 16, [[[3, 12] for _ in range(3)] for _ in range(8)])
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", progress=False,
                              predictor=OraclePredictor(trace), sync_free=False)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))

    def generate(m):
        return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                          pad_token_id=0)

    try:
        with pytest.raises(ValueError, match="its trace has 16 experts a layer, the model 8"):
            generate(model)
        assert not ctl._queued_guess
        ctl.predictor = None
        ctl.new_sequence()
        assert torch.equal(generate(model), generate(ref))
    finally:
        ctl.close()


def test_blocks_with_different_expert_counts_are_refused_before_any_changes():
    model = Blocks(counts=[4, 8, 4])
    with pytest.raises(NotImplementedError, match=r"experts per layer: \[4, 8, 4\]"):
        offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", progress=False)
    # Not attached: the blocks keep their experts, and can be offloaded once made alike.
    assert all(block.controller is None and len(block._experts) == block.num_experts for block in model.blocks)


@pytest.mark.parametrize("kwargs,match", [
    ({"history": 0}, "history must be >= 1"),
    ({"history": -1}, "history must be >= 1"),
    ({"max_experts": 0}, "max_experts must be None"),
    ({"max_experts": -2}, "max_experts must be None"),
])
def test_trace_predictor_refuses_bad_bounds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TracePredictor(**kwargs)


def test_trace_predictor_keeps_at_most_history_requests():
    predictor = TracePredictor(history=3)

    class Shape:
        num_layers, num_experts = 2, 4

    for i in range(5):
        predictor.observe(Shape, 0, 0, np.array([i % 4]))
        predictor.end_request()
    assert len(predictor.past) == 3


@pytest.mark.parametrize("bad,match", [
    ("oracle", "got str 'oracle' without predict and observe"),
    (NextLayerGatePredictor, "got the class NextLayerGatePredictor: pass an instance"),
    (object(), "without predict and observe"),
])
def test_something_that_is_not_a_predictor_is_refused_before_anything_changes(bad, match):
    model = Blocks()
    x = inputs(1)[0]
    with pytest.raises(TypeError, match=match):
        offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", progress=False, predictor=bad)
    assert all(block.controller is None and len(block._experts) == block.num_experts for block in model.blocks)
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", progress=False,
                              predictor=NextLayerGatePredictor())
    try:
        gate = ctl.predictor
        with pytest.raises(TypeError, match=match):
            ctl.predictor = bad
        assert ctl.predictor is gate
        with torch.no_grad():
            model(x)
    finally:
        ctl.close()
