"""How many of a layer's guesses does the engine copy while the GPU runs the
chain between one layer's last miss and the next routing read-back? BM7
and BM6 at batch 8 and a quarter of the experts cached (docs/results.md,
runs 61-66): the gate is right on 85 % of its guesses, yet the engine
cancels 97 % of them before their copy, and the link idles 0.6-0.8 ms a
layer during that chain. This replays the pattern on the engine alone
(runs 67-70 found the cause with it: the host's `.cpu()` read-back held
the copy worker up; see --read-back and prefetch/read_back.py):

    python3 tools/speculation_start_probe.py [--chain-us 0 300 600 1200] [--json PATH]

Per layer, one engine call (as `OffloadController.exchange`): release the
last layer's experts, cancel this layer's guesses still queued, acquire this
layer's routed experts (the misses are copied on demand) on the compute
stream, queue the next layer's guesses at band 1. Then the compute stream
"runs the layer" (waits for the acquired copies, then a kernel of
--chain-us: the experts, the all-reduce, the next attention and router)
and the host waits for it (the routing read-back). Routings are random
(--routed of --experts per layer), guesses are the next layer's routing with
--precision of them right. Entries are --expert-mib each (OLMoE-1B-7B's are
12 MiB), the cache --share of them, eviction "cyclic" as
`offload_moe_experts` sets it.

Prints, per chain length: ms per layer, and per layer the guesses queued,
cancelled before their copy, copied, and the misses; with the chain's
length, how many expert copies the link could have made in it (at the
measured on-demand rate). With CUDA, also when (host-observed) the
misses landed, how long after that the copy worker issued its first guess,
and how many guesses it issued before the chain ended. On a machine without CUDA it runs on the host
backend with a busy-wait for the chain (the copies are synchronous there:
a check that it runs, not a measurement)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def routings(rng, layers: int, steps: int, experts: int, routed: int, precision: float, guesses: int):
    """(routed experts, guesses for it made a layer before) per (step, layer),
    in visiting order."""
    plan = []
    for _ in range(steps):
        for _ in range(layers):
            plan.append(np.sort(rng.choice(experts, routed, replace=False)))
    out = []
    for i, need in enumerate(plan):
        nxt = plan[i + 1] if i + 1 < len(plan) else None
        guess = None
        if nxt is not None:
            right = rng.choice(nxt, min(len(nxt), int(round(precision * guesses))), replace=False)
            wrong_pool = np.setdiff1d(np.arange(experts), nxt)
            wrong = rng.choice(wrong_pool, min(len(wrong_pool), guesses - right.shape[0]), replace=False)
            guess = np.sort(np.concatenate([right, wrong]))
        out.append((need, guess))
    return out


def run_chain(torch, args, chain_us: float, cuda: bool, cycles_per_us: float) -> dict:
    import prefetch
    from prefetch.read_back import to_host

    layers, experts = args.layers, args.experts
    size = int(args.expert_mib * (1 << 20))
    budget = int(args.share * layers * experts) * size
    handle = prefetch.PrefetchHandle(device_budget_bytes=budget, backend="cuda" if cuda else "host",
                                     eviction_policy="cyclic", cycle_acquires=layers)
    host = torch.empty((experts, size), dtype=torch.uint8)
    if cuda:
        host = host.pin_memory()
    ids = np.arange(layers * experts, dtype=np.int64).reshape(layers, experts)
    for layer in range(layers):
        for e in range(experts):
            handle.register(int(ids[layer, e]), host[e])  # every layer's expert e reads the same bytes
    stream = torch.cuda.current_stream().cuda_stream if cuda else None
    rng = np.random.default_rng(args.seed)
    plan = routings(rng, layers, args.warmup_steps + args.steps, experts, args.routed, args.precision, args.guesses)
    routing = torch.zeros(64, dtype=torch.int64, device="cuda") if cuda else None
    held = None
    timeline = {"landed_us": [], "first_guess_us": [], "guesses_in_chain": []}
    queued = {}  # layer -> ids of its guesses queued
    times = []
    marks = None
    for i, (need, guess) in enumerate(plan):
        layer = i % layers
        if i == args.warmup_steps * layers:
            marks = handle.stats()
        t0 = time.perf_counter()
        nxt = (layer + 1) % layers
        prefetch_ids = ids[nxt][guess] if guess is not None else None
        acquire = ids[layer][need]
        handle.step(acquire, release=held, prefetch=prefetch_ids, band=1, cancel=queued.pop(layer, None),
                    stream=stream)
        if prefetch_ids is not None:
            queued[nxt] = prefetch_ids
        held = acquire
        if cuda:
            landed = torch.cuda.Event()
            landed.record()  # the compute stream passes it once the layer's misses are in
            if chain_us > 0:
                torch.cuda._sleep(int(chain_us * cycles_per_us))
            if marks is None or args.read_back == "copy":
                # The routing read-back as the serving path makes it: a
                # small device-to-host copy on the compute stream, blocking.
                routing.cpu()
            elif args.read_back == "pinned":
                to_host(routing)  # prefetch.read_back: a blocking copy into page-locked memory
            elif args.read_back == "sync":
                torch.cuda.current_stream().synchronize()
            else:
                watch(handle, landed, t0, timeline)
        else:
            end = time.perf_counter() + chain_us / 1e6
            while time.perf_counter() < end:
                pass
        if marks is not None:
            times.append(time.perf_counter() - t0)
    handle.release(held, stream=stream)
    end = handle.stats()
    handle.close()
    n = len(times)
    delta = {k: end[k] - marks[k] for k in ("enqueued", "cancelled", "declined", "copies", "on_demand", "hits",
                                            "misses", "copy_seconds", "bytes_copied")}
    guess_copies = delta["copies"] - delta["on_demand"]
    rate = delta["bytes_copied"] / delta["copy_seconds"] if delta["copy_seconds"] > 0 else None
    def med(xs):
        return statistics.median(xs) if xs else None

    return {"chain_us": chain_us, "ms_per_layer": statistics.median(times) * 1e3,
            # Host-observed, from the engine call's start, medians over the
            # measured layers (CUDA only): the misses in (the compute
            # stream passed an event behind their waits), the first guess's
            # copy issued after that, and the guesses issued between the
            # misses landing and the chain's end.
            "misses_landed_us": med(timeline["landed_us"]),
            "first_guess_after_landing_us": med(timeline["first_guess_us"]),
            "layers_with_a_guess_in_chain": sum(1 for g in timeline["guesses_in_chain"] if g > 0),
            "guesses_issued_in_chain_per_layer": (sum(timeline["guesses_in_chain"]) / n
                                                  if timeline["guesses_in_chain"] else None),
            "guesses_queued_per_layer": delta["enqueued"] / n, "guesses_cancelled_per_layer": delta["cancelled"] / n,
            "guesses_declined_per_layer": delta["declined"] / n, "guesses_copied_per_layer": guess_copies / n,
            "misses_per_layer": delta["on_demand"] / n,
            "hit_rate": delta["hits"] / (delta["hits"] + delta["misses"]) if delta["hits"] + delta["misses"] else None,
            "copies_the_chain_could_hold": (chain_us * 1e-6 * rate / size) if rate else None}


def watch(handle, landed, t0: float, timeline: dict) -> None:
    """Polls (instead of one synchronize) until the compute stream is idle:
    when the `landed` event completes, and when the copies count first
    passes the on-demand count plus the guesses copied before, that is,
    when the copy worker issued its first guess after the misses landed."""
    import torch

    stream = torch.cuda.current_stream()
    s = handle.stats()
    guesses_before = s["copies"] - s["on_demand"]
    landed_at = first_at = None
    at_landing = guesses_before
    while True:
        done = stream.query()
        s = handle.stats()
        now = time.perf_counter()
        guesses = s["copies"] - s["on_demand"]
        if landed_at is None and landed.query():
            landed_at, at_landing = now, guesses
        if landed_at is not None and first_at is None and guesses > at_landing:
            first_at = now
        if done:
            break
    if landed_at is not None:
        timeline["landed_us"].append((landed_at - t0) * 1e6)
        timeline["guesses_in_chain"].append(guesses - at_landing)
        if first_at is not None:
            timeline["first_guess_us"].append((first_at - landed_at) * 1e6)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chain-us", type=float, nargs="+", default=[0, 300, 600, 1200])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--routed", type=int, default=21, help="distinct experts a layer routes to (a rank's share)")
    parser.add_argument("--guesses", type=int, default=21)
    parser.add_argument("--precision", type=float, default=0.85)
    parser.add_argument("--expert-mib", type=float, default=12.0)
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="the host backend even where CUDA is present")
    parser.add_argument("--read-back", choices=("watch", "copy", "pinned", "sync"), default="watch",
                        help="how the host waits for the layer (CUDA): polling the stream and the engine's counts "
                             "(the timeline below), a blocking .cpu() of a routing-sized tensor (the serving path "
                             "before run 68), prefetch.read_back.to_host of it (the serving path since), or a "
                             "stream synchronize")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not 0 <= args.precision <= 1 or args.routed > args.experts or args.guesses > args.experts:
        parser.error("--precision in [0, 1]; --routed and --guesses at most --experts")
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    cycles_per_us = 0.0
    if cuda:
        torch.cuda._sleep(1000)  # loads the kernel: the timed call below is its run alone
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        cycles_per_us = 20_000_000 / (a.elapsed_time(b) * 1e3)
    rows = [run_chain(torch, args, c, cuda, cycles_per_us) for c in args.chain_us]
    print(f"{'chain us':>8} {'ms/layer':>8} {'queued':>7} {'cancelled':>9} {'declined':>8} {'copied':>7} "
          f"{'misses':>7} {'hit rate':>8} {'link room':>9}   (per layer; link room: copies the chain could hold)")
    for r in rows:
        room = r["copies_the_chain_could_hold"]
        if r["misses_landed_us"] is not None:
            first = r["first_guess_after_landing_us"]
            print(f"{'':8} misses landed {r['misses_landed_us']:.0f} us after the call; first guess issued "
                  f"{'never' if first is None else f'{first:.0f} us'} after that; guesses issued in the chain "
                  f"{r['guesses_issued_in_chain_per_layer']:.2f} a layer ({r['layers_with_a_guess_in_chain']} "
                  f"layers with one)")
        print(f"{r['chain_us']:8.0f} {r['ms_per_layer']:8.2f} {r['guesses_queued_per_layer']:7.1f} "
              f"{r['guesses_cancelled_per_layer']:9.1f} {r['guesses_declined_per_layer']:8.1f} "
              f"{r['guesses_copied_per_layer']:7.1f} {r['misses_per_layer']:7.1f} {r['hit_rate'] or 0:8.2f} "
              f"{room if room is not None else float('nan'):9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cuda": cuda, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
