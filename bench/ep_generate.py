"""BM7: expert parallel `generate`, one process per GPU under torchrun, against
one GPU in the same run.

    torchrun --standalone --nproc-per-node 2 bench/ep_generate.py [--models olmoe-1b-7b qwen3-30b-a3b]
        [--batches 1 8] [--shares 0.25 0.5] [--predictor gate|none] [--new-tokens 64] [--warmup-tokens 8]
        [--prompt-tokens 32] [--vocab 32000] [--no-single] [--placement balanced|activations]
        [--timeout-s 1800] [--json PATH]
    torchrun --standalone --nproc-per-node 2 bench/ep_generate.py --smoke-cpu [--json PATH]

Each rank sees only its own GPU (CUDA_VISIBLE_DEVICES is set from
LOCAL_RANK before torch starts: the engine's cache is on the process's CUDA
device 0) and builds the same model (bench/generate.py's shapes and random
bf16 weights, same seed). Per model:

  1. rank 0 alone (the others wait at a barrier): the resident model's
     greedy tokens for each batch (the reference every row is compared to)
     and its ms/token; then, unless --no-single, the single-process
     offload (`offload_moe_experts`, no group) at each share of ALL the
     experts' bytes: the "1-gpu" rows.
  2. every rank: `offload_moe_experts(..., process_group=WORLD)` at each share
     of ITS slice's bytes (experts / ranks per layer, in contiguous blocks,
     or with --placement activations assigned by activation counts recorded
     on other prompts: `calibration_counts`), the same predictor: the "ep"
     rows. The total device cache equals the 1-gpu row's at the same share.

Before any row every rank runs the resident model over the measured lengths
on other prompts (Note [Warm every sequence length] in
bench/lib/generate_model.py). Each row: a warm-up generate on another prompt,
then the measured generate
of --new-tokens tokens (min = max, no eos). Figures (rank 0's clock, read
after --timer-sync's wait: device, the default, torch.cuda.synchronize;
stream, the compute stream only): p50_ms / p90_ms of decode
ms/token (the prefill step excluded), tokens_equal / first_mismatch against
the resident tokens, x_1gpu = ep p50 / 1-gpu p50; per rank: hit_rate
(decode), bytes copied, experts registered, all-reduce us per layer.

Rounding: the batched_mm and grouped_mm implementations all-reduce per
(token, k) expert outputs, so the ranks' result is bit-equal to one process
for any top-k (Note [Expert parallel]; the CPU test checks top-4 in bf16);
first_mismatch says where tokens differ if they ever do.

--profile DIR: after each offloaded row's measured generate, every rank
runs --profile-tokens more under torch.profiler and writes its ops table
and Chrome trace to DIR; the row gets, per rank and token, the GPU's busy
time (union of its kernels and copies), and device time in NCCL kernels
(which includes waiting for the other rank), in host-to-device copies and
in other kernels: where a rank's step goes that the host clock cannot split.

--smoke-cpu: gloo, tiny Qwen3-MoE and OLMoE configs in float32 on the CPU,
host backend: checks the logic, measures nothing.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from datetime import timedelta

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.lib.common import fmt, gpu_time_split, machine_info, own_gpu, percentile, write_json  # noqa: E402

if "--smoke-cpu" not in sys.argv:
    own_gpu()  # before anything imports torch
from bench.lib.generate_model import (  # noqa: E402
    MODELS,
    SMOKE_MODELS,
    ModelState,
    StepTimer,
    build_model,
    generate,
    make_sync,
    warm_lengths,
)

SMOKE = ("smoke-qwen3-moe", "smoke-olmoe")


def first_mismatch(a, b):
    """The first generated position where any sequence of the batch differs
    (None: equal)."""
    if a.shape != b.shape:
        return 0
    differ = (a != b).any(dim=0).nonzero()
    return int(differ[0]) if differ.numel() else None


def run_row(torch, model, state, prompts, args, sync, timer_sync, budget, group, backend_kw, host=None,
            placement=None):
    """Offloads, warms up, runs the measured generate, restores the model.
    Returns (figures of this rank, generated ids, the HostExperts to reuse)."""
    import prefetch
    from prefetch.integration import NextLayerGatePredictor

    predictor = NextLayerGatePredictor() if args.predictor == "gate" else None
    ctl = prefetch.offload_moe_experts(model, device_budget_bytes=budget, predictor=predictor, process_group=group,
                                       host_experts=host, progress=False, sync_free=_SYNC_FREE[args.sync_free],
                                       **(placement or {}), **backend_kw)
    marks = {}
    try:
        generate(torch, model, prompts["warm"], args.warmup_tokens, sync)
        ctl.new_sequence()

        def first():
            ctl.flush()  # the prefill's (and warm-up's) sync-free routings count before the mark
            marks["stats"] = ctl.handle.stats()
            marks.update({key: getattr(ctl, key) for key in _COUNTERS})

        timer = StepTimer(timer_sync, on_first=first)
        ids, _, _ = generate(torch, model, prompts["measured"], args.new_tokens, sync, timer)
        ctl.flush()
        end = ctl.handle.stats()
        delta = {key: getattr(ctl, key) - marks[key] for key in _COUNTERS}
        layers = delta["layers_run"]
        host = ctl.host_experts
        figures = {
            "registered": end["registered"],
            "hit_rate": _hit_rate(marks["stats"], end, delta),
            "bytes_copied": end["bytes_copied"] - marks["stats"]["bytes_copied"],
            # What the engine did with the measured tokens' misses and guesses.
            "engine_counts": {key: end[key] - marks["stats"][key] for key in _ENGINE_COUNTS},
            "prediction_precision": (delta["prediction_hits"] / delta["predicted_total"]
                                     if delta["predicted_total"] else None),
            "speculation_paused_layers": delta["speculation_paused_layers"],
            "zero_copy_reads": delta["zero_copy_reads"],
            "allreduce_us_per_layer": (delta["comm_ns"] / layers / 1e3 if group is not None and layers else None),
        }
        # Where a decode layer's host time goes (OffloadController's counters):
        # engine calls (acquire waits for copies), the routing read-back
        # (waits for the GPU), the rest of our host work.
        for key in ("engine_ns", "sync_ns", "host_ns"):
            figures[key.replace("_ns", "_us_per_layer")] = delta[key] / layers / 1e3 if layers else None
        if args.profile:
            tag = f"{'ep' if group is not None else '1gpu'}_b{prompts['measured'].shape[0]}_s{budget}"
            figures["profile"] = profile_decode(torch, model, prompts["measured"], args.profile_tokens, sync,
                                                os.path.join(args.profile, f"{tag}_rank{_rank(group)}"))
    finally:
        ctl.close()
        state.restore()
        gc.collect()
    figures.update(_decode_ms(timer.times))
    return figures, ids, host


def _rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank() if group is not None else 0


def profile_decode(torch, model, ids, tokens: int, sync, path: str) -> dict:
    """A generate of `tokens` more tokens under torch.profiler, after the
    measured one (the profiler's own cost stays out of the figures). Writes
    `path`.txt (ops by device time) and `path`.json (the Chrome trace).
    Returns, per generated token: wall ms, the GPU's busy ms (union of its
    kernels and copies), the link's busy ms (union of the host-to-device
    copies), device ms in NCCL kernels (their time includes waiting for the
    other ranks), in host-to-device copies, and in every other kernel
    (summed per event), and the link's idle ms by what the GPU did
    meanwhile: an NCCL kernel, another kernel or copy, nothing."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, t0, t1 = generate(torch, model, ids, tokens, sync)
    split = gpu_time_split(torch, prof)
    with open(path + ".txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))
    prof.export_chrome_trace(path + ".json")
    per = 1e3 * tokens
    return {"tokens": tokens, "wall_ms_per_token": (t1 - t0) * 1e3 / tokens,
            "gpu_busy_ms_per_token": split["busy_us"] / per, "h2d_busy_ms_per_token": split["h2d_us"] / per,
            **{f"{k}_ms_per_token": split[f"{k}_event_us"] / per for k in ("nccl", "h2d", "other")},
            **{f"link_idle_{k}_ms_per_token": split[f"link_idle_{k}_us"] / per
               for k in ("nccl", "compute", "gpu_idle")}}


def pin_cpus() -> list:
    """Restricts this process to its local rank's share of the CPUs it may
    run on (contiguous blocks of equal size, in CPU order), so the ranks of
    one host do not share cores; returns that CPU list."""
    cpus = sorted(os.sched_getaffinity(0))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if len(cpus) < ranks:
        raise SystemExit(f"--pin-cpus: {len(cpus)} CPUs for {ranks} ranks on this host")
    mine = cpus[local * len(cpus) // ranks:(local + 1) * len(cpus) // ranks]
    os.sched_setaffinity(0, mine)
    return mine


# --sync-free: offload_moe_experts' sync_free argument.
_SYNC_FREE = {"auto": None, "on": True, "off": False}

# OffloadController counters read before and after the measured generate.
_COUNTERS = ("layers_run", "comm_ns", "engine_ns", "sync_ns", "host_ns", "pinned_hits", "zero_copy_reads",
             "prediction_hits", "predicted_total", "speculation_paused_layers")
# Engine stats counted over the measured tokens: guesses queued (enqueued),
# dropped before their copy (cancelled), refused room (declined), copied
# but evicted unread (wasted), and misses copied by the acquirer (on_demand).
_ENGINE_COUNTS = ("enqueued", "cancelled", "declined", "wasted", "late", "on_demand", "copies")


def _hit_rate(a, b, delta):
    """Engine acquires (synced layers) and sync-free reads together: a read
    from the cache is a hit, one from host memory a miss."""
    hits = b["hits"] - a["hits"] + delta["pinned_hits"]
    misses = b["misses"] - a["misses"] + delta["zero_copy_reads"]
    return hits / (hits + misses) if hits + misses else None


def calibration_counts(torch, dist, model, prompts, tokens: int, sync, cuda: bool):
    """--placement activations: how often each layer routed to each expert
    over greedy generates of `tokens` tokens from `prompts` (other prompts
    than the measured ones) on the resident model, counted on the device by
    a hook on every experts module's routing (top_k_index). Rank 0's counts
    are sent to every rank, so all place the experts alike. Returns an int64
    numpy [layers, experts]."""
    from prefetch.hf import find_hf_moe_blocks

    blocks = find_hf_moe_blocks(model)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    counts = torch.zeros((len(blocks), blocks[0][1].gate_up_proj.shape[0]), dtype=torch.int64, device=device)

    def hook(layer):
        def count(module, args, kwargs):
            index = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
            counts[layer] += torch.bincount(index.reshape(-1), minlength=counts.shape[1]).to(counts.device)
        return count

    handles = [experts.register_forward_pre_hook(hook(i), with_kwargs=True) for i, (_, experts, _) in
               enumerate(blocks)]
    try:
        for ids in prompts:
            generate(torch, model, ids, tokens, sync)
    finally:
        for h in handles:
            h.remove()
    dist.broadcast(counts, src=0)
    return counts.cpu().numpy()


def _decode_ms(times):
    decode = [(y - x) * 1e3 for x, y in zip(times, times[1:])]
    return {"p50_ms": statistics.median(decode) if decode else None,
            "p90_ms": percentile(decode, 0.9) if decode else None, "decode_tokens": len(decode)}


def run_model(torch, dist, name, args, cuda, device, dtype, rank, world, rows):
    from prefetch.expert_parallel import partition_experts

    family, shape = (SMOKE_MODELS if args.smoke_cpu else MODELS)[name]
    model = build_model(torch, family, shape, args.vocab, device, dtype)
    state = ModelState(model)
    sync = make_sync(torch, cuda)
    timer_sync = make_sync(torch, cuda, args.timer_sync)
    backend_kw = {} if cuda else {"backend": "host"}
    mine = int((partition_experts(state.num_layers, state.num_experts, world) == rank).sum())
    slice_bytes = mine * state.expert_bytes

    def prompts(batch):
        def one(seed):
            g = torch.Generator().manual_seed(seed)
            return torch.randint(1, args.vocab, (batch, args.prompt_tokens), generator=g).to(device)
        return {"measured": one(100 + batch), "warm": one(200 + batch), "calib": one(300 + batch)}

    base = {"model": name, "layers": state.num_layers, "experts": state.num_experts}
    placement = None
    if args.placement == "activations":
        counts = calibration_counts(torch, dist, model, [prompts(batch)["calib"] for batch in args.batches],
                                    args.new_tokens, sync, cuda)
        placement = {"expert_placement": "activations", "activation_counts": counts}
    reference, single = {}, {}
    # Every rank, the model still resident (Note [Warm every sequence length]):
    # rank 1 runs no resident or 1-gpu row, and would otherwise meet each
    # sequence length first inside its measured expert-parallel generate.
    warm_lengths(torch, model, [prompts(batch)["warm"] for batch in args.batches], args.new_tokens, sync)
    if rank == 0:
        host = None
        for batch in args.batches:
            p = prompts(batch)
            generate(torch, model, p["warm"], args.warmup_tokens, sync)
            timer = StepTimer(timer_sync)
            reference[batch], _, _ = generate(torch, model, p["measured"], args.new_tokens, sync, timer)
            rows.append({**base, "batch": batch, "share": None, "mode": "resident", "ranks": 1,
                         **_decode_ms(timer.times)})
            if args.no_single:
                continue
            for share in args.shares:
                budget = state.cache_bytes(share)
                figures, ids, host = run_row(torch, model, state, p, args, sync, timer_sync, budget, None, backend_kw,
                                             host)
                single[(batch, share)] = figures["p50_ms"]
                rows.append({**base, "batch": batch, "share": share, "mode": "1-gpu", "ranks": 1,
                             "budget_bytes_per_rank": budget, "tokens_equal": bool(torch.equal(ids, reference[batch])),
                             "first_mismatch": first_mismatch(ids, reference[batch]), **figures})
        del host
        gc.collect()
    dist.barrier(**({"device_ids": [0]} if cuda else {}))
    host = None
    for batch in args.batches:
        p = prompts(batch)
        for share in args.shares:
            budget = int(share * slice_bytes)
            figures, ids, host = run_row(torch, model, state, p, args, sync, timer_sync, budget, dist.group.WORLD,
                                         backend_kw, host, placement)
            gathered = [None] * world
            dist.all_gather_object(gathered, {"figures": figures, "ids": ids.cpu()})
            if rank != 0:
                continue
            per_rank = [g["figures"] for g in gathered]
            row = {**base, "batch": batch, "share": share, "mode": "ep", "ranks": world,
                   "budget_bytes_per_rank": budget, "p50_ms": figures["p50_ms"], "p90_ms": figures["p90_ms"],
                   "decode_tokens": figures["decode_tokens"],
                   "tokens_equal": bool(torch.equal(ids.cpu(), reference[batch].cpu())),
                   "first_mismatch": first_mismatch(ids.cpu(), reference[batch].cpu()),
                   "ranks_agree": all(torch.equal(g["ids"], gathered[0]["ids"]) for g in gathered),
                   "x_1gpu": (figures["p50_ms"] / single[(batch, share)]
                              if single.get((batch, share)) and figures["p50_ms"] else None)}
            for key in ("hit_rate", "bytes_copied", "registered", "allreduce_us_per_layer", "zero_copy_reads",
                        "engine_counts", "prediction_precision", "speculation_paused_layers",
                        "engine_us_per_layer", "sync_us_per_layer", "host_us_per_layer", "profile"):
                row[f"{key}_per_rank"] = [f.get(key) for f in per_rank]
            rows.append(row)
    del host, model, state
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def format_table(rows) -> str:
    lines = [f"{'model':<18} {'batch':>5} {'share':>5} {'mode':<8} {'p50 ms':>8} {'p90 ms':>8} {'x 1gpu':>6} "
             f"{'equal':>5} hit rate per rank"]
    for r in rows:
        hits = r.get("hit_rate_per_rank") or ([r["hit_rate"]] if "hit_rate" in r else [])
        lines.append(f"{r['model']:<18} {r['batch']:>5} {fmt(r['share']) if r['share'] else '-':>5} {r['mode']:<8} "
                     f"{fmt(r['p50_ms']):>8} {fmt(r['p90_ms']):>8} {fmt(r.get('x_1gpu')):>6} "
                     f"{str(r.get('tokens_equal', '-')):>5} {' '.join(fmt(h) for h in hits)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"of {list(MODELS)} (smoke: {list(SMOKE)})")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--predictor", choices=["gate", "none"], default="gate")
    parser.add_argument("--new-tokens", type=int, default=None, help="measured tokens per row (default 64)")
    parser.add_argument("--warmup-tokens", type=int, default=None, help="tokens of the warm-up generate (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 32)")
    parser.add_argument("--vocab", type=int, default=None, help="vocab size (default 32000)")
    parser.add_argument("--no-single", action="store_true", help="skip the 1-gpu offload rows (resident still runs)")
    parser.add_argument("--timeout-s", type=float, default=1800,
                        help="process group timeout: the other ranks wait this long while rank 0 runs alone")
    parser.add_argument("--json")
    parser.add_argument("--profile", metavar="DIR",
                        help="after each row's measured generate, profile --profile-tokens more on every rank "
                             "(torch.profiler: ops table and Chrome trace per rank in DIR; GPU busy, NCCL and "
                             "copy time per token in the row)")
    parser.add_argument("--profile-tokens", type=int, default=8)
    parser.add_argument("--sync-free", choices=list(_SYNC_FREE), default="auto",
                        help="offload_moe_experts(sync_free=None|True|False) for the 1-gpu and ep rows")
    parser.add_argument("--timer-sync", choices=["device", "stream"], default="device",
                        help="what the per-token clock waits for: every stream of the GPU (the engine's copies "
                             "too) or the compute stream only (what a caller reading tokens waits for)")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="each rank runs on its own contiguous share of this host's CPUs (default: the OS "
                             "places the processes)")
    parser.add_argument("--placement", choices=["balanced", "activations"], default="balanced",
                        help="the ep rows' expert_placement: contiguous blocks, or the same block sizes balanced "
                             "by activation counts recorded on other prompts (resident greedy generates of "
                             "--new-tokens, one per batch, before any row)")
    parser.add_argument("--smoke-cpu", action="store_true", help="gloo, tiny configs in float32 on the CPU")
    args = parser.parse_args(argv)
    smoke = args.smoke_cpu
    for key, full, tiny in (("models", list(MODELS), list(SMOKE)), ("new_tokens", 64, 4), ("warmup_tokens", 8, 2),
                            ("prompt_tokens", 32, 8), ("vocab", 32000, 128)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if smoke else full)
    table = SMOKE_MODELS if smoke else MODELS
    unknown = [m for m in args.models if m not in table]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(table) if not smoke else list(SMOKE)}")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (the decode figure excludes the prefill)")
    if not all(0 < s <= 1 for s in args.shares):
        parser.error("--shares must be in (0, 1]")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error("run under torchrun, e.g. torchrun --standalone --nproc-per-node 2 bench/ep_generate.py")

    cpus = pin_cpus() if args.pin_cpus else sorted(os.sched_getaffinity(0))

    import torch
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    cuda = not smoke and torch.cuda.is_available()
    if not smoke and not cuda:
        print("BM7 needs a CUDA device per rank (or --smoke-cpu): not measured", file=sys.stderr)
        return 1
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout_s),
                            **({"device_id": torch.device("cuda", 0)} if cuda else {}))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if smoke:
            torch.set_num_threads(1)
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        torch.set_grad_enabled(False)
        started = time.monotonic()
        rows = []
        for name in args.models:
            run_model(torch, dist, name, args, cuda, device, dtype, rank, world, rows)
        cpus_per_rank = [None] * world
        dist.all_gather_object(cpus_per_rank, cpus)
        if rank == 0:
            report = {"benchmark": "BM7 expert-parallel generate", "machine": machine_info(), "smoke_cpu": smoke,
                      "world_size": world, "backend": dist.get_backend(), "cpus_per_rank": cpus_per_rank,
                      "config": {k: getattr(args, k) for k in ("models", "batches", "shares", "predictor",
                                                                "new_tokens", "warmup_tokens", "prompt_tokens",
                                                                "vocab", "no_single", "sync_free", "timer_sync",
                                                                "pin_cpus", "placement")},
                      "transformers": transformers.__version__,
                      "notes": ["random weights; vocab reduced to --vocab",
                                "ep budget per rank = share x the rank's slice; 1-gpu budget = share x all experts",
                                "p50/p90 on rank 0's clock; tokens compared to rank 0's resident run"],
                      "rows": rows, "wall_s": time.monotonic() - started}
            print(format_table(rows))
            if args.json:
                write_json(args.json, report)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Out without the interpreter's teardown: in about 1 CPU smoke run of 10
    # (on this session's tree and the one before), a rank aborted after
    # main had returned ("terminate called without an active exception",
    # no Python frame left: a std::thread destroyed unjoined in the static
    # teardown of a library's objects, after destroy_process_group). The
    # report is written and the process group torn down by now; flush and go.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
