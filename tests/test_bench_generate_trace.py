"""BM6 with routing forced from a trace (bench/generate.py --trace-in, Note
[Forced routing] in bench/lib/generate_trace.py) on the CPU: a tiny Qwen3-MoE
routes as the trace says in transformers' own generate, every row keeps
that routing, and a bad trace is refused. No timing assertions."""
from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from bench import generate  # noqa: E402
from bench.lib.generate_model import SMOKE_MODELS, RoutingRecorder, build_model, moe_blocks  # noqa: E402
from bench.lib.generate_model import generate as run_generate  # noqa: E402
from bench.lib.generate_trace import ForcedRouting, force_routing, trace_shape  # noqa: E402
from prefetch.integration import RoutingTrace  # noqa: E402

LAYERS, EXPERTS, TOP_K = 4, 8, 2  # smoke-qwen3-moe's


def _trace(decode_steps=12, seed=0, prompt_experts=5) -> RoutingTrace:
    rng = random.Random(seed)
    steps = [[sorted(rng.sample(range(EXPERTS), prompt_experts)) for _ in range(LAYERS)]]
    steps += [[sorted(rng.sample(range(EXPERTS), TOP_K)) for _ in range(LAYERS)] for _ in range(decode_steps)]
    return RoutingTrace(LAYERS, EXPERTS, steps)


def _write(path, trace: RoutingTrace) -> str:
    path.write_text(json.dumps({"format": "prefetch-routing-trace/1", "num_layers": trace.num_layers,
                                "num_experts": trace.num_experts, "steps": trace.steps}))
    return str(path)


def _model(trace, batch, start=1):
    family, shape = SMOKE_MODELS["smoke-qwen3-moe"]
    model = build_model(torch, family, trace_shape(shape, trace), 64, torch.device("cpu"), torch.float32)
    routing = ForcedRouting(trace, torch.device("cpu"), start=start)
    force_routing(model, moe_blocks(model), routing)
    routing.set_batch(batch)
    return model, routing


def _expected_decode(trace, i, batch, start=1):
    """Decode token i's routing per layer (the union over the batch's rows)."""
    d = len(trace.steps) - 1
    rows = [1 + (start - 1 + i + b * (d // batch)) % d for b in range(batch)]
    return [sorted(set().union(*(trace.steps[s][layer] for s in rows))) for layer in range(LAYERS)]


@pytest.mark.parametrize("batch,start", [(1, 1), (2, 1), (2, 5)])
def test_generate_routes_as_the_trace(batch, start):
    trace = _trace()
    model, routing = _model(trace, batch, start)
    prompt = torch.randint(1, 64, (batch, 3), generator=torch.Generator().manual_seed(1))
    rec = RoutingRecorder(model)
    try:
        for _ in range(2):  # each generate starts over
            rec.calls = []
            run_generate(torch, model, prompt, 6, lambda: None)
            steps = rec.steps()
            assert len(steps) == 6  # the prefill, then 5 decode tokens
            for layer in range(LAYERS):
                # 3 x batch prompt tokens take k apiece of step 0's experts, in turn
                union = trace.steps[0][layer]
                picks = {union[j % len(union)] for j in range(3 * batch * TOP_K)}
                assert steps[0][layer] == sorted(picks)
            for i in range(5):
                assert steps[1 + i] == _expected_decode(trace, i, batch, start), i
    finally:
        rec.close()


def test_a_prompt_token_routes_to_distinct_experts():
    trace = _trace()
    steps = [list(s) for s in trace.steps]
    steps[0] = [[3, 3, 5, 5, 6]] + [[1]] + [list(x) for x in steps[0][2:]]  # repeats; fewer than k
    routing = ForcedRouting(RoutingTrace(LAYERS, EXPERTS, steps), torch.device("cpu"))
    routing.set_batch(1)
    for layer in (0, 1):
        rows = routing.indices(layer, 7).tolist()
        assert all(len(set(r)) == TOP_K for r in rows), (layer, rows)
    assert {e for r in routing.indices(0, 7).tolist() for e in r} == {3, 5, 6}


def test_a_router_called_outside_its_block_moves_nothing():
    trace = _trace()
    model, routing = _model(trace, 1)
    blocks = moe_blocks(model)
    run_generate(torch, model, torch.ones(1, 3, dtype=torch.long), 3, lambda: None)
    pos = routing.pos
    gate = blocks[2][2]
    _, weights, index = gate(torch.randn(1, 64))  # as a predictor would call it
    assert routing.pos == pos
    assert index.tolist() == [trace.steps[1 + pos][2]]
    assert torch.allclose(weights.sum(-1), torch.ones(1))  # normalised, as the config says


def test_the_twin_routes_with_its_own_copy():
    import copy

    trace = _trace()
    model, routing = _model(trace, 1)
    twin = copy.deepcopy(model)
    assert twin._forced_routing is not routing
    for block, _, gate in moe_blocks(twin):
        assert block.forward.__self__ is block and gate.forward.__self__ is gate
        assert block._forced_routing[0] is twin._forced_routing
    ids = torch.ones(1, 3, dtype=torch.long)
    assert torch.equal(run_generate(torch, model, ids, 4, lambda: None)[0],
                       run_generate(torch, twin, ids, 4, lambda: None)[0])


def test_bad_traces_are_refused():
    trace = _trace()
    uneven = RoutingTrace(LAYERS, EXPERTS, [list(s) for s in trace.steps])
    uneven.steps[3] = [list(x) for x in uneven.steps[3]]
    uneven.steps[3][2] = [0, 1, 2]
    with pytest.raises(ValueError, match="trace step 3 layer 2"):
        ForcedRouting(uneven, torch.device("cpu"))
    repeated = RoutingTrace(LAYERS, EXPERTS, [list(s) for s in trace.steps])
    repeated.steps[1] = [[4, 4]] + [list(x) for x in repeated.steps[1][1:]]
    with pytest.raises(ValueError, match="trace step 1 layer 0"):
        ForcedRouting(repeated, torch.device("cpu"))
    with pytest.raises(ValueError, match="not a decode step"):
        ForcedRouting(trace, torch.device("cpu"), start=len(trace.steps))
    with pytest.raises(ValueError, match="no decode step"):
        ForcedRouting(RoutingTrace(LAYERS, EXPERTS, trace.steps[:1]), torch.device("cpu"))
    _, shape = SMOKE_MODELS["smoke-qwen3-moe"]
    with pytest.raises(ValueError, match="layers"):
        trace_shape(shape, RoutingTrace(LAYERS + 1, EXPERTS, [s + [[0, 1]] for s in trace.steps]))
    routing = ForcedRouting(trace, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="set_batch"):
        routing.enter(0, 1)


@pytest.mark.parametrize("make,message", [
    (lambda t: {"format": "prefetch-routing-trace/1", "num_layers": LAYERS, "num_experts": EXPERTS,
                "steps": [s[:-1] for s in t.steps]}, "layers"),
    (lambda t: {"format": "something-else"}, "not a prefetch routing trace"),
    (lambda t: {"format": "prefetch-routing-trace/1", "num_layers": 5, "num_experts": EXPERTS,
                "steps": [s + [[0, 1]] for s in t.steps]}, "no model of this benchmark"),
    (lambda t: {"format": "prefetch-routing-trace/1", "num_layers": LAYERS, "num_experts": EXPERTS,
                "steps": [t.steps[0], [[0, 1]] + [[0, 1, 2]] * (LAYERS - 1)]}, "trace step 1 layer 1"),
])
def test_bm6_refuses_a_bad_trace_with_a_clear_error(tmp_path, capsys, make, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(make(_trace())))
    with pytest.raises(SystemExit):
        generate.main(["--smoke-cpu", "--trace-in", str(path)])
    assert message in capsys.readouterr().err


def test_trace_from_without_a_trace_is_refused(capsys):
    with pytest.raises(SystemExit):
        generate.main(["--smoke-cpu", "--trace-from", "3"])
    assert "--trace-from goes with --trace-in" in capsys.readouterr().err


def test_bm6_with_a_trace_keeps_its_routing_in_every_row(tmp_path):
    trace_path = _write(tmp_path / "trace.json", _trace(decode_steps=16))
    out = tmp_path / "bm6.json"
    assert generate.main(["--smoke-cpu", "--trace-in", trace_path, "--batches", "1", "--paired", "1",
                          "--rows", "resident", "on-demand", "oracle", "torch-by-hand", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["trace_in"] == trace_path and report["config"]["trace_from"] == 1
    assert any("routing forced from trace.json" in n for n in report["notes"])
    assert report["models"]["smoke-qwen3-moe"]["top_k"] == TOP_K
    assert report["blocks"][0]["twin_tokens_equal"] is True
    rows = {r["row"]: r for r in report["rows"]}
    for name in ("on-demand", "oracle", "torch-by-hand"):
        assert rows[name]["tokens_equal"] is True, name
    for name in ("on-demand", "oracle"):
        assert rows[name]["routing_equals_resident"] is True, name
    # The oracle replays the forced routing on-demand recorded, so it finds
    # more of it cached than on-demand does (the smoke share: half of 32).
    assert rows["oracle"]["hit_rate"] > rows["on-demand"]["hit_rate"]


def test_every_real_trace_of_a_large_model_has_a_model_to_replay_it():
    # The real traces of the three large models (traces/ and the shared ones, where present) each
    # find a TRACE_MODELS entry of their layers and experts, which ForcedRouting then takes; the
    # Granite traces (24 x 32) have none, and the refusal names the shapes there are.
    from pathlib import Path

    from bench.lib.generate_trace import TRACE_MODELS

    root = Path(__file__).resolve().parent.parent
    found = sorted((root / "traces").glob("qwen3-30b-a3b*.json")) + sorted(
        (root.parent / "shared" / "traces").glob("*.json"))
    assert any("qwen3" in p.name for p in found)
    for path in found:
        trace = RoutingTrace.load(str(path))
        shapes = [n for n, (_, shape) in TRACE_MODELS.items()
                  if (shape["num_hidden_layers"], shape["num_experts"]) == (trace.num_layers, trace.num_experts)]
        assert shapes, path.name
        for n in shapes:
            shape = trace_shape(TRACE_MODELS[n][1], trace)
            assert shape["num_experts_per_tok"] == len(trace.steps[1][0])
        ForcedRouting(trace, torch.device("cpu"))
