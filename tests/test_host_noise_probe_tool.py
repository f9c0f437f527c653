"""tools/host_noise_probe.py (why one generate runs at several speeds on
the GPU machine's host) runs on the CPU with --smoke-cpu and reports what
it says: every setting ran both models in every round, the offloaded one
generated the resident model's tokens, and each ratio is the two p50s'. No
timing assertion."""
import json

import pytest
from conftest import load_tool

pytest.importorskip("transformers")


def test_host_noise_probe_runs_every_setting_on_both_models(tmp_path):
    out = tmp_path / "noise.json"
    assert load_tool("host_noise_probe").main(["--smoke-cpu", "--tokens", "3", "--rounds", "2",
                                               "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got["results"]) == {"free", "pin", "gc-off", "pin+gc-off"}
    for setting, rows in got["results"].items():
        assert set(rows) == {"resident", "on-demand"}
        for runs in rows.values():
            assert len(runs) == 2 and all(r["equal"] and r["p50"] > 0 and len(r["steps"]) == 2 for r in runs)
        assert all(0 <= r["hit_rate"] <= 1 for r in rows["on-demand"])
        summary = got["summary"][setting]
        want = [o["p50"] / r["p50"] for r, o in zip(rows["resident"], rows["on-demand"])]
        assert summary["ratios"] == pytest.approx(want)
    assert got["pinned_cpu"] in got["topology"]["affinity"]
