"""Host cost of the controller's per-layer calls with the oracle predictor,
on the CPU (host backend): what BM5 pays per MoE layer besides the model.

    python3 tools/speculation_cost.py TRACE.json [--steps 40] [--repeats 3]
        [--separate] [--no-plan] [--share 0.25]

Replays the trace's routings (from its second step, as BM5's --trace-from 1)
through an OffloadController with OraclePredictor(distance=2) and a
"next-use" handle holding --share of the (layer, expert) tensors of 4 KiB
each (1.0: all of them, no copies after the first pass, and the predictor
runs on every layer: the host work alone, without the copy workers taking
this machine's cores), calling `speculate(with_next_acquire=True)` then `route_and_acquire`
per layer as BM5's decoder does, with no model around them. Prints us per
layer for each of the two calls and for the engine calls inside them
(median of --repeats passes, each after one unmeasured pass). --separate:
the speculation's engine call on its own, as before Note [Speculation rides
on the next acquire]; --no-plan: the oracle predicts and observes, as before
Note [The oracle's plan]."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_pass(ctl, steps, layers, ride: bool = True) -> dict:
    spec = acq = 0
    engine0 = ctl.engine_ns
    for step in steps:
        for layer in range(layers):
            experts = np.asarray(step[layer], dtype=np.int64)
            t0 = time.perf_counter_ns()
            ctl.speculate(with_next_acquire=ride)
            t1 = time.perf_counter_ns()
            ctl.route_and_acquire(layer, None, experts)
            acq += time.perf_counter_ns() - t1
            spec += t1 - t0
        ctl.release_held()
        ctl.speculate()
    n = len(steps) * layers
    return {"speculate": spec / n / 1e3, "route_and_acquire": acq / n / 1e3,
            "engine": (ctl.engine_ns - engine0) / n / 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--separate", action="store_true", help="the speculation's engine call on its own")
    parser.add_argument("--no-plan", action="store_true", help="the oracle predicts and observes (no plan)")
    parser.add_argument("--share", type=float, default=0.25, help="cache budget / all tensor bytes (<= 1)")
    args = parser.parse_args(argv)
    if not 0 < args.share <= 1:
        parser.error("--share must be in (0, 1]")
    import prefetch
    from prefetch.integration import OffloadController, OraclePredictor, RoutingTrace, layer_handle_options

    trace = RoutingTrace.load(args.trace)
    trace.steps = trace.steps[1:]
    layers, experts = trace.num_layers, trace.num_experts
    steps = trace.steps[: args.steps]
    nbytes = 4096
    options = layer_handle_options(layers, {"eviction_policy": "next-use"})
    slots = max(1, int(layers * experts * args.share))
    with prefetch.PrefetchHandle(device_budget_bytes=slots * nbytes, backend="host", **options) as handle:
        oracle = OraclePredictor(trace, distance=2, hints=True)
        if args.no_plan:
            oracle.plan = None  # the controller then calls predict and observe
        ctl = OffloadController(handle, num_layers=layers, num_experts=experts, top_k=1, predictor=oracle)
        ctl.probe_when_nothing_fetched = args.share < 1
        import torch

        weight = torch.zeros(nbytes, dtype=torch.uint8)
        for layer in range(layers):
            for e in range(experts):
                ctl.prefetcher.register_expert(layer, e, {"w": weight})
        runs = []
        for _ in range(args.repeats):
            one_pass(ctl, steps, layers, not args.separate)  # unmeasured: caches and queues settle
            ctl.new_sequence()
            runs.append(one_pass(ctl, steps, layers, not args.separate))
            ctl.new_sequence()
    name = os.path.basename(args.trace)
    how = ("separate calls" if args.separate else "one call") + (", no plan" if args.no_plan else ", plan")
    print(f"{name}: {len(steps)} steps x {layers} layers, host backend, {how}, us per layer "
          f"(median of {args.repeats}):")
    for key in ("speculate", "route_and_acquire", "engine"):
        print(f"  {key:<18} {statistics.median(r[key] for r in runs):6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
