"""The engine path of one MoE layer, all hits: host time per layer.

    python bench/engine_path.py [--backend auto|cuda|host] [--layers 48] [--experts 128]
        [--top 8] [--iterations 2000] [--thrash-mb 0] [--json PATH]

A decode loop over `layers` layers whose experts are all resident (the
budget holds every expert), 8 routed experts per layer and 8 guesses for the
next one, on the current CUDA stream. Rows, each the median over
`iterations` layers of host wall time:
  step              PrefetchHandle.exchange: release the previous layer's
                    ids, acquire this layer's, queue the next layer's
                    guesses (one GIL-free call; Note [One call per layer]);
                    the row keeps the call's old name, so that it compares
                    with earlier results
  exchange          OffloadController.exchange: the same through the
                    controller (tensor-id lookup, cancel of wrong guesses,
                    bookkeeping): what an offloaded transformers layer pays
                    in the engine
  separate-calls    the pre-step path: prefetch_tensors + acquire_slots +
                    release, three calls
  by-hand-separate  the same three through ExpertPrefetcher, as a serving
                    stack's own layer calls them (prefetch_experts,
                    acquire_experts, release_experts): (layer, expert) to
                    ids and the weights' views included
  by-hand-layer     ExpertPrefetcher.layer: the same work in one call (the
                    step), weights' views included
  pin-layer         the sync-free decode path's call (Note [Pins without
                    waiting]): release the previous layer's pins, pin every
                    resident expert of this layer (`experts` ids, each
                    asked whether its copy completed), report this
                    layer's routed experts as used
  step-plan         a host-routed step plan's call (Note [Host-routed step
                    pins] in prefetch/offload/step_plan.py), once a step on a
                    second handle with "next-use" eviction: release the
                    last step's pins, report its reads as used, pin this
                    step's reads (`layers` x `top`), prefetch the next
                    step's and hint their next-use times; its p50 is per
                    call
  hints-one-time    on that handle, a hint_next_use of `layers` x `top`
                    random resident ids, all to one time (per call)
  hints-clear       the same ids' hints cleared (NO_NEXT_USE) right after
                    (per call). Stop 47 tried a next-use order kept in a
                    bucket per time that placed a hinted entry by walking
                    its bucket: the step-plan call fell 3-5x, but 1,000
                    hints to one time took 1.5 ms and clearing 180 hints
                    among 6,000 unhinted entries 5.4-5.7 ms (0.19 ms and 29
                    us with the set; docs/results.md, stop 47). These two
                    rows are here so such a cliff shows. The buckets now
                    keep a hinted time in order of arrival, with no walk,
                    and the unhinted in a set by touch (Note [Next-use
                    buckets] in src_cpp/eviction_policy.h).
Bytes are tiny (4 KiB per expert): this measures issuance, not copies.
--thrash-mb N touches N MB of host memory between calls (outside the timed
region), as a model's forward does between two MoE layers: the call then
runs with cold caches, which is what it costs inside `generate`.
When the requested backend is unavailable (--backend cuda without CUDA),
every row is null (not measured, never zero), in the printout and the
JSON, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.lib.common import machine_info, write_json  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "host"])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--thrash-mb", type=int, default=0,
                        help="MB of host memory touched between calls (cold caches, as inside a forward)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.experts < 1 or args.top < 1 or args.iterations < 1:
        parser.error("--layers, --experts, --top and --iterations must be positive")
    if args.top > args.experts:
        parser.error(f"--top {args.top} is more than --experts {args.experts} (routed experts are distinct)")
    if args.thrash_mb < 0:
        parser.error(f"--thrash-mb must be >= 0, got {args.thrash_mb}")
    import numpy as np
    import torch

    import prefetch

    try:
        handle, ctl, stream = resident_handle(args, prefetch, np, torch, "cyclic")
    except prefetch.BackendUnavailableError as exc:  # e.g. --backend cuda without a GPU
        return not_measured(args, exc)
    cuda = stream is not None
    rng = np.random.default_rng(0)
    routes = [np.sort(rng.choice(args.experts, args.top, replace=False)).astype(np.int64)
              for _ in range(args.layers * 4)]
    rows = {}
    thrash = np.ones(args.thrash_mb << 17) if args.thrash_mb else None  # float64: 8 bytes each

    def timed(name, body):
        samples = []
        for i in range(args.iterations + 100):
            layer = i % args.layers
            experts = routes[i % len(routes)]
            guess = routes[(i + 1) % len(routes)]
            if thrash is not None:
                np.add(thrash, 1.0, out=thrash)
            t0 = time.perf_counter_ns()
            body(layer, experts, guess)
            t1 = time.perf_counter_ns()
            if i >= 100:
                samples.append((t1 - t0) / 1e3)
        if cuda:
            torch.cuda.synchronize()
        rows[name] = _row(samples)

    held = [None]

    def step(layer, experts, guess):
        ids = ctl.ids(layer, experts)
        nxt = ctl.ids((layer + 1) % args.layers, guess)
        handle.exchange(ids, release=held[0], prefetch=nxt, priority=1, stream=stream)
        held[0] = ids

    def exchange(layer, experts, guess):
        ctl.exchange(layer, experts, {(layer + 1) % args.layers: guess}, None, stream=stream)

    def separate(layer, experts, guess):
        ids = ctl.ids(layer, experts)
        handle.prefetch_tensors(ctl.ids((layer + 1) % args.layers, guess), 1)
        handle.acquire_slots(ids, stream=stream)
        handle.release(ids, stream=stream)

    def by_hand_separate(layer, experts, guess):
        pf = ctl.prefetcher
        pf.prefetch_experts((layer + 1) % args.layers, guess, 1)
        pf.acquire_experts(layer, experts, stream=stream)
        pf.release_experts(layer, experts, stream=stream)

    def by_hand_layer(layer, experts, guess):
        ctl.prefetcher.layer(layer, experts, prefetch={(layer + 1) % args.layers: guess}, priority=1, stream=stream)

    timed("step", step)
    if held[0] is not None:
        handle.release(held[0], stream=stream)
    timed("by-hand-separate", by_hand_separate)
    timed("by-hand-layer", by_hand_layer)
    ctl.prefetcher.release_held(stream=stream)
    timed("exchange", exchange)
    ctl.release_held(stream)
    timed("separate-calls", separate)
    layer_ids = [ctl.prefetcher.tensor_ids(layer, np.arange(args.experts)) for layer in range(args.layers)]
    pin_out = np.empty(args.experts, dtype=np.int64)
    pinned = [None]

    def pin_layer(layer, experts, guess):
        ids = layer_ids[layer]
        handle.exchange(release=pinned[0], pin=ids, pin_into=pin_out, use=ctl.ids(layer, experts), stream=stream)
        pinned[0] = ids[pin_out >= 0]

    timed("pin-layer", pin_layer)
    if pinned[0] is not None:
        handle.release(pinned[0], stream=stream)
    s = handle.stats()
    hit_rate = s["hits"] / max(1, s["hits"] + s["misses"])
    next_use, pins_resident = next_use_rows(args, prefetch, np, torch, routes, thrash)
    rows.update(next_use)
    cold = f", {args.thrash_mb} MB touched between calls" if args.thrash_mb else ""
    print(f"engine path per layer, {args.top} experts, all hits ({handle.backend}{cold}; hit rate "
          f"{hit_rate:.3f} over step to pin-layer, warm-up included; the step plan's pins found "
          f"{pins_resident:.3f} resident):")
    for name, r in rows.items():
        print(f"  {name:15s} p50 {r['p50_us']:7.2f} us   p90 {r['p90_us']:7.2f} us")
    ctl.close()
    if args.json:
        write_json(args.json, {"bench": "engine_path", "machine": machine_info(), "backend": handle.backend,
                               "top": args.top, "layers": args.layers, "experts": args.experts,
                               "thrash_mb": args.thrash_mb,
                               "hit_rate": hit_rate, "step_plan_pins_resident": pins_resident, "rows": rows})
    return 0


ROWS = ("step", "by-hand-separate", "by-hand-layer", "exchange", "separate-calls", "pin-layer", "step-plan",
        "hints-one-time", "hints-clear")


def not_measured(args, exc) -> int:
    """The requested backend is unavailable: every row null (never zero), the
    JSON written where it would be, exit status 1."""
    print(f"engine path: could not measure on backend {args.backend!r}: {exc}", file=sys.stderr)
    print(f"engine path per layer, {args.top} experts: not measured (backend {args.backend} unavailable):")
    for name in ROWS:
        print(f"  {name:15s} p50    null      p90    null")
    if args.json:
        write_json(args.json, {"bench": "engine_path", "machine": machine_info(), "backend": None,
                               "requested_backend": args.backend, "error": str(exc),
                               "top": args.top, "layers": args.layers, "experts": args.experts,
                               "thrash_mb": args.thrash_mb, "hit_rate": None, "step_plan_pins_resident": None,
                               "rows": {name: None for name in ROWS}})
    return 1


def _row(samples: list, per_what: str | None = None) -> dict:
    """A row's figures from its samples (us)."""
    samples.sort()
    row = {"p50_us": statistics.median(samples), "p90_us": samples[int(0.9 * len(samples))],
           "iterations": len(samples)}
    if per_what is not None:
        row["per"] = per_what
    return row


def resident_handle(args, prefetch, np, torch, eviction: str):
    """A handle of `eviction` with the decode loop's experts registered (4
    KiB each) and every one resident, its controller and the current CUDA
    stream (None on the host backend)."""
    from prefetch.controller import OffloadController

    per = 4096
    budget = args.layers * args.experts * (per + 256) + (1 << 20)
    handle = prefetch.PrefetchHandle(device_budget_bytes=budget, backend=args.backend, eviction_policy=eviction)
    stream = torch.cuda.current_stream().cuda_stream if handle.backend == "cuda" else None
    ctl = OffloadController(handle, num_layers=args.layers, num_experts=args.experts, top_k=args.top)
    payload = torch.zeros(per // 4, dtype=torch.float32)
    for layer in range(args.layers):
        for e in range(args.experts):
            ctl.prefetcher.register_expert(layer, e, {"w": payload})
    for layer in range(args.layers):
        ids = ctl.prefetcher.tensor_ids(layer, np.arange(args.experts))
        handle.acquire_slots(ids, stream=stream, timeout=60)
        handle.release(ids, stream=stream)
    if stream is not None:
        torch.cuda.synchronize()  # every copy done: the loops only hit
    return handle, ctl, stream


def next_use_rows(args, prefetch, np, torch, routes, thrash) -> tuple[dict, float]:
    """The step-plan and hint rows: their own handle ("next-use" eviction,
    every expert resident); the step plan's call once a step over eight
    steps' reads in turn, then the hint calls. Returns (rows, the share of
    the step plan's pins that found their expert resident: pins count no
    hit in the engine's counters)."""
    handle, ctl, stream = resident_handle(args, prefetch, np, torch, "next-use")
    try:
        steps = []  # per step: its reads' tensor ids (sorted) and each one's layer
        for s in range(8):
            ids = np.concatenate([ctl.ids(layer, routes[(s * args.layers + layer) % len(routes)])
                                  for layer in range(args.layers)])
            layers = np.repeat(np.arange(args.layers), args.top)
            order = np.argsort(ids, kind="stable")
            steps.append((ids[order], layers[order]))
        pin_out = np.empty(args.layers * args.top, dtype=np.int64)
        pinned, used = None, None
        samples = []
        pins = pins_resident = 0
        for i in range(max(200, args.iterations // args.layers) + 20):
            now, _ = steps[i % len(steps)]
            nxt, nxt_layers = steps[(i + 1) % len(steps)]
            clock = i * args.layers
            when = clock + args.layers + nxt_layers  # the next step's layer of each read
            if thrash is not None:
                np.add(thrash, 1.0, out=thrash)
            t0 = time.perf_counter_ns()
            handle.exchange(release=pinned, pin=now, pin_into=pin_out[: now.shape[0]], use=used, prefetch=nxt,
                            priority=1, hint_ids=nxt, hint_when=when, now=clock, stream=stream)
            t1 = time.perf_counter_ns()
            pinned, used = now[pin_out[: now.shape[0]] >= 0], now
            pins += now.shape[0]
            pins_resident += pinned.shape[0]
            if i >= 20:
                samples.append((t1 - t0) / 1e3)
        if pinned is not None:
            handle.release(pinned, stream=stream)
        if stream is not None:
            torch.cuda.synchronize()
        rows = {"step-plan": _row(samples, "step")}
        every = np.concatenate([ctl.prefetcher.tensor_ids(layer, np.arange(args.experts))
                                for layer in range(args.layers)])
        rng = np.random.default_rng(1)
        n = min(args.layers * args.top, every.shape[0])
        clear = np.full(n, prefetch.NO_NEXT_USE, dtype=np.int64)
        hint, cleared = [], []
        clock = handle.hint_clock() or 0
        for i in range(120):
            ids = np.sort(rng.choice(every, n, replace=False))
            clock += 1
            t0 = time.perf_counter_ns()
            handle.hint_next_use(ids, np.full(n, clock + 10, dtype=np.int64), now=clock)
            t1 = time.perf_counter_ns()
            handle.hint_next_use(ids, clear)
            t2 = time.perf_counter_ns()
            if i >= 20:
                hint.append((t1 - t0) / 1e3)
                cleared.append((t2 - t1) / 1e3)
        rows["hints-one-time"] = _row(hint, "call")
        rows["hints-clear"] = _row(cleared, "call")
        return rows, pins_resident / max(1, pins)
    finally:
        handle.close()


if __name__ == "__main__":
    sys.exit(main())
