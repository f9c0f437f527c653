"""tools/ep_timeline.py on two small Chrome traces written here: the issue
times, NCCL kernel spans and per-layer host gaps it prints are those of the
events."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trace(path, issues_us, kernels):
    events = [{"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": t, "dur": 5} for t in issues_us]
    events += [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": t, "dur": d}
               for t, d in kernels]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1})  # not an all-reduce
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def run_tool(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ep_timeline.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_timeline_reports_each_ranks_gaps_and_spins(tmp_path):
    # rank 0 issues every 3 ms and its kernel waits for rank 1, which issues every 4 ms
    r0 = _trace(tmp_path / "r0.json", [1000, 4000, 7000], [(1100, 2000), (4100, 4000), (7100, 6000)])
    r1 = _trace(tmp_path / "r1.json", [3000, 7000, 11000], [(3100, 10), (7100, 10), (11100, 10)])
    out = run_tool(r0, r1)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split() == ["0", "0.00", "0.10+2.00", "2.00", "2.10+0.01"]
    assert "rank 0: host ms between all-reduces p50 3.00; NCCL kernel ms p50 4.00, sum 12.0 over 3" in out.stdout
    assert "rank 1: host ms between all-reduces p50 4.00; NCCL kernel ms p50 0.01, sum 0.0 over 3" in out.stdout


def test_timeline_without_all_reduces_says_so(tmp_path):
    empty = _trace(tmp_path / "e.json", [], [])
    out = run_tool(empty)
    assert out.returncode == 1 and "no all-reduce" in out.stdout
