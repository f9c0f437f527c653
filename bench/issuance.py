"""BM2: cost of issuing a block of expert prefetches.

    python bench/issuance.py [--backend host|cuda|auto] [--experts 32]
        [--layers 24] [--warmup 20] [--iterations 200]
        [--window-us 1000 | --window-json F] [--json PATH]

Modes, each timing the issue of the same block (experts x layers ids; default
768 = 32 experts x 24 layers, the gpt-oss-20b saturated block):
  python-per-expert  ExpertPrefetcher's per-expert fallback: one engine call
                     per expert (the reference design's path)
  batched-cython     one PrefetchHandle.prefetch_tensors call over an int64
                     array (Python clock around the call)
  cpp-internal       the engine's own steady-clock timer of that same call
  torch-by-hand      for comparison, the plain-PyTorch way: a Python loop of
                     copy_(non_blocking=True) of pinned 4 KiB tensors on a
                     side stream (needs CUDA)
The copy workers are paused and the queue is emptied (untimed) before every
iteration, so each iteration enqueues the same ids into the same empty queue.

Output: per mode, the p50/p90/p99 issue time of the whole block in
microseconds and "x batched", its p50 over batched-cython's p50 (measured in
the same run, so steadier across runs and machines than the times).
A row of null is a mode that could not be measured here (torch-by-hand
without CUDA; every engine mode when the requested backend is unavailable,
which also makes the exit status 1). Null is never zero.

The last line applies BM2's decision rule at the route-ahead window W
(--window-us, default 1000 us): the time between learning which experts a
later layer will use and needing them, i.e. how long issuing may take before
it is exposed. "per-expert exposed" is True when the per-expert p50 >= W;
"batched justified" when the batched p50 < W while per-expert is exposed;
"crossover" is the range of W, [batched p50, per-expert p50) us, in which
the batched call is justified (None when batched is not faster).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if __package__ in (None, ""):
    # Run as a script: make `bench` importable, but after site-packages so an
    # installed (compiled) prefetch wins over the source folder.
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.lib.common import fmt, machine_info, write_json  # noqa: E402

MODES = ("python-per-expert", "batched-cython", "cpp-internal")
# Beside the modes: the plain-PyTorch way a user would write by hand (a Python
# loop of copy_(non_blocking=True) on a side stream). Needs CUDA; else null.
BY_HAND_MODE = "torch-by-hand"
DEFAULT_WINDOW_US = 1000.0  # reference route-ahead window
DEFAULT_EXPERTS = 32
DEFAULT_LAYERS = 24


def percentiles_us(samples_ns) -> dict | None:
    """p50/p90/p99 in microseconds of nanosecond samples (nearest-rank);
    None when there are no samples."""
    if samples_ns is None:
        return None
    values = sorted(float(v) for v in samples_ns)
    if not values:
        return None
    for v in values:
        if math.isnan(v) or v < 0:
            raise ValueError(f"samples must be non-negative nanoseconds, got {v}")

    def rank(q: float) -> float:
        index = max(0, math.ceil(q * len(values)) - 1)
        return values[index] / 1000.0

    return {"p50_us": rank(0.50), "p90_us": rank(0.90), "p99_us": rank(0.99), "samples": len(values)}


def bm2_decision(per_expert_p50_us, batched_p50_us, window_us: float = DEFAULT_WINDOW_US) -> dict:
    """Is per-expert issuance exposed at route-ahead window W, and is the
    batched call justified? Per-expert is exposed when its p50 >= W; batched
    is justified when its p50 < W while per-expert is exposed. The
    window-independent answer: batched is justified for every W in
    [batched_p50, per_expert_p50). Unknown inputs give null answers."""
    if window_us is None or not (window_us > 0):
        raise ValueError(f"window_us must be positive, got {window_us}")
    known = per_expert_p50_us is not None and batched_p50_us is not None
    crossover = None
    if known:
        crossover = (
            {"low_us": batched_p50_us, "high_us": per_expert_p50_us}
            if batched_p50_us < per_expert_p50_us
            else None
        )
    per_expert_exposed = None if per_expert_p50_us is None else per_expert_p50_us >= window_us
    batched_justified = None
    if known:
        batched_justified = batched_p50_us < window_us and per_expert_exposed
    return {
        "window_us": window_us,
        "per_expert_exposed": per_expert_exposed,
        "batched_justified": batched_justified,
        "crossover_window_us": crossover,
    }


def build_bm2_report(
    mode_samples_ns: dict,
    *,
    machine: dict,
    backend: str | None,
    block_size: int,
    warmup: int,
    iterations: int,
    window_us: float = DEFAULT_WINDOW_US,
) -> dict:
    """The BM2 JSON report. `mode_samples_ns` maps mode name to a list of
    nanosecond samples, or None for a mode that could not be measured."""
    modes = {}
    for mode in (*MODES, BY_HAND_MODE):
        modes[mode] = percentiles_us(mode_samples_ns.get(mode))
    for mode, samples in mode_samples_ns.items():
        if mode not in modes:
            modes[mode] = percentiles_us(samples)
    per = modes["python-per-expert"]
    bat = modes["batched-cython"]
    ratio = None
    if per is not None and bat is not None and bat["p50_us"] > 0:
        ratio = per["p50_us"] / bat["p50_us"]
    return {
        "benchmark": "BM2 issuance",
        "machine": machine,
        "backend": backend,
        "block_size": block_size,
        "warmup": warmup,
        "iterations": iterations,
        "modes": modes,
        "per_expert_over_batched_p50": ratio,
        "decision": bm2_decision(
            None if per is None else per["p50_us"], None if bat is None else bat["p50_us"], window_us
        ),
    }


def format_table(report: dict) -> str:
    base = report["modes"].get("batched-cython")
    lines = [
        f"BM2 issuance: {report['block_size']} ids, backend={report['backend']}, "
        f"warmup={report['warmup']}, iterations={report['iterations']}",
        f"{'mode':<20}{'p50 us':>10}{'p90 us':>10}{'p99 us':>10}{'x batched':>11}",
    ]
    for mode, row in report["modes"].items():
        if row is None:
            lines.append(f"{mode:<20}{'null':>10}{'null':>10}{'null':>10}{'null':>11}")
            continue
        ratio = None if base is None or base["p50_us"] <= 0 else row["p50_us"] / base["p50_us"]
        lines.append(
            f"{mode:<20}{fmt(row['p50_us']):>10}{fmt(row['p90_us']):>10}{fmt(row['p99_us']):>10}{fmt(ratio):>11}"
        )
    if any(row is None for row in report["modes"].values()):
        lines.append("null: not measured on this machine (torch-by-hand needs CUDA; the engine modes the "
                     "requested backend), never zero")
    d = report["decision"]
    crossover = d["crossover_window_us"]
    span = "None" if crossover is None else f"[{fmt(crossover['low_us'])}, {fmt(crossover['high_us'])}) us"
    lines.append(
        f"window W={d['window_us']:.0f} us: per-expert exposed={d['per_expert_exposed']}, "
        f"batched justified={d['batched_justified']}, crossover={span}"
    )
    lines.append("(W: route-ahead window; exposed: per-expert p50 >= W; justified: batched p50 < W while "
                 "per-expert is exposed; see --help)")
    return "\n".join(lines)


def read_window(path: str) -> float:
    """The positive 'window_us' of the JSON file at `path` (or a bare
    number); SystemExit naming the file and the problem otherwise."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise SystemExit(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8
        raise SystemExit(f"{path}: not valid JSON ({exc})") from exc
    value = data.get("window_us") if isinstance(data, dict) else data
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise SystemExit(f"{path}: expected a positive 'window_us', got {value!r}")
    return float(value)


def measure(backend: str, experts: int, layers: int, warmup: int, iterations: int) -> tuple[str, dict]:
    """Runs the three modes on one paused handle; returns (backend, samples)."""
    import numpy as np

    import prefetch

    n_ids = experts * layers
    handle = prefetch.PrefetchHandle(
        device_budget_bytes=max(1 << 20, n_ids * 256), backend=backend, start_paused=True
    )
    try:
        per_expert = prefetch.ExpertPrefetcher(handle, use_batched=False)
        payload = np.arange(256, dtype=np.uint8)
        for layer in range(layers):
            for expert in range(experts):
                tensor_id = layer * experts + expert
                handle.register(tensor_id, payload)
                per_expert.adopt(layer, expert, tensor_id)
        expert_list = list(range(experts))
        ids = np.concatenate([per_expert.tensor_ids(layer, expert_list) for layer in range(layers)])
        assert ids.shape[0] == n_ids and ids.dtype == np.int64

        samples = {mode: [] for mode in MODES}
        clock = time.perf_counter_ns
        for i in range(warmup + iterations):
            handle.cancel_all()
            t0 = clock()
            for layer in range(layers):
                per_expert.prefetch_experts_list(layer, expert_list)
            t1 = clock()
            if i >= warmup:
                samples["python-per-expert"].append(t1 - t0)
        queued = handle.stats()["queue_depth"]
        if queued != n_ids:
            raise RuntimeError(f"per-expert mode queued {queued} ids, expected {n_ids}")
        for i in range(warmup + iterations):
            handle.cancel_all()
            t0 = clock()
            handle.prefetch_tensors(ids)
            t1 = clock()
            internal = handle.last_batch_ns()
            if i >= warmup:
                samples["batched-cython"].append(t1 - t0)
                samples["cpp-internal"].append(internal)
        queued = handle.stats()["queue_depth"]
        if queued != n_ids:
            raise RuntimeError(f"batched mode queued {queued} ids, expected {n_ids}")
        return handle.backend, samples
    finally:
        handle.close()


def measure_torch_by_hand(n_ids: int, warmup: int, iterations: int, entry_bytes: int = 4096):
    """Issue time of n_ids copy_(non_blocking=True) calls from pinned host
    tensors into device tensors on a side stream, as a user would write it.
    Returns None without CUDA (the mode cannot run, so it is not measured)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = [torch.full((entry_bytes,), i % 251, dtype=torch.uint8).pin_memory() for i in range(n_ids)]
    dst = [torch.empty(entry_bytes, dtype=torch.uint8, device="cuda") for _ in range(n_ids)]
    stream = torch.cuda.Stream()
    samples = []
    clock = time.perf_counter_ns
    with torch.cuda.stream(stream):
        for i in range(warmup + iterations):
            stream.synchronize()
            t0 = clock()
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
            t1 = clock()
            if i >= warmup:
                samples.append(t1 - t0)
    stream.synchronize()
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="host", choices=["host", "cuda", "auto"],
                        help="engine backend (default host)")
    parser.add_argument("--experts", type=int, default=DEFAULT_EXPERTS, help="experts per layer (default 32)")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                        help="layers; ids = experts x layers (default 24)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed iterations per mode (default 20)")
    parser.add_argument("--iterations", type=int, default=200, help="timed iterations per mode (default 200)")
    window = parser.add_mutually_exclusive_group()
    window.add_argument("--window-us", type=float, default=DEFAULT_WINDOW_US,
                        help="route-ahead window W of the decision line (default 1000)")
    window.add_argument("--window-json", help="JSON file with a 'window_us' number (instead of --window-us)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.experts <= 0 or args.layers <= 0 or args.iterations <= 0 or args.warmup < 0:
        parser.error("experts, layers and iterations must be positive; warmup >= 0")
    try:
        window_us = read_window(args.window_json) if args.window_json else args.window_us
    except SystemExit as exc:
        parser.error(f"--window-json {exc}")
    if not window_us > 0:
        parser.error("--window-us must be positive")

    try:
        backend, samples = measure(args.backend, args.experts, args.layers, args.warmup, args.iterations)
    except RuntimeError as exc:  # e.g. --backend cuda without a GPU
        print(f"BM2: could not measure on backend {args.backend!r}: {exc}", file=sys.stderr)
        backend, samples = None, {mode: None for mode in MODES}
    samples[BY_HAND_MODE] = measure_torch_by_hand(args.experts * args.layers, args.warmup, args.iterations)
    report = build_bm2_report(
        samples,
        machine=machine_info(),
        backend=backend,
        block_size=args.experts * args.layers,
        warmup=args.warmup,
        iterations=args.iterations,
        window_us=window_us,
    )
    print(format_table(report))
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0 if backend is not None else 1


if __name__ == "__main__":
    sys.exit(main())
