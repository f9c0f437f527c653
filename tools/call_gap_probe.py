"""What one layer's engine crossing costs back to back, and with the gaps a
decode loop leaves between calls (diagnostic; host backend, no GPU needed).

    python3 tools/call_gap_probe.py TRACE.json [--steps 10] [--rounds 3]
        [--gap-us 500] [--sweep-mib 8] [--json OUT.json]

BM5 on the H200 host spent 55 us a layer in the engine's calls and about
110 more in the controller around them (run 76), where
tools/speculation_cost.py, the same calls replayed with nothing in between,
took 12-20 and 19-32 us on that host (run 79). This probe replays the
trace's first --steps steps (every expert resident: a budget of every
tensor, so no copy runs) through an OffloadController without a predictor,
one `route_and_acquire` a layer as BM5 makes it, and times each call
(Python and engine; the engine's own share too) in three ways, round after
round:

  back-to-back  the calls one after another
  gap           a sleep of --gap-us before each call (the core idles, as
                while a serving thread waits for the GPU)
  sweep         a pass over --sweep-mib of memory before each call (what a
                model's work between two calls does to the caches)

Prints us per call (p10, p50, p90) per way; --json keeps them. Nothing here
is a target figure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-us", type=float, default=500.0)
    parser.add_argument("--sweep-mib", type=float, default=8.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.gap_us < 0 or args.sweep_mib <= 0:
        parser.error("need --steps >= 1, --rounds >= 1, --gap-us >= 0, --sweep-mib > 0")

    import torch

    import prefetch
    from prefetch.integration import OffloadController, RoutingTrace, layer_handle_options

    trace = RoutingTrace.load(args.trace)
    steps = trace.steps[1 : 1 + args.steps] or trace.steps[: args.steps]
    layers, experts = trace.num_layers, trace.num_experts
    nbytes = 4096
    sweep = np.ones(int(args.sweep_mib * 2**20), dtype=np.uint8)
    gap_s = args.gap_us / 1e6
    ways = {
        "back-to-back": lambda: None,
        "gap": lambda: time.sleep(gap_s),
        "sweep": lambda: int(sweep.sum()),
    }
    out = {way: {"call_us": [], "engine_us": []} for way in ways}
    with prefetch.PrefetchHandle(device_budget_bytes=layers * experts * nbytes, backend="host",
                                 **layer_handle_options(layers)) as handle:
        ctl = OffloadController(handle, num_layers=layers, num_experts=experts, top_k=1)
        weight = torch.zeros(nbytes, dtype=torch.uint8)
        for layer in range(layers):
            for e in range(experts):
                ctl.prefetcher.register_expert(layer, e, {"w": weight})

        def one_pass(before, keep):
            for step in steps:
                for layer in range(layers):
                    experts_now = np.asarray(step[layer], dtype=np.int64)
                    before()
                    engine0 = ctl.engine_ns
                    t0 = time.perf_counter_ns()
                    ctl.route_and_acquire(layer, None, experts_now)
                    t1 = time.perf_counter_ns()
                    if keep is not None:
                        keep["call_us"].append((t1 - t0) / 1e3)
                        keep["engine_us"].append((ctl.engine_ns - engine0) / 1e3)
                ctl.release_held()
                ctl.speculate()

        one_pass(ways["back-to-back"], None)  # every expert copied in once, unmeasured
        copies = handle.stats()["copies"]
        for _ in range(args.rounds):
            for way, before in ways.items():
                one_pass(before, out[way])
        copied_while_measured = handle.stats()["copies"] - copies
    summary = {}
    for way, got in out.items():
        summary[way] = {k: np.percentile(v, [10, 50, 90]).tolist() for k, v in got.items()}
        call, engine = summary[way]["call_us"], summary[way]["engine_us"]
        print(f"{way:13s} us per call p10/p50/p90 {call[0]:7.1f} {call[1]:7.1f} {call[2]:7.1f}   "
              f"engine {engine[0]:6.1f} {engine[1]:6.1f} {engine[2]:6.1f}")
    print(f"copies while measured: {copied_while_measured}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "copies_while_measured": copied_while_measured,
                       "calls": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
