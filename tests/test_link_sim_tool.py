"""tools/link_sim.py (BM5's decode loop against the fault backend's
simulated link) runs and reports what it says: every policy decoded the
measured steps, the copies it counts are the engine's, the link was never
busier than the wall time allows, and the oracle, which knows every layer's
experts ahead, fetches no more on demand than on-demand itself. No timing
assertion."""
import json

import pytest
from conftest import load_tool

# 4 layers x 8 experts, 7 steps: the cache of a quarter holds 8 of 32.
STEPS = [[[s % 8, (s + 3) % 8], [(2 * s) % 8], [(s + 5) % 8, (3 * s) % 8], [(5 * s + 1) % 8]] for s in range(7)]
TRACE = {"format": "prefetch-routing-trace/1", "num_layers": 4, "num_experts": 8, "steps": STEPS}


def test_link_sim_reports_every_policy(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(TRACE))
    out = tmp_path / "sim.json"
    assert load_tool("link_sim").main([str(trace), "--steps", "4", "--warmup", "1", "--host-us", "50",
                                       "--expert-us", "200", "--policies", "on-demand", "oracle", "oracle:3",
                                       "--option", "copy_poll_us=10", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["config"]["option"] == {"copy_poll_us": 10}
    assert got["io_floor_ms"] > 0 and got["floor_ms"] >= got["host_ms"]
    rows = {r["policy"]: r for r in got["rows"]}
    assert set(rows) == {"on-demand", "oracle", "oracle:3"}
    for r in rows.values():
        assert r["experts_copied_per_step"] > 0
        # the measured steps: from --trace-from 1, after one warm-up step
        assert r["hits"] + r["misses"] == sum(len(set(e)) for step in STEPS[2:6] for e in step)
        # A copy counts whole once issued: what is still on the link when the
        # measured steps end (speculation up to its cap, Note [A cap that
        # follows the worker's wake-ups]) counts too.
        assert 0 < r["link_busy"] <= 1.0 + r["in_flight_ms_at_end"] / r["measured_ms"]
        assert r["idle_ms_before_lane"] >= 0 and r["idle_ms_before_urgent"] >= 0
    assert rows["on-demand"]["cancelled"] == 0 and rows["on-demand"]["idle_ms_before_lane"] == 0
    assert rows["oracle"]["on_demand"] <= rows["on-demand"]["on_demand"]


@pytest.mark.parametrize("args", [["--share", "0"], ["--policies", "gate"], ["--policies", "on-demand:2"],
                                  ["--option", "copy_poll_us"], ["--steps", "50"]])
def test_link_sim_refuses_bad_arguments(tmp_path, args):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(TRACE))
    with pytest.raises(SystemExit):
        load_tool("link_sim").main([str(trace), *args])
