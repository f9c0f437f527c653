"""BM4: copies hidden behind compute.

    python bench/overlap.py [--matmul 8192] [--steps 40] [--entry-mib 9.4]
        [--copy-fraction 0.6] [--reps 5] [--json PATH]

Three timings, each the median of `reps`, host clock around fully
synchronised work:
  compute  `steps` bf16 matmuls on the default stream, nothing else
  copy     the engine prefetches N entries (sized so copying takes about
           copy-fraction of the compute time) and a CPU-blocking acquire
  both     the matmuls are launched, then the same prefetch and acquire
hidden = (compute + copy - both) / copy: the share of copy time that
disappeared behind compute (1.0 = all of it). slowdown = compute time on the
default stream (CUDA events) with copies running, over without.
Needs CUDA; without it the figures are null.
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

from bench.lib.common import fmt, machine_info, write_json  # noqa: E402

MIB = 1 << 20


def matmul_launcher(torch, n: int, steps: int):
    """A function that launches `steps` bf16 n x n matmuls on the default
    stream between two timing events, and returns the events."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def launch_compute():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            torch.matmul(a, b, out=out)
        end.record()
        return start, end

    return launch_compute


def time_compute(torch, launch_compute, reps: int):
    """Two untimed launches, then `reps` timed ones: the host-clock seconds
    of each, synchronised, and the GPU seconds between its events."""
    for _ in range(2):
        launch_compute()
    torch.cuda.synchronize()
    compute, compute_gpu = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s, e = launch_compute()
        torch.cuda.synchronize()
        compute.append(time.perf_counter() - t0)
        compute_gpu.append(s.elapsed_time(e) / 1e3)
    return compute, compute_gpu


def time_copies(torch, prefetch, entry: int, count: int, reps: int, launch_compute):
    """The engine copying `count` entries of `entry` bytes (prefetch, then a
    CPU-blocking acquire), alone and behind the matmuls, `reps` times each
    after an untimed copy. Returns the host-clock seconds of the copies
    alone, of both, the GPU seconds of the matmuls with copies running, and
    the engine's copy count."""
    handle = prefetch.PrefetchHandle(device_budget_bytes=((entry + 255) // 256 * 256) * count, backend="cuda")
    try:
        src = torch.randint(0, 256, (entry,), dtype=torch.uint8, device="cuda").cpu()
        for i in range(count):
            handle.register(i, src)
        ids = list(range(count))

        def copy_all():
            handle.prefetch_tensors(ids)
            handle.acquire(ids)
            handle.release(ids)

        copy_all()
        handle.evict(ids)
        copy = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy_all()
            torch.cuda.synchronize()
            copy.append(time.perf_counter() - t0)
            handle.evict(ids)
        both, both_gpu = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s, e = launch_compute()
            copy_all()
            torch.cuda.synchronize()
            both.append(time.perf_counter() - t0)
            both_gpu.append(s.elapsed_time(e) / 1e3)
            handle.evict(ids)
        stats = handle.stats()
    finally:
        handle.close()
    return copy, both, both_gpu, stats["copies"]


def run(args) -> dict:
    import torch

    import prefetch

    n = args.matmul
    launch_compute = matmul_launcher(torch, n, args.steps)
    compute, compute_gpu = time_compute(torch, launch_compute, args.reps)
    t_compute = statistics.median(compute)

    entry = int(args.entry_mib * MIB)
    bandwidth_guess = 50e9
    count = max(4, int(args.copy_fraction * t_compute * bandwidth_guess / entry))
    copy, both, both_gpu, copies = time_copies(torch, prefetch, entry, count, args.reps, launch_compute)
    t_copy = statistics.median(copy)
    t_both = statistics.median(both)
    hidden = (t_compute + t_copy - t_both) / t_copy
    return {
        "benchmark": "BM4 overlap",
        "machine": machine_info(),
        "matmul": n,
        "steps": args.steps,
        "entries": count,
        "entry_mib": args.entry_mib,
        "copy_bytes": count * entry,
        "compute_s": t_compute,
        "copy_s": t_copy,
        "both_s": t_both,
        "copy_gbps": count * entry / t_copy / 1e9,
        "hidden_fraction": max(0.0, min(1.0, hidden)),
        "hidden_fraction_unclamped": hidden,
        "compute_slowdown": statistics.median(both_gpu) / statistics.median(compute_gpu),
        "engine_copies": copies,
    }


def format_table(r: dict) -> str:
    if r.get("hidden_fraction") is None:
        return "BM4 overlap: not measured (no CUDA): hidden=null slowdown=null"
    return "\n".join(
        [
            f"BM4 overlap: {r['steps']} x bf16 matmul {r['matmul']}^3 vs {r['entries']} x {r['entry_mib']} MiB copies",
            f"{'compute s':>10}{'copy s':>10}{'both s':>10}{'copy GB/s':>11}{'hidden':>9}{'slowdown':>10}",
            f"{r['compute_s']:>10.4f}{r['copy_s']:>10.4f}{r['both_s']:>10.4f}{fmt(r['copy_gbps']):>11}"
            f"{fmt(100 * r['hidden_fraction'], 1) + '%':>9}{fmt(r['compute_slowdown'], 3):>10}",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matmul", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--entry-mib", type=float, default=9.4)
    parser.add_argument("--copy-fraction", type=float, default=0.6)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.matmul < 1 or args.steps < 1 or args.reps < 1:
        parser.error(f"--matmul, --steps and --reps must be at least 1, got {args.matmul}, {args.steps}, {args.reps}")
    if not (math.isfinite(args.entry_mib) and int(args.entry_mib * MIB) >= 1):
        parser.error(f"--entry-mib must be positive and finite (at least a byte), got {args.entry_mib}")
    if not (math.isfinite(args.copy_fraction) and args.copy_fraction > 0):
        parser.error(f"--copy-fraction must be positive and finite, got {args.copy_fraction}")
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if available:
        report = run(args)
    else:
        report = {"benchmark": "BM4 overlap", "machine": machine_info(), "hidden_fraction": None,
                  "compute_slowdown": None}
    print(format_table(report))
    if args.json:
        write_json(args.json, report)
    return 0 if available else 1


if __name__ == "__main__":
    sys.exit(main())
