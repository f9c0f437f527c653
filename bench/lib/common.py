"""Helpers shared by the bench scripts (importable, no side effects)."""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
from collections import OrderedDict


def machine_info() -> dict:
    info = {
        "node": platform.node(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "cpu_model": None,
        "gpu": None,
        "torch": None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def write_json(path: str, report: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"  # replaced in one step: a run killed mid-write leaves the last whole file
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def fmt(value, digits: int = 2) -> str:
    return "null" if value is None else f"{value:.{digits}f}"


def raw_copy_gbps(torch, src, dst, streams, reps: int) -> list:
    """Raw host-to-device bandwidth the plain-PyTorch way: copy_(non_blocking=
    True) of each row of pinned `src` into the same row of `dst`, rows taking
    `streams` in turn, timed with CUDA events from the first stream. One GB/s
    figure per rep, after one warm-up rep that is dropped."""
    total = src.numel() * src.element_size()
    first = streams[0]
    out = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dst.device)
        start.record(first)
        for s in streams[1:]:
            s.wait_event(start)
        for i in range(src.shape[0]):
            with torch.cuda.stream(streams[i % len(streams)]):
                dst[i].copy_(src[i], non_blocking=True)
        for s in streams[1:]:
            first.wait_stream(s)
        end.record(first)
        end.synchronize()
        out.append(total / (start.elapsed_time(end) / 1e3) / 1e9)
    return out[1:]


class LruSlots:
    """The bookkeeping of the by-hand PyTorch LRU that BM5 and BM6 compare
    against: (layer, expert) -> one of `count` device slots; a miss takes a
    free slot, else the least recently used one that this call does not
    hold already (`busy`, from `held`)."""

    def __init__(self, count: int):
        self.lru = OrderedDict()  # (layer, expert) -> slot, least recent first
        self.free = list(range(count))[::-1]
        self.hits = self.misses = 0

    def held(self, keys) -> set:
        """The slots of those `keys` that are cached (a call's own experts)."""
        return {self.lru[k] for k in keys if k in self.lru}

    def slot_for(self, key, busy: set) -> tuple[int, bool]:
        """(slot, hit). On a miss the slot is claimed for `key` and joins
        `busy`; the caller copies the expert into it."""
        slot = self.lru.get(key)
        if slot is not None:
            self.hits += 1
            self.lru.move_to_end(key)
            return slot, True
        self.misses += 1
        if self.free:
            slot = self.free.pop()
        else:
            victim = next(k for k, s in self.lru.items() if s not in busy)
            slot = self.lru.pop(victim)
        self.lru[key] = slot
        busy.add(slot)
        return slot, False


def host_steal_s():
    """Seconds of CPU time the hypervisor gave to others (the steal column of
    /proc/stat's cpu line, all CPUs), cumulative; None where not readable
    (not Linux, or no such column)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else None
    except (OSError, ValueError, IndexError):
        return None


# The engine's counts of where copies and guesses went, as BM5 and BM6
# report them: copied on demand, guesses upgraded to band 0 by their layer's
# acquire, declined by admission control, cancelled before their copy,
# copies evicted unused (wasted), and the copy worker's waits for the
# speculative cap that ended with the link drained (spec_underruns: Note [A
# cap that follows the worker's wake-ups] in src_cpp/copy_worker.cpp).
ENGINE_COUNTS = ("on_demand", "upgraded", "declined", "cancelled", "wasted", "spec_underruns")


def round_floor_ratio(p50_ms: float, resident_ms: float, io_floor_ms: float) -> float:
    """A round's p50 over the floor of its own moment: max(the resident run
    beside it, the IO floor) (Note [A round's own floor] in bench/e2e.py)."""
    return p50_ms / max(resident_ms, io_floor_ms)


def best_of_ratio(runs, resident_runs) -> float:
    """Note [Best of the repeats]
    The GPU machine's host runs the same generate at a few distinct speeds
    and switches between them every few seconds, whatever runs:
    tools/host_noise_probe.py (run 78, OLMoE-1B-7B shapes, batch 1, 48
    tokens) saw the resident model's per-generate p50 at 19-21, 25, 30 and
    39 ms a token, each level held for tens of tokens; holding the serving
    thread to one CPU or turning the garbage collector off did not remove
    it. A slow spell only ever adds time, and it lands on a row or on its
    adjacent resident generates by chance, so the median of two or three
    generates still moved a row's ratio by 0.2-0.4 between cells that
    should match (run 74).
    The fastest of the row's --repeats generates over the fastest of as
    many resident generates right after it is the ratio of their costs on
    an undisturbed host (each side's p50 of one generate: its misses and
    copies count). Both sides take the best of the same number of
    generates. Reported as x_adjacent_best next to x_adjacent (medians),
    not instead of it. Run 80 found spells as long as a row's three
    generates, so the best of three does not cancel them either: Note
    [Paired generates] in bench/lib/generate_twin.py pairs each generate with a
    resident one a second apart."""
    return min(runs) / min(resident_runs)


def percentile(values, q):
    """Nearest-rank percentile `q` (0..1) of `values`."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def merge_spans(spans) -> list:
    """The union of (start, end) spans as disjoint [start, end] spans, in
    order (spans that touch are joined)."""
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _union_us(spans) -> float:
    """Microseconds covered by the union of (start, end) spans."""
    return float(sum(b - a for a, b in merge_spans(spans)))


def own_gpu() -> None:
    """Under torchrun, make this process see only GPU LOCAL_RANK (of those
    already visible), before torch initialises CUDA: the engine's cache is
    on the process's CUDA device 0."""
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v for v in visible.split(",") if v.strip()]
        if int(local) >= len(ids):
            raise SystemExit(f"LOCAL_RANK {local} but CUDA_VISIBLE_DEVICES={visible} lists {len(ids)} GPUs")
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[int(local)]
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = local


def gpu_time_split(torch, prof) -> dict:
    """Where the GPU's time went under a finished torch.profiler `prof` (us):
    busy (the union of every kernel and copy), compute (the union of the
    kernels that are not copies), h2d (the union of host-to-device copies),
    copy_only (busy - compute: only copies running), summed per event,
    device time in NCCL kernels (which includes waiting for other ranks), in
    host-to-device copies and in every other kernel, and the link's idle
    time by what ran meanwhile (_link_idle_us)."""
    spans, compute, h2d, nccl = [], [], [], []
    by_kind = {"nccl": 0.0, "h2d": 0.0, "other": 0.0}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.time_range.elapsed_us() <= 0:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        spans.append(span)
        name = ev.name.lower().replace(" ", "")
        kind = "nccl" if "nccl" in name else "h2d" if "htod" in name else "other"
        by_kind[kind] += ev.time_range.elapsed_us()
        if kind == "h2d":
            h2d.append(span)
        elif kind == "nccl":
            nccl.append(span)
            compute.append(span)
        elif "memcpy" not in name and "memset" not in name:
            compute.append(span)
    busy, compute_us = _union_us(spans), _union_us(compute)
    return {"busy_us": busy, "compute_us": compute_us, "h2d_us": _union_us(h2d), "copy_only_us": busy - compute_us,
            **{f"{k}_event_us": v for k, v in by_kind.items()}, **_link_idle_us(spans, h2d, nccl)}


def _link_idle_us(spans, h2d, nccl) -> dict:
    """When no host-to-device copy runs, between the first device event's
    start and the last one's end (us): the window, and the link's idle time
    split by what the GPU did meanwhile: an NCCL kernel (expert parallel's
    all-reduce, or its wait for another rank), another kernel or copy, or
    nothing at all."""
    if not spans:
        return {"window_us": 0.0, "link_idle_nccl_us": 0.0, "link_idle_compute_us": 0.0,
                "link_idle_gpu_idle_us": 0.0}
    points = []
    for kind, group in (("h2d", h2d), ("nccl", nccl), ("any", spans)):
        for a, b in group:
            points += [(a, 1, kind), (b, -1, kind)]
    points.sort(key=lambda p: (p[0], p[1]))
    active = {"h2d": 0, "nccl": 0, "any": 0}
    idle = {"nccl": 0.0, "compute": 0.0, "gpu_idle": 0.0}
    last = points[0][0]
    for t, delta, kind in points:
        if t > last and not active["h2d"]:
            idle["nccl" if active["nccl"] else "compute" if active["any"] else "gpu_idle"] += t - last
        active[kind] += delta
        last = t
    window = max(b for _, b in spans) - min(a for a, _ in spans)
    return {"window_us": window, **{f"link_idle_{k}_us": v for k, v in idle.items()}}


def raw_h2d_gbps(torch, nbytes_each: int, device=0, count: int = 64) -> float:
    """Median raw host-to-device GB/s of `count` page-locked copies of
    `nbytes_each` bytes onto `device` (raw_copy_gbps, 3 repetitions)."""
    src = torch.empty((count, nbytes_each), dtype=torch.uint8, pin_memory=True).fill_(7)
    with torch.cuda.device(device):
        dst = torch.empty((count, nbytes_each), dtype=torch.uint8, device=device)
        gbps = statistics.median(raw_copy_gbps(torch, src, dst, [torch.cuda.Stream(device=device)], reps=3))
    del src, dst
    return gbps


def finish_panel(ax, title: str, xlabel: str, ylabel: str) -> None:
    """A latency panel's title, axis labels, log scale and grid (BM5's and
    BM6's plots)."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)


def save_panels(fig, axes, path: str) -> None:
    """The legend on the last panel, then the figure as a PNG at `path` (its
    folder made if missing), and the figure closed."""
    import matplotlib.pyplot as plt

    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
