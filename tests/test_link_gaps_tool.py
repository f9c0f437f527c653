"""tools/link_gaps.py on a Chrome trace written here: each gap on the link
is split at the device-to-host copy inside it, as the events say."""
from __future__ import annotations

import json

from conftest import load_tool


def _ev(name, cat, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_gaps_split_at_the_routing_read_back(tmp_path, capsys):
    link_gaps = load_tool("link_gaps")
    h2d = "Memcpy HtoD (Pinned -> Device)"
    events = [
        _ev(h2d, "gpu_memcpy", 0, 100), _ev(h2d, "gpu_memcpy", 50, 40),  # overlapping copies: one busy span
        _ev("gemm", "kernel", 100, 40),
        _ev("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 150, 10),  # the routing, read back at 160
        _ev(h2d, "gpu_memcpy", 200, 100),  # gap [100, 200]: gpu 60, host 40
        _ev(h2d, "gpu_memcpy", 400, 100),  # gap [300, 400]: no read-back inside, "other"
        _ev(h2d, "gpu_memcpy", 510, 10),  # gap of 10 us: under --min-us
        _ev("aten::mm", "cpu_op", 0, 1000),  # a host op: not on the GPU
    ]
    g = link_gaps.gaps(events, 20.0)
    assert (g["gaps"], g["gap_us"], g["gpu_us"], g["host_us"], g["other_us"]) == (2, 200, 60, 40, 100)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert link_gaps.main([str(path), "--tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "1.0 gaps, 0.10 ms idle per token: gpu chain 0.03, host 0.02, other 0.05" in out
    # busy [0,100] [200,300] [400,500] [510,520] = 310 us of a 520 us span
    assert (g["busy_us"], g["span_us"], g["copies"]) == (310, 520, 5)
    assert "link busy 0.15 of 0.26 ms per token (60%), 2.5 copies" in out


def test_link_rate_counts_the_copies_bytes_over_the_busy_time():
    link_gaps = load_tool("link_gaps")
    h2d = "Memcpy HtoD (Pinned -> Device)"
    events = [dict(_ev(h2d, "gpu_memcpy", 0, 100), args={"bytes": 4_000_000}),
              dict(_ev(h2d, "gpu_memcpy", 300, 100), args={"bytes": 2_000_000}),
              dict(_ev("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 150, 10), args={"bytes": 64})]
    g = link_gaps.gaps(events, 20.0)
    assert (g["h2d_bytes"], g["busy_us"]) == (6_000_000, 200)  # the read-back's bytes are not the link's
