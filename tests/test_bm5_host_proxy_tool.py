"""tools/bm5_host_proxy.py (BM5's decode step on the CPU, host work by
phase) runs and reports what it says: no timing assertions; every row has
its figures, the engine rows went through the engine, and with every
expert preloaded they copied nothing."""
import json
import os

import pytest
from conftest import load_tool

TRACE = os.path.join(os.path.dirname(__file__), "..", "traces", "gemma4-26b-a4b.json")
SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces", "gemma4-26b-a4b.json")


def trace_file(tmp_path):
    """A routing trace of gemma-4's counts (30 layers x 128 experts, top 6):
    the real one where this checkout has it, else a made-up one."""
    for path in (TRACE, SHARED):
        if os.path.exists(path):
            return path
    from prefetch.integration import RoutingTrace

    steps = [[[(7 * s + 3 * la + j * 11) % 128 for j in range(6)] for la in range(30)] for s in range(8)]
    path = tmp_path / "made_up.json"
    RoutingTrace(30, 128, steps).save(str(path))
    return str(path)


def test_bm5_host_proxy_reports_every_row(tmp_path):
    out = tmp_path / "proxy.json"
    tool = load_tool("bm5_host_proxy")
    assert tool.main([trace_file(tmp_path), "--steps", "2", "--warmup", "1", "--rounds", "1",
                      "--policies", "all-resident", "on-demand", "oracle", "on-demand-bare", "bare-no-engine",
                      "arena-table", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["model"] == "gemma4-26b-a4b"
    rows = {r["policy"]: r for r in got["rows"]}
    assert set(rows) == {"all-resident", "on-demand", "oracle", "on-demand-bare", "bare-no-engine", "arena-table"}
    assert rows["all-resident"]["x_resident"] == 1.0
    for r in rows.values():
        assert r["p50_ms"] > 0
        assert {"sync", "acquire", "compute", "release", "other"} <= set(r["host_us_per_layer"])
        assert r["host_us_per_layer"]["other"] > 0  # norms, attention, router: never free
    for policy in ("on-demand", "oracle"):
        phases = rows[policy]["host_us_per_layer"]
        assert phases["engine"] > 0 and phases["speculate"] >= 0
        assert rows[policy]["experts_copied"] == 0  # preloaded: host work alone
        # The acquire's parts (Note [The acquire's parts]) are timed inside it.
        parts = [phases[k] for k in ("acquire.route_l0", "acquire.route", "acquire.gather")]
        assert min(parts) > 0 and sum(parts) <= phases["acquire"]
    assert not any(k.startswith("acquire.") for k in rows["all-resident"]["host_us_per_layer"])
    # The controller left out: the same engine, no controller phases.
    assert rows["on-demand-bare"]["experts_copied"] == 0
    assert "engine" not in rows["on-demand-bare"]["host_us_per_layer"]
    assert "speculate" not in rows["on-demand-bare"]["host_us_per_layer"]
    for policy in ("bare-no-engine", "arena-table"):  # the engine only before the measured steps
        assert rows[policy]["experts_copied"] == 0
        assert "engine" not in rows[policy]["host_us_per_layer"]


def test_bm5_host_proxy_rows_without_the_engine_compute_what_the_resident_row_does(tmp_path):
    # bare-no-engine and arena-table take the cache's rows from a table made
    # once: their decode output must be the resident model's, bit for bit
    # (a wrong slot would gather another expert's weights).
    import torch

    tool = load_tool("bm5_host_proxy")
    from bench.e2e_decoder import MODELS, Decoder
    from bench.e2e_providers import make_provider

    spec = dict(MODELS["gemma4-26b-a4b"], layers=3, experts=16, hidden=64, inter=32)
    dec = Decoder(torch, spec, 8, device="cpu")
    try:
        x = dec.inputs(1, 1, seed=2)[0]
        want = dec.step(x, make_provider(dec, "all-resident", 0, None))
        budget = spec["layers"] * spec["experts"] * dec.slot_bytes
        undo = tool.fault_handles(__import__("prefetch"))
        try:
            for cls in (tool.NoEngineProvider, tool.ArenaTableProvider):
                provider = cls(make_provider(dec, "on-demand", budget, None, "cyclic"))
                try:
                    tool.preload_all(provider, budget // dec.slot_bytes, spec["layers"] * spec["experts"])
                    provider.learn_rows()
                    assert torch.equal(dec.step(x, provider), want), cls.__name__
                finally:
                    provider.close()
        finally:
            undo()
    finally:
        dec.remove_pool_file()


def test_bm5_host_proxy_refuses_bad_arguments(tmp_path):
    tool = load_tool("bm5_host_proxy")
    path = trace_file(tmp_path)
    for bad in (["--share", "0"], ["--steps", "0"], ["--policies", "on-demand"], ["--model", "olmoe-1b-7b"]):
        with pytest.raises(SystemExit):
            tool.main([path, *bad])
    # The rows without an engine call need the whole cache: refused at once.
    for row in ("arena-table", "bare-no-engine"):
        with pytest.raises(SystemExit):
            tool.main([path, "--share", "0.5", "--policies", "all-resident", row])
