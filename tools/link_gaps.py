"""Where a GPU's host-to-device link idles, from a Chrome trace that
torch.profiler wrote (BM7 --profile, BM5 --profile):

    python tools/link_gaps.py TRACE.json [TRACE.json ...] [--min-us 20] [--tokens N]

A gap is a stretch of at least --min-us with no host-to-device copy on the
GPU. On a synced decode layer the link waits for the routing: the GPU
finishes the layer's experts, the all-reduce, the next attention and router,
copies the routing to the host (a device-to-host copy), and the host then
asks the engine for that layer's misses. So each gap is split at the last
device-to-host copy that ends inside it:

  gpu:  gap start -> that copy's end (the GPU's own chain)
  host: that copy's end -> gap end (the host reading the routing, its work,
        the engine call, until the first miss is on the link)

A gap with no device-to-host copy inside counts as "other" (the GPU idle or
busy for another reason: sync-free layers, the token's read-back, the lm
head). Prints, per trace, the gaps' count and milliseconds (per token with
--tokens) and the medians of the two parts; then the link's busy time, its
bytes (the copies' "bytes" argument) and the rate while busy, so a link
that runs slow is told apart from one that idles."""
from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import merge_spans  # noqa: E402


def _spans(events, pred):
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if pred(e))


def gaps(events, min_us: float) -> dict:
    """The link's gaps in `events` (Chrome trace "X" events, us), split as
    the module says. Returns sums (us) and per-gap parts."""
    dev = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    h2d = _spans(dev, lambda e: "htod" in e["name"].lower().replace(" ", ""))
    d2h_ends = sorted(b for _, b in _spans(dev, lambda e: "dtoh" in e["name"].lower().replace(" ", "")))
    out = {"gaps": 0, "gap_us": 0.0, "gpu_us": 0.0, "host_us": 0.0, "other_us": 0.0, "gpu_parts": [],
           "host_parts": [], "busy_us": 0.0, "span_us": 0.0, "h2d_bytes": 0, "copies": len(h2d)}
    if not h2d:
        return out
    merged = merge_spans(h2d)
    out["busy_us"] = float(sum(b - a for a, b in merged))
    out["span_us"] = float(merged[-1][1] - merged[0][0])
    out["h2d_bytes"] = sum(int(e.get("args", {}).get("bytes", 0)) for e in dev
                           if "htod" in e["name"].lower().replace(" ", ""))
    for (_, start), (end, _) in zip(merged, merged[1:]):
        if end - start < min_us:
            continue
        out["gaps"] += 1
        out["gap_us"] += end - start
        i = bisect.bisect_right(d2h_ends, end) - 1
        if i >= 0 and d2h_ends[i] > start:
            gpu, host = d2h_ends[i] - start, end - d2h_ends[i]
            out["gpu_us"] += gpu
            out["host_us"] += host
            out["gpu_parts"].append(gpu)
            out["host_parts"].append(host)
        else:
            out["other_us"] += end - start
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--min-us", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=1, help="divide the sums by this many tokens")
    args = parser.parse_args(argv)
    for path in args.traces:
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        g = gaps(events, args.min_us)
        per = 1e3 * args.tokens
        med = {k: (statistics.median(g[k]) if g[k] else 0.0) for k in ("gpu_parts", "host_parts")}
        print(f"{path}: {g['gaps'] / args.tokens:.1f} gaps, {g['gap_us'] / per:.2f} ms idle per token: "
              f"gpu chain {g['gpu_us'] / per:.2f}, host {g['host_us'] / per:.2f}, other {g['other_us'] / per:.2f}; "
              f"median per gap: gpu {med['gpu_parts']:.0f} us, host {med['host_parts']:.0f} us")
        if g["busy_us"]:
            rate = g["h2d_bytes"] / g["busy_us"] / 1e3 if g["h2d_bytes"] else float("nan")
            print(f"  link busy {g['busy_us'] / per:.2f} of {g['span_us'] / per:.2f} ms per token "
                  f"({g['busy_us'] / g['span_us']:.0%}), {g['copies'] / args.tokens:.1f} copies and "
                  f"{g['h2d_bytes'] / 1e6 / args.tokens:.1f} MB per token, {rate:.1f} GB/s while busy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
