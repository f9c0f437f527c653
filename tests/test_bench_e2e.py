"""BM5's logic on the CPU: every policy (engine on the host backend, the
by-hand LRU, predictors) must compute exactly what all-resident computes."""
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
