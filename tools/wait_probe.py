"""Does the copy worker's way of waiting slow the serving thread? (Note
[Worker waits] in src_cpp/copy_worker.cpp.)

    python3 tools/wait_probe.py --trace traces/gemma4-26b-a4b.json [--rounds 3]
        [--steps 16] [--share 0.25] [--json OUT]

BM5's decoder (bench/e2e_decoder.py) replays a recorded routing trace at
batch 1 with the engine's on-demand and oracle policies, each with the
worker's wait for its oldest copy in flight done both ways
(worker_wait="spin", the driver's event wait, and "poll"), alternating
within each round after an all-resident run of that round: same process,
same weights, same routing. Prints, per round and run, the p50 step
latency, its ratio to the round's all-resident p50, the hit rate and the
decoder's host time per layer by phase (bench/e2e.py's run_policy); the
JSON has every run. CUDA only: without it, says so and exits 1 (--cpu runs
the same on the host backend, to check the script)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="a routing trace; its file name (no .json) names BM5's model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--policies", nargs="+", default=["on-demand", "oracle"])
    parser.add_argument("--json")
    parser.add_argument("--cpu", action="store_true", help="check the script on the CPU (host backend; no figures)")
    args = parser.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("wait_probe needs CUDA: not measured", file=sys.stderr)
        return 1
    from bench.e2e import run_policy
    from bench.e2e_decoder import MODELS, Decoder
    from prefetch.integration import RoutingTrace

    name = os.path.basename(args.trace).removesuffix(".json")
    spec = dict(MODELS[name], name=name)
    trace = RoutingTrace.load(args.trace)
    forced = trace.steps[1:]
    dec = Decoder(torch, spec, 48, device="cpu" if args.cpu else "cuda")
    inputs = dec.inputs(args.warmup + args.steps, 1, seed=1)
    total = spec["layers"] * spec["experts"] * dec.slot_bytes
    budget = int(args.share * total) // dec.slot_bytes * dec.slot_bytes
    runs = []
    recorded = None
    for rnd in range(args.rounds):
        lat, _, recorded_now = run_policy(torch, dec, "all-resident", inputs, args.warmup, 0, forced=forced)
        recorded = recorded or recorded_now
        resident = statistics.median(lat) * 1e3
        runs.append({"round": rnd, "policy": "all-resident", "worker_wait": None, "p50_ms": resident})
        order = [(p, w) for p in args.policies for w in ("spin", "poll")]
        if rnd % 2:
            order.reverse()
        for policy, wait in order:
            lat, delta, _ = run_policy(torch, dec, policy, inputs, args.warmup, budget, trace=recorded,
                                       forced=forced, eviction="cyclic", handle_options={"worker_wait": wait})
            p50 = statistics.median(lat) * 1e3
            acquired = (delta.get("hits") or 0) + (delta.get("misses") or 0)
            run = {"round": rnd, "policy": policy, "worker_wait": wait, "p50_ms": p50, "x_resident": p50 / resident,
                   "hit_rate": delta["hits"] / acquired if acquired else None, "late": delta.get("late"),
                   "bytes": delta.get("bytes"), "host_us_per_layer": delta.get("host_us_per_layer")}
            runs.append(run)
            phases = " ".join(f"{k} {v:.0f}" for k, v in (run["host_us_per_layer"] or {}).items())
            print(f"round {rnd} {policy:<10} {wait:<5} p50 {p50:7.2f} ms  x resident {p50 / resident:5.2f}  "
                  f"hit {run['hit_rate']:.3f}  host us/layer: {phases}", flush=True)
    print(f"{name}, batch 1, {args.share:.0%} cache, {args.steps} steps, median over {args.rounds} rounds:")
    for policy in args.policies:
        for wait in ("spin", "poll"):
            xs = [r["x_resident"] for r in runs if r["policy"] == policy and r["worker_wait"] == wait]
            ps = [r["p50_ms"] for r in runs if r["policy"] == policy and r["worker_wait"] == wait]
            print(f"  {policy:<10} {wait:<5} p50 {statistics.median(ps):7.2f} ms  "
                  f"x resident {statistics.median(xs):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "share": args.share, "steps": args.steps, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
