"""bench/engine_path.py runs on the host backend and reports every row,
the step plan's call among them; no timing assertions."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import engine_path  # noqa: E402


def test_engine_path_reports_every_row_on_the_host_backend(tmp_path):
    out = tmp_path / "engine_path.json"
    assert engine_path.main(["--backend", "host", "--layers", "4", "--experts", "16", "--top", "2",
                             "--iterations", "40", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["backend"] == "host"
    assert set(got["rows"]) == {"step", "exchange", "separate-calls", "pin-layer", "step-plan", "hints-one-time",
                                "hints-clear"}
    for row in got["rows"].values():
        assert row["p50_us"] > 0 and row["p90_us"] >= row["p50_us"] and row["iterations"] > 0
    assert got["rows"]["step-plan"]["per"] == "step"
    assert got["rows"]["hints-one-time"]["per"] == got["rows"]["hints-clear"]["per"] == "call"
    # The first handle's acquires hit but for its warm-up's; every expert of
    # the second is resident, so each of the step plan's pins finds its own.
    assert 0.5 < got["hit_rate"] < 1 and got["step_plan_pins_resident"] == 1.0
