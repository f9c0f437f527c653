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


@pytest.mark.parametrize("extra", [[], ["--predictor", "oracle", "--policy", "next-use", "--share", "0.25"],
                                   ["--predictor", "gate", "--record-trace", "--layers", "4", "--share", "0.5"]],
                         ids=["on-demand", "oracle", "gate"])
def test_layer_overhead_reports_every_figure(tmp_path, extra):
    out = tmp_path / "lo.json"
    assert load().main(["--tokens", "4", "--rounds", "1", "--json", str(out), *extra]) == 0
    got = json.loads(out.read_text())
    assert {r["model"] for r in got["rounds"]} == {"resident", "offloaded"}
    for r in got["rounds"]:
        assert r["ms_per_token"] > 0 and r["impl_us"] > 0 and r["call_us"] >= r["impl_us"]
    # The offloaded model's layers went through the engine (sync-free steps
    # pin, synced ones exchange).
    assert sum(got["methods_us"].get(m, {}).get("calls", 0) for m in ("pin_layer", "exchange")) > 0
    # Every MoE layer of each of the 4 forwards (the prompt's and 3 decode
    # steps) of the timed generate: the model has --layers of them.
    assert got["methods_us"]["begin_layer"]["calls"] == 4 * got["config"]["layers"]
    assert got["report"]["host_us_per_layer"] > 0


def test_layer_overhead_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        load().main(["--share", "0"])
