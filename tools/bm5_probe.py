"""Where a BM5 decode step's time goes (diagnostic, GPU only).

    python tools/bm5_probe.py --json OUT.json

1. The host sync BM5 does once per layer (a tiny device-to-host read,
   `tolist()`), alone and with host-to-device copies queued on another
   stream: does the routing read wait behind prefetch traffic?
2. A few BM5 cells (model, batch, cache share) under several engine settings
   (eviction, next-use hints, copy lanes, oracle distance) and the by-hand policy, with
   the host time of each phase of a step (routing sync, acquire, compute
   launch, release) and the engine's counters.
Prints a table; --json keeps everything. Nothing here is a target figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.e2e_decoder import MODELS, Decoder, measure_steps  # noqa: E402
from bench.e2e_providers import ByHandProvider, EngineProvider, ResidentProvider  # noqa: E402


def sync_probe(torch, reps: int = 30) -> dict:
    x = torch.arange(16, device="cuda")
    side = torch.cuda.Stream()
    chunk = 4 << 20
    src = torch.empty(64, chunk, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(64, chunk, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(16, dtype=x.dtype, pin_memory=True)
    out = {}
    for queued in (0, 4, 16, 64):
        for how in ("tolist", "pinned+event"):
            lat = []
            for _ in range(reps):
                torch.cuda.synchronize()
                with torch.cuda.stream(side):
                    for i in range(queued):
                        dst[i].copy_(src[i], non_blocking=True)
                t = time.perf_counter()
                if how == "tolist":
                    x.tolist()
                else:
                    pinned.copy_(x, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record()
                    ev.synchronize()
                lat.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            out[f"{how} with {queued * 4} MiB queued"] = statistics.median(lat) * 1e6
    return out


def run_cell(torch, dec, trace, inputs, warmup, budget, label, policy, options, distance,
             eviction="cyclic", hints=False):
    from prefetch.integration import OraclePredictor, RoutingTrace

    spec = dec.spec
    if policy == "torch-by-hand":
        provider = ByHandProvider(dec, budget)
    else:
        predictor = None
        if policy == "oracle":
            predictor = OraclePredictor(RoutingTrace(spec["layers"], spec["experts"], trace), distance=distance,
                                        hints=hints)
        provider = EngineProvider(dec, budget, predictor, eviction, options)
    timers = {}
    try:
        lat, before, after = measure_steps(dec, provider, inputs, warmup, timers=timers)
    finally:
        provider.close()
    steps = len(lat)
    counters = {k: (after[k] - before.get(k, 0)) / steps for k in after
                if isinstance(after.get(k), (int, float)) and k not in ("precision", "recall")}
    return {"label": label, "policy": policy, "options": options, "distance": distance, "eviction": eviction,
            "hints": hints,
            "p50_ms": statistics.median(lat) * 1e3,
            "phase_ms_per_step": {k: v / steps * 1e3 for k, v in timers.items()},
            "per_step": counters}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs CUDA: not measured", file=sys.stderr)
        return 1
    report = {"sync_us": sync_probe(torch)}
    for k, v in report["sync_us"].items():
        print(f"sync {k:<32} {v:9.1f} us", flush=True)
    cells = [("qwen3-30b-a3b", 1, 0.1), ("qwen3-30b-a3b", 1, 0.25), ("olmoe-1b-7b", 8, 0.25)]
    # label, policy, engine options, oracle distance, eviction, hints
    variants = [
        ("all-resident", "all-resident", None, 0, None, False),
        ("on-demand", "on-demand", {}, 0, "cyclic", False),
        ("by-hand", "torch-by-hand", None, 0, None, False),
        ("oracle cyclic", "oracle", {}, 2, "cyclic", False),
        ("oracle cyclic + hint calls", "oracle", {}, 2, "cyclic", True),
        ("oracle next-use", "oracle", {}, 2, "next-use", True),
        ("oracle next-use lanes 1", "oracle", {"copy_lanes": 1}, 2, "next-use", True),
        ("oracle next-use d1", "oracle", {}, 1, "next-use", True),
    ]
    report["cells"] = []
    for name, batch, share in cells:
        spec = dict(MODELS[name], name=name)
        dec = Decoder(torch, spec, 48)
        n = args.warmup + args.steps
        inputs = dec.inputs(n, batch, seed=batch)
        total = spec["layers"] * spec["experts"] * dec.slot_bytes
        budget = int(share * total) // dec.slot_bytes * dec.slot_bytes
        res = ResidentProvider(dec)
        for x in inputs:
            dec.step(x, res)
        dec.sync()
        trace = res.trace
        print(f"\n{name} b{batch} {share:.0%}", flush=True)
        for label, policy, options, distance, eviction, hints in variants:
            if policy == "all-resident":
                lat, timers = [], {}
                for i, x in enumerate(inputs):
                    dec.sync()
                    dec.timers = timers if i >= args.warmup else None
                    t0 = time.perf_counter()
                    dec.step(x, ResidentProvider(dec))
                    dec.sync()
                    if i >= args.warmup:
                        lat.append(time.perf_counter() - t0)
                dec.timers = None
                row = {"label": label, "p50_ms": statistics.median(lat) * 1e3,
                       "phase_ms_per_step": {k: v / len(lat) * 1e3 for k, v in timers.items()}, "per_step": {}}
            else:
                row = run_cell(torch, dec, trace, inputs, args.warmup, budget, label, policy, options, distance,
                               eviction, hints)
            row.update(model=name, batch=batch, share=share)
            report["cells"].append(row)
            ph = row["phase_ms_per_step"]
            ps = row["per_step"]
            print(f"  {label:<26} p50 {row['p50_ms']:8.2f} ms | sync {ph.get('sync', 0):6.2f}"
                  f" acq {ph.get('acquire', 0):6.2f} comp {ph.get('compute', 0):6.2f} rel {ph.get('release', 0):6.2f}"
                  " | "
                  + " ".join(f"{k} {v:.1f}" for k, v in ps.items() if k != "bytes")
                  + (f" MB {ps['bytes'] / 1e6:.0f}" if "bytes" in ps else ""), flush=True)
        del dec
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
