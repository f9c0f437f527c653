"""Note [Host-routed step pins] (prefetch/offload/step_plan.py): on the host-routed
path (route_and_acquire a layer, as BM5's decoder and OffloadedMoEBlock call
it) a predictor that knows whole steps gets one engine call a step; the
layers read the pins, acquire only what the pins miss, and the bytes,
scores, trace and pins come out as on the layer-by-layer path."""

import numpy as np
import pytest
import torch
from conftest import CountingHandle, wait_drained

import prefetch
from prefetch.integration import (
    OffloadController,
    OraclePredictor,
    RoutingTrace,
    belady_misses,
)

# OffloadedMoEBlock models take the plan too:
# tests/test_integration.py::test_offloaded_blocks_replaying_their_routing_take_the_step_plan.
LAYERS, EXPERTS = 6, 16


def random_trace(seed: int, steps: int, layers: int = LAYERS, experts: int = EXPERTS) -> RoutingTrace:
    """Each layer routed to 3 distinct random experts."""
    gen = torch.Generator().manual_seed(seed)
    return RoutingTrace(layers, experts, [[sorted(torch.randperm(experts, generator=gen)[:3].tolist())
                                           for _ in range(layers)] for _ in range(steps)])


def planned_controller(trace, slots: int, predictor=None, plan: bool = True, record_trace: bool = True):
    """A next-use host handle of `slots` 256-byte slots with every (layer,
    expert) registered (its bytes say which), the oracle by default, and the
    slot count that turns the step plan on (`plan`)."""
    handle = prefetch.PrefetchHandle(device_budget_bytes=slots * 256, backend="host", eviction_policy="next-use")
    ctl = OffloadController(handle, num_layers=trace.num_layers, num_experts=trace.num_experts, top_k=3,
                            predictor=predictor or OraclePredictor(trace, distance=2), record_trace=record_trace)
    for layer in range(trace.num_layers):
        for e in range(trace.num_experts):
            ctl.prefetcher.register_expert(layer, e, {"w": torch.full((64,), layer * 100 + e, dtype=torch.int32)})
    if plan:
        ctl.cache_slots = slots
    return ctl


def decode(ctl, steps, drain: bool = True):
    """route_and_acquire a layer as BM5's decoder calls it (speculate before
    each layer's call, release and speculate after the last), checking each
    acquired expert's bytes; with `drain` the copies land after each step,
    so the next step's plan finds them resident."""
    for step in steps:
        for layer, experts in enumerate(step):
            ctl.speculate(with_next_acquire=True)
            routed, where = ctl.route_and_acquire(layer, None, list(experts), timeout=10)
            assert routed.tolist() == sorted(set(experts))
            got = ctl.prefetcher.weights_in_slots(ctl.ids(layer, routed), where)
            for e, w in zip(routed.tolist(), got):
                assert torch.equal(w["w"], torch.full((64,), layer * 100 + e, dtype=torch.int32))
        ctl.release_held()
        ctl.speculate()
        assert ctl.handle.stats()["pinned_count"] == 0
        if drain:
            wait_drained(ctl.handle)


def test_a_planned_step_makes_one_engine_call():
    # The first step finds nothing resident: its plan pins nothing, and each
    # layer acquires its experts (a call a layer). From then on the next
    # step's reads, queued by the plan a step ahead, have landed: one call
    # a step and the release. Scores, trace and bytes as layer by layer.
    trace = random_trace(1, 10)
    reads = sum(len(e) for step in trace.steps for e in step)
    ctl = planned_controller(trace, slots=40)  # 18 reads a step: 18 + max(18, 16) <= 40
    real = ctl.handle
    ctl.handle = counting = CountingHandle(real)
    try:
        decode(ctl, trace.steps)
        steps = len(trace.steps)
        assert ctl.host_step_pins == ctl.step_pins == steps
        assert counting.calls == {"exchange": steps + LAYERS, "release": steps, "other": 0}
        r = ctl.report()
        assert r["step_pins"] == steps
        assert r["prediction_precision"] == 1.0 and r["prediction_recall"] == 1.0
        first = sum(len(e) for e in trace.steps[0])
        assert ctl.actual_total == reads - first  # every step but the first was planned, and scored
        assert ctl.pinned_hits == reads - first
        s = real.stats()
        # The first step's reads were acquired (a read of it that the plan
        # queued for the next step may have landed first: a hit).
        assert s["hits"] + s["misses"] == first and s["misses"] > 0
        assert r["hit_rate"] == (reads - s["misses"]) / reads
        assert ctl.trace.steps == trace.steps
    finally:
        ctl.handle = real
        ctl.close()


@pytest.mark.parametrize("slots", [40, 64])
def test_what_the_plan_copies(slots):
    # The plan queues the next step's reads a whole step ahead, the
    # layer-by-layer oracle its guesses two layers ahead: while a step runs
    # the plan keeps a step's reads more in the cache, and where the cache
    # is tight that costs copies (measured: 119 against 100 in 40 slots,
    # within Belady's count for a cache a step's reads smaller); with room
    # to spare (64 slots) both copy each expert once, as Belady does.
    trace = random_trace(2, 12)
    copies = {}
    for plan in (True, False):
        ctl = planned_controller(trace, slots=slots, plan=plan)
        try:
            decode(ctl, trace.steps)
            copies[plan] = ctl.handle.stats()["copies"]
            assert ctl.report()["prediction_precision"] == 1.0
            assert (ctl.host_step_pins > 0) == plan
        finally:
            ctl.close()
    per_step = max(sum(len(e) for e in step) for step in trace.steps)
    assert belady_misses(trace, slots) <= copies[False] <= copies[True] <= belady_misses(trace, slots - per_step)
    if slots == 64:
        distinct = len({(la, e) for step in trace.steps for la, ex in enumerate(step) for e in ex})
        assert copies[True] == copies[False] == belady_misses(trace, slots) == distinct


def test_a_step_without_its_copies_landed_acquires_what_the_pins_miss():
    # Nothing drained between steps: the plan pins what has landed by layer
    # 0, each layer acquires the rest (waiting for their copies), the bytes
    # are right and nothing stays pinned or held.
    trace = random_trace(3, 12)
    ctl = planned_controller(trace, slots=40)
    try:
        decode(ctl, trace.steps, drain=False)
        assert ctl.host_step_pins == len(trace.steps)
        assert ctl.report()["prediction_precision"] == 1.0
        assert ctl._held is None and ctl.plan.pinned_step is None
    finally:
        ctl.close()


def test_a_wrong_plan_is_scored_and_stops():
    # The oracle replays another trace than the model routes: every plan
    # misses, its guesses score 0, speculation pauses, and the plan stops;
    # the bytes are still each routed expert's.
    trace = random_trace(4, 24)
    wrong = RoutingTrace(LAYERS, EXPERTS, [[[e for e in range(EXPERTS) if e not in layer][:3] for layer in step]
                                           for step in trace.steps])
    ctl = planned_controller(trace, slots=40, predictor=OraclePredictor(wrong, distance=2))
    try:
        decode(ctl, trace.steps[:12])
        pins = ctl.host_step_pins
        assert 0 < pins < 12
        r = ctl.report()
        assert r["prediction_precision"] == 0.0 and ctl.speculation_paused
        decode(ctl, trace.steps[12:])
        assert ctl.host_step_pins == pins
        assert ctl.trace.steps == trace.steps
    finally:
        ctl.close()


def test_the_plan_needs_room_and_a_whole_layer_in_one_call():
    # Room: this step's reads plus the larger of the next step's and a
    # whole layer's experts (the most a layer can acquire beside the pins).
    trace = random_trace(5, 6)
    ctl = planned_controller(trace, slots=40)
    try:
        now = ctl.predictor.step_reads(2, LAYERS, EXPERTS, ahead=False)
        nxt = ctl.predictor.step_reads(3, LAYERS, EXPERTS, ahead=False)
        ctl.cache_slots = now.shape[0] + max(nxt.shape[0], EXPERTS)
        assert ctl.sync.step_plan(2, host=True) is not None
        ctl.cache_slots -= 1
        assert ctl.sync.step_plan(2, host=True) is None
        ctl.cache_slots = 40
        # A layer taken in pieces (first < its routed experts) ends the
        # plan: the pins are released and that layer goes layer by layer.
        ctl.route_and_acquire(0, None, trace.steps[0][0], timeout=10)
        ctl.release_held()
        wait_drained(ctl.handle)
        ctl.route_and_acquire(0, None, trace.steps[1][0], timeout=10)
        assert ctl.plan.pinned_step == 1
        routed, where = ctl.route_and_acquire(1, None, trace.steps[1][1], timeout=10, first=1)
        assert ctl.plan.pinned_step is None
        assert ctl.handle.stats()["pinned_count"] == 1
        ctl.release_held()
        assert ctl.handle.stats()["pinned_count"] == 0
    finally:
        ctl.close()


def test_bad_input_in_a_planned_step_leaves_the_pins():
    # An expert id out of range is refused before anything changes: the
    # step's pins stay held, and the last layer's release frees them.
    trace = random_trace(6, 4)
    ctl = planned_controller(trace, slots=40)
    try:
        decode(ctl, trace.steps[:1])
        ctl.route_and_acquire(0, None, trace.steps[1][0], timeout=10)
        pinned = ctl.handle.stats()["pinned_count"]
        assert pinned > 0
        with pytest.raises(ValueError):
            ctl.route_and_acquire(1, None, [EXPERTS + 3], timeout=10)
        with pytest.raises(ValueError):
            ctl.route_and_acquire(1, None, [-1], timeout=10)
        assert ctl.handle.stats()["pinned_count"] == pinned and ctl.plan.pinned_step == 1
        routed, where = ctl.route_and_acquire(1, None, trace.steps[1][1], timeout=10)
        got = ctl.prefetcher.weights_in_slots(ctl.ids(1, routed), where)
        assert [int(w["w"][0]) for w in got] == [100 + e for e in routed.tolist()]
        ctl.release_held()
        assert ctl.handle.stats()["pinned_count"] == 0
    finally:
        ctl.close()


def test_plan_rows_checks_its_indices():
    from prefetch._engine import plan_rows

    offsets = np.array([-1, 256, 512, -1], dtype=np.int64)
    where = np.empty((2, 2), dtype=np.int64)
    assert plan_rows(offsets, 2, np.array([0, 1], dtype=np.int64), where) == 1
    assert where.tolist() == [[512, 0], [-1, 0]]
    with pytest.raises(IndexError):
        plan_rows(offsets, 2, np.array([0, 2], dtype=np.int64), where)
    with pytest.raises(IndexError):
        plan_rows(offsets, 0, np.array([-1, 0], dtype=np.int64), where)
    with pytest.raises(ValueError):
        plan_rows(offsets, 0, np.array([0], dtype=np.int64), where)
    assert where.tolist() == [[512, 0], [-1, 0]]  # nothing written by a refused call
