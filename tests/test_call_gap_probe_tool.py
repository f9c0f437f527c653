"""tools/call_gap_probe.py (one layer's engine crossing back to back and
with gaps between calls) runs and reports what it says: every way timed
every call of every round, nothing was copied while it measured (every
expert resident), and the engine's share of a call is within the call. No
timing assertion."""
import json

import pytest
from conftest import load_tool

TRACE = {"format": "prefetch-routing-trace/1", "num_layers": 2, "num_experts": 4,
         "steps": [[[0, 1], [2]], [[1, 3], [0, 2]], [[2], [3]]]}


def test_call_gap_probe_times_every_call_three_ways(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(TRACE))
    out = tmp_path / "gap.json"
    assert load_tool("call_gap_probe").main([str(trace), "--steps", "2", "--rounds", "2", "--gap-us", "50",
                                             "--sweep-mib", "0.5", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["copies_while_measured"] == 0
    assert set(got["calls"]) == {"back-to-back", "gap", "sweep"}
    for way in got["calls"].values():
        assert len(way["call_us"]) == len(way["engine_us"]) == 2 * 2 * 2  # rounds x steps x layers
        assert all(0 < e <= c for c, e in zip(way["call_us"], way["engine_us"]))


def test_call_gap_probe_refuses_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        load_tool("call_gap_probe").main([str(tmp_path / "t.json"), "--rounds", "0"])
