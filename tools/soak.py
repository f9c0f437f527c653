"""GPU soak: 8 threads, each on its own CUDA stream, hammer one handle whose
budget is far below the working set; every acquired expert is checksummed by
a GPU kernel on that thread's stream; driver free memory, the engine's pinned
(registered) bytes and the process RSS are sampled throughout.

    python tools/soak.py [--minutes 3] [--threads 8] [--entries 512]
        [--entry-mib 4] [--budget-mib 256] [--json PATH]

Pass: no checksum mismatch, no error, and no growth after warm-up (the first
20% of samples): free device memory and RSS stay within --drift-mib.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--entries", type=int, default=512)
    p.add_argument("--entry-mib", type=float, default=4.0)
    p.add_argument("--budget-mib", type=float, default=256.0)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--drift-mib", type=float, default=64.0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.minutes > 10:
        p.error("a soak runs at most 10 minutes")

    import numpy as np
    import torch

    import prefetch

    n = int(args.entry_mib * (1 << 20))
    weights = (torch.arange(n, device="cuda", dtype=torch.int64) % 251) + 1
    expected = torch.empty(args.entries, dtype=torch.int64, device="cuda")
    handle = prefetch.PrefetchHandle(device_budget_bytes=int(args.budget_mib * (1 << 20)), backend="cuda")
    gen = torch.Generator(device="cuda")
    for tid in range(args.entries):
        gen.manual_seed(tid)
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)
        expected[tid] = (data.to(torch.int64) * weights).sum()
        handle.register(tid, data.cpu())
        if tid % 64 == 63:
            print(f"registered {tid + 1}/{args.entries}", file=sys.stderr, flush=True)
    expected_cpu = expected.cpu()
    torch.cuda.synchronize()

    stop = threading.Event()
    errors: list[str] = []
    ops = [0] * args.threads
    checked = [0] * args.threads
    mismatches = [0] * args.threads

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        stream = torch.cuda.Stream()
        pending = []  # (ids, sums on device)
        try:
            while not stop.is_set():
                ids = [int(x) for x in rng.choice(args.entries, size=int(rng.integers(1, 5)), replace=False)]
                ahead = rng.integers(0, args.entries, size=int(rng.integers(0, 16)))
                handle.prefetch_tensors(ahead, priority=int(rng.integers(1, 20)))
                views = handle.acquire(ids, stream=stream, timeout=120)
                with torch.cuda.stream(stream):
                    sums = torch.stack([(v.to(torch.int64) * weights).sum() for v in views])
                handle.release(ids, stream=stream)
                pending.append((ids, sums))
                ops[k] += 1
                if len(pending) >= 32:
                    stream.synchronize()
                    for got_ids, got in pending:
                        bad = (got.cpu() != expected_cpu[got_ids]).sum().item()
                        mismatches[k] += bad
                        checked[k] += len(got_ids)
                    pending.clear()
            stream.synchronize()
            for got_ids, got in pending:
                mismatches[k] += (got.cpu() != expected_cpu[got_ids]).sum().item()
                checked[k] += len(got_ids)
        except BaseException as exc:  # noqa: BLE001 - reported
            errors.append(f"thread {k}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.threads)]
    samples = []
    t_start = time.monotonic()
    for t in threads:
        t.start()
    deadline = t_start + args.minutes * 60
    while time.monotonic() < deadline and not errors:
        time.sleep(args.sample_s)
        s = handle.stats()
        samples.append(
            {
                "t_s": round(time.monotonic() - t_start, 1),
                "free_device_bytes": torch.cuda.mem_get_info()[0],
                "pinned_registered_bytes": s["registered_bytes"],
                "rss_bytes": rss_bytes(),
                "ops": sum(ops),
                "copies": s["copies"],
                "evictions": s["evictions"],
            }
        )
        print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
    stop.set()
    for t in threads:
        t.join(300)
    stats = handle.stats()
    handle.close()

    warm = samples[max(1, len(samples) // 5) :] or samples
    mib = 1 << 20

    def drift(key):
        values = [s[key] for s in warm]
        return (max(values) - min(values)) / mib

    report = {
        "minutes": args.minutes,
        "threads": args.threads,
        "working_set_mib": args.entries * n / mib,
        "budget_mib": args.budget_mib,
        "ops": sum(ops),
        "experts_checksummed": sum(checked),
        "mismatches": sum(mismatches),
        "errors": errors,
        "copies": stats["copies"],
        "evictions": stats["evictions"],
        "hits": stats["hits"],
        "misses": stats["misses"],
        "late": stats["late"],
        "drift_after_warmup_mib": {
            "free_device": drift("free_device_bytes"),
            "pinned_registered": drift("pinned_registered_bytes"),
            "rss": drift("rss_bytes"),
        },
        "samples": samples,
    }
    ok = (
        not errors
        and sum(mismatches) == 0
        and sum(checked) > 0
        and all(v <= args.drift_mib for v in report["drift_after_warmup_mib"].values())
    )
    report["pass"] = ok
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
