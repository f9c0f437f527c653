"""BM5: end-to-end decode of an offloaded MoE decoder at real expert shapes.

    python bench/e2e.py [--models olmoe-1b-7b qwen3-30b-a3b] [--batches 1 8]
        [--shares 0.1 0.25 0.5] [--warmup 3] [--steps 10] [--budget-s 420]
        [--trace-out DIR] [--trace-in FILE] [--json PATH] [--plots DIR]
        [--devices N] [--eviction cyclic|lru] [--expert-compute grouped|loop]

The decoder: per layer RMSNorm, a dense HxH projection standing in for
attention, RMSNorm, a router (softmax, top-k, renormalised), SwiGLU experts
(real bf16 matmuls: gate|up [2I, H], down [H, I]; each routed expert runs on
the whole batch with its dense routing weight, so a layer has one host sync,
for the expert list), residual adds. --expert-compute grouped (default)
runs the layer's routed experts in two batched matmuls, their weights
gathered by every provider from its slot tensor (the resident pool,
the engine's arena, the by-hand LRU's slots) with one kernel per weight,
so no provider pays a tensor op per expert (bench/lib/e2e_providers.py);
"loop" runs one expert at a time as transformers' eager MoE does, which on a
slow host CPU makes the step Python launch time rather than GPU time. Weights are
random bf16 (never zeros); expert (layer, e) uses the bytes of one of
--pool distinct random experts, registered zero-copy from page-locked host
memory, so copies move real bytes over PCIe into distinct cache slots.
Routing comes from the model itself (inputs are fixed per step, so every
policy sees the same routing), or from --trace-in (a routing trace, see
docs/trace_format.md), which then overrides the router's choice.

Policies, one run each per round (fresh cache, same inputs; --repeats
rounds, each running every policy in turn after an all-resident run of its
own):
  all-resident     every expert on the GPU: the compute-only step
  on-demand        engine, no prediction: misses are fetched at band 0
  next-layer-gate  engine + router of layer L+1 applied to layer L's input
  trace            engine + activation-matrix predictor trained on --train
                   other requests first
  oracle           engine + replay of the routing this request really takes,
                   --oracle-distance layers ahead (default 4: at 2 the
                   real traces' copies were late, docs/results.md stop
                   38), with next-use hints and eviction_policy="next-use"
                   (Belady's rule: the ceiling)
  oracle-cyclic    the same prefetches, no hints, --eviction's policy
  torch-by-hand    Python copy_(non_blocking=True) per missing expert on a
                   side stream into an LRU of device slots kept in Python
                   (one slot tensor per device, gathered like the others)
  on-demand-disk   on-demand with the experts left on disk: the pool is
                   written to one file in --disk-dir and every expert is
                   read from it (O_DIRECT) through the engine's host tier of
                   half of all the expert bytes (Note [Host tier]): the
                   "host budget below the expert bytes" cell of #15
An engine policy may carry PrefetchHandle options, integers after a
colon: "oracle:copy_poll_us=0" or "on-demand:copy_lanes=1,copy_chunk_bytes=
8388608" is a row of its own, so settings compare in one process;
"oracle:distance=4" sets that row's lookahead (over --oracle-distance).
Reported per run: step latency p50/p90, stall (p50 - compute-only p50), hit
rate, bytes moved, achieved GB/s, prediction precision/recall, and the IO
floor: Belady-minimum bytes for this routing and cache size over raw H2D
bandwidth measured in the same run (before and after each model's runs, the
faster of the two). Runs past --budget-s are reported null, and so is a
share that holds less than one expert a device. With
--repeats: p50_ms and p90_ms are the medians of the rounds' (p50_runs_ms,
p90_runs_ms; all-resident's are those of the faster of its first run and
the one after the policies, the compute-only step), and
x_adjacent the median of each round's p50 over its all-resident p50
(resident_runs_ms): the host's speed drifts over a block; x_adjacent_best
the fastest round's p50 over the fastest all-resident round's (Note [Best
of the repeats] in bench/lib/common.py); x_floor_adjacent (printed as "x rnd
fl") the median of each round's p50 over max(that round's all-resident
p50, the IO floor), x_floor_runs those ratios (Note [A round's own
floor]). Each row also has
host_us_per_layer (the first round's host time per decode layer by phase of
the step: speculate, sync, acquire, compute launch, release, and the engine
calls' share of them; an engine row's acquire also in its parts,
acquire.route_l0, acquire.route and acquire.gather: Note [The acquire's
parts] in bench/lib/e2e_providers.py), late (acquires that found their copy under way),
speculation_paused_layers (Note [Speculation by its precision]) and the
engine's counts of where the copies and guesses went (ENGINE_COUNTS).
The engine policies use --eviction (default "cyclic", Note [Cyclic eviction]
in src_cpp/eviction_policy.h). --devices N splits the layers into N contiguous
runs, one per GPU, with the cache budget split by layers; the IO floor is then
the slowest device's (each device's Belady loads over its own raw bandwidth).
--profile DIR: after each policy's first measured run, a fresh provider (an
empty cache, as the measured run started) runs the warm-up steps unprofiled
and then --profile-steps steps of the measured inputs under
torch.profiler (Chrome traces and op tables in DIR); the row's "profile" has
per step the wall time, the GPU's busy, compute, host-to-device and
copy-only time and its idle time (wall - busy), and the decoder's host
phases (speculate, sync, acquire, compute launch, release): where a step's
time goes that the host clock alone cannot split.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.lib.common import (  # noqa: E402
    ENGINE_COUNTS,
    best_of_ratio,
    fmt,
    machine_info,
    percentile,
    raw_h2d_gbps,
    round_floor_ratio,
    write_json,
)
from bench.lib.e2e_decoder import MODELS, POLICIES, Decoder, measure_steps, profile_steps  # noqa: E402
from bench.lib.e2e_floor import io_floor, settle_compute_only, settle_raw  # noqa: E402
from bench.lib.e2e_providers import (  # noqa: E402
    make_provider,
    policy_eviction,
    split_policy,
)
from bench.lib.e2e_report import format_table, plot_latency, timeline  # noqa: E402

# ENGINE_COUNTS (bench/lib/common.py): over the measured steps, null for the
# rows without the engine.


def run_policy(torch, dec, policy, inputs, warmup, budget, trace=None, train_inputs=(), forced=None,
               eviction="cyclic", profile=None, disk_dir=None, oracle_distance=4):
    """Decodes `inputs` (one tensor per step) under `policy`. Returns the
    measured step latencies (after `warmup` steps), the provider's counters
    over the measured steps, and the routing trace (all-resident only).
    `forced`: a routing trace's steps, replayed instead of the router.
    `profile`: (path, steps): that many more steps under torch.profiler
    (profile_steps), their figures in the counters' "profile"."""

    def route(i):
        return forced[i % len(forced)] if forced else None

    def fresh():
        made = make_provider(dec, policy, budget, trace, eviction, disk_dir=disk_dir, oracle_distance=oracle_distance)
        if split_policy(policy)[0] == "trace":  # learn from other requests first
            for request in train_inputs:
                for i, x in enumerate(request):
                    dec.step(x, made, route(i))
                made.ctl.new_sequence()
        return made

    provider = fresh()
    try:
        def score_from_here():  # predictions are scored on measured steps only
            if hasattr(provider, "ctl"):
                provider.ctl.prediction_hits = provider.ctl.predicted_total = provider.ctl.actual_total = 0

        timers = {}
        lat, before, after = measure_steps(dec, provider, inputs, warmup, route, timers=timers,
                                           at_warmup_end=score_from_here)
        delta = {key: after[key] - before.get(key, 0)
                 for key in ("hits", "misses", "bytes", "disk_read_bytes", "late", "engine_ns",
                             "speculation_paused_layers", "step_pins", *ENGINE_COUNTS)
                 if after.get(key) is not None}
        # Host time per decode layer of the measured steps, by phase of
        # Decoder.step (wall clock of the one Python thread; "engine" is the
        # part of speculate, acquire and release spent in the engine's calls).
        per_layer = 1e6 / max(1, len(lat) * dec.spec["layers"])
        delta["host_us_per_layer"] = {k: v * per_layer for k, v in sorted(timers.items())}
        if "engine_ns" in delta:
            delta["host_us_per_layer"]["engine"] = delta.pop("engine_ns") * per_layer / 1e9
        delta["precision"] = after.get("precision")
        delta["recall"] = after.get("recall")
        out_trace = getattr(provider, "trace", None)
        if profile is not None:
            # A fresh provider, so the profiled steps start from the state
            # the measured ones did (an empty cache after the warm-up
            # steps): replaying the measured steps on the same provider
            # found every expert cached (run 83: no copy in the profile of
            # an IO-bound row).
            if hasattr(provider, "close"):
                provider.close()
            provider = fresh()
            delta["profile"] = profile_steps(dec, provider, inputs, warmup, profile[1], route, profile[0])
        return lat, delta, out_trace
    finally:
        if hasattr(provider, "close"):
            provider.close()


def profile_of(args, name, batch, policy, share=None):
    """run_policy's `profile` for a run (None without --profile)."""
    if not args.profile:
        return None
    tag = f"{name}_b{batch}" + ("" if share is None else f"_{share:g}") + "_" + policy.replace(":", "_").replace(
        "=", "-").replace(",", "_")
    return os.path.join(args.profile, tag), args.profile_steps


def record_round(row, lat, delta, compute_p50, floor_s, res_round, io_floor_s):
    """One round's run of a policy (latencies in s, counters) into its row:
    p50_ms and p90_ms are the medians of the rounds' (p50_runs_ms,
    p90_runs_ms), x_adjacent the median of each round's p50 over that
    round's all-resident p50, x_adjacent_best the fastest round's over the
    fastest resident round's, x_floor_runs each round's p50 over that
    round's floor, max(its all-resident p50, `io_floor_s`), and
    x_floor_adjacent their median (Note [A round's own floor]); hit rate,
    bytes and prediction scores are the first round's (every round replays
    the same steps from a fresh cache)."""
    p50 = statistics.median(lat)
    row["p50_runs_ms"].append(p50 * 1e3)
    row.setdefault("p90_runs_ms", []).append(percentile(lat, 0.9) * 1e3)
    row["resident_runs_ms"].append(statistics.median(res_round) * 1e3)
    row["p50_ms"] = statistics.median(row["p50_runs_ms"])
    row["p90_ms"] = statistics.median(row["p90_runs_ms"])
    row["x_adjacent"] = statistics.median(a / b for a, b in zip(row["p50_runs_ms"], row["resident_runs_ms"]))
    # Note [A round's own floor]
    # #11's target for the oracle on the real traces is a ratio to the
    # floor, max(all-resident, IO floor). The H200 host's speed drifts
    # within a run (the gpt-oss resident step ran 19.3-48.7 ms across runs
    # 143-146), so the run's floor (the faster compute-only run against the
    # IO floor: over_floor) flatters or punishes a round by the host's
    # spell, and x_adjacent leaves the IO floor out, so a round whose host
    # was fast reads as far above a floor the link never lets it reach.
    # Each round is compared with the floor of its own moment instead: its
    # resident run or the IO floor, whichever is higher (docs/results.md,
    # stop 43's second session, where this was first done by hand).
    row.setdefault("x_floor_runs", []).append(round_floor_ratio(p50 * 1e3, row["resident_runs_ms"][-1],
                                                                io_floor_s * 1e3))
    row["x_floor_adjacent"] = statistics.median(row["x_floor_runs"])
    row["x_adjacent_best"] = best_of_ratio(row["p50_runs_ms"], row["resident_runs_ms"])
    row["stall_ms"] = row["p50_ms"] - compute_p50 * 1e3
    row["over_floor"] = row["p50_ms"] / floor_s / 1e3
    if len(row["p50_runs_ms"]) > 1:
        return
    total_s = sum(lat)
    acquired = (delta.get("hits") or 0) + (delta.get("misses") or 0)
    row.update({
        "hit_rate": delta["hits"] / acquired if acquired else None,
        "bytes_moved": delta.get("bytes"),
        "achieved_gbps": (delta.get("bytes") or 0) / total_s / 1e9 if total_s else None,
        "precision": delta.get("precision"),
        "recall": delta.get("recall"),
        "disk_read_bytes": delta.get("disk_read_bytes"),
        "late": delta.get("late"),
        "step_pins": delta.get("step_pins"),  # steps taken by the oracle's step plan (Note [Host-routed step pins])
        "speculation_paused_layers": delta.get("speculation_paused_layers"),
        "host_us_per_layer": delta.get("host_us_per_layer"),
        **{key: delta.get(key) for key in ENGINE_COUNTS},
    })
    if "profile" in delta:
        row["profile"] = delta["profile"]


def policy_arg(text: str) -> str:
    """--policies: a policy, with handle options or not (split_policy)."""
    try:
        split_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), type=policy_arg, metavar="POLICY",
                        help=f"of {', '.join(POLICIES)}; an engine policy may carry PrefetchHandle options, "
                             "as oracle:copy_poll_us=0 (a row of its own), and step_plan=0 or resident_gather=1 "
                             "(bench/lib/e2e_providers.py's split_policy)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--train", type=int, default=3, help="past requests the trace predictor learns from")
    parser.add_argument("--pool", type=int, default=48, help="distinct random experts behind all (layer, expert)")
    parser.add_argument("--budget-s", type=float, default=420, help="stop starting runs after this many seconds")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds: each runs every policy once in turn, after an all-resident run of its own")
    parser.add_argument("--trace-in", help="routing trace to replay (overrides the router)")
    parser.add_argument("--trace-from", type=int, default=0,
                        help="first step of --trace-in to replay (1 skips a recorded prompt step)")
    parser.add_argument("--trace-out", help="folder to write each model/batch routing trace to")
    parser.add_argument("--json")
    parser.add_argument("--plots", help="folder for latency_vs_share.png and timeline.png")
    parser.add_argument("--devices", type=int, default=1,
                        help="split the layers over this many GPUs (one cache, queue and stream each)")
    parser.add_argument("--eviction", default="cyclic", choices=["cyclic", "lru"],
                        help="engine eviction policy of the engine policies but oracle (always next-use)")
    parser.add_argument("--oracle-distance", type=int, default=4,
                        help="layers ahead the oracle and oracle-cyclic policies guess (default 4)")
    parser.add_argument("--expert-compute", default="grouped", choices=["grouped", "loop"],
                        help="routed experts in two batched matmuls, or one expert at a time")
    parser.add_argument("--profile", metavar="DIR",
                        help="after each policy's first measured run, --profile-steps more steps under "
                             "torch.profiler: traces in DIR, per-step GPU and host split in the row's 'profile'")
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(),
                        help="where on-demand-disk writes the expert pool's file (removed after each model)")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="tiny shapes on the CPU with the host backend: checks the logic, measures nothing")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.profile_steps < 1:
        parser.error("--profile-steps must be >= 1")
    if args.oracle_distance < 1:
        parser.error("--oracle-distance must be >= 1")
    if args.steps < 1 or args.warmup < 0 or args.pool < 1 or args.train < 0:
        parser.error("need --steps >= 1, --warmup >= 0, --pool >= 1 and --train >= 0")
    if not 1 <= args.devices <= 16:
        parser.error("--devices must be in 1..16")
    if any(b < 1 for b in args.batches):
        parser.error("--batches must be >= 1 each")
    if any(not 0 < s <= 1 for s in args.shares):
        parser.error("--shares must be in (0, 1] each (a share of all the experts' bytes)")
    if not args.smoke_cpu:
        # Below the layer count a guess's target comes later in this step or
        # earlier in the next one, and the controller files (scores, hints)
        # it under that step: a lookahead of a whole step or more would put
        # it under the wrong one.
        for policy in args.policies:  # each already parsed by policy_arg
            base, options = split_policy(policy)
            if base not in ("oracle", "oracle-cyclic"):
                continue
            distance = options.get("distance", args.oracle_distance)
            for name in args.models:
                if distance >= MODELS[name]["layers"]:
                    parser.error(f"{policy}: an oracle distance of {distance} is not below {name}'s "
                                 f"{MODELS[name]['layers']} layers (--oracle-distance)")

    import torch

    if args.smoke_cpu:
        return smoke_cpu(torch, args)
    from prefetch.integration import RoutingTrace, belady_misses

    forced_trace = None
    if args.trace_in:  # an untrusted file: read and checked before anything runs
        try:
            forced_trace = RoutingTrace.load(args.trace_in)
        except (OSError, ValueError) as exc:
            parser.error(f"--trace-in: {exc}")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < args.devices:
        print(f"BM5 needs {args.devices} CUDA device(s), found {found}: not measured", file=sys.stderr)
        report = {"benchmark": "BM5 e2e", "machine": machine_info(), "devices": args.devices, "rows": None}
        if args.json:
            write_json(args.json, report)
        return 1
    if forced_trace is not None:
        for name in args.models:
            spec = MODELS[name]
            if (forced_trace.num_layers, forced_trace.num_experts) != (spec["layers"], spec["experts"]):
                parser.error(f"--trace-in has {forced_trace.num_layers} layers x {forced_trace.num_experts} experts; "
                             f"{name} has {spec['layers']} x {spec['experts']} (pick the model it was recorded on)")
        if not 0 <= args.trace_from < len(forced_trace.steps):
            parser.error(f"--trace-from must be in 0..{len(forced_trace.steps) - 1}")
        forced_trace.steps = forced_trace.steps[args.trace_from:]
    started = time.monotonic()
    rows = []
    timeline_summary = None
    for name in args.models:
        spec = dict(MODELS[name], name=name)
        dec = Decoder(torch, spec, args.pool, devices=args.devices, grouped=args.expert_compute == "grouped")
        raw_each = [raw_h2d_gbps(torch, dec.expert_bytes, d) for d in range(args.devices)]
        raw = sum(raw_each)
        total = spec["layers"] * spec["experts"] * dec.slot_bytes
        print(f"{name}: expert {dec.expert_bytes / 2**20:.2f} MiB, all experts {total / 2**30:.1f} GiB, "
              f"raw H2D {', '.join(f'{r:.1f}' for r in raw_each)} GB/s, {args.devices} device(s)",
              file=sys.stderr, flush=True)
        for batch in args.batches:
            n = args.warmup + args.steps
            inputs = dec.inputs(n, batch, seed=batch)
            train = [dec.inputs(n, batch, seed=100 + r) for r in range(args.train)]
            forced = forced_trace.steps if forced_trace else None
            lat_res, res_delta, trace = run_policy(torch, dec, "all-resident", inputs, args.warmup, 0, forced=forced,
                                                   profile=profile_of(args, name, batch, "all-resident"))
            compute_p50 = statistics.median(lat_res)
            if args.trace_out:
                os.makedirs(args.trace_out, exist_ok=True)
                RoutingTrace(spec["layers"], spec["experts"], trace).save(
                    os.path.join(args.trace_out, f"trace_{name}_b{batch}.json"))
            used = [len(set(e)) for step in trace[args.warmup:] for e in step]
            batch_rows = []
            for share in args.shares:
                budget = int(share * total) // dec.slot_bytes * dec.slot_bytes
                if min(dec.device_budgets(budget)) < dec.slot_bytes:
                    # Not one expert a device: no policy can run, and Belady's floor has no cache.
                    print(f"  {name} b{batch} {share:.0%}: under one expert a device: not measured", file=sys.stderr)
                    rows.extend({"model": name, "batch": batch, "cache_share": share, "policy": policy,
                                 "devices": args.devices, "budget_gib": budget / 2**30, "p50_ms": None,
                                 "p90_ms": None, "io_floor_ms": None, "floor_ms": None,
                                 "belady_bytes_per_step_each": None,
                                 "note": "not measured: the share holds less than one expert a device"}
                                for policy in args.policies)
                    continue
                # IO floor: per device, Belady's fewest loads for its layers
                # and its cache over its raw bandwidth; the devices' links
                # run in parallel, so the slowest one bounds the step.
                belady_bytes = []  # per device, per step
                for d, dev_budget in enumerate(dec.device_budgets(budget)):
                    layers = dec.layers_of(d)
                    rt = RoutingTrace(len(layers), spec["experts"], [[step[la] for la in layers] for step in trace])
                    misses = belady_misses(rt, dev_budget // dec.slot_bytes, start_step=args.warmup)
                    belady_bytes.append(misses * dec.expert_bytes / args.steps)
                io_floor_s = io_floor(belady_bytes, raw_each)
                floor_s = max(compute_p50, io_floor_s)
                cells = []
                for policy in args.policies:
                    row = {"model": name, "batch": batch, "cache_share": share, "policy": policy,
                           "devices": args.devices, "eviction": policy_eviction(policy, args.eviction),
                           "budget_gib": budget / 2**30, "compute_only_ms": compute_p50 * 1e3,
                           "io_floor_ms": io_floor_s * 1e3, "floor_ms": floor_s * 1e3,
                           "raw_h2d_gbps": raw, "raw_h2d_gbps_each": raw_each,
                           "belady_bytes_per_step_each": belady_bytes,
                           "experts_per_layer_mean": statistics.mean(used),
                           "p50_ms": None, "p90_ms": None, "p50_runs_ms": [], "resident_runs_ms": []}
                    batch_rows.append(row)
                    rows.append(row)
                    cells.append(row)
                # --repeats rounds, each running every policy once in turn
                # after an all-resident run of its own (the first round's is
                # lat_res): the host's speed drifts over a block, so a row is
                # also compared with the resident run of its round.
                for rnd in range(args.repeats):
                    res_round = lat_res
                    if rnd and time.monotonic() - started > args.budget_s:
                        for row in cells:
                            row.setdefault("note", f"time budget spent after {rnd} of {args.repeats} rounds")
                        break
                    if rnd:
                        res_round = run_policy(torch, dec, "all-resident", inputs, args.warmup, 0, forced=forced)[0]
                    for row in cells:
                        policy = row["policy"]
                        if time.monotonic() - started > args.budget_s:
                            row.setdefault("note", "not measured: time budget spent" if rnd == 0 else
                                           f"time budget spent after {rnd} of {args.repeats} rounds")
                            continue
                        if policy == "all-resident":
                            lat, delta = res_round, {"hits": None, "misses": None, "bytes": 0}
                            if rnd == 0:
                                delta["host_us_per_layer"] = res_delta.get("host_us_per_layer")
                                if "profile" in res_delta:
                                    delta["profile"] = res_delta["profile"]
                        else:
                            lat, delta, _ = run_policy(torch, dec, policy, inputs, args.warmup, budget, trace, train,
                                                       forced=forced, eviction=args.eviction, disk_dir=args.disk_dir,
                                                       oracle_distance=args.oracle_distance,
                                                       profile=(profile_of(args, name, batch, policy, share)
                                                                if rnd == 0 else None))
                        record_round(row, lat, delta, compute_p50, floor_s, res_round, io_floor_s)
                        print(f"  {name} b{batch} {share:.0%} {policy:<16} p50 {row['p50_runs_ms'][-1]:8.2f} ms "
                              f"(floor {floor_s * 1e3:7.2f}) hit {fmt(row['hit_rate'])}", file=sys.stderr, flush=True)
            # Compute-only once more, after the policies: the floor is the
            # faster of the two runs (a transient slowdown of the host is not
            # compute); both are kept in the rows.
            lat_res2, _, _ = run_policy(torch, dec, "all-resident", inputs, args.warmup, 0, forced=forced)
            settle_compute_only(batch_rows, lat_res, lat_res2)
            if args.plots and timeline_summary is None and batch == args.batches[0]:
                os.makedirs(args.plots, exist_ok=True)
                budget = int(0.25 * total) // dec.slot_bytes * dec.slot_bytes
                try:
                    timeline_summary = timeline(torch, dec, inputs, budget, os.path.join(args.plots, "timeline.png"),
                                                os.path.join(args.plots, "timeline.json"), args.eviction)
                except Exception as exc:  # noqa: BLE001 - the plot is optional; say why it is missing
                    timeline_summary = {"error": repr(exc)}
                    print(f"timeline not made: {exc!r}", file=sys.stderr)
        # Raw bandwidth once more, after the model's runs: the floor uses the
        # faster measurement of each device (a stricter floor; a slow host
        # moment is not the link). Both are kept in the rows.
        raw_again = [raw_h2d_gbps(torch, dec.expert_bytes, d) for d in range(args.devices)]
        settle_raw([r for r in rows if r["model"] == name], raw_each, raw_again)
        dec.remove_pool_file()
        del dec
        torch.cuda.empty_cache()
    report = {"benchmark": "BM5 e2e", "machine": machine_info(), "warmup": args.warmup, "steps": args.steps,
              "pool": args.pool, "devices": args.devices, "eviction": args.eviction,
              "oracle_distance": args.oracle_distance, "expert_compute": args.expert_compute, "rows": rows,
              "timeline": timeline_summary}
    print(format_table(rows))
    if args.plots:
        plot_latency(rows, os.path.join(args.plots, "latency_vs_share.png"))
    if args.json:
        write_json(args.json, report)
    return 0


class PerExpertViews:
    """A provider seen without its acquire_stacked: the decoder then stacks
    the per-expert views of acquire (the path of a provider that has no
    stacked acquire). The smoke checks both paths compute the same."""

    def __init__(self, provider):
        self.provider = provider

    def acquire(self, layer, x, experts):
        return self.provider.acquire(layer, x, experts)

    def release(self, layer, experts):
        self.provider.release(layer, experts)


def smoke_cpu(torch, args) -> int:
    """Every policy on tiny shapes on the CPU (host backend): the outputs of
    every policy must equal all-resident's, bit for bit. With grouped
    experts, a resident, an engine and a by-hand provider also run through
    their per-expert acquire (stacked by the decoder), which must give the
    same bits as their stacked acquire. No figures."""
    spec = dict(layers=3, experts=8, top_k=2, hidden=16, inter=8, name="smoke")
    dec = Decoder(torch, spec, pool=5, device="cpu", devices=args.devices, grouped=args.expert_compute == "grouped")
    inputs = dec.inputs(4, 2, seed=0)
    outs = {}
    trace = None
    runs = [(policy, False) for policy in POLICIES] + [("oracle:copy_poll_us=0,copy_lanes=1,distance=1", False)]
    if dec.grouped:
        runs += [(policy, True) for policy in ("all-resident", "on-demand", "torch-by-hand")]
    for policy, per_expert in runs:
        budget = 6 * dec.slot_bytes * args.devices  # every device holds a whole layer's experts
        # Lookahead 2 (below the smoke model's 3 layers, as main requires).
        provider = make_provider(dec, policy, budget, trace, args.eviction, disk_dir=args.disk_dir,
                                 oracle_distance=2)
        stepped = PerExpertViews(provider) if per_expert else provider
        try:
            if policy == "trace":
                for x in dec.inputs(4, 2, seed=1):
                    dec.step(x, stepped)
                provider.ctl.new_sequence()
            outs[policy + (" (per-expert views)" if per_expert else "")] = [dec.step(x, stepped) for x in inputs]
            if policy == "all-resident" and not per_expert:
                trace = provider.trace
        finally:
            if hasattr(provider, "close"):
                provider.close()
    dec.remove_pool_file()
    for policy, out in outs.items():
        for a, b in zip(out, outs["all-resident"]):
            if not torch.equal(a, b):
                print(f"smoke: {policy} differs from all-resident", file=sys.stderr)
                return 1
    print(f"smoke ok ({args.devices} device(s), {args.expert_compute}): " + ", ".join(outs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
