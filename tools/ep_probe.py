"""Two questions behind expert parallel's per-layer cost, measured apart
from the model (run under torchrun, one process per GPU):

    torchrun --standalone --nproc-per-node 2 tools/ep_probe.py [--iters 200] [--json PATH]

1. The all-reduce's host cost per call, by entry point, on the tensors a
   decode layer all-reduces ([tokens x top_k, hidden] bf16): the public
   `torch.distributed.all_reduce`, the process group's own `allreduce`
   (the same NCCL call without the Python wrapper's checks) and the
   functional collective (`torch.ops._c10d_functional.all_reduce` +
   `wait_tensor`). Each is checked to give the right sum. Host us per call
   is the median over --iters calls, each after a small kernel so the
   stream is never idle; GPU us is the median of CUDA events around it.
2. Whether batched_mm's per-pair product (gather the pairs' weights, one
   bmm) gives a pair the same bits when only some pairs are computed: for
   every count P of 1..64 pairs and several random subsets, the rows of a
   bmm over the subset against the same rows of the bmm over all 64 (the
   shapes of OLMoE-1B-7B and Qwen3-30B-A3B experts, bf16). Also the GPU
   time of gather + bmm for 32 pairs against 64.

Rank 0 prints a table and writes --json. Needs CUDA and NCCL; exits 1
(nothing measured) otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import own_gpu  # noqa: E402


def allreduce_costs(torch, dist, iters: int, rows_list) -> list:
    group = dist.group.WORLD
    pg = dist.distributed_c10d._get_default_group()
    name = pg.group_name
    world = dist.get_world_size()
    rank = dist.get_rank()
    filler = torch.randn(256, 256, device="cuda")
    out = []
    for rows in rows_list:
        x = torch.full((rows, 2048), float(rank + 1), dtype=torch.bfloat16, device="cuda")

        def public(t):
            dist.all_reduce(t, group=group)
            return t

        def direct(t):
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            pg.allreduce([t], opts).wait()
            return t

        def functional(t):
            r = torch.ops._c10d_functional.all_reduce(t, "sum", name)
            return torch.ops._c10d_functional.wait_tensor(r)

        want = float(world * (world + 1) // 2)
        for label, fn in (("dist.all_reduce", public), ("ProcessGroup.allreduce", direct),
                          ("functional", functional)):
            host, gpu = [], []
            ok = True
            for i in range(iters + 10):
                t = x.clone()
                filler @ filler  # the stream is busy, as in a layer
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if i % 50 == 0:
                    dist.barrier(device_ids=[0])
                a.record()
                t0 = time.perf_counter_ns()
                r = fn(t)
                t1 = time.perf_counter_ns()
                b.record()
                if i >= 10:
                    host.append((t1 - t0) / 1e3)
                    b.synchronize()
                    gpu.append(a.elapsed_time(b) * 1e3)
                    if i == 10:
                        ok = bool((r.float() == want).all())
            out.append({"rows": rows, "entry": label, "sum_right": ok, "host_us_p50": statistics.median(host),
                        "gpu_us_p50": statistics.median(gpu)})
    return out


def subset_bits(torch, shapes, seed: int = 0) -> list:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for model, (gu, down) in shapes.items():
        for label, (o, i) in (("gate_up", gu), ("down", down)):
            slots = 16
            w = (torch.randn((slots, o, i), generator=g, device="cuda") / i ** 0.5).to(torch.bfloat16)
            expert = torch.randint(0, slots, (64,), generator=g, device="cuda")
            x = torch.randn((64, i), generator=g, device="cuda").to(torch.bfloat16)
            full = torch.bmm(w[expert], x.unsqueeze(-1)).squeeze(-1)
            bad = []
            for p in range(1, 65):
                for trial in range(3):
                    pick = torch.randperm(64, generator=g, device="cuda")[:p].sort().values if trial else \
                        torch.arange(p, device="cuda")
                    sub = torch.bmm(w[expert[pick]], x[pick].unsqueeze(-1)).squeeze(-1)
                    if not torch.equal(sub, full[pick]):
                        bad.append(p)
                        break
            times = {}
            for p in (32, 64):
                pick = torch.arange(p, device="cuda")
                ev = []
                for _ in range(30):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    torch.bmm(w[expert[pick]], x[pick].unsqueeze(-1))
                    b.record()
                    ev.append((a, b))
                torch.cuda.synchronize()
                times[p] = statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev[5:])
            out.append({"model": model, "weight": label, "shape": [o, i], "pair_counts_differing": bad,
                        "gather_bmm_us_32": times[32], "gather_bmm_us_64": times[64]})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    own_gpu()
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("ep_probe needs CUDA: not measured", file=sys.stderr)
        return 1
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    try:
        torch.set_grad_enabled(False)
        costs = allreduce_costs(torch, dist, args.iters, [8, 64])
        bits = subset_bits(torch, {"olmoe-1b-7b": ((2048, 2048), (2048, 1024)),
                                   "qwen3-30b-a3b": ((1536, 2048), (2048, 768))}) if dist.get_rank() == 0 else None
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, costs)
        if dist.get_rank() == 0:
            for r, rows in enumerate(gathered):
                for c in rows:
                    print(f"rank {r} rows {c['rows']:>3} {c['entry']:<24} host {c['host_us_p50']:7.1f} us  "
                          f"gpu {c['gpu_us_p50']:7.1f} us  sum right {c['sum_right']}")
            for b in bits:
                print(f"{b['model']:<14} {b['weight']:<8} pair counts whose rows differ: {b['pair_counts_differing']}"
                      f"  gather+bmm 32 pairs {b['gather_bmm_us_32']:.1f} us, 64 pairs {b['gather_bmm_us_64']:.1f} us")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"allreduce": gathered, "subset_bits": bits, "torch": torch.__version__}, f, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
