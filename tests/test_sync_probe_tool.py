"""tools/sync_probe.py (where an offloaded generate makes the host wait for
the GPU) runs on the CPU with --smoke-cpu: every row and phase ran, and
its counts are null there, not zero (torch's sync debug mode watches CUDA
only). Its call-site summary keeps the innermost project frames."""
import json
import traceback

import pytest
from conftest import load_tool

pytest.importorskip("transformers")


def test_sync_probe_runs_every_row_and_reports_null_counts_without_cuda(tmp_path):
    out = tmp_path / "sync.json"
    assert load_tool("sync_probe").main(["--smoke-cpu", "--new-tokens", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["cuda"] is False and "no CUDA" in got["note"]
    assert set(got["rows"]) == {"on-demand", "gate", "oracle"}
    for phases in got["rows"].values():
        assert set(phases) == {"prefill", "decode"}
        assert phases["prefill"]["tokens"] == 1 and phases["decode"]["tokens"] == 3
        for phase in phases.values():
            assert phase["syncs"] is None and phase["wall_ms"] > 0


def test_sync_probe_refuses_an_unknown_row_and_a_bad_share():
    tool = load_tool("sync_probe")
    with pytest.raises(SystemExit):
        tool.main(["--smoke-cpu", "--rows", "lru"])
    with pytest.raises(SystemExit):
        tool.main(["--smoke-cpu", "--share", "0"])


def test_call_site_names_the_innermost_project_frames_first():
    tool = load_tool("sync_probe")
    frames = [traceback.FrameSummary("/x/site-packages/torch/nn/module.py", 1, "call"),
              traceback.FrameSummary("/x/transformers/generation/utils.py", 10, "generate"),
              traceback.FrameSummary("/x/prefetch/hf.py", 20, "forward"),
              traceback.FrameSummary("/x/prefetch/hf.py", 30, "_stand_for"),
              traceback.FrameSummary("/usr/lib/python3/warnings.py", 40, "warn")]
    assert tool.call_site(frames, depth=2) == "hf.py:30 _stand_for <- hf.py:20 forward"
    assert tool.call_site(frames[:1]) == "(elsewhere)"
