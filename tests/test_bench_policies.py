"""bench/policies.py: each engine policy's hit rate against Belady's on a
routing trace, per half of its decode steps."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.lib.trace_replay import capacity_for, replay
from prefetch.trace import RoutingTrace, belady_misses

ROOT = Path(__file__).resolve().parent.parent


def skewed_trace(seed=0, steps=41, layers=6, experts=16, top_k=2):
    rng = np.random.default_rng(seed)
    popular = rng.dirichlet(np.full(experts, 0.3), size=layers)
    trace = RoutingTrace(layers, experts)
    for s in range(steps):
        for layer in range(layers):
            trace.add(s, layer, rng.choice(experts, size=top_k, replace=False, p=popular[layer]))
    return trace


def test_replay_counts_every_access_and_never_beats_belady():
    trace = skewed_trace()
    for share in (0.1, 0.25, 0.5):
        capacity = capacity_for(trace, share)
        for policy in ("lru", "cyclic", "decay"):
            r = replay(trace, capacity, policy)
            per_step = [sum(len(e) for e in step) for step in trace.steps]
            assert (r.hits + r.misses).tolist() == per_step
            assert int(r.misses[1:].sum()) >= belady_misses(trace, capacity, 1)


def test_the_script_reports_both_halves(tmp_path):
    trace = skewed_trace(seed=3)
    path = tmp_path / "t.json"
    trace.save(str(path))
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/policies.py"), "--traces", str(path),
                           "--shares", "0.25", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["rows"]
    capacity = capacity_for(trace, 0.25)
    assert row["capacity"] == capacity
    fitted_steps = sum(len(e) for step in trace.steps[1:21] for e in step)
    assert row["belady_fitted"] == 1 - belady_misses(trace, capacity, 1, 21) / fitted_steps
    for policy in ("lru", "cyclic", "decay"):
        for half in ("fitted", "held_out"):
            assert 0 <= row[f"{policy}_{half}"] <= row[f"belady_{half}"]
    assert "t.json" in proc.stdout
