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
stacks the layer's routed experts and runs them in two batched matmuls;
"loop" runs one expert at a time as transformers' eager MoE does, which on a
slow host CPU makes the step Python launch time rather than GPU time. Weights are
random bf16 (never zeros); expert (layer, e) uses the bytes of one of
--pool distinct random experts, registered zero-copy from page-locked host
memory, so copies move real bytes over PCIe into distinct cache slots.
Routing comes from the model itself (inputs are fixed per step, so every
policy sees the same routing), or from --trace-in (a routing trace, see
docs/trace_format.md), which then overrides the router's choice.

Policies, one run each (fresh cache, same inputs):
  all-resident     every expert on the GPU: the compute-only step
  on-demand        engine, no prediction: misses are fetched at band 0
  next-layer-gate  engine + router of layer L+1 applied to layer L's input
  trace            engine + activation-matrix predictor trained on --train
                   other requests first
  oracle           engine + replay of the routing this request really takes,
                   with next-use hints and eviction_policy="next-use"
                   (Belady's rule: the ceiling)
  oracle-cyclic    the same prefetches, no hints, --eviction's policy
  torch-by-hand    Python copy_(non_blocking=True) per missing expert on a
                   side stream into an LRU of device slots kept in Python
Reported per run: step latency p50/p90, stall (p50 - compute-only p50), hit
rate, bytes moved, achieved GB/s, prediction precision/recall, and the IO
floor: Belady-minimum bytes for this routing and cache size over raw H2D
bandwidth measured in the same run (before and after each model's runs, the
faster of the two). Runs past --budget-s are reported null.
The engine policies use --eviction (default "cyclic", Note [Cyclic eviction]
in src_cpp/device_cache.h). --devices N splits the layers into N contiguous
runs, one per GPU, with the cache budget split by layers; the IO floor is then
the slowest device's (each device's Belady loads over its own raw bandwidth).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import OrderedDict

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import fmt, machine_info, raw_copy_gbps, write_json  # noqa: E402

MODELS = {
    "olmoe-1b-7b": dict(layers=16, experts=64, top_k=8, hidden=2048, inter=1024),
    "qwen3-30b-a3b": dict(layers=48, experts=128, top_k=8, hidden=2048, inter=768),
    # Shapes for replaying the real traces of ../shared/traces (layers and
    # experts as recorded, top-k as run there); hidden and expert widths
    # from the models' published configs, quoted, not checked here.
    "gemma4-26b-a4b": dict(layers=30, experts=128, top_k=6, hidden=2816, inter=704),
    "gpt-oss-120b": dict(layers=36, experts=128, top_k=2, hidden=2880, inter=2880),
}
POLICIES = ("all-resident", "on-demand", "next-layer-gate", "trace", "oracle", "oracle-cyclic", "torch-by-hand")
ENGINE_POLICIES = ("on-demand", "next-layer-gate", "trace", "oracle", "oracle-cyclic")


class Decoder:
    """The synthetic MoE decoder's dense weights (GPU) and expert pool.

    With `devices` > 1 the layers are split into contiguous runs, one per
    device (layer l on device l * devices // layers): each layer's dense
    weights and experts live on its device, the hidden state moves to the
    next device at a boundary, and each device has its own expert cache.
    The weights do not depend on `devices`, so routing is the same."""

    def __init__(self, torch, spec: dict, pool: int, seed: int = 0, device: str = "cuda", devices: int = 1,
                 grouped: bool = True):
        self.torch = torch
        self.grouped = grouped
        self.spec = spec
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        L, E, H, inter = spec["layers"], spec["experts"], spec["hidden"], spec["inter"]
        if not 1 <= devices <= L:
            raise ValueError(f"devices must be in 1..{L}")
        self.ndev = devices
        self.layer_dev = [layer * devices // L for layer in range(L)]
        self.devs = [torch.device("cuda", d) if self.cuda else self.device for d in range(devices)]
        g = torch.Generator(device=self.device).manual_seed(seed)
        bf16 = torch.bfloat16
        dev = self.device
        router = (torch.randn(L, E, H, device=dev, generator=g) / math.sqrt(H)).to(bf16)
        attn = (torch.randn(L, H, H, device=dev, generator=g) / math.sqrt(H)).to(bf16)
        self.router = [router[layer].to(self.devs[self.layer_dev[layer]]) for layer in range(L)]
        self.attn = [attn[layer].to(self.devs[self.layer_dev[layer]]) for layer in range(L)]
        # Residual updates stay small against the stream, as in trained
        # models: consecutive layers see similar hidden states.
        self.attn_scale = 0.1
        self.pool_gpu = [[] for _ in range(devices)]  # per device: (gate_up, down)
        self.pool_host = []  # (pinned packed buffer, layout)
        import prefetch

        for _ in range(pool):
            gate_up = (torch.randn(2 * inter, H, device=dev, generator=g) / math.sqrt(H)).to(bf16)
            down = (torch.randn(H, inter, device=dev, generator=g) / math.sqrt(inter) * 0.1).to(bf16)
            for d in range(devices):
                self.pool_gpu[d].append((gate_up.to(self.devs[d]), down.to(self.devs[d])))
            self.pool_host.append(prefetch.pack_expert({"gate_up": gate_up.cpu(), "down": down.cpu()},
                                                       pin_memory=self.cuda))
        self.expert_bytes = self.pool_host[0][1][-1].offset + self.pool_host[0][1][-1].nbytes
        self.slot_bytes = -(-self.expert_bytes // prefetch.SLOT_ALIGNMENT) * prefetch.SLOT_ALIGNMENT
        # Host seconds per phase of step() (routing sync, acquire, compute
        # launch, release) when set to a dict; None costs nothing.
        self.timers = None

    def layers_of(self, d: int) -> list:
        return [layer for layer, ld in enumerate(self.layer_dev) if ld == d]

    def device_budgets(self, budget: int) -> list:
        """A cache of `budget` bytes in all, split over the devices by their
        share of the layers, in whole slots."""
        slots = budget // self.slot_bytes
        L = self.spec["layers"]
        return [slots * len(self.layers_of(d)) // L * self.slot_bytes for d in range(self.ndev)]

    def pool_index(self, layer: int, expert: int) -> int:
        return (layer * self.spec["experts"] + expert * 7 + layer) % len(self.pool_host)

    def inputs(self, steps: int, batch: int, seed: int):
        g = self.torch.Generator(device=self.device).manual_seed(1000 + seed)
        x = self.torch.randn(steps, batch, self.spec["hidden"], device=self.device, generator=g)
        return x.to(self.torch.bfloat16)

    def sync(self):
        if self.cuda:
            for d in range(self.ndev):
                self.torch.cuda.synchronize(d)

    def stream(self, layer: int = 0):
        return self.torch.cuda.current_stream(self.devs[self.layer_dev[layer]]) if self.cuda else None

    def rms(self, x):
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def step(self, x0, provider, forced=None):
        """One decode step of every layer; returns the final hidden state.
        `forced`: per layer, expert lists to use instead of the router's."""
        torch = self.torch
        h = x0
        k = self.spec["top_k"]
        for layer in range(self.spec["layers"]):
            if h.device != self.devs[self.layer_dev[layer]]:
                h = h.to(self.devs[self.layer_dev[layer]])
            x = self.rms(h)
            h = h + (x @ self.attn[layer].T) * self.attn_scale
            x = self.rms(h)
            probs = torch.softmax((x @ self.router[layer].T).float(), dim=-1)
            top_w, top_i = torch.topk(probs, k, dim=-1)
            if forced is not None:
                allowed = torch.tensor(forced[layer], device=x.device)
                masked = torch.full_like(probs, -1.0)
                masked[:, allowed] = probs[:, allowed]
                top_w, top_i = torch.topk(masked, min(k, len(forced[layer])), dim=-1)
            top_w = (top_w / top_w.sum(-1, keepdim=True)).to(x.dtype)
            # Routing weights as a dense [batch, experts] matrix: each routed
            # expert runs on the whole batch, weighted by its (possibly zero)
            # weight, so the only host sync per layer is reading the expert
            # list the CPU needs to acquire.
            dense = torch.zeros(x.shape[0], self.spec["experts"], dtype=x.dtype, device=x.device)
            dense.scatter_(1, top_i, top_w)
            routed = torch.unique(top_i)  # sorted; stays on the GPU for indexing
            timers = self.timers
            if timers is not None:
                t0 = time.perf_counter()
            experts = routed.tolist()
            if timers is not None:
                t1 = time.perf_counter()
            weights = provider.acquire(layer, x, experts)
            if timers is not None:
                t2 = time.perf_counter()
            if self.grouped:
                # All routed experts in two batched matmuls: far fewer kernel
                # launches than a loop, so the step is GPU time rather than
                # Python time. Stacking copies the weights device-to-device.
                gate_up = torch.stack([w[0] for w in weights])  # [n, 2I, H]
                down = torch.stack([w[1] for w in weights])  # [n, H, I]
                xs = x.unsqueeze(0).expand(len(experts), -1, -1)
                gate, up = torch.bmm(xs, gate_up.transpose(1, 2)).chunk(2, dim=-1)
                y = torch.bmm(torch.nn.functional.silu(gate) * up, down.transpose(1, 2))  # [n, B, H]
                out = (y * dense.index_select(1, routed).T.unsqueeze(-1)).sum(0)
            else:
                out = torch.zeros_like(x)
                for e, (gate_up, down) in zip(experts, weights):
                    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
                    y = (torch.nn.functional.silu(gate) * up) @ down.T
                    out += y * dense[:, e : e + 1]
            if timers is not None:
                t3 = time.perf_counter()
            provider.release(layer, experts)
            h = h + out
            if timers is not None:
                t4 = time.perf_counter()
                for name, dt in (("sync", t1 - t0), ("acquire", t2 - t1), ("compute", t3 - t2),
                                 ("release", t4 - t3)):
                    timers[name] = timers.get(name, 0.0) + dt
        return h


class ResidentProvider:
    def __init__(self, dec):
        self.dec = dec
        self.trace = []  # per step, per layer experts

    def acquire(self, layer, x, experts):
        if layer == 0:
            self.trace.append([])
        self.trace[-1].append(experts)
        pool = self.dec.pool_gpu[self.dec.layer_dev[layer]]
        return [pool[self.dec.pool_index(layer, e)] for e in experts]

    def release(self, layer, experts):
        pass

    def stats(self):
        return {}


class EngineProvider:
    """Experts through the engine; prediction through prefetch.integration."""

    def __init__(self, dec, budget: int, predictor, eviction: str, handle_options=None):
        import prefetch
        from prefetch.integration import OffloadController

        self.torch = dec.torch
        self.dec = dec
        self.handle = prefetch.PrefetchHandle(device_budget_bytes=dec.device_budgets(budget),
                                              backend="cuda" if dec.cuda else "host", eviction_policy=eviction,
                                              **(handle_options or {}))
        # The gate of layer L+1 reads layer L's hidden state: across a device
        # boundary it is moved first.
        routers = [lambda x, layer=layer: x.to(dec.router[layer].device) @ dec.router[layer].T
                   for layer in range(dec.spec["layers"])]
        self.ctl = OffloadController(self.handle, num_layers=dec.spec["layers"], num_experts=dec.spec["experts"],
                                     top_k=dec.spec["top_k"], predictor=predictor, routers=routers)
        for layer in range(dec.spec["layers"]):
            for e in range(dec.spec["experts"]):
                buffer, layout = dec.pool_host[dec.pool_index(layer, e)]
                self.ctl.prefetcher.register_packed(layer, e, buffer, layout, device=dec.layer_dev[layer])

    def acquire(self, layer, x, experts):
        self.ctl.on_routed(layer, x, experts)
        got = self.ctl.prefetcher.acquire_experts(layer, experts, stream=self.dec.stream(layer))
        return [(w["gate_up"], w["down"]) for w in got]

    def release(self, layer, experts):
        self.ctl.prefetcher.release_experts(layer, experts, stream=self.dec.stream(layer))

    def stats(self):
        s = self.handle.stats()
        r = self.ctl.report()
        return {"hits": s["hits"], "misses": s["misses"], "bytes": s["bytes_copied"], "late": s["late"],
                "wasted": s["wasted"], "caller_copies": s["caller_copies"], "on_demand": s["on_demand"],
                "evictions": s["evictions"], "precision": r["prediction_precision"],
                "recall": r["prediction_recall"]}

    def close(self):
        self.handle.close()


class ByHandCache:
    """What a user writes by hand, for one device: an LRU of device slots in
    Python, a copy_(non_blocking=True) per missing expert on a side stream,
    an event per copy that the compute stream waits on, and an event per use
    so a slot is not overwritten while a kernel still reads it."""

    def __init__(self, dec, budget: int, device):
        torch = dec.torch
        self.torch = torch
        self.dec = dec
        n_slots = budget // dec.slot_bytes
        self.slots = [torch.empty(dec.expert_bytes, dtype=torch.uint8, device=device) for _ in range(n_slots)]
        self.free = list(range(n_slots))
        self.lru = OrderedDict()  # (layer, expert) -> slot
        self.ready = {}  # slot -> event (copy done)
        self.used = {}  # slot -> event (last read done)
        self.side = torch.cuda.Stream(device=device) if dec.cuda else None
        self.layout = dec.pool_host[0][1]
        self.hits = self.misses = self.bytes = 0

    def _views(self, slot):
        raw = self.slots[slot]
        out = []
        for part in self.layout:
            out.append(raw[part.offset : part.offset + part.nbytes].view(part.dtype).view(part.shape))
        return tuple(out)

    def acquire(self, layer, experts, compute):
        torch = self.torch
        cuda = self.dec.cuda
        result = []
        busy = {self.lru[(layer, e)] for e in experts if (layer, e) in self.lru}
        for e in experts:
            key = (layer, e)
            if key in self.lru:
                self.hits += 1
                self.lru.move_to_end(key)
                slot = self.lru[key]
            else:
                self.misses += 1
                if self.free:
                    slot = self.free.pop()
                else:
                    victim = next(k for k, s in self.lru.items() if s not in busy)
                    slot = self.lru.pop(victim)
                    if cuda:
                        self.side.wait_event(self.used[slot])
                src = self.dec.pool_host[self.dec.pool_index(layer, e)][0]
                if cuda:
                    with torch.cuda.stream(self.side):
                        self.slots[slot].copy_(src, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(self.side)
                    self.ready[slot] = ev
                else:
                    self.slots[slot].copy_(src)
                self.lru[key] = slot
                busy.add(slot)
                self.bytes += self.dec.expert_bytes
            if cuda:
                compute.wait_event(self.ready[slot])
            result.append(self._views(slot))
        return result

    def release(self, layer, experts, compute):
        if not self.dec.cuda:
            return
        for e in experts:
            slot = self.lru[(layer, e)]
            ev = self.torch.cuda.Event()
            ev.record(compute)
            self.used[slot] = ev


class ByHandProvider:
    """One ByHandCache per device; a layer uses its device's."""

    def __init__(self, dec, budget: int):
        self.dec = dec
        self.caches = [ByHandCache(dec, b, dev) for b, dev in zip(dec.device_budgets(budget), dec.devs)]

    def acquire(self, layer, x, experts):
        return self.caches[self.dec.layer_dev[layer]].acquire(layer, experts, self.dec.stream(layer))

    def release(self, layer, experts):
        self.caches[self.dec.layer_dev[layer]].release(layer, experts, self.dec.stream(layer))

    def stats(self):
        return {"hits": sum(c.hits for c in self.caches), "misses": sum(c.misses for c in self.caches),
                "bytes": sum(c.bytes for c in self.caches), "late": None, "wasted": None,
                "precision": None, "recall": None}

    def close(self):
        for c in self.caches:
            c.slots.clear()


def raw_h2d_gbps(torch, nbytes_each: int, device, count: int = 64) -> float:
    src = torch.empty((count, nbytes_each), dtype=torch.uint8, pin_memory=True).fill_(7)
    with torch.cuda.device(device):
        dst = torch.empty((count, nbytes_each), dtype=torch.uint8, device=device)
        return statistics.median(raw_copy_gbps(torch, src, dst, [torch.cuda.Stream(device=device)], reps=3))


def make_provider(dec, policy, budget, trace, eviction="cyclic", handle_options=None):
    from prefetch.integration import NextLayerGatePredictor, OraclePredictor, RoutingTrace, TracePredictor

    spec = dec.spec
    if policy == "all-resident":
        return ResidentProvider(dec)
    if policy == "torch-by-hand":
        return ByHandProvider(dec, budget)
    predictor = None
    if policy == "next-layer-gate":
        predictor = NextLayerGatePredictor()
    elif policy == "trace":
        predictor = TracePredictor(distance=2)
    elif policy in ("oracle", "oracle-cyclic"):
        predictor = OraclePredictor(RoutingTrace(spec["layers"], spec["experts"], trace), distance=2,
                                    hints=policy == "oracle")
    return EngineProvider(dec, budget, predictor, policy_eviction(policy, eviction), handle_options)


def policy_eviction(policy: str, eviction: str) -> str:
    """The engine eviction policy a BM5 policy runs with."""
    return "next-use" if policy == "oracle" else eviction


def run_policy(torch, dec, policy, inputs, warmup, budget, trace=None, train_inputs=(), forced=None,
               eviction="cyclic"):
    """Decodes `inputs` (one tensor per step) under `policy`. Returns the
    measured step latencies (after `warmup` steps), the provider's counters
    over the measured steps, and the routing trace (all-resident only).
    `forced`: a routing trace's steps, replayed instead of the router."""

    def route(i):
        return forced[i % len(forced)] if forced else None

    provider = make_provider(dec, policy, budget, trace, eviction)
    try:
        if policy == "trace":  # learn from other requests first
            for request in train_inputs:
                for i, x in enumerate(request):
                    dec.step(x, provider, route(i))
                provider.ctl.new_sequence()
        lat = []
        before = {}
        for i, x in enumerate(inputs):
            dec.sync()
            if i == warmup:
                before = provider.stats()
                if hasattr(provider, "ctl"):  # score predictions on measured steps only
                    provider.ctl.prediction_hits = provider.ctl.predicted_total = provider.ctl.actual_total = 0
            t0 = time.perf_counter()
            dec.step(x, provider, route(i))
            dec.sync()
            if i >= warmup:
                lat.append(time.perf_counter() - t0)
        after = provider.stats()
        delta = {key: after[key] - before.get(key, 0) for key in ("hits", "misses", "bytes") if key in after}
        delta["precision"] = after.get("precision")
        delta["recall"] = after.get("recall")
        return lat, delta, getattr(provider, "trace", None)
    finally:
        if hasattr(provider, "close"):
            provider.close()


def percentile(values, q):
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def timeline(torch, dec, inputs, budget, path_png, path_json, eviction):
    """Profiles one next-layer-gate step (after a warm-up step) and plots GPU
    kernels against host-to-device copies on one time axis."""
    import tempfile

    provider = make_provider(dec, "next-layer-gate", budget, None, eviction)
    try:
        dec.step(inputs[0], provider)
        dec.sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            dec.step(inputs[1], provider)
            dec.sync()
    finally:
        provider.close()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        trace_path = f.name
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    os.unlink(trace_path)
    kernels = [(e["ts"], e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e]
    copies = [(e["ts"], e["dur"]) for e in events
              if e.get("cat") == "gpu_memcpy" and "dur" in e and "HtoD" in e.get("name", "")]
    if not kernels:
        return None
    t0 = min(t for t, _ in kernels + copies)
    summary = {"kernels": len(kernels), "copies": len(copies),
               "kernel_busy_ms": sum(d for _, d in kernels) / 1e3, "copy_busy_ms": sum(d for _, d in copies) / 1e3,
               "span_ms": (max(t + d for t, d in kernels + copies) - t0) / 1e3}
    with open(path_json, "w") as f:
        json.dump({"summary": summary, "kernels_us": [(t - t0, d) for t, d in kernels],
                   "copies_us": [(t - t0, d) for t, d in copies]}, f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 2.8))
    ax.broken_barh([((t - t0) / 1e3, max(d / 1e3, 0.002)) for t, d in kernels], (10, 8), color="tab:blue")
    ax.broken_barh([((t - t0) / 1e3, max(d / 1e3, 0.002)) for t, d in copies], (0, 8), color="tab:orange")
    ax.set_yticks([4, 14], ["H2D copies", "compute kernels"])
    ax.set_xlabel("ms since the step's first GPU activity")
    ax.set_title(f"one decode step, {dec.spec['name']}, next-layer-gate, batch {inputs.shape[1]}")
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return summary


def plot_latency(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (model, batch) in zip(axes[0], groups):
        sub = [r for r in rows if r["model"] == model and r["batch"] == batch]
        for policy in POLICIES:
            pts = sorted((r["cache_share"], r["p50_ms"]) for r in sub if r["policy"] == policy and r["p50_ms"])
            if pts:
                ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=policy)
        floors = sorted({(r["cache_share"], r["floor_ms"]) for r in sub if r.get("floor_ms")})
        if floors:
            ax.plot([f[0] * 100 for f in floors], [f[1] for f in floors], "k--", label="max(compute, IO floor)")
        ax.set_title(f"{model}, batch {batch}")
        ax.set_xlabel("GPU cache share of expert bytes (%)")
        ax.set_ylabel("step latency p50 (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--train", type=int, default=3, help="past requests the trace predictor learns from")
    parser.add_argument("--pool", type=int, default=48, help="distinct random experts behind all (layer, expert)")
    parser.add_argument("--budget-s", type=float, default=420, help="stop starting runs after this many seconds")
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
    parser.add_argument("--expert-compute", default="grouped", choices=["grouped", "loop"],
                        help="routed experts in two batched matmuls, or one expert at a time")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="tiny shapes on the CPU with the host backend: checks the logic, measures nothing")
    args = parser.parse_args(argv)

    import torch

    if args.smoke_cpu:
        return smoke_cpu(torch, args)
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < args.devices:
        print(f"BM5 needs {args.devices} CUDA device(s), found {found}: not measured", file=sys.stderr)
        report = {"benchmark": "BM5 e2e", "machine": machine_info(), "devices": args.devices, "rows": None}
        if args.json:
            write_json(args.json, report)
        return 1
    from prefetch.integration import RoutingTrace, belady_misses

    forced_trace = RoutingTrace.load(args.trace_in) if args.trace_in else None
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
            lat_res, _, trace = run_policy(torch, dec, "all-resident", inputs, args.warmup, 0, forced=forced)
            compute_p50 = statistics.median(lat_res)
            if args.trace_out:
                os.makedirs(args.trace_out, exist_ok=True)
                RoutingTrace(spec["layers"], spec["experts"], trace).save(
                    os.path.join(args.trace_out, f"trace_{name}_b{batch}.json"))
            used = [len(set(e)) for step in trace[args.warmup:] for e in step]
            batch_rows = []
            for share in args.shares:
                budget = int(share * total) // dec.slot_bytes * dec.slot_bytes
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
                for policy in args.policies:
                    row = {"model": name, "batch": batch, "cache_share": share, "policy": policy,
                           "devices": args.devices, "eviction": policy_eviction(policy, args.eviction),
                           "budget_gib": budget / 2**30, "compute_only_ms": compute_p50 * 1e3,
                           "io_floor_ms": io_floor_s * 1e3, "floor_ms": floor_s * 1e3,
                           "raw_h2d_gbps": raw, "raw_h2d_gbps_each": raw_each,
                           "belady_bytes_per_step_each": belady_bytes,
                           "experts_per_layer_mean": statistics.mean(used),
                           "p50_ms": None, "p90_ms": None}
                    batch_rows.append(row)
                    if time.monotonic() - started > args.budget_s:
                        row["note"] = "not measured: time budget spent"
                        rows.append(row)
                        continue
                    if policy == "all-resident":
                        lat, delta = lat_res, {"hits": None, "misses": None, "bytes": 0}
                    else:
                        lat, delta, _ = run_policy(torch, dec, policy, inputs, args.warmup, budget, trace, train,
                                                   forced=forced, eviction=args.eviction)
                    total_s = sum(lat)
                    acquired = (delta.get("hits") or 0) + (delta.get("misses") or 0)
                    row.update({
                        "p50_ms": statistics.median(lat) * 1e3,
                        "p90_ms": percentile(lat, 0.9) * 1e3,
                        "stall_ms": (statistics.median(lat) - compute_p50) * 1e3,
                        "hit_rate": delta["hits"] / acquired if acquired else None,
                        "bytes_moved": delta.get("bytes"),
                        "achieved_gbps": (delta.get("bytes") or 0) / total_s / 1e9 if total_s else None,
                        "precision": delta.get("precision"),
                        "recall": delta.get("recall"),
                        "over_floor": statistics.median(lat) / floor_s,
                    })
                    rows.append(row)
                    print(f"  {name} b{batch} {share:.0%} {policy:<16} p50 {row['p50_ms']:8.2f} ms "
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
        del dec
        torch.cuda.empty_cache()
    report = {"benchmark": "BM5 e2e", "machine": machine_info(), "warmup": args.warmup, "steps": args.steps,
              "pool": args.pool, "devices": args.devices, "eviction": args.eviction,
              "expert_compute": args.expert_compute, "rows": rows,
              "timeline": timeline_summary}
    print(format_table(rows))
    if args.plots:
        plot_latency(rows, os.path.join(args.plots, "latency_vs_share.png"))
    if args.json:
        write_json(args.json, report)
    return 0


def io_floor(belady_bytes_each, raw_each) -> float:
    """Seconds per step the links need at least: per device, Belady's bytes
    over its raw bandwidth; devices copy in parallel, the slowest bounds."""
    return max(b / (r * 1e9) for b, r in zip(belady_bytes_each, raw_each))


def settle_raw(model_rows, raw_first, raw_second):
    """Sets each device's raw bandwidth to the faster of its two
    measurements and recomputes the IO floor, floor and x-floor."""
    best = [max(a, b) for a, b in zip(raw_first, raw_second)]
    for row in model_rows:
        row["raw_h2d_gbps_runs_each"] = [list(raw_first), list(raw_second)]
        row["raw_h2d_gbps_each"] = best
        row["raw_h2d_gbps"] = sum(best)
        row["io_floor_ms"] = io_floor(row["belady_bytes_per_step_each"], best) * 1e3
        set_floor(row)


def set_floor(row):
    """floor = max(compute-only, IO floor), and x-floor where the row ran."""
    row["floor_ms"] = max(row["compute_only_ms"], row["io_floor_ms"])
    if row["p50_ms"] is not None:
        row["over_floor"] = row["p50_ms"] / row["floor_ms"]


def settle_compute_only(batch_rows, lat_first, lat_second):
    """Sets the compute-only step of one model and batch to the faster of
    its two all-resident runs, and the floor, stall and x-floor of every row
    that depends on it."""
    runs = [statistics.median(lat_first), statistics.median(lat_second)]
    best = lat_first if runs[0] <= runs[1] else lat_second
    compute_ms = min(runs) * 1e3
    for row in batch_rows:
        row["compute_only_ms"] = compute_ms
        row["compute_only_runs_ms"] = [r * 1e3 for r in runs]
        if row["p50_ms"] is not None:
            if row["policy"] == "all-resident":
                row["p50_ms"] = statistics.median(best) * 1e3
                row["p90_ms"] = percentile(best, 0.9) * 1e3
            row["stall_ms"] = row["p50_ms"] - compute_ms
        set_floor(row)


def smoke_cpu(torch, args) -> int:
    """Every policy on tiny shapes on the CPU (host backend): the outputs of
    every policy must equal all-resident's, bit for bit. No figures."""
    spec = dict(layers=3, experts=8, top_k=2, hidden=16, inter=8, name="smoke")
    dec = Decoder(torch, spec, pool=5, device="cpu", devices=args.devices, grouped=args.expert_compute == "grouped")
    inputs = dec.inputs(4, 2, seed=0)
    outs = {}
    trace = None
    for policy in POLICIES:
        budget = 6 * dec.slot_bytes * args.devices  # every device holds a whole layer's experts
        provider = make_provider(dec, policy, budget, trace, args.eviction)
        try:
            if policy == "trace":
                for x in dec.inputs(4, 2, seed=1):
                    dec.step(x, provider)
                provider.ctl.new_sequence()
            outs[policy] = [dec.step(x, provider) for x in inputs]
            if policy == "all-resident":
                trace = provider.trace
        finally:
            if hasattr(provider, "close"):
                provider.close()
    for policy, out in outs.items():
        for a, b in zip(out, outs["all-resident"]):
            if not torch.equal(a, b):
                print(f"smoke: {policy} differs from all-resident", file=sys.stderr)
                return 1
    print(f"smoke ok ({args.devices} device(s), {args.expert_compute}): " + ", ".join(outs))
    return 0


def format_table(rows) -> str:
    head = (f"{'model':<14}{'b':>3}{'share':>6}  {'policy':<16}{'p50 ms':>9}{'p90 ms':>9}{'stall':>8}"
            f"{'hit':>6}{'GB moved':>9}{'GB/s':>7}{'prec':>6}{'recall':>7}{'floor':>8}{'x floor':>8}")
    lines = [head]
    for r in rows:
        gb = None if r.get("bytes_moved") is None else r["bytes_moved"] / 1e9
        lines.append(
            f"{r['model']:<14}{r['batch']:>3}{r['cache_share']:>6.0%}  {r['policy']:<16}{fmt(r['p50_ms']):>9}"
            f"{fmt(r['p90_ms']):>9}{fmt(r.get('stall_ms')):>8}{fmt(r.get('hit_rate')):>6}{fmt(gb):>9}"
            f"{fmt(r.get('achieved_gbps'), 1):>7}{fmt(r.get('precision')):>6}{fmt(r.get('recall')):>7}"
            f"{fmt(r['floor_ms']):>8}{fmt(r.get('over_floor')):>8}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
