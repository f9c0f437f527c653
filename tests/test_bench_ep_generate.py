"""BM7 (bench/ep_generate.py) on the CPU: `torchrun --nproc-per-node 2
--smoke-cpu`, two real gloo ranks, tiny Qwen3-MoE and OLMoE. The logic only
(no timing assertions): every row exists, tokens equal the resident run's,
each rank registered its half. The launcher runs in its own session with a
deadline; leftovers are killed, so a stuck rank cannot hang CI."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ep_smoke_under_torchrun(tmp_path):
    path = tmp_path / "bm7.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "bench", "ep_generate.py"), "--smoke-cpu", "--timeout-s", "60", "--json", str(path),
           "--profile", str(tmp_path / "prof"), "--profile-tokens", "2", "--placement", "activations"]
    pinned = len(os.sched_getaffinity(0)) >= 2  # --pin-cpus needs a CPU per rank
    cmd += ["--pin-cpus"] if pinned else []
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"bench/ep_generate.py --smoke-cpu did not finish in 240 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    report = json.loads(path.read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo" and report["smoke_cpu"]
    # --pin-cpus: each rank on its own share of the CPUs this test may use
    cpus = report["cpus_per_rank"]
    assert report["config"]["pin_cpus"] is pinned and all(cpus)
    assert report["config"]["placement"] == "activations"
    if pinned:
        assert not set(cpus[0]) & set(cpus[1]) and set(cpus[0]) | set(cpus[1]) <= os.sched_getaffinity(0)
    rows = report["rows"]
    want = {(m, b, s, mode) for m in ("smoke-qwen3-moe", "smoke-olmoe") for b in (1, 8) for s in (0.25, 0.5)
            for mode in ("1-gpu", "ep")}
    want |= {(m, b, None, "resident") for m in ("smoke-qwen3-moe", "smoke-olmoe") for b in (1, 8)}
    assert {(r["model"], r["batch"], r["share"], r["mode"]) for r in rows} == want
    for r in rows:
        assert r["p50_ms"] > 0 and r["p90_ms"] >= r["p50_ms"] and r["decode_tokens"] == 3
        if r["mode"] == "resident":
            continue
        assert r["tokens_equal"] is True and r["first_mismatch"] is None, r
        if r["mode"] == "ep":
            assert r["ranks_agree"] is True and r["x_1gpu"] > 0
            # 4 layers x 8 experts, half on each rank; the cache is share x the slice.
            assert r["registered_per_rank"] == [16, 16]
            assert all(h is None or 0 <= h <= 1 for h in r["hit_rate_per_rank"])
            assert all(us > 0 for us in r["allreduce_us_per_layer_per_rank"])
            for counts in r["engine_counts_per_rank"]:  # the measured tokens' copies, this rank's own
                assert counts["copies"] > 0 and counts["on_demand"] <= counts["copies"]
            single = next(s for s in rows if s["mode"] == "1-gpu" and (s["model"], s["batch"], s["share"])
                          == (r["model"], r["batch"], r["share"]))
            assert 2 * r["budget_bytes_per_rank"] == single["budget_bytes_per_rank"]
            # --profile: every rank profiled 2 tokens of this row (no GPU here: no device time)
            for rank, prof in enumerate(r["profile_per_rank"]):
                assert prof["tokens"] == 2 and prof["wall_ms_per_token"] > 0 and prof["gpu_busy_ms_per_token"] == 0
                assert prof["h2d_busy_ms_per_token"] == 0 and prof["link_idle_gpu_idle_ms_per_token"] == 0
                stem = tmp_path / "prof" / f"ep_b{r['batch']}_s{r['budget_bytes_per_rank']}_rank{rank}"
                assert (stem.with_suffix(".json")).stat().st_size > 0 and "Name" in stem.with_suffix(".txt").read_text()
