"""Reads the Chrome traces BM7 --profile wrote for the ranks of one row and
prints, per all-reduce, when each rank's host issued it and how long each
rank's NCCL kernel ran (it spins until the other rank's arrives), plus each
rank's host time between consecutive all-reduces (one MoE layer).

    python tools/ep_timeline.py DIR/ep_b1_S_rank0.json DIR/ep_b1_S_rank1.json [--first 40] [--count 32]

The ranks are processes on one host; the profiler's timestamps share its
clock, so the columns compare directly."""
from __future__ import annotations

import argparse
import json
import statistics


def load(path):
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    issue = sorted((e for e in events if e.get("cat") == "cpu_op" and e["name"] == "c10d::allreduce_"),
                   key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()),
                     key=lambda e: e["ts"])
    return issue, kernels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="one Chrome trace per rank, rank order")
    parser.add_argument("--first", type=int, default=0, help="first all-reduce to print")
    parser.add_argument("--count", type=int, default=32, help="all-reduces to print")
    args = parser.parse_args(argv)
    ranks = [load(p) for p in args.traces]
    n = min(min(len(i), len(k)) for i, k in ranks)
    if n == 0:
        print("no all-reduce in these traces")
        return 1
    t0 = min(i[0]["ts"] for i, _ in ranks)
    head = " ".join(f"{'host' + str(r):>9} {'nccl' + str(r) + ' ms':>12}" for r in range(len(ranks)))
    print(f"{'#':>4} {head}   (ms from the first issue; nccl: kernel start + duration)")
    for j in range(args.first, min(n, args.first + args.count)):
        cols = []
        for issue, kernels in ranks:
            k = kernels[j]
            cols.append(f"{(issue[j]['ts'] - t0) / 1e3:9.2f} {(k['ts'] - t0) / 1e3:7.2f}+{k['dur'] / 1e3:4.2f}")
        print(f"{j:>4} " + " ".join(cols))
    for r, (issue, kernels) in enumerate(ranks):
        gaps = [(b["ts"] - a["ts"]) / 1e3 for a, b in zip(issue[:n], issue[1:n])]
        spins = [k["dur"] / 1e3 for k in kernels[:n]]
        print(f"rank {r}: host ms between all-reduces p50 {statistics.median(gaps):.2f}; "
              f"NCCL kernel ms p50 {statistics.median(spins):.2f}, sum {sum(spins):.1f} over {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
