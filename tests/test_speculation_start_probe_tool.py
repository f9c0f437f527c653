"""tools/speculation_start_probe.py on the CPU (host backend): the routing
plan's guesses have the precision asked for, and a short run reports every
count per layer (a check that it runs; its figures are for the GPU)."""
from __future__ import annotations

import json

import numpy as np
from conftest import load_tool


def test_the_plan_guesses_the_next_layer_with_the_precision_asked():
    probe = load_tool("speculation_start_probe")
    plan = probe.routings(np.random.default_rng(3), layers=4, steps=3, experts=64, routed=21, precision=0.85,
                          guesses=20)
    assert len(plan) == 12 and plan[-1][1] is None
    for (need, guess), (nxt, _) in zip(plan, plan[1:]):
        assert need.shape == (21,) and np.unique(need).shape == (21,)
        assert guess.shape == (20,) and np.unique(guess).shape == (20,)
        assert np.intersect1d(guess, nxt).shape[0] == 17  # round(0.85 x 20) right, the rest wrong


def test_a_short_run_reports_every_count(tmp_path):
    probe = load_tool("speculation_start_probe")
    path = tmp_path / "p.json"
    assert probe.main(["--cpu", "--expert-mib", "0.0625", "--layers", "4", "--experts", "16", "--routed", "6",
                       "--guesses", "6", "--chain-us", "0", "200", "--steps", "2", "--warmup-steps", "1",
                       "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["cuda"] is False and [r["chain_us"] for r in report["rows"]] == [0, 200]
    for r in report["rows"]:
        assert r["ms_per_layer"] > 0 and r["misses_per_layer"] > 0 and 0 <= r["hit_rate"] <= 1
        assert r["guesses_queued_per_layer"] > 0
        assert min(r["guesses_cancelled_per_layer"], r["guesses_declined_per_layer"],
                   r["guesses_copied_per_layer"]) >= 0
