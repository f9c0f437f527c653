"""tools/bm5_host_proxy.py (BM5's decode step on the CPU, host work by
phase) runs and reports what it says: no timing assertions; every row has
its figures, the engine rows went through the engine, and with every
expert preloaded they copied nothing."""
import json
import os

import pytest
from conftest import load_tool

TRACE = os.path.join(os.path.dirname(__file__), "..", "traces", "gemma4-26b-a4b.json")
SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces", "gemma4-26b-a4b.json")


def trace_file(tmp_path):
    """A routing trace of gemma-4's counts (30 layers x 128 experts, top 6):
    the real one where this checkout has it, else a made-up one."""
    for path in (TRACE, SHARED):
        if os.path.exists(path):
            return path
    from prefetch.integration import RoutingTrace

    steps = [[[(7 * s + 3 * la + j * 11) % 128 for j in range(6)] for la in range(30)] for s in range(8)]
    path = tmp_path / "made_up.json"
    RoutingTrace(30, 128, steps).save(str(path))
    return str(path)


def test_bm5_host_proxy_reports_every_row(tmp_path):
    out = tmp_path / "proxy.json"
    tool = load_tool("bm5_host_proxy")
    assert tool.main([trace_file(tmp_path), "--steps", "2", "--warmup", "1", "--rounds", "1",
                      "--policies", "all-resident", "on-demand", "oracle", "on-demand-bare", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["model"] == "gemma4-26b-a4b"
    rows = {r["policy"]: r for r in got["rows"]}
    assert set(rows) == {"all-resident", "on-demand", "oracle", "on-demand-bare"}
    assert rows["all-resident"]["x_resident"] == 1.0
    for r in rows.values():
        assert r["p50_ms"] > 0
        assert {"sync", "acquire", "compute", "release"} <= set(r["host_us_per_layer"])
    for policy in ("on-demand", "oracle"):
        phases = rows[policy]["host_us_per_layer"]
        assert phases["engine"] > 0 and phases["speculate"] >= 0
        assert rows[policy]["experts_copied"] == 0  # preloaded: host work alone
    # The controller left out: the same engine, no controller phases.
    assert rows["on-demand-bare"]["experts_copied"] == 0
    assert "engine" not in rows["on-demand-bare"]["host_us_per_layer"]
    assert "speculate" not in rows["on-demand-bare"]["host_us_per_layer"]


def test_bm5_host_proxy_refuses_bad_arguments(tmp_path):
    tool = load_tool("bm5_host_proxy")
    path = trace_file(tmp_path)
    for bad in (["--share", "0"], ["--steps", "0"], ["--policies", "on-demand"], ["--model", "olmoe-1b-7b"]):
        with pytest.raises(SystemExit):
            tool.main([path, *bad])
