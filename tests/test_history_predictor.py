"""HistoryPredictor (prefetch/history_predictor.py, issue #60 item 4): its
arguments are checked, it predicts a routing pattern it has seen (and
carries it across requests), it leaves out what the last token routed to,
and it runs inside offload_moe_experts without changing a decoded token.
Plus bench/predictors.py's arithmetic: precision and recall of the
misses, checked by hand on a tiny trace, and its resident sets against the
replay's own hit and miss counts."""
import copy
import json
import types

import numpy as np
import pytest

from bench import predictors as bench
from bench.lib.trace_replay import capacity_for, replay
from prefetch import HistoryPredictor, InvalidArgumentError
from prefetch.trace import RoutingTrace

# Two kinds of token over 4 layers of 8 experts, one expert a layer except
# A's two at layer 0: each kind goes its own way through every layer.
A = [[0, 1], [2], [3], [4]]
B = [[5], [6], [7], [0]]


def ctx(layers=4, experts=8, top_k=2):
    return types.SimpleNamespace(num_layers=layers, num_experts=experts, top_k=top_k)


def feed(predictor, tokens, start=0, c=None, upto=None):
    """Each token a step (from `start`), layer by layer as the controller
    calls a predictor that reads the routing: observe, then predict.
    Returns the last predict's guesses."""
    c = c or ctx()
    got = None
    for i, token in enumerate(tokens):
        for layer, experts in enumerate(token[:upto] if i == len(tokens) - 1 else token):
            predictor.observe(c, start + i, layer, np.array(experts, dtype=np.int64))
            got = predictor.predict(c, start + i, layer, None)
    return got


@pytest.mark.parametrize("kwargs,match", [
    ({"distance": 0}, "distance must be >= 1"),
    ({"threshold": 0}, "threshold must be in"),
    ({"threshold": 1.5}, "threshold must be in"),
    ({"decay": 0}, "decay must be in"),
    ({"decay": 1.01}, "decay must be in"),
    ({"sharpness": -1}, "sharpness must be finite"),
    ({"sharpness": float("inf")}, "sharpness must be finite"),
    ({"prior": -0.1}, "prior must be finite"),
    ({"neighbours": 0}, "neighbours must be None"),
    ({"history": 0}, "history must be >= 1"),
    ({"max_experts": 0}, "max_experts must be None"),
    ({"skip_recent": -1}, "skip_recent must be >= 0"),
])
def test_history_predictor_refuses_bad_arguments(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        HistoryPredictor(**kwargs)


def test_it_predicts_the_way_a_token_like_this_one_went():
    predictor = HistoryPredictor(distance=3)
    assert feed(predictor, [A]) == {}  # nothing kept yet: no guess
    feed(predictor, [B, A, B, A, B])
    # A new A token after a B: from its first layer on, the A rows are the
    # nearest, and each later layer is A's (nothing of it routed by the
    # last token, a B).
    got = feed(predictor, [A], start=6, upto=1)
    assert {t: g.tolist() for t, g in got.items()} == {1: [2], 2: [3], 3: [4]}
    assert all(g.dtype == np.int64 for g in got.values())
    # ... and a B token after that A goes B's way.
    predictor.observe(ctx(), 6, 1, np.array([2]))  # finish the A token
    predictor.observe(ctx(), 6, 2, np.array([3]))
    predictor.observe(ctx(), 6, 3, np.array([4]))
    got = feed(predictor, [B], start=7, upto=1)
    assert {t: g.tolist() for t, g in got.items()} == {1: [6], 2: [7], 3: [0]}
    # distance bounds the layers guessed; the last layer guesses none.
    assert set(feed(HistoryPredictor(distance=1), [A, B, A, B, A], upto=2)) == {2}
    assert feed(predictor, [B], start=8) == {}


def test_it_leaves_out_what_the_last_tokens_routed():
    # After an A token, the next A's experts are almost surely still
    # cached: skip_recent=1 leaves them out; 0 keeps them.
    for skip, expected in ((1, {}), (0, {1: [2], 2: [3], 3: [4]})):
        predictor = HistoryPredictor(distance=3, skip_recent=skip)
        got = feed(predictor, [A, B, A, B, A, A], upto=1)
        assert {t: g.tolist() for t, g in got.items()} == expected


def test_what_it_learned_carries_into_the_next_request():
    predictor = HistoryPredictor(distance=1, history=4)
    feed(predictor, [A, B, A, B])
    predictor.end_request()
    assert predictor.kept == 4
    got = feed(predictor, [A], start=0, upto=1)  # step 0 of a new request
    assert {t: g.tolist() for t, g in got.items()} == {1: [2]}
    feed(predictor, [B, B, B, B], start=1)
    predictor.end_request()
    assert predictor.kept == 4  # the oldest rows gave way (history=4): only Bs are left
    got = feed(predictor, [A], start=0, upto=1)
    assert 2 not in got.get(1, np.array([])).tolist()


def test_threshold_and_max_experts_bound_the_guesses():
    # Half the past A tokens went to 2 at layer 1, half to 5: each scores
    # about one half (under the prior).
    A2 = [[0, 1], [5], [3], [4]]
    tokens = [A, B, A2, B, A, B, A2, B]
    assert feed(HistoryPredictor(threshold=0.4), tokens + [A], upto=1)[1].tolist() == [2, 5]
    assert feed(HistoryPredictor(threshold=0.6), tokens + [A], upto=1) == {}
    assert feed(HistoryPredictor(threshold=0.4, max_experts=1), tokens + [A], upto=1)[1].shape == (1,)


def test_a_predict_without_its_observe_guesses_nothing():
    # A predictor swapped in between a layer's routing and its predict has
    # nothing of this token: it says nothing rather than guess from another.
    predictor = HistoryPredictor()
    feed(predictor, [A, B, A])
    assert predictor.predict(ctx(), 3, 0, None) == {}
    # a model of another shape starts it over
    predictor.observe(ctx(layers=2, experts=4), 0, 0, np.array([1]))
    assert predictor.kept == 0 and predictor.predict(ctx(layers=2, experts=4), 0, 0, None) == {}


def tiny_trace():
    trace = RoutingTrace(2, 4)
    trace.steps = [[[0, 1], [2]], [[0], [1, 3]], [[2], [0, 2]], [[3], [1]], [[1], [3]]]
    return trace


def test_bench_precision_and_recall_by_hand():
    trace = tiny_trace()
    # Resident experts of each layer just before its acquire (made up).
    resident = [[set(), set()], [{0}, {1}], [set(), {2}], [{3}, set()], [set(), set()]]
    guesses = {(1, 1, 1): {1, 2, 3},  # P = {2, 3} (1 is resident); M = {3}: 1 hit
               (2, 1, 1): {0, 1},  # P = {0, 1}; M = {0}: 1 hit
               (3, 1, 1): {2}}  # P = {2}; M = {1}: none
    got = bench.score(trace, guesses, resident, range(1, 4), 1)
    assert (got["hits"], got["predicted"], got["misses"]) == (2, 5, 3)
    assert got["precision"] == pytest.approx(2 / 5) and got["recall"] == pytest.approx(2 / 3)
    assert got["sent_per_target"] == pytest.approx(6 / 3)
    # Misses seen at their layer before: 3 at step 1 no (layer 1 had routed
    # only 2); 0 at step 2 no (2, 1, 3); 1 at step 3 yes (step 1).
    assert got["seen_before"] == pytest.approx(1 / 3)
    # Halves of 4 decode steps: 1..2 and 3..4; nothing guessed: precision null.
    assert bench.halves(trace) == (range(1, 3), range(3, 5))
    empty = bench.score(trace, {}, resident, range(3, 5), 1)
    assert empty["precision"] is None and empty["recall"] == 0 and empty["misses"] == 2


@pytest.mark.parametrize("policy", ["cyclic", "lru"])
def test_bench_resident_sets_give_the_replays_misses(policy):
    rng = np.random.default_rng(3)
    trace = RoutingTrace(6, 16)
    trace.steps = [[sorted(rng.choice(16, 3, replace=False).tolist()) for _ in range(6)] for _ in range(30)]
    capacity = capacity_for(trace, 0.25)
    rep = replay(trace, capacity, policy)
    resident = bench.resident_sets(trace, 0.25, policy)
    misses = [sum(len(set(e) - resident[s][la]) for la, e in enumerate(step)) for s, step in enumerate(trace.steps)]
    assert misses == rep.misses.tolist() and sum(misses) > 0
    assert all(len(r) <= capacity for row in resident for r in row)


def test_bench_drives_the_predictors_as_two_requests():
    trace = tiny_trace()
    seen = []

    class Recorder(bench.make_previous_token()):
        def observe(self, ctx, step, layer, experts):
            seen.append((ctx.step, step, layer, experts.tolist()))
            return super().observe(ctx, step, layer, experts)

        def end_request(self):
            seen.append("end")
            super().end_request()

    guesses = bench.drive(trace, Recorder(1), {1})
    # The prompt and steps 1..2, then steps 3..4 numbered from 0 again.
    assert [s for s in seen if s == "end"] == ["end", "end"]
    assert [x[:3] for x in seen if x != "end"][:2] == [(0, 0, 0), (0, 0, 1)]
    assert (0, 0, 0) in [x[:3] for x in seen[seen.index("end") + 1:]]
    # The baseline's guess for (step, layer 1) is the previous step's layer 1.
    assert guesses == {(1, 1, 1): {2}, (2, 1, 1): {1, 3}, (3, 1, 1): {0, 2}, (4, 1, 1): {1}}


def test_bench_runs_end_to_end(tmp_path, capsys):
    trace = RoutingTrace(4, 8)
    rng = np.random.default_rng(0)
    kinds = [A, B]
    trace.steps = [[sorted(set(range(8)) - {7}) for _ in range(4)]]
    trace.steps += [kinds[int(rng.integers(2))] for _ in range(24)]
    path = tmp_path / "t.json"
    trace.save(str(path))
    out = tmp_path / "r.json"
    assert bench.main(["--traces", str(path), "--shares", "25", "--distances", "1", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * 2 * 2  # predictors x distances x halves
    assert not any(r["fitted"] for r in rows)  # not a trace the defaults were fitted on
    assert "neither fitted on" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
@pytest.mark.parametrize("sync_free", [None, False])
def test_history_predictor_inside_offload_moe_experts(family, sync_free):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_integration import assert_same_decode, build, expert_bytes, family_configs

    from prefetch.integration import offload_moe_experts

    cfg = family_configs()[family]
    ref = build(cfg, experts_implementation="batched_mm")
    model = copy.deepcopy(ref)
    per, num_experts = expert_bytes(model)
    predictor = HistoryPredictor(distance=2, threshold=0.05, skip_recent=0)
    # Room for one layer's experts and a few more: the cache evicts.
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512), backend="host",
                              predictor=predictor, sync_free=sync_free)
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
        assert_same_decode(ref, model, ids, steps=6)
        assert predictor.kept > 0  # it saw the tokens
        ctl.new_sequence()
        assert_same_decode(ref, model, ids, steps=6)  # the same request again: it has seen every token
        report = ctl.report()  # both requests
        assert ctl.handle.stats()["evictions"] > 0
        assert report["prediction_recall"] > 0.5 and report["prediction_precision"] > 0.2
    finally:
        ctl.close()
