"""tools/copy_interference_probe.py (does copy traffic slow the serving
thread?) runs on the CPU with --smoke-cpu and reports what it measured:
every setting in every round, ratios that are the p50s over the same
round's quiet p50, and bytes copied only where a setting copies. No timing
assertion."""
import json

import pytest
from conftest import load_tool


def test_copy_interference_probe_runs_every_setting(tmp_path):
    out = tmp_path / "ci.json"
    assert load_tool("copy_interference_probe").main(["--smoke-cpu", "--steps", "2", "--rounds", "2",
                                                      "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    res = got["results"]
    assert set(res) == {"quiet", "dma", "thread", "thread-block"}
    assert all(len(runs) == 2 and all(r["p50_ms"] > 0 for r in runs) for runs in res.values())
    for s in ("dma", "thread", "thread-block"):
        want = [o["p50_ms"] / q["p50_ms"] for q, o in zip(res["quiet"], res[s])]
        assert got["summary"][s]["ratios_to_quiet"] == pytest.approx(want)
    assert all(r["bytes_copied"] > 0 for r in res["thread"] + res["thread-block"])  # the second thread copied
    assert all(r["bytes_copied"] == 0 for r in res["quiet"] + res["dma"])  # dma copies on CUDA only
    assert set(res["quiet"][0]["host_us_per_layer"]) >= {"sync", "acquire", "compute", "release"}
    assert got["link_gbps"] is None
