"""Why the same generate runs at two speeds on the GPU machine's host
(diagnostic; CUDA only).

    python tools/host_noise_probe.py [--model olmoe-1b-7b] [--tokens 48] [--rounds 6]
        [--share 0.25] [--json OUT.json]

BM6's resident rows on the H200 host came out near 20 ms or near 27-32 ms a
token, switching between generates seconds apart (run 74), which swamps
the 1.10x and 1.15x targets. This probe builds BM6's model (resident, and
offloaded on-demand at --share through offload_moe_experts), then runs
rounds of generates under each host setting, in turn, so every setting
sees the same drift:

  free      as BM6 runs: any CPU, Python's garbage collector on
  pin       the serving (main) thread held to one CPU, chosen with no busy
            hyperthread sibling; the engine's threads (made before) keep
            theirs
  gc-off    the collector off during the generate (gc.freeze first)
  pin+gc-off

Prints and keeps, per setting and row, every generate's p50 ms/token and
the per-token times; plus the CPU topology and load. Nothing here is a
target figure.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.generate_model import MODELS, SMOKE_MODELS, StepTimer, build_model, generate, make_sync, warm_lengths  # noqa: E402


def topology() -> dict:
    cpus = {}
    for path in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list")):
        cpu = int(path.split("/")[5][3:])
        with open(path) as f:
            cpus[cpu] = f.read().strip()
    out = {"siblings": cpus, "affinity": sorted(os.sched_getaffinity(0)), "loadavg": os.getloadavg()}
    for key, path in (("governor", "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),):
        try:
            with open(path) as f:
                out[key] = f.read().strip()
        except OSError:
            out[key] = None
    return out


def pick_cpu(siblings: dict, allowed: list) -> int:
    """A CPU this process may run on, away from 0 (interrupts), alone on
    its core where the machine says so."""
    alone = [c for c in allowed if siblings.get(c) == str(c) and c != 0]
    if alone:
        return alone[len(alone) // 2]
    return allowed[len(allowed) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="olmoe-1b-7b", choices=list(MODELS))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke-cpu", action="store_true", help="a tiny model on the CPU (host backend): "
                        "checks the probe runs, measures nothing of the GPU machine")
    args = parser.parse_args(argv)

    import torch

    smoke = args.smoke_cpu
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: not measured", file=sys.stderr)
        return 2
    import prefetch

    device = "cpu" if smoke else "cuda"
    options = {"backend": "host"} if smoke else {}

    topo = topology()
    print(json.dumps(topo), flush=True)
    family, shape = (SMOKE_MODELS["smoke-olmoe"] if smoke else MODELS[args.model])
    vocab = 256 if smoke else 32000
    model = build_model(torch, family, shape, vocab, device, torch.float32 if smoke else torch.bfloat16)
    sync = make_sync(torch, not smoke)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, vocab, (1, 32), generator=g).to(device)
    warm = torch.randint(1, vocab, (1, 32), generator=g).to(device)
    warm_lengths(torch, model, [warm], args.tokens, sync)
    ref_tokens = generate(torch, model, ids, args.tokens, sync)[0]

    from bench.generate_modes import shared_host_experts

    everything = topo["affinity"]  # what the process may use, as it started
    cpu = pick_cpu(topo["siblings"], everything)

    def run():
        timer = StepTimer(sync)
        tokens = generate(torch, model, ids, args.tokens, sync, timer)[0]
        steps = [(b - a) * 1e3 for a, b in zip(timer.times, timer.times[1:])]
        return {"p50": statistics.median(steps), "steps": steps, "equal": bool(torch.equal(tokens, ref_tokens))}

    settings = ("free", "pin", "gc-off", "pin+gc-off")
    results = {s: {"resident": [], "on-demand": []} for s in settings}
    ctl = None
    t_start = time.perf_counter()
    try:
        state_impl = model.config._experts_implementation
        from bench.generate_model import ModelState

        state = ModelState(model)
        budget = int(state.total_bytes * args.share)
        host = shared_host_experts(model, not smoke)
        for r in range(args.rounds):
            for s in settings:
                for row in ("resident", "on-demand"):
                    if row == "on-demand":
                        ctl = prefetch.offload_moe_experts(model, device_budget_bytes=budget, host_experts=host,
                                                            **options)
                        generate(torch, model, warm, args.tokens, sync)  # its warm-up
                    os.sched_setaffinity(0, {cpu} if "pin" in s else everything)
                    if "gc-off" in s:
                        gc.collect()
                        gc.freeze()
                        gc.disable()
                    try:
                        out = run()
                    finally:
                        gc.enable()
                        gc.unfreeze()
                        os.sched_setaffinity(0, everything)
                    if ctl is not None:
                        out["hit_rate"] = ctl.report()["hit_rate"]
                        ctl.close()
                        ctl = None
                        state.restore()
                        model.config._experts_implementation = state_impl
                    results[s][row].append(out)
                    print(f"round {r} {s:10s} {row:9s} p50 {out['p50']:6.2f} ms  equal {out['equal']}", flush=True)
    finally:
        if ctl is not None:
            ctl.close()
    summary = {}
    for s in settings:
        res = [o["p50"] for o in results[s]["resident"]]
        off = [o["p50"] for o in results[s]["on-demand"]]
        ratios = [b / a for a, b in zip(res, off)]
        summary[s] = {"resident_p50s": res, "on_demand_p50s": off,
                      "resident_spread": max(res) / min(res), "ratio_median": statistics.median(ratios),
                      "ratios": ratios}
        print(f"{s:10s} resident {min(res):6.2f}-{max(res):6.2f} (x{max(res) / min(res):.2f})  on-demand "
              f"{min(off):6.2f}-{max(off):6.2f}  ratio median {statistics.median(ratios):.3f} "
              f"({' '.join(f'{x:.2f}' for x in ratios)})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"topology": topo, "pinned_cpu": cpu, "args": vars(args), "summary": summary,
                       "results": results, "wall_s": time.perf_counter() - t_start}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
