"""tools/gather_cost_probe.py (host cost of the ways to gather a layer's
expert slots) runs on the CPU and reports every way; each way gathering the
same weights as the resident row's index_select is checked by the tool
itself (it exits otherwise). No timing assertions."""
import json

import pytest
from conftest import load_tool


def test_gather_cost_probe_times_every_way_on_the_cpu(tmp_path):
    out = tmp_path / "gather.json"
    tool = load_tool("gather_cost_probe")
    assert tool.main(["--smoke-cpu", "--slots", "160", "--iterations", "5", "--rounds", "2",
                      "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["top_k"] == 6 and len(got["rounds"]) == 2
    assert set(got["median_us"]) == {"index3", "cat2", "cat1", "index2"}
    assert all(v > 0 for v in got["median_us"].values())


def test_gather_cost_probe_refuses_a_slot_tensor_smaller_than_a_layer():
    tool = load_tool("gather_cost_probe")
    with pytest.raises(SystemExit):
        tool.main(["--smoke-cpu", "--slots", "8"])
