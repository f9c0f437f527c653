"""Why the first measured generate of a process is slower (diagnostic, GPU only).

    python tools/warmup_probe.py [--model olmoe-1b-7b] [--tokens 64] [--repeats 4] [--warmup-tokens 8]
        [--json OUT.json]

BM6 and BM7 see the first resident generate of a block at 51-59 ms a token
and the next one at 17-25 (docs/results.md, runs 29-32). This runs the
resident model (bench/generate.py's shapes, random bf16 weights) in one
process: a warm-up generate of --warmup-tokens, then --repeats measured
generates of --tokens, each with its decode ms/token p50 and what changed
during it: the CUDA caching allocator's device allocations (segments made
with cudaMalloc) and frees, the GPU's SM clock (nvidia-smi's reading,
where it is available) and Python's garbage collections. Nothing here is a
target figure.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.generate_model import MODELS, StepTimer, build_model, generate, make_sync  # noqa: E402


def sm_clock_mhz():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10)
        return float(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="olmoe-1b-7b", choices=[m for m in MODELS if not m.startswith("smoke")])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs CUDA: not measured", file=sys.stderr)
        return 1
    family, shape = MODELS[args.model]
    model = build_model(torch, family, shape, 32000, "cuda", torch.bfloat16)
    sync = make_sync(torch, True, "stream")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 32000, (1, 32), generator=g).cuda()
    warm = torch.randint(1, 32000, (1, 32), generator=g).cuda()
    generate(torch, model, warm, args.warmup_tokens, sync)
    gcs = [0]
    gc.callbacks.append(lambda phase, info: gcs.__setitem__(0, gcs[0] + (phase == "start")))
    runs = []
    for r in range(args.repeats):
        before = torch.cuda.memory_stats()
        gc_before = gcs[0]
        clock_before = sm_clock_mhz()
        timer = StepTimer(sync)
        generate(torch, model, ids, args.tokens, sync, timer)
        after = torch.cuda.memory_stats()
        steps = [b - a for a, b in zip(timer.times, timer.times[1:])]
        run = {"run": r, "p50_ms": statistics.median(steps) * 1e3,
               "first_10_ms": [round(s * 1e3, 2) for s in steps[:10]],
               "last_10_ms": [round(s * 1e3, 2) for s in steps[-10:]],
               "device_allocs": after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0),
               "device_frees": after.get("num_device_free", 0) - before.get("num_device_free", 0),
               "alloc_retries": after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0),
               "gc_collections": gcs[0] - gc_before,
               "sm_clock_mhz_before": clock_before, "sm_clock_mhz_after": sm_clock_mhz()}
        runs.append(run)
        print(json.dumps(run), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "warmup_tokens": args.warmup_tokens,
                       "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
