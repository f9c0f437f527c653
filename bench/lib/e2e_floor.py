"""BM5's IO floor bookkeeping (bench/e2e.py): Belady bytes over raw
bandwidth, settled after each model's two raw readings."""
from __future__ import annotations

import statistics

from bench.lib.common import percentile, round_floor_ratio


def io_floor(belady_bytes_each, raw_each) -> float:
    """Seconds per step the links need at least: per device, Belady's bytes
    over its raw bandwidth; devices copy in parallel, the slowest bounds."""
    return max(b / (r * 1e9) for b, r in zip(belady_bytes_each, raw_each))


def settle_raw(model_rows, raw_first, raw_second):
    """Sets each device's raw bandwidth to the faster of its two
    measurements and recomputes the IO floor, floor and x-floor, the
    rounds' own floors included (x_floor_runs, x_floor_adjacent: each round
    against max(its resident run, this IO floor), as the row reports it)."""
    best = [max(a, b) for a, b in zip(raw_first, raw_second)]
    for row in model_rows:
        if row.get("belady_bytes_per_step_each") is None:  # a share under one expert: not measured
            continue
        row["raw_h2d_gbps_runs_each"] = [list(raw_first), list(raw_second)]
        row["raw_h2d_gbps_each"] = best
        row["raw_h2d_gbps"] = sum(best)
        row["io_floor_ms"] = io_floor(row["belady_bytes_per_step_each"], best) * 1e3
        set_floor(row)
        if row.get("x_floor_runs"):
            row["x_floor_runs"] = [round_floor_ratio(p50, resident, row["io_floor_ms"])
                                   for p50, resident in zip(row["p50_runs_ms"], row["resident_runs_ms"])]
            row["x_floor_adjacent"] = statistics.median(row["x_floor_runs"])


def set_floor(row):
    """floor = max(compute-only, IO floor), and x-floor where the row ran."""
    row["floor_ms"] = max(row["compute_only_ms"], row["io_floor_ms"])
    if row["p50_ms"] is not None:
        row["over_floor"] = row["p50_ms"] / row["floor_ms"]


def settle_compute_only(batch_rows, lat_first, lat_second):
    """Sets the compute-only step of one model and batch to the faster of
    its two all-resident runs, and the floor, stall and x-floor of every row
    that depends on it."""
    runs = [statistics.median(lat_first), statistics.median(lat_second)]
    best = lat_first if runs[0] <= runs[1] else lat_second
    compute_ms = min(runs) * 1e3
    for row in batch_rows:
        row["compute_only_ms"] = compute_ms
        row["compute_only_runs_ms"] = [r * 1e3 for r in runs]
        if row["p50_ms"] is not None:
            if row["policy"] == "all-resident":
                row["p50_ms"] = statistics.median(best) * 1e3
                row["p90_ms"] = percentile(best, 0.9) * 1e3
            row["stall_ms"] = row["p50_ms"] - compute_ms
        set_floor(row)
