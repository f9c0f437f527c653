"""tools/prefill_copies.py (the CPU proxy of BM6's time-to-first-token cell
in engine counters) runs and reports what it says: both rows, the counters
of the prefill alone, and the resident model's tokens. No assertion on the
counts themselves: they depend on when the copy workers land a prefetch."""
import json

import pytest
from conftest import load_tool

pytest.importorskip("transformers")


def load():
    return load_tool("prefill_copies")


@pytest.mark.parametrize("extra", [[], ["--no-request-start-hints"]], ids=["hints", "no-hints"])
def test_prefill_copies_reports_both_rows(tmp_path, extra):
    out = tmp_path / "pc.json"
    assert load().main(["--prompt", "24", "--batch", "2", "--decode-tokens", "2", "--json", str(out), *extra]) == 0
    got = json.loads(out.read_text())
    assert [r["row"] for r in got["rows"]] == ["on-demand", "oracle"]
    assert got["config"]["no_request_start_hints"] is bool(extra)
    for r in got["rows"]:
        assert r["tokens_equal"] is True
        # Every acquire of the prefill is a hit or a miss, one per routed
        # (layer, expert): 16 layers, at most 64 experts each.
        assert 16 <= r["hits"] + r["misses"] <= 16 * 64
        assert r["copies"] >= r["misses"] and r["bytes_copied"] == r["copies"] * got["expert_bytes"]


def test_prefill_copies_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        load().main(["--share", "0"])
