"""Host cost of the ways a decode layer can gather its routed experts'
weights out of a slot tensor (diagnostic; CUDA, or --smoke-cpu).

    python3 tools/gather_cost_probe.py [--model gemma4-26b-a4b] [--slots 960]
        [--iterations 400] [--rounds 3] [--json OUT.json]

BM5's engine rows spend 40-50 us a layer more than its resident row in
the acquire phase on the H200 host (runs 135, 162), and part of that is
the gather: the resident row makes three index_select (its pool table,
then each weight), an engine row turns the acquire's rows into slot
numbers in C and makes two torch.cat of per-slot views (SlotRows in
bench/e2e_providers.py). This times each way alone, host microseconds
from the first call to the last call's return (the kernels queued, not
run: the layer's host path is what the step waits on at batch 1), with
the GPU drained between iterations so that no call waits for a full
launch queue:

  index3      the resident row: table.index_select(0, routed), then one
              index_select per weight of the [slots, ...] views
  cat2        an engine row as BM5 has it (EngineProvider.gather):
              slot_numbers on the acquire's rows, .tolist(), SlotRows'
              torch.cat per weight of per-slot views
  cat1        one torch.cat of per-slot [1, slot_bytes] rows of the whole
              slot, then each weight as a strided view of the result
  index2      slot numbers written into a page-locked buffer, copied to
              the device (non_blocking), one index_select per weight

Medians over --iterations, per round; rows run in turn each round. Top-k,
hidden and expert widths are the --model's (bench/e2e_decoder.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WAYS = ("index3", "cat2", "cat1", "index2")


def build(torch, spec: dict, slots: int, device):
    """A slot tensor of `slots` experts ([slots, slot_elems] bf16) and its
    two weights' [slots, ...] strided views, as BM5 lays out an expert."""
    H, inter = spec["hidden"], spec["inter"]
    gate_up_elems, down_elems = 2 * inter * H, H * inter
    slot_elems = -(-(gate_up_elems + down_elems) // 128) * 128  # 256-byte aligned slots
    flat = torch.randn(slots, slot_elems, device=device).to(torch.bfloat16)
    gate_up = flat.as_strided((slots, 2 * inter, H), (slot_elems, H, 1))
    down = flat.as_strided((slots, H, inter), (slot_elems, inter, 1), gate_up_elems)
    return flat, gate_up, down, gate_up_elems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma4-26b-a4b")
    parser.add_argument("--slots", type=int, default=960, help="slots in the tensor (gemma-4 at 25 %%: 960)")
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke-cpu", action="store_true", help="tiny shapes on the CPU (CI)")
    args = parser.parse_args(argv)
    import numpy as np
    import torch
    from prefetch._engine import slot_numbers

    from bench.e2e_decoder import MODELS
    from bench.e2e_providers import SlotRows

    if args.model not in MODELS:
        parser.error(f"--model must be one of {sorted(MODELS)}")
    if args.iterations < 1 or args.rounds < 1 or args.slots < MODELS[args.model]["experts"]:
        parser.error("need --iterations >= 1, --rounds >= 1 and --slots >= the model's experts per layer")
    spec = dict(MODELS[args.model])
    if args.smoke_cpu:
        spec.update(hidden=64, inter=32)
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --smoke-cpu)")
    else:
        device = torch.device("cuda")
    k, experts = spec["top_k"], spec["experts"]
    flat, gate_up, down, gate_up_elems = build(torch, spec, args.slots, device)
    slot_bytes = flat.shape[1] * flat.element_size()
    slot_rows = SlotRows(torch, {"gate_up": gate_up, "down": down})  # BM5's engine rows' gather
    rows_flat = [flat[s : s + 1] for s in range(args.slots)]
    table = torch.randperm(args.slots, device=device)[:experts]  # expert -> slot, as the resident pool table
    pinned = torch.empty(k, dtype=torch.int64, pin_memory=device.type == "cuda")
    rng = np.random.default_rng(0)
    picks = [np.sort(rng.choice(experts, k, replace=False)) for _ in range(64)]
    routed_dev = [torch.from_numpy(p).to(device) for p in picks]
    table_host = table.cpu().numpy()
    where = [np.stack([table_host[p] * slot_bytes, np.zeros(k, dtype=np.int64)], axis=1) for p in picks]
    buf = np.empty(experts, dtype=np.int64)
    host_slots = [table_host[p].tolist() for p in picks]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    H, inter = spec["hidden"], spec["inter"]

    def index3(i):
        s = table.index_select(0, routed_dev[i])
        return gate_up.index_select(0, s), down.index_select(0, s)

    def cat2(i):
        n = slot_numbers(where[i], slot_bytes, buf)
        return slot_rows.gather(buf[:n].tolist())

    def cat1(i):
        out = torch.cat([rows_flat[s] for s in host_slots[i]])
        n, width = out.shape
        return (out.as_strided((n, 2 * inter, H), (width, H, 1)),
                out.as_strided((n, H, inter), (width, inter, 1), gate_up_elems))

    def index2(i):
        pinned.numpy()[:] = host_slots[i]
        s = pinned.to(device, non_blocking=True)
        return gate_up.index_select(0, s), down.index_select(0, s)

    ways = {"index3": index3, "cat2": cat2, "cat1": cat1, "index2": index2}
    # Every way gathers the same weights.
    ref = index3(0)
    for name, way in ways.items():
        got = way(0)
        if not all(torch.equal(a, b) for a, b in zip(ref, got)):
            raise SystemExit(f"{name} gathered other weights than index3")
    rounds = []
    for r in range(args.rounds):
        got = {}
        for name in WAYS:
            way = ways[name]
            times = []
            for it in range(args.iterations):
                sync()
                t0 = time.perf_counter()
                way(it % len(picks))
                times.append(time.perf_counter() - t0)
            sync()
            got[name] = statistics.median(times) * 1e6
        rounds.append(got)
        print(f"round {r}: " + "  ".join(f"{n} {got[n]:6.2f} us" for n in WAYS), flush=True)
    summary = {n: statistics.median(r[n] for r in rounds) for n in WAYS}
    print("median: " + "  ".join(f"{n} {summary[n]:6.2f} us" for n in WAYS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "gather_cost_probe", "model": args.model, "device": str(device), "top_k": k,
                       "slots": args.slots, "iterations": args.iterations, "rounds": rounds,
                       "median_us": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
