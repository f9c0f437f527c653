"""BM6 (bench/generate.py) on the CPU: tiny configs, every row, the logic
only. No timing assertions: the figures of a noisy 2-core machine mean
nothing; what must hold is which figures exist, and that offloaded rows
generate the resident row's tokens."""
from __future__ import annotations

import gc
import importlib.util
import json
import numbers
import weakref

import pytest

pytest.importorskip("transformers")

from bench import generate  # noqa: E402
from bench.lib import generate_modes  # noqa: E402

ENGINE_AND_BY_HAND = (*generate_modes.ENGINE_ROWS, "torch-by-hand")


def _run(tmp_path, *extra):
    path = tmp_path / "bm6.json"
    assert generate.main(["--smoke-cpu", "--json", str(path), *extra]) == 0
    return json.loads(path.read_text())


def _check_figures(row):
    """Figures are numbers where the row ran, null with a reason where not."""
    for key in generate_modes.FIGURES:
        assert key in row, (row["row"], key)
    if row.get("reason"):
        for key in generate_modes.FIGURES:
            assert row[key] is None, (row["row"], key, row[key])
        return
    for key in ("p50_ms", "p90_ms", "prefill_ms", "ttft_ms", "x_resident"):
        assert isinstance(row[key], numbers.Real) and row[key] > 0, (row["row"], key, row[key])
    assert isinstance(row["tokens_equal"], bool)
    for key in generate_modes.FIGURES:
        value = row[key]
        if value is None:
            assert row["null_reasons"][key], (row["row"], key)
        elif key != "tokens_equal":
            assert isinstance(value, numbers.Real) and not isinstance(value, bool), (row["row"], key, value)
            assert value >= 0, (row["row"], key, value)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("bm6"))


def test_smoke_has_every_row(smoke):
    assert smoke["benchmark"] == "BM6 generate"
    assert smoke["partial"] is False
    assert smoke["machine"]["cpu_count"]
    models = smoke["config"]["models"]
    assert set(models) == set(generate.SMOKE_DEFAULT)
    want = {(m, b, s, r) for m in models for b in smoke["config"]["batches"]
            for r in generate_modes.ROWS
            for s in ([None] if r in generate_modes.SHARE_FREE_ROWS else smoke["config"]["shares"])}
    got = [(r["model"], r["batch"], r["share"], r["row"]) for r in smoke["rows"]]
    assert len(got) == len(set(got))
    assert set(got) == want


def test_smoke_figures(smoke):
    for row in smoke["rows"]:
        _check_figures(row)


def test_engine_rows_say_where_their_copies_went_over_the_decode_steps(smoke):
    from bench.lib import generate_figures

    counts = generate_figures.DECODE_ENGINE_COUNTS
    engine = [r for r in smoke["rows"] if r["row"] in generate_modes.ENGINE_ROWS and not r.get("reason")]
    assert engine
    for row in engine:
        for key in counts:
            assert isinstance(row[key], int) and row[key] >= 0, (row["row"], key, row.get(key))
    for row in smoke["rows"]:
        if row["row"] not in generate_modes.ENGINE_ROWS:
            assert not any(key in row for key in counts), row["row"]
    # Over the decode steps: the counters' change from the first logits call
    # to the end, not their totals; a counter a mode lacks gives no key.
    got = generate_figures.decode_counters({"wasted": 5, "late": 1, "hits": 0, "misses": 0},
                                           {"wasted": 9, "late": 1, "hits": 3, "misses": 1}, None)
    assert (got["wasted"], got["late"], got["hit_rate"]) == (4, 0, 0.75)
    assert "cancelled" not in got


def test_engine_and_by_hand_generate_the_resident_tokens(smoke):
    for row in smoke["rows"]:
        if row["row"] in ENGINE_AND_BY_HAND:
            assert row.get("reason") is None, row
            assert row["tokens_equal"] is True, row
            assert row["hit_rate"] is not None and 0 <= row["hit_rate"] <= 1
            assert row["bytes_moved"] is not None
            # host time per layer over the decode steps (the prefill's excluded)
            assert row["host_us_per_layer"] > 0
            if row["row"] in generate_modes.ENGINE_ROWS:
                assert row["engine_us_per_layer"] > 0 and row["sync_us_per_layer"] >= 0
        if row["row"] == "resident":
            assert row["tokens_equal"] is True and row["x_resident"] > 0


def test_gpt_oss_engine_rows_generate_the_resident_tokens_and_by_hand_says_why_not(tmp_path):
    # Biased, transposed experts with gpt-oss's clamped activation: the
    # engine rows run the model's own implementation on them; the by-hand
    # baseline (grouped_mm on gate_up/down alone) is skipped with a reason.
    report = _run(tmp_path, "--models", "smoke-gpt-oss", "--rows", "on-demand", "oracle", "torch-by-hand")
    rows = {r["row"]: r for r in report["rows"]}
    for name in ("resident", "on-demand", "oracle"):
        assert rows[name].get("reason") is None and rows[name]["tokens_equal"] is True, rows[name]
    assert "gate_up_proj_bias" in rows["torch-by-hand"]["reason"]
    assert rows["torch-by-hand"]["p50_ms"] is None


def test_oracle_replays_the_recorded_routing(smoke):
    oracle = [r for r in smoke["rows"] if r["row"] == "oracle"]
    assert oracle
    for row in oracle:
        assert row["oracle_replayed_exactly"] is True
        assert row["recall"] == 1.0


def test_each_block_restores_the_model(smoke):
    assert smoke["blocks"]
    for block in smoke["blocks"]:
        assert block["restore_check"] is True
        assert "routing" not in block  # large; kept out of the JSON


def test_optional_packages_run_or_say_why(smoke):
    optional = {"accelerate-cpu-offload": "accelerate", "moe-policylang-lru": "moe_policylang",
                "moe-policylang-lookahead": "moe_policylang"}
    for row in smoke["rows"]:
        package = optional.get(row["row"])
        if package is None:
            continue
        if importlib.util.find_spec(package) is None:
            assert row["reason"] and "not importable" in row["reason"]
        else:
            assert row.get("reason") is None, row
            assert row["tokens_equal"] is True, row


def test_by_hand_runs_a_layer_in_pieces_when_slots_are_few(tmp_path):
    """3 slots of 8 experts a layer: the prefill routes more experts than fit,
    so torch-by-hand computes a layer in pieces; the tokens must not change.
    The oracle has no on-demand trace to replay here: null with the reason."""
    report = _run(tmp_path, "--models", "smoke-mixtral", "--rows", "torch-by-hand", "oracle",
                  "--shares", "0.1", "--new-tokens", "3")
    rows = {r["row"]: r for r in report["rows"]}
    assert set(rows) == {"resident", "torch-by-hand", "oracle"}
    by_hand = rows["torch-by-hand"]
    assert by_hand["device_expert_bytes"] == 3 * report["models"]["smoke-mixtral"]["expert_bytes"]
    assert by_hand["tokens_equal"] is True
    assert rows["oracle"]["reason"].startswith("not run")
    for row in rows.values():
        _check_figures(row)


def test_by_hand_gathers_its_slots_past_grouped_mm_group_limit(tmp_path, monkeypatch):
    """torch's grouped_mm takes at most 1023 groups; a by-hand cache with more
    slots (Qwen3-30B-A3B at 25 %: 1,536) gathers the routed slots first. The
    limit lowered to 2 makes the smoke's cache that large: same tokens, and
    the gathered path did run (each call gathers once per piece)."""
    monkeypatch.setattr(generate_modes, "_GROUPED_MM_MAX_GROUPS", 2)
    gathered = []
    real = generate_modes._grouped_rows

    def counting(torch, module, weights, hidden_states, slot_ids, top_k_weights, num_slots):
        gathered.append(weights[0].shape[0] == num_slots <= 8)
        return real(torch, module, weights, hidden_states, slot_ids, top_k_weights, num_slots)

    monkeypatch.setattr(generate_modes, "_grouped_rows", counting)
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "torch-by-hand", "--shares", "0.5",
                  "--new-tokens", "3")
    rows = {r["row"]: r for r in report["rows"]}
    assert rows["torch-by-hand"]["tokens_equal"] is True
    assert gathered and all(gathered)


def test_time_budget_reports_rows_not_run(tmp_path):
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "on-demand", "--budget-s", "0")
    for row in report["rows"]:
        assert row["reason"].startswith("not run: --budget-s")
        _check_figures(row)


def test_without_cuda_the_real_run_is_not_measured(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "bm6.json"
    assert generate.main(["--models", "olmoe-1b-7b", "--json", str(path)]) == 1
    assert json.loads(path.read_text())["rows"] is None


def test_repeats_alternate_the_row_and_the_resident_model(tmp_path):
    # --repeats 3: three measured generates of the row, then three of the
    # resident model; p50_ms is the median of the row's, x_adjacent the
    # ratio of the two medians.
    import statistics

    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "on-demand", "--repeats", "3",
                  "--new-tokens", "3")
    row = next(r for r in report["rows"] if r["row"] == "on-demand")
    assert row.get("reason") is None and row["tokens_equal"] is True
    assert len(row["p50_runs_ms"]) == 3 and row["p50_ms"] == statistics.median(row["p50_runs_ms"])
    assert len(row["resident_adjacent_runs_ms"]) == 3
    want = statistics.median(row["p50_runs_ms"]) / statistics.median(row["resident_adjacent_runs_ms"])
    assert row["x_adjacent"] == pytest.approx(want)
    # Note [Best of the repeats]: the fastest of each side's three.
    best = min(row["p50_runs_ms"]) / min(row["resident_adjacent_runs_ms"])
    assert row["x_adjacent_best"] == pytest.approx(best)
    # One host steal reading per generate of each side (null off Linux).
    assert len(row["steal_runs_ms"]) == 3 and len(row["resident_adjacent_steal_ms"]) == 3
    assert all(s is None or s >= 0 for s in row["steal_runs_ms"] + row["resident_adjacent_steal_ms"])
    with pytest.raises(SystemExit):
        generate.main(["--smoke-cpu", "--repeats", "0"])



def test_paired_generates_against_a_second_resident_copy(tmp_path):
    # Note [Paired generates]: each row, the resident one included, runs
    # --paired pairs of --paired-tokens generates against a second resident
    # copy of the model; x_paired is the median of the pairs' ratios. The
    # copy generates the resident row's tokens.
    import statistics

    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "on-demand", "torch-by-hand",
                  "--paired", "3", "--paired-tokens", "3", "--new-tokens", "3")
    (block,) = report["blocks"]
    assert block["twin_reason"] is None and block["twin_tokens_equal"] is True
    for row in report["rows"]:
        assert row.get("reason") is None and row["tokens_equal"] is True, row
        pairs = row["paired_runs_ms"]
        assert len(pairs) == 3 and all(len(p) == 2 and min(p) > 0 for p in pairs)
        assert row["x_paired"] == pytest.approx(statistics.median(r / t for r, t in pairs))
        _check_figures(row)
    # Without --paired nothing is paired, and the figure says why it is null.
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "on-demand", "--new-tokens", "3")
    assert report["blocks"][0]["twin_reason"] == "not measured: --paired 0"
    for row in report["rows"]:
        assert row["x_paired"] is None and row["paired_runs_ms"] == []
        assert "--paired 0" in row["null_reasons"]["x_paired"]
    with pytest.raises(SystemExit):
        generate.main(["--smoke-cpu", "--paired", "-1"])

def test_ab_runs_two_engine_rows_side_by_side(tmp_path):
    # Note [Two rows side by side]: after the rows, the model offloaded as
    # ROW_A and the twin as ROW_B run --ab-pairs pairs of generates; x_ab
    # is the median of the pairs' A/B ratios, both sides generate the
    # resident tokens, and the model is restored after (the block's check).
    import statistics

    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "on-demand", "--paired", "1",
                  "--paired-tokens", "3", "--new-tokens", "3", "--ab", "oracle", "on-demand", "--ab-pairs", "3")
    (block,) = report["blocks"]
    ab = block["ab"]
    assert ab["rows"] == ["oracle", "on-demand"] and ab["share"] == report["config"]["shares"][0]
    assert ab["reason"] is None and ab["tokens_equal"] is True
    pairs = ab["pairs_ms"]
    assert len(pairs) == 3 and all(len(p) == 2 and min(p) > 0 for p in pairs)
    assert ab["x_ab"] == pytest.approx(statistics.median(a / b for a, b in pairs))
    assert ab["a_faster"] == sum(a < b for a, b in pairs) and 0 < ab["sign_p"] <= 1
    assert ab["x_ab_ci"] is None  # 3 pairs bound the median at 75 % at most
    # Note [Where a pair's time went]: per pair and side, the generate's
    # wall time (longer than its decode p50 step) and its engine counters'
    # change: each side's layer calls are the generate's forwards times the
    # model's MoE layers, and they sum to the row's host time's calls.
    detail = ab["pairs_detail"]
    layers = 4  # smoke-olmoe
    assert len(detail) == 3 and all(len(d) == 2 for d in detail)
    for pair, about in zip(pairs, detail):
        for p50, d in zip(pair, about):
            assert d["wall_ms"] > p50 and d["alloc_retries"] is None  # the CPU has no CUDA allocator
            assert d["calls"] == 3 * layers  # a prompt and two decode steps
            assert d["host_ms"] > 0 and d["engine_ms"] > 0 and d["sync_ms"] >= 0
            assert d["copies"] >= 0 and d["misses"] >= 0
    assert len(ab["copies"]) == 2 and all(isinstance(c, int) and c >= 0 for c in ab["copies"])
    assert len(ab["hit_rates"]) == 2 and all(0 <= h <= 1 for h in ab["hit_rates"])
    assert ab["parked_resident_experts"] is False
    assert block["restore_check"] is True
    assert report["config"]["ab"] == ["oracle", "on-demand"] and report["config"]["ab_pairs"] == 3
    # With --park-resident-experts the model's side runs parked, as the
    # engine rows do, and comes back bit-equal; with --ab-control it is
    # parked, restored after the control and parked again for the A/B.
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "1",
                  "--paired-tokens", "3", "--new-tokens", "3", "--ab", "gate", "on-demand", "--ab-pairs", "1",
                  "--park-resident-experts", "--ab-control")
    (block,) = report["blocks"]
    assert block["ab"]["reason"] is None and block["ab"]["tokens_equal"] is True
    assert block["ab"]["control"]["tokens_equal"] is True
    assert block["ab"]["parked_resident_experts"] is True and block["restore_check"] is True


def test_ab_lockstep_pairs_run_both_sides_in_turns(tmp_path, capsys):
    # Note [Lockstep pairs]: --ab-lockstep N adds N pairs whose generates
    # take turns a token at a time; the same figures as the alternating
    # pairs, both sides the resident tokens, the model restored after.
    import statistics

    from bench.lib import generate_ab

    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "1",
                  "--paired-tokens", "4", "--new-tokens", "4", "--ab", "gate", "on-demand", "--ab-pairs", "1",
                  "--ab-lockstep", "6")
    (block,) = report["blocks"]
    ab = block["ab"]
    assert ab["reason"] is None and len(ab["pairs_ms"]) == 1
    lock = ab["lockstep"]
    assert lock["tokens_equal"] is True
    pairs = lock["pairs_ms"]
    assert len(pairs) == 6 and all(len(p) == 2 and min(p) > 0 for p in pairs)
    ratios = [a / b for a, b in pairs]
    assert lock["x_ab"] == pytest.approx(statistics.median(ratios))
    assert lock["x_ab_ci"] is not None and lock["x_ab_ci"][:2] == [min(ratios), max(ratios)]
    assert lock["a_faster"] == sum(a < b for a, b in pairs) and 0 < lock["sign_p"] <= 1
    assert len(lock["handoffs_with_copies"]) == 2 and all(0 <= h <= 1 for h in lock["handoffs_with_copies"])
    prefills = lock["prefill_pairs_ms"]
    assert len(prefills) == 6 and all(len(p) == 2 and min(p) > 0 for p in prefills)
    assert lock["prefill_x_ab"] == pytest.approx(statistics.median(a / b for a, b in prefills))
    assert lock["prefill_a_faster"] == sum(a < b for a, b in prefills) and lock["prefill_x_ab_ci"] is not None
    assert block["restore_check"] is True and report["config"]["ab_lockstep"] == 6
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "1",
                  "--paired-tokens", "3", "--new-tokens", "3", "--ab", "gate", "on-demand", "--ab-pairs", "1")
    assert report["blocks"][0]["ab"]["lockstep"] is None  # none asked for
    # --ab-control: the same pairs first with ROW_B on both sides (the
    # estimators' own bias), then the A/B; both in the block's "ab".
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "1",
                  "--paired-tokens", "3", "--new-tokens", "3", "--ab", "gate", "on-demand", "--ab-pairs", "2",
                  "--ab-lockstep", "1", "--ab-control")
    (block,) = report["blocks"]
    ab, control = block["ab"], block["ab"]["control"]
    assert ab["reason"] is None and ab["rows"] == ["gate", "on-demand"] and report["config"]["ab_control"] is True
    assert control["rows"] == ["on-demand", "on-demand"] and control["tokens_equal"] is True
    assert len(control["pairs_ms"]) == 2 and len(control["lockstep"]["pairs_ms"]) == 1
    assert control["x_ab"] == pytest.approx(statistics.median(a / b for a, b in control["pairs_ms"]))
    assert len(control["copies"]) == 2 and len(ab["pairs_ms"]) == 2 and ab["tokens_equal"] is True
    assert block["restore_check"] is True
    # The same row twice is a valid --ab of its own, too.
    assert generate_ab.ab_rows(["on-demand", "on-demand"]) == ("on-demand", "on-demand")
    with pytest.raises(SystemExit):
        generate.main(["--smoke-cpu", "--ab", "gate", "on-demand", "--paired", "1", "--ab-lockstep", "-1"])
    # On a GPU a device-wide clock would charge each side the other's copies.
    capsys.readouterr()
    with pytest.raises(SystemExit):
        generate.main(["--ab", "gate", "on-demand", "--paired", "1", "--ab-lockstep", "2"])
    assert "--ab-lockstep needs --timer-sync stream" in capsys.readouterr().err


def _record_engine_modes(monkeypatch, what):
    """--ab's EngineMode replaced by a subclass that appends what(model,
    row) to a list as each side is offloaded: (the list, the subclass)."""
    from bench.lib import generate_ab

    made = []

    class Recording(generate_ab.EngineMode):
        def __init__(self, model, budget, row, *a, **kw):
            made.append(what(model, row))
            super().__init__(model, budget, row, *a, **kw)

    monkeypatch.setattr(generate_ab, "EngineMode", Recording)
    return made, Recording


def test_ab_swap_runs_each_row_on_each_copy_and_pools_the_pairs(tmp_path, monkeypatch):
    # Note [Two rows side by side]: --ab-swap runs the A/B again with ROW_B
    # on the model and ROW_A on the twin; "pooled" holds both runs' pairs
    # as [A, B], so a difference between the copies falls on each row in
    # half of them. The model comes back bit-equal, parked or not.
    import statistics

    from bench.lib import generate_ab

    made, Recording = _record_engine_modes(monkeypatch, lambda model, row: (model, row))
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "1",
                  "--paired-tokens", "3", "--new-tokens", "3", "--ab", "gate", "on-demand", "--ab-pairs", "3",
                  "--ab-lockstep", "1", "--ab-swap")
    (block,) = report["blocks"]
    ab = block["ab"]
    assert ab["reason"] is None and report["config"]["ab_swap"] is True and ab["control"] is None
    # The A/B: gate on the model, on-demand on the twin; then the other way.
    assert [row for _, row in made] == ["gate", "on-demand", "on-demand", "gate"]
    assert made[0][0] is made[2][0] and made[1][0] is made[3][0] and made[0][0] is not made[1][0]
    swapped, pooled = ab["swapped"], ab["pooled"]
    assert swapped["rows"] == ["on-demand", "gate"] and swapped["tokens_equal"] is True
    assert len(swapped["pairs_ms"]) == 3 and len(swapped["copies"]) == 2
    want = [list(p) for p in ab["pairs_ms"]] + [[g, o] for o, g in swapped["pairs_ms"]]
    assert pooled["pairs_ms"] == want and len(want) == 6
    # Each pair's details are turned round with its ms.
    assert pooled["pairs_detail"] == [list(d) for d in ab["pairs_detail"]] + [
        [g, o] for o, g in swapped["pairs_detail"]]
    assert all(d["wall_ms"] > ms for pair, about in zip(want, pooled["pairs_detail"]) for ms, d in zip(pair, about))
    assert pooled["x_ab"] == pytest.approx(statistics.median(g / o for g, o in want))
    assert pooled["a_faster"] == sum(g < o for g, o in want) and pooled["x_ab_ci"] is not None
    assert pooled["tokens_equal"] is True
    lock = pooled["lockstep"]
    assert lock["pairs_ms"] == [list(p) for p in ab["lockstep"]["pairs_ms"]] + [
        [g, o] for o, g in swapped["lockstep"]["pairs_ms"]]
    assert len(lock["pairs_ms"]) == 2 and lock["tokens_equal"] is True
    assert block["restore_check"] is True
    # Parked: restored and parked again between the A/B and its swap.
    made.clear()
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "1",
                  "--paired-tokens", "3", "--new-tokens", "3", "--ab", "gate", "on-demand", "--ab-pairs", "1",
                  "--park-resident-experts", "--ab-control", "--ab-swap")
    (block,) = report["blocks"]
    ab = block["ab"]
    assert ab["reason"] is None and ab["parked_resident_experts"] is True
    assert [row for _, row in made] == ["on-demand", "on-demand", "gate", "on-demand", "on-demand", "gate"]
    assert ab["control"]["tokens_equal"] is True and ab["swapped"]["tokens_equal"] is True
    assert len(ab["pooled"]["pairs_ms"]) == 2 and ab["pooled"]["lockstep"] is None
    assert block["restore_check"] is True
    # A swap that fails keeps the A/B's figures, says where it failed and
    # still restores the model.
    made.clear()

    class FailingOnTheSwap(Recording):
        def __init__(self, model, budget, row, *a, **kw):
            if len(made) == 2:
                raise RuntimeError("no room for the swapped cache")
            super().__init__(model, budget, row, *a, **kw)

    monkeypatch.setattr(generate_ab, "EngineMode", FailingOnTheSwap)
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "1",
                  "--paired-tokens", "3", "--new-tokens", "3", "--ab", "gate", "on-demand", "--ab-pairs", "2",
                  "--ab-swap")
    (block,) = report["blocks"]
    ab = block["ab"]
    assert ab["reason"] == "failed in --ab-swap setup: RuntimeError: no room for the swapped cache"
    assert len(ab["pairs_ms"]) == 2 and ab["tokens_equal"] is True and ab["x_ab"] is not None
    assert ab["swapped"]["pairs_ms"] == [] and ab["pooled"] is None
    assert block["restore_check"] is True
    monkeypatch.setattr(generate_ab, "EngineMode", Recording)
    # Without --ab-swap neither is written.
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "1",
                  "--paired-tokens", "3", "--new-tokens", "3", "--ab", "gate", "on-demand", "--ab-pairs", "1")
    assert report["blocks"][0]["ab"]["swapped"] is None and report["blocks"][0]["ab"]["pooled"] is None


def test_a_twin_made_after_engine_rows_runs_its_own_forward(tmp_path, monkeypatch):
    # An offload wraps the model's forward in an instance attribute bound to
    # the model; restore takes it off, so the twin the next batch deep-copies
    # (Note [Paired generates]) calls its own forward, not the model's.
    from bench import generate

    seen = []
    make_twin = generate.make_twin

    def probe(block):
        make_twin(block)
        seen.append((block.batch, "forward" in block.model.__dict__, "forward" in block.twin.__dict__))

    monkeypatch.setattr(generate, "make_twin", probe)
    report = _run(tmp_path, "--models", "smoke-olmoe", "--batches", "1", "2", "--rows", "resident", "on-demand",
                  "--paired", "1", "--paired-tokens", "3", "--new-tokens", "3")
    assert seen == [(1, False, False), (2, False, False)]
    assert all(b["restore_check"] is True for b in report["blocks"])


def test_ab_without_a_resident_twin_makes_a_lean_one_from_the_parked_model(tmp_path, monkeypatch, capsys):
    # Note [A lean twin]: --paired 0 and --park-resident-experts: each
    # side-by-side gets a new deep copy of the parked model, whose experts
    # are meta stand-ins (no second resident copy); tokens equal, the model
    # restored after.
    made, _ = _record_engine_modes(monkeypatch, lambda model, row: (
        model, row, [p.device.type for n, p in model.named_parameters() if "experts" in n]))
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "0",
                  "--paired-tokens", "3", "--new-tokens", "3", "--ab", "gate", "on-demand", "--ab-pairs", "2",
                  "--park-resident-experts", "--ab-control", "--ab-swap")
    (block,) = report["blocks"]
    ab = block["ab"]
    assert ab["reason"] is None and ab["twin"] == "lean" and ab["parked_resident_experts"] is True
    assert [row for _, row, _ in made] == ["on-demand", "on-demand", "gate", "on-demand", "on-demand", "gate"]
    models = [m for m, _, _ in made]
    assert models[0] is models[2] is models[4]  # side A: the model
    twins = models[1::2]
    assert len({id(t) for t in twins}) == 3 and all(t is not models[0] for t in twins)  # a new twin each time
    assert all(devices and set(devices) == {"meta"} for _, _, devices in made[1::2])  # no resident experts
    for part in (ab, ab["control"], ab["swapped"]):
        assert part["tokens_equal"] is True and len(part["pairs_ms"]) == 2
        # Each side ran on its own engine: a twin whose forward called the
        # model's (a wrapper copied from an earlier offload) counted nothing.
        assert all(h is not None for h in part["hit_rates"]) and all(c > 0 for c in part["copies"]), part
    assert len(ab["pooled"]["pairs_ms"]) == 4
    assert block["restore_check"] is True
    # Without a resident twin and without parking there is no second side.
    with pytest.raises(SystemExit):
        _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "0", "--ab", "gate",
             "on-demand")
    assert "--ab needs --paired >= 1 (its second side is the twin) or --park-resident-experts" in (
        capsys.readouterr().err)


class _FakeMode:
    """An engine row's mode as lockstep uses it: its handle's stats and
    new_sequence."""

    class ctl:  # noqa: N801 - stands in for the controller
        class handle:  # noqa: N801
            @staticmethod
            def stats():
                return {"queue_depth": 0, "bytes_in_flight": 1}

    def __init__(self):
        self.sequences = 0

    def new_sequence(self):
        self.sequences += 1


def _fake_block():
    import types

    import torch

    return types.SimpleNamespace(torch=torch, prompt=None, sync=lambda: None, timer_sync=lambda: None)


def test_lockstep_sides_never_run_at_once_and_alternate(monkeypatch):
    # Each side's forward (between its turn starting and its logits) runs
    # while the other side waits: the log never interleaves two sides'
    # forwards, and the sides alternate token by token, side i % 2 first
    # in pair i (the warm-up pair is pair 0). The two threads swap sides
    # every two pairs, so each side runs in both.
    import threading
    import time

    import torch

    from bench.lib import generate_ab

    log, lock, runs = [], threading.Lock(), []

    def fake_generate(torch_, model, prompt, tokens, sync, timer):
        with lock:
            runs.append((model, threading.get_ident()))
        for t in range(tokens):
            with lock:
                log.append((model, "start"))
            # A forward (the other side must not start meanwhile); the
            # prefill (t == 0) ten times as long.
            time.sleep(0.02 if t == 0 else 0.002)
            with lock:
                log.append((model, "end"))
            timer(None, None)
        return (torch.tensor([[7]]),)

    monkeypatch.setattr(generate_ab, "generate", fake_generate)
    sides = [(0, _FakeMode()), (1, _FakeMode())]
    got = generate_ab.lockstep_p50s(_fake_block(), sides, 3, 5, torch.tensor([[7]]), timeout_s=30)
    starts = [e[0] for e in log if e[1] == "start"]
    assert starts == [(i + k) % 2 for i in range(4) for k in range(10)]  # 1 warm-up and 3 counted pairs
    for i in range(0, len(log), 2):
        assert log[i][0] == log[i + 1][0] and (log[i][1], log[i + 1][1]) == ("start", "end")
    pairs, prefills = got["pairs_ms"], got["prefill_pairs_ms"]
    assert len(pairs) == 3 and all(p >= 2.0 for pair in pairs for p in pair)  # each step over its own forward
    assert len(prefills) == 3 and all(p >= 20.0 for pair in prefills for p in pair)  # the prefill, apart
    assert all(step < prefill for ps, fs in zip(pairs, prefills) for step, prefill in zip(ps, fs))
    assert got["tokens_equal"] is True and got["handoffs_with_copies"] == [1.0, 1.0]  # in flight at every hand-over
    threads = {side: [t for m, t in runs if m == side] for side in (0, 1)}
    assert threads[0][0] == threads[1][2] and threads[0][2] == threads[1][0]  # swapped at pair 2
    assert threads[0][0] != threads[0][2] and threads[0][:2] == threads[0][0:1] * 2
    assert sides[0][1].sequences == sides[1][1].sequences == 4  # a new sequence after each pair


def test_lockstep_a_failing_side_raises_its_error_and_wakes_the_other(monkeypatch):
    import time

    import torch

    from bench.lib import generate_ab

    def fake_generate(torch_, model, prompt, tokens, sync, timer):
        for t in range(tokens):
            if model == 1 and t == 2:
                raise ValueError("side 1 broke")
            timer(None, None)
        return (torch.tensor([[model]]),)

    monkeypatch.setattr(generate_ab, "generate", fake_generate)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="side 1 broke"):
        generate_ab.lockstep_p50s(_fake_block(), [(0, _FakeMode()), (1, _FakeMode())], 2, 6, timeout_s=60)
    assert time.monotonic() - t0 < 30  # woken, not timed out


def test_ab_says_why_it_did_not_run_and_refuses_bad_rows(tmp_path):
    # The oracle replays on-demand's recorded routing: without that row the
    # A/B does not run and says why; the model is still restored.
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "1",
                  "--new-tokens", "3", "--ab", "oracle", "gate", "--ab-pairs", "1")
    (block,) = report["blocks"]
    assert "no recorded routing trace" in block["ab"]["reason"] and block["ab"]["pairs_ms"] == []
    assert block["ab"]["x_ab"] is None and block["restore_check"] is True
    for bad in (["--ab", "torch-by-hand", "gate", "--paired", "1"],
                ["--ab", "gate", "on-demand"], ["--ab", "gate", "on-demand", "--paired", "1", "--ab-pairs", "0"],
                ["--ab", "gate", "on-demand", "--paired", "1", "--ab-share", "1.5"],
                ["--ab-swap"], ["--ab-control"], ["--ab-lockstep", "2"], ["--ab-share", "0.5"]):
        with pytest.raises(SystemExit):
            generate.main(["--smoke-cpu", *bad])


def test_a_failed_ab_says_where_and_restores_the_model(tmp_path, monkeypatch):
    # The twin's side fails to set up (the model's side did): the A/B says
    # in which phase, closes what it made, and the block's check finds the
    # model restored.
    from bench.lib import generate_ab

    made = []

    class FailingOnTheTwin(generate_ab.EngineMode):
        def __init__(self, model, *a, **kw):
            if made:
                raise RuntimeError("no room for the second cache")
            super().__init__(model, *a, **kw)
            made.append(self)

    monkeypatch.setattr(generate_ab, "EngineMode", FailingOnTheTwin)
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--paired", "1",
                  "--new-tokens", "3", "--ab", "gate", "on-demand", "--ab-pairs", "1")
    (block,) = report["blocks"]
    assert block["ab"]["reason"] == "failed in --ab setup: RuntimeError: no room for the second cache"
    assert block["ab"]["pairs_ms"] == [] and block["ab"]["x_ab"] is None
    assert len(made) == 1 and made[0].ctl.handle.closed
    assert block["restore_check"] is True


def test_profile_writes_each_rows_decode_steps(tmp_path):
    # --profile: one more generate per row under torch.profiler, from its
    # first logits call on (decode steps only); a Chrome trace and an op
    # table per row, and the row's "profile" per decode token. On the CPU
    # the GPU's figures are null; the tokens are still the resident ones.
    folder = tmp_path / "prof"
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "on-demand", "oracle",
                  "--new-tokens", "4", "--profile", str(folder), "--profile-tokens", "3")
    rows = report["rows"]
    assert [r["row"] for r in rows] == ["resident", "on-demand", "oracle"]
    for row in rows:
        assert row.get("reason") is None and row["tokens_equal"] is True, row
        prof = row["profile"]
        assert prof["decode_tokens"] == 2 and prof["wall_ms_per_token"] > 0
        assert prof["gpu_busy_ms_per_token"] is None and prof["kernel_launches_per_token"] is None
        stem = folder / ("smoke-olmoe_b2_all_resident" if row["share"] is None
                         else f"smoke-olmoe_b2_50pct_{row['row']}")
        trace = json.loads(stem.with_suffix(".json").read_text())
        assert trace["traceEvents"]  # the profiled steps' events
        assert "Self CPU" in stem.with_suffix(".txt").read_text()
    assert report["config"]["profile"] == str(folder)
    with pytest.raises(SystemExit):
        generate.main(["--smoke-cpu", "--profile", str(folder), "--profile-tokens", "1"])
    # Without --profile no row has one.
    report = _run(tmp_path, "--models", "smoke-olmoe", "--rows", "resident", "--new-tokens", "3")
    assert "profile" not in report["rows"][0]


def test_a_row_crowded_out_by_the_twin_runs_again_unpaired(tmp_path, monkeypatch):
    # Note [Paired generates]: the twin's room is an estimate (run 85: Qwen3
    # at a quarter ran out of memory beside it). A row that runs out of
    # memory while the twin exists frees it and runs again; the rows from
    # there on are unpaired, and the block says which row dropped it.
    import torch

    from bench.lib import generate_rows

    real = generate_rows.run_row
    calls = []

    def short_of_memory_beside_the_twin(block, row, share, trace):
        calls.append((row, block.twin is not None))
        if row == "on-demand" and block.twin is not None:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(block, row, share, trace)

    monkeypatch.setattr(generate_rows, "run_row", short_of_memory_beside_the_twin)
    report = _run(tmp_path, "--models", "smoke-olmoe", "--shares", "0.5", "--rows", "resident", "on-demand",
                  "torch-by-hand", "--paired", "2", "--paired-tokens", "3", "--new-tokens", "3")
    assert calls == [("resident", True), ("on-demand", True), ("on-demand", False), ("torch-by-hand", False)]
    (block,) = report["blocks"]
    assert block["twin_reason"].startswith("dropped: on-demand at 50%")
    rows = {r["row"]: r for r in report["rows"]}
    assert len(rows["resident"]["paired_runs_ms"]) == 2 and rows["resident"]["x_paired"] is not None
    for name in ("on-demand", "torch-by-hand"):
        row = rows[name]
        assert row.get("reason") is None and row["tokens_equal"] is True, row
        assert row["x_paired"] is None and row["paired_runs_ms"] == []
        assert "twin_reason" in row["null_reasons"]["x_paired"]  # which points at the block's, above
    # An out-of-memory error without a twin is the row's own failure.
    monkeypatch.setattr(generate_rows, "run_row",
                        lambda block, row, share, trace: (_ for _ in ()).throw(torch.OutOfMemoryError("x"))
                        if row == "on-demand" else real(block, row, share, trace))
    report = _run(tmp_path, "--models", "smoke-olmoe", "--shares", "0.5", "--rows", "resident", "on-demand",
                  "--new-tokens", "3")
    (row,) = [r for r in report["rows"] if r["row"] == "on-demand"]
    assert row["reason"].startswith("failed: OutOfMemoryError")


def test_engine_rows_preload_a_cache_that_holds_every_expert(tmp_path):
    # Note [Preload]: at a cache of every expert the engine rows start with
    # every expert queued at offload and the measured generate hits every
    # time; at half, nothing is preloaded. The tokens are the resident's.
    report = _run(tmp_path, "--models", "smoke-olmoe", "--shares", "0.5", "1.0", "--rows", "resident", "on-demand",
                  "gate", "--new-tokens", "3")
    rows = [r for r in report["rows"] if r["row"] in ("on-demand", "gate")]
    assert len(rows) == 4
    for row in rows:
        assert row.get("reason") is None and row["tokens_equal"] is True, row
        if row["share"] == 1.0:
            assert row["preloaded"] == 4 * 8  # every (layer, expert) of the smoke model
            assert row["hit_rate"] == 1.0
            assert row["copies"] == 0  # the preload had landed before the measured generate
        else:
            assert row["preloaded"] == 0
        assert row["preload_wait_s"] >= 0


def test_oracle_ttft_replays_the_ttft_prompts_routing():
    # The oracle row's TTFT generate runs on another prompt than the trace it
    # was given: before it, the mode swaps in that prompt's own routing (the
    # same predictor settings, the next-use handle kept).
    import torch
    import transformers

    from prefetch.integration import OraclePredictor, RoutingTrace

    cfg = transformers.OlmoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, intermediate_size=16, num_experts=4,
                                   num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    measured = RoutingTrace(2, 4, [[[0, 1], [2, 3]]])
    mode = generate_modes.EngineMode(model, 1 << 20, "oracle", measured, cuda=False)
    try:
        ttft = [[[1, 2, 3], [0, 3]]]
        mode.before_ttft(ttft)
        predictor = mode.ctl.predictor
        assert isinstance(predictor, OraclePredictor) and predictor.trace.steps == ttft
        assert mode.ctl.step == 0  # a new request
        mode.before_ttft(None)  # nothing recorded: the predictor is kept
        assert mode.ctl.predictor is predictor
    finally:
        mode.close()


def test_a_run_cut_short_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    # The device tool kills a run at its time limit (run 57 lost every row
    # of a 575 s run that way): the JSON written after each row stays.
    real = generate.run_planned_row
    done = []

    def cut_after_two(*a, **k):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(real(*a, **k))
        return done[-1]

    monkeypatch.setattr(generate, "run_planned_row", cut_after_two)
    path = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt):
        generate.main(["--smoke-cpu", "--models", "smoke-olmoe", "--rows", "resident", "on-demand", "gate",
                       "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["partial"] is True
    assert [r["row"] for r in report["rows"]] == [r["row"] for r in done] == ["resident", "on-demand"]
    assert report["rows"][1]["tokens_equal"] is True


def test_parked_resident_experts_come_back_bit_equal():
    # Note [Parked resident experts]: parked, the resident experts are on
    # the meta device (no memory) and the saved tensors gone; the model
    # offloads from the packed host copy and generates its own tokens; then
    # restore() copies them back from that copy, every byte as it was.
    # Parking twice, or from another model's host copy, is refused.
    import torch

    import prefetch
    from bench.lib.generate_model import SMOKE_MODELS, ModelState, build_model, moe_blocks
    from prefetch.hf import find_hf_moe_blocks
    from prefetch.host_experts import HostExperts

    family, shape = SMOKE_MODELS["smoke-qwen3-moe"]
    model = build_model(torch, family, shape, 64, "cpu", torch.float32)
    state = ModelState(model)
    before = [(e.gate_up_proj.detach().clone(), e.down_proj.detach().clone()) for _, e, _ in moe_blocks(model)]
    ids = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, max_new_tokens=3, do_sample=False)
    host = HostExperts(find_hf_moe_blocks(model), pin=False)
    other = build_model(torch, family, dict(shape, moe_intermediate_size=16), 64, "cpu", torch.float32)
    with pytest.raises(ValueError, match="not every expert of this model"):
        state.park(HostExperts(find_hf_moe_blocks(other), pin=False))
    state.park(host)
    with pytest.raises(RuntimeError, match="parked already"):
        state.park(host)
    for _, experts, params, _, _ in state.saved:
        assert experts.gate_up_proj.is_meta and experts.down_proj.is_meta
        # The resident weights' memory is gone, whoever holds the tensors.
        assert all(param.untyped_storage().nbytes() == 0 == data.untyped_storage().nbytes()
                   for param, data in params.values())
    ctl = prefetch.offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", host_experts=host)
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), want)
    finally:
        ctl.close()
    state.restore()
    assert state.parked is None
    for (_, experts, _), (gate_up, down) in zip(moe_blocks(model), before):
        assert torch.equal(experts.gate_up_proj, gate_up) and torch.equal(experts.down_proj, down)
        assert experts.gate_up_proj.is_contiguous() and experts.down_proj.is_contiguous()
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), want)


def test_a_restore_that_failed_half_way_resumes():
    # Note [Parked resident experts]: a restore that stops part-way (run
    # 106: out of memory beside the twin) leaves the model parked; the next
    # restore copies back only the layers still missing and the weights are
    # the resident ones again.
    import numpy as np
    import torch

    from bench.lib.generate_model import SMOKE_MODELS, ModelState, build_model, moe_blocks
    from prefetch.hf import find_hf_moe_blocks
    from prefetch.host_experts import HostExperts

    family, shape = SMOKE_MODELS["smoke-qwen3-moe"]
    model = build_model(torch, family, shape, 64, "cpu", torch.float32)
    state = ModelState(model)
    before = [(e.gate_up_proj.detach().clone(), e.down_proj.detach().clone()) for _, e, _ in moe_blocks(model)]
    host = HostExperts(find_hf_moe_blocks(model), pin=False)
    state.park(host)
    rows = host._row.copy()
    host._row[1] = rows[1][::-1]  # layer 1 refuses to come back
    with pytest.raises(RuntimeError, match="layer 1's experts are not in order"):
        state.restore()
    assert state.parked is host

    def sizes(layer):
        return [data.untyped_storage().nbytes() for _, data in state.saved[layer][2].values()]

    assert all(sizes(0)) and not any(sizes(1))  # layer 0 came back before the failure, layer 1 did not
    first = [data.data_ptr() for _, data in state.saved[0][2].values()]
    host._row[:] = rows
    state.restore()
    assert state.parked is None
    assert [data.data_ptr() for _, data in state.saved[0][2].values()] == first  # not copied a second time
    for (_, experts, _), (gate_up, down) in zip(moe_blocks(model), before):
        assert torch.equal(experts.gate_up_proj, gate_up) and torch.equal(experts.down_proj, down)
    assert np.array_equal(host._row, rows)


def test_park_refuses_weights_that_share_storage():
    # Parking frees each weight's storage: a weight whose storage holds
    # other tensors too is refused, and nothing is parked.
    import torch

    from bench.lib.generate_model import SMOKE_MODELS, ModelState, build_model, moe_blocks
    from prefetch.hf import find_hf_moe_blocks
    from prefetch.host_experts import HostExperts

    family, shape = SMOKE_MODELS["smoke-qwen3-moe"]
    model = build_model(torch, family, shape, 64, "cpu", torch.float32)
    _, experts, _ = moe_blocks(model)[0]
    both = torch.cat([experts.gate_up_proj.detach().flatten(), experts.down_proj.detach().flatten()])
    n = experts.gate_up_proj.numel()
    experts.gate_up_proj.data = both[:n].view_as(experts.gate_up_proj)
    experts.down_proj.data = both[n:].view_as(experts.down_proj)
    state = ModelState(model)
    with pytest.raises(ValueError, match="shares its storage"):
        state.park(HostExperts(find_hf_moe_blocks(model), pin=False))
    assert state.parked is None and not experts.gate_up_proj.is_meta
    assert experts.gate_up_proj.untyped_storage().nbytes() == both.numel() * both.element_size()


def test_engine_rows_park_the_resident_experts_when_asked(tmp_path):
    # --park-resident-experts: each engine row runs with the resident
    # experts parked and the model restored after it: the tokens are the
    # resident row's in every row, the block's closing resident check
    # passes, and the rows say they parked; the by-hand row does not park.
    report = _run(tmp_path, "--models", "smoke-qwen3-moe", "--shares", "1.0", "--rows", "resident", "on-demand",
                  "oracle", "torch-by-hand", "--new-tokens", "3", "--paired", "2", "--paired-tokens", "3",
                  "--park-resident-experts")
    rows = {r["row"]: r for r in report["rows"]}
    for name in ("on-demand", "oracle", "torch-by-hand"):
        assert rows[name].get("reason") is None and rows[name]["tokens_equal"] is True, rows[name]
        assert rows[name]["x_paired"] is not None
    assert rows["on-demand"]["parked_resident_experts"] is True and rows["oracle"]["parked_resident_experts"] is True
    assert not rows["torch-by-hand"].get("parked_resident_experts")
    (block,) = report["blocks"]
    assert block["restore_check"] is True and block["twin_reason"] is None


def test_shared_host_experts_go_with_their_model():
    # The packed host copy is kept per model object, and only while the
    # model lives: keyed by id(model) it outlived its model, and a later
    # model given the same id got another model's experts (TSan's CI run:
    # "the packed host experts are not every expert of this model").
    import torch

    from bench.lib.generate_model import SMOKE_MODELS, build_model
    from bench.lib.generate_modes import _HOST_EXPERTS, shared_host_experts

    gc.collect()
    before = len(_HOST_EXPERTS)
    family, shape = SMOKE_MODELS["smoke-olmoe"]
    model = build_model(torch, family, shape, 64, "cpu", torch.float32)
    host = shared_host_experts(model, False)
    assert shared_host_experts(model, False) is host  # packed once per model
    other = build_model(torch, family, shape, 64, "cpu", torch.float32)
    assert shared_host_experts(other, False) is not host
    ref = weakref.ref(host)
    del model, host, other
    gc.collect()
    assert ref() is None and len(_HOST_EXPERTS) == before


def test_referrer_chains_name_who_keeps_an_object_alive():
    # BM6's out-of-memory report follows what holds the largest CUDA
    # storages up to their owner (run 109's report stopped at "list").
    from bench.lib.generate_model import referrer_chains

    class Handle:
        def __init__(self):
            self.arenas = [bytearray(16)]

    class Controller:
        def __init__(self):
            self.handle = Handle()

    owners = {"ctl": Controller()}
    arena = owners["ctl"].handle.arenas[0]
    (chain,) = referrer_chains(arena)
    assert chain.startswith("list <- Handle <- Controller <- dict[ctl]"), chain
    assert referrer_chains(bytearray(4)) == []  # a temporary: nothing holds it


def test_storage_kinds_add_up_the_middle_sized_storages():
    # Run 109's report listed the six largest storages and left 26 GiB of
    # 138 unnamed: the report also groups every storage by kind.
    import torch

    from bench.lib.generate_model import storage_kinds

    small = [torch.empty(2, 3) for _ in range(5)]  # 5 x 24 bytes
    big = torch.empty(100, dtype=torch.uint8)  # one of 100 bytes
    view = torch.empty(32, dtype=torch.bfloat16)[:8]  # its storage's 64 bytes count, not the view's 16
    storages = [(24, t) for t in small] + [(100, big), (64, view)]
    lines = storage_kinds(storages, top=3)
    assert [line.split(" (")[0] for line in lines] == ["5 x", "1 x", "1 x"], lines
    assert lines[0].startswith("5 x (2, 3) float32 ("), lines  # 120 bytes in all: more than the single 100
    assert lines[1].startswith("1 x (100,) uint8 ("), lines
    assert lines[2].startswith("1 x (8,) bfloat16 ("), lines
    assert lines[0].endswith(f": {120 / 2**30:.2f} GiB")
    assert len(storage_kinds(storages, top=1)) == 1
    assert storage_kinds([]) == []


def test_a_failed_rows_frames_let_go_of_what_they_held():
    # run 109: a row that failed kept its cache alive through the restore
    # and the retry. clear_exception_frames drops the locals of the failed
    # calls' frames, of the exception and of the one it was raised during.
    from bench.lib.generate_rows import clear_exception_frames

    class Cache:
        pass

    def fails(cache):
        raise MemoryError("out of memory")

    def fails_while_handling(cache):
        try:
            fails(cache)
        except MemoryError:
            raise RuntimeError("restore failed") from None

    refs = []
    try:
        cache = Cache()
        refs.append(weakref.ref(cache))
        fails_while_handling(cache)
    except RuntimeError as exc:
        del cache
        assert refs[0]() is not None  # the failed frames still hold it
        clear_exception_frames(exc)
        gc.collect()
        assert refs[0]() is None


def _track_arenas(monkeypatch) -> list:
    """A weak reference to each engine row's cache arena, in the order the
    rows set up."""
    from bench.lib import generate_modes

    arenas = []
    init = generate_modes.EngineMode.__init__

    def engine_mode(self, *args, **kwargs):
        init(self, *args, **kwargs)
        arenas.append(weakref.ref(self.ctl.handle.arena(0)))

    monkeypatch.setattr(generate_modes.EngineMode, "__init__", engine_mode)
    return arenas


def test_a_row_crowded_out_by_the_twin_runs_again_without_it(tmp_path, monkeypatch):
    # Note [Paired generates]: a row that runs out of memory beside the
    # twin drops it and runs again, unpaired, with the experts parked and
    # restored around each try; the failed try's cache does not outlive it
    # (run 109: it was still alive through the retry).
    import torch

    from bench.lib import generate_rows

    arenas = _track_arenas(monkeypatch)
    tries = []
    measure = generate_rows.measure_row

    def measure_row(block, row, *args, **kwargs):
        tries.append(row)
        if row == "on-demand" and tries.count(row) == 1:
            raise torch.OutOfMemoryError("simulated: the twin crowds the cache out")
        return measure(block, row, *args, **kwargs)

    monkeypatch.setattr(generate_rows, "measure_row", measure_row)
    report = _run(tmp_path, "--models", "smoke-qwen3-moe", "--shares", "1.0", "--rows", "resident", "on-demand",
                  "--new-tokens", "3", "--paired", "2", "--paired-tokens", "3", "--park-resident-experts")
    rows = {r["row"]: r for r in report["rows"]}
    assert tries.count("on-demand") == 2
    assert rows["on-demand"].get("reason") is None and rows["on-demand"]["tokens_equal"] is True
    assert rows["on-demand"]["x_paired"] is None and rows["resident"]["x_paired"] is not None
    (block,) = report["blocks"]
    assert block["twin_reason"].startswith("dropped: on-demand") and block["restore_check"] is True
    gc.collect()
    assert len(arenas) == 2 and all(ref() is None for ref in arenas)


def test_a_rows_cache_is_gone_before_its_restore(tmp_path, monkeypatch):
    # Note [Parked resident experts]: the restore regrows the parked experts
    # where the row's cache was. Run 111: the measured generate's timer
    # (kept for the figures) held the row's mode through its callbacks, so
    # the 54 GiB cache was still alive and the restore ran out of memory
    # beside the twin. Each row's cache must be unreachable when the
    # restore starts.
    from bench.lib import generate_model

    arenas = _track_arenas(monkeypatch)
    alive_at_restore = []
    unpark = generate_model.ModelState._unpark

    def checked_unpark(self):
        gc.collect()
        alive_at_restore.append([ref() is not None for ref in arenas])
        return unpark(self)

    monkeypatch.setattr(generate_model.ModelState, "_unpark", checked_unpark)
    report = _run(tmp_path, "--models", "smoke-qwen3-moe", "--shares", "1.0", "--rows", "resident", "on-demand",
                  "gate", "--new-tokens", "3", "--paired", "2", "--paired-tokens", "3", "--park-resident-experts")
    assert all(r.get("reason") is None for r in report["rows"]), report["rows"]
    assert alive_at_restore == [[False], [False, False]]


def test_a_failed_row_names_the_phase_it_failed_in(tmp_path, monkeypatch):
    # A failed row's reason says what it was doing (run 106-109's rows
    # reported only "out of memory"), and, where the restore after it failed
    # too, both.
    from bench.lib import generate_rows

    def paired(block, mode, new_tokens):
        raise RuntimeError("injected")

    monkeypatch.setattr(generate_rows, "paired_p50s", paired)
    report = _run(tmp_path, "--models", "smoke-olmoe", "--shares", "0.5", "--rows", "resident", "on-demand",
                  "--new-tokens", "3")
    rows = {r["row"]: r for r in report["rows"]}
    assert rows["resident"]["reason"] == "failed: RuntimeError in its paired generates: injected"
    assert rows["on-demand"]["reason"].startswith("not run: the resident row did not run")

    block = generate_rows.Block.__new__(generate_rows.Block)
    block.phase, block.failed_in = "restore", "time to first token"
    assert generate_rows.failed_where(block) == " in its restore, after an error in its time to first token"
    block.phase = block.failed_in = None
    assert generate_rows.failed_where(block) == ""


def test_ab_sign_test_counts_the_pairs_and_gives_the_exact_p():
    from bench.lib.generate_ab import sign_test

    # Runs 168-169's splits: 7 and 4 of 12 (p from the binomial by hand).
    assert sign_test([[1, 2]] * 7 + [[2, 1]] * 5) == (7, 12, pytest.approx(2 * 1586 / 4096))
    assert sign_test([[1, 2]] * 4 + [[2, 1]] * 8) == (4, 12, pytest.approx(2 * 794 / 4096))
    assert sign_test([[1, 2]] * 10) == (10, 10, pytest.approx(2 / 1024))
    # Ties and missing sides count for nobody; with none left, no p.
    assert sign_test([[1, 1], [None, 2], [3, None]]) == (0, 0, None)
    assert sign_test([[1, 2], [2, 2]]) == (1, 1, 1.0)


def test_ab_median_ci_takes_the_order_statistics_of_the_binomial_law():
    from bench.lib.generate_ab import median_ci

    # Run 168's 12 pair ratios: the 3rd smallest and 3rd largest, covering
    # 1 - 2 (1 + 12 + 66) / 4096 = 96.1 % (the 4th would cover 85.4 %).
    ratios = [0.6, 0.721, 0.944, 0.951, 0.968, 0.975, 0.995, 1.003, 1.017, 1.053, 1.425, 1.761]
    low, high, coverage = median_ci(list(reversed(ratios)))
    assert (low, high) == (0.944, 1.053) and coverage == pytest.approx(1 - 2 * 79 / 4096)
    # Six ratios: min and max cover 1 - 2/64 = 96.9 %; five cannot reach 95 %.
    assert median_ci([3, 1, 2, 6, 5, 4]) == [1, 6, pytest.approx(62 / 64)]
    assert median_ci([1, 2, 3, 4, 5]) is None and median_ci([]) is None
    # A lower level takes a narrower interval.
    assert median_ci(ratios, level=0.8)[:2] == [0.951, 1.017]


@pytest.mark.parametrize("argv,message", [
    (["--shares", "-0.5"], "--shares must be in (0, 1]"),
    (["--shares", "0"], "--shares must be in (0, 1]"),
    (["--shares", "1.5"], "--shares must be in (0, 1]"),
    (["--batches", "0"], "--batches must be >= 1"),
    (["--warmup-tokens", "0"], "--warmup-tokens"),
    (["--prompt-tokens", "0"], "--prompt-tokens"),
    (["--vocab", "1"], "--vocab >= 2"),
])
def test_bad_sizes_get_a_usage_error_before_any_row(argv, message, capsys):
    # A share of -50 % ran the by-hand row with one slot and reported it
    # as measured; a batch of 0 or a vocab of 1 ended in a torch traceback.
    with pytest.raises(SystemExit) as exc:
        generate.main(["--smoke-cpu", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_full_share_holds_every_expert_whatever_its_padding():
    # gpt-oss's biases pad its experts' parts to 256-byte boundaries: a
    # budget of share x the tensors' bytes held a few experts too few, so
    # BM6's "every expert cached" rows evicted and copied.
    import torch

    from bench.lib.generate_model import SMOKE_MODELS, ModelState, build_model

    family, shape = SMOKE_MODELS["smoke-gpt-oss"]
    shape = {**shape, "hidden_size": 40, "intermediate_size": 24}  # a bias of 40 fp32 values: 160 bytes, padded
    model = build_model(torch, family, shape, 64, torch.device("cpu"), torch.float32)
    state = ModelState(model)
    assert state.layout.slot_bytes * state.num_experts * state.num_layers > state.total_bytes  # padded
    slots = state.cache_bytes(1.0) // state.layout.slot_bytes
    assert slots == state.num_layers * state.num_experts
    assert state.cache_bytes(0.25) // state.layout.slot_bytes == state.num_layers * state.num_experts // 4
