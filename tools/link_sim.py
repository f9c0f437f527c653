"""BM5's decode loop against a simulated link, on the CPU: does the engine
keep the link busy when the copies set the pace?

    python3 tools/link_sim.py TRACE.json [--share 0.25] [--host-us 630]
        [--expert-us 905] [--steps 16] [--warmup 2]
        [--policies on-demand oracle oracle:4 oracle:8] [--option NAME=INT ...]
        [--separate] [--eager] [--json PATH]

The engine, its queue, pacing (Note [Speculation in chunks]), admission and
eviction, the controller and the oracle predictor are the real ones; the
GPU is not. The fault backend's simulated link (async_copy_ns_per_kib)
completes each copy at a fixed rate, one copy after another per device, so
an expert of 48 real KiB (12 chunks of 4 KiB) takes --expert-us on the link
(default 905 us: a gpt-oss-120b expert, 47.5 MiB, at the H200's 55 GB/s).
Each layer of each step does what BM5's decoder does on the host, with
--host-us of busy host time (default 630 us: BM5's resident gpt-oss step of
22.9 ms over 36 layers, run 86) standing for the model: the layer's work,
then `speculate(with_next_acquire=True)` and `route_and_acquire` with no
stream, so the host waits for the layer's copies there (on the GPU it waits
at the next layer's routing read-back, after launching this layer's
compute: the model here overlaps less host work with a copy than the GPU
does, never more). `release_held` and `speculate` end each step.

Policies: on-demand (no predictor, cyclic eviction), oracle (the trace
replayed, next-use hints and eviction, distance 2), oracle:D (distance D),
oracle-plan (the oracle with the controller's step plan, as BM5 runs it:
Note [Host-routed step pins] in prefetch/step_plan.py; the others run
without it).
--option passes PrefetchHandle options to every policy's handle
(max_speculative_bytes_in_flight=49152, copy_poll_us=0, ...). --separate
sends the last layer's guesses in an engine call of their own before this
layer's acquire instead of riding on it; --eager makes a layer's guesses
right after its acquire, before the next layer's host work, instead of at
the next layer (Note [Speculation after launch]).
Per policy: ms per step (median of the measured steps), the IO floor
(Belady's fewest loads for this cache over the same link, per step) and
max(IO floor, host time) as the floor, the link's busy share of the
measured steps (copies in them x --expert-us over their wall time; a copy
counts whole once issued, so what is still on the link as the last step
ends counts too and the share can pass 1 by that much: measured_ms is the
wall time, in_flight_ms_at_end the link time of the bytes the engine had in
flight then, an upper bound of it), hits,
late and the engine's on-demand and cancelled counts, and the link's idle
time a step split by the copy that ended it: a prefetch-lane copy (the
worker had nothing, or was late, to send) or an urgent one (a miss). A figure of this
model, not of a GPU: it says whether the engine's scheduling leaves the
link idle when it need not, without the H200 host's noise."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXPERT_BYTES = 48 * 1024
CHUNK_BYTES = 4096


def spin(seconds: float) -> None:
    """Busy host time (a sleep overshoots by tens of us on a VM)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def parse_policy(text: str):
    """"on-demand", "oracle" or "oracle:D": (name, distance)."""
    name, _, distance = text.partition(":")
    if name not in ("on-demand", "oracle", "oracle-plan") or (
            distance and (name != "oracle" or not distance.isdigit())):
        raise argparse.ArgumentTypeError(f"policy must be on-demand, oracle, oracle:D or oracle-plan, got {text!r}")
    return text


def run_policy(policy: str, trace, args) -> dict:
    import prefetch
    from prefetch.integration import OffloadController, OraclePredictor, layer_handle_options

    name, _, distance = policy.partition(":")
    layers, experts = trace.num_layers, trace.num_experts
    slots = max(1, int(layers * experts * args.share))
    ns_per_kib = int(args.expert_us * 1000 * 1024 / EXPERT_BYTES)
    oracle = name in ("oracle", "oracle-plan")
    options = layer_handle_options(layers, {"eviction_policy": "next-use" if oracle else "cyclic", **args.option})
    handle = prefetch.PrefetchHandle(device_budget_bytes=slots * EXPERT_BYTES, backend="fault",
                                     copy_chunk_bytes=CHUNK_BYTES,
                                     faults={"report_async": 1, "async_copy_ns_per_kib": ns_per_kib}, **options)
    try:
        predictor = None
        if oracle:
            predictor = OraclePredictor(trace, distance=int(distance or 2), hints=True)
        ctl = OffloadController(handle, num_layers=layers, num_experts=experts, top_k=1, predictor=predictor)
        if name == "oracle-plan":
            ctl.cache_slots = slots
        import torch

        weight = torch.zeros(EXPERT_BYTES, dtype=torch.uint8)
        for layer in range(layers):
            for e in range(experts):
                ctl.prefetcher.register_expert(layer, e, {"w": weight})
        host_s = args.host_us / 1e6
        wall = []
        before = None
        for i, step in enumerate(trace.steps[: args.warmup + args.steps]):
            if i == args.warmup:
                before = handle.stats()
                pinned_before = ctl.pinned_hits
                idle_before = handle.fault_counts()
            t0 = time.perf_counter()
            for layer in range(layers):
                spin(host_s)
                ctl.speculate(with_next_acquire=not args.separate)
                ctl.route_and_acquire(layer, None, np.asarray(step[layer], dtype=np.int64))
                if args.eager:
                    ctl.speculate()
            ctl.release_held()
            ctl.speculate()
            wall.append(time.perf_counter() - t0)
        after = handle.stats()
        idle_after = handle.fault_counts()
        measured = wall[args.warmup:]
        copied = (after["bytes_copied"] - before["bytes_copied"]) / EXPERT_BYTES
        delta = {k: after[k] - before[k] for k in ("hits", "misses", "late", "on_demand", "cancelled", "declined")}
        delta["hits"] += ctl.pinned_hits - pinned_before  # read from a step plan's pins: not acquired
        return {"policy": policy, "ms_per_step": statistics.median(measured) * 1e3,
                "link_busy": copied * args.expert_us / 1e6 / sum(measured),
                "measured_ms": sum(measured) * 1e3,
                "in_flight_ms_at_end": after["bytes_in_flight"] / EXPERT_BYTES * args.expert_us / 1e3,
                "experts_copied_per_step": copied / len(measured),
                "hit_rate": delta["hits"] / max(1, delta["hits"] + delta["misses"]),
                # the link's idle time a step, by the kind of copy that ended it
                **{f"idle_ms_before_{kind}": (idle_after[f"link_idle_before_{kind}_us"]
                                              - idle_before[f"link_idle_before_{kind}_us"]) / 1e3 / len(measured)
                   for kind in ("lane", "urgent")}, **delta}
    finally:
        handle.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--share", type=float, default=0.25, help="cache budget / all expert bytes")
    parser.add_argument("--host-us", type=float, default=630.0, help="busy host time per layer")
    parser.add_argument("--expert-us", type=float, default=905.0, help="one expert's time on the link")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trace-from", type=int, default=1, help="first step replayed (1: skip the prompt)")
    parser.add_argument("--policies", nargs="+", type=parse_policy, default=["on-demand", "oracle", "oracle:4"])
    parser.add_argument("--option", nargs="+", default=[], metavar="NAME=INT",
                        help="PrefetchHandle options for every policy")
    parser.add_argument("--separate", action="store_true",
                        help="the last layer's guesses in an engine call of their own before this layer's "
                             "acquire, not riding on it (Note [Speculation rides on the next acquire])")
    parser.add_argument("--eager", action="store_true",
                        help="this layer's guesses right after its acquire, before the next layer's host work "
                             "(not deferred: Note [Speculation after launch])")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from bench.e2e_providers import int_options

    try:
        args.option = int_options(args.option, "--option")
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 < args.share <= 1:
        parser.error("--share must be in (0, 1]")
    if args.host_us < 0 or args.expert_us <= 0 or args.steps < 1 or args.warmup < 0:
        parser.error("--host-us >= 0, --expert-us > 0, --steps >= 1 and --warmup >= 0")
    from prefetch.integration import RoutingTrace, belady_misses

    trace = RoutingTrace.load(args.trace)
    if not 0 <= args.trace_from < len(trace.steps):
        parser.error(f"--trace-from must be in 0..{len(trace.steps) - 1}")
    trace.steps = trace.steps[args.trace_from:]
    if len(trace.steps) < args.warmup + args.steps:
        parser.error(f"the trace has {len(trace.steps)} steps from --trace-from, fewer than --warmup + --steps")
    slots = max(1, int(trace.num_layers * trace.num_experts * args.share))
    cut = RoutingTrace(trace.num_layers, trace.num_experts, trace.steps[: args.warmup + args.steps])
    io_floor_ms = belady_misses(cut, slots, start_step=args.warmup) / args.steps * args.expert_us / 1e3
    host_ms = trace.num_layers * args.host_us / 1e3
    floor_ms = max(io_floor_ms, host_ms)
    rows = [run_policy(p, trace, args) for p in args.policies]
    print(f"{os.path.basename(args.trace)}: {trace.num_layers} layers, share {args.share:g}, host {host_ms:.2f} ms "
          f"a step, IO floor {io_floor_ms:.2f} ms, floor {floor_ms:.2f} ms (simulated link, CPU)")
    print(f"{'policy':<12} {'ms/step':>8} {'x floor':>8} {'link busy':>9} {'copies':>7} {'hit':>5} "
          f"{'late':>5} {'on-demand':>9} {'cancelled':>9} {'idle->lane':>10} {'idle->urgent':>12}")
    for r in rows:
        print(f"{r['policy']:<12} {r['ms_per_step']:8.2f} {r['ms_per_step'] / floor_ms:8.2f} {r['link_busy']:9.2f} "
              f"{r['experts_copied_per_step']:7.1f} {r['hit_rate']:5.2f} {r['late']:5d} {r['on_demand']:9d} "
              f"{r['cancelled']:9d} {r['idle_ms_before_lane']:10.2f} {r['idle_ms_before_urgent']:12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "io_floor_ms": io_floor_ms, "host_ms": host_ms, "floor_ms": floor_ms,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
