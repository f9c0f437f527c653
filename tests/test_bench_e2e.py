"""BM5's logic on the CPU: every policy (engine on the host backend, the
by-hand LRU, predictors) must compute exactly what all-resident computes."""
import numpy as np
import pytest
import torch

from bench import e2e


def test_every_policy_computes_the_same_decode(capsys):
    assert e2e.main(["--smoke-cpu"]) == 0
    assert "smoke ok (1 device(s), grouped)" in capsys.readouterr().out


def test_layers_split_over_two_devices_compute_the_same_decode(capsys):
    # The host backend with two device caches stands in for two GPUs: the
    # layer split, per-device budgets and per-device by-hand caches run.
    assert e2e.main(["--smoke-cpu", "--devices", "2", "--eviction", "lru"]) == 0
    assert "smoke ok (2 device(s), grouped)" in capsys.readouterr().out


def test_device_budgets_split_by_layers():
    import torch

    spec = dict(layers=4, experts=2, top_k=1, hidden=8, inter=4, name="t")
    dec = e2e.Decoder(torch, spec, pool=2, device="cpu", devices=2)
    assert dec.layer_dev == [0, 0, 1, 1]
    assert dec.device_budgets(5 * dec.slot_bytes) == [2 * dec.slot_bytes, 2 * dec.slot_bytes]


def test_table_keeps_unmeasured_runs_null():
    row = {"model": "m", "batch": 1, "cache_share": 0.1, "policy": "oracle", "p50_ms": None, "p90_ms": None,
           "floor_ms": 3.0}
    assert "null" in e2e.format_table([row])


def test_compute_only_is_the_faster_of_two_runs():
    rows = [
        {"policy": "all-resident", "io_floor_ms": 1.0, "p50_ms": 30.0},
        {"policy": "oracle", "io_floor_ms": 25.0, "p50_ms": 27.5},
        {"policy": "trace", "io_floor_ms": 1.0, "p50_ms": None},
    ]
    e2e.settle_compute_only(rows, [0.030, 0.031, 0.032], [0.020, 0.021, 0.022])
    assert rows[0]["compute_only_runs_ms"] == [31.0, 21.0]
    assert rows[0]["compute_only_ms"] == 21.0 and rows[0]["p50_ms"] == 21.0 and rows[0]["over_floor"] == 1.0
    assert rows[1]["floor_ms"] == 25.0 and abs(rows[1]["over_floor"] - 1.1) < 1e-12
    assert rows[1]["stall_ms"] == 27.5 - 21.0
    assert rows[2]["floor_ms"] == 21.0 and "over_floor" not in rows[2]


def test_io_floor_uses_the_faster_raw_measurement_per_device():
    # Two devices: 10 GB/step over 50 GB/s, 6 GB/step over 20 -> 40 later.
    rows = [{"policy": "oracle", "compute_only_ms": 100.0, "belady_bytes_per_step_each": [10e9, 6e9],
             "p50_ms": 250.0},
            {"policy": "trace", "compute_only_ms": 100.0, "belady_bytes_per_step_each": [1e9, 1e9], "p50_ms": None}]
    e2e.settle_raw(rows, [50.0, 20.0], [45.0, 40.0])
    assert rows[0]["raw_h2d_gbps_each"] == [50.0, 40.0] and rows[0]["raw_h2d_gbps"] == 90.0
    assert rows[0]["io_floor_ms"] == 200.0  # device 0 is now the slowest: 10e9 / 50e9 s
    assert rows[0]["floor_ms"] == 200.0 and rows[0]["over_floor"] == 1.25
    assert rows[1]["floor_ms"] == 100.0 and "over_floor" not in rows[1]  # compute-bound, not run
    assert rows[0]["raw_h2d_gbps_runs_each"] == [[50.0, 20.0], [45.0, 40.0]]


def test_the_rounds_own_floors_take_the_settled_io_floor():
    # Each round was compared with the IO floor of the first raw reading
    # (record_round); the settled floor is lower when the second reading is
    # faster, and the rounds' ratios must use the floor the row reports
    # (run 162's gpt-oss oracle: 1.097 written, 1.100 against its own floor).
    row = {"p50_runs_ms": [], "resident_runs_ms": [], "p50_ms": None, "p90_ms": None, "compute_only_ms": 20.0,
           "belady_bytes_per_step_each": [3e9]}
    for p50, resident in ((0.033, 0.020), (0.036, 0.021), (0.031, 0.019)):
        e2e.record_round(row, [p50] * 5, {"hits": 0, "misses": 4, "bytes": 99}, compute_p50=0.020, floor_s=0.030,
                         res_round=[resident] * 5, io_floor_s=0.030)  # 3 GB at 100 GB/s
    assert row["x_floor_adjacent"] == 33 / 30
    e2e.settle_raw([row], [100.0], [120.0])  # the second reading faster: 25 ms
    assert row["io_floor_ms"] == 25.0
    assert row["x_floor_runs"] == [33 / 25, 36 / 25, 31 / 25] and row["x_floor_adjacent"] == 33 / 25
    assert row["over_floor"] == row["p50_ms"] / 25.0


def test_experts_use_the_whole_pool_whatever_the_devices():
    # Runs 8 and 9 took the pool size from the per-device list of pools (its
    # length is the device count), so every expert used pool entry 0.
    import torch

    spec = dict(layers=4, experts=8, top_k=1, hidden=8, inter=4, name="t")
    used = {}
    for devices in (1, 2):
        dec = e2e.Decoder(torch, spec, pool=5, device="cpu", devices=devices)
        used[devices] = [dec.pool_index(layer, e) for layer in range(4) for e in range(8)]
        assert set(used[devices]) == set(range(5))
    assert used[1] == used[2]


def test_repeats_take_the_median_round_and_its_adjacent_resident():
    row = {"p50_runs_ms": [], "resident_runs_ms": [], "p50_ms": None, "p90_ms": None}
    # round 1: 30 ms against a 20 ms resident; round 2: 24 against 20; round 3: 50 against 25 (a slow moment)
    e2e.record_round(row, [0.030] * 5, {"hits": 3, "misses": 1, "bytes": 8, "precision": 0.5, "recall": None},
                     compute_p50=0.020, floor_s=0.020, res_round=[0.020] * 5, io_floor_s=0.010)
    assert row["p50_ms"] == 30.0 and row["hit_rate"] == 0.75 and row["bytes_moved"] == 8
    assert row["x_adjacent"] == 1.5 and abs(row["over_floor"] - 1.5) < 1e-9
    e2e.record_round(row, [0.024] * 5, {"hits": 0, "misses": 4, "bytes": 99}, 0.020, 0.020, [0.020] * 5, 0.010)
    e2e.record_round(row, [0.050] * 5, {"hits": 0, "misses": 4, "bytes": 99}, 0.020, 0.020, [0.025] * 5, 0.010)
    assert row["p50_runs_ms"] == [30.0, 24.0, 50.0] and row["resident_runs_ms"] == [20.0, 20.0, 25.0]
    assert row["p50_ms"] == 30.0  # the median round
    assert row["p90_runs_ms"] == [30.0, 24.0, 50.0] and row["p90_ms"] == 30.0
    assert row["x_adjacent"] == 1.5  # median of 1.5, 1.2, 2.0
    assert row["x_adjacent_best"] == 24.0 / 20.0  # the fastest round over the fastest resident round
    assert row["hit_rate"] == 0.75 and row["bytes_moved"] == 8  # the first round's counters


def test_each_round_is_compared_with_the_floor_of_its_own_moment():
    """x_floor_runs: a round's p50 over max(its own resident run, the IO
    floor), so a round whose resident step ran under the IO floor is held
    to the IO floor and one on a slow host to its slow resident step."""
    row = {"p50_runs_ms": [], "resident_runs_ms": [], "p50_ms": None, "p90_ms": None}
    counters = {"hits": 0, "misses": 4, "bytes": 99}
    # IO floor 22 ms; the rounds' resident runs 20 (under it), 20, 25 (over it)
    for p50, resident in ((0.030, 0.020), (0.024, 0.020), (0.050, 0.025)):
        e2e.record_round(row, [p50] * 5, counters, compute_p50=0.020, floor_s=0.022, res_round=[resident] * 5,
                         io_floor_s=0.022)
    assert [round(x, 4) for x in row["x_floor_runs"]] == [round(30 / 22, 4), round(24 / 22, 4), 2.0]
    assert row["x_floor_adjacent"] == row["x_floor_runs"][0]  # the median of the three
    assert row["x_adjacent"] == 1.5  # against the resident runs alone, the IO floor left out


def _cpu_main_loop(monkeypatch):
    """BM5's measured path needs CUDA; its device probes pointed at the CPU
    (host backend, a tiny model) so the loop itself runs."""
    from functools import partial

    from bench.lib.e2e_decoder import Decoder

    monkeypatch.setitem(e2e.MODELS, "tiny", dict(layers=3, experts=8, top_k=2, hidden=16, inter=8))
    monkeypatch.setattr(e2e, "Decoder", partial(Decoder, device="cpu"))
    monkeypatch.setattr(e2e, "raw_h2d_gbps", lambda torch, nbytes, device: 50.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(e2e, "machine_info", lambda: {"host": "test"})


def test_main_loop_with_repeats_on_the_cpu(monkeypatch, tmp_path, capsys):
    # BM5's measured path needs CUDA; here its device probes are pointed at
    # the CPU (host backend, a tiny model) so the loop itself runs: rounds,
    # the per-round resident, the floor and the JSON.
    import json

    _cpu_main_loop(monkeypatch)
    out = tmp_path / "bm5.json"
    assert e2e.main(["--models", "tiny", "--batches", "1", "--shares", "0.5", "--policies", "all-resident",
                     "on-demand", "oracle", "torch-by-hand", "--warmup", "1", "--steps", "3", "--pool", "4",
                     "--train", "0", "--repeats", "3", "--oracle-distance", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["all-resident", "on-demand", "oracle", "torch-by-hand"]
    for r in rows:
        assert len(r["p50_runs_ms"]) == 3 and len(r["resident_runs_ms"]) == 3, r
        assert r["x_adjacent"] > 0 and r["over_floor"] > 0
        if r["policy"] != "all-resident":  # its p50 is settled as the faster of its first and last run
            assert r["p50_ms"] == sorted(r["p50_runs_ms"])[1]
    assert rows[0]["resident_runs_ms"] == rows[0]["p50_runs_ms"]  # each round's own resident run
    assert rows[2]["precision"] == 1.0 and rows[2]["recall"] == 1.0  # the oracle replays the routing


def test_profiled_steps_start_from_the_measured_runs_state(monkeypatch, tmp_path):
    # --profile runs the measured steps again on a fresh provider: at a
    # cache that holds every expert the steps route to, replaying them on
    # the measured provider would copy nothing (run 83's profiles of an
    # IO-bound row); from an empty cache they miss what the measured run
    # missed.
    import json

    _cpu_main_loop(monkeypatch)
    out = tmp_path / "e2e.json"
    assert e2e.main(["--models", "tiny", "--batches", "1", "--shares", "1.0", "--policies", "all-resident",
                     "on-demand", "--warmup", "1", "--steps", "3", "--pool", "4", "--train", "0",
                     "--profile", str(tmp_path / "prof"), "--profile-steps", "3", "--json", str(out)]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    od = rows["on-demand"]
    assert od["profile"]["misses"] > 0
    measured_misses = round((1 - od["hit_rate"]) * (od["profile"]["hits"] + od["profile"]["misses"]))
    assert od["profile"]["misses"] == measured_misses
    assert od["profile"]["bytes"] == od["bytes_moved"]  # the same copies, from the same state
    assert rows["all-resident"]["profile"]["misses"] is None
    # Where the copies went: the engine's counts for the engine row, null for the reference.
    assert od["on_demand"] > 0 and od["declined"] == 0 and od["cancelled"] == 0
    assert all(rows["all-resident"][key] is None for key in e2e.ENGINE_COUNTS)


def test_profile_steps_split_a_step_on_the_cpu(tmp_path):
    # --profile's figures for a real engine run on the host backend: the
    # decoder's host phases are there (the oracle's before_sync work as
    # "speculate"), the trace is written, and the GPU split is null, not 0,
    # without CUDA.
    import json

    import torch

    from bench.lib.e2e_decoder import profile_steps
    from bench.lib.e2e_providers import ResidentProvider, make_provider

    spec = dict(layers=3, experts=8, top_k=2, hidden=16, inter=8, name="t")
    dec = e2e.Decoder(torch, spec, pool=5, device="cpu")
    inputs = dec.inputs(4, 2, seed=0)
    resident = ResidentProvider(dec)
    for x in inputs:
        dec.step(x, resident)
    provider = make_provider(dec, "oracle:resident_gather=1", 6 * dec.slot_bytes, resident.trace)
    try:
        e2e.measure_steps(dec, provider, inputs, warmup=1)
        out = profile_steps(dec, provider, inputs, 1, 5, None, str(tmp_path / "prof" / "oracle"))
    finally:
        provider.close()
    assert out["steps"] == 5 and out["wall_ms_per_step"] > 0
    phases = out["host_phase_ms_per_step"]
    parts = ("acquire.route_l0", "acquire.route", "acquire.gather")  # Note [The acquire's parts]
    assert set(phases) == {"speculate", "sync", "acquire", "compute", "release", *parts}
    assert all(v >= 0 for v in phases.values())
    assert sum(v for k, v in phases.items() if k not in parts) <= out["wall_ms_per_step"]
    assert sum(phases[k] for k in parts) <= phases["acquire"]
    for key in ("busy", "compute", "h2d", "copy_only", "idle"):
        assert out[f"gpu_{key}_ms_per_step"] is None
    assert json.loads((tmp_path / "prof" / "oracle.json").read_text())["traceEvents"]
    assert (tmp_path / "prof" / "oracle.txt").read_text()


def test_gpu_time_split_takes_unions():
    # Device events as the profiler lists them (us): two overlapping
    # kernels, a copy overlapping one of them, a copy alone, a CPU op.
    import types

    import torch

    from bench.lib.common import gpu_time_split

    def ev(name, start, end, cuda=True):
        device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        rng = types.SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return types.SimpleNamespace(name=name, device_type=device, time_range=rng)

    prof = types.SimpleNamespace(events=lambda: [
        ev("gemm", 0, 10), ev("silu", 5, 15), ev("Memcpy HtoD (Pinned -> Device)", 12, 20),
        ev("Memcpy HtoD (Pinned -> Device)", 30, 40), ev("ncclKernel_AllReduce", 40, 45),
        ev("aten::mm", 0, 100, False)])
    split = gpu_time_split(torch, prof)
    assert split["busy_us"] == 35  # [0, 20] + [30, 45]
    assert split["compute_us"] == 20  # [0, 15] + [40, 45]
    assert split["h2d_us"] == 18
    assert split["copy_only_us"] == 15
    assert split["h2d_event_us"] == 18 and split["nccl_event_us"] == 5 and split["other_event_us"] == 20
    # No copy on the link over [0, 45]: [0, 12] under the kernels, [20, 30]
    # with the GPU idle, [40, 45] under the NCCL kernel.
    assert split["window_us"] == 45
    assert (split["link_idle_compute_us"], split["link_idle_gpu_idle_us"], split["link_idle_nccl_us"]) == (12, 10, 5)


def test_on_demand_disk_reads_the_experts_from_a_file(tmp_path):
    # #15's BM5 cell: every expert read from the pool's file through a host
    # tier of half the expert bytes; the same bits as all-resident, real
    # reads, and the file gone afterwards.
    import torch

    from bench.lib.e2e_providers import ResidentProvider, make_provider

    spec = dict(layers=3, experts=8, top_k=2, hidden=16, inter=8, name="t")
    dec = e2e.Decoder(torch, spec, pool=5, device="cpu")
    inputs = dec.inputs(4, 2, seed=0)
    want = [dec.step(x, ResidentProvider(dec)) for x in inputs]
    provider = make_provider(dec, "on-demand-disk", 6 * dec.slot_bytes, None, disk_dir=str(tmp_path))
    try:
        got = [dec.step(x, provider) for x in inputs]
        s = provider.handle.stats()
    finally:
        provider.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert s["disk_read_bytes"] > 0 and s["host_tier_budget_bytes"] > 0 and s["disk_errors"] == 0
    assert len(list(tmp_path.iterdir())) == 1  # the pool's file
    dec.remove_pool_file()
    assert not list(tmp_path.iterdir())


def test_slot_views_start_at_the_flat_tensors_own_first_byte():
    """A flat tensor that starts inside its storage (a HostExperts buffer
    starts at its allocation's first 256-byte boundary): each slot's parts
    are read from that tensor's bytes, not from the storage's start."""
    import torch

    from bench.lib.e2e_providers import slot_views
    from prefetch.expert_prefetcher import expert_layout

    parts = {"gate_up": torch.empty(4, 2, dtype=torch.bfloat16), "down": torch.empty(2, 2, dtype=torch.bfloat16)}
    layout = expert_layout(parts)
    slot_bytes = 512  # parts start 256 bytes apart
    storage = torch.zeros(64 + 3 * slot_bytes, dtype=torch.uint8)
    flat = storage[64:]
    want = []
    for s in range(3):
        gu = torch.arange(8, dtype=torch.bfloat16).reshape(4, 2) + 10 * s
        dn = -torch.arange(4, dtype=torch.bfloat16).reshape(2, 2) - 10 * s
        row = flat[s * slot_bytes : (s + 1) * slot_bytes]
        for part, value in zip(layout, (gu, dn)):
            row[part.offset : part.offset + part.nbytes].view(torch.bfloat16).copy_(value.reshape(-1))
        want.append((gu, dn))
    views = slot_views(torch, flat, slot_bytes, layout)
    assert [p.name for p in layout] == ["gate_up", "down"]
    for s, (gu, dn) in enumerate(want):
        assert torch.equal(views["gate_up"][s], gu) and torch.equal(views["down"][s], dn)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_slot_rows_gather_each_calls_slots(device):
    # BM5's SlotRows gathers a call's slots by concatenating cached views:
    # each gather must hold exactly those slots' bytes, in the call's order,
    # as index_select with the same slots gives, also when later gathers
    # (of other lengths, repeated slots) were queued behind it before any
    # ran, and after the slot tensor is written again (copies, not views).
    from bench.lib.e2e_providers import SlotRows

    dev = torch.device(device)
    gate_up = torch.randn(50, 6, 4, device=dev).to(torch.bfloat16)
    down = torch.randn(50, 4, 3, device=dev).to(torch.bfloat16)
    rows = SlotRows(torch, {"gate_up": gate_up, "down": down})
    rng = np.random.default_rng(3)
    calls = [rng.integers(0, 50, size=int(rng.integers(1, 9))).tolist() for _ in range(9)]
    got = [rows.gather(slots) for slots in calls]
    want = [(gate_up[slots].clone(), down[slots].clone()) for slots in calls]
    gate_up.fill_(0)
    down.fill_(0)
    for slots, (gu, dn), (wgu, wdn) in zip(calls, got, want):
        assert gu.shape == (len(slots), 6, 4) and dn.shape == (len(slots), 4, 3)
        assert torch.equal(gu, wgu) and torch.equal(dn, wdn)
        assert gu.is_contiguous() and dn.is_contiguous()


def test_engine_provider_gather_refuses_offsets_off_the_grid():
    # EngineProvider.gather makes its slot numbers with slot_numbers: an
    # offset that is not a whole number of slots is refused, not rounded.
    from bench.lib.e2e_providers import make_provider

    spec = dict(layers=2, experts=8, top_k=2, hidden=16, inter=8, name="t")
    dec = e2e.Decoder(torch, spec, pool=3, device="cpu")
    provider = make_provider(dec, "on-demand", 4 * dec.slot_bytes, None)
    try:
        views = provider._views(0)
        for part in views:  # the arena's bytes are not initialised: known values first
            part.copy_(torch.randn(part.shape).to(part.dtype))
        where = np.array([[2 * dec.slot_bytes, 0], [dec.slot_bytes, 0]], dtype=np.int64)
        gu, dn = provider.gather(0, where)
        assert torch.equal(gu, views[0][[2, 1]]) and torch.equal(dn, views[1][[2, 1]])
        with pytest.raises(ValueError, match="not on the grid"):
            provider.gather(0, np.array([[dec.slot_bytes + 1, 0]], dtype=np.int64))
    finally:
        provider.close()


def test_policies_carry_handle_options():
    from bench.lib.e2e_providers import policy_eviction, split_policy

    assert split_policy("oracle") == ("oracle", {})
    assert split_policy("oracle:copy_poll_us=0,copy_lanes=1") == ("oracle", {"copy_poll_us": 0, "copy_lanes": 1})
    assert policy_eviction("oracle:copy_poll_us=0", "cyclic") == "next-use"
    assert policy_eviction("on-demand:copy_lanes=1", "lru") == "lru"
    assert split_policy("oracle:distance=4") == ("oracle", {"distance": 4})
    assert split_policy("on-demand:resident_gather=1") == ("on-demand", {"resident_gather": 1})
    for bad, message in (("oracel", "unknown policy"), ("oracle:copy_poll_us", "name=int"),
                         ("on-demand:distance=4", "distance goes with oracle"), ("oracle:distance=0", ">= 1"),
                         ("oracle:copy_poll_us=fast", "must be an int"),
                         ("torch-by-hand:copy_lanes=1", "need an engine policy"),
                         ("oracle:resident_gather=2", "resident_gather is 0 or 1"),
                         ("oracle:step_plan=3", "step_plan is 0 or 1"),
                         ("all-resident:resident_gather=1", "need an engine policy")):
        with pytest.raises(ValueError, match=message):
            split_policy(bad)
    with pytest.raises(SystemExit):
        e2e.main(["--policies", "oracle:copy_lanes=x", "--smoke-cpu"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_routed_experts_match_unique_without_waiting_for_the_gpu(device):
    # Note [No hidden sync in the routing] (bench/lib/e2e_decoder.py): the
    # decoder's routed experts are torch.unique's, sorted and distinct, for
    # one row and for many, with a row of fewer than top-k (a forced
    # routing) and with none; on CUDA nothing in routed_keys waits for
    # the GPU (sync debug mode "error" raises on a synchronizing call).
    from bench.lib.e2e_decoder import Decoder

    dec = Decoder.__new__(Decoder)  # the two methods need only these
    dec.torch, dec.spec, dec._expert_ids = torch, {"experts": 64}, {}
    gen = torch.Generator().manual_seed(5)
    cases = [torch.randperm(64, generator=gen)[:8].view(1, 8)]
    cases += [torch.stack([torch.randperm(64, generator=gen)[:k] for _ in range(b)]) for b, k in ((8, 8), (3, 2))]
    cases += [torch.tensor([[63, 0, 5]]), torch.zeros(1, 0, dtype=torch.int64), torch.arange(64).view(8, 8)]
    for top_i in cases:
        top_i = top_i.to(device)
        if device == "cuda":
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        try:
            keys = dec.routed_keys(top_i)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(previous)
        experts, routed = dec.read_routed(keys)
        want = torch.unique(top_i).tolist()
        assert experts == want, (top_i, experts)
        assert routed.device == top_i.device and routed.tolist() == want


def test_oracle_distance_must_stay_below_the_models_layers(monkeypatch, capsys):
    # The controller files a guess under the step its target layer comes
    # next, so a lookahead of a whole step or more would score (and hint)
    # against the wrong step: BM5 refuses it before building anything.
    monkeypatch.setitem(e2e.MODELS, "tiny", dict(layers=3, experts=8, top_k=2, hidden=16, inter=8))
    for argv in (["--policies", "oracle"], ["--policies", "oracle:distance=3", "--oracle-distance", "2"],
                 ["--policies", "oracle-cyclic", "--oracle-distance", "5"]):
        with pytest.raises(SystemExit) as got:
            e2e.main(["--models", "tiny", *argv])
        assert got.value.code == 2
        assert "is not below tiny's 3 layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.main(["--models", "tiny", "--policies", "oracle", "--oracle-distance", "0"])
    assert "--oracle-distance must be >= 1" in capsys.readouterr().err


def test_engine_calls_with_resident_weights_compute_the_resident_step():
    # Note [Engine calls, resident weights]: with resident_gather=1 the
    # oracle makes its engine calls (hits, copies) and computes from the
    # resident pool: every step's output is the resident row's, bit for bit,
    # and the acquire's parts are still timed.
    from bench.lib.e2e_providers import ResidentProvider, make_provider

    spec = dict(layers=3, experts=8, top_k=2, hidden=16, inter=8, name="t")
    dec = e2e.Decoder(torch, spec, pool=5, device="cpu")
    inputs = dec.inputs(5, 2, seed=0)
    resident = ResidentProvider(dec)
    want = [dec.step(x, resident) for x in inputs]
    provider = make_provider(dec, "oracle:resident_gather=1", 6 * dec.slot_bytes, resident.trace)
    try:
        assert provider.resident_gather

        def arena_gather(*args):
            raise AssertionError("gathered from the engine's arena")

        provider.gather = arena_gather  # the weights must come from the pool
        timers = {}
        dec.timers = timers
        try:
            got = [dec.step(x, provider) for x in inputs]
        finally:
            dec.timers = None
        stats = provider.stats()
    finally:
        provider.close()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert stats["hits"] > 0 and stats["bytes"] > 0  # the engine did its part
    assert {"acquire.route_l0", "acquire.route", "acquire.gather"} <= set(timers)


def test_a_share_under_one_expert_is_reported_null_and_the_others_run(monkeypatch, tmp_path):
    # Belady's floor and every policy need one slot a device at least: a
    # share under that was a ValueError that ended the run.
    import json

    _cpu_main_loop(monkeypatch)
    out = tmp_path / "bm5.json"
    assert e2e.main(["--models", "tiny", "--batches", "1", "--shares", "0.001", "0.5", "--policies", "all-resident",
                     "on-demand", "--warmup", "1", "--steps", "2", "--pool", "4", "--train", "0",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    tiny = [r for r in rows if r["cache_share"] == 0.001]
    assert [r["policy"] for r in tiny] == ["all-resident", "on-demand"]
    assert all(r["p50_ms"] is None and r["floor_ms"] is None and "less than one expert" in r["note"] for r in tiny)
    assert all(r["p50_ms"] > 0 for r in rows if r["cache_share"] == 0.5)


@pytest.mark.parametrize("argv,message", [
    (["--shares", "0"], "--shares must be in"),
    (["--shares", "1.5"], "--shares must be in"),
    (["--batches", "0"], "--batches must be >= 1"),
    (["--devices", "0"], "--devices must be in 1..16"),
    (["--steps", "0"], "--steps >= 1"),
    (["--warmup", "-1"], "--warmup >= 0"),
    (["--trace-in", "/nonexistent/trace.json"], "--trace-in: "),
])
def test_bad_arguments_get_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        e2e.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_malformed_trace_in_gets_a_usage_error_before_anything_runs(tmp_path, capsys):
    bad = tmp_path / "t.json"
    bad.write_text('{"format": "prefetch-routing-trace/1", "num_layers": 2, "num_experts": 4, "steps": [[[9]]]}')
    with pytest.raises(SystemExit) as exc:
        e2e.main(["--trace-in", str(bad)])
    assert exc.value.code == 2
    assert "--trace-in: " in capsys.readouterr().err
