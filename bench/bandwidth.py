"""Engine host-to-device throughput against raw PyTorch copies, same run.

    python bench/bandwidth.py [--sizes-mib 1 4 9.4 64] [--total-mib 2048]
        [--reps 5] [--json PATH]

For each entry size: `count` entries (total-mib worth) of random bytes.
  raw     copy_(non_blocking=True) from one pinned host tensor per entry into
          device tensors on a side stream, timed with CUDA events (the
          baseline of the engine/raw ratio); also on two side streams taking
          entries in turn ("raw x2": what two copy engines give)
  engine  all entries evicted; a timing stream records a start event, then
          prefetch_tensors(ids); once every copy is issued the timing stream
          is made to wait (acquire with a stream: GPU-side) on each id still
          in flight, then records the end event. Also timed on the host clock
          around prefetch and a CPU-blocking acquire of every id ("engine
          host-clock"; acquire moves ids not yet issued to the on-demand
          stream, so more copy engines may work at once).
Also reported: the engine's issue overhead per copy call (worker seconds
spent in the backend's Copy, over the number of calls), and a byte-exact
check of every entry after the engine's copies. Needs CUDA; without it every
figure is null.

--devices N (N > 1): one handle with a cache per device, every device's
entries prefetched at once and acquired (CPU-blocking), host clock: the
aggregate against the sum of each device's raw bandwidth measured alone, and
against raw copy_ on all devices at once ("raw together", host clock), with
a byte-exact check of every entry on every device.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.lib.common import fmt, machine_info, raw_copy_gbps, write_json  # noqa: E402

MIB = 1 << 20


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def random_pinned_rows(torch, count: int, entry_bytes: int):
    """`count` rows of `entry_bytes` random bytes in pinned host memory
    (made on the GPU and copied down: fast; never zeros)."""
    src = torch.empty((count, entry_bytes), dtype=torch.uint8, pin_memory=True)
    for i in range(count):
        src[i].copy_(torch.randint(0, 256, (entry_bytes,), dtype=torch.uint8, device="cuda"))
    return src


def measure_raw(torch, src, reps: int):
    """The raw copy_ baseline of every row of `src`: GB/s samples on one side
    stream and on two taking rows in turn; the copied bytes are checked."""
    count, entry_bytes = src.shape
    dst = torch.empty((count, entry_bytes), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    raw = raw_copy_gbps(torch, src, dst, [stream], reps)
    raw2 = raw_copy_gbps(torch, src, dst, [stream, torch.cuda.Stream()], reps)
    if not torch.equal(dst, src.cuda()):
        raise RuntimeError("raw copy mismatch")
    return raw, raw2


def evict_all(torch, handle, ids):
    torch.cuda.synchronize()
    handle.evict(ids)
    if handle.stats()["resident_count"] != 0:
        raise RuntimeError("could not evict every entry between passes")


def gpu_timed_pass(torch, handle, ids, timing):
    """Every id evicted, then prefetched between two events on the `timing`
    stream, which waits (GPU-side) for each copy still in flight once all
    are issued. Returns the seconds between the events and the engine's
    copy_seconds during the pass."""
    evict_all(torch, handle, ids)
    before = handle.stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(timing)
    handle.prefetch_tensors(ids)
    while handle.stats()["queue_depth"] > 0:  # wait until all are issued
        time.sleep(0.0001)
    handle.acquire(ids, stream=timing)  # no upgrade: all issued
    end.record(timing)
    handle.release(ids, stream=timing)
    end.synchronize()
    after = handle.stats()
    if after["copies"] - before["copies"] != len(ids) or after["upgraded"] != before["upgraded"]:
        raise RuntimeError("GPU-timed pass did not copy every entry exactly once at its band")
    return start.elapsed_time(end) / 1e3, after["copy_seconds"] - before["copy_seconds"]


def host_clock_pass(torch, handle, ids, src, check: bool) -> float:
    """Every id evicted, then prefetched and acquired CPU-blocking: the
    seconds on the host clock. With `check`, every view must equal its row
    of `src`."""
    evict_all(torch, handle, ids)
    t0 = time.perf_counter()
    handle.prefetch_tensors(ids)
    views = handle.acquire(ids)
    t1 = time.perf_counter()
    if check:
        exact = all(torch.equal(v, src[i].cuda()) for i, v in enumerate(views))
        if not exact:
            raise RuntimeError("engine copy mismatch")
    handle.release(ids)
    return t1 - t0


def measure_engine(torch, prefetch, src, reps: int, chunk_bytes: int, lanes: int):
    """The engine copying every row of `src` (one entry each) into a cache
    that holds them all: GB/s samples of the GPU-timed and the host-clock
    passes, and the issue time per copy call, over `reps` passes after an
    untimed one (which checks the bytes)."""
    count, entry_bytes = src.shape
    total = entry_bytes * count
    slot = -(-entry_bytes // prefetch.SLOT_ALIGNMENT) * prefetch.SLOT_ALIGNMENT
    handle = prefetch.PrefetchHandle(
        device_budget_bytes=slot * count, backend="cuda", copy_chunk_bytes=chunk_bytes, copy_lanes=lanes
    )
    try:
        for i in range(count):
            handle.register(i, src[i])
        ids = list(range(count))
        engine, engine_host = [], []
        per_call_us = []
        timing = torch.cuda.Stream()
        for rep in range(reps + 1):
            gpu_s, copy_s = gpu_timed_pass(torch, handle, ids, timing)
            host_s = host_clock_pass(torch, handle, ids, src, check=rep == 0)
            if rep > 0:
                engine.append(gbps(total, gpu_s))
                engine_host.append(gbps(total, host_s))
                calls = count * -(-entry_bytes // chunk_bytes)
                per_call_us.append(copy_s / calls * 1e6)
    finally:
        handle.close()
    return engine, engine_host, per_call_us


def measure_size(torch, prefetch, entry_bytes: int, count: int, reps: int, chunk_bytes: int, lanes: int) -> dict:
    total = entry_bytes * count
    src = random_pinned_rows(torch, count, entry_bytes)
    raw, raw2 = measure_raw(torch, src, reps)
    engine, engine_host, per_call_us = measure_engine(torch, prefetch, src, reps, chunk_bytes, lanes)
    raw_gbps = statistics.median(raw)
    raw2_gbps = statistics.median(raw2)
    engine_gbps = statistics.median(engine)
    return {
        "engine_host_clock_gbps": statistics.median(engine_host),
        "entry_mib": entry_bytes / MIB,
        "entries": count,
        "total_mib": total / MIB,
        "raw_gbps": raw_gbps,
        "raw_two_streams_gbps": raw2_gbps,
        "copy_lanes": lanes,
        "engine_gbps": engine_gbps,
        "engine_over_raw": engine_gbps / raw_gbps,
        "issue_us_per_copy_call": statistics.median(per_call_us),
        "byte_exact": True,
        "raw_samples_gbps": raw,
        "engine_samples_gbps": engine,
        "engine_host_clock_samples_gbps": engine_host,
    }


def measure_devices(torch, prefetch, entry_bytes: int, count: int, reps: int, chunk_bytes: int, lanes: int,
                    ndev: int) -> dict:
    """All `ndev` devices prefetching at once through one handle (per-device
    caches, queues, streams and workers): aggregate host-clock throughput of
    prefetch + CPU-blocking acquire of every id, against the sum of each
    device's raw copy_ bandwidth measured alone in the same run, with a
    byte-exact check of every entry on every device."""
    raw_each = []
    raw_src, raw_dst, raw_streams = [], [], []
    for d in range(ndev):
        with torch.cuda.device(d):
            src = torch.randint(0, 256, (count, entry_bytes), dtype=torch.uint8, device=d).cpu().pin_memory()
            dst = torch.empty((count, entry_bytes), dtype=torch.uint8, device=d)
            stream = torch.cuda.Stream(device=d)
            raw_each.append(statistics.median(raw_copy_gbps(torch, src, dst, [stream], reps)))
            raw_src.append(src)
            raw_dst.append(dst)
            raw_streams.append(stream)
    # Raw copy_ on every device at once (host clock, copies issued in turn
    # across the devices): what the host's links give together.
    together = []
    for rep in range(reps + 1):
        for d in range(ndev):
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        for i in range(count):
            for d in range(ndev):
                with torch.cuda.stream(raw_streams[d]):
                    raw_dst[d][i].copy_(raw_src[d][i], non_blocking=True)
        for d in range(ndev):
            torch.cuda.synchronize(d)
        if rep > 0:
            together.append(gbps(ndev * count * entry_bytes, time.perf_counter() - t0))
    del raw_src, raw_dst
    slot = -(-entry_bytes // prefetch.SLOT_ALIGNMENT) * prefetch.SLOT_ALIGNMENT
    handle = prefetch.PrefetchHandle(device_budget_bytes=[slot * count] * ndev, backend="cuda",
                                     copy_chunk_bytes=chunk_bytes, copy_lanes=lanes)
    sources = []
    try:
        for d in range(ndev):
            src = torch.randint(0, 256, (count, entry_bytes), dtype=torch.uint8, device=d).cpu().pin_memory()
            sources.append(src)
            for i in range(count):
                handle.register_external(d * count + i, src[i], device=d)
        ids = list(range(ndev * count))
        aggregate = []
        for rep in range(reps + 1):
            for d in range(ndev):
                torch.cuda.synchronize(d)
            handle.evict(ids)
            t0 = time.perf_counter()
            handle.prefetch_tensors(ids)
            views = handle.acquire(ids)
            t1 = time.perf_counter()
            if rep == 0:
                for tid, v in zip(ids, views):
                    d, i = divmod(tid, count)
                    if v.device.index != d or not torch.equal(v.cpu(), sources[d][i]):
                        raise RuntimeError(f"multi-device copy mismatch for id {tid} on device {d}")
            handle.release(ids)
            del views
            if rep > 0:
                aggregate.append(gbps(ndev * count * entry_bytes, t1 - t0))
    finally:
        handle.close()
    agg = statistics.median(aggregate)
    raw_together = statistics.median(together)
    return {"entry_mib": entry_bytes / MIB, "devices": ndev, "entries_per_device": count,
            "raw_per_device_gbps": raw_each, "raw_sum_gbps": sum(raw_each), "engine_aggregate_gbps": agg,
            "aggregate_over_raw_sum": agg / sum(raw_each), "raw_together_gbps": raw_together,
            "aggregate_over_raw_together": agg / raw_together, "byte_exact": True,
            "aggregate_samples_gbps": aggregate, "raw_together_samples_gbps": together}


def format_table(report: dict) -> str:
    lines = [
        f"H2D bandwidth ({report['reps']} reps, median; chunk {report['chunk_mib']} MiB, "
        f"{report['copy_lanes']} copy lane(s))",
        f"{'entry MiB':>10}{'entries':>9}{'raw GB/s':>10}{'raw x2 GB/s':>13}{'engine GB/s':>13}{'engine/raw':>12}"
        f"{'issue us/copy':>15}{'host-clock GB/s':>17}",
    ]
    for row in report["rows"]:
        if row.get("raw_gbps") is None:
            lines.append(
                f"{row['entry_mib']:>10.1f}{'null':>9}{'null':>10}{'null':>13}{'null':>13}{'null':>12}{'null':>15}"
                f"{'null':>17}"
            )
            continue
        lines.append(
            f"{row['entry_mib']:>10.1f}{row['entries']:>9}{fmt(row['raw_gbps']):>10}{fmt(row['raw_two_streams_gbps']):>13}"
            f"{fmt(row['engine_gbps']):>13}"
            f"{fmt(100 * row['engine_over_raw'], 1) + '%':>12}{fmt(row['issue_us_per_copy_call']):>15}"
            f"{fmt(row['engine_host_clock_gbps']):>17}"
        )
    return "\n".join(lines)


def check_args(parser, args) -> None:
    """parser.error for a value no measurement can take: every size at least
    a byte, a positive total, chunk, rep, lane and device count."""
    for size in args.sizes_mib:
        if not (math.isfinite(size) and int(size * MIB) >= 1):
            parser.error(f"--sizes-mib must be positive and finite (at least a byte), got {size}")
    if not (math.isfinite(args.total_mib) and args.total_mib > 0):
        parser.error(f"--total-mib must be positive and finite, got {args.total_mib}")
    if not (math.isfinite(args.chunk_mib) and int(args.chunk_mib * MIB) >= 1):
        parser.error(f"--chunk-mib must be positive and finite (at least a byte), got {args.chunk_mib}")
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.lanes < 1:
        parser.error(f"--lanes must be at least 1, got {args.lanes}")
    if args.devices < 1:
        parser.error(f"--devices must be at least 1, got {args.devices}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 9.4, 64])
    parser.add_argument("--total-mib", type=float, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunk-mib", type=float, default=4)
    parser.add_argument("--lanes", type=int, default=2, help="engine copy lanes (prefetch streams) per device")
    parser.add_argument("--devices", type=int, default=1,
                        help="with N > 1: all N devices prefetch at once (aggregate vs sum of raw)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.devices > 1:
        return main_devices(args)
    rows = []
    ok = True
    try:
        import torch

        import prefetch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    for size in args.sizes_mib:
        entry = int(size * MIB)
        if not available:
            rows.append({"entry_mib": size, "raw_gbps": None, "engine_gbps": None, "engine_host_clock_gbps": None})
            ok = False
            continue
        count = max(4, int(args.total_mib * MIB // entry))
        rows.append(measure_size(torch, prefetch, entry, count, args.reps, int(args.chunk_mib * MIB), args.lanes))
        print(f"  {size} MiB done", file=sys.stderr, flush=True)
    report = {
        "benchmark": "H2D bandwidth",
        "machine": machine_info(),
        "reps": args.reps,
        "chunk_mib": args.chunk_mib,
        "copy_lanes": args.lanes,
        "rows": rows,
    }
    print(format_table(report))
    if args.json:
        write_json(args.json, report)
    return 0 if ok else 1


def main_devices(args) -> int:
    import torch

    import prefetch

    if not torch.cuda.is_available() or torch.cuda.device_count() < args.devices:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"--devices {args.devices}: found {found} CUDA devices; not measured", file=sys.stderr)
        rows = [{"entry_mib": size, "engine_aggregate_gbps": None, "raw_sum_gbps": None} for size in args.sizes_mib]
        ok = False
    else:
        rows = []
        for size in args.sizes_mib:
            entry = int(size * MIB)
            count = max(4, int(args.total_mib * MIB // entry))
            rows.append(measure_devices(torch, prefetch, entry, count, args.reps, int(args.chunk_mib * MIB),
                                        args.lanes, args.devices))
        ok = True
    lines = [f"H2D bandwidth, {args.devices} devices at once ({args.reps} reps, median)",
             f"{'entry MiB':>10}{'raw sum GB/s':>14}{'raw together':>14}{'engine agg GB/s':>17}{'agg/raw sum':>13}"
             f"{'agg/together':>14}"]

    def pct(value):
        return "null" if value is None else fmt(100 * value, 1) + "%"

    for r in rows:
        lines.append(f"{r['entry_mib']:>10.1f}{fmt(r.get('raw_sum_gbps')):>14}{fmt(r.get('raw_together_gbps')):>14}"
                     f"{fmt(r.get('engine_aggregate_gbps')):>17}{pct(r.get('aggregate_over_raw_sum')):>13}"
                     f"{pct(r.get('aggregate_over_raw_together')):>14}")
    print("\n".join(lines))
    if args.json:
        write_json(args.json, {"benchmark": "H2D bandwidth, multi-device", "machine": machine_info(),
                               "devices": args.devices, "rows": rows})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
