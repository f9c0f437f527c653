"""tools/layer_overhead.py (the CPU proxy for an offloaded layer's host
work) runs and reports what it says: no timing assertions, only that every
figure exists, and that the offloaded model's calls went through the
wrapper it times."""
import json

import pytest
from conftest import load_tool

pytest.importorskip("transformers")


def load():
    return load_tool("layer_overhead")


@pytest.mark.parametrize("extra", [[], ["--predictor", "oracle", "--policy", "next-use", "--share", "0.25"]],
                         ids=["on-demand", "oracle"])
def test_layer_overhead_reports_every_figure(tmp_path, extra):
    out = tmp_path / "lo.json"
    assert load().main(["--tokens", "4", "--rounds", "1", "--json", str(out), *extra]) == 0
    got = json.loads(out.read_text())
    assert {r["model"] for r in got["rounds"]} == {"resident", "offloaded"}
    for r in got["rounds"]:
        assert r["ms_per_token"] > 0 and r["impl_us"] > 0 and r["call_us"] >= r["impl_us"]
    assert got["methods_us"]["pin_layer"]["calls"] > 0  # the offloaded model's layers went through it
    assert got["report"]["host_us_per_layer"] > 0


def test_layer_overhead_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        load().main(["--share", "0"])
